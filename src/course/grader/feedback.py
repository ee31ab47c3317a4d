"""The feedback page a student gets back: their cells, the visible tests and what each earned.

Safe to hand back: hidden tests never appear (neither their source nor anything they or the
student's code printed while they ran; a failure shows only the label of its case), and
everything the student's notebook produced is escaped text, without terminal escapes,
control characters or bidi overrides (`printable`). The only markup is ours; images
are embedded only as base64 PNG/JPEG, checked character by character. No script, no link.
"""

from __future__ import annotations

import base64
import binascii
import html

from .plan import Cell
from .printable import printable

IMAGES = ("image/png", "image/jpeg")
STYLE = """
body { font-family: sans-serif; max-width: 60em; margin: 2em auto; color: #222; }
pre { background: #f6f6f6; padding: .6em; white-space: pre-wrap; overflow-wrap: anywhere; }
.out { background: #fff; border-left: 3px solid #ccc; }
.pass { border-left: 6px solid #2a2; padding-left: .6em; }
.fail { border-left: 6px solid #c22; padding-left: .6em; }
.md { color: #555; }
"""


def _text(text: str) -> str:
    """Escaped HTML of `text`, without terminal escapes, control characters or bidi
    overrides (course.grader.printable)."""
    return html.escape(printable(text, lines=True), quote=True)


def _image(mime: str, data: object) -> str:
    """An <img> of base64 `data`, or nothing when it is not clean base64 of that type."""
    if not isinstance(data, str):
        return ""
    compact = "".join(data.split())
    try:
        raw = base64.b64decode(compact, validate=True)
    except (binascii.Error, ValueError):
        return ""
    magic = {"image/png": b"\x89PNG", "image/jpeg": b"\xff\xd8"}[mime]
    return f'<img alt="figure" src="data:{mime};base64,{compact}">' if raw.startswith(magic) else ""


def _output(o: dict) -> str:
    kind = o.get("output_type")
    if kind == "stream":
        return f'<pre class="out">{_text(str(o.get("text", "")))}</pre>'
    if kind == "error":
        tb = "\n".join(str(line) for line in o.get("traceback", []))
        return f'<pre class="out">{_text(tb or str(o.get("ename", "")))}</pre>'
    data = o.get("data", {})
    for mime in IMAGES:
        if mime in data and (img := _image(mime, data[mime])):
            return img
    return f'<pre class="out">{_text(str(data.get("text/plain", "")))}</pre>' if data else ""


def _test_header(cell: Cell) -> str:
    t = cell.test
    verdict = {"ok": "passed", "not run": "not run"}.get(cell.status)
    if verdict is None:
        # Nothing of a hidden failure's error (it can carry what the hidden test did): the
        # label the lab's author gave the case.
        verdict = (f"failed a hidden test: {_text(cell.hidden_case or 'hidden tests')}"
                   if cell.hidden_failed else "failed: " + _text(cell.error[:300]))
    css = "pass" if cell.earned else "fail"
    return (f'<h3 class="{css}">{_text(t.grade_id)}: {cell.earned:g} / {t.points:g} points, '
            f"{verdict}</h3>")


def _cell(cell: Cell) -> str:
    if cell.kind == "markdown":
        return f'<pre class="md">{_text(cell.source)}</pre>'
    head = _test_header(cell) if cell.kind == "test" else ""
    body = f"<pre>{_text(cell.source)}</pre>" + "".join(_output(o) for o in cell.outputs)
    if cell.status == "jupyter-only":
        body += ("<p><em>Not run when graded: the lab runs this cell in Jupyter only (it calls "
                 "the library's version of what you write here).</em></p>")
    if cell.kind == "test" and any(hidden for hidden, _ in cell.test.chunks):
        body += "<p><em>This test cell also runs hidden tests; they are not shown.</em></p>"
    return f'<section class="{"test" if head else "cell"}">{head}{body}</section>'


def render(student: str, lab: str, score: float, max_score: float, status: str,
           cells: list[Cell]) -> str:
    """The whole feedback page, one self-contained HTML file."""
    title = f"{_text(lab)}: {_text(student)}"
    return (f"<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\">"
            f'<meta http-equiv="Content-Security-Policy" content="default-src \'none\'; '
            f"img-src data:; style-src 'unsafe-inline'\">"
            f"<title>{title}</title><style>{STYLE}</style></head><body>"
            f"<h1>{title}</h1><p><strong>{score:g} / {max_score:g}</strong> &mdash; "
            f"{_text(status)}</p>" + "".join(_cell(c) for c in cells) + "</body></html>\n")
