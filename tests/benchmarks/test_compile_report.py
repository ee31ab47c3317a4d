"""benchmarks/compile_report.py: every Triton kernel compiled for sm_80 and sm_90 in CI.

One run of the whole report (about a minute on 2 cores) is what the tests read: it must
find no problem (no kernel that fails to compile or misses an architecture, no spilled
register anywhere, no byte-wide loads in the NF4 dequant, tensor cores in every 16-bit dot),
and the committed JSON must be what it produces. `problems` is shown to catch each kind on
doctored records and on a real kernel compiled the old way (byte loads).
"""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "compile_report.py"
COMMITTED = ROOT / "benchmarks" / "results" / "compile_report.json"


def _load():
    spec = importlib.util.spec_from_file_location("compile_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


report = _load()


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile")
    out = tmp / "compile_report.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp / "cache")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--jobs", "2"],
                          env=env, capture_output=True, text=True, timeout=1200, cwd=ROOT)
    assert out.exists(), done.stderr[-3000:]
    return (json.loads(out.read_text()), json.loads((tmp / "roofline.json").read_text()),
            done)


KERNELS = {"nf4_dequant", "scatter2scatter", "group", "group_bwd_W", "group_bwd_lora",
           "logsoftmax_fwd", "logsoftmax_bwd"}


@pytest.mark.slow
def test_every_kernel_compiles_for_both_archs_with_no_problem(fresh):
    records, _, done = fresh
    assert report.problems(records) == [], done.stdout[-3000:]
    assert done.returncode == 0
    assert {r["kernel"] for r in records} == KERNELS
    for kernel in KERNELS:
        assert {r["arch"] for r in records if r["kernel"] == kernel} == {"sm_80", "sm_90"}
    # every autotune candidate of every MoE kernel, at both widths
    from minimoe.kernels import CONFIGS
    for name, per_width in CONFIGS.items():
        for bits, configs in per_width.items():
            for config in configs:
                assert any(r["kernel"] == name and config.items() <= r["config"].items()
                           for r in records), (name, bits, config)


@pytest.mark.slow
def test_the_required_fields_and_the_fixes_hold(fresh):
    records, _, _ = fresh
    for r in records:
        assert {"kernel", "arch", "dtype", "config", "registers", "spill_bytes", "shared_bytes",
                "global_loads", "global_stores", "tensor_core_instructions"} <= r.keys()
    dequant = [r for r in records if r["kernel"] == "nf4_dequant" and r["sizes"] == "aligned"]
    assert len(dequant) == 18
    for r in dequant:
        assert "8" not in r["global_loads"] and r["global_loads"].get("64", 0) >= 1, r
        assert set(r["global_stores"]) == {"128"}, r
    hopper = [r for r in records if r["kernel"] == "scatter2scatter" and r["arch"] == "sm_90"
              and r["dtype"] == "bf16"]
    assert hopper and all(r["tensor_core_instructions"] > 0 for r in hopper)


@pytest.mark.slow
def test_the_committed_report_is_what_the_script_makes(fresh):
    records, roofline, _ = fresh
    import triton
    committed_roofline = json.loads(COMMITTED.with_name("roofline.json").read_text())
    if committed_roofline["triton"] != triton.__version__:
        pytest.skip(f"committed with triton {committed_roofline['triton']}, "
                    f"running {triton.__version__}")
    assert json.loads(COMMITTED.read_text()) == records, "run `make compile-report`"
    assert committed_roofline == roofline


def _record(**changes):
    base = dict(kernel="scatter2scatter", arch="sm_90", dtype="bf16", sizes="aligned",
                config=dict(BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3), registers=96,
                spill_bytes=0, shared_bytes=0, occupancy=0.25, global_loads={"128": 4},
                global_stores={"128": 4}, local_instructions=0, tensor_core_instructions=2)
    return dict(base, **changes)


