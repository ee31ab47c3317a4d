"""Without triton (it has wheels for Linux only): every package imports and sets no environment
variable, everything that launches no Triton kernel runs, and a kernel launch or a kernel lab's
setup cell says in one line where the kernels run (`triton_env.TritonUnavailableError`).

triton is hidden from child processes by a `sitecustomize.py` on PYTHONPATH, which the notebook
kernel `make check` starts inherits too: the path finder finds no `triton` nor `triton.*`, so
`import triton` fails as on macOS and `importlib.util.find_spec("triton")` is None, as there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import nbformat
import pytest

from course.authoring.build import graded_test_cells, source_notebook
from course.authoring.exercises import failed_setup
from miniquant.triton_env import TRITON_MISSING

ROOT = Path(__file__).resolve().parents[1]
HIDE_TRITON = '''\
"""Test-only: hide triton from this process, as on a machine where it is not installed."""
import importlib.machinery
import sys


class PathFinderWithoutTriton(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] == "triton":
            return None
        return super().find_spec(fullname, path, target)


sys.meta_path[:] = [PathFinderWithoutTriton if f is importlib.machinery.PathFinder else f
                    for f in sys.meta_path]
'''
# Lab 11 trains on the PyTorch path; its Part F (the Triton path) says it is skipped.
NON_KERNEL_LABS = ["00-setup-minigpt", "01-quant-basics", "02-nf4", "04-lora",
                   "05-lora-finetune", "06-qlora-preview", "07-moe-routing",
                   "11-capstone-qlora-moe"]
KERNEL_LAB = "03-triton-dequant"
NOISE = ("running over TCP without encryption", "Failed to load CPU gemm_4bit_forward")


@pytest.fixture
def no_triton(tmp_path) -> dict[str, str]:
    """The environment of a child process without triton (and without TRITON_INTERPRET)."""
    site = tmp_path / "no_triton"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE_TRITON)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), env.get("PYTHONPATH")]))
    return env


# The child: imports, then the torch paths, then each kind of kernel launch. It prints one
# line per broken rule (naming the rule), then "done".
CHILD = '''
import importlib, importlib.util, os, pkgutil, sys
before = dict(os.environ)
assert importlib.util.find_spec("triton") is None, "the test's sitecustomize did not hide triton"
problems = []
KERNEL_MODULES = {"miniquant.dequant_kernel", "minimoe.kernels", "minirl.logprob_kernels"}

def imported(name):
    try:
        return importlib.import_module(name)
    except Exception as e:
        problems.append(f"import {name} failed without triton ({e!r}): no module imports "
                        "triton at import; the kernel modules load at the first launch")

for root in ["miniquant", "minimoe", "minigpt", "minituner", "minirl", "labkit", "gpucompile",
             "course"]:
    if package := imported(root):               # and every module below it
        for m in pkgutil.walk_packages(package.__path__, root + "."):
            if m.name not in KERNEL_MODULES:
                imported(m.name)
if dict(os.environ) != before:
    changed = sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k))
    problems.append(f"importing the packages changed the environment ({changed}): an import "
                    "sets nothing; the Triton mode is chosen at the first kernel launch")
if problems:                                    # what follows needs the packages
    print("\\n".join(problems) + "\\ndone")
    sys.exit()

import torch, miniquant, minimoe, minirl
from minigpt import MiniGPT, MiniGPTConfig
from minituner import wrap_lora
from minituner.qlora import wrap_minigpt_qlora
from miniquant.triton_env import TRITON_MISSING, TritonUnavailableError
from course.notebook.harness import require_triton

def step(model, what):
    """A forward and backward on 2 x 8 tokens; every gradient finite."""
    try:
        gen = torch.Generator().manual_seed(0)
        ids = torch.randint(0, model.config.vocab_size, (2, 8), generator=gen)
        model(ids).float().square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert grads and all(g is not None and g.isfinite().all() for g in grads), "bad gradients"
    except Exception as e:
        problems.append(f"{what} failed without triton ({e!r}): it launches no Triton kernel")

tiny = dict(block_size=8, n_layer=1, n_head=2, n_embd=16, d_ff=32)
torch.manual_seed(0)
step(MiniGPT(MiniGPTConfig(**tiny)), "dense MiniGPT")
step(MiniGPT(MiniGPTConfig(**tiny, n_experts=4, top_k=2)), "MiniGPT-MoE, torch backend")
lora = MiniGPT(MiniGPTConfig(**tiny, n_experts=4, top_k=2))
wrap_lora(lora, ["q_proj", "v_proj"], r=4)
step(lora, "LoRA on MiniGPT-MoE")
for n_experts in (0, 4):
    qlora = MiniGPT(MiniGPTConfig(**tiny, n_experts=n_experts, top_k=2))
    wrap_minigpt_qlora(qlora, r=4)
    step(qlora, f"QLoRA on MiniGPT ({n_experts} experts)")
logits, ids = torch.randn(4, 10), torch.tensor([0, 3, 9, 1])
torch.testing.assert_close(minirl.selective_log_softmax(logits, ids),
                           torch.log_softmax(logits, 1).gather(1, ids[:, None])[:, 0])

def launches(what, call, where=None):
    """call() must raise TritonUnavailableError, one line: where it runs."""
    want = f"{where}: {TRITON_MISSING}" if where else TRITON_MISSING
    try:
        call()
    except TritonUnavailableError as e:
        if str(e) != want:
            problems.append(f"{what}: the message {str(e)!r} is not the one line {want!r}")
        return
    except Exception as e:
        problems.append(f"{what} raised {e!r}, not TritonUnavailableError")
        return
    problems.append(f"{what} ran without triton")

q = miniquant.quantize_nf4(torch.randn(4, 64))
x, W = torch.randn(3, 16), torch.randn(4, 16, 8)
sei, ssi, offs = minimoe.flatten_sort_count(torch.tensor([[0, 1], [2, 3], [1, 2]]), 4)
triton_moe = MiniGPT(MiniGPTConfig(**tiny, n_experts=4, top_k=2, moe_backend="triton"))
launches("miniquant.triton_dequantize_nf4", lambda: miniquant.triton_dequantize_nf4(q))
launches("miniquant.selective_dequantize_nf4",
         lambda: miniquant.selective_dequantize_nf4(miniquant.quantize_nf4(torch.randn(2, 4, 16)),
                                                    torch.tensor([1])))
launches("minimoe.scatter2scatter", lambda: minimoe.scatter2scatter(x, W, sei, ssi, 2))
launches("MiniGPT-MoE with moe_backend='triton'", lambda: triton_moe(torch.zeros(1, 4).long()))
launches("minirl's Triton log-softmax",
         lambda: minirl.selective_log_softmax(logits, ids, backend="triton"))
for name in sorted(KERNEL_MODULES):
    launches(f"import {name}", lambda: importlib.import_module(name))
launches("harness.require_triton", lambda: require_triton("03-triton-dequant"),
         where="03-triton-dequant")
# Only TRITON_* here: torch sets TORCHINDUCTOR_CACHE_DIR itself (its checkpoint imports dynamo).
changed = sorted(k for k in set(os.environ) | set(before)
                 if k.startswith("TRITON") and os.environ.get(k) != before.get(k))
if changed:
    problems.append(f"running without triton set {changed}: the Triton mode is chosen only "
                    "where triton is imported")
print("\\n".join(problems))
print("done")
'''


def test_packages_work_without_triton(no_triton):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD)], env=no_triton,
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0 and done.stdout.endswith("done\n"), done.stderr[-3000:]
    problems = done.stdout.removesuffix("done\n").strip()
    assert not problems, problems


def test_the_triton_message_is_one_line_naming_where_it_runs():
    assert "\n" not in TRITON_MISSING
    for words in ("Linux only", "macOS or Windows", "Colab", "Codespace", "WSL2",
                  "Where it runs"):
        assert words in TRITON_MISSING


def test_require_triton_returns_when_triton_is_there():
    from course.notebook.harness import require_triton

    pytest.importorskip("triton")
    assert require_triton(KERNEL_LAB) is None


# --- make check: the failing setup cell, in one line -------------------------------------


def executed(*cells: tuple[dict, str | None]) -> nbformat.NotebookNode:
    """A notebook as nbclient leaves it: code cells with (nbgrader metadata, error or None)."""
    nb = nbformat.v4.new_notebook()
    for meta, error in cells:
        cell = nbformat.v4.new_code_cell("pass", metadata={"nbgrader": meta} if meta else {})
        if error:
            cell.outputs = [nbformat.v4.new_output("error", ename=error, evalue="why",
                                                   traceback=[])]
        nb.cells.append(cell)
    return nb


SOLUTION = {"solution": True, "grade": False, "grade_id": "mine"}
TEST = {"solution": False, "grade": True, "grade_id": "test_mine", "points": 1}


def test_a_failing_setup_cell_is_found():
    nb = executed(({}, None), ({}, "ImportError"), (SOLUTION, "NameError"), (TEST, "NameError"))
    assert failed_setup(nb) == (1, 2, "ImportError: why"), \
        "the first failing cell, neither a test nor a solution and above every solution, is " \
        "a setup cell: `make check` reports it in one line"


@pytest.mark.parametrize("cells", [
    [({}, None), (SOLUTION, "NotImplementedError"), ({}, "NotImplementedError")],  # the stub
    [({}, None), (SOLUTION, None), ({}, "ValueError"), (TEST, "ValueError")],  # after learner code
    [({}, None), (TEST, "AssertionError"), (SOLUTION, None)],                   # a test, not setup
    [({}, None), (SOLUTION, None), (TEST, None)],                               # nothing failed
])
def test_other_failures_are_not_setup_failures(cells):
    assert failed_setup(executed(*cells)) is None, \
        "only a cell that ran before any learner code is a setup cell"


# --- make check without triton, on the instructors' solutions (slow) ----------------------


def run_check(lab: str, root: Path, env: dict[str, str]) -> subprocess.CompletedProcess:
    """`make check LAB=lab` in a course checkout at `root` whose work copy is the solution."""
    (root / "labs" / lab).mkdir(parents=True)
    release = ROOT / "labs" / lab / f"{lab}.ipynb"
    (root / "labs" / lab / release.name).write_bytes(release.read_bytes())
    (root / "work").mkdir()
    nbformat.write(source_notebook(ROOT / "solutions" / f"{lab}.py"),
                   root / "work" / f"{lab}.ipynb")
    return subprocess.run([sys.executable, "-m", "course", "check", lab, "--root", str(root)],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)


def visible_tests(lab: str) -> list[str]:
    release = nbformat.read(ROOT / "labs" / lab / f"{lab}.ipynb", as_version=4)
    return [c.metadata.nbgrader.grade_id for c in graded_test_cells(release)]


@pytest.mark.slow
@pytest.mark.notebooks
@pytest.mark.parametrize("lab", NON_KERNEL_LABS)
def test_labs_without_kernels_pass_their_checks_without_triton(lab, tmp_path, no_triton):
    proc = run_check(lab, tmp_path / "course", no_triton)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    for grade_id in visible_tests(lab):
        assert f"PASS  {grade_id} " in proc.stdout, out[-3000:]
    noise = [n for n in NOISE if n in out]
    assert not noise, f"make check printed {noise}: silence them at their source\n{out[-2000:]}"


@pytest.mark.slow
@pytest.mark.notebooks
def test_a_kernel_lab_reports_its_setup_cell_without_triton(tmp_path, no_triton):
    proc = run_check(KERNEL_LAB, tmp_path / "course", no_triton)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    setup = [line for line in proc.stdout.splitlines() if "setup cell" in line
             and "failed:" in line]
    want = (f"TritonUnavailableError: {KERNEL_LAB}: {TRITON_MISSING}; the tests below it "
            "cannot run")
    assert len(setup) == 1 and setup[0].endswith(want), \
        f"expected one line 'setup cell N failed: {want}' (the setup cell must call " \
        f"harness.require_triton({KERNEL_LAB!r}) before `import triton`), got:\n{out[-3000:]}"
    for grade_id in visible_tests(KERNEL_LAB):
        assert f"FAIL  {grade_id} " in proc.stdout, out[-3000:]
    assert "NameError" not in proc.stdout, out[-3000:]
