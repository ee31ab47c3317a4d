"""Token sequences for supervised fine-tuning: prompt + answer + <eos>, right-padded.

The loss is taken on the answer (and its <eos>) only, unless the trainer asks to train on
the prompt too; padding never counts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass
class SequenceData:
    tokens: torch.Tensor       # [N, L] int64, right-padded with pad_id
    answer_mask: torch.Tensor  # [N, L] bool, True on answer tokens (including the <eos>)
    lengths: torch.Tensor      # [N] int64, tokens before padding

    @classmethod
    def from_pairs(cls, pairs: Sequence[tuple[list[int], list[int]]], pad_id: int = 0
                   ) -> SequenceData:
        """pairs of (prompt ids, answer ids ending with <eos>) -> padded tensors."""
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
        return cls(tokens, answer_mask, lengths)

    def __len__(self) -> int:
        return self.tokens.shape[0]

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
