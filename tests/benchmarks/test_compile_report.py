"""benchmarks/compile_report.py: every Triton kernel compiled for sm_75, sm_80, sm_86, sm_89
and sm_90.

The committed report (benchmarks/results/compile_report.json) is held whole to the rules of
`problems`: a record for every job `jobs()` lists and nothing else, no kernel that fails to
compile, no spilled register, no block too large for an SM, no byte-wide loads in the NF4
dequant and 128-bit loads elsewhere, tensor cores in every dot whose dtype the architecture's
tensor cores take, none in an exact float32 dot. Two exceptions are listed, explained, and
checked to be still needed: below sm_80 Triton compiles no tensor-core dot, and the records
of the dot kernels there say what the launcher does instead (`"fallback"`, the words of
`minimoe.launch_plan.dot_plan`); group_bwd_W's TF32 dot loads nothing 128 bits wide on sm_90
(`NARROW_LOADS`, which says why). CI recompiles a sample of it (`--sample`: one job of each
kernel, dtype, architecture and size, about a quarter, a minute or two on 2 cores), which
must find no problem and match the committed records. `problems` is shown to catch each kind
on doctored records and on a real kernel compiled the old way (byte loads).
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
ARCHS = {"sm_75", "sm_80", "sm_86", "sm_89", "sm_90"}
KERNELS = {"nf4_dequant", "scatter2scatter", "group", "group_bwd_W", "group_bwd_lora",
           "logsoftmax_fwd", "logsoftmax_bwd"}


@pytest.fixture(scope="module")
def committed():
    return json.loads(COMMITTED.read_text())


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("compile")
    out = tmp / "compile_report.json"
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp / "cache")}
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out), "--jobs", "2",
                           "--sample"], env=env, capture_output=True, text=True, timeout=1200,
                          cwd=ROOT)
    assert out.exists(), done.stderr[-3000:]
    return (json.loads(out.read_text()), json.loads((tmp / "roofline.json").read_text()),
            done)


def test_the_committed_report_compiles_every_job_with_no_problem(committed):
    assert report.problems(committed, report.jobs()) == [], "run `make compile-report`"
    assert sorted(map(report.key, committed)) == sorted(map(report.key, report.jobs())), \
        "the committed report has records no job makes: run `make compile-report`"
    assert {r["kernel"] for r in committed} == KERNELS
    for kernel in KERNELS:
        assert {r["arch"] for r in committed if r["kernel"] == kernel} == ARCHS
    # every autotune candidate of every MoE kernel, at both widths, on every tensor-core arch
    from minimoe.kernels import CONFIGS
    for name, per_width in CONFIGS.items():
        for bits, configs in per_width.items():
            for config in configs:
                for arch in ARCHS - {"sm_75"}:
                    assert any(r["kernel"] == name and r["arch"] == arch
                               and config.items() <= r["config"].items()
                               for r in committed), (name, bits, config, arch)


def test_the_fallbacks_are_sm_75s_dots_and_say_what_runs_instead(committed):
    """Every record of a dot kernel on sm_75 in a 16-bit dtype or TF32, and no other, falls
    back: compiled with the float32 tiles and exact products, no tensor-core instruction,
    with the launcher's reason."""
    from minimoe.kernels import configs
    from minimoe.launch_plan import dot_plan

    fallen = [r for r in committed if "fallback" in r]
    assert {(r["kernel"], r["dtype"], r["arch"]) for r in fallen} == {
        (k, d, "sm_75") for k in report.DOT_KERNELS for d in ("fp16", "bf16", "tf32")}
    for r in fallen:
        assert r["fallback"] == dot_plan((7, 5), report.DTYPES[r["dtype"]],
                                         tf32=r["dtype"] == "tf32").fallback
        assert r["tensor_core_instructions"] == 0 and r["spill_bytes"] == 0
        tiles = {k: v for k, v in r["config"].items() if k.startswith(("BLOCK", "num_"))}
        assert tiles in configs(r["kernel"], 32, aligned=r["sizes"] == "aligned"), r


def test_the_narrow_loads_exception_is_still_needed(committed):
    narrow = {(r["kernel"], r["dtype"], r["arch"]) for r in committed
              if r["sizes"] == "aligned" and r["kernel"] != "nf4_dequant"
              and "128" not in r["global_loads"]}
    assert narrow == {("group_bwd_W", "tf32", "sm_90")}
    assert set(report.NARROW_LOADS) == {(kernel, dtype) for kernel, dtype, _ in narrow}


