"""Text the grader lets out (grades.csv, the console, feedback pages), made inert.

A student's folder name, a grade_id, a file name or whatever their code printed may hold
terminal escapes (colours, a window title, a hyperlink, a cleared screen), other control
characters or bidirectional overrides that show text in another order than it is stored
(U+202A-U+202E, U+2066-U+2069). `printable` removes them, whole sequences at once:

    ESC [ params intermediates final     (CSI; also its 8-bit form U+009B)
    ESC ] P X ^ _ ... BEL or ESC \\      (OSC, DCS, SOS, PM, APC strings, payload and all)
    ESC intermediates final              (any other escape)
    C0, DEL, C1, bidi controls           (what is left, one character each)

On one line (a CSV cell, a console row) tabs and line breaks become spaces; `lines=True`
(a cell's output on a feedback page) keeps tabs and newlines and turns a lone carriage
return into a newline. The result never holds one of these characters, so a second pass
changes nothing.
"""

from __future__ import annotations

import re

_CSI = r"(?:\x1b\[|\x9b)[0-?]*[ -/]*[@-~]"
_STRING = r"(?:\x1b[\]PX^_]|[\x90\x98\x9d\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)"
_ESCAPE = r"\x1b[ -/]*[0-~]"
SEQUENCE = re.compile(f"{_CSI}|{_STRING}|{_ESCAPE}")
CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")
LINE_CONTROL = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")


def printable(text: str, lines: bool = False) -> str:
    """`text` without escape sequences, control characters or bidi overrides (see above)."""
    text = SEQUENCE.sub("", str(text))
    if lines:
        return LINE_CONTROL.sub("", text.replace("\r\n", "\n").replace("\r", "\n"))
    return CONTROL.sub("", re.sub("\r\n|[\t\n\r\x0b\x0c]", " ", text))
