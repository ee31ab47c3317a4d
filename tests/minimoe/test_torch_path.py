"""The sort-based PyTorch path of `parallel_linear` (backend="torch"): its backward allocates
no zero-filled gradient per expert, and `torch_parallel_linear_dx` (the dx that
nf4_experts computes without autograd) gives autograd's bits, on awkward routings: an expert
with no rows, uneven counts, every row to one expert, one token; float32 and float64.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from minimoe import flatten_sort_count, parallel_linear
from minimoe.parallel_experts import torch_parallel_linear_dx

pytestmark = pytest.mark.usefixtures("single_thread")

# (T, K, N, E, k, experts [T, k] by rule): "skip" = expert 1 never chosen and expert 0 on
# every token (uneven counts), "one" = every token to experts 0..k-1, "rand" = any k.
ROUTINGS = [(9, 24, 40, 5, 2, "skip"), (1, 40, 24, 4, 3, "rand"), (13, 24, 16, 6, 1, "skip"),
            (6, 16, 24, 3, 3, "one")]
LAYOUTS = [(False, False), (False, True), (True, False), (True, True)]     # grouped_in, _out


def _experts(T: int, E: int, k: int, rule: str, gen: torch.Generator) -> torch.Tensor:
    if rule == "one":
        return torch.arange(k).repeat(T, 1)
    if rule == "rand":
        return torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    rest = torch.stack([2 + torch.randperm(E - 2, generator=gen)[:k - 1] for _ in range(T)])
    return torch.cat([torch.zeros(T, 1, dtype=torch.int64), rest], 1)       # [T, k]


def _problem(case, grouped_in: bool, dtype=torch.float32, seed=0):
    T, K, N, E, k, rule = case
    gen = torch.Generator().manual_seed(seed)
    experts = _experts(T, E, k, rule, gen)
    routing = flatten_sort_count(experts, E)
    x = torch.randn(T * k if grouped_in else T, K, generator=gen, dtype=dtype)
    W = torch.randn(E, K, N, generator=gen, dtype=dtype) / K ** 0.5
    return x, W, experts, routing


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("grouped_in, grouped_out", LAYOUTS, ids=["ss", "sg", "gs", "gg"])
@pytest.mark.parametrize("case", ROUTINGS, ids=lambda c: "T{}-K{}-N{}-E{}-k{}-{}".format(*c))
def test_dx_without_autograd_has_autograds_bits(case, grouped_in, grouped_out, dtype):
    x, W, _, routing = _problem(case, grouped_in, dtype)
    xl = x.clone().requires_grad_()
    out = parallel_linear(xl, W, routing, grouped_in=grouped_in, grouped_out=grouped_out,
                          backend="torch")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=dtype)
    out.backward(dout)
    dx = torch_parallel_linear_dx(dout, W, routing, grouped_in, grouped_out, x.shape[0])
    assert dx.dtype == dtype and torch.equal(dx, xl.grad)
    # and it is the gradient: row by row, dX = dY W_eᵀ, summed over each token's slots
    sei, ssi, _ = routing
    dYg = dout if grouped_out else dout[ssi]                          # [M, N] sorted
    dXg = torch.einsum("mn,mkn->mk", dYg, W[sei])                     # [M, K] sorted
    want = dXg if grouped_in else torch.zeros_like(x).index_add(0, ssi // routing.k, dXg)
    torch.testing.assert_close(dx, want)


class _FilledElements(TorchDispatchMode):
    """Elements of every tensor an operator zero-fills or builds from zeros."""

    FILLS = ("zeros", "new_zeros", "zero_", "fill_", "slice_backward", "select_backward")

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.__name__.split(".")[0] in self.FILLS:
            self.elements += sum(t.numel() for t in tree_leaves(out)
                                 if isinstance(t, torch.Tensor))
        return out


@pytest.mark.parametrize("grouped_in", [False, True])
def test_backward_fills_no_gradient_per_expert(grouped_in):
    """dX of E expert slices comes back in one piece: at most the [T, K] gather's gradient is
    zero-filled, not one [M, K] per expert (a slice's backward) to be summed."""
    T, K, N, E, k = 64, 64, 8, 8, 2
    gen = torch.Generator().manual_seed(0)
    experts = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    routing = flatten_sort_count(experts, E)
    x = torch.randn(T * k if grouped_in else T, K, generator=gen, requires_grad=True)
    W = torch.randn(E, K, N, generator=gen, requires_grad=True)
    out = parallel_linear(x, W, routing, grouped_in=grouped_in, grouped_out=True,
                          backend="torch")
    fills = _FilledElements()
    with fills:
        out.backward(torch.ones_like(out))
    assert fills.elements <= T * K, fills.elements
