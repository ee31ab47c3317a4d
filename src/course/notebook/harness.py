"""The lab test harness: the helpers the lab notebooks' test cells share, imported instead of
pasted (`from course.notebook.harness import ...`).

- `outputs`, `unchanged`: a block whose calls write into the test's buffers, and one that
  must leave the test's tensors as they were (see `bridged.py`: they hold apart too).
- `swap`, `forbid`, `refuse`: switch library functions out by object (see `forbid.py`);
  `reference(lab)`: what a lab rebuilds, from the packages' REFERENCE tables, to forbid.
- `Spy`, `spy_on`: count a kernel's launches or a function's calls while a block runs;
  `assert_no_atomics`: a kernel whose programs own their tiles needs none;
  `assert_rejects`: bad inputs get a ValueError.
- `accept_routing`: let a learner's index-form `parallel_linear` stand in for minimoe's.
- `expert_routing`, `expert_problem`, `describe`, `leaf`, `loop_grads`, `assert_close`: the
  awkward MoE problems of Labs 08–10 and their naive-loop reference.
- `require_triton`, `triton_mode`, `triton_setup`, `gpu_arch`, `randn`, `pairs_of`,
  `randomize_lora`: what the setup cells of several labs share.

Torch is imported here; minimoe only inside `loop_grads`, so the early labs do not load it.
"""

from __future__ import annotations

import contextlib
import importlib
import os
from collections.abc import Callable, Iterator

import torch

from .bridged import outputs, unchanged
from .forbid import Refuse, forbid, refuse, swap

__all__ = ["Refuse", "Spy", "accept_routing", "assert_close", "assert_no_atomics",
           "assert_rejects", "describe", "expert_problem", "expert_routing", "forbid", "leaf",
           "gpu_arch", "loop_grads", "must_reach", "outputs", "pairs_of", "randn",
           "randomize_lora", "reference", "refuse", "require_triton", "spy_on", "swap",
           "triton_mode", "triton_setup", "unchanged"]


# The packages whose REFERENCE tables name what the labs rebuild (lab -> public name -> path).
REFERENCE_PACKAGES = ("miniquant", "minimoe", "minigpt", "minituner", "minirl", "gpucompile",
                      "labkit")


def resolve(path: str) -> object:
    """The object at a dotted path: the longest importable module, then attributes
    (`minimoe.kernels._group_kernel`, `miniquant.nf4.NF4Weight.dequantize`)."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        try:
            obj = importlib.import_module(module)
            break
        except ModuleNotFoundError as e:     # `module` (or a part of it) is no module:
            if i == 1 or not f"{module}.".startswith(f"{e.name}."):     # try its parent
                raise
    for name in parts[i:]:
        obj = getattr(obj, name)
    return obj


def reference(lab: str) -> dict[str, object]:
    """What `lab` rebuilds: every package's `REFERENCE[lab]`, public name -> object (a kernel
    module loads now). A lab's tests forbid these while a learner's code runs, and pick one
    by its public name (`reference("08-moe-forward-kernel")["scatter2scatter_kernel"]`)."""
    found: dict[str, object] = {}
    for package in REFERENCE_PACKAGES:
        table = getattr(importlib.import_module(package), "REFERENCE", {})
        for name, path in table.get(lab, {}).items():
            if name in found:
                raise ValueError(f"{lab}: {name!r} is named by two packages' REFERENCE tables")
            found[name] = resolve(path)
    if not found:
        raise ValueError(f"no package names what lab {lab!r} rebuilds (their REFERENCE tables)")
    return found


def require_triton(lab: str) -> None:
    """For the kernel labs' setup cells, before `import triton`: return if triton can be
    imported, else raise `TritonUnavailableError`, one line saying where the lab runs (triton
    has wheels for Linux only). Imports nothing of triton, so the cell can still choose the
    interpreter afterwards."""
    from miniquant.triton_env import TritonUnavailableError, triton_installed

    if not triton_installed():
        raise TritonUnavailableError(lab)


def gpu_arch() -> str | None:
    """The architecture of the CUDA GPU torch sees, as compilers name it ("sm_75" for a T4,
    "sm_89" for an L4, "sm_90" for an H100), or None where there is none."""
    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    return f"sm_{major}{minor}"


def triton_mode() -> tuple[bool, str]:
    """(INTERPRET, DEVICE) of the kernel labs, by the rule `miniquant.triton_env` applies when
    it imports triton: an explicit TRITON_INTERPRET is respected, and unset it means the
    interpreter exactly where there is no CUDA GPU. Interpreted kernels run on the CPU and
    read CPU tensors ("cpu"); compiled kernels read only GPU memory ("cuda"), so that is
    where the tests make their tensors."""
    value = os.environ.get("TRITON_INTERPRET")
    if value is None:
        interpret = not torch.cuda.is_available()
    else:                                                # as triton reads it
        interpret = value.strip().lower() in ("1", "true", "on", "yes")
    return interpret, "cpu" if interpret else "cuda"


def triton_setup() -> tuple[bool, str]:
    """For the kernel labs, once the notebook has chosen the interpreter and imported triton:
    one CPU thread (the interpreter runs one program at a time with NumPy; more threads only
    add overhead), seed 0, and `triton_mode()`, printed with what it means."""
    import triton

    torch.set_num_threads(1)
    torch.manual_seed(0)
    interpret, device = triton_mode()
    if interpret:
        where = ("no CUDA GPU (or TRITON_INTERPRET set), so the kernels run in Triton's "
                 "interpreter on the CPU (float32 only, slow)")
    else:
        where = (f"the kernels compile for this GPU, {torch.cuda.get_device_name()} "
                 f"({gpu_arch()}), and read only its memory")
    print(f"torch {torch.__version__} | triton {triton.__version__}\n"
          f"INTERPRET = {interpret}, DEVICE = {device!r}: {where}. The tests put their "
          "tensors on DEVICE.")
    return interpret, device


def randn(*shape: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A reproducible standard-normal tensor (the tests use it too)."""
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def pairs_of(examples, tok) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + <eos>) for each tasks.Example, as the training data holds
    them; `tok` is the CharTokenizer."""
    return [(tok.encode(ex.prompt), tok.encode(ex.answer) + [tok.eos_id]) for ex in examples]


def randomize_lora(model: torch.nn.Module, seed: int = 1, std: float = 0.1) -> None:
    """Random lora_A / lora_B values, so that an adapter does something (B starts at zero)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_A" in name or "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


