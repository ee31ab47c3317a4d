"""Sort the [T, k] expert choices once; every dispatch kernel then walks the sorted rows."""

from __future__ import annotations

import torch


def flatten_sort_count(expert_idxs: torch.Tensor, num_experts: int
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """expert_idxs [T, k] -> (sorted_expert_idxs [T·k], sorted_scattered_idxs [T·k],
    expert_offsets [E]).

    Flatten the choices in slot order (slot s = t·k + j), sort them stably by expert:
    `sorted_scattered_idxs[i]` is the slot of sorted row i (its token is slot // k), and
    `expert_offsets[e]` the inclusive cumulative count, i.e. the end row of expert e (its
    rows are offsets[e-1]..offsets[e], with offsets[-1] read as 0). int64 throughout.
    """
    if expert_idxs.dim() != 2:
        raise ValueError(f"expert_idxs must be [tokens, k], got shape {tuple(expert_idxs.shape)}")
    if expert_idxs.dtype.is_floating_point or expert_idxs.dtype == torch.bool:
        raise ValueError(f"expert_idxs must be an integer tensor, got {expert_idxs.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1, got {num_experts}")
    flat = expert_idxs.reshape(-1).long()                                  # [T·k]
    if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= num_experts):
        raise ValueError(f"expert_idxs must lie in 0..{num_experts - 1}, got "
                         f"{int(flat.min())}..{int(flat.max())}")
    sorted_expert_idxs, sorted_scattered_idxs = flat.sort(stable=True)      # [T·k] each
    counts = torch.bincount(flat, minlength=num_experts)                   # [E]
    return sorted_expert_idxs, sorted_scattered_idxs, counts.cumsum(0)
