"""Triton kernels of the ScatterMoE dispatch (private: call them through `ops.py`).

Notation: T tokens, k experts per token, M = T·k routing slots, E experts, W [E, K, N].
The M slots are sorted once by expert (`routing.flatten_sort_count`): row i of the sorted order
is slot `s = sorted_scattered_idxs[i]` (token `s // k`) routed to `e = sorted_expert_idxs[i]`.
"Grouped" tensors are in sorted order; "scattered" ones in slot order (row s = t·k + j).

scatter2scatter — gather + per-expert GEMM + scatter, no padding of the data:

    # grid = (n_tiles, cdiv(N, BLOCK_N)); tile t covers sorted rows tile_start[t] ..
    # tile_end[t] of ONE expert (`expert_tiles`: each expert's rows cut into BLOCK_M pieces,
    # n_tiles <= cdiv(M, BLOCK_M) + E - 1; spare tiles have start == end and return at once)
    i     = tile_start + arange(BLOCK_M);  rows = i < tile_end
    e     = sorted_expert_idxs[tile_start]             # the tile's one expert
    s_i   = sorted_scattered_idxs[i]
    xrow  = i if X_GROUPED else s_i // FAN_OUT         # which row of X each sorted row reads
    yrow  = i if Y_GROUPED else s_i                    # where its output goes
    acc   = 0                                          # [BLOCK_M, BLOCK_N] float32
    for kk in 0 .. K step BLOCK_K:
        acc += X[xrow, kk:]  @  W[e, kk:, n]           # rows past tile_end load as 0
    Y[yrow, n] = acc

Why tiles never span experts (ScatterMoE pads its block indices per expert the same way): a
tile of BLOCK_M sorted rows that spans several experts must run one K loop per expert, each
a full BLOCK_M-row product of which only that expert's rows count. With 64–128 experts and a
few tokens each, one tile spans dozens of experts, does dozens of times the work and runs
them in series. Cut per expert, the work is one K loop per tile, at most E - 1 tiles more.

group — gather rows into sorted order, optionally scaled:

    # grid = (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N))
    out[i, n] = X[s_i // FAN_OUT, n] * (coeff[s_i] if HAS_COEFF else 1)

group_bwd_W — dW[e] = Σ_{sorted rows i of e} X[i]ᵀ · DY[i], both grouped, no atomics:

    # grid = (E, cdiv(K, BLOCK_K), cdiv(N, BLOCK_N))
    start, end = expert_offsets[e-1] (0 for e=0), expert_offsets[e]
    acc = 0                                            # [BLOCK_K, BLOCK_N] float32
    for m in start .. end step BLOCK_M:
        acc += X[m:m+BLOCK_M, kk]ᵀ @ DY[m:m+BLOCK_M, n]   # masked: rows < end
    dW[e, kk, n] = acc                                 # an expert with no rows stores 0

scatter2scatter_lora — the same kernel with HAS_LORA: also

    xa  = Σ_kk X[xrow, kk:] @ A[e·R:(e+1)·R, kk:]ᵀ          # [BLOCK_M, R], same x loads
    acc += scaling · xa @ B[n, e·R:(e+1)·R]ᵀ                # rank-R update of the tile

and dX with LoRA is that kernel again on (dY, Wᵀ, A := Bᵀ, B := Aᵀ): dY·W_eᵀ + s·(dY·B_e)·A_e.

group_bwd_lora — one kernel for both LoRA gradients (no atomics, exact zeros if no rows):

    # OUT[p, e·R + r] = scaling · Σ_{rows m of e} U[m, p] · (V[m] @ L[:, e·R:(e+1)·R])[r]
    # grid = (E, cdiv(P, BLOCK_P));  dB = this(U=dY, V=X, L=Aᵀ);  dAᵀ = this(U=X, V=dY, L=B)
    acc = 0                                            # [BLOCK_P, R] float32
    for m in start .. end step BLOCK_M:
        vl  = V[m:m+BLOCK_M] @ L_e                     # [BLOCK_M, R], looped over Q
        acc += U[m:m+BLOCK_M, p]ᵀ @ vl
    OUT[p, e·R:(e+1)·R] = scaling · acc

The kernels use builtins only (no `tl.min`, `tl.sum`, ...: those are themselves @triton.jit
helpers, which fail inside an interpreted kernel when triton was first imported without
TRITON_INTERPRET; see miniquant/triton_dequant.py).

PRECISION is `tl.dot`'s input_precision: "ieee" (exact float32 products, the checking mode)
or "tf32" (float32 on tensor cores); 16-bit inputs run on tensor cores from sm_80, and below it,
where Triton compiles every dot to FMAs, in float32 (`launch_plan.dot_plan`).
"""

