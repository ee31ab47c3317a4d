"""Compile every Triton kernel of the packages for the GPUs learners meet, no GPU needed.

    python benchmarks/compile_report.py [--out benchmarks/results/compile_report.json]
                                        [--jobs 2] [--arch sm_75,sm_90] [--kernels a,b]
                                        [--sample]

Five architectures (`ARCHS`): sm_75 (T4, Colab's free GPU), sm_80 (A100), sm_86 (A10G,
RTX 30), sm_89 (L4, RTX 40) and sm_90 (H100). What each launcher would compile on a GPU of
each, at the sizes of the benchmarks (multiples of 16, so Triton's divisibility
specialization applies as it would there), for every configuration it can pick there: the
MoE kernels' autotune candidates (`minimoe.kernels.CONFIGS`) from the list
`minimoe.launch_plan.dot_plan` chooses, float32 both exact ("ieee") and with TF32, float16 and
bfloat16; the NF4 dequant kernel for its three uses and three output dtypes; minirl's
log-softmax kernels. One record per kernel × configuration × architecture × dtype
(`gpucompile.KernelReport`): registers, spilled bytes, shared memory, occupancy, global loads
and stores by width, tensor-core instructions. A record whose launch is not what its dtype
asks for says why in `"fallback"` (the plan's words): below sm_80 Triton compiles no
tensor-core dot, so there the dot kernels multiply 16-bit inputs in float32 with the float32
tiles, and TF32 becomes exact float32. The dequant and log-softmax kernels have no dot and
launch alike everywhere (on sm_75, which has no cvt.rn.bf16, Triton rounds float32 to
bfloat16 to nearest even with integer instructions). A few records compile the same kernel at
sizes that are not multiples of 16 (`"sizes": "odd"`): what a launch on awkward shapes gets.
`problems` holds every record to the rules of its architecture.

Then a roofline for each benchmark shape of bench_dequant and bench_moe: bytes the kernel
must move, FLOPs, and the time neither bandwidth nor arithmetic would let it beat, on each
device from its datasheet peaks (`DEVICES`), plus the predicted effect of cutting the MoE
dispatch's row tiles per expert (what `routing.expert_tiles` does) against tiles that span
experts (what it did before).

Compilation only, on a CPU: the whole report takes about four minutes on 2 idle cores. Its
JSON, a list of those records, is committed at benchmarks/results/compile_report.json; the
roofline goes beside it, in roofline.json. `--sample` compiles one job of each kernel, dtype,
architecture and size, a different configuration on each architecture (`sample`): about a
quarter of the jobs, which CI compiles and compares with the committed records.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

from minimoe.launch_plan import DOT_KERNELS, dot_plan  # imports no triton (see main)

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "benchmarks" / "results" / "compile_report.json"
ROOFLINE_NAME = "roofline.json"       # written beside --out
FORK = multiprocessing.get_context("fork")   # workers inherit TRITON_INTERPRET=0 (see main)

# Datasheet peaks, dense (no structured sparsity), as Lab 13 uses them. H100: "NVIDIA H100
# Tensor Core GPU" datasheet, SXM5 column: HBM3 3.35 TB/s; FP32 67 TFLOP/s; TF32 and
# BF16/FP16 tensor cores 989 and 1,979 TFLOP/s *with* sparsity: 494.5 and 989 dense (NVIDIA
# quotes 989 dense BF16; half of 1,979 is 989.5). A100:
# "NVIDIA A100 Tensor Core GPU" datasheet, 80GB SXM column: HBM2e 2,039 GB/s; FP32 19.5;
# TF32 156; BF16/FP16 312 TFLOP/s (dense). SM counts: 132 (H100 SXM5), 108 (A100).
# L4: "NVIDIA L4 Tensor Core GPU" datasheet: GDDR6 300 GB/s; FP32 30.3; TF32 120 and
# BF16/FP16 242 TFLOP/s with sparsity: 60 and 121 dense; 58 SMs (7,424 CUDA cores, 128 an SM).
# A10 (the sm_86 data-center part; AWS's A10G is its variant): "NVIDIA A10 Tensor Core GPU"
# datasheet: GDDR6 600 GB/s; FP32 31.2; TF32 62.5; BF16/FP16 125 TFLOP/s dense; 72 SMs.
# T4: "NVIDIA T4" datasheet: GDDR6 320 GB/s; FP32 8.1 TFLOP/s; FP16 tensor cores 65 TFLOP/s
# (no BF16 or TF32); 40 SMs (2,560 CUDA cores, 64 an SM). These kernels multiply on sm_75's
# FMA units whatever the dtype (minimoe.launch_plan.dot_plan: Triton compiles no tensor-core
# dot below sm_80), so every T4 entry is the FP32 rate.
DEVICES = {
    "H100 SXM": dict(arch="sm_90", sms=132, bandwidth=3.35e12,
                     flops=dict(fp32=67e12, tf32=494.5e12, fp16=989e12, bf16=989e12)),
    "A100 SXM 80GB": dict(arch="sm_80", sms=108, bandwidth=2.039e12,
                          flops=dict(fp32=19.5e12, tf32=156e12, fp16=312e12, bf16=312e12)),
    "L4": dict(arch="sm_89", sms=58, bandwidth=300e9,
               flops=dict(fp32=30.3e12, tf32=60e12, fp16=121e12, bf16=121e12)),
    "A10": dict(arch="sm_86", sms=72, bandwidth=600e9,
                flops=dict(fp32=31.2e12, tf32=62.5e12, fp16=125e12, bf16=125e12)),
    "T4": dict(arch="sm_75", sms=40, bandwidth=320e9,
               flops=dict(fp32=8.1e12, tf32=8.1e12, fp16=8.1e12, bf16=8.1e12)),
}
DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "fp16": torch.float16,
          "bf16": torch.bfloat16}
# sm_75: T4 (Colab's free GPU); sm_80: A100; sm_86: A10G, RTX 30; sm_89: L4, RTX 40; sm_90: H100.
ARCHS = ("sm_75", "sm_80", "sm_86", "sm_89", "sm_90")
# The input dtypes each architecture's tensor cores multiply (mma.sync, SASS HMMA): float16
# from sm_75, bfloat16 and TF32 from sm_80; sm_90 adds wgmma (HGMMA), counted with HMMA.
TENSOR_CORE_DTYPES = {"sm_75": {"fp16"}, **{a: {"fp16", "bf16", "tf32"} for a in ARCHS[1:]}}
# The one exception to "128-bit loads at aligned sizes" (`_width_rules`), and why.
NARROW_LOADS = {("group_bwd_W", "tf32"): (
    "its dot's operands, Xᵀ and DY, are M- and N-major in memory, and tensor cores take TF32 "
    "operands K-major only (ldmatrix and wgmma transpose 16-bit elements only): Triton "
    "transposes them into shared memory 4 bytes at a time, one operand from sm_80 to sm_89, "
    "both on sm_90")}

# The sizes the records are compiled at: bench_moe's Qwen3-30B-A3B expert linear (E = 128,
# top-8, d_model 2048, d_ff 768, 4096 tokens), a 4096 × 4096 weight for the dequant, a
# Qwen-sized vocabulary for the log-softmax. "odd": the same kernels at sizes no power of two
# divides (as the CPU tests use).
MOE = dict(T=4096, k=8, E=128, K=2048, N=768, R=16)
MOE_ODD = dict(T=33, k=2, E=5, K=40, N=24, R=3)
DEQUANT_N = 4096 * 4096
VOCAB = dict(N=1024, V=151936)


# ----------------------------------------------------------------------------- the jobs


def _plan(kernel: str, dtype: str, arch: str) -> dict:
    """A dot kernel's launch on `arch` (minimoe.launch_plan.dot_plan): its configuration
    list's width (`bits`), tl.dot's precision and, where it is not what the dtype asks for,
    the fallback."""
    if kernel not in DOT_KERNELS:
        return dict(bits=32 if DTYPES[dtype] == torch.float32 else 16)
    capability = (int(arch[3:-1]), int(arch[-1]))                      # "sm_86" -> (8, 6)
    plan = dot_plan(capability, DTYPES[dtype], tf32=dtype == "tf32")
    fallback = {} if plan.fallback is None else dict(fallback=plan.fallback)
    return dict(bits=plan.bits, precision=plan.precision, **fallback)


def _variants(name: str) -> list[dict]:
    """The constexpr variants of MoE kernel `name` that change its code."""
    if name == "scatter2scatter":
        return [dict(pass_=p, lora=lora) for p in ("fwd", "dX") for lora in (False, True)]
    if name == "group":
        return [dict(coeff=c) for c in (False, True)]
    return [{}]


def jobs(kernels: set[str] | None = None, archs=ARCHS) -> list[dict]:
    """Every (kernel, variant, config, dtype, arch, sizes) to compile, as plain dicts; a dot
    kernel's also carry its plan's precision and fallback (`_plan`)."""
    from minimoe.kernels import CONFIGS, configs
    from minirl import logprob_kernels as L

    out = []

    def add(kernel, variant, config, dtype, arch, sizes="aligned", **plan):
        if not kernels or kernel in kernels:
            plan.pop("bits", None)
            out.append(dict(kernel=kernel, variant=variant, config=config, dtype=dtype,
                            arch=arch, sizes=sizes, **plan))

    dequant = dict(BYTES=1024, num_warps=4, num_stages=3)
    for use in ("whole", "selective", "selective_dq"):
        for dtype in ("fp32", "fp16", "bf16"):
            for arch in archs:
                add("nf4_dequant", dict(use=use), dequant, dtype, arch)
    for arch in archs:
        add("nf4_dequant", dict(use="whole"), dequant, "bf16", arch, "odd")
    for name in CONFIGS:
        for variant in _variants(name):
            for dtype in ("fp32", "fp16", "bf16") if name == "group" else DTYPES:
                for arch in archs:
                    plan = _plan(name, dtype, arch)
                    for config in configs(name, plan["bits"]):
                        add(name, variant, config, dtype, arch, **plan)
                    for config in configs(name, plan["bits"], aligned=False) \
                            if dtype in ("fp32", "bf16") else ():
                        add(name, variant, config, dtype, arch, "odd", **plan)
    block_r, block_v = L.blocks(VOCAB["N"], VOCAB["V"])
    rows = dict(BLOCK_R=block_r, BLOCK_V=block_v,
                num_warps=8 if block_r * block_v >= L.TILE else 4, num_stages=3)
    for flags in (dict(HAS_IDS=True), dict(HAS_IDS=False)):
        for dtype in ("fp32", "bf16"):
            for arch in archs:
                add("logsoftmax_fwd", flags, rows, dtype, arch)
    for flags in (dict(HAS_G_LOGP=True, HAS_G_H=True), dict(HAS_G_LOGP=True, HAS_G_H=False)):
        for dtype in ("fp32", "bf16"):
            for arch in archs:
                add("logsoftmax_bwd", flags, rows, dtype, arch)
    return out


def sample(todo: list[dict]) -> list[dict]:
    """One job of each (kernel, dtype, arch, sizes) of `todo`: the i-th of its group on the
    i-th architecture of ARCHS (cyclically), so that every kernel, dtype and architecture is
    compiled, and across the architectures most configurations."""
    groups: dict[tuple, list[dict]] = {}
    for job in todo:
        groups.setdefault((job["kernel"], job["dtype"], job["arch"], job["sizes"]), []).append(job)
    return [group[ARCHS.index(arch) % len(group)] for (_, _, arch, _), group in groups.items()]


def key(r: dict) -> tuple:
    """What names a job and its record: kernel, dtype, arch, sizes and the configuration (the
    variant's flags with the launch's; a record holds them merged as "config")."""
    config = dict(r["variant"], **r["config"]) if "variant" in r else r["config"]
    return r["kernel"], r["dtype"], r["arch"], r["sizes"], json.dumps(config, sort_keys=True)


def _moe_launch(job) -> tuple:
    """(kernel, args, kwargs) of one MoE kernel launch, as ops.py makes it."""
    from gpucompile import like
    from minimoe import kernels as K

    s = MOE if job["sizes"] == "aligned" else MOE_ODD
    t, i = like(DTYPES[job["dtype"]]), like(torch.int64)
    M, Kd, N, E, R = s["T"] * s["k"], s["K"], s["N"], s["E"], s["R"]
    precision = job.get("precision", "ieee")
    c = dict(job["config"])
    kw = dict(num_warps=c.pop("num_warps"), num_stages=c.pop("num_stages"), **c)
    v = job["variant"]
    if job["kernel"] == "scatter2scatter":
        lora, dx = v["lora"], v["pass_"] == "dX"
        # dX = dY @ Wᵀ: K and N trade places and Wᵀ is read through transposed strides.
        Kin, Nout = (N, Kd) if dx else (Kd, N)
        w_strides = (Kd * N, 1, N) if dx else (Kd * N, N, 1)
        args = (t, t, t, i, i, i, i, Kin, Nout, Kin, 1, *w_strides, Nout, 1,
                t, t, R, 2.0, Kin, 1, R * E, 1)
        kw.update(FAN_OUT=1 if dx else s["k"], X_GROUPED=dx, Y_GROUPED=False, HAS_LORA=lora,
                  PRECISION=precision, BLOCK_M=K.TILE_M, BLOCK_R=16)
    elif job["kernel"] == "group":
        args = (t, t, t, i, M, Kd, Kd, 1, Kd, 1)
        kw.update(FAN_OUT=s["k"], HAS_COEFF=v["coeff"])
    elif job["kernel"] == "group_bwd_W":
        args = (t, t, t, i, Kd, N, N, 1, Kd, 1, Kd * N, N, 1)
        kw.update(PRECISION=precision)
    else:                                  # group_bwd_lora, dB = f(U=dY, V=X, L=Aᵀ)
        args = (t, t, t, t, i, N, Kd, R, 2.0, N, 1, Kd, 1, 1, Kd, R * E, 1)
        kw.update(PRECISION=precision, BLOCK_R=16)
    return K.KERNELS[job["kernel"]], args, kw


def _other_launch(job) -> tuple:
    """(kernel, args, kwargs) of the dequant and log-softmax launches."""
    from gpucompile import like
    from miniquant import dequant_kernel as D
    from minirl import logprob_kernels as L

    f32, i64 = like(torch.float32), like(torch.int64)
    out = like(DTYPES[job["dtype"]])
    if job["kernel"] == "nf4_dequant":
        n = DEQUANT_N if job["sizes"] == "aligned" else 999 * 1001
        use = job["variant"]["use"]
        args = (like(torch.uint8), f32, f32, i64, out, n, (n + 1) // 2)
        kw = dict(BLOCKSIZE=64, GATHER=use != "whole", SCALES_BY_ROW=use == "selective_dq",
                  BF16_BY_HAND=False, **job["config"])
        return D._nf4_dequant_kernel, args, kw
    N, V = VOCAB["N"], VOCAB["V"]
    kw = dict(job["variant"], **job["config"])
    if job["kernel"] == "logsoftmax_fwd":
        return L._logsoftmax_stats_fwd_kernel, (out, i64, f32, f32, f32, f32, N, V, V, 1), kw
    return (L._logsoftmax_stats_bwd_kernel, (out, i64, f32, f32, f32, f32, f32, out, N, V, V, 1),
            kw)


def run_job(job: dict) -> dict:
    """Compile one job and read its cubin: the job's fields plus the KernelReport's (without
    the compile time, which would make the committed file differ on every run), or `error`."""
    from gpucompile import inspect_kernel

    moe = job["kernel"] in (*DOT_KERNELS, "group")
    fn, args, kw = (_moe_launch if moe else _other_launch)(job)
    head = dict(kernel=job["kernel"], arch=job["arch"], dtype=job["dtype"],
                config=dict(job["variant"], **job["config"]), sizes=job["sizes"],
                **({"fallback": job["fallback"]} if "fallback" in job else {}))
    try:
        report = inspect_kernel(fn, args, kw, job["arch"]).as_dict()
    except Exception as e:  # noqa: BLE001  (a kernel that no longer compiles is a finding)
        return dict(head, error=f"{type(e).__name__}: {str(e)[:2000]}")
    for key in ("kernel", "arch", "compile_s"):
        report.pop(key)
    head["config"].update(num_warps=report.pop("num_warps"), num_stages=report.pop("num_stages"))
    return dict(head, **report)


def _name(r: dict) -> str:
    _, dtype, arch, sizes, config = key(r)
    return f"{r['kernel']} {dtype} {arch} {config} {sizes}"


def _width_rules(r: dict) -> list[str]:
    """At aligned sizes: the NF4 dequant reads its packed bytes 8 at a time or more and stores
    8 bytes or more at a time; every other kernel loads 128 bits at a time somewhere (but
    those of NARROW_LOADS)."""
    if r["kernel"] != "nf4_dequant":
        ok = "128" in r["global_loads"] or (r["kernel"], r["dtype"]) in NARROW_LOADS
        return [] if ok else [f"no 128-bit loads at aligned sizes ({r['global_loads']})"]
    found = []
    if "8" in r["global_loads"]:
        found.append(f"loads packed bytes one at a time ({r['global_loads']})")
    if min(int(b) for b in r["global_stores"]) < 64:
        found.append(f"stores narrower than 8 bytes ({r['global_stores']})")
    return found


def _dot(r: dict) -> list[str]:
    """A dot kernel's tensor cores: on them for every dtype its architecture's tensor cores
    take (TENSOR_CORE_DTYPES), off them for exact float32, and, where the launch falls back
    (the record says why), off them as it says; a dtype the tensor cores do not take must
    fall back."""
    cores, dtype, arch = r["tensor_core_instructions"], r["dtype"], r["arch"]
    if "fallback" in r:
        return [f"falls back ({r['fallback']}) yet has {cores} tensor-core instructions"] \
            if cores else []
    if dtype == "fp32":
        return [f"an exact float32 dot uses tensor cores ({cores})"] if cores else []
    if dtype not in TENSOR_CORE_DTYPES[arch]:
        return [f"a {dtype} dot launched as on tensor cores, which {arch} has not for {dtype}"]
    return [] if cores else [f"a {dtype} dot without tensor-core instructions"]


def problems(records: list[dict], expected: list[dict] = ()) -> list[str]:
    """What the tests and CI refuse, one line each: a kernel that failed to compile, a job of
    `expected` (`jobs()`) with no record, any spilled register, a block that fits no SM, the
    access widths of `_width_rules` at aligned sizes, and the tensor-core rules of `_dot`."""
    found = []
    for r in records:
        if "error" in r:
            found.append(f"{_name(r)}: does not compile: {r['error'][:300]}")
            continue
        lines = _width_rules(r) if r["sizes"] == "aligned" else []
        if r["spill_bytes"]:
            lines.append(f"spills {r['spill_bytes']} bytes per thread ({r['registers']} "
                         f"registers)")
        if not r["occupancy"]:
            lines.append(f"fits no SM ({r['registers']} registers, {r['shared_bytes']} bytes "
                         f"of shared memory)")
        found += [f"{_name(r)}: {line}" for line in lines
                  + (_dot(r) if r["kernel"] in DOT_KERNELS else [])]
    have = {key(r) for r in records}
    return found + [f"{_name(job)}: not compiled" for job in expected if key(job) not in have]


# ----------------------------------------------------------------------------- the roofline


def _roofline(bytes_moved: float, flops: float, precision: str) -> dict:
    """Time bounds on each device: bytes / bandwidth, FLOPs / peak, the larger of the two."""
    out = {}
    for name, d in DEVICES.items():
        t_mem, t_math = bytes_moved / d["bandwidth"], flops / d["flops"][precision]
        out[name] = dict(time_us=round(max(t_mem, t_math) * 1e6, 2),
                         bound="memory" if t_mem >= t_math else "compute")
    return out


def dequant_roofline() -> list[dict]:
    """bench_dequant's full shapes: read n/2 packed bytes and 4n/64 absmax, write n outputs."""
    rows = []
    for shape in ((4096, 4096), (4096, 14336), (14336, 4096)):
        n = shape[0] * shape[1]
        for dtype, size in (("bf16", 2), ("fp32", 4)):
            moved = n / 2 + 4 * n / 64 + n * size
            rows.append(dict(bench="bench_dequant", shape=list(shape), dtype=dtype,
                             bytes=int(moved), flops=n, device=_roofline(moved, n, "fp32")))
    return rows


