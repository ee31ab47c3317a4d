"""Token sequences for supervised fine-tuning: prompt + answer + <eos>, right-padded.

The loss is taken on the answer (and its <eos>) only, unless the trainer asks to train on
the prompt too; padding never counts. `BatchOrder` is the order the loop draws rows in.

Reward-weighted SFT: each example may carry a weight, derived from a per-example reward by
`reward_weights`: shift so that the lowest reward is 0, then divide by the mean,

    w_i = (r_i - min r) / mean_j (r_j - min r),

so the weights are >= 0 with mean 1 (the loss keeps plain SFT's scale), do not depend on the
rewards' offset or (positive) scale, and negative rewards need no special case. The
worst-rewarded examples get weight 0; with 0/1 rewards this is rejection-sampling SFT (train
on the accepted examples only). When every reward is equal there is nothing to prefer and
every weight is 1.0: plain SFT (each example counting equally, see `train.sequence_loss`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

import torch


def reward_weights(rewards: Sequence[float] | torch.Tensor) -> torch.Tensor:
    """Per-example rewards [N] -> float32 weights [N], >= 0 with mean 1 (see the module doc)."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("rewards must hold at least one value")
    bad = (~torch.isfinite(r)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"rewards[{i}] is {r[i].item()}; every reward must be finite "
                         f"({bad.numel()} non-finite value(s))")
    shifted = r - r.min()                  # float64: equal rewards give exactly 0 here
    if not shifted.any():
        return torch.ones(r.numel(), dtype=torch.float32)
    return (shifted / shifted.mean()).float()


@dataclass
class SequenceData:
    tokens: torch.Tensor       # [N, L] int64, right-padded with pad_id
    answer_mask: torch.Tensor  # [N, L] bool, True on answer tokens (including the <eos>)
    lengths: torch.Tensor      # [N] int64, tokens before padding
    weights: torch.Tensor | None = None  # [N] float32 example weights (reward-weighted SFT)

    def __post_init__(self):
        if not isinstance(self.tokens, torch.Tensor) or self.tokens.dim() != 2:
            raise ValueError(f"tokens must be a 2-D [N, L] tensor, got "
                             f"{getattr(self.tokens, 'shape', type(self.tokens).__name__)}")
        if len(self) == 0:
            raise ValueError("tokens holds no examples (N = 0): a dataset needs at least one "
                             "sequence to train or evaluate on")
        if self.weights is None:
            return
        w = self.weights
        if w.shape != (len(self),) or w.dtype != torch.float32:
            raise ValueError(f"weights must be a float32 tensor of shape [{len(self)}], got "
                             f"{w.dtype} {list(w.shape)}")
        if not (torch.isfinite(w).all() and (w >= 0).all()):
            raise ValueError("weights must be finite and >= 0")

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[list[int], list[int]]], pad_id: int = 0,
                   rewards: Sequence[float] | torch.Tensor | None = None) -> SequenceData:
        """pairs of (prompt ids, answer ids ending with <eos>) -> padded tensors.

        `rewards` (one per pair) set the example weights with `reward_weights`.
        """
        if not pairs:
            raise ValueError("pairs must hold at least one (prompt, answer) pair")
        L = max(len(p) + len(a) for p, a in pairs)
        tokens = torch.full((len(pairs), L), pad_id, dtype=torch.long)
        answer_mask = torch.zeros((len(pairs), L), dtype=torch.bool)
        for i, (p, a) in enumerate(pairs):
            if not a:
                raise ValueError(f"pairs[{i}] has an empty answer; nothing to train on")
            tokens[i, :len(p) + len(a)] = torch.tensor(p + a)
            answer_mask[i, len(p):len(p) + len(a)] = True
        lengths = torch.tensor([len(p) + len(a) for p, a in pairs])
        data = cls(tokens, answer_mask, lengths)
        return data if rewards is None else data.with_rewards(rewards)

    def __len__(self) -> int:
        return self.tokens.shape[0]

    def with_rewards(self, rewards: Sequence[float] | torch.Tensor) -> SequenceData:
        """A copy whose weights come from per-example `rewards` [N] (see `reward_weights`)."""
        n = len(torch.as_tensor(rewards).flatten())
        if n != len(self):
            raise ValueError(f"rewards has {n} values for {len(self)} examples")
        return replace(self, weights=reward_weights(rewards))

    def subset(self, idx: torch.Tensor) -> SequenceData:
        """Rows `idx` (weights kept as they are, not renormalised)."""
        return SequenceData(self.tokens[idx], self.answer_mask[idx], self.lengths[idx],
                            None if self.weights is None else self.weights[idx])

    def split(self, val_fraction: float, seed: int) -> tuple[SequenceData, SequenceData]:
        """(train, val): a random round(N · val_fraction) rows, drawn from `seed`, are val.

        Both parts keep at least one row; their rows keep the original order.
        """
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
        n_val = round(len(self) * val_fraction)
        if not 1 <= n_val <= len(self) - 1:
            raise ValueError(f"val_fraction={val_fraction} of {len(self)} examples leaves "
                             f"{n_val} for validation and {len(self) - n_val} for training; "
                             f"each needs at least one")
        perm = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        val = perm[:n_val].sort().values
        train = perm[n_val:].sort().values
        return self.subset(train), self.subset(val)

    def batch(self, idx: torch.Tensor, train_on_prompt: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows `idx` as next-token pairs: x, y, loss mask, each [b, l] with l = longest - 1."""
        l = int(self.lengths[idx].max())
        tok = self.tokens[idx, :l]
        x, y = tok[:, :-1], tok[:, 1:]
        if train_on_prompt:
            mask = torch.arange(1, l)[None, :] < self.lengths[idx, None]
        else:
            mask = self.answer_mask[idx, 1:l]
        return x, y, mask


class BatchOrder:
    """Index batches forever, reshuffled at every epoch from `seed`; resumable mid-epoch."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.batch_size = n, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.perm: torch.Tensor | None = None      # [n] this epoch's order
        self.pos = 0                               # next batch starts at perm[pos]

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        # Drop the last partial batch, but keep one (smaller) batch when n < batch_size.
        if self.perm is None or self.pos > max(self.n - self.batch_size, 0):
            self.perm, self.pos = torch.randperm(self.n, generator=self.generator), 0
        idx = self.perm[self.pos:self.pos + self.batch_size]
        self.pos += self.batch_size
        return idx

    def load(self, generator_state: torch.Tensor, perm: torch.Tensor, pos: int) -> None:
        if len(perm) != self.n:
            raise ValueError(f"cannot resume: the checkpoint's batch order covers {len(perm)} "
                             f"training rows, the data has {self.n}")
        self.generator.set_state(generator_state)
        self.perm, self.pos = perm, pos
