"""gpucompile: compile for sm_75 to sm_90 on a CPU and read what ptxas made.

The SASS parsing against hand counts; the occupancy against hand-worked cases and against
NVIDIA's occupancy calculator, transcribed (every register count, block size and a range of
shared memory sizes on five GPUs); the whole path on small
kernels whose machine code is known to differ: aligned vs unaligned sizes (vector width),
bf16 vs exact float32 vs TF32 dots (tensor cores), a tile too large for the register file
(spills). Runs in this process, whose kernels are interpreted: the inspector recompiles them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from gpucompile import (
    ARCHS,
    compile_kernel,
    inspect_kernel,
    like,
    memory_widths,
    occupancy,
    read_cubin,
)
from miniquant.triton_env import tl, triton

SASS = """
        /*0040*/                   LDG.E.U8 R4, desc[UR6][R2.64] ;
        /*0050*/                   LDG.E.U8 R5, desc[UR6][R2.64+0x1] ;
        /*0060*/                   LDG.E.64 R6, desc[UR6][R8.64] ;
        /*0070*/                   LDG.E.128.CONSTANT R12, desc[UR6][R10.64] ;
        /*0080*/                   LDG.E R3, desc[UR6][R2.64] ;
        /*0090*/                   LDGSTS.E.BYPASS.LTC128B.128 [R5], desc[UR6][R2.64] ;
        /*00a0*/                   STG.E.U16 desc[UR6][R2.64], R7 ;
        /*00b0*/                   STG.E.128 desc[UR6][R2.64], R8 ;
        /*00c0*/                   STG.E.128 desc[UR6][R2.64+0x10], R12 ;
        /*00d0*/                   LDGDEPBAR ;
        /*00e0*/                   HMMA.16816.F32.BF16 R20, R4, R8, R20 ;
