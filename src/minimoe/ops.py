"""Launchers of the dispatch kernels: check the inputs, allocate the output, launch.

Shapes: M = T·k sorted rows, E experts, W [E, K, N]; see kernels.py for the pseudocode.
Row inputs (X, DY) that are not contiguous are copied; weights are read through strides.

Launch configurations (`kernels.CONFIGS`): on a GPU each kernel autotunes over a short list
for its dtype's width (16-bit or float32), keyed on the sizes that change the best choice; in
the interpreter, which pays per program rather than per instruction, one fixed large tile,
always in float32. Which list and which dot precision a GPU gets, TF32 included, is
`launch_plan.dot_plan`'s choice (below sm_80 every dot runs in float32, with a warning).
`benchmarks/compile_report.py` compiles every candidate a launch can pick for sm_75, sm_80,
sm_86, sm_89 and sm_90, and the tests hold them to no register spills.

The kernels (kernels.py) load at the first launch, when `_kernels()` imports them: that
imports triton (choosing its interpreter without CUDA), so `import minimoe` needs no triton and
sets nothing; without triton a launch raises `TritonUnavailableError`.

Index values: called alone, a launcher checks the index values it reads (in range, sorted,
a permutation, consistent offsets) with one host sync. `trusted=True` skips that look: the
caller vouches that the indices come from a validated `routing.Routing` (`parallel_linear`
does, so a forward and backward never sync per launch). Shapes, dtypes and devices are
always checked (no sync). scatter2scatter's row tiles (`expert_tiles`) are cut per launch,
or once per Routing when the launch is given it (`routing=`: `Routing.tiles`).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable

import torch

from miniquant.triton_env import not_on_cuda

from . import routing
from .launch_plan import DOT_KERNELS, device_plan
from .routing import Routing, expert_tiles

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernels():
    """minimoe.kernels, imported at the first launch (which imports triton, or raises
    TritonUnavailableError without it; a failure is not cached)."""
    return importlib.import_module(".kernels", __package__)


@functools.cache
def _autotuned(name: str, bits: int, aligned: bool):
    """kernels.`name` autotuned over kernels.configs(name, bits, aligned) (on first use)."""
    kernels = _kernels()
    triton = kernels.triton
    configs = [triton.Config({k: v for k, v in c.items() if k.startswith("BLOCK_")},
                             num_warps=c["num_warps"], num_stages=c["num_stages"])
               for c in kernels.configs(name, bits, aligned)]
    return triton.autotune(configs, key=kernels.TUNING_KEYS[name])(kernels.KERNELS[name])


def _launch(name: str, grid: Callable[[dict], tuple], dtype: torch.dtype, *args, **consts):
    """Launch kernels.`name` on grid(meta) (meta: the BLOCK_* sizes chosen): autotuned on a
    GPU over the configurations `dot_plan` picks, the interpreter's fixed configuration
    (float32, exact) otherwise. A dot kernel's PRECISION is set here."""
    kernels = _kernels()
    dot = name in DOT_KERNELS
    if kernels.interpreting():
        meta = kernels.INTERPRETER_CONFIG[name]
        precision = dict(PRECISION="ieee") if dot else {}
        kernels.KERNELS[name][grid(meta)](*args, **consts, **precision, **meta)
        return
    bits = 32 if dtype == torch.float32 else 16
    if dot:
        plan = device_plan(args[0].device, dtype)
        bits, consts = plan.bits, dict(consts, PRECISION=plan.precision)
    _autotuned(name, bits, aligned(kernels.KERNELS[name].arg_names, args))[grid](*args, **consts)


def aligned(names: list[str], args: tuple) -> bool:
    """Whether every integer argument (sizes, strides) is 1 or a multiple of 16, which Triton
    specializes on and then vectorises; the LoRA rank R is left out (it only counts rows of A
    and B, whose strides are arguments of their own)."""
    return all(a == 1 or a % 16 == 0 for n, a in zip(names, args, strict=False)
               if type(a) is int and n != "R")


