"""``fedjax-fair report DIR`` (fedjax_fair/cli/rebuild.py): a finished comparison's
tables, figures and report.html written again from its files, byte for byte, and the
report opened in a real headless browser."""
import json
import os
import re
import shutil
import subprocess

import numpy as np
import pytest

from fedjax_fair import cli
from helpers import CLI_TINY as TINY, png_ok

METHODS = "fedavg,qffl,afl,ditto"
OUTPUTS = ("comparison.md", "comparison.csv", "report.html", "accuracy.png",
           "client_accuracy_hist.png", "client_accuracy_ecdf.png", "lorenz.png",
           "improved_clients.png")


@pytest.fixture(scope="module")
def comparison(tmp_path_factory):
    out = tmp_path_factory.mktemp("rebuild") / "cmp"
    code = cli.main(["compare", *TINY, "--algorithms", METHODS, "--seeds", "0,1",
                     "--num-rounds", "2", "--eval-every", "1", "-o", str(out)])
    assert code == 0
    return out


def test_report_rewrites_every_table_and_figure_byte_for_byte(comparison, tmp_path, capsys):
    copy = tmp_path / "copy"  # a folder copied elsewhere, its outputs lost
    shutil.copytree(comparison, copy)
    before = {n: (comparison / n).read_bytes() for n in OUTPUTS}
    summary = json.loads((comparison / "summary.json").read_text())
    for name in OUTPUTS:
        (copy / name).unlink()
    capsys.readouterr()
    assert cli.main(["report", str(copy)]) == 0
    assert "fedavg (reference)" in capsys.readouterr().out  # the table, printed again
    for name in ("comparison.md", "comparison.csv"):
        assert (copy / name).read_bytes() == before[name], name
    for name in OUTPUTS[3:]:
        png_ok(copy / name)
    rebuilt = json.loads((copy / "summary.json").read_text())
    assert rebuilt["table"] == summary["table"] and rebuilt["command"] == summary["command"]
    assert summary["command"].startswith("fedjax-fair compare") and METHODS in summary["command"]
    # in place, the same files again
    assert cli.main(["report", str(comparison)]) == 0
    assert {n: (comparison / n).read_bytes() for n in OUTPUTS[:2]} == {
        n: before[n] for n in OUTPUTS[:2]}


def test_report_groups_methods_by_family(comparison):
    md = (comparison / "comparison.md").read_text()
    headings = re.findall(r"^### (.+)$", md, flags=re.M)
    assert headings == ["fair aggregation", "personalised"]
    assert md.count("| fedavg (reference)") == 2


def test_report_refuses_a_folder_that_no_command_wrote(tmp_path, capsys):
    assert cli.main(["report", str(tmp_path)]) == cli.EXIT_CONFIG
    assert cli.main(["report", str(tmp_path / "missing")]) == cli.EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and err.startswith("error: directory:")
    assert os.listdir(tmp_path) == []  # nothing written


def _browser():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if shutil.which(name):
            return shutil.which(name)
    pytest.skip("no Chromium here (.ci/run installs Debian's chromium)")


def _chromium(browser, profile, *args):
    return subprocess.run(
        [browser, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
         "--no-first-run", "--disable-background-networking", "--disable-component-update",
         "--disable-sync", f"--user-data-dir={profile}", "--hide-scrollbars", *args],
        capture_output=True, text=True, timeout=120, check=True)


def test_report_html_renders_tables_and_figures_in_a_headless_browser(comparison, tmp_path):
    browser = _browser()
    page = (comparison / "report.html").read_text()
    # the page's own figures, decoded by the browser: a probe copy reports them in its title
    probe = tmp_path / "probe.html"
    probe.write_text(page.replace("</body>", "<script>window.onload = () => {document.title ="
                                  " [...document.images].filter(i => i.complete && "
                                  "i.naturalWidth > 0).length + ' images ' + document."
                                  "querySelectorAll('table tr').length + ' rows';};</script>"
                                  "</body>"))
    dom = _chromium(browser, tmp_path / "p1", "--virtual-time-budget=5000", "--dump-dom",
                    probe.as_uri()).stdout
    images, rows = map(int, re.search(r"<title>(\d+) images (\d+) rows</title>", dom).groups())
    assert images == page.count("<img") >= 5
    assert rows == 2 * 2 + 2 + 1  # two families: header and FedAvg, then members
    shot = tmp_path / "shot.png"
    _chromium(browser, tmp_path / "p2", "--window-size=1400,3000", f"--screenshot={shot}",
              (comparison / "report.html").as_uri())
    from PIL import Image
    pixels = np.asarray(Image.open(shot).convert("RGB"), np.int32)
    assert pixels.shape[:2] == (3000, 1400)
    near = lambda rgb: (np.abs(pixels - np.array(rgb)).sum(-1) < 30).sum()
    assert near((242, 242, 242)) > 2000  # the tables' header cells
    assert near((31, 119, 180)) > 500  # the figures' first line colour (tab10 blue)
    assert near((0, 0, 0)) > 2000  # text and FedAvg's dashed reference


def test_report_of_a_run_folder_draws_its_figures_and_page_again(tmp_path):
    out = tmp_path / "run"
    assert cli.main(["run", *TINY, "--num-rounds", "2", "--eval-every", "1",
                     "--unseen-clients", "0.34", "-o", str(out)]) == 0
    names = sorted(n for n in os.listdir(out) if n.endswith(".png")) + ["report.html"]
    assert "accuracy.png" in names and "lorenz.png" in names
    before = {n: (out / n).read_bytes() for n in names}
    page = before["report.html"].decode()
    assert "Unseen clients (2)" in page and page.count("<img") == len(names) - 1
    for n in names:
        (out / n).unlink()
    assert cli.main(["report", str(out)]) == 0
    assert {n: (out / n).read_bytes() for n in names} == before


def test_report_refuses_a_run_that_did_not_finish(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text(json.dumps({"algorithm": "fedavg", "seed": 0}))
    assert cli.main(["report", str(out)]) == cli.EXIT_CONFIG
    assert capsys.readouterr().err.startswith("error: directory:")