from __future__ import annotations

from miniquant.triton_env import interpreted, tl, triton


@triton.jit
def _scatter2scatter_kernel(
    X,              # [rows of X, K] input: token rows (scattered) or sorted rows (X_GROUPED)
    W,              # [E, K, N] expert weights
    Y,              # [M, N] output: slot order, or sorted order (Y_GROUPED)
    expert_ids,     # [M] int64 sorted_expert_idxs (non-decreasing)
    scattered_ids,  # [M] int64 sorted_scattered_idxs (slot s = token * FAN_OUT + j)
    tile_start,     # [n_tiles] int64 first sorted row of each tile (`expert_tiles`)
    tile_end,       # [n_tiles] int64 end of its expert's rows (== start: a spare tile)
    K, N,           # sizes (runtime ints)
    sxm, sxk,       # strides of X
    swe, swk, swn,  # strides of W
    sym, syn,       # strides of Y
    A, B,           # LoRA factors A [R·E, K], B [N, R·E] (read only if HAS_LORA)
    R, scaling,     # LoRA rank per expert, and the factor on its product
    sar, sak,       # strides of A
    sbn, sbr,       # strides of B
    FAN_OUT: tl.constexpr,    # k: slots per token (X row of slot s is s // FAN_OUT)
    X_GROUPED: tl.constexpr,  # True: X row of sorted row i is i
    Y_GROUPED: tl.constexpr,  # True: output row of sorted row i is i (else its slot)
    HAS_LORA: tl.constexpr,   # add scaling · (x @ A_eᵀ) @ B_eᵀ (scatter2scatter_lora)
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" or "tf32"
    BLOCK_M: tl.constexpr,    # sorted rows per tile (the size `expert_tiles` cut with)
    BLOCK_N: tl.constexpr,    # output columns per program
    BLOCK_K: tl.constexpr,    # reduction step
    BLOCK_R: tl.constexpr,    # LoRA rank, padded to a power of two (>= 16 for tl.dot)
):
    tile = tl.program_id(0)
    start = tl.load(tile_start + tile)                              # int64: row · stride can
    end = tl.load(tile_end + tile)                                  # pass 2**31 elements
    if start >= end:
        return
    e = tl.load(expert_ids + start)                                 # the tile's one expert
    i = start + tl.arange(0, BLOCK_M)                               # [BM] sorted rows
    rows = i < end
    s_i = tl.load(scattered_ids + i, mask=rows, other=0)            # [BM]
    if X_GROUPED:
        xrow = i
    else:
        xrow = s_i // FAN_OUT
    if Y_GROUPED:
        yrow = i
    else:
        yrow = s_i
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)   # [BN]
    n_mask = n < N
    kk = tl.arange(0, BLOCK_K)                                      # [BK]
    rr = tl.arange(0, BLOCK_R)                                      # [BR]
    r_mask = rr < R
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)
    xa = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)               # x @ A_eᵀ, LoRA only
    for k0 in range(0, K, BLOCK_K):
        k_mask = (k0 + kk) < K
        x = tl.load(X + xrow[:, None] * sxm + (k0 + kk)[None, :] * sxk,
                    mask=rows[:, None] & k_mask[None, :], other=0.0)           # [BM, BK]
        w = tl.load(W + e * swe + (k0 + kk)[:, None] * swk + n[None, :] * swn,
                    mask=k_mask[:, None] & n_mask[None, :], other=0.0)         # [BK, BN]
        acc += tl.dot(x, w, input_precision=PRECISION)
        if HAS_LORA:
            a = tl.load(A + (e * R + rr)[None, :] * sar + (k0 + kk)[:, None] * sak,
                        mask=k_mask[:, None] & r_mask[None, :], other=0.0)      # [BK, BR]
            xa += tl.dot(x, a, input_precision=PRECISION)
    if HAS_LORA:
        b = tl.load(B + n[None, :] * sbn + (e * R + rr)[:, None] * sbr,
                    mask=r_mask[:, None] & n_mask[None, :], other=0.0)         # [BR, BN]
        acc += tl.dot((xa * scaling).to(b.dtype), b, input_precision=PRECISION)
    tl.store(Y + yrow[:, None] * sym + n[None, :] * syn, acc.to(Y.dtype.element_ty),
             mask=rows[:, None] & n_mask[None, :])


