"""The `nearest` column of grades.csv (course.grader.similarity): each submission's nearest
source, the lab's reference or another student's, and its score, for a person to read.

On Lab 02's real release, solutions and library: the solutions with their names changed are
nearest the reference; two students, one of whom renamed the other's code, are each other's
nearest; honest work scores low; the skeleton alone has no fingerprint. The score is
copydetect's own. Hostile files are bounded and stripped. The column round-trips through
grades.csv (an old file without it still reads), and `grade` writes it without changing a
score. No kernel runs here.
"""

from __future__ import annotations

import csv
import io
import json
import re
import time
from pathlib import Path

import nbformat
import pytest

from course.authoring.build import source_notebook
from course.grader import grades_csv, grading, similarity
from course.learner import release_notebook_path

ROOT = Path(__file__).resolve().parents[2]
LAB = "02-nf4"
CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

# One student's own work, written apart from the instructor's (and no better).
ANN = {
    "nf4_indices": '''\
def nf4_indices(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes [numel], float32 absmax [ceil(numel / blocksize)]) of w, row-major."""
    x = w.flatten().to(torch.float32)
    count = x.numel()
    nblocks = math.ceil(count / blocksize)
    padded = torch.nn.functional.pad(x, (0, nblocks * blocksize - count))
    grid = padded.view(nblocks, blocksize)
    scale = grid.abs().max(dim=1).values
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    normed = (grid / safe.unsqueeze(1)).flatten()[:count]
    distance = (normed.unsqueeze(1) - CODE.unsqueeze(0)).abs()
    return distance.argmin(dim=1).to(torch.uint8), scale
''',
    "nibbles": '''\
def pack_nibbles(idx: torch.Tensor) -> torch.Tensor:
    """uint8 codes [n] -> uint8 [ceil(n/2)]: element 2i in the high nibble; odd n padded with 7."""
    codes = list(idx.flatten().tolist())
    if len(codes) % 2 == 1:
        codes.append(7)
    out = []
    for i in range(0, len(codes), 2):
        out.append(codes[i] * 16 + codes[i + 1])
    return torch.tensor(out, dtype=torch.uint8)


def unpack_nibbles(packed: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of pack_nibbles: uint8 [ceil(n/2)] -> the first n uint8 codes."""
    high = torch.div(packed, 16, rounding_mode="floor")
    low = packed % 16
    both = torch.empty(2 * packed.numel(), dtype=torch.uint8)
    both[0::2] = high
    both[1::2] = low
    return both[:n]
''',
    "nf4_dequantize": '''\
def nf4_dequantize(idx: torch.Tensor, absmax: torch.Tensor, blocksize: int, shape,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """CODE[idx] * absmax of each element's block, float32, reshaped to `shape`, then cast."""
    levels = torch.index_select(CODE, 0, idx.flatten().to(torch.int64))
    block_of = torch.arange(levels.numel()) // blocksize
    out = levels * absmax.to(torch.float32)[block_of]
    return out.reshape(shape).to(dtype)
''',
}
# Another student's own work.
BOB = {
    "nf4_indices": '''\
def nf4_indices(w: torch.Tensor, blocksize: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 codes [numel], float32 absmax [ceil(numel / blocksize)]) of w, row-major."""
    vals = w.contiguous().view(-1).float()
    codes = torch.empty(vals.numel(), dtype=torch.uint8)
    maxes = []
    start = 0
    while start < vals.numel():
        chunk = vals[start:start + blocksize]
        m = chunk.abs().max()
        maxes.append(m)
        normalized = chunk / m if m > 0 else chunk
        diffs = torch.abs(normalized[:, None] - CODE[None, :])
        codes[start:start + chunk.numel()] = torch.argmin(diffs, dim=-1).to(torch.uint8)
        start += blocksize
    return codes, torch.stack(maxes).float()
''',
    "nf4_dequantize": '''\
def nf4_dequantize(idx: torch.Tensor, absmax: torch.Tensor, blocksize: int, shape,
                   dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """CODE[idx] * absmax of each element's block, float32, reshaped to `shape`, then cast."""
    total = idx.numel()
    result = torch.zeros(total, dtype=torch.float32)
    for b in range(absmax.numel()):
        lo, hi = b * blocksize, min(total, (b + 1) * blocksize)
        result[lo:hi] = CODE[idx.view(-1)[lo:hi].long()] * absmax[b].float()
    return result.reshape(shape).to(dtype)
''',
}


