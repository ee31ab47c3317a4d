"""A Routing's row tiles (`Routing.tiles`): cut once per tile size, however many
scatter2scatter launches are given the routing, and the same tiles a launch cuts alone."""

from __future__ import annotations

import pytest
import torch

from minimoe import flatten_sort_count, ops, reference, routing


@pytest.fixture
def counted(monkeypatch):
    """routing.expert_tiles, counting its calls: `counted.calls`."""
    real = routing.expert_tiles

    def expert_tiles(*args):
        expert_tiles.calls += 1
        return real(*args)

    expert_tiles.calls = 0
    monkeypatch.setattr(routing, "expert_tiles", expert_tiles)
    monkeypatch.setattr(ops, "expert_tiles", expert_tiles)
    return expert_tiles


def _case(T=9, k=2, E=5, K=24, N=40):
    g = torch.Generator().manual_seed(4)
    experts = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])   # [T, k]
    x, W = torch.randn(T, K, generator=g), torch.randn(E, K, N, generator=g)
    return experts, x, W


def test_tiles_are_cut_once_for_every_launch_and_equal_a_launch_alone(counted):
    experts, x, W = _case()
    r = flatten_sort_count(experts, W.shape[0])
    sei, ssi, _ = r
    want = reference.linear_loop(x, W, experts)                               # [T·k, N]
    for _ in range(3):
        Y = ops.scatter2scatter(x, W, sei, ssi, r.k, trusted=True, routing=r)
        assert (Y - want).abs().max() < 1e-4
    Wt = W.transpose(1, 2).contiguous()                                       # dX's launch
    ops.scatter2scatter(torch.randn(sei.shape[0], W.shape[2]), Wt, sei, ssi, 1,
                        x_grouped=True, trusted=True, routing=r.with_k(1))
    assert counted.calls == 1
    start, end = r.tiles(ops._kernels().TILE_M)
    alone = routing.expert_tiles(sei, W.shape[0], ops._kernels().TILE_M)       # counted: 2
    assert torch.equal(start, alone[0]) and torch.equal(end, alone[1])
    assert counted.calls == 2
    ops.scatter2scatter(x, W, sei, ssi, r.k)                                  # no routing given
    assert counted.calls == 3


def test_each_tile_size_is_cut_once_and_with_k_shares_them(counted):
    experts, _, W = _case()
    r = flatten_sort_count(experts, W.shape[0])
    a, b = r.tiles(4), r.tiles(4)
    assert a is b and counted.calls == 1
    assert r.with_k(1).tiles(4) is a and counted.calls == 1
    r.tiles(8)
    assert counted.calls == 2
    _, compact = r.compacted()                                  # other ids: its own tiles
    compact.tiles(4)
    assert counted.calls == 3


def test_a_routing_of_other_rows_is_refused():
    experts, x, W = _case()
    r = flatten_sort_count(experts, W.shape[0])
    other = flatten_sort_count(experts[:4], W.shape[0])
    sei, ssi, _ = r
    with pytest.raises(ValueError, match="routing must be the Routing of these 18 sorted rows"):
        ops.scatter2scatter(x, W, sei, ssi, r.k, routing=other)
    with pytest.raises(ValueError, match="and 4 experts on cpu, got Routing.*n_experts=5"):
        ops.scatter2scatter(x, W[:4], sei.clamp(max=3), ssi, r.k, routing=r)
    with pytest.raises(ValueError, match="routing must be the Routing"):
        ops.scatter2scatter(x, W, sei, ssi, r.k, routing=(sei, ssi))


@pytest.mark.parametrize("lora", [False, True])
def test_parallel_linear_cuts_its_tiles_once_for_forward_and_backward(counted, lora):
    from minimoe import ExpertLoRA, parallel_linear

    experts, x, W = _case()
    r = flatten_sort_count(experts, W.shape[0])
    x.requires_grad_()
    gates = torch.rand(experts.shape, requires_grad=True)
    extra = (ExpertLoRA(torch.randn(3 * W.shape[0], W.shape[1], requires_grad=True),
                        torch.randn(W.shape[2], 3 * W.shape[0], requires_grad=True), 0.5)
             if lora else None)
    out = parallel_linear(x, W, r, gates=gates, lora=extra, backend="triton")   # [T, N]
    out.square().sum().backward()                # two launches forward and dX: one cut
    assert counted.calls == 1 and x.grad is not None
