"""One self-contained HTML page per output folder (``report.html``).

The page is the folder's Markdown table (``comparison.md``, ``sweep.md``, a run's
summary) rendered as HTML, the command that reproduces the folder, its figures
embedded as PNG data URIs and its configuration: one file that opens anywhere,
offline, with nothing beside it. ``markdown_html`` renders the Markdown this package
writes (``#`` headings, pipe tables, paragraphs, ``**bold**`` and ```code```), not
Markdown in general.
"""
from __future__ import annotations

import base64
import html
import json
import os
import re
from typing import Optional, Sequence

STYLE = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 2em auto;
       max-width: 1400px; padding: 0 1.5em; color: #222; }
h1 { font-size: 1.45em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
h3 { font-size: 1.05em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0 1.2em; font-size: 0.88em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; }
th { background: #f2f2f2; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafafa; }
td b { color: #0a5; }
div.wide { overflow-x: auto; } figure { margin: 1.2em 0; } figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { font-size: 0.85em; color: #555; }
pre, code { background: #f6f6f6; font-size: 0.85em; } pre { padding: 0.8em; overflow-x: auto; }
p.note { font-size: 0.85em; color: #555; }
"""


def _inline(text: str) -> str:
    """Escaped text with ``**bold**`` and ```code``` spans."""
    out = html.escape(text, quote=False)
    out = re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", out)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", out)


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def _table(lines: Sequence[str]) -> str:
    header, align = _cells(lines[0]), _cells(lines[1])
    right = [a.endswith(":") for a in align]
    head = "".join(f"<th>{_inline(c)}</th>" for c in header)
    rows = []
    for line in lines[2:]:
        cells = _cells(line)
        rows.append("<tr>" + "".join(
            f'<td{" class=num" if r else ""}>{_inline(c)}</td>' for c, r in zip(cells, right))
            + "</tr>")
    return (f'<div class="wide"><table><thead><tr>{head}</tr></thead>'
            f"<tbody>{''.join(rows)}</tbody></table></div>")


def markdown_html(text: str) -> str:
    """HTML of the Markdown subset this package writes: headings, tables, paragraphs."""
    blocks, lines = [], text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if not line.strip():
            i += 1
        elif line.startswith("#"):
            level = max(2, min(len(line) - len(line.lstrip("#")), 4))  # h1: the page's title
            blocks.append(f"<h{level}>{_inline(line.lstrip('#').strip())}</h{level}>")
            i += 1
        elif line.startswith("|"):
            j = i
            while j < len(lines) and lines[j].startswith("|"):
                j += 1
            blocks.append(_table(lines[i:j]))
            i = j
        else:
            j = i
            while j < len(lines) and lines[j].strip() and not lines[j].startswith(("#", "|")):
                j += 1
            blocks.append(f"<p>{_inline(' '.join(lines[i:j]))}</p>")
            i = j
    return "\n".join(blocks)


def figure(path: str, caption: str = "") -> str:
    """A PNG file embedded as a data URI, with its file name (and ``caption``) below."""
    with open(path, "rb") as f:
        data = base64.b64encode(f.read()).decode("ascii")
    name = os.path.basename(path)
    text = f"<code>{html.escape(name)}</code>" + (f": {_inline(caption)}" if caption else "")
    return (f'<figure><img alt="{html.escape(name)}" src="data:image/png;base64,{data}">'
            f"<figcaption>{text}</figcaption></figure>")


def page(title: str, markdown: str, *, figures: Sequence[tuple[str, str]] = (),
         command: Optional[str] = None, reproduce: Optional[str] = None,
         config: Optional[dict] = None) -> str:
    """The whole page: ``title``, the ``markdown`` (tables), how to reproduce it
    (``command`` as it was run; ``reproduce``, a command from the recorded config), the
    ``figures`` (``[(png path, caption)]``, those that exist) and the ``config``."""
    parts = [f"<h1>{_inline(title)}</h1>"]
    if command or reproduce:
        parts.append("<h2>Reproduce</h2>")
        if command:
            parts.append(f"<p>Command run:</p><pre>{html.escape(command, quote=False)}</pre>")
        if reproduce:
            parts.append(f"<p>From the recorded configuration:</p>"
                         f"<pre>{html.escape(reproduce, quote=False)}</pre>")
    parts.append(markdown_html(markdown))
    shown = [(p, c) for p, c in figures if os.path.isfile(p)]
    if shown:
        parts.append("<h2>Figures</h2>")
        parts += [figure(p, c) for p, c in shown]
    if config is not None:
        parts.append("<h2>Configuration</h2><pre>"
                     + html.escape(json.dumps(config, indent=2, default=str), quote=False)
                     + "</pre>")
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>\n"
            + "\n".join(parts) + "\n</body></html>\n")
