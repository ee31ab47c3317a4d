"""Selective log-softmax and entropy from logits [rows, vocab]: Triton kernels vs PyTorch,
forward + backward, time and peak memory from one run.

    python benchmarks/bench_logprobs.py [--tiny] [--device cpu|cuda] [--dtype bf16|fp16|fp32]
                                        [--shapes ROWSxVOCAB,...] [--out path.json]

Two tasks, each timed as a user calls it (argument and finiteness checks included):

- `logp`: `selective_log_softmax(logits, ids, backend=...)`, what `token_logprobs` and so
  the GRPO loss run. Both backends pass the same front door (`check_logits`: one max
  reduction over the logits and one host sync), then `torch` is gather − logsumexp (bf16 /
  fp16 logits copied to float32 first) and `triton` the streaming kernel;
- `logp+entropy`: `torch` is that plus `entropy_from_logits` (its own `check_logits`, then
  log_softmax, exp, product, sum); `triton` is `logprobs_and_entropy_triton` (its checks
  look at [rows] vectors only), both outputs from one pass each way.

Each repeat is a forward and `autograd.grad` of the sum of the outputs for the logits.
Units: time in ms; GB/s counts the least traffic any implementation needs, the logits read
once forward and once backward and their gradient written (3 · rows · vocab · element size),
so it says how close each gets to DRAM bandwidth. `ratio` = torch time / triton time (above
1: Triton is faster). Memory: `peak_extra_mib` is torch.cuda.max_memory_allocated() during
one forward + backward minus what was allocated before (the logits, made beforehand, are
not counted; the [rows, vocab] gradient both produce is), and `saved_mib` the difference
torch − triton: the [rows, vocab] float32 tensors the PyTorch path keeps for its backward
or builds while it runs, which the kernels never create.

A PyTorch path that runs out of device memory (the largest shapes hold several
[rows, vocab] float32 tensors at once) is reported as skipped, with no ratio; the Triton
path of that shape is then still timed, checked against PyTorch on the smaller shapes.
Timing: median over repeats after warm-up, CUDA events on a GPU. On CPU the kernels run in
Triton's interpreter (NumPy, float32 only): CPU mode uses tiny shapes and no memory figures,
and only shows that the script works. Results are not committed.
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

SHAPES = {"tiny": [(16, 300), (64, 1000)],
          "full": [(4096, 32000), (4096, 151936), (16384, 32000), (16384, 151936)]}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TASKS = ("logp", "logp+entropy")


def shape_list(text: str) -> list[tuple[int, int]]:
    """"4096x32000,16384x151936" -> [(4096, 32000), (16384, 151936)]."""
    try:
        shapes = [tuple(int(n) for n in item.lower().split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"expected ROWSxVOCAB[,ROWSxVOCAB...], got {text!r}")
    return shapes


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes (always used on CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                   help="logits dtype; default bf16 on cuda, fp32 on cpu (the interpreter's)")
    p.add_argument("--shapes", type=shape_list, default=None, metavar="ROWSxVOCAB,...",
                   help="these logits shapes instead of the tiny or full ones")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--repeats", type=int, default=None, help="default: 20 on cuda, 3 on cpu")
    p.add_argument("--warmup", type=int, default=None, help="default: 3 on cuda, 1 on cpu")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    cuda = args.device == "cuda"
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    if not cuda and args.dtype != "fp32":
        p.error("--device cpu runs the Triton interpreter, which is float32-only: --dtype fp32")
    args.repeats = args.repeats or (20 if cuda else 3)
    args.warmup = args.warmup if args.warmup is not None else (3 if cuda else 1)
    return args


def peak_extra_bytes(fn) -> int:
    """Peak CUDA memory fn() allocates beyond what was allocated when it started."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def methods(logits: torch.Tensor, ids: torch.Tensor) -> dict:
    """{(task, backend): fn() -> (outputs, d logits)}, forward and backward."""
    from minirl import entropy_from_logits, selective_log_softmax
    from minirl.logprob_triton import logprobs_and_entropy_triton

    def fwd_bwd(forward):
        def run():
            outputs = forward()
            grad = torch.autograd.grad(sum(o.sum() for o in outputs), logits)[0]
            return outputs, grad
        return run

    return {
        ("logp", "torch"): fwd_bwd(lambda: (selective_log_softmax(logits, ids, "torch"),)),
        ("logp", "triton"): fwd_bwd(lambda: (selective_log_softmax(logits, ids, "triton"),)),
        ("logp+entropy", "torch"): fwd_bwd(lambda: (selective_log_softmax(logits, ids, "torch"),
                                                    entropy_from_logits(logits))),
        ("logp+entropy", "triton"): fwd_bwd(lambda: logprobs_and_entropy_triton(logits, ids)),
    }