class Spy:
    """Stands in for a kernel or a function and records its launches (`kernel[grid]`: the
    grids) and calls (`calls`, and `(args, kwargs, result)` in `results`)."""

    def __init__(self, target):
        self.target, self.grids, self.calls, self.results = target, [], 0, []

    def __getitem__(self, grid):
        self.grids.append(grid)
        return self.target[grid]

    def __call__(self, *args, **kwargs):
        self.calls += 1
        out = self.target(*args, **kwargs)
        self.results.append((args, kwargs, out))
        return out

    def __getattr__(self, name):
        return getattr(self.target, name)


@contextlib.contextmanager
def spy_on(namespace: dict, *targets) -> Iterator[Spy | list[Spy]]:
    """Replace each target object, wherever it is bound (course packages and `namespace`,
    the notebook's `globals()`), by a `Spy` while the block runs; yields the spy, or a list
    of them for several targets. A target bound nowhere raises LookupError."""
    spies = [Spy(t) for t in targets]
    with contextlib.ExitStack() as stack:
        for target, spy in zip(targets, spies, strict=True):
            stack.enter_context(swap(target, spy, namespace))
        yield spies[0] if len(spies) == 1 else spies


def assert_no_atomics(kernel, why: str) -> None:
    """The @triton.jit kernel's code names no `tl.atomic_*` (read from its Python code
    object, so it holds on the interpreter too); `why` says why none is needed."""
    fn = getattr(kernel, "fn", kernel)
    names = [n for n in getattr(getattr(fn, "__code__", None), "co_names", ()) if "atomic" in n]
    assert not names, f"{getattr(fn, '__name__', kernel)} uses {names}: {why}"


REACHED = "the test checks that your code reaches it, by switching it off"


def must_reach(targets: list, call: Callable[[], object], what: str,
               namespace: dict | None = None) -> None:
    """`call()` must fail once every one of `targets` is switched off (`forbid`): the
    learner's code reaches one of them, under whatever name (a kernel launched, a function
    called). A check that needs no look inside the learner's process: it holds beside their
    code and apart from it. Raises AssertionError(`what`) when the call does not reach them."""
    try:
        with forbid(list(targets), namespace, why=REACHED):
            call()
    except AssertionError as e:
        if REACHED in str(e):
            return
        raise AssertionError(f"{what} (it failed before reaching it: {e})") from e
    raise AssertionError(what)


def assert_rejects(name: str, bad_calls, guard: Callable[[], contextlib.AbstractContextManager]
                   = contextlib.nullcontext) -> None:
    """Each `(what, call)` of `bad_calls` must raise ValueError (run inside `guard()`, e.g.
    a `forbid`); the message names the function `name` and the input it accepted."""
    for what, call in bad_calls:
        try:
            with guard():
                call()
        except ValueError:
            continue
        raise AssertionError(f"{name} accepted {what}; expected ValueError")


