"""Write one self-contained HTML report: text, tables, plots and graphs in a single file.

PNG images are embedded as base64 data URIs and SVG files inlined, so the report can be mailed
or attached to an issue alone; only ``link`` sections point at other files (relative to the
report, so the dump folder can be moved as a whole).
"""

from __future__ import annotations

import base64
import html
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["text", "table", "image", "svg", "link", "html"]
KINDS = ("text", "table", "image", "svg", "link", "html")

_CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto;
       max-width: 1200px; padding: 0 1em; color: #1c2833; line-height: 1.45; }
h1 { border-bottom: 2px solid #d5d8dc; padding-bottom: .3em; }
h2 { margin-top: 2em; border-bottom: 1px solid #e5e8e8; }
pre { background: #f4f6f7; padding: .8em 1em; border-radius: 4px; overflow-x: auto;
      font-size: 90%; }
table { border-collapse: collapse; margin: .5em 0; font-size: 90%; }
th, td { border: 1px solid #cacfd2; padding: .3em .7em; text-align: left; }
th { background: #eaeded; }
tr:nth-child(even) td { background: #f8f9f9; }
img, svg { max-width: 100%; height: auto; }
.caption { color: #566573; font-size: 90%; margin-top: .3em; }
.missing { color: #c0392b; }
nav ul { padding-left: 1.2em; }
"""
_IMAGE_TYPES = {
    ".png": "image/png",
    ".jpg": "image/jpeg",
    ".jpeg": "image/jpeg",
    ".gif": "image/gif",
}
# The XML declaration and doctype of an SVG file are not allowed inside an HTML body.
_SVG_PROLOG = re.compile(r"^\s*(<\?xml[^>]*\?>\s*)?(<!DOCTYPE[^>]*>\s*)?(<!--.*?-->\s*)*", re.S)


@dataclass
class ReportSection:
    """One section of a report, under its own heading.

    ``body`` by kind: ``text`` a string shown preformatted; ``table`` rows of cells, the first
    row the header; ``image`` the path of a PNG (or JPEG/GIF) to embed; ``svg`` the path of an
    SVG file to inline; ``link`` the path of a file to link to (or a URL); ``html`` markup
    inserted as is. Paths are as the writing process sees them (absolute or relative to its
    working directory).
    """

    heading: str
    kind: Kind
    body: str | list[list[str]]
    caption: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"report section kind {self.kind!r}: expected one of {KINDS}")
        if (self.kind == "table") != isinstance(self.body, list):
            expected = "a list of rows" if self.kind == "table" else "a string"
            raise TypeError(
                f"report section {self.heading!r} ({self.kind}): body must be {expected}"
            )


def _missing(path: Path) -> str:
    return f'<p class="missing">missing file: {html.escape(str(path))}</p>'


def _table(rows: list[list[str]]) -> str:
    if not rows:
        return "<p>(empty table)</p>"
    header = "".join(f"<th>{html.escape(str(cell))}</th>" for cell in rows[0])
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(cell))}</td>" for cell in row) + "</tr>"
        for row in rows[1:]
    )
    return f"<table><thead><tr>{header}</tr></thead><tbody>{body}</tbody></table>"


def _image(path: Path, alt: str) -> str:
    if not path.is_file():
        return _missing(path)
    mime = _IMAGE_TYPES.get(path.suffix.lower(), "image/png")
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f'<img src="data:{mime};base64,{data}" alt="{html.escape(alt)}">'


def _svg(path: Path) -> str:
    if not path.is_file():
        return _missing(path)
    return _SVG_PROLOG.sub("", path.read_text(encoding="utf-8"), count=1)


def _link(target: str, report_dir: Path) -> str:
    if "://" in target:
        href = target
    else:
        href = Path(os.path.relpath(Path(target).resolve(), report_dir)).as_posix()
    name = target if "://" in target else Path(target).name
    return f'<p><a href="{html.escape(href)}">{html.escape(name)}</a></p>'


def _section_body(section: ReportSection, report_dir: Path) -> str:
    body = section.body
    if section.kind == "table":
        assert isinstance(body, list)
        return _table(body)
    assert isinstance(body, str)
    if section.kind == "text":
        return f"<pre>{html.escape(body)}</pre>"
    if section.kind == "image":
        return _image(Path(body), section.caption or section.heading)
    if section.kind == "svg":
        return _svg(Path(body))
    if section.kind == "link":
        return _link(body, report_dir)
    return body  # html


def _anchor(index: int, heading: str) -> str:
    slug = re.sub(r"[^a-z0-9]+", "-", heading.lower()).strip("-")
    return f"s{index}-{slug}"


def write_report(
    path: str | os.PathLike[str], *, title: str, sections: list[ReportSection]
) -> None:
    """Write the sections as one self-contained HTML file at ``path``, with a contents list.

    Every heading, caption, text and table cell is HTML-escaped; only ``html`` bodies and
    inlined SVG files go in as markup. Missing image/SVG files show as a red note, not an error,
    so one failed plot does not cost the rest of the report.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    report_dir = path.parent.resolve()
    anchors = [_anchor(i, s.heading) for i, s in enumerate(sections)]
    contents = "".join(
        f'<li><a href="#{a}">{html.escape(s.heading)}</a></li>'
        for a, s in zip(anchors, sections, strict=True)
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<nav><ul>{contents}</ul></nav>" if len(sections) > 1 else "",
    ]
    for anchor, section in zip(anchors, sections, strict=True):
        parts.append(f'<section id="{anchor}"><h2>{html.escape(section.heading)}</h2>')
        parts.append(_section_body(section, report_dir))
        if section.caption:
            parts.append(f'<p class="caption">{html.escape(section.caption)}</p>')
        parts.append("</section>")
    parts.append("</body></html>")
    path.write_text("\n".join(p for p in parts if p) + "\n", encoding="utf-8")
