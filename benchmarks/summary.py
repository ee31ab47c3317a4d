"""RESULTS.md's benchmark blocks: the GPU results `make bench-gpu` writes, the compile report
and the CPU benchmark.

`python -m labkit readme` puts what `readme(part, results)` returns in each block opened by
`labkit.readme.gpu_marker(part)`, for each part in PARTS. `results` holds every result under
benchmarks/results/gpu/ as (path, verified manifest), newest first, from `make bench-gpu` or
`make device-check`; a block shows the newest that measured its part (a device-check step
that failed leaves its part null), and with none it says that the benchmark has not been run
on a GPU and how to run it. bench_gpu.py and device_check.py compute every ratio (the
manifest's metrics; the log-prob part only device_check.py); this file only words them. Only
`make readme` reads it.
"""

from __future__ import annotations

from labkit.readme import paragraph, table

PARTS = ("dequant", "moe", "logprobs")
HOW = ("`make bench-gpu` on a CUDA machine writes `benchmarks/results/gpu/<device>.json` (the "
       "GPU tests and both benchmarks, measured in one run), and `make readme` puts its "
       "ratios here")


def not_run(part: str) -> str:
    if part == "logprobs":
        return paragraph("Not yet run on a GPU: `make device-check` measures it (`make "
                         "bench-gpu` does not), into the same result file.")
    if part == "moe":
        return paragraph("Not yet run on a GPU: `make bench-gpu` measures it in the same run as "
                         "the dequant benchmark above, into the same result file.")
    return paragraph(f"Not yet run on a GPU: `benchmarks/results/gpu/` holds no result. {HOW}.")


def source(path: str, manifest: dict) -> str:
    """Which run the numbers come from: its file, commit and date."""
    git = manifest["git"]
    dirty = " with uncommitted changes" if git["dirty"] else ""
    return (f"[{path.rpartition('/')[2]}]({path}), commit `{git['commit'][:7]}`{dirty}, "
            f"{manifest.get('recorded_at', 'undated')[:10]}")


def tests_clause(tests: dict | None) -> str:
    if tests is None:
        return "the GPU tests did not finish in the same run"
    failed = tests["failed"] + tests["errors"]
    return (f"the GPU tests in the same run: {tests['passed']} passed, "
            f"{'**' + str(failed) + ' failed**' if failed else '0 failed'}, "
            f"{tests['skipped']} skipped")


def met(counts: list[int], what: str) -> str:
    return f"met at {counts[0]} of {counts[1]} {what}" if counts[1] else f"no {what} measured"


def bnb_cells(shape: dict) -> list[str]:
    """bitsandbytes' GB/s and Triton's speed over it, or dashes where it did not run."""
    if shape["triton_vs_bitsandbytes"] is None:
        return ["—", "—"]
    return [f"{shape['gbps']['bitsandbytes']:,.0f}", f"{shape['triton_vs_bitsandbytes']:.2f}×"]


def dequant(results: list[tuple[str, dict]]) -> str:
    path, manifest = results[0]
    m = manifest["metrics"]
    d = m["dequant"]
    others = ", ".join(f"[{p.rpartition('/')[2]}]({p})" for p, _ in results[1:])
    intro = paragraph(
        f"Measured by `make {manifest['experiment']}` on {m['device_name']} "
        f"({source(path, manifest)}; "
        f"{d['dtype']} out, blocksize {d['blocksize']}, median of {d['repeats']}; "
        f"{tests_clause(m['gpu_tests'])}){f'; other GPUs: {others}' if others else ''}. "
        "Each method's GB/s, and Triton's as a fraction of a plain copy's and against "
        "bitsandbytes, all from that one run:")
    rows = [["×".join(map(str, s["shape"])), f"{s['gbps']['triton']:,.0f}",
             f"{s['gbps']['copy']:,.0f}", f"{s['triton_of_copy']:.2f}", *bnb_cells(s)]
            for s in d["shapes"]]
    grid = table(["shape", "Triton GB/s", "copy GB/s", "Triton / copy", "bitsandbytes GB/s",
                  "Triton / bitsandbytes"], rows)
    skipped = next((s["bitsandbytes_skipped"] for s in d["shapes"] if s["bitsandbytes_skipped"]),
                   None)
    targets = paragraph(
        f"Targets: Triton ≥ {d['targets']['triton_of_copy']:.2f} of the copy "
        f"({met(d['met']['triton_of_copy'], 'shapes')}) and ≥ "
        f"{d['targets']['triton_vs_bitsandbytes']:.2f}× bitsandbytes "
        f"({met(d['met']['triton_vs_bitsandbytes'], 'shapes')})"
        + (f"; bitsandbytes did not run: {skipped}" if skipped else "") + ".")
    return f"{intro}\n\n{grid}\n\n{targets}\n"


