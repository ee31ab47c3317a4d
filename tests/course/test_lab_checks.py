"""What the lab sources promise about their tests, read from solutions/ (nothing runs).

    - a check that must look inside the learner's process (`in_learner`) is declared with a
      `# in-process check:` line, sits in a visible test, and such tests hold at most 15 % of
      a lab's points (docs/ARCHITECTURE.md, Tests apart from the learner's code);
    - labs/INSTRUCTORS.md lists exactly those test cells, with their points;
    - no code of a hidden chunk comes before its first `# case:` label, so a hidden failure's
      feedback names its case and nothing else.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from course.authoring.build import lab_names, source_notebook
from course.grader.tests_setup import CASE, HIDDEN, meta

ROOT = Path(__file__).resolve().parents[2]
LABS = lab_names(ROOT)
MAX_SHARE = 0.15
DECLARED = "# in-process check:"


def cells_of(lab: str) -> list:
    nb = source_notebook(ROOT / "solutions" / f"{lab}.py")
    return [c for c in nb.cells if meta(c).get("grade") and not meta(c).get("solution")]


def in_process(lab: str) -> dict[str, float]:
    """{grade_id: points} of the test cells with a declared in-process check."""
    return {meta(c)["grade_id"]: float(meta(c)["points"]) for c in cells_of(lab)
            if DECLARED in HIDDEN.sub("", c.source)}


@pytest.mark.parametrize("lab", LABS)
def test_in_process_checks_are_declared_visible_and_few(lab):
    for cell in cells_of(lab):
        visible = HIDDEN.sub("", cell.source)
        gid = meta(cell)["grade_id"]
        assert "in_learner(" not in "".join(m.group(1) for m in HIDDEN.finditer(cell.source)), \
            f"{lab} {gid}: in_learner in a hidden test sends its code to the learner's kernel"
        if "in_learner(" in visible:
            assert DECLARED in visible, f"{lab} {gid}: in_learner without a '{DECLARED}' line"
    total = sum(float(meta(c)["points"]) for c in cells_of(lab))
    share = sum(in_process(lab).values()) / total
    assert share <= MAX_SHARE, (f"{lab}: {share:.0%} of its points hang on in-process checks "
                                f"{sorted(in_process(lab))}; at most {MAX_SHARE:.0%}")


def test_instructors_list_every_in_process_check():
    text = (ROOT / "labs" / "INSTRUCTORS.md").read_text()
    listed = set(re.findall(r"^\| (\d\d-[\w-]+) \| `(\w+)` \| (\d+) ", text, re.MULTILINE))
    declared = {(lab, gid, f"{points:g}") for lab in LABS
                for gid, points in in_process(lab).items()}
    assert listed == declared, (f"labs/INSTRUCTORS.md lists {sorted(listed - declared)}, "
                                f"which the sources do not declare, and misses "
                                f"{sorted(declared - listed)}")


@pytest.mark.parametrize("lab", LABS)
def test_every_hidden_case_has_a_label(lab):
    for cell in cells_of(lab):
        for m in HIDDEN.finditer(cell.source):
            label = CASE.search(m.group(1))
            before = m.group(1)[:label.start()] if label else m.group(1)
            code = [line for line in before.splitlines() if line.strip()
                    and not line.lstrip().startswith("#")]
            assert not code, (f"{lab} {meta(cell)['grade_id']}: a hidden chunk runs "
                              f"{code[0].strip()[:60]!r} before any '# case:' label")
