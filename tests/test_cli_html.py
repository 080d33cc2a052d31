"""``fedjax_fair.reports.html``: the Markdown this package writes rendered as HTML, and the
self-contained page (figures inline)."""
import base64

from fedjax_fair import reports as report
from fedjax_fair.reports import html


def test_markdown_tables_headings_and_bold_become_html():
    md = ("Title line\n\n### fair aggregation\n\n"
          + report.markdown_table(["Algorithm", "Average (%)"], [["qffl", "**61.00**"],
                                                                  ["a<b", "1.00"]])
          + "\nA note with `code`.\n")
    out = html.markdown_html(md)
    assert "<h3>fair aggregation</h3>" in out
    assert "<td class=num><b>61.00</b></td>" in out  # right-aligned columns stay numbers
    assert "<td>a&lt;b</td>" in out  # text is escaped
    assert "<code>code</code>" in out and out.count("<tr>") == 3


def test_page_inlines_existing_figures_and_the_configuration(tmp_path):
    png = tmp_path / "a.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\nfake")
    page = html.page("T <1>", "| A |\n|---|\n| x |\n", figures=[(str(png), "cap"),
                                                                (str(tmp_path / "no.png"), "")],
                     command="fedjax-fair compare", config={"k": 1})
    assert page.startswith("<!DOCTYPE html>") and "<title>T &lt;1&gt;</title>" in page
    encoded = base64.b64encode(png.read_bytes()).decode()
    assert f"data:image/png;base64,{encoded}" in page and page.count("<img") == 1
    assert "fedjax-fair compare" in page and "&quot;k&quot;: 1" not in page and '"k": 1' in page