@triton.jit
def _group_kernel(
    X,              # [rows of X, N] input rows
    coeff,          # [M] per-slot scale (read only if HAS_COEFF)
    out,            # [M, N] output, sorted order
    scattered_ids,  # [M] int64 sorted_scattered_idxs
    M, N,           # sizes
    sxm, sxn,       # strides of X
    som, son,       # strides of out
    FAN_OUT: tl.constexpr,    # X row of slot s is s // FAN_OUT
    HAS_COEFF: tl.constexpr,  # multiply each row by coeff[slot]
    BLOCK_M: tl.constexpr,    # rows per program
    BLOCK_N: tl.constexpr,    # columns per program
):
    i = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)   # [BM], int64
    n = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)   # [BN]
    m_mask = i < M
    mask = m_mask[:, None] & (n < N)[None, :]
    s_i = tl.load(scattered_ids + i, mask=m_mask, other=0)
    x = tl.load(X + (s_i // FAN_OUT)[:, None] * sxm + n[None, :] * sxn, mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_COEFF:
        c = tl.load(coeff + s_i, mask=m_mask, other=0.0).to(tl.float32)
        x = x * c[:, None]
    tl.store(out + i[:, None] * som + n[None, :] * son, x.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _group_bwd_W_kernel(
    DY,             # [M, N] output gradient, sorted order
    X,              # [M, K] inputs, sorted order
    DW,             # [E, K, N] weight gradient (every element written)
    offsets,        # [E] int64 expert_offsets (inclusive cumulative counts = end rows)
    K, N,           # sizes
    sdym, sdyn,     # strides of DY
    sxm, sxk,       # strides of X
    swe, swk, swn,  # strides of DW
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" or "tf32"
    BLOCK_M: tl.constexpr,    # rows per reduction step
    BLOCK_K: tl.constexpr,    # rows of dW[e] per program
    BLOCK_N: tl.constexpr,    # columns of dW[e] per program
):
    e = tl.program_id(0).to(tl.int64)       # int64: e · stride can pass 2**31 elements
    k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)          # [BK]
    n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)          # [BN]
    k_mask = k < K
    n_mask = n < N
    start = tl.load(offsets + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets + e)
    mm = tl.arange(0, BLOCK_M)
    acc = tl.full((BLOCK_K, BLOCK_N), 0.0, tl.float32)
    for m0 in range(start, end, BLOCK_M):
        r_mask = (m0 + mm) < end
        x = tl.load(X + (m0 + mm)[:, None] * sxm + k[None, :] * sxk,
                    mask=r_mask[:, None] & k_mask[None, :], other=0.0)   # [BM, BK]
        dy = tl.load(DY + (m0 + mm)[:, None] * sdym + n[None, :] * sdyn,
                     mask=r_mask[:, None] & n_mask[None, :], other=0.0)  # [BM, BN]
        acc += tl.dot(tl.trans(x), dy, input_precision=PRECISION)
    tl.store(DW + e * swe + k[:, None] * swk + n[None, :] * swn, acc.to(DW.dtype.element_ty),
             mask=k_mask[:, None] & n_mask[None, :])


@triton.jit
def _group_bwd_lora_kernel(
    U,              # [M, P] grouped rows whose columns index the output rows
    V,              # [M, Q] grouped rows multiplied into the LoRA factor
    L,              # [Q, R·E] LoRA factor; expert e owns columns e·R:(e+1)·R
    OUT,            # [P, R·E] gradient (every element of each expert's columns written)
    offsets,        # [E] int64 expert_offsets (inclusive cumulative counts = end rows)
    P, Q, R,        # sizes
    scaling,        # LoRA scaling s
    s_um, s_up,     # strides of U
    s_vm, s_vq,     # strides of V
    s_lq, s_lr,     # strides of L
    s_op, s_or,     # strides of OUT
    PRECISION: tl.constexpr,  # tl.dot input_precision: "ieee" or "tf32"
    BLOCK_M: tl.constexpr,    # rows per reduction step
    BLOCK_P: tl.constexpr,    # output rows per program
    BLOCK_Q: tl.constexpr,    # inner reduction step over Q
    BLOCK_R: tl.constexpr,    # LoRA rank, padded to a power of two (>= 16 for tl.dot)
):
    e = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)          # [BP]
    p_mask = p < P
    rr = tl.arange(0, BLOCK_R)                                      # [BR]
    r_mask = rr < R
    qq = tl.arange(0, BLOCK_Q)
    mm = tl.arange(0, BLOCK_M)
    start = tl.load(offsets + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets + e)
    acc = tl.full((BLOCK_P, BLOCK_R), 0.0, tl.float32)
    for m0 in range(start, end, BLOCK_M):
        rows = (m0 + mm) < end
        vl = tl.full((BLOCK_M, BLOCK_R), 0.0, tl.float32)           # V[rows] @ L_e
        for q0 in range(0, Q, BLOCK_Q):
            q_mask = (q0 + qq) < Q
            v = tl.load(V + (m0 + mm)[:, None] * s_vm + (q0 + qq)[None, :] * s_vq,
                        mask=rows[:, None] & q_mask[None, :], other=0.0)      # [BM, BQ]
            lf = tl.load(L + (q0 + qq)[:, None] * s_lq + (e * R + rr)[None, :] * s_lr,
                         mask=q_mask[:, None] & r_mask[None, :], other=0.0)   # [BQ, BR]
            vl += tl.dot(v, lf, input_precision=PRECISION)
        u = tl.load(U + (m0 + mm)[:, None] * s_um + p[None, :] * s_up,
                    mask=rows[:, None] & p_mask[None, :], other=0.0)          # [BM, BP]
        acc += tl.dot(tl.trans(u), vl.to(u.dtype), input_precision=PRECISION)
    tl.store(OUT + p[:, None] * s_op + (e * R + rr)[None, :] * s_or,
             (acc * scaling).to(OUT.dtype.element_ty), mask=p_mask[:, None] & r_mask[None, :])