def test_the_required_fields_and_the_fixes_hold(committed):
    for r in committed:
        assert {"kernel", "arch", "dtype", "config", "registers", "spill_bytes", "shared_bytes",
                "global_loads", "global_stores", "tensor_core_instructions"} <= r.keys()
    dequant = [r for r in committed if r["kernel"] == "nf4_dequant" and r["sizes"] == "aligned"]
    assert len(dequant) == 9 * len(ARCHS)
    for r in dequant:
        assert "8" not in r["global_loads"] and r["global_loads"].get("64", 0) >= 1, r
        assert set(r["global_stores"]) == {"128"}, r
    for arch in ARCHS - {"sm_75"}:
        tensor = [r for r in committed if r["kernel"] == "scatter2scatter" and r["arch"] == arch
                  and r["dtype"] == "bf16"]
        assert tensor and all(r["tensor_core_instructions"] > 0 for r in tensor), arch


@pytest.mark.slow
def test_a_sample_compiles_as_committed_with_no_problem(fresh, committed):
    records, roofline, done = fresh
    todo = report.sample(report.jobs())
    assert report.problems(records, todo) == [], done.stdout[-3000:]
    assert done.returncode == 0
    assert len(records) == len(todo)
    assert {r["arch"] for r in records} == ARCHS and {r["kernel"] for r in records} == KERNELS
    import triton
    committed_roofline = json.loads(COMMITTED.with_name("roofline.json").read_text())
    assert committed_roofline == roofline
    if committed_roofline["triton"] != triton.__version__:
        pytest.skip(f"committed with triton {committed_roofline['triton']}, "
                    f"running {triton.__version__}")
    by_key = {report.key(r): r for r in committed}
    assert [by_key.get(report.key(r)) for r in records] == records, "run `make compile-report`"


def _record(**changes):
    base = dict(kernel="scatter2scatter", arch="sm_90", dtype="bf16", sizes="aligned",
                config=dict(BLOCK_N=64, BLOCK_K=32, num_warps=4, num_stages=3), registers=96,
                spill_bytes=0, shared_bytes=0, occupancy=0.25, global_loads={"128": 4},
                global_stores={"128": 4}, local_instructions=0, tensor_core_instructions=2)
    return dict(base, **changes)


def _job(record):
    """The job a record answers."""
    return dict({k: record[k] for k in ("kernel", "arch", "dtype", "sizes", "config")},
                variant={})


def test_problems_names_each_kind_of_failure():
    good = [_record(), _record(arch="sm_80"), _record(dtype="fp16", arch="sm_75", fallback="x",
                                                      tensor_core_instructions=0)]
    assert report.problems(good, [_job(r) for r in good]) == []
    cases = {
        "spills 16 bytes": _record(spill_bytes=16),
        "fits no SM": _record(occupancy=0.0),
        "no 128-bit loads at aligned sizes": _record(global_loads={"32": 4, "64": 2}),
        "a bf16 dot without tensor-core": _record(tensor_core_instructions=0),
        "a fp16 dot without tensor-core": _record(dtype="fp16", arch="sm_75",
                                                  tensor_core_instructions=0),
        "exact float32 dot uses tensor cores": _record(dtype="fp32"),
        "launched as on tensor cores, which sm_75 has not for bf16": _record(
            arch="sm_75", tensor_core_instructions=0),
        "falls back (x) yet has 2 tensor-core instructions": _record(arch="sm_75",
                                                                     fallback="x"),
        "does not compile": _record(error="CompilationError: x"),
        "one at a time": _record(kernel="nf4_dequant", global_loads={"8": 8, "32": 32}),
        "narrower than 8 bytes": _record(kernel="nf4_dequant", global_stores={"16": 16}),
    }
    for words, record in cases.items():
        found = report.problems(copy.deepcopy([record, _record(arch="sm_80")]))
        assert len(found) == 1 and words in found[0], (words, found)
    found = report.problems([_record()], [_job(_record()), _job(_record(arch="sm_80"))])
    assert len(found) == 1 and found[0].endswith("sm_80 " + json.dumps(
        _record()["config"], sort_keys=True) + " aligned: not compiled"), found


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
    # a T4's kernels multiply on the FMA units (launch_plan.dot_plan): bf16 at the FP32 rate
    assert mixtral["device"]["T4"] == dict(
        time_us=round(2 * 4096 * 2 * 4096 * 14336 / 8.1e12 * 1e6, 2), bound="compute")
    assert set(report.DEVICES) == {"H100 SXM", "A100 SXM 80GB", "L4", "A10", "T4"}
    assert {d["arch"] for d in report.DEVICES.values()} == ARCHS


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