def accept_routing(fn: Callable) -> Callable:
    """`fn(x, W, k, sei, ssi, offsets, **kw)` (a learner's parallel_linear, with no backend)
    as a stand-in for `minimoe.parallel_linear`: it takes the routing as a `Routing` value
    (`.k`, unpacking as `sei, ssi, offsets`) or as the positional `k, sei, ssi, offsets`, and
    a `backend` it ignores (the learner's function is the backend)."""
    def adapted(x, W, *routing, backend=None, **kw):
        if len(routing) == 1:                       # a Routing value
            routing = (routing[0].k, *routing[0])
        return fn(x, W, *routing, **kw)
    return adapted


def expert_routing(T: int, k: int, E: int, seed: int = 0, only=None, skip=None
                   ) -> torch.Tensor:
    """expert_idxs [T, k]: k distinct experts per token; `only` restricts the choice to those
    experts, `skip` leaves one expert without tokens."""
    g = torch.Generator().manual_seed(seed)
    allowed = list(range(E)) if only is None else list(only)
    if skip is not None:
        allowed.remove(skip)
    if k > len(allowed):
        raise ValueError(f"k={k} distinct experts per token, but only {allowed} are allowed")
    rows = [torch.tensor(allowed)[torch.randperm(len(allowed), generator=g)[:k]]
            for _ in range(T)]
    return torch.stack(rows).long()


def expert_problem(T: int, K: int, N: int, E: int, k: int, seed: int = 0, r: int = 0,
                   device: str = "cpu", **routing) -> tuple:
    """(x [T, K], W [E, K, N], expert_idxs [T, k], gates [T, k] (positive), dout [T, N],
    A [r·E, K], B [N, r·E]) on `device`; A and B are None for r = 0, B is non-zero so that a
    LoRA term shows. `routing`: `only` / `skip` of `expert_routing`."""
    g = torch.Generator().manual_seed(seed + 100)
    x = torch.randn(T, K, generator=g)
    W = torch.randn(E, K, N, generator=g) / K ** 0.5
    gates = torch.rand(T, k, generator=g) + 0.1
    dout = torch.randn(T, N, generator=g)
    A = torch.randn(r * E, K, generator=g) / K ** 0.5 if r else None
    B = torch.randn(N, r * E, generator=g) / r ** 0.5 if r else None
    idx = expert_routing(T, k, E, seed, **routing)
    return tuple(None if t is None else t.to(device) for t in (x, W, idx, gates, dout, A, B))


def describe(x: torch.Tensor, W: torch.Tensor, idx: torch.Tensor, r: int | None = None) -> str:
    """The sizes of an expert problem and its tokens per expert, for a failure message."""
    rank = "" if r is None else f", r={r}"
    return (f"T={x.shape[0]}, K={x.shape[1]}, N={W.shape[2]}, E={W.shape[0]}, "
            f"k={idx.shape[1]}{rank}, tokens per expert "
            f"{torch.bincount(idx.reshape(-1).cpu(), minlength=W.shape[0]).tolist()}")


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A detached copy that requires a gradient."""
    return t.detach().clone().requires_grad_()


def loop_grads(x, W, idx, gates, dout, A=None, B=None, scaling: float = 1.0) -> tuple:
    """(out, dx, dW, dgates, dA, dB): autograd through minimoe.reference.linear_loop, the
    naive per-expert loop (float32); dgates is None without gates, dA and dB without LoRA.
    Call it outside a `forbid` block that switches the loop off."""
    from minimoe.reference import linear_loop

    xr, Wr = leaf(x), leaf(W)
    gr = None if gates is None else leaf(gates)
    Ar, Br = (None, None) if A is None else (leaf(A), leaf(B))
    out = linear_loop(xr, Wr, idx, gr, Ar, Br, scaling)
    out.backward(dout)
    return (out.detach(), xr.grad, Wr.grad, None if gr is None else gr.grad,
            None if Ar is None else Ar.grad, None if Br is None else Br.grad)


def assert_close(got, want: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    """|got - want| <= rtol · (|want| + max |want|), elementwise (NaN fails); the message
    says where the first difference is and by how much."""
    assert isinstance(got, torch.Tensor), f"{what}: expected a tensor, got {type(got).__name__}"
    assert got.shape == want.shape, \
        f"{what}: expected shape {tuple(want.shape)}, got {tuple(got.shape)}"
    assert got.dtype == want.dtype, f"{what}: expected dtype {want.dtype}, got {got.dtype}"
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    scale = max(float(want.abs().max()) if want.numel() else 0.0, 1e-12)
    err = (got - want).abs()
    bad = ~(err <= rtol * (want.abs() + scale))            # NaN counts as bad
    if bad.any():
        where = bad.nonzero()[0].tolist()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {want.numel()} entries differ (tolerance {rtol:g} "
            f"relative to max |expected| = {scale:.3g}); max error {float(err.max()):.3g}; "
            f"first at index {where}: expected {float(want[tuple(where)]):.6g}, got "
            f"{float(got[tuple(where)]):.6g}")