def _check_float(t: torch.Tensor, name: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
    if t.dtype not in DTYPES:
        raise ValueError(f"{name} must be one of {DTYPES}, got {t.dtype}")
    if _kernels().interpreting():
        if t.dtype != torch.float32:
            raise ValueError(f"{name} is {t.dtype}, but the Triton interpreter is float32-only")
    elif t.device.type != "cuda":
        raise not_on_cuda(name, t.device)


def _check_same(a: torch.Tensor, b: torch.Tensor, na: str, nb: str) -> None:
    if a.dtype != b.dtype:
        raise ValueError(f"{na} ({a.dtype}) and {nb} ({b.dtype}) must have the same dtype")
    if a.device != b.device:
        raise ValueError(f"{na} ({a.device}) and {nb} ({b.device}) must be on the same device")


def _check_index(t: torch.Tensor, name: str, M: int, device: torch.device) -> torch.Tensor:
    """A [M] integer index tensor on `device` (no look at its values), as contiguous int64."""
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor")
    if t.dim() != 1 or t.shape[0] != M:
        raise ValueError(f"{name} must have shape [{M}], got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, the data on {device}")
    return t.long().contiguous()


def _require(checks: dict[str, tuple[torch.Tensor, Callable[[], str]]]) -> None:
    """Raise ValueError(message()) for the first name whose 0-d bool flag is false: the
    public launchers' check of index values, one host sync for all the flags."""
    if not checks:
        return
    ok = torch.stack([flag for flag, _ in checks.values()]).tolist()        # the one sync
    for good, (_, message) in zip(ok, checks.values(), strict=True):
        if not good:
            raise ValueError(message())


def _range_check(t: torch.Tensor, name: str, hi: int):
    """The `_require` entry for t in 0..hi-1."""
    return (routing._all_in(t, 0, hi),
            lambda: f"{name} must lie in 0..{hi - 1}, got {int(t.min())}..{int(t.max())}")


def _checked_offsets(expert_offsets: torch.Tensor, E: int, M: int, device, trusted: bool
                     ) -> torch.Tensor:
    """[E] non-decreasing end offsets in 0..M ending at M, as contiguous int64."""
    offs = _check_index(expert_offsets, "expert_offsets", E, device)
    if not trusted:
        good = routing._all_in(offs, 0, M + 1) & (offs[-1] == M) & (offs[1:] >= offs[:-1]).all()
        _require({"offsets": (good, lambda: f"expert_offsets must be non-decreasing end offsets "
                                             f"ending at M={M}, got {offs.tolist()}")})
    return offs


def check_expert_lora(lora_A, lora_B, E: int, K: int, N: int) -> int:
    """Expert LoRA A [r·E, K], B [N, r·E] (expert e: rows / columns e·r:(e+1)·r) -> r."""
    if lora_A is None or lora_B is None:
        raise ValueError("lora_A and lora_B must be given together")
    rE = lora_A.shape[0] if lora_A.dim() == 2 else -1
    if rE <= 0 or rE % E or lora_A.shape[1] != K or tuple(lora_B.shape) != (N, rE):
        raise ValueError(f"lora_A must be [r·E, K] = [r·{E}, {K}] and lora_B [N, r·E] = "
                         f"[{N}, r·{E}], got {tuple(lora_A.shape)} and {tuple(lora_B.shape)}")
    return rE // E


def _rank_block(r: int) -> int:
    """The LoRA rank padded to a power of two, at least 16 (tl.dot's smallest dimension)."""
    return max(16, 1 << (r - 1).bit_length())


def scatter2scatter(X: torch.Tensor, W: torch.Tensor, sorted_expert_idxs: torch.Tensor,
                    sorted_scattered_idxs: torch.Tensor, k: int, x_grouped: bool = False,
                    y_grouped: bool = False, *, trusted: bool = False,
                    routing: Routing | None = None) -> torch.Tensor:
    """Y[row(i)] = X[xrow(i)] @ W[sorted_expert_idxs[i]] for every sorted row i.

    X [T, K] (or [M, K] grouped), W [E, K, N] -> Y [M, N], M = len(sorted_expert_idxs);
    xrow(i) = i if x_grouped else sorted_scattered_idxs[i] // k; row(i) = i if y_grouped
    else sorted_scattered_idxs[i] (slot order t·k + j). routing: the Routing the sorted ids
    are from, whose row tiles every launch on it shares (`Routing.tiles`).
    """
    return _scatter2scatter(X, W, sorted_expert_idxs, sorted_scattered_idxs, k, x_grouped,
                            y_grouped, None, trusted, routing)


def scatter2scatter_lora(X: torch.Tensor, W: torch.Tensor, lora_A: torch.Tensor,
                         lora_B: torch.Tensor, scaling: float, sorted_expert_idxs: torch.Tensor,
                         sorted_scattered_idxs: torch.Tensor, k: int, x_grouped: bool = False,
                         y_grouped: bool = False, *, trusted: bool = False,
                         routing: Routing | None = None) -> torch.Tensor:
    """`scatter2scatter` plus each row's expert LoRA, fused into the same tiles:
    Y[row(i)] = x @ W[e] + scaling · (x @ A_eᵀ) @ B_eᵀ with e = sorted_expert_idxs[i],
    A [r·E, K], B [N, r·E], A_e = A[e·r:(e+1)·r], B_e = B[:, e·r:(e+1)·r]."""
    return _scatter2scatter(X, W, sorted_expert_idxs, sorted_scattered_idxs, k, x_grouped,
                            y_grouped, (lora_A, lora_B, float(scaling)), trusted, routing)


def _tiles(sei: torch.Tensor, E: int, tile_m: int, owner: Routing | None):
    """expert_tiles of the sorted ids: those of their Routing `owner`, cut once, if given."""
    if owner is None:
        return expert_tiles(sei, E, tile_m)
    if not isinstance(owner, Routing) or owner.n_rows != sei.shape[0] \
            or owner.n_experts != E or owner.sorted_expert_idxs.device != sei.device:
        raise ValueError(f"routing must be the Routing of these {sei.shape[0]} sorted rows and "
                         f"{E} experts on {sei.device}, got {owner!r}")
    return owner.tiles(tile_m)


def _scatter2scatter(X, W, sorted_expert_idxs, sorted_scattered_idxs, k, x_grouped, y_grouped,
                     lora, trusted, owner) -> torch.Tensor:
    """Check, allocate and launch the scatter2scatter kernel; lora = (A, B, scaling) or None,
    owner: the Routing of the sorted ids or None."""
    _check_same(X, W, "X", "W")
    _check_float(X, "X")
    _check_float(W, "W")
    if X.dim() != 2 or W.dim() != 3 or X.shape[1] != W.shape[1]:
        raise ValueError(f"X must be [rows, K] and W [E, K, N] with the same K, got "
                         f"{tuple(X.shape)} and {tuple(W.shape)}")
    E, K, N = W.shape
    if not 1 <= k <= E:
        raise ValueError(f"k must be in 1..{E} (the number of experts), got {k}")
    M = sorted_expert_idxs.shape[0] if sorted_expert_idxs.dim() == 1 else -1
    rows = M if x_grouped else M // k
    if M < 0 or M % k or X.shape[0] != rows:
        raise ValueError(f"X has {X.shape[0]} rows; expected {'M' if x_grouped else 'M / k'} "
                         f"with M = {M} sorted rows and k = {k}")
    sei = _check_index(sorted_expert_idxs, "sorted_expert_idxs", M, X.device)
    ssi = _check_index(sorted_scattered_idxs, "sorted_scattered_idxs", M, X.device)
    if not trusted:
        # Unsorted ids break the tile's expert range; a non-permutation leaves rows unwritten.
        _require({"sei": _range_check(sei, "sorted_expert_idxs", E),
                  "order": ((sei[1:] >= sei[:-1]).all(),
                            lambda: "sorted_expert_idxs must be non-decreasing (sorted)"),
                  "ssi": (routing._is_permutation(ssi),
                          lambda: f"sorted_scattered_idxs must be a permutation of 0..{M - 1}")})
    # Weights are read through their strides: the backward's Wᵀ, Bᵀ, Aᵀ views are not copied.
    X = X.contiguous()
    A, B, r, scaling = X, X, 0, 1.0          # never read without LoRA (a constexpr branch)
    if lora is not None:
        A, B, scaling = lora
        r = check_expert_lora(A, B, E, K, N)
        for t, name in ((A, "lora_A"), (B, "lora_B")):
            _check_same(X, t, "X", name)
    Y = torch.empty(M, N, dtype=X.dtype, device=X.device)                  # [M, N]
    if M == 0:
        return Y
    tile_m = _kernels().TILE_M
    start, end = _tiles(sei, E, tile_m, owner)
    _launch("scatter2scatter", lambda meta: (start.shape[0], _cdiv(N, meta["BLOCK_N"])),
            X.dtype, X, W, Y, sei, ssi, start, end, K, N, X.stride(0), X.stride(1),
            W.stride(0), W.stride(1), W.stride(2), Y.stride(0), Y.stride(1),
            A, B, r, scaling, A.stride(0), A.stride(1), B.stride(0), B.stride(1),
            FAN_OUT=k, X_GROUPED=x_grouped, Y_GROUPED=y_grouped, HAS_LORA=lora is not None,
            BLOCK_M=tile_m, BLOCK_R=_rank_block(max(r, 1)))
    return Y


def group(X: torch.Tensor, sorted_scattered_idxs: torch.Tensor, fan_out: int = 1,
          coeff: torch.Tensor | None = None, *, trusted: bool = False) -> torch.Tensor:
    """Rows into sorted order: out[i] = X[s_i // fan_out] (· coeff[s_i]), s_i the slot of i.

    X [M / fan_out, N], coeff [M] (any shape of M elements) -> [M, N] in X's dtype.
    """
    _check_float(X, "X")
    if X.dim() != 2:
        raise ValueError(f"X must be [rows, N], got shape {tuple(X.shape)}")
    if fan_out < 1:
        raise ValueError(f"fan_out must be >= 1, got {fan_out}")
    M = X.shape[0] * fan_out
    ssi = _check_index(sorted_scattered_idxs, "sorted_scattered_idxs", M, X.device)
    if not trusted:
        _require({"ssi": _range_check(ssi, "sorted_scattered_idxs", M)})
    if coeff is not None:
        if coeff.numel() != M or not coeff.dtype.is_floating_point or coeff.device != X.device:
            raise ValueError(f"coeff must be a floating tensor of {M} elements on {X.device}")
        coeff = coeff.reshape(-1).contiguous()
    X = X.contiguous()
    N = X.shape[1]
    out = torch.empty(M, N, dtype=X.dtype, device=X.device)                # [M, N]
    if M == 0:
        return out
    _launch("group", lambda meta: (_cdiv(M, meta["BLOCK_M"]), _cdiv(N, meta["BLOCK_N"])),
            X.dtype, X, X if coeff is None else coeff, out, ssi, M, N,
            X.stride(0), X.stride(1), out.stride(0), out.stride(1),
            FAN_OUT=fan_out, HAS_COEFF=coeff is not None)
    return out


def group_bwd_W(DY: torch.Tensor, X: torch.Tensor, expert_offsets: torch.Tensor, E: int,
                *, trusted: bool = False) -> torch.Tensor:
    """dW[e] = X[rows of e]ᵀ @ DY[rows of e]: DY [M, N], X [M, K] grouped -> [E, K, N].

    Rows of expert e are expert_offsets[e-1]..expert_offsets[e] (end offsets); an expert with
    no rows gets an exact zero block.
    """
    _check_same(DY, X, "DY", "X")
    _check_float(DY, "DY")
    _check_float(X, "X")
    if DY.dim() != 2 or X.dim() != 2 or DY.shape[0] != X.shape[0]:
        raise ValueError(f"DY [M, N] and X [M, K] must have the same rows, got "
                         f"{tuple(DY.shape)} and {tuple(X.shape)}")
    if E < 1:
        raise ValueError(f"E must be >= 1, got {E}")
    M, N, K = DY.shape[0], DY.shape[1], X.shape[1]
    offs = _checked_offsets(expert_offsets, E, M, X.device, trusted)
    DY, X = DY.contiguous(), X.contiguous()
    DW = torch.empty(E, K, N, dtype=X.dtype, device=X.device)              # [E, K, N]
    _launch("group_bwd_W",
            lambda meta: (E, _cdiv(K, meta["BLOCK_K"]), _cdiv(N, meta["BLOCK_N"])),
            X.dtype, DY, X, DW, offs, K, N, DY.stride(0), DY.stride(1), X.stride(0),
            X.stride(1), DW.stride(0), DW.stride(1), DW.stride(2))
    return DW


def group_bwd_lora(DY: torch.Tensor, X: torch.Tensor, lora_A: torch.Tensor,
                   lora_B: torch.Tensor, expert_offsets: torch.Tensor, scaling: float,
                   *, trusted: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert LoRA gradients from grouped rows: DY [M, N], X [M, K], A [r·E, K], B [N, r·E].

    dA_e = scaling · (DY_e @ B_e)ᵀ @ X_e  -> dA [r·E, K]
    dB_e = scaling · DY_eᵀ @ (X_e @ A_eᵀ) -> dB [N, r·E]
    with X_e, DY_e the rows expert_offsets[e-1]..expert_offsets[e]; an expert with no rows
    gets exact zeros. One kernel computes both (see kernels.py).
    """
    for t, name in ((X, "X"), (lora_A, "lora_A"), (lora_B, "lora_B")):
        _check_same(DY, t, "DY", name)
    for t, name in ((DY, "DY"), (X, "X")):
        _check_float(t, name)
    if DY.dim() != 2 or X.dim() != 2 or DY.shape[0] != X.shape[0]:
        raise ValueError(f"DY [M, N] and X [M, K] must have the same rows, got "
                         f"{tuple(DY.shape)} and {tuple(X.shape)}")
    M, N, K = DY.shape[0], DY.shape[1], X.shape[1]
    E = expert_offsets.shape[0] if expert_offsets.dim() == 1 else 0
    if E < 1:
        raise ValueError(f"expert_offsets must be a non-empty [E] tensor, got "
                         f"{tuple(expert_offsets.shape)}")
    r = check_expert_lora(lora_A, lora_B, E, K, N)
    offs = _checked_offsets(expert_offsets, E, M, X.device, trusted)
    DY, X, A, B = (t.contiguous() for t in (DY, X, lora_A, lora_B))
    dA = torch.empty_like(A)                                               # [r·E, K]
    dB = torch.empty_like(B)                                               # [N, r·E]
    BR = _rank_block(r)
    # dB[n, e·r + j] = s · Σ DY[m, n] · (X[m] @ A_eᵀ)[j];  dAᵀ[k, e·r + j] likewise with
    # U = X, V = DY, L = B — dA written through its transposed strides.
    for U, V, L, OUT, sl, so in ((DY, X, A, dB, (A.stride(1), A.stride(0)), dB.stride()),
                                 (X, DY, B, dA, B.stride(), (dA.stride(1), dA.stride(0)))):
        P, Q = U.shape[1], V.shape[1]
        _launch("group_bwd_lora", lambda meta, P=P: (E, _cdiv(P, meta["BLOCK_P"])),
                X.dtype, U, V, L, OUT, offs, P, Q, r, float(scaling), U.stride(0),
                U.stride(1), V.stride(0), V.stride(1), *sl, *so, BLOCK_R=BR)
    return dA, dB
