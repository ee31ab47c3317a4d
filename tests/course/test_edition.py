"""The student edition (course.authoring.edition) and the grading sandbox that mounts it.

- no file of the edition holds a line found only in the body of a reference it stubs;
- a stub raises "Lab NN asks you to write this" by every import route (a fresh import, a
  reload, the module's file run under another name), kernels when launched or called, and
  every module of the edition imports (constants a stub would compute are written out);
- `--through` releases exactly the labs up to it, a name several labs list goes with the lab
  that writes it, and a bad `--through` or OUT is refused before anything is written;
- the edition passes `course check` with every lab's solution, and fails with a release (slow);
- in the grading sandbox, a learner who drops the packages and imports them again gets stubs.
"""

from __future__ import annotations

import ast
import inspect
import json
import os
import shutil
import subprocess
import sys
import textwrap
from collections import Counter
from fnmatch import fnmatch
from pathlib import Path

import nbformat
import pytest

from course.authoring.build import lab_names, source_notebook
from course.authoring.edition import (
    EDITION_FILE,
    SKIPPED,
    STUDENT_PATHS,
    build_edition,
    grading_src,
    lab_called,
    stub_module,
    stubbed,
    writers,
)
from course.grader.sandbox import Sandbox
from course.notebook import mine
from course.notebook.harness import resolve
from labkit.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
LABS = lab_names(ROOT)
# labs whose notebooks import triton (its wheels are Linux-only)
KERNEL_LABS = [lab for lab in LABS
               if "import triton" in (ROOT / "solutions" / f"{lab}.py").read_text()]
MIN_LINE = 16            # shorter body lines (`return out`) say nothing of an answer


@pytest.fixture(scope="module")
def edition(tmp_path_factory) -> Path:
    """The edition with nothing released: every lab's references are stubs."""
    out = tmp_path_factory.mktemp("student") / "edition"
    build_edition(ROOT, out)
    return out


def run_in(edition: Path, *args: str) -> subprocess.CompletedProcess:
    """`python *args` in the edition, its packages the edition's (as its own venv has them)."""
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          cwd=edition, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(edition / "src")})


# ------------------------------------------------------------------------- no body on disk


def _files(root: Path) -> dict[str, list[str]]:
    """{relative path: stripped lines} of the text files of a repository's STUDENT_PATHS (a
    notebook's lines are its cells')."""
    found = {}
    for name in STUDENT_PATHS:
        paths = [root / name] if (root / name).is_file() else sorted((root / name).rglob("*"))
        for path in paths:
            rel = path.relative_to(root)
            if not path.is_file() or path.stat().st_size > 4 << 20 or any(
                    fnmatch(part, pattern) for part in rel.parts for pattern in SKIPPED):
                continue
            try:
                text = path.read_text(encoding="utf-8")
            except UnicodeDecodeError:
                continue
            if path.suffix == ".ipynb":
                text = "\n".join(c.source for c in nbformat.reads(text, as_version=4).cells)
            found[str(rel)] = [line.strip() for line in text.splitlines()]
    return found


def _body(path: str) -> tuple[str, range, list[str]]:
    """(file relative to the checkout, its line numbers, the code lines of its body: no
    header, decorator, signature or docstring) of a stubbed object's real source."""
    obj = resolve(path)
    obj = getattr(obj, "fn", obj)                   # a Triton kernel: its Python function
    lines, start = inspect.getsourcelines(obj)
    file = Path(inspect.getsourcefile(obj)).resolve().relative_to(ROOT)
    tree = ast.parse(textwrap.dedent("".join(lines)))
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            skip |= set(range(node.lineno, node.body[0].lineno))          # header, signature
            skip |= {d.lineno for d in node.decorator_list}
            doc = node.body[0]
            if isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant):
                skip |= set(range(doc.lineno, doc.end_lineno + 1))
    body = [line.strip() for i, line in enumerate(lines, 1) if i not in skip]
    return str(file), range(start, start + len(lines)), body


def distinctive_lines() -> dict[str, set[str]]:
    """{dotted path: lines of its body found nowhere in the checkout's student files but in the
    bodies of the objects an edition with nothing released stubs}."""
    files = _files(ROOT)
    bodies = {path: _body(path) for path in stubbed(None)}
    inside = {(file, i) for file, lines, _ in bodies.values() for i in lines}
    outside = Counter(line for file, lines in files.items()
                      for i, line in enumerate(lines, 1) if (file, i) not in inside)
    return {path: {line for line in body if len(line) >= MIN_LINE and not line.startswith("#")
                   and not outside[line]} for path, (_, _, body) in bodies.items()}