def _routing_counts(T: int, k: int, E: int) -> torch.Tensor:
    """Rows per expert of a uniform top-k routing of T tokens (seeded): [E]."""
    g = torch.Generator().manual_seed(0)
    experts = torch.rand(T, E, generator=g).topk(k, dim=1).indices
    return torch.bincount(experts.reshape(-1), minlength=E)


def tiling(counts: torch.Tensor, block_m: int) -> dict:
    """Row tiles of the sorted rows, cut per expert or in fixed spans of block_m rows:
    tiles (programs per column block), expert K-loops in all and in the longest tile."""
    nonzero = counts[counts > 0]
    per_expert = int(((nonzero + block_m - 1) // block_m).sum())
    ends = torch.cumsum(counts, 0)
    M = int(ends[-1])
    spans = []
    for start in range(0, M, block_m):
        last = min(start + block_m, M) - 1
        first_e = int(torch.searchsorted(ends, torch.tensor(start), right=True))
        last_e = int(torch.searchsorted(ends, torch.tensor(last), right=True))
        spans.append(last_e - first_e + 1)
    return dict(spanning=dict(tiles=len(spans), k_loops=sum(spans), longest=max(spans)),
                per_expert=dict(tiles=per_expert, k_loops=per_expert, longest=1))


def moe_roofline(block_m: int = 64, block_n: int = 64) -> list[dict]:
    """bench_moe's shapes (4096 tokens, and 256 as in decoding), bf16 forward of the expert
    linear: bytes (X, the routed experts' W, Y), FLOPs 2·M·K·N; and for both tilings the
    issued work (every K loop is a full block_m-row product) and a predicted time: the
    largest of the memory time, the issued FLOPs at peak, and the longest program's K loops
    in series on one SM (1/sms of the peak)."""
    rows = []
    models = {"mixtral-8x7b": (8, 2, 4096, 14336), "qwen3-30b-a3b": (128, 8, 2048, 768),
              "olmoe-1b-7b": (64, 8, 2048, 1024)}
    for model, (E, k, K, N) in models.items():
        for T in (4096, 256):
            counts = _routing_counts(T, k, E)
            M, size = T * k, 2
            used = int((counts > 0).sum())
            moved = (T * K + used * K * N + M * N) * size
            flops = 2 * M * K * N
            row = dict(bench="bench_moe", model=model, tokens=T, E=E, k=k, K=K, N=N,
                       dtype="bf16", bytes=moved, flops=flops,
                       device=_roofline(moved, flops, "bf16"), tiling={})
            for name, t in tiling(counts, block_m).items():
                issued = t["k_loops"] * 2 * block_m * K * N
                predicted = {}
                for dev, d in DEVICES.items():
                    # One SM runs the longest program's K loops at 1/sms of the peak.
                    per_sm = d["flops"]["bf16"] / d["sms"]
                    serial = t["longest"] * 2 * block_m * K * block_n / per_sm
                    bound = max(moved / d["bandwidth"], issued / d["flops"]["bf16"], serial)
                    predicted[dev] = round(bound * 1e6, 2)
                # W tiles are re-read once per K loop, mostly from L2 (tiles of one expert
                # run side by side), so DRAM bytes stay `moved`; the L2 traffic grows.
                row["tiling"][name] = dict(t, issued_flops=issued,
                                           w_tile_bytes=t["k_loops"] * K * N * size,
                                           predicted_us=predicted)
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- output


def _widths(d: dict) -> str:
    return " ".join(f"{n}x{bits}" for bits, n in d.items()) or "-"


def table(records: list[dict]) -> str:
    """The records as a fixed-width text table."""
    head = (f"{'kernel':16} {'variant':28} {'dtype':5} {'config':44} {'arch':5} {'regs':>4} "
            f"{'spill':>5} {'smem':>6} {'occ':>4} {'TC':>3}  loads (count x bits) | stores")
    lines = [head, "-" * len(head)]
    for r in records:
        if "error" in r:
            lines.append(f"{r['kernel']:16} {r['dtype']:5} {r['arch']:5} ERROR {r['error'][:80]}")
            continue
        variant = ",".join(f"{k}={v}" for k, v in r["config"].items()
                           if not k.startswith("BLOCK") and not k.startswith("num_")
                           and k not in ("BYTES",)) + ("" if r["sizes"] == "aligned" else " odd") \
            + (" fallback" if "fallback" in r else "")
        config = " ".join(f"{k.removeprefix('BLOCK_')}={v}" for k, v in r["config"].items()
                          if k.startswith("BLOCK") or k.startswith("num_") or k == "BYTES")
        config = config.replace("num_warps", "w").replace("num_stages", "s")
        lines.append(f"{r['kernel']:16} {variant[:28]:28} {r['dtype']:5} {config[:44]:44} "
                     f"{r['arch']:5} {r['registers']:>4} {r['spill_bytes']:>5} "
                     f"{r['shared_bytes']:>6} {r['occupancy']:>4.2f} "
                     f"{r['tensor_core_instructions']:>3}  {_widths(r['global_loads'])} | "
                     f"{_widths(r['global_stores'])}")
    return "\n".join(lines)


def roofline_table(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        what = (f"dequant {r['shape'][0]}x{r['shape'][1]} {r['dtype']}" if r["bench"] ==
                "bench_dequant" else f"moe {r['model']} T={r['tokens']} {r['dtype']}")
        times = "  ".join(f"{d}: {v['time_us']:.1f} us ({v['bound']})"
                          for d, v in r["device"].items())
        lines.append(f"{what:36} {r['bytes'] / 1e6:9.1f} MB {r['flops'] / 1e9:9.1f} GFLOP  "
                     f"{times}")
        for name, t in r.get("tiling", {}).items():
            pred = "  ".join(f"{d}: {v:.1f} us" for d, v in t["predicted_us"].items())
            lines.append(f"    tiles {name:10} {t['tiles']:5} tiles, {t['k_loops']:5} K loops, "
                         f"longest {t['longest']:3}  predicted {pred}")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(DEFAULT_OUT), help="the JSON report")
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    p.add_argument("--arch", default=",".join(ARCHS), help="comma-separated subset of "
                   + ", ".join(ARCHS))
    p.add_argument("--kernels", default="", help="comma-separated kernel names (default: all)")
    p.add_argument("--sample", action="store_true", help="one job of each kernel, dtype, "
                   "architecture and size (what CI compiles)")
    args = p.parse_args(argv)
    args.arch = [a for a in args.arch.split(",") if a]
    if set(args.arch) - set(ARCHS):
        p.error(f"--arch: choose from {ARCHS}")
    args.kernels = {k for k in args.kernels.split(",") if k} or None
    return args


def main(argv=None) -> int:
    # Compiled kernels, not the interpreter's: decided before anything imports triton (the
    # worker processes are forked from this one and inherit it).
    os.environ["TRITON_INTERPRET"] = "0"
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from tqdm import tqdm

    from labkit.atomic import atomic_write_text

    args = parse_args(argv)
    todo = jobs(args.kernels, args.arch)
    todo = sample(todo) if args.sample else todo
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.jobs), mp_context=FORK) as pool:
        records = list(tqdm(pool.map(run_job, todo), total=len(todo), desc="compiling",
                            file=sys.stderr))
    seconds = time.perf_counter() - start
    rooflines = dequant_roofline() + moe_roofline()
    import triton

    roofline = dict(triton=triton.__version__, devices=DEVICES, shapes=rooflines)
    out = Path(args.out)
    print(table(records))
    print()
    print(roofline_table(rooflines))
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out, json.dumps(records, indent=1) + "\n")
    atomic_write_text(out.with_name(ROOFLINE_NAME), json.dumps(roofline, indent=1) + "\n")
    print(f"\n{len(records)} compilations (triton {triton.__version__}) in {seconds:.0f} s; "
          f"wrote {out} and {out.with_name(ROOFLINE_NAME)}")
    found = problems(records, todo)
    for line in found:
        print(f"PROBLEM {line}")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