KERNELS = {"scatter2scatter": _scatter2scatter_kernel, "group": _group_kernel,
           "group_bwd_W": _group_bwd_W_kernel, "group_bwd_lora": _group_bwd_lora_kernel}

# Sorted rows per scatter2scatter tile: fixed rather than tuned, because the host cuts each
# expert's rows into tiles of this size before the launch (`ops.expert_tiles`).
TILE_M = 64


def _configs(*rows: tuple) -> list[dict]:
    """(BLOCK sizes dict, num_warps, num_stages) rows -> config dicts."""
    return [dict(blocks, num_warps=w, num_stages=s) for blocks, w, s in rows]


# GPU candidates per kernel and dtype width (16: fp16/bf16 on tensor cores, 32: float32),
# each compiled for sm_75, sm_80, sm_86, sm_89 and sm_90 by benchmarks/compile_report.py and
# held to no spills by the tests. Float32 without TF32 multiplies on the FMA units: a thread
# then holds its whole strip of both operands, so it gets smaller K steps or more warps than
# 16-bit tiles of the same size. Below sm_80 every dot is such a product, 16-bit ones too, and
# the launchers take the float32 list for every dtype there (`launch_plan.dot_plan`): the
# 16-bit tiles spill up to 4 KiB a thread on sm_75. "unaligned": for launches whose sizes or
# strides are not multiples of 16. Triton cannot prove such rows aligned, so every element gets
# its own 64-bit address and load, and the aligned tiles then run out of registers (up to 968
# spilled bytes a thread, sm_80); smaller tiles, unpipelined, keep within them on every
# architecture (32 × 32 scatter2scatter tiles spill 8 bytes on sm_75, group_bwd_lora's 32-row
# tiles over 8 warps 8 on sm_86 and sm_89).
CONFIGS = {
    "scatter2scatter": {
        16: _configs((dict(BLOCK_N=64, BLOCK_K=32), 4, 3), (dict(BLOCK_N=128, BLOCK_K=32), 4, 3),
                     (dict(BLOCK_N=64, BLOCK_K=64), 4, 3), (dict(BLOCK_N=128, BLOCK_K=64), 8, 3)),
        32: _configs((dict(BLOCK_N=32, BLOCK_K=32), 4, 3), (dict(BLOCK_N=64, BLOCK_K=16), 4, 2),
                     (dict(BLOCK_N=128, BLOCK_K=16), 8, 2)),
        "unaligned": _configs((dict(BLOCK_N=32, BLOCK_K=16), 8, 1)),
    },
    "group": {
        16: _configs((dict(BLOCK_M=64, BLOCK_N=64), 4, 1), (dict(BLOCK_M=32, BLOCK_N=128), 4, 1)),
        32: _configs((dict(BLOCK_M=64, BLOCK_N=64), 4, 1), (dict(BLOCK_M=32, BLOCK_N=128), 4, 1)),
    },
    "group_bwd_W": {
        16: _configs((dict(BLOCK_M=64, BLOCK_K=64, BLOCK_N=64), 4, 3),
                     (dict(BLOCK_M=32, BLOCK_K=128, BLOCK_N=64), 4, 3),
                     (dict(BLOCK_M=64, BLOCK_K=64, BLOCK_N=128), 8, 3)),
        32: _configs((dict(BLOCK_M=32, BLOCK_K=64, BLOCK_N=64), 8, 2),
                     (dict(BLOCK_M=16, BLOCK_K=64, BLOCK_N=64), 4, 2)),
        "unaligned": _configs((dict(BLOCK_M=32, BLOCK_K=64, BLOCK_N=64), 8, 1)),
    },
    "group_bwd_lora": {
        16: _configs((dict(BLOCK_M=64, BLOCK_P=64, BLOCK_Q=32), 4, 3),
                     (dict(BLOCK_M=64, BLOCK_P=128, BLOCK_Q=64), 8, 3)),
        32: _configs((dict(BLOCK_M=32, BLOCK_P=64, BLOCK_Q=32), 8, 2),
                     (dict(BLOCK_M=64, BLOCK_P=64, BLOCK_Q=16), 8, 2)),
        "unaligned": _configs((dict(BLOCK_M=16, BLOCK_P=64, BLOCK_Q=16), 4, 1)),
    },
}