def renamed(code: str, names: dict[str, str]) -> str:
    """`code` with whole-word names changed and the solution markers gone: a copy's disguise."""
    code = re.sub(r".*### (BEGIN|END) SOLUTION.*\n", "", code)
    return re.sub(r"\b(" + "|".join(names) + r")\b", lambda m: names[m.group(1)], code)


def submission(folder: Path, answers: dict[str, str]) -> Path:
    """The release notebook with the solution cells of `answers` (grade_id -> code) filled in."""
    nb = nbformat.read(release_notebook_path(ROOT, LAB), as_version=4)
    for cell in nb.cells:
        grade_id = cell.metadata.get("nbgrader", {}).get("grade_id")
        if cell.metadata.get("nbgrader", {}).get("solution") and grade_id in answers:
            cell.source = answers[grade_id]
    folder.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, folder / f"{LAB}.ipynb")
    return folder / f"{LAB}.ipynb"


@pytest.fixture(scope="module")
def lab02(tmp_path_factory):
    """(source notebook, given code, {student: notebook}) for Lab 02."""
    tmp = tmp_path_factory.mktemp("similarity")
    source = source_notebook(ROOT / "solutions" / f"{LAB}.py")
    solutions = {c.metadata.nbgrader.grade_id: c.source for c in source.cells
                 if c.cell_type == "code" and c.metadata.get("nbgrader", {}).get("solution")}
    disguise = {"flat": "v", "blocks": "chunks", "scaled": "normed", "quantiles": "qs",
                "positive": "pos", "negative": "neg", "midpoints": "mids", "full": "whole",
                "tail": "rest", "n": "count", "offset": "mu", "centred": "c"}
    friend = {"x": "data", "count": "size", "grid": "mat", "scale": "mx", "normed": "unit",
              "codes": "vals", "levels": "lv", "out": "res", "both": "pair"}
    notebooks = {
        "copier": submission(tmp / "copier", {g: renamed(c, disguise)
                                              for g, c in solutions.items()}),
        "ann": submission(tmp / "ann", ANN),
        "ann's friend": submission(tmp / "friend", {g: renamed(c, friend)
                                                    for g, c in ANN.items()}),
        "bob": submission(tmp / "bob", BOB),
        "blank": submission(tmp / "blank", {}),
    }
    release = nbformat.read(release_notebook_path(ROOT, LAB), as_version=4)
    return source, similarity.given_code(release), notebooks


def test_copies_are_nearest_their_source_and_honest_work_is_not_flagged(lab02):
    source, given, notebooks = lab02
    columns, _ = similarity.lab_columns(ROOT, LAB, source, notebooks)
    score = {s: similarity.column_score(c) for s, c in columns.items()}
    assert columns["copier"].startswith("reference ") and score["copier"] >= 0.9, \
        f"the solutions with names changed should be nearest the reference: {columns}"
    assert columns["ann"].startswith("student ann's friend ") and score["ann"] >= 0.9, \
        f"a student whose code another renamed should be nearest them: {columns}"
    assert columns["ann's friend"].startswith("student ann ") and score["ann's friend"] >= 0.9, \
        f"a student who renamed another's code should be nearest them: {columns}"
    assert score["bob"] < 0.2, f"honest work should score low against every source: {columns}"
    cells, _ = similarity.reference_cells(LAB, source)
    ref = similarity.fingerprint(cells, given)
    ann = similarity.fingerprint(similarity.student_cells(notebooks["ann"], given), given)
    assert similarity.score(ann, ref) < 0.2, "honest work should score low against the reference"