def test_problems_names_each_kind_of_failure():
    good = [_record(), _record(arch="sm_80")]
    assert report.problems(good) == []
    cases = {
        "spills 16 bytes": [_record(spill_bytes=16), _record(arch="sm_80")],
        "without tensor-core": [_record(tensor_core_instructions=0), _record(arch="sm_80")],
        "exact float32 dot uses tensor cores": [
            _record(dtype="fp32"), _record(dtype="fp32", arch="sm_80", tensor_core_instructions=0)],
        "not compiled": [_record()],
        "does not compile": [_record(error="CompilationError: x"), _record(arch="sm_80")],
        "one at a time": [_record(kernel="nf4_dequant", global_loads={"8": 8, "32": 32}),
                          _record(kernel="nf4_dequant", arch="sm_80")],
        "narrower than 8 bytes": [_record(kernel="nf4_dequant", global_stores={"16": 16}),
                                  _record(kernel="nf4_dequant", arch="sm_80")],
    }
    for words, records in cases.items():
        found = report.problems(copy.deepcopy(records))
        assert len(found) == 1 and words in found[0], (words, found)


def test_problems_catches_a_real_byte_loading_dequant():
    """The dequant as it was: a mask bound of (M + 1) // 2 hides the bound's divisibility, so
    the packed bytes load one at a time (LDG.E.U8) although M is a multiple of 16."""
    from gpucompile import inspect_kernel, like
    from miniquant.triton_env import tl, triton

    @triton.jit
    def old_loads(packed, out, M, BYTES: tl.constexpr):
        k = tl.program_id(0) * BYTES + tl.arange(0, BYTES)
        b = tl.load(packed + k, mask=k < (M + 1) // 2, other=0)
        tl.store(out + k, b.to(tl.float16), mask=k < (M + 1) // 2)

    got = inspect_kernel(old_loads, (like(torch.uint8), like(torch.float16), 4096 * 4096),
                         dict(BYTES=1024, num_warps=4), "sm_90")
    record = _record(kernel="nf4_dequant", **{k: getattr(got, k) for k in (
        "registers", "spill_bytes", "global_loads", "global_stores")})
    found = report.problems([record, dict(record, arch="sm_80")])
    assert got.global_loads.get("8", 0) > 0, got
    assert any("one at a time" in f for f in found), found


def test_roofline_known_answers():
    rows = {(r["shape"][0], r["shape"][1], r["dtype"]): r for r in report.dequant_roofline()}
    n = 4096 * 4096
    r = rows[(4096, 4096, "bf16")]
    assert r["bytes"] == n // 2 + 4 * n // 64 + 2 * n == 42_991_616
    assert r["device"]["H100 SXM"] == dict(time_us=round(42_991_616 / 3.35e12 * 1e6, 2),
                                           bound="memory")
    moe = {(r["model"], r["tokens"]): r for r in report.moe_roofline()}
    q = moe[("qwen3-30b-a3b", 4096)]
    assert q["flops"] == 2 * 4096 * 8 * 2048 * 768
    mixtral = moe[("mixtral-8x7b", 4096)]
    assert mixtral["device"]["A100 SXM 80GB"]["bound"] == "compute"
    assert mixtral["device"]["A100 SXM 80GB"]["time_us"] == round(
        2 * 4096 * 2 * 4096 * 14336 / 312e12 * 1e6, 2)


def test_tiling_against_a_loop():
    """Tiles per expert and spanning tiles, counted row by row."""
    g = torch.Generator().manual_seed(3)
    for E, block in ((1, 4), (7, 4), (16, 8), (5, 64)):
        counts = torch.randint(0, 11, (E,), generator=g)
        counts[0] = max(int(counts[0]), 1)
        experts = torch.repeat_interleave(torch.arange(E), counts).tolist()
        # the old kernel looped over every expert id from the tile's first to its last row
        spans = [experts[min(i + block, len(experts)) - 1] - experts[i] + 1
                 for i in range(0, len(experts), block)]
        per_expert = sum(-(-int(c) // block) for c in counts)
        got = report.tiling(counts, block)
        assert got["spanning"] == dict(tiles=len(spans), k_loops=sum(spans), longest=max(spans))
        assert got["per_expert"] == dict(tiles=per_expert, k_loops=per_expert, longest=1)