"""


def test_memory_widths_against_hand_counts():
    assert memory_widths(SASS, "LDG") == {"8": 2, "32": 1, "64": 1, "128": 1}
    assert memory_widths(SASS, "LDGSTS") == {"128": 1}
    assert memory_widths(SASS, "STG") == {"16": 1, "128": 2}
    assert memory_widths("", "LDG") == {}


@pytest.mark.parametrize("arch, regs, shared, warps, want", [
    ("sm_90", 32, 0, 4, 1.0),            # 64 warps fit: the warp limit
    ("sm_90", 255, 0, 4, 8 / 64),         # 256 regs · 32 threads = 8 KiB a warp: 2 a sub-partition
    ("sm_80", 128, 0, 8, 16 / 64),        # 4 KiB a warp: 4 a sub-partition, 16 = 2 blocks of 8
    ("sm_90", 97, 0, 1, 16 / 64),         # 3 328 a warp: 4 · (16 384 // 3 328) = 16, not 19
    ("sm_90", 97, 0, 2, 16 / 64),         # ... 8 blocks of 2, not 9
    ("sm_90", 80, 0, 1, 24 / 64),         # 2 560 a warp: 4 · 6 = 24, not 65 536 // 2 560 = 25
    ("sm_80", 40, 100 * 1024, 4, 4 / 64),  # shared: one block of 101 KiB in 164 KiB
    ("sm_90", 40, 100 * 1024, 4, 8 / 64),  # ... two in 228 KiB
    ("sm_80", 32, 41_984, 4, 12 / 64),    # 41 984 + the reserved 1 024 B: 3 blocks, not 4
    ("sm_80", 32, 54_926, 4, 8 / 64),     # 55 950 B round up to 56 064 (128-byte units): 2, not 3
    ("sm_90", 16, 0, 1, 32 / 64),         # the limit of 32 blocks an SM
    ("sm_86", 16, 0, 1, 16 / 48),         # sm_86: 16 blocks of 48 warps
    ("sm_89", 16, 0, 1, 24 / 48),         # sm_89: 24 blocks of 48 warps
    ("sm_89", 64, 0, 8, 32 / 48),         # 2 048 a warp, 8 a sub-partition: 4 blocks of 8 (6 fit)
    ("sm_75", 64, 0, 8, 32 / 32),         # sm_75: 32 warps an SM
    ("sm_75", 40, 40_000, 2, 2 / 32),     # 64 KiB, 256-byte units, no reserve: 40 192 B, 1 block
    ("sm_90", 40, 0, 33, 0.0),            # 1 056 threads: no block launches
    ("sm_90", 256, 0, 1, 0.0),            # past the 255 registers of a thread
])
def test_occupancy_known_answers(arch, regs, shared, warps, want):
    assert occupancy(arch, regs, shared, warps) == pytest.approx(want)


# NVIDIA's occupancy calculator (cuda_occupancy.h: cudaOccMaxActiveBlocksPerMultiprocessor),
# transcribed apart from gpucompile.occupancy: the cudaDeviceProp values of each GPU and the
# header's functions, step by step (default carveout, shared memory limit opted in as Triton
# does for large tiles, no partitioned global caching).
_PROPS = {   # major, minor, maxThreadsPerMultiProcessor, sharedMemPerMultiprocessor,
    # sharedMemPerBlockOptin, reservedSharedMemPerBlock
    "sm_75": (7, 5, 1024, 65536, 65536, 0),
    "sm_80": (8, 0, 2048, 167936, 166912, 1024),
    "sm_86": (8, 6, 1536, 102400, 101376, 1024),
    "sm_89": (8, 9, 1536, 102400, 101376, 1024),
    "sm_90": (9, 0, 2048, 233472, 232448, 1024),
}


def _round_up(x, y):
    return y * ((x + y - 1) // y)


def _nvidia_blocks(arch, num_regs, dynamic_smem, block_size):
    major, minor, threads_per_sm, smem_per_sm, smem_optin, reserved = _PROPS[arch]
    warp_size, regs_per_sm, regs_per_block, max_threads_per_block = 32, 65536, 65536, 1024
    # cudaOccMaxBlocksPerSMRegsLimit
    warps_per_cta = -(-block_size // warp_size)
    regs_per_warp = _round_up(num_regs * warp_size, 256)            # RegAllocationGranularity
    sub_partitions = 4                                              # SubPartitionsPerMultiprocessor
    if (regs_per_block < regs_per_warp * _round_up(warps_per_cta, sub_partitions)
            or regs_per_block < regs_per_warp * warps_per_cta or num_regs > 256):
        regs_limit = 0
    elif regs_per_warp > 0:
        warps_per_sub_partition = (regs_per_sm // sub_partitions) // regs_per_warp
        regs_limit = warps_per_sub_partition * sub_partitions // warps_per_cta
    else:
        regs_limit = 2**31 - 1
    # cudaOccMaxBlocksPerSMWarpsLimit
    warps_limit = 0 if block_size > max_threads_per_block else \
        (threads_per_sm // warp_size) // warps_per_cta
    # cudaOccMaxBlocksPerMultiprocessor
    blocks_limit = {(7, 5): 16, (8, 0): 32, (8, 6): 16, (8, 9): 24, (9, 0): 32}[major, minor]
    # cudaOccMaxBlocksPerSMSmemLimit
    granularity = 256 if major == 7 else 128                        # SMemAllocationGranularity
    allocated = _round_up(reserved + dynamic_smem, granularity)
    per_cta_limit = (smem_optin if reserved + dynamic_smem > 49152 else 49152) + \
        (reserved if major >= 8 else 0)
    if allocated > per_cta_limit:
        smem_limit = 0
    else:
        smem_limit = smem_per_sm // allocated if allocated else 2**31 - 1
    return min(regs_limit, warps_limit, blocks_limit, smem_limit)


_SHARED = (0, 1, 1000, 16384, 41984, 50176, 99328, 148480, 166912, 200000, 232448)


@pytest.mark.parametrize("arch", sorted(_PROPS))
def test_occupancy_is_nvidias_calculator(arch):
    """Every register count 16..255, block of 1..32 warps and the shared sizes above."""
    max_warps = _PROPS[arch][2] // 32
    wrong = [(regs, shared, warps) for regs in range(16, 256) for warps in range(1, 33)
             for shared in _SHARED
             if occupancy(arch, regs, shared, warps)
             != _nvidia_blocks(arch, regs, shared, 32 * warps) * warps / max_warps]
    assert not wrong, f"{arch}: {len(wrong)} cases differ, e.g. (regs, shared, warps) {wrong[:5]}"


@triton.jit
def _scaled_copy(src, dst, n, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(src + offs, mask=offs < n, other=0.0)
    tl.store(dst + offs, x * scale, mask=offs < n)


@triton.jit
def _matmul(a, b, c, M, N, K, PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    acc = tl.full((BLOCK_M, BLOCK_N), 0.0, tl.float32)   # builtins only: see triton_dequant
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(a + m[:, None] * K + (k0 + kk)[None, :],
                    mask=(m[:, None] < M) & ((k0 + kk)[None, :] < K), other=0.0)
        y = tl.load(b + (k0 + kk)[:, None] * N + n[None, :],
                    mask=((k0 + kk)[:, None] < K) & (n[None, :] < N), other=0.0)
        acc += tl.dot(x, y, input_precision=PRECISION)
    tl.store(c + m[:, None] * N + n[None, :], acc.to(c.dtype.element_ty),
             mask=(m[:, None] < M) & (n[None, :] < N))


def _copy(n, arch="sm_90", dtype=torch.float32):
    return inspect_kernel(_scaled_copy, (like(dtype), like(dtype), n, 2.0),
                          dict(BLOCK=1024, num_warps=4), arch)


def _mm(dtype, precision="ieee", blocks=(64, 64, 32), warps=4, arch="sm_90", size=1024):
    t = like(dtype)
    BM, BN, BK = blocks
    return inspect_kernel(_matmul, (t, t, t, size, size, size),
                          dict(PRECISION=precision, BLOCK_M=BM, BLOCK_N=BN, BLOCK_K=BK,
                               num_warps=warps, num_stages=3), arch)


def test_the_interpreted_kernel_still_runs_and_compiles():
    """The inspector rebuilt the kernel from its source; the interpreted one is untouched."""
    src, dst = torch.arange(10.0), torch.empty(10)
    _scaled_copy[(1,)](src, dst, 10, 2.0, BLOCK=16)
    assert torch.equal(dst, 2 * src)
    compiled = compile_kernel(_scaled_copy, (src, dst, 10, 2.0), dict(BLOCK=16), "sm_80")
    assert "cubin" in compiled.asm and ".target sm_80" in compiled.asm["ptx"]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_multiple_of_16_gets_128_bit_accesses_and_an_odd_size_does_not(arch):
    """n % 16 == 0 is specialized at launch: the mask is constant over 4 floats."""
    aligned, odd = _copy(4096, arch), _copy(4095, arch)
    assert aligned.global_loads == {"128": 2} and aligned.global_stores == {"128": 2}
    assert set(odd.global_loads) == {"32"} and set(odd.global_stores) == {"32"}
    assert aligned.spill_bytes == odd.spill_bytes == 0 and aligned.registers <= 64


def test_an_unaligned_pointer_loses_the_vectors():
    report = inspect_kernel(_scaled_copy, (like(torch.float32, aligned=False),
                                           like(torch.float32), 4096, 2.0),
                            dict(BLOCK=1024, num_warps=4), "sm_90")
    assert report.global_loads == {"32": 8} and report.global_stores == {"128": 2}


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])     # HMMA, HGMMA (sm_86, sm_89: the report)
def test_tensor_cores_for_bf16_and_tf32_not_for_exact_float32(arch):
    assert _mm(torch.bfloat16, arch=arch).tensor_core_instructions > 0
    assert _mm(torch.float16, arch=arch).tensor_core_instructions > 0
    assert _mm(torch.float32, "tf32", arch=arch).tensor_core_instructions > 0
    assert _mm(torch.float32, "ieee", arch=arch).tensor_core_instructions == 0


def test_no_tensor_cores_below_sm_80():
    """Triton 3.3 and later lowers every dot below sm_80 to FMAs on float32 (float16 too,
    which sm_75's tensor cores could take): what minimoe.launch_plan.dot_plan launches for there."""
    for dtype, precision in ((torch.float16, "ieee"), (torch.bfloat16, "ieee"),
                             (torch.float32, "tf32")):
        assert _mm(dtype, precision, arch="sm_75").tensor_core_instructions == 0


def test_a_float32_tile_too_large_for_4_warps_spills_and_8_warps_do_not():
    """An exact float32 dot runs on the FMA units. 128×128 over 4 warps is 128 accumulator
    registers a thread, which fit; with the FMA operand strips and the addresses of the
    pipelined loads next to them the thread passes sm_80's 255 registers and spills; 8 warps
    halve every thread's share."""
    four = _mm(torch.float32, blocks=(128, 128, 32), warps=4, arch="sm_80")
    eight = _mm(torch.float32, blocks=(128, 128, 32), warps=8, arch="sm_80")
    assert four.registers == 255 and four.spill_bytes > 0 and four.local_instructions > 0
    assert eight.spill_bytes == 0 and eight.local_instructions == 0


def test_read_cubin_adds_the_launch_shared_memory():
    compiled = compile_kernel(_matmul, (like(torch.bfloat16),) * 3 + (1024,) * 3,
                              dict(PRECISION="ieee", BLOCK_M=64, BLOCK_N=64, BLOCK_K=32,
                                   num_warps=4, num_stages=3), "sm_80")
    assert compiled.metadata.shared > 0
    plain = read_cubin(compiled.asm["cubin"], "sm_80", 4)
    full = read_cubin(compiled.asm["cubin"], "sm_80", 4, compiled.metadata.shared)
    assert full["shared_bytes"] == plain["shared_bytes"] + compiled.metadata.shared


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="arch must be one of"):
        _copy(4096, arch="sm_70")              # Volta: before the architectures it targets
    with pytest.raises(ValueError, match="arch must be one of"):
        occupancy("sm_70", 32, 0, 4)
    with pytest.raises(ValueError, match="kernel must be a @triton.jit function"):
        compile_kernel(lambda x: x, (1,), {}, "sm_90")