def moe(results: list[tuple[str, dict]]) -> str:
    path, manifest = results[0]
    m = manifest["metrics"]["moe"]
    shapes = "the models' own shapes" if m["scale"] == 1 else f"d_model and d_ff / {m['scale']}"
    intro = paragraph(
        f"Measured in the same run ({source(path, manifest)}; {m['dtype']}, {m['tokens']} "
        f"tokens, {shapes}, expert LoRA of rank {m['lora_rank']}, median of {m['repeats']}). "
        "Speed-up is the per-expert loop's time over the method's (same pass, both with LoRA "
        "or both without); LoRA overhead is what LoRA adds to the method's own fwd+bwd time:")
    rows = [[f"{r['model']}", f"{r['E']}, {r['k']}", f"{r['K']} × {r['N']}",
             f"{r['vs_loop']['triton']['fwd']:.2f}×", f"{r['vs_loop']['triton']['fwd+bwd']:.2f}×",
             f"{r['vs_loop_lora']['triton']['fwd+bwd']:.2f}×",
             f"{r['vs_loop']['torch_sorted']['fwd+bwd']:.2f}×",
             f"{r['lora_overhead']['triton']['fwd+bwd']:+.0%}",
             f"{r['lora_overhead']['triton_split']['fwd+bwd']:+.0%}"]
            for r in m["models"]]
    grid = table(["model", "E, top-k", "K × N", "Triton fwd", "Triton fwd+bwd",
                  "Triton fwd+bwd, LoRA", "PyTorch sorted fwd+bwd", "LoRA overhead, fused",
                  "LoRA overhead, split"], rows)
    target, counts = m["targets"], m["met"]
    targets = paragraph(
        f"Targets: Triton fwd+bwd ≥ {target['triton_vs_loop_fwd_bwd']:g}× the loop at "
        f"many-expert shapes (E ≥ {m['many_experts']}; "
        f"{met(counts['triton_vs_loop_fwd_bwd'], 'models')}), and fused LoRA overhead ≤ "
        f"{target['triton_lora_overhead']:.0%} ({met(counts['triton_lora_overhead'], 'models')}).")
    return f"{intro}\n\n{grid}\n\n{targets}\n"


