"""NF4 dequantization bandwidth: Triton kernel vs PyTorch reference vs bitsandbytes vs a copy.

    python benchmarks/bench_dequant.py [--tiny] [--device cpu|cuda] [--out path.json]

Dequantization is memory-bound, so each method is reported in the unit that says how close it
gets to the hardware: GB/s of DRAM traffic, counting the bytes it must read (packed codes,
n/2, plus float32 absmax, 4n/blocksize) and write (the output, n * element size). The ceiling
is a plain device copy of an output-sized tensor (read n * size + write n * size), measured in
the same run; each method's `frac_of_copy` is its GB/s over the copy's. The targets for the
Triton kernel on a GPU (docs/ARCHITECTURE.md, Performance targets): >= 0.8 of copy and
>= bitsandbytes.

Timing: median over repeats after warm-up; on CUDA each repeat is timed with CUDA events, and
the L2 cache is flushed before each (by zeroing a 256 MiB buffer) so that a weight that fits
in L2 is not read from it. On CPU the Triton kernel runs in the interpreter (NumPy, one
program at a time): its numbers measure the interpreter, not the kernel, and only show the
script works; CPU mode therefore uses the tiny shapes. Without double quantization, so that
every method reads the same stored absmax.
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

SHAPES = {"tiny": [(256, 256), (128, 512)], "full": [(4096, 4096), (4096, 14336), (14336, 4096)]}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
L2_FLUSH_BYTES = 256 * 2**20


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="small shapes (always used on CPU)")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="default: cuda if available, else cpu")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="output dtype")
    p.add_argument("--blocksize", type=int, default=64)
    p.add_argument("--repeats", type=int, default=None, help="default: 50 on cuda, 5 on cpu")
    p.add_argument("--warmup", type=int, default=None, help="default: 10 on cuda, 1 on cpu")
    args = p.parse_args(argv)
    if args.device is None:
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch.cuda.is_available() is False")
    cuda = args.device == "cuda"
    args.repeats = args.repeats or (50 if cuda else 5)
    args.warmup = args.warmup if args.warmup is not None else (10 if cuda else 1)
    return args


def bnb_method(w: torch.Tensor, blocksize: int):
    """bitsandbytes' dequantize_4bit on its own quantization of w, or (None, why not)."""
    try:
        import bitsandbytes.functional as bnbf

        packed, state = bnbf.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
        bnbf.dequantize_4bit(packed, state)
    except Exception as e:  # not installed, or no kernels for this device
        return None, f"{type(e).__name__}: {e}"
    return (lambda: bnbf.dequantize_4bit(packed, state)), None


def bench_shape(shape, args, dtype) -> list[dict]:
    from miniquant.nf4 import dequantize_nf4, quantize_nf4
    from miniquant.triton_dequant import triton_dequantize_nf4

    torch.manual_seed(0)
    w = torch.randn(shape, device=args.device, dtype=dtype)
    q = quantize_nf4(w, blocksize=args.blocksize)
    n, size = w.numel(), w.element_size()
    # A benchmark of a wrong kernel is meaningless: check it first.
    if not torch.equal(triton_dequantize_nf4(q, dtype), dequantize_nf4(q, dtype)):
        raise AssertionError(f"triton_dequantize_nf4 disagrees with the reference on {shape}")

    y = torch.empty(shape, device=args.device, dtype=dtype)
    dequant_bytes = q.packed.numel() + 4 * q.n_blocks + n * size  # read codes + absmax, write
    methods = {
        "triton": (lambda: triton_dequantize_nf4(q, dtype), dequant_bytes),
        "torch_reference": (lambda: dequantize_nf4(q, dtype), dequant_bytes),
        "copy": (lambda: torch.empty_like(y).copy_(y), 2 * n * size),
    }
    bnb, why_not = bnb_method(w, args.blocksize)
    if bnb is not None:
        methods["bitsandbytes"] = (bnb, dequant_bytes)

    rows = []
    for name, (fn, nbytes) in methods.items():
        seconds = median_seconds(fn, args.device, args.repeats, args.warmup, L2_FLUSH_BYTES)
        rows.append(dict(shape=list(shape), method=name, median_s=seconds, bytes=nbytes,
                         gbps=nbytes / seconds / 1e9))
    if bnb is None:
        rows.append(dict(shape=list(shape), method="bitsandbytes", skipped=why_not))
    copy_gbps = next(r["gbps"] for r in rows if r["method"] == "copy")
    for r in rows:
        if "gbps" in r:
            r["frac_of_copy"] = r["gbps"] / copy_gbps
    return rows


def print_table(rows: list[dict]) -> None:
    print(f"{'shape':>14} {'method':>16} {'time (us)':>12} {'GB/s':>10} {'of copy':>8}")
    for r in rows:
        shape = "x".join(map(str, r["shape"]))
        if "gbps" not in r:
            print(f"{shape:>14} {r['method']:>16}  skipped: {r['skipped']}")
            continue
        print(f"{shape:>14} {r['method']:>16} {r['median_s'] * 1e6:12.1f} "
              f"{r['gbps']:10.4g} {r['frac_of_copy']:8.3g}")


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.device == "cpu":
        # Decide before miniquant.triton_dequant imports triton: on a machine that has a GPU,
        # CPU tensors still need the interpreter.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    import miniquant.triton_dequant  # noqa: F401  (makes the TRITON_INTERPRET decision)

    dtype = DTYPES[args.dtype]
    shapes = SHAPES["tiny" if args.tiny or args.device == "cpu" else "full"]
    rows = [r for shape in shapes for r in bench_shape(shape, args, dtype)]
    try:
        import bitsandbytes

        bnb_version = bitsandbytes.__version__
    except ImportError:
        bnb_version = None
    result = dict(
        device=args.device,
        device_name=(torch.cuda.get_device_name() if args.device == "cuda"
                     else platform.processor() or platform.machine()),
        triton_interpreter=os.environ.get("TRITON_INTERPRET") == "1",
        dtype=args.dtype,
        blocksize=args.blocksize,
        repeats=args.repeats,
        warmup=args.warmup,
        versions=dict(python=sys.version.split()[0], torch=torch.__version__,
                      triton=triton.__version__, bitsandbytes=bnb_version),
        bytes_counted="dequant: packed + float32 absmax read, output written; copy: 2 x output",
        results=rows,
    )
    print(f"NF4 dequant, {args.dtype} out, blocksize {args.blocksize}, {result['device_name']}"
          f"{' (Triton interpreter)' if result['triton_interpreter'] else ''}")
    print_table(rows)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return result


if __name__ == "__main__":
    main()
