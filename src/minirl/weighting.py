"""Reward-weighted SFT: offline answers with rewards, turned into per-example loss weights.

The data: a JSONL file, one JSON object per line with a prompt, an answer and a reward (for
example, sampled answers scored by a verifier). Training is minituner's ordinary loop on a
`SequenceData` whose `weights` scale each example's loss (`minituner.sequence_loss`:
Σ w_i · loss_i / b).

Weights are normalised per prompt group, not over the whole file. Within the answers to one
prompt, minituner's `reward_weights` shifts the worst reward to 0 and scales to mean 1:

    w_i = (r_i − min_{j∈g} r_j) / mean_{j∈g}(r_j − min_{k∈g} r_k)      for i in group g,

and a group whose rewards are all equal gets weight 0 (nothing to prefer, as GRPO's zero
advantage). Why per group: normalised globally, every answer with reward 1 gets the same
weight, so a prompt the model already solves (all of its answers right) takes weight in
proportion to its many right answers, while a hard prompt's single right answer is a drop in
that sea. Per group, the solved prompt gives nothing and the hard prompt's right answer gets
weight G; each prompt that has something to teach teaches it with the same total weight.

What the weights mean in the loss:
- w > 0: imitate this answer, w times as strongly as plain SFT would.
- w = 0: the example adds nothing to the loss or the gradient (it still counts in the
  batch's b). The worst answer of every group, and every answer of a group without reward
  variance, get 0; with 0/1 rewards this is rejection sampling: train on the accepted
  answers of prompts that have some wrong ones. `data.subset(data.weights > 0)` drops them.
- w < 0 never occurs: it would mean pushing the answer's likelihood down, which has no floor
  (log p → −∞ on one bad answer teaches nothing about good ones) and so `SequenceData`
  refuses it. Learning from bad answers is what GRPO's negative advantages do, with the
  clipped ratio and the KL bounding the step.
"""

from __future__ import annotations

import json
import math
import numbers
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from minigpt import CharTokenizer
from minituner import SequenceData, reward_weights


@dataclass
class RewardedRecords:
    """The records of a rewarded JSONL file, in file order."""
    prompts: list[str]
    answers: list[str]
    rewards: torch.Tensor      # [N] float64
    groups: torch.Tensor       # [N] int64: group of each record, numbered by first appearance

    def __len__(self) -> int:
        return len(self.prompts)


def _field(record: dict, name: str, where: str):
    if name not in record:
        raise ValueError(f"{where}: the record has no {name!r} field (its fields: "
                         f"{sorted(record)})")
    return record[name]


def read_rewarded_jsonl(path: str | Path, reward_field: str = "reward",
                        group_field: str = "prompt", prompt_field: str = "prompt",
                        answer_field: str = "answer") -> RewardedRecords:
    """Read one JSON object per line (blank lines skipped); errors name the line number.

    Prompts and answers must be strings, rewards finite numbers (not booleans); records with
    equal `group_field` values (any JSON value; by default the prompt) form one group.
    """
    prompts, answers, rewards, group_of = [], [], [], {}
    groups = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not valid JSON ({err})") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
            prompt, answer = (_field(record, n, where) for n in (prompt_field, answer_field))
            if not (isinstance(prompt, str) and isinstance(answer, str)):
                raise ValueError(f"{where}: {prompt_field!r} and {answer_field!r} must be "
                                 f"strings, got {prompt!r}, {answer!r}")
            reward = _field(record, reward_field, where)
            if isinstance(reward, bool) or not isinstance(reward, numbers.Real) \
                    or not math.isfinite(reward):
                raise ValueError(f"{where}: {reward_field!r} must be a finite number, got "
                                 f"{reward!r}")
            key = json.dumps(_field(record, group_field, where), sort_keys=True)
            groups.append(group_of.setdefault(key, len(group_of)))
            prompts.append(prompt)
            answers.append(answer)
            rewards.append(float(reward))
    if not prompts:
        raise ValueError(f"{path} holds no records")
    return RewardedRecords(prompts, answers, torch.tensor(rewards, dtype=torch.float64),
                           torch.tensor(groups, dtype=torch.long))


def _group_ids(groups: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """Group labels (ints, or any hashable values) -> int64 ids [N]."""
    if isinstance(groups, torch.Tensor):
        if groups.is_floating_point() or groups.dtype == torch.bool:
            raise ValueError(f"groups must hold integer ids or hashable labels, got {groups.dtype}")
        return groups.flatten().long()
    ids: dict = {}
    return torch.tensor([ids.setdefault(k, len(ids)) for k in groups], dtype=torch.long)


def group_weights(rewards: torch.Tensor | Sequence[float],
                  groups: torch.Tensor | Sequence[Hashable]) -> torch.Tensor:
    """Per-group reward weights [N] float32 (see the module doc): `reward_weights` within each
    group with reward variance, 0 for every example of a group without."""
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    g = _group_ids(groups)
    if r.numel() == 0:
        raise ValueError("rewards must hold at least one value")
    if g.shape != r.shape:
        raise ValueError(f"groups must give one group per reward: {r.numel()} rewards, "
                         f"{g.numel()} groups")
    bad = (~torch.isfinite(r)).nonzero().flatten()
    if bad.numel():
        i = int(bad[0])
        raise ValueError(f"rewards[{i}] is {r[i].item()}; every reward must be finite "
                         f"({bad.numel()} non-finite value(s))")
    w = torch.zeros(r.numel(), dtype=torch.float32)
    for k in torch.unique(g):
        idx = (g == k).nonzero().flatten()
        if (r[idx] != r[idx[0]]).any():
            w[idx] = reward_weights(r[idx])
    return w


def sft_pairs(prompts: Sequence[str], answers: Sequence[str],
              tokenizer: CharTokenizer | None = None) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids + <eos>) pairs, what `SequenceData.from_pairs` takes."""
    tok = tokenizer or CharTokenizer()
    return [(tok.encode(p), tok.encode(a) + [tok.eos_id])
            for p, a in zip(prompts, answers, strict=True)]


def rewarded_sequence_data(records: RewardedRecords, tokenizer: CharTokenizer | None = None
                           ) -> SequenceData:
    """A `SequenceData` of the records with `group_weights` as its example weights.

    Raises ValueError when no group has reward variance (every weight would be 0): per-group
    weighting needs several answers per prompt with different rewards; for one answer per
    prompt, minituner's global `SequenceData.with_rewards` is the tool.
    """
    w = group_weights(records.rewards, records.groups)
    if not w.any():
        raise ValueError(f"no prompt group among the {len(records)} records has rewards that "
                         f"differ, so every per-group weight is 0 and there is nothing to "
                         f"learn; with one answer per prompt use SequenceData.with_rewards "
                         f"(global weights)")
    tok = tokenizer or CharTokenizer()
    data = SequenceData.from_pairs(sft_pairs(records.prompts, records.answers, tok), tok.pad_id)
    return replace(data, weights=w)