def test_a_kernel_calling_jit_helpers_compiles_and_still_runs_interpreted(tmp_path):
    """A notebook's process: TRITON_INTERPRET=1 before triton, so tl.sum and tl.zeros (and
    any @triton.jit helper) are interpreted. Compiled twins stand in while the kernel
    compiles, and everything is as before afterwards (later compiles included)."""
    code = textwrap.dedent("""
        import os
        os.environ["TRITON_INTERPRET"] = "1"
        import torch, triton, triton.language as tl
        from triton.runtime.interpreter import InterpretedFunction
        from gpucompile import inspect_kernel, like

        @triton.jit
        def twice(v):
            return 2 * v

        @triton.jit
        def row_sums(x, out, n, BLOCK: tl.constexpr):
            cols = tl.arange(0, BLOCK)
            row = tl.load(x + tl.program_id(0) * n + cols, mask=cols < n, other=0.0)
            total = tl.sum(twice(row) + tl.zeros((BLOCK,), tl.float32), axis=0)
            tl.store(out + tl.program_id(0), total)

        assert isinstance(tl.sum, InterpretedFunction)
        f32 = like(torch.float32)
        for arch in ("sm_80", "sm_90"):
            report = inspect_kernel(row_sums, (f32, f32, 64), dict(BLOCK=64, num_warps=1), arch)
            assert report.spill_bytes == 0 and report.global_stores, report
        assert isinstance(tl.sum, InterpretedFunction) and isinstance(twice, InterpretedFunction)
        x, out = torch.arange(12.0).reshape(3, 4), torch.empty(3)
        row_sums[(3,)](x, out, 4, BLOCK=8)
        assert torch.equal(out, 2 * x.sum(1)), out
        print("ok")
    """)
    script = tmp_path / "notebook.py"            # Triton reads a kernel's source from a file
    script.write_text(code)
    env = {**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"}
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-3000:]