def mib(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def logprob_cells(r: dict) -> list[str]:
    """PyTorch's and Triton's ms, the speed-up, both peaks and what Triton saves; PyTorch's
    cells say why it was not timed where it ran out of memory."""
    if r["torch_skipped"]:
        return [f"skipped: {r['torch_skipped']}", f"{r['triton_ms']:.2f}", "—", "—",
                mib(r["triton_peak_mib"]), "—"]
    return [f"{r['torch_ms']:.2f}", f"{r['triton_ms']:.2f}", f"{r['speedup']:.2f}×",
            mib(r["torch_peak_mib"]), mib(r["triton_peak_mib"]), mib(r["saved_mib"])]


def logprobs(results: list[tuple[str, dict]]) -> str:
    path, manifest = results[0]
    m = manifest["metrics"]["logprobs"]
    intro = paragraph(
        f"Measured by `make {manifest['experiment']}` on {manifest['metrics']['device_name']} "
        f"({source(path, manifest)}; {m['dtype']} logits, median of {m['repeats']}). Each task "
        "is one forward and backward of what the GRPO loss computes: `logp` is "
        "`selective_log_softmax`, `logp+entropy` that and the entropy of each row. PyTorch is "
        "their PyTorch code at that commit, Triton the streaming kernels; speed-up is "
        "PyTorch's time over Triton's, peak the memory each allocates beyond the logits (their "
        "gradient included), and saved the difference of the peaks:")
    rows = [["×".join(map(str, r["shape"])), f"`{r['task']}`", *logprob_cells(r)]
            for r in m["rows"]]
    grid = table(["logits", "task", "PyTorch ms", "Triton ms", "Triton speed-up",
                  "PyTorch peak MiB", "Triton peak MiB", "saved MiB"], rows)
    return f"{intro}\n\n{grid}\n"


def readme(part: str, results: list[tuple[str, dict]]) -> str:
    results = [(path, m) for path, m in results if m["metrics"].get(part) is not None]
    if not results:
        return not_run(part) + "\n"
    return {"dequant": dequant, "moe": moe, "logprobs": logprobs}[part](results)


# ---------------------------------------------------------------------------------------------
# the compile report (benchmarks/results/compile_report.json, roofline.json)

# The GPUs of each architecture the report compiles for (gpucompile.ARCHS).
GPUS = {"sm_75": "T4", "sm_80": "A100", "sm_86": "A10, RTX 30", "sm_89": "L4, RTX 40",
        "sm_90": "H100"}


def _span(values: list, fmt: str = "{}") -> str:
    lo, hi = fmt.format(min(values)), fmt.format(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _widths(records: list[dict], key: str) -> str:
    """The access widths any of these records uses, narrowest first, in bits."""
    bits = sorted({int(b) for r in records for b in r[key]})
    return ", ".join(map(str, bits)) or "—"


def _archs(records: list[dict]) -> list[str]:
    """The architectures these records compile for, oldest first."""
    return sorted({r["arch"] for r in records}, key=lambda arch: int(arch.removeprefix("sm_")))


def _named(archs: list[str]) -> str:
    """"sm_75 (T4), sm_80 (A100) and sm_90 (H100)": each architecture with its GPUs."""
    names = [f"{arch} ({GPUS[arch]})" if arch in GPUS else arch for arch in archs]
    return " and ".join(filter(None, [", ".join(names[:-1]), names[-1]]))


def _figures(group: list[dict]) -> list[str]:
    """A kernel's row for its configurations on one architecture, after kernel and arch; a
    fallback's dots have no tensor-core instructions."""
    half = [r["tensor_core_instructions"] for r in group if r["dtype"] in ("fp16", "bf16")]
    cores = (_span(half) if any(half) else
             "fallback" if any("fallback" in r for r in group) else "—")
    return [str(len(group)), _span([r["registers"] for r in group]),
            str(max(r["spill_bytes"] for r in group)),
            _span([r["occupancy"] for r in group], "{:.2f}"),
            _widths(group, "global_loads"), _widths(group, "global_stores"), cores]


def _kernel_rows(compiled: list[dict], archs: list[str]) -> list[list[str]]:
    """One row per kernel and architecture at aligned sizes; consecutive architectures with
    the same figures share a row ("sm_86, sm_89")."""
    rows = []
    for kernel in dict.fromkeys(r["kernel"] for r in compiled):
        first = len(rows)
        for arch in archs:
            group = [r for r in compiled if r["kernel"] == kernel and r["arch"] == arch
                     and r["sizes"] == "aligned"]
            if not group:
                continue
            figures = _figures(group)
            if len(rows) > first and rows[-1][2:] == figures:
                rows[-1][1] += f", {arch}"
            else:
                rows.append([f"`{kernel}`", arch, *figures])
    return rows


def _fallbacks(records: list[dict], archs: list[str]) -> str:
    """How many compilations fell back, per architecture, dtype and the records' reason; ""
    with none."""
    counts: dict[tuple, int] = {}
    for r in sorted((r for r in records if "fallback" in r), key=lambda r: archs.index(r["arch"])):
        key = (r["arch"], r["dtype"], r["fallback"])
        counts[key] = counts.get(key, 0) + 1
    if not counts:
        return ""
    where = _named(list(dict.fromkeys(arch for arch, _, _ in counts)))
    intro = paragraph(
        f"{sum(counts.values())} of these compilations, on {where}, fall back: their dots "
        "multiply on the FMA units, in float32 with the float32 tiles. "
        "`minimoe.launch_plan.dot_plan` picks that launch (on a GPU it warns once when 16-bit "
        "inputs fall back) and says why, "
        "in the records' `\"fallback\"`:")
    rows = [[arch, dtype, str(n), why] for (arch, dtype, why), n in counts.items()]
    return f"{intro}\n\n{table(['arch', 'dtype', 'compilations', 'why'], rows)}"


def _roofline(roofline: dict) -> str:
    """The roofline of each benchmark shape on each device, oldest architecture first, and
    the K loops of tiles that span experts against tiles per expert."""
    devices = sorted(roofline["devices"],
                     key=lambda d: int(roofline["devices"][d]["arch"].removeprefix("sm_")))
    lines = []
    for r in roofline["shapes"]:
        what = (f"dequant {r['shape'][0]}×{r['shape'][1]}, {r['dtype']} out"
                if r["bench"] == "bench_dequant"
                else f"MoE {r['model']}, {r['tokens']} tokens, {r['dtype']}")
        cells = [what, f"{r['bytes'] / 1e6:,.0f}", f"{r['flops'] / 1e9:,.1f}"]
        for device in devices:
            d = r["device"][device]
            cells.append(f"{d['time_us']:,.1f} ({d['bound']})")
        tiles = r.get("tiling")
        cells.append("—" if not tiles else
                     f"{tiles['spanning']['k_loops']} → {tiles['per_expert']['k_loops']}")
        lines.append(cells)
    rooftable = table(["shape", "MB moved", "GFLOP", *(f"{d} µs" for d in devices),
                       "K loops: tiles spanning experts → per expert"], lines)
    fma = [d for d in devices if len(set(roofline["devices"][d]["flops"].values())) == 1]
    peaks = (f"; on {', '.join(fma)} the float32 FMA peak for every dtype, as the fallback "
             "computes" if fma else "")
    roof = paragraph(
        "The time neither bandwidth nor arithmetic allows the kernel to beat at each "
        f"benchmark shape (datasheet peaks{peaks}; bytes the kernel must move, FLOPs it must "
        "do), and how many tile K loops the dispatch would issue with row tiles that span "
        "experts, against the row tiles it cuts per expert:")
    return f"{roof}\n\n{rooftable}"


def compile_readme(records: list[dict], roofline: dict) -> str:
    """One row per kernel and architecture over every configuration compiled at aligned sizes,
    the compilations that fell back, then the roofline of the benchmark shapes and the effect
    of cutting tiles per expert."""
    compiled = [r for r in records if "error" not in r]
    archs = _archs(compiled)
    kernels = table(["kernel", "arch", "configs", "registers", "max spill B", "occupancy",
                     "load bits", "store bits", "tensor-core instr., 16-bit"],
                    _kernel_rows(compiled, archs))
    intro = paragraph(
        f"{len(records)} compilations with triton {roofline['triton']}: every configuration "
        "each launcher can pick (the MoE kernels' autotune candidates; float32 exact and "
        f"TF32, fp16, bf16), at the benchmarks' sizes, for {_named(archs)}. Per kernel and "
        "architecture, over its configurations:")
    odd = [r for r in compiled if r["sizes"] == "odd"]
    worst = max((r["spill_bytes"] for r in odd), default=0)
    after = paragraph(
        f"At sizes that are not multiples of 16 ({len(odd)} more compilations: the launchers "
        f"then pick the \"unaligned\" tiles) the largest spill is {worst} bytes, and the data "
        "moves one element per instruction: no wider access can be proven aligned there.")
    blocks = [intro, kernels, _fallbacks(compiled, archs), after, _roofline(roofline)]
    return "\n\n".join(filter(None, blocks)) + "\n"


def cpu_readme(path: str, manifest: dict) -> str:
    """The CPU hot paths against their peers (`make bench-cpu`): one row per case."""
    rows = []
    for name, r in manifest["metrics"].items():
        target = "—" if r["target"] is None else f"≤ {r['target']}×"
        held = {"held": "yes", "over": "**no**", "reported": "—"}[r["verdict"]]
        rows.append([f"`{name}`", r["shape"], r["peer"], f"{r['ours_ms']:,.1f}",
                     f"{r['peer_ms']:,.1f}", f"{r['ratio']:.2f}×", f"±{r['noise']:.0%}", target,
                     held])
    cpu = manifest["env"].get("cpu", "a CPU")
    intro = paragraph(
        f"Measured by `make bench-cpu` on {cpu}, one thread ({source(path, manifest)}; "
        f"torch {manifest['env'].get('torch')}, {manifest['config']['repeats']} alternating "
        "rounds a case, medians; the noise is half the middle half of the per-round ratios).")
    return intro + "\n\n" + table(
        ["case", "shape", "peer", "ours ms", "peer ms", "ours / peer", "noise", "target", "held"],
        rows)