def test_the_skeleton_alone_has_no_fingerprint(lab02):
    source, given, notebooks = lab02
    release = nbformat.read(release_notebook_path(ROOT, LAB), as_version=4)
    given_cells = [c for c in release.cells if c.cell_type == "code"]
    skeleton = [c.source for c in given_cells if c.metadata.get("nbgrader", {}).get("solution")]
    tests = [c.source for c in given_cells if c.metadata.get("nbgrader", {}).get("grade")
             and not c.metadata.nbgrader.get("solution")]
    # the skeleton's cells themselves, and each with the stub left in after some code
    code = similarity.fingerprint([*skeleton, *[s + "\nx = 1" for s in skeleton]], given)
    assert code.coverage < similarity.MIN_COVERAGE, \
        "what every learner was given (signature, docstring, stub) must not count as code"
    pasted = similarity.fingerprint([t + "\nx = 1" for t in tests], given)
    assert pasted.coverage <= len(tests) * (similarity.K + len("V=1")), \
        "the release's other code (its tests, pasted and edited) counts only beside the edit"
    cells, _ = similarity.reference_cells(LAB, source)
    assert similarity.score(code, similarity.fingerprint(cells, given)) == 0
    columns, _ = similarity.lab_columns(ROOT, LAB, source, notebooks)
    assert columns["blank"] == "", f"a blank submission has nothing to compare: {columns}"


def test_the_score_is_copydetects_own_similarity():
    from copydetect import CodeFingerprint, compare_files

    given = similarity.Given(frozenset(), frozenset(), None)
    a, b = BOB["nf4_indices"], renamed(BOB["nf4_indices"], {"vals": "v"}) + "\ny = [1, 2, 3]"
    ours = similarity.score(similarity.fingerprint([a], given), similarity.fingerprint([b],
                                                                                       given))
    fa, fb = (CodeFingerprint("x.py", similarity.K, similarity.WINDOW, language="python",
                              fp=io.StringIO(t)) for t in (a, b))
    assert ours == pytest.approx(compare_files(fa, fb)[1][0]), \
        "score() must be copydetect.compare_files' similarity of the first source"


def test_hostile_files_are_bounded_and_stripped(lab02, tmp_path, monkeypatch):
    _, given, notebooks = lab02
    noise = "".join(chr(c) for c in range(0, 0x200)) + "\u202e\u2066"
    cells = [{"cell_type": "code", "source": "x = 1\n" * 400_000},                  # huge
             {"cell_type": "code", "source": ["y = 2\n" * 20_000] * 30},          # in parts
             {"cell_type": "code", "source": [noise * 20, 7, None, "\x1b[31mred"]},  # a list
             {"cell_type": "code", "source": {"not": "text"}, "metadata": []},
             {"cell_type": "code", "source": noise * 200, "metadata": {"nbgrader": 1}},
             "not a cell", 42]
    path = tmp_path / "eve" / f"{LAB}.ipynb"
    path.parent.mkdir()
    path.write_text(json.dumps({"cells": cells * 3}))
    start = time.perf_counter()
    text = similarity.student_cells(path, given)
    code = similarity.fingerprint(text, given)
    assert time.perf_counter() - start < 5, "a submission's text must be bounded"
    assert sum(map(len, text)) <= similarity.MAX_CODE_CHARS, "MAX_CODE_CHARS in all"
    assert max(map(len, text)) <= similarity.MAX_CELL_CHARS, "MAX_CELL_CHARS a cell"
    assert not any(CONTROL.search(t) for t in text), "control characters are removed"
    assert code.coverage > 0
    path.write_text(json.dumps({"cells": [{"cell_type": "code", "source": f"z{i} = {i}"}
                                          for i in range(200_000)]}))
    start = time.perf_counter()
    text = similarity.student_cells(path, given)
    assert len(text) <= similarity.MAX_CELLS and time.perf_counter() - start < 5, \
        "MAX_CELLS read of a notebook"
    monkeypatch.setattr(similarity, "MAX_NOTEBOOK_BYTES", path.stat().st_size - 1)
    assert similarity.student_cells(path, given) == [], "a file over MAX_NOTEBOOK_BYTES is not read"
    for bad in (b"\xff\xfe{", b"[1, 2]", b'{"cells": {"a": 1}}', b"[" * 100_000, b""):
        path.write_bytes(bad)
        assert similarity.student_cells(path, given) == [], f"not a notebook: {bad[:20]!r}"
    # a name holding escapes and line breaks is shown without them
    evil = "eve\x1b]8;;http://x\x07\n\u202e=cmd"
    codes = {evil: code, "copier": code}
    column = similarity.nearest("copier", codes, similarity.Code([], frozenset(), 0))
    assert column.startswith("student eve") and not CONTROL.search(column), \
        f"a name is shown without escapes or control characters: {column!r}"


