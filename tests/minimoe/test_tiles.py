"""The dispatch's row tiles: cut per expert (`ops.expert_tiles`), never spanning two.

Checked against a loop over the sorted rows on awkward routings (one row, more experts than
rows, experts with no rows, counts that are and are not multiples of the tile), then through
the kernel with many experts and few tokens each, where most tiles are spare.
"""

from __future__ import annotations

import pytest
import torch

from minimoe import flatten_sort_count, reference, scatter2scatter
from minimoe.ops import aligned, expert_tiles


def _loop_tiles(expert_of_row: list[int], block: int) -> list[tuple[int, int]]:
    """(start, end of that expert's rows) of each tile, walking the sorted rows."""
    tiles, i = [], 0
    while i < len(expert_of_row):
        e = expert_of_row[i]
        end = i
        while end < len(expert_of_row) and expert_of_row[end] == e:
            end += 1
        tiles += [(s, end) for s in range(i, end, block)]
        i = end
    return tiles


ROUTINGS = [([0], 3, 64), ([2], 5, 1), ([0, 0, 0, 0, 0], 1, 2), ([1, 1, 3, 3, 3, 3, 3], 6, 2),
            ([0] * 64 + [1] * 65 + [4] * 3, 5, 64), (list(range(9)), 40, 4)]


@pytest.mark.parametrize("rows, E, block", ROUTINGS)
def test_expert_tiles_against_a_loop(rows, E, block):
    start, end = expert_tiles(torch.tensor(rows), E, block)
    M = len(rows)
    assert start.shape == end.shape == (-(-M // block) + min(E, M) - 1,)
    want = _loop_tiles(rows, block)
    got = list(zip(start.tolist(), end.tolist(), strict=True))
    assert got[:len(want)] == want
    assert all(s == e == 0 for s, e in got[len(want):])          # spare tiles do nothing


def test_tiles_cover_each_row_once_and_never_span_experts():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        E = int(torch.randint(1, 30, (1,), generator=g))
        rows = torch.randint(0, E, (int(torch.randint(1, 200, (1,), generator=g)),),
                             generator=g).sort().values
        block = int(torch.randint(1, 70, (1,), generator=g))
        start, end = expert_tiles(rows, E, block)
        covered = torch.zeros(rows.numel(), dtype=torch.long)
        for s, e in zip(start.tolist(), end.tolist(), strict=True):
            if s == e:
                continue
            covered[s:min(s + block, e)] += 1
            assert len(set(rows[s:min(s + block, e)].tolist())) == 1
        assert torch.equal(covered, torch.ones_like(covered))


@pytest.mark.parametrize("T, k, E", [(5, 3, 70), (1, 1, 64), (40, 2, 3)])
def test_many_experts_few_tokens_through_the_kernel(T, k, E):
    g = torch.Generator().manual_seed(T + E)
    x, W = torch.randn(T, 24, generator=g), torch.randn(E, 24, 40, generator=g)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    sei, ssi, _ = flatten_sort_count(experts, E)
    got = scatter2scatter(x, W, sei, ssi, k)
    assert (got - reference.linear_loop(x, W, experts)).abs().max() < 1e-4


def test_aligned_reads_the_sizes_and_strides_but_not_the_rank():
    names = ["X", "K", "N", "sxm", "sxk", "R", "scaling"]
    assert aligned(names, (None, 2048, 768, 2048, 1, 8, 2.0))
    assert not aligned(names, (None, 40, 768, 40, 1, 16, 2.0))
    assert not aligned(names, (None, 2048, 768, 2048, 3, 16, 2.0))


@pytest.mark.parametrize("name", ["scatter2scatter", "group", "group_bwd_W", "group_bwd_lora"])
def test_the_gpu_autotuners_are_built_from_the_configurations(name):
    """What a GPU launch would tune over, built here without one: each list's BLOCK sizes are
    constexpr parameters of the kernel the launcher does not pass itself, the tuning keys are
    its arguments, and the unaligned list is used where there is one."""
    from minimoe import kernels, ops
    kernel = kernels.KERNELS[name]
    for bits in (16, 32):
        for is_aligned in (True, False):
            tuned = ops._autotuned(name, bits, is_aligned)
            want = kernels.configs(name, bits, is_aligned)
            got = [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)
                   for c in tuned.configs]
            assert got == want
            passed = {"BLOCK_R"} | ({"BLOCK_M"} if name == "scatter2scatter" else set())
            for c in tuned.configs:                     # the launcher passes `passed` itself
                assert set(c.kwargs) <= set(kernel.arg_names) - passed
            assert set(tuned.keys) <= set(kernel.arg_names)
    unaligned = kernels.configs(name, 16, aligned=False)
    assert (unaligned is kernels.CONFIGS[name].get("unaligned", kernels.CONFIGS[name][16]))