def test_no_file_of_the_edition_holds_the_body_of_a_stubbed_reference(edition):
    distinctive = distinctive_lines()
    assert sum(map(len, distinctive.values())) > 500, "too few lines to look for"
    found = [f"{path}: {line!r} in {file}" for file, lines in _files(edition).items()
             for line in set(lines) for path, body in distinctive.items() if line in body]
    assert found == [], "the edition holds lines of bodies it stubs:\n" + "\n".join(found[:20])
    record = json.loads((edition / EDITION_FILE).read_text())
    assert record == {"through": None, "stubbed": stubbed(None)}
    assert not (edition / "solutions").exists() and not (edition / "build").exists()
    assert not list(edition.rglob("__pycache__")) and not list(edition.rglob("*.egg-info"))


# ------------------------------------------------------------------------ stubs that raise

ROUTES = r"""
import importlib, importlib.util, sys, torch
def raises(f, lab):
    try:
        f()
    except NotImplementedError as e:
        assert f"Lab {lab} asks you to write this" in str(e), e
        return
    raise AssertionError(f"{f} did not raise")
import miniquant, miniquant.intquant as iq
raises(lambda: miniquant.quantize_absmax_int8(torch.ones(3)), "01")
for name in [m for m in sys.modules if m.split(".")[0] == "miniquant"]:
    del sys.modules[name]
import miniquant.intquant
raises(lambda: miniquant.intquant.quantize_absmax_int8(torch.ones(3)), "01")
raises(lambda: importlib.reload(miniquant.intquant).round_to_grid(torch.ones(3), torch.ones(1), 7),
       "01")
spec = importlib.util.spec_from_file_location("copy_of_intquant", iq.__file__)
copy = importlib.util.module_from_spec(spec)
spec.loader.exec_module(copy)
raises(lambda: copy.dequantize_absmax_int8(torch.ones(3, dtype=torch.int8), torch.ones(())), "01")
from miniquant.nf4 import NF4_CODE, NF4Weight
assert NF4_CODE.tolist() == [float(v) for v in sys.argv[1].split(",")], NF4_CODE
raises(lambda: NF4Weight.dequantize(None), "02")
from minituner import LoRALinear
raises(lambda: LoRALinear(torch.nn.Linear(4, 4)), "04")
from minigpt import CharTokenizer
raises(lambda: CharTokenizer().encode("add:1+1="), "00")
import labkit
raises(lambda: labkit.sha256_state_dict({}), "00")
from miniquant.triton_env import triton_installed
if triton_installed():
    from miniquant import dequant_kernel
    raises(lambda: dequant_kernel._nf4_dequant_kernel[(1,)](torch.ones(1)), "03")
    raises(lambda: dequant_kernel._nf4_dequant_kernel(torch.ones(1)), "03")
import pkgutil
for package in ("miniquant", "minimoe", "minigpt", "minituner", "minirl", "gpucompile",
                "labkit"):
    root = importlib.import_module(package)
    assert root.__file__.startswith(sys.argv[2]), root.__file__
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if info.name.endswith(("_kernel", "kernels")) and not triton_installed():
            continue
        importlib.import_module(info.name)
print("every route raised")
"""


@pytest.mark.slow
def test_a_stub_raises_by_every_import_route(edition):
    from miniquant.nf4 import NF4_CODE

    proc = run_in(edition, "-c", ROUTES, ",".join(map(repr, NF4_CODE.tolist())),
                  str(edition / "src"))
    assert proc.returncode == 0 and "every route raised" in proc.stdout, proc.stderr[-3000:]


KERNELS = """import triton


def _body(x):
    y = x * 2 + 17
    return y


_kernel = triton.jit(_body)


@triton.jit
def _other(x, BLOCK: triton.language.constexpr):
    z = x + 41
"""