def test_the_column_round_trips_and_an_old_grades_csv_still_reads(tmp_path):
    path = tmp_path / "grades.csv"
    rows = [grades_csv.GradeRow("ann", LAB, 3, 11, "graded", nearest="student bob 0.71"),
            grades_csv.GradeRow("bob", LAB, 5, 11, "graded", nearest="=HYPERLINK(1)"),
            grades_csv.GradeRow("cy", LAB, 0, 11, "not submitted")]
    grades_csv.write_csv(rows, path)
    with open(path, newline="", encoding="utf-8") as f:
        written = list(csv.DictReader(f))
    assert [r["nearest"] for r in written] == ["student bob 0.71", "'=HYPERLINK(1)", ""], \
        "grades.csv has a `nearest` column, no cell of which a spreadsheet evaluates"
    assert [(r.nearest, r.score) for r in grades_csv.read_csv(path)] == [
        ("student bob 0.71", 3), ("=HYPERLINK(1)", 5), ("", 0)], "the column reads back"
    path.write_text(f"student,lab,score,max_score,status\nann,{LAB},3,11,graded\n")
    old = grades_csv.read_csv(path)
    assert [(r.student, r.score, r.nearest) for r in old] == [("ann", 3, "")], \
        "a grades.csv written before the column reads with an empty one"


def test_grade_writes_the_column_and_changes_no_score(lab02, tmp_path, monkeypatch, capsys):
    """`grade` end to end with a stand-in for the kernels: every row keeps the score grading
    gave it, the column names each one's nearest source (a journaled row's too, on the next
    run), and the console lists the high ones."""
    _, _, notebooks = lab02
    subs = tmp_path / "subs"
    for student in ("copier", "bob", "blank"):
        (subs / student).mkdir(parents=True)
        (subs / student / f"{LAB}.ipynb").write_bytes(notebooks[student].read_bytes())
    (subs / "absent").mkdir()
    graded = []

    def grade_one(student, lab, notebook, source_nb, *args):
        graded.append(student)
        return grades_csv.GradeRow(student, lab, 7, 11, "graded")

    monkeypatch.setattr(grading, "grade_one", grade_one)
    monkeypatch.setattr(grading, "record", lambda *args: None)
    for run in range(2):
        rows = grading.grade(subs, ROOT, tmp_path / "out", course=tmp_path / "course", jobs=1,
                             unsafe_no_sandbox=True)
        by = {r.student: r for r in grades_csv.read_csv(tmp_path / "out" / "grades.csv")}
        assert {s: r.score for s, r in by.items()} == {
            "absent": 0, "blank": 7, "bob": 7, "copier": 7}, "the column never changes a score"
        assert by["copier"].nearest.startswith("reference "), \
            f"run {run}: the copier's row names the reference: {by['copier']}"
        assert by["blank"].nearest == by["absent"].nearest == "", by
        assert [r.nearest for r in rows if r.student == "copier"] == [by["copier"].nearest]
        out = capsys.readouterr().out
        assert f"  copier {LAB}: reference " in out and "  bob " not in out, \
            f"the console lists the rows at FLAG_AT or more, and only those:\n{out}"
    assert sorted(graded) == ["blank", "bob", "copier"], "the second run reused the journal"
