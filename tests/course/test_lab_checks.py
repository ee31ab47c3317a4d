"""What the lab sources promise about their tests, read from solutions/ (nothing runs).

    - a check that must look inside the learner's process (`in_learner`) is declared with a
      `# in-process check:` line, sits in a visible test, and such tests hold at most 15 % of
      a lab's points (docs/ARCHITECTURE.md, Tests apart from the learner's code);
    - labs/INSTRUCTORS.md lists exactly those test cells, with their points;
    - no code of a hidden chunk comes before its first `# case:` label, so a hidden failure's
      feedback names its case and nothing else;
    - each cell reads only names made where it runs: the learner's cells (ordinary and
      solution) run in one process and the tests in another, so a learner's cell cannot read
      a test's helper, and neither a learner's cell nor a test reads what only a cell tagged
      jupyter-only makes (it never runs while graded).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from course.authoring.build import jupyter_only, lab_names, source_notebook
from course.grader.tests_setup import CASE, HIDDEN, _names, meta

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


def misplaced_reads(nb) -> list[str]:
    """Cells that read a name made only where they do not run (see the module docstring)."""
    made = {"learner": set(), "test": set(), "jupyter-only": set()}
    out = []
    for i, cell in enumerate(c for c in nb.cells if c.cell_type in ("code", "markdown")):
        if cell.cell_type != "code":
            continue
        kind = ("jupyter-only" if jupyter_only(cell) else "test"
                if meta(cell).get("grade") and not meta(cell).get("solution") else "learner")
        bound, read = _names(cell.source)
        if kind != "jupyter-only":         # in Jupyter every cell ran before it
            shared = made["learner"] | (made["test"] if kind == "test" else set())
            elsewhere = (made["test"] if kind == "learner" else set()) | made["jupyter-only"]
            for name in sorted((read & elsewhere) - shared):
                where = ("a test cell (its process is not the learner's)"
                         if name in made["test"] else "a jupyter-only cell (never run)")
                out.append(f"cell {i + 1} ({cell.source.strip().splitlines()[0][:40]!r}) "
                           f"reads {name!r}, which only {where} above it makes")
        made[kind] |= bound
    return out


@pytest.mark.parametrize("lab", LABS)
def test_cells_read_names_made_where_they_run(lab):
    problems = misplaced_reads(source_notebook(ROOT / "solutions" / f"{lab}.py"))
    assert not problems, f"{lab}:\n" + "\n".join(problems)
