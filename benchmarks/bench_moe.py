"""MoE expert linear: Triton parallel_linear vs the sort-based PyTorch path vs a per-expert loop.

    python benchmarks/bench_moe.py [--tiny] [--device cpu|cuda] [--scale S] [--tokens T]
                                   [--models mixtral,qwen3-30b-a3b,olmoe] [--out path.json]

One expert linear of a top-k MoE layer, the gate/up projection shape W [E, d_model, d_ff],
with the gates mixing each token's k outputs: out[t] = Σ_j g[t,j] · x[t] @ W[e(t,j)]
(`parallel_linear(x, W, flatten_sort_count(experts, E), gates=g)`). Methods, all timed
from the [T, k] routing (the sort / the per-expert masks are inside the timing):

- `triton`: `parallel_linear(backend="triton")` (ScatterMoE: sort once, one grouped GEMM),
  expert LoRA fused into the same kernels (`scatter2scatter_lora`, `group_bwd_lora`);
- `triton_split`: the same, with LoRA as two more expert linears (`lora_path="split"`);
  without LoRA it is `triton` timed a second time (a measure of the timing noise);
- `torch_sorted`: `parallel_linear(backend="torch")`, the same sorted order in PyTorch
  (gather, one matmul per expert slice, scatter), autograd backward;
- `loop`: the per-expert PyTorch loop of Hugging Face's Mixtral / `minimoe.dispatch_torch`
  (`per_expert_loop` below): for each expert, find its tokens, gather, matmul, scale by the
  gate, index_add back. This is the baseline of the target "MoE fwd+bwd ≥ 2× a per-expert
  PyTorch loop at many-expert shapes" (docs/ARCHITECTURE.md, Performance targets).

Each method also runs with expert LoRA (rank --rank on every expert, A [r·E, d_model],
B [d_ff, r·E]); `lora_overhead` = time(with LoRA) / time(base) − 1, same method and pass
(the target for `triton`: ≤ 0.20). Passes: `fwd` (no grad) and `fwd+bwd` (forward and
`autograd.grad` for x, gates, W, and A, B with LoRA: the base weight is trained too, so the
ratio counts only what LoRA adds).

Units: TFLOP/s of the base linear, 2·T·k·K·N per forward and ×3 for fwd+bwd (dX and dW),
plus 2·T·k·r·(K+N) (×3) with LoRA. Every ratio comes from the same run. Timing: median over
repeats after warm-up, CUDA events on a GPU. Shapes are the real models' (Mixtral-8x7B,
Qwen3-30B-A3B, OLMoE-1B-7B) with d_model and d_ff divided by --scale. On CPU the Triton
kernels run in the interpreter (NumPy, one program at a time, float32 only): `--tiny` uses
scale 128, 8 tokens and one repeat, and only shows that the script works.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))   # timing.py, also when loaded by path
from timing import median_seconds  # noqa: E402

# name -> (E experts, top-k, d_model, d_ff of one expert)
MODELS = {
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "olmoe-1b-7b": (64, 8, 2048, 1024),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
METHODS = ("triton", "triton_split", "torch_sorted", "loop")
PASSES = ("fwd", "fwd+bwd")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true",
                   help="CPU smoke run: scale 128, 8 tokens, 1 repeat, no warm-up")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--models", default=",".join(MODELS),
                   help=f"comma-separated subset of {', '.join(MODELS)}")
    p.add_argument("--scale", type=int, default=None,
                   help="divide d_model and d_ff by this (default 1 on cuda, 128 on cpu)")
    p.add_argument("--tokens", type=int, default=None, help="default: 4096 on cuda, 8 on cpu")
    p.add_argument("--rank", type=int, default=16, help="expert LoRA rank")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="default: bf16 on cuda, fp32 on cpu (the interpreter is float32-only)")
    p.add_argument("--repeats", type=int, default=None, help="default: 20 on cuda, 1 on cpu")
    p.add_argument("--warmup", type=int, default=None, help="default: 5 on cuda, 0 on cpu")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    cuda = args.device == "cuda" and not args.tiny
    args.scale = args.scale or (1 if cuda else 128)
    args.tokens = args.tokens or (4096 if cuda else 8)
    args.dtype = args.dtype or ("bf16" if args.device == "cuda" else "fp32")
    args.repeats = args.repeats or (20 if cuda else 1)
    args.warmup = args.warmup if args.warmup is not None else (5 if cuda else 0)
    args.models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = set(args.models) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}; choose from {list(MODELS)}")
    if args.device == "cpu" and args.dtype != "fp32":
        p.error("on cpu the Triton interpreter is float32-only: use --dtype fp32")
    return args


def per_expert_loop(x, W, gates, experts, lora_A=None, lora_B=None, scaling=1.0):
    """The baseline: out[t] = Σ_j gates[t,j] · x[t] @ W[experts[t,j]], one expert at a time.

    x [T, K], W [E, K, N], gates / experts [T, k]; LoRA A [r·E, K], B [N, r·E] as in
    parallel_linear. Experts without tokens are skipped (one host sync per expert to know).
    """
    E = W.shape[0]
    r = 0 if lora_A is None else lora_A.shape[0] // E
    out = x.new_zeros(x.shape[0], W.shape[2])
    for e in range(E):
        token, slot = (experts == e).nonzero(as_tuple=True)     # this expert's (token, slot)s
        if token.numel() == 0:
            continue
        xe = x[token]                                           # [n_e, K] gather
        y = xe @ W[e]                                           # [n_e, N]
        if r:
            y = y + scaling * ((xe @ lora_A[e * r:(e + 1) * r].T) @ lora_B[:, e * r:(e + 1) * r].T)
        out = out.index_add(0, token, y * gates[token, slot, None].to(y.dtype))
    return out


def make_method(name: str):
    from minimoe import ExpertLoRA, flatten_sort_count, parallel_linear

    if name == "loop":
        return per_expert_loop
    backend = "torch" if name == "torch_sorted" else "triton"
    lora_path = "split" if name == "triton_split" else "fused"

    def sorted_method(x, W, gates, experts, lora_A=None, lora_B=None, scaling=1.0):
        routing = flatten_sort_count(experts, W.shape[0])       # k from experts [T, k]
        lora = None if lora_A is None else ExpertLoRA(lora_A, lora_B, scaling)
        return parallel_linear(x, W, routing, gates=gates, lora=lora, backend=backend,
                               lora_path=lora_path)

    return sorted_method


def bench_model(model: str, args, dtype) -> list[dict]:
    E, k, d_model, d_ff = MODELS[model]
    K, N, T, r = max(1, d_model // args.scale), max(1, d_ff // args.scale), args.tokens, args.rank
    dev = args.device
    gen = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, K, device=dev, generator=gen).to(dtype)
    W = (torch.randn(E, K, N, device=dev, generator=gen) / K ** 0.5).to(dtype)
    logits = torch.randn(T, E, device=dev, generator=gen)
    gates, experts = logits.softmax(-1).topk(k, dim=-1)                   # [T, k] each
    gates = (gates / gates.sum(-1, keepdim=True)).to(dtype)
    A = (torch.randn(r * E, K, device=dev, generator=gen) / K ** 0.5).to(dtype)
    B = (torch.randn(N, r * E, device=dev, generator=gen) / r ** 0.5).to(dtype)
    scaling = 2.0
    dout = torch.randn(T, N, device=dev, generator=gen).to(dtype)

    methods = {m: make_method(m) for m in METHODS}
    # A benchmark of a wrong kernel is meaningless: check every method against the loop.
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    ref = per_expert_loop(x.float(), W.float(), gates.float(), experts, A.float(), B.float(),
                          scaling)
    for name, fn in methods.items():
        got = fn(x, W, gates, experts, A, B, scaling).float()
        err = float((got - ref).abs().max() / ref.abs().max())
        if err > tol:
            raise AssertionError(f"{model}: {name} disagrees with the loop (rel err {err:.2e})")

    base_flops = 2 * T * k * K * N
    lora_flops = 2 * T * k * r * (K + N)
    rows = []
    for name, fn in methods.items():
        for lora in (False, True):
            extra = (A, B, scaling) if lora else (None, None, 1.0)
            leaves = (x, gates, W) + ((A, B) if lora else ())
            for pass_ in PASSES:
                if pass_ == "fwd":
                    def run(fn=fn, extra=extra):
                        with torch.no_grad():
                            fn(x, W, gates, experts, *extra)
                else:
                    def run(fn=fn, lora=lora, leaves=leaves):
                        ins = [t.detach().requires_grad_() for t in leaves]
                        a_b = (ins[3], ins[4], scaling) if lora else (None, None, 1.0)
                        out = fn(ins[0], ins[2], ins[1], experts, *a_b)
                        torch.autograd.grad(out, ins, dout)
                seconds = median_seconds(run, dev, args.repeats, args.warmup)
                mult = 1 if pass_ == "fwd" else 3
                flops = mult * (base_flops + (lora_flops if lora else 0))
                rows.append(dict(model=model, E=E, k=k, K=K, N=N, T=T, method=name,
                                 lora_rank=r if lora else 0, pass_=pass_, median_s=seconds,
                                 flops=flops, tflops=flops / seconds / 1e12))
    for row in rows:                                            # ratios from this same run
        loop = next(o for o in rows if o["method"] == "loop" and o["pass_"] == row["pass_"]
                    and o["lora_rank"] == row["lora_rank"])
        row["speedup_vs_loop"] = loop["median_s"] / row["median_s"]
        if row["lora_rank"]:
            base = next(o for o in rows if o["method"] == row["method"]
                        and o["pass_"] == row["pass_"] and o["lora_rank"] == 0)
            row["lora_overhead"] = row["median_s"] / base["median_s"] - 1
    for row in rows:
        row["pass"] = row.pop("pass_")
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'model':>14} {'E':>4} {'k':>2} {'K':>5} {'N':>6} {'T':>5} {'method':>13} "
          f"{'lora':>4} {'pass':>8} {'time (ms)':>10} {'TFLOP/s':>8} {'vs loop':>8} "
          f"{'lora ovh':>8}")
    for r in rows:
        ovh = f"{r['lora_overhead']:8.1%}" if "lora_overhead" in r else f"{'':>8}"
        print(f"{r['model']:>14} {r['E']:>4} {r['k']:>2} {r['K']:>5} {r['N']:>6} {r['T']:>5} "
              f"{r['method']:>13} {r['lora_rank']:>4} {r['pass']:>8} "
              f"{r['median_s'] * 1e3:10.3f} {r['tflops']:8.3g} {r['speedup_vs_loop']:7.2f}x "
              f"{ovh}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cpu":
        # Decide before minimoe imports triton: CPU tensors need the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import minimoe  # noqa: F401  (makes the TRITON_INTERPRET decision)

    dtype = DTYPES[args.dtype]
    rows = [r for m in args.models for r in bench_model(m, args, dtype)]
    result = dict(
        device=args.device,
        device_name=(torch.cuda.get_device_name() if args.device == "cuda"
                     else platform.processor() or platform.machine()),
        triton_interpreter=os.environ.get("TRITON_INTERPRET") == "1",
        dtype=args.dtype, scale=args.scale, tokens=args.tokens, lora_rank=args.rank,
        repeats=args.repeats, warmup=args.warmup,
        versions=dict(python=sys.version.split()[0], torch=torch.__version__,
                      triton=triton.__version__),
        flops_counted="2·T·k·K·N per forward (+ 2·T·k·r·(K+N) with LoRA), x3 for fwd+bwd",
        results=rows,
    )
    interp = " (Triton interpreter)" if result["triton_interpreter"] else ""
    print(f"MoE expert linear, {args.dtype}, {args.tokens} tokens, d/{args.scale}, "
          f"{result['device_name']}{interp}")
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