def out_of_memory(fn):
    """fn(), or None if the device ran out of memory (its cache then emptied)."""
    try:
        return fn()
    except torch.OutOfMemoryError:
        pass
    torch.cuda.empty_cache()        # after the except block: the traceback is gone
    return None


def check_agreement(shape, task: str, runs: dict) -> bool:
    """A benchmark of a wrong kernel is meaningless: compare outputs and gradients with the
    PyTorch path's. False if that path ran out of memory (nothing to compare with)."""
    reference = out_of_memory(runs[task, "torch"])
    if reference is None:
        return False
    (want, g_want), (got, g_got) = reference, runs[task, "triton"]()
    for a, b in zip((*got, g_got), (*want, g_want), strict=True):
        tol = 1e-4 if a.dtype == torch.float32 else 2e-2
        if not torch.allclose(a.float(), b.float(), atol=tol, rtol=tol):
            err = (a.float() - b.float()).abs().max().item()
            raise AssertionError(f"{task} on {shape}: Triton and PyTorch differ by {err}")
    return True


def bench_shape(shape, args, dtype) -> list[dict]:
    rows, vocab = shape
    g = torch.Generator().manual_seed(0)
    logits = (4 * torch.randn(shape, generator=g)).to(args.device, dtype).requires_grad_()
    ids = torch.randint(0, vocab, (rows,), generator=g).to(args.device)
    runs = methods(logits, ids)
    traffic = 3 * logits.numel() * logits.element_size()
    out = []
    for task in TASKS:
        checked = check_agreement(shape, task, runs)
        timed = {}
        for backend in ("torch", "triton"):
            r = timed[backend] = dict(shape=list(shape), task=task, backend=backend)
            if backend == "torch" and not checked:
                r["skipped"] = "out of memory"
                continue
            seconds = median_seconds(runs[task, backend], args.device, args.repeats,
                                     args.warmup)
            r.update(median_ms=seconds * 1e3, gbps=traffic / seconds / 1e9)
            if args.device == "cuda":
                r["peak_extra_mib"] = peak_extra_bytes(runs[task, backend]) / 2**20
        if checked:
            timed["triton"]["ratio"] = timed["torch"]["median_ms"] / timed["triton"]["median_ms"]
            if args.device == "cuda":
                timed["triton"]["saved_mib"] = (timed["torch"]["peak_extra_mib"]
                                                - timed["triton"]["peak_extra_mib"])
        out += timed.values()
    return out


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':>14} {'task':>13} {'backend':>7} {'time (ms)':>10} {'GB/s':>8} "
          f"{'ratio':>6} {'peak (MiB)':>11} {'saved (MiB)':>12}")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "skipped" in r:
            print(f"{shape:>14} {r['task']:>13} {r['backend']:>7}  skipped: {r['skipped']}")
            continue
        ratio = f"{r['ratio']:6.2f}" if "ratio" in r else " " * 6
        peak = f"{r['peak_extra_mib']:11.0f}" if "peak_extra_mib" in r else f"{'-':>11}"
        saved = f"{r['saved_mib']:12.0f}" if "saved_mib" in r else " " * 12
        print(f"{shape:>14} {r['task']:>13} {r['backend']:>7} {r['median_ms']:10.3f} "
              f"{r['gbps']:8.3g} {ratio} {peak} {saved}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cpu":
        # Decide before triton is first imported: on a machine that has a GPU, CPU tensors
        # still need the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    from minirl.logprob_kernels import interpreting

    dtype = DTYPES[args.dtype]
    shapes = args.shapes or SHAPES["tiny" if args.tiny or args.device == "cpu" else "full"]
    rows = [r for shape in shapes for r in bench_shape(shape, args, dtype)]
    result = dict(
        device=args.device,
        device_name=(torch.cuda.get_device_name() if args.device == "cuda"
                     else platform.processor() or platform.machine()),
        triton_interpreter=interpreting(),
        dtype=args.dtype,
        repeats=args.repeats,
        warmup=args.warmup,
        versions=dict(python=sys.version.split()[0], torch=torch.__version__,
                      triton=triton.__version__),
        bytes_counted="3 x logits: read forward, read backward, gradient written",
        results=rows,
    )
    print(f"log-probs and entropy, fwd+bwd, {args.dtype} logits, {result['device_name']}"
          f"{' (Triton interpreter)' if result['triton_interpreter'] else ''}")
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