def test_the_editions_sources_pass_the_projects_linter(edition):
    """A stub leaves no import unused and no line too long: learners read these files."""
    ruff = Path(sys.executable).with_name("ruff")
    if not ruff.exists():
        pytest.skip("ruff is not installed beside this Python")
    proc = subprocess.run([str(ruff), "check", "src", "--config", str(ROOT / "pyproject.toml"),
                           "--output-format", "concise"], capture_output=True, text=True,
                          cwd=edition)
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_a_kernel_stub_raises_when_launched_or_called(tmp_path, monkeypatch):
    file = tmp_path / "kernels.py"
    file.write_text(KERNELS)
    stub_module(file, "kernels", {"_kernel": ("kernels._kernel", "08-x"),
                                  "_other": ("kernels._other", "09-y")})
    text = file.read_text()
    assert "x * 2 + 17" not in text and "x + 41" not in text, text
    assert text.count("class _Unreleased") == 1 and "def _body(x):" in text
    fake = type(sys)("triton")
    fake.jit, fake.language = (lambda fn: fn), type(sys)("language")
    fake.language.constexpr = int
    monkeypatch.setitem(sys.modules, "triton", fake)
    space = {}
    exec(compile(text, str(file), "exec"), space)
    for call, lab in ((lambda: space["_kernel"][(1,)](1), "08"),
                      (lambda: space["_kernel"](1), "08"), (lambda: space["_body"](1), "08"),
                      (lambda: space["_other"][(4,)](1), "09")):
        with pytest.raises(NotImplementedError, match=f"Lab {lab} asks you to write this"):
            call()
    assert space["__unreleased__"] == {"_kernel": "08-x", "_other": "09-y"}


# ----------------------------------------------------------------------------- releasing


def test_through_releases_exactly_the_labs_up_to_it():
    every = stubbed(None)
    for through in LABS:
        kept = stubbed(through)
        assert set(kept) == {p for p, lab in every.items() if lab > through}, through
        assert all(lab > through for lab in kept.values()), through
    owner = writers()
    # listed by 02, 03 and 10 (to switch it off), written in 02
    assert owner["miniquant.nf4.dequantize_nf4"] == "02-nf4"
    # listed by 07, 08 and 09, written in 09 (minimoe.WRITTEN); GIVEN in 10
    assert owner["minimoe.parallel_experts.parallel_linear"] == "09-moe-backward-kernels"
    assert "minimoe.parallel_experts.parallel_linear" in stubbed("08-moe-forward-kernel")
    # graded: what the lab switches off is a stub too, but what it gives to build on
    graded = stubbed("09-moe-backward-kernels", graded="10-moe-lora")
    assert graded["miniquant.nf4.dequantize_nf4"] == "10-moe-lora"
    assert "minimoe.kernels._scatter2scatter_kernel" not in graded
    assert "minimoe.parallel_experts.parallel_linear" not in graded


def test_the_edition_through_a_lab_keeps_its_bodies(tmp_path):
    out = tmp_path / "student"
    build_edition(ROOT, out, through="02")
    nf4 = (out / "src" / "miniquant" / "nf4.py").read_text()
    assert "packed, absmax = _quantize_codes(w.reshape(-1), blocksize)" in nf4
    assert "__unreleased__" not in nf4
    launcher = (out / "src" / "miniquant" / "triton_dequant.py").read_text()
    assert "Lab 03 asks you to write this" in launcher
    assert json.loads((out / EDITION_FILE).read_text())["through"] == "02-nf4"
    build_edition(ROOT, out, through="03-triton-dequant")        # over an earlier edition
    assert "Lab 03 asks" not in (out / "src" / "miniquant" / "triton_dequant.py").read_text()
    assert [p.name for p in tmp_path.iterdir()] == ["student"]   # no temporary folder left


@pytest.mark.parametrize("through", ["99", "nf4", "2"])
def test_a_bad_through_is_refused(tmp_path, through):
    with pytest.raises(InputError, match=f"--through must name a lab, by number or name, "
                                         f"e.g. 00 or 00-setup-minigpt; got '{through}'"):
        build_edition(ROOT, tmp_path / "e", through)
    assert not (tmp_path / "e").exists()
    assert lab_called("02", LABS) == lab_called("02-nf4", LABS) == "02-nf4"


