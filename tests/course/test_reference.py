"""What the labs rebuild is named by the packages (their REFERENCE tables), not by the labs.

- every REFERENCE table's labs exist and each of its paths resolves (kernels included);
- a lab source names no private attribute of a course package (`minimoe.kernels._x`), so
  moving code in src/ changes a table there, never a lab;
- the lists a test forbids live in locked cells, never in a cell the learner edits.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import jupytext
import pytest

from course.notebook.harness import REFERENCE_PACKAGES, reference, resolve

ROOT = Path(__file__).resolve().parents[2]
SOURCES = sorted((ROOT / "solutions").glob("[0-9][0-9]-*.py"))
LABS = [p.stem for p in SOURCES]
PACKAGES = "|".join(("miniquant", "minimoe", "minigpt", "minituner", "minirl", "gpucompile",
                     "labkit", "course"))
PRIVATE = [
    re.compile(rf"\b(?:{PACKAGES})(?:\.[A-Za-z]\w*)*\._[A-Za-z]\w*"),          # pkg.mod._x
    re.compile(rf"from (?:{PACKAGES})[\w.]* import [^\n]*\b_[A-Za-z]\w*"),    # import _x
    re.compile(rf"\((?:{PACKAGES})[\w.]*, \"_[A-Za-z]\w*\"\)"),               # (pkg, "_x")
]
# A forbid list is defined (`_REFERENCE = ...`) or used (`forbid(...)`) in its cell.
FORBID_LIST = re.compile(r"^_[A-Z][A-Z_]{2,} = (?:\[|\(|list\(|tuple\(|.*reference\()|\bforbid\(",
                         re.MULTILINE)


def private_names(text: str) -> list[str]:
    return sorted({m.group(0) for rx in PRIVATE for m in rx.finditer(text)})


def unlocked_forbid_cells(path: Path) -> list[int]:
    """Indices of code cells a learner can edit that define or use a forbid list."""
    cells = jupytext.read(path).cells
    return [i for i, c in enumerate(cells) if c.cell_type == "code"
            and not c.metadata.get("nbgrader", {}).get("locked", False)
            and FORBID_LIST.search(c.source)]


@pytest.mark.parametrize("package", REFERENCE_PACKAGES)
def test_each_reference_table_names_labs_and_resolves(package):
    table = importlib.import_module(package).REFERENCE
    assert set(table) <= set(LABS), f"{package}.REFERENCE names labs that do not exist: " \
        f"{sorted(set(table) - set(LABS))}"
    for lab, names in table.items():
        for name, path in names.items():
            assert path.startswith(package + "."), f"{package}.REFERENCE[{lab!r}][{name!r}] " \
                f"= {path!r} is not in {package}"
            assert callable(resolve(path)) or isinstance(resolve(path), property), \
                f"{package}.REFERENCE[{lab!r}][{name!r}] = {path!r} is not a function, class " \
                "or kernel"


def test_reference_merges_the_packages_and_refuses_an_unknown_lab():
    merged = reference("10-moe-lora")
    assert {"dequantize_nf4", "scatter2scatter_lora", "scatter2scatter_kernel"} <= set(merged)
    with pytest.raises(ValueError, match="no package names what lab '99-nothing' rebuilds"):
        reference("99-nothing")


@pytest.mark.parametrize("source", SOURCES, ids=LABS)
def test_a_lab_names_no_private_attribute(source):
    found = private_names(source.read_text(encoding="utf-8"))
    assert found == [], (
        f"{source.name} names private attributes of the course packages: {found}. Name what "
        "the lab rebuilds in the package's REFERENCE table and take it from "
        "harness.reference(lab)")


@pytest.mark.parametrize("source", SOURCES, ids=LABS)
def test_forbid_lists_live_in_locked_cells(source):
    assert unlocked_forbid_cells(source) == [], (
        f"{source.name}: code cells {unlocked_forbid_cells(source)} define or use a forbid "
        "list but a learner can edit them: move it into a locked test cell")


def test_the_checks_see_what_they_guard(tmp_path):
    assert private_names("x = minimoe.kernels._group_kernel\n"
                         "from minituner.trainer import _Run\n"
                         "y = [(gpucompile, \"_tools\")]\n") == [
        "(gpucompile, \"_tools\")", "from minituner.trainer import _Run",
        "minimoe.kernels._group_kernel"]
    assert private_names("harness.reference('08')['scatter2scatter_kernel']; _x = 1") == []
    lab = tmp_path / "07-x.py"
    lab.write_text('# %%\n_REFERENCE = [1]\n\n'
                   '# %% nbgrader={"grade": true, "grade_id": "t", "locked": true, '
                   '"points": 1, "schema_version": 3, "solution": false, "task": false}\n'
                   '_OTHER = [2]\n')
    assert unlocked_forbid_cells(lab) == [0]
