"""benchmarks/summary.py's compile block (`compile_readme`): a row per kernel and architecture,
oldest architecture first, each named with its GPUs; the compilations that fell back, how
many and why; the roofline on every device of the report."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("summary", ROOT / "benchmarks" / "summary.py")
summary = importlib.util.module_from_spec(spec)
spec.loader.exec_module(summary)

WHY = "float16 products in float32 on the FMA units: sm_75 has no tensor-core dot"


def record(arch: str, dtype: str = "fp16", registers: int = 64, cores: int = 8, **extra) -> dict:
    return dict(kernel="scatter2scatter", arch=arch, dtype=dtype, config={}, sizes="aligned",
                registers=registers, spill_bytes=0, shared_bytes=0, occupancy=0.5,
                global_loads={"128": 4}, global_stores={"128": 2}, local_instructions=0,
                tensor_core_instructions=cores, **extra)


def roofline(archs: dict[str, str]) -> dict:
    """Every device `archs` names, at one MoE shape; each device's time is its arch's number."""
    devices = {name: dict(arch=arch, flops={"fp32": 1.0, "bf16": 2.0})
               for name, arch in archs.items()}
    times = {name: dict(time_us=float(arch.removeprefix("sm_")), bound="memory")
             for name, arch in archs.items()}
    shape = dict(bench="bench_moe", model="olmoe-1b-7b", tokens=256, dtype="bf16", bytes=2e6,
                 flops=3e9, device=times)
    return dict(triton="3.7.1", devices=devices, shapes=[shape])


def words(text: str) -> str:
    return " ".join(text.split())


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")]
            for line in text.splitlines() if line.startswith("| ") and "---" not in line]


def test_each_architecture_named_in_order_with_its_fallbacks():
    records = [record("sm_90", cores=4), record("sm_75", cores=0, fallback=WHY),
               record("sm_75", dtype="fp32", cores=0), record("sm_80")]
    roof = roofline({"H100 SXM": "sm_90", "T4": "sm_75"})
    roof["devices"]["T4"]["flops"] = {"fp32": 1.0, "bf16": 1.0}     # the fallback's FMA peak
    text = summary.compile_readme(records, roof)
    said = words(text)
    assert "for sm_75 (T4), sm_80 (A100) and sm_90 (H100)." in said
    rows = table_rows(text)
    kernels = [row[1:3] + row[-1:] for row in rows if row[0] == "`scatter2scatter`"]
    assert kernels == [["sm_75", "2", "fallback"], ["sm_80", "1", "8"], ["sm_90", "1", "4"]]
    assert "1 of these compilations, on sm_75 (T4), fall back" in said
    assert ["sm_75", "fp16", "1", WHY] in rows
    header = next(row for row in rows if row[0] == "shape")
    assert header[3:5] == ["T4 µs", "H100 SXM µs"]
    assert "on T4 the float32 FMA peak for every dtype" in said


def test_architectures_with_the_same_figures_share_a_row_and_none_fell_back():
    records = [record("sm_89"), record("sm_86"), record("sm_90", registers=70)]
    text = summary.compile_readme(records, roofline({"L4": "sm_89"}))
    rows = [row[1] for row in table_rows(text) if row[0] == "`scatter2scatter`"]
    assert rows == ["sm_86, sm_89", "sm_90"]
    assert "fall back" not in words(text)
    assert all("why" not in row for row in table_rows(text))
    assert "FMA peak" not in words(text)
    assert "sm_86 (A10, RTX 30), sm_89 (L4, RTX 40) and sm_90 (H100)" in words(text)


def cpu_manifest(verdicts: dict[str, str]) -> dict:
    rows = {name: dict(shape="4x4", peer=f"peer of {name}", ours_ms=3.0, peer_ms=2.0, ratio=1.5,
                       noise=0.04, target=None if v == "reported" else 1.2, verdict=v,
                       repeats=15) for name, v in verdicts.items()}
    return dict(metrics=rows, env=dict(cpu="AMD EPYC", torch="2.13.0"), config=dict(repeats=15),
                git=dict(commit="abcdef1234", dirty=False), recorded_at="2026-11-27T17:00:00")


def test_the_cpu_block_has_a_row_per_case_and_says_which_missed_its_target():
    text = summary.cpu_readme("benchmarks/results/cpu.json", cpu_manifest(
        {"nf4_dequant": "held", "logprobs": "over", "moe_mlp": "reported"}))
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("|")[1].strip() for r in rows] == ["`nf4_dequant`", "`logprobs`",
                                                       "`moe_mlp`"]
    assert rows[0].rstrip(" |").endswith("≤ 1.2× | yes")
    assert rows[1].rstrip(" |").endswith("≤ 1.2× | **no**")
    assert rows[2].rstrip(" |").endswith("— | —")
    assert "1.50×" in rows[0] and "±4%" in rows[0] and "peer of logprobs" in rows[1]
    assert "on AMD EPYC, one thread" in text and "commit `abcdef1`" in text