def test_a_folder_that_is_no_edition_is_never_written_over(tmp_path):
    (tmp_path / "mine.txt").write_text("a learner's file")
    with pytest.raises(InputError, match="is not an earlier student edition"):
        build_edition(ROOT, tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["mine.txt"]
    with pytest.raises(InputError, match="inside the course's own files"):
        build_edition(ROOT, ROOT / "labs" / "student")


@pytest.mark.slow
def test_the_command_says_what_is_wrong(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "course", "edition", str(tmp_path / "e"),
                           "--root", str(ROOT), "--through", "99"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "--through must name a lab" in proc.stderr, proc.stderr


# ------------------------------------------------------------------- the capstone's pieces


def test_use_names_a_piece_whose_reference_is_a_stub(tmp_path, monkeypatch, capsys):
    import miniquant.nf4

    monkeypatch.delenv("NBGRADER_EXECUTION", raising=False)
    monkeypatch.setattr(miniquant.nf4, "__unreleased__", {"quantize_nf4": "02-nf4"},
                        raising=False)
    with mine.use("mine", root=tmp_path) as choices:
        pass
    quantize = next(c for c in choices if c.piece.startswith("NF4 quantize"))
    assert quantize.stub == "02-nf4" and not quantize.yours
    line = next(s for s in capsys.readouterr().out.splitlines() if "NF4 quantize" in s)
    assert "stub 02" in line and "Lab 02 asks you to write it" in line, line
    assert all(not c.stub for c in choices if c is not quantize)


# ------------------------------------------------------------------ checks in the edition


@pytest.mark.notebooks
@pytest.mark.parametrize("lab", LABS)
def test_the_edition_passes_check_with_the_solution_and_fails_with_the_release(tmp_path, lab):
    """Released through the lab before: a learner's finished lab passes its visible tests
    (they compare with known answers, outside libraries or loops of their own, never with
    a reference the edition stubs), and the blank release (two labs: the rest is
    test_notebooks' release check) passes none."""
    if lab in KERNEL_LABS:
        pytest.importorskip("triton")
    before = LABS[LABS.index(lab) - 1] if LABS.index(lab) else None
    out = tmp_path / "edition"
    build_edition(ROOT, out, through=before)
    notebook = tmp_path / f"{lab}.ipynb"
    nbformat.write(source_notebook(ROOT / "solutions" / f"{lab}.py"), notebook)
    solved = run_in(out, "-m", "course", "check", lab, "--notebook", str(notebook))
    assert solved.returncode == 0, solved.stdout[-3000:] + solved.stderr[-3000:]
    if lab in ("00-setup-minigpt", "03-triton-dequant"):
        blank = run_in(out, "-m", "course", "check", lab)      # labs/: the blank release
        assert blank.returncode == 1 and "PASS" not in blank.stdout, blank.stdout[-3000:]


# ---------------------------------------------------------------------- grading sandbox

ATTACK = r"""
import hashlib, sys, torch
for name in [m for m in sys.modules if m.split(".")[0] in ("miniquant", "labkit")]:
    del sys.modules[name]
import labkit, miniquant
print(miniquant.__file__)
try:
    miniquant.quantize_symmetric_per_group(torch.ones(8), 4, 4)
except NotImplementedError as e:
    print("stub:", e)
body = "levels = NF4_BYTE_LEVELS.to(q.device)" in open(miniquant.nf4.__file__).read()
print("Lab 02's body" if body else "no body of Lab 02")
print("Lab 00 released:", labkit.sha256_state_dict({}) == hashlib.sha256().hexdigest())
"""


def test_the_sandbox_mounts_the_src_it_is_given():
    edition = Path("/tmp/edition-src")
    args = Sandbox(ROOT, src=edition).command(["python"], Path("/tmp/p"), 0)
    assert ["--ro-bind", str(edition), str(ROOT / "src")] == args[args.index(str(edition)) - 1:
                                                                   args.index(str(edition)) + 2]
    assert str(edition) not in Sandbox(ROOT, unsafe=True, src=edition).command(
        ["python"], Path("/tmp/p"), 0)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
def test_a_learner_importing_the_packages_again_in_the_sandbox_gets_stubs(tmp_path):
    src = grading_src(ROOT, tmp_path / "edition", "01-quant-basics")
    sandbox = Sandbox(ROOT.resolve(), src=src)
    private = tmp_path / "private"
    private.mkdir()
    sandbox.prepare(private, 0)
    proc = subprocess.run(sandbox.command([sys.executable, "-c", ATTACK], private, 0),
                          capture_output=True, text=True, timeout=300, env={})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert lines[0] == str(ROOT.resolve() / "src" / "miniquant" / "__init__.py"), lines
    assert lines[1].startswith("stub: Lab 01 asks you to write this"), lines
    assert lines[2:] == ["no body of Lab 02", "Lab 00 released: True"], lines
    # a venv that imports the packages from elsewhere would bypass what is mounted: refused
    with pytest.raises(InputError, match=f"finds the course packages (nowhere|in .*), not in "
                                         f"{tmp_path / 'src'}: install the course editable"):
        Sandbox(tmp_path).check()
    assert "levels = NF4_BYTE_LEVELS.to(q.device)" in (ROOT / "src/miniquant/nf4.py").read_text()