def configs(name: str, bits: int, aligned: bool = True) -> list[dict]:
    """The GPU candidates of kernel `name` for a dtype of `bits` (16 or 32) and a launch
    whose sizes and strides are (`aligned`) or are not all multiples of 16."""
    per_width = CONFIGS[name]
    return per_width["unaligned"] if not aligned and "unaligned" in per_width else per_width[bits]


# The sizes whose change can change the best configuration (the autotuner adds the dtypes).
TUNING_KEYS = {"scatter2scatter": ["K", "N", "HAS_LORA", "X_GROUPED", "Y_GROUPED"],
               "group": ["N", "HAS_COEFF"], "group_bwd_W": ["K", "N"],
               "group_bwd_lora": ["P", "Q", "R"]}
# The interpreter pays per program, not per instruction: one large tile each.
INTERPRETER_CONFIG = {
    "scatter2scatter": dict(BLOCK_N=64, BLOCK_K=64),
    "group": dict(BLOCK_M=64, BLOCK_N=64),
    "group_bwd_W": dict(BLOCK_M=64, BLOCK_K=64, BLOCK_N=64),
    "group_bwd_lora": dict(BLOCK_M=64, BLOCK_P=64, BLOCK_Q=64),
}


def interpreting() -> bool:
    """Whether these kernels were built for the Triton interpreter (decided at import)."""
    return interpreted(_scatter2scatter_kernel)
