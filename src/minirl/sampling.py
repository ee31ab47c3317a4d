"""Sampling a group of G completions per prompt: the "generate" half of GRPO.

GRPO compares answers to the same prompt with each other, so every prompt is sampled G
times. The P·G rows come back in prompt-major order (row p·G + g is sample g of prompt p), so
`rewards.view(P, G)` lines up with the groups and `Samples.group` says which prompt each row
answers.

Decoding is batched: all prompts of one length, each repeated G times, are decoded together
(same length, so no left-padding and the positions stay those of training). MiniGPT has no KV
cache; each step runs the whole prefix again, which at these sizes costs less than the
bookkeeping a cache would need. A row that has produced <eos> keeps being decoded (the batch
keeps its shape) until every row has; what it draws after its <eos> is dropped.

Determinism: the only randomness is `torch.multinomial` with `generator`, drawn on the
generator's device (a CPU generator works for a model on a GPU too), in a fixed order
(buckets by first appearance, then steps), so the same seed gives the same samples.

Completion tokens are told by `completion_mask`, not by their ids: a model may draw <pad>
inside a completion (rarely, once trained), and its decoded text drops it, as
`CharTokenizer.decode` does.

The sequence never grows past the model's `block_size`: a prompt whose length plus
`max_new_tokens` exceeds it is refused up front rather than cropped, since a cropped window
would score the completion under a context the training forward never sees.
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from minigpt import CharTokenizer
from minigpt.tasks import Example

from .logprobs import check_logits


@dataclass
class Samples:
    """P prompts × G completions, rows in prompt-major order."""
    tokens: torch.Tensor           # [P·G, L] int64: prompt + completion, right-padded with <pad>
    prompt_lengths: torch.Tensor   # [P·G] int64: prompt tokens at the start of each row
    completion_mask: torch.Tensor  # [P·G, L] bool: True on completion tokens, <eos> included
    finished: torch.Tensor         # [P·G] bool: ended with <eos> (False: hit max_new_tokens)
    completions: list[str]         # [P·G] decoded completions, without the <eos>
    group: torch.Tensor            # [P·G] int64: the prompt each row answers (row // G)
    group_size: int                # G

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def n_prompts(self) -> int:
        return len(self) // self.group_size

    @property
    def target_mask(self) -> torch.Tensor:
        """[P·G, L-1] bool: completion tokens as next-token targets, aligned with
        `token_logprobs` (position t scores tokens[:, t+1])."""
        return self.completion_mask[:, 1:]

    def rows(self, rows: slice) -> Samples:
        """The rows `rows` (a micro-batch); `group` and `group_size` keep their meaning."""
        return dataclasses.replace(
            self, tokens=self.tokens[rows], prompt_lengths=self.prompt_lengths[rows],
            completion_mask=self.completion_mask[rows], finished=self.finished[rows],
            completions=self.completions[rows], group=self.group[rows])


def _prompt_ids(prompt: Example | str | Sequence[int], tok: CharTokenizer, i: int) -> list[int]:
    if isinstance(prompt, Example):
        ids = tok.encode(prompt.prompt)
    elif isinstance(prompt, str):
        ids = tok.encode(prompt)
    elif isinstance(prompt, list | tuple) and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        ids = list(prompt)
    else:
        raise ValueError(f"prompts[{i}] must be an Example, a string or a list of token ids, "
                         f"got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"prompts[{i}] is empty; sampling needs at least one prompt token")
    return ids


def _check_args(group_size, max_new_tokens, temperature) -> None:
    for name, value in (("group_size", group_size), ("max_new_tokens", max_new_tokens)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not (isinstance(temperature, int | float) and math.isfinite(temperature)
            and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0 (sampling; greedy decoding is "
                         f"minigpt.greedy_generate), got {temperature!r}")


@torch.no_grad()
def _decode_bucket(model, prompt: torch.Tensor, max_new_tokens: int, temperature: float,
                   generator: torch.Generator | None, eos_id: int) -> torch.Tensor:
    """prompt [b, n] -> [b, n + steps]: sampled continuations (anything after a row's <eos>
    is left for the caller to drop)."""
    seq, done = prompt, torch.zeros(prompt.shape[0], dtype=torch.bool, device=prompt.device)
    draw_on = generator.device if generator is not None else prompt.device
    for _ in range(max_new_tokens):
        logits = model(seq)[:, -1].float()                                   # [b, V]
        check_logits(logits, "the model's logits while sampling")
        probs = (logits / temperature).softmax(-1)                           # [b, V]
        nxt = torch.multinomial(probs.to(draw_on), 1, generator=generator)[:, 0]
        nxt = nxt.to(seq.device)                                             # [b]
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        done |= nxt == eos_id
        if done.all():
            break
    return seq


def sample_groups(model, prompts: Sequence[Example | str | Sequence[int]], group_size: int,
                  max_new_tokens: int, *, temperature: float = 1.0,
                  generator: torch.Generator | None = None,
                  tokenizer: CharTokenizer | None = None) -> Samples:
    """Sample `group_size` completions of each prompt (Example, text, or token ids) until
    <eos> or `max_new_tokens`, from softmax(logits / temperature).

    The model runs in eval mode (no LoRA dropout) and gets its mode back afterwards. It may be
    any MiniGPT: dense or MoE (either MoE backend), plain, LoRA or QLoRA; it needs only
    `model(idx) -> logits` and `model.config.block_size`.
    """
    if not prompts:
        raise ValueError("prompts is empty; sample_groups needs at least one prompt")
    _check_args(group_size, max_new_tokens, temperature)
    tok = tokenizer or CharTokenizer()
    ids = [_prompt_ids(p, tok, i) for i, p in enumerate(prompts)]
    block_size = model.config.block_size
    for i, p in enumerate(ids):
        if len(p) + max_new_tokens > block_size:
            raise ValueError(
                f"prompts[{i}] has {len(p)} tokens; with max_new_tokens={max_new_tokens} the "
                f"sequence could reach {len(p) + max_new_tokens} tokens, more than the model's "
                f"block_size={block_size}; use max_new_tokens <= {block_size - len(p)} or a "
                f"shorter prompt")
    device = next(model.parameters()).device
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(ids):
        by_len[len(p)].append(i)
    G = group_size
    rows: list[list[int]] = [[] for _ in range(len(ids) * G)]   # completion ids (with <eos>)
    was_training = model.training
    model.eval()
    try:
        for idxs in by_len.values():
            prompt = torch.tensor([ids[i] for i in idxs], device=device)     # [b, n]
            seq = _decode_bucket(model, prompt.repeat_interleave(G, dim=0), max_new_tokens,
                                 temperature, generator, tok.eos_id)     # [b·G, n + s]
            for j, gen in enumerate(seq[:, prompt.shape[1]:].tolist()):
                row = idxs[j // G] * G + j % G
                rows[row] = gen[:gen.index(tok.eos_id) + 1] if tok.eos_id in gen else gen
    finally:
        model.train(was_training)
    return _assemble(ids, rows, G, tok)


def _assemble(ids: list[list[int]], rows: list[list[int]], G: int, tok: CharTokenizer
              ) -> Samples:
    """Prompt + completion per row, right-padded into one [P·G, L] tensor with its masks."""
    prompt_of = [ids[r // G] for r in range(len(rows))]
    L = max(len(p) + len(c) for p, c in zip(prompt_of, rows, strict=True))
    tokens = torch.full((len(rows), L), tok.pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), L), dtype=torch.bool)
    for r, (p, c) in enumerate(zip(prompt_of, rows, strict=True)):
        tokens[r, :len(p) + len(c)] = torch.tensor(p + c)
        mask[r, len(p):len(p) + len(c)] = True
    return Samples(
        tokens=tokens,
        prompt_lengths=torch.tensor([len(p) for p in prompt_of]),
        completion_mask=mask,
        finished=torch.tensor([bool(c) and c[-1] == tok.eos_id for c in rows]),
        completions=[tok.decode(c) for c in rows],
        group=torch.arange(len(ids)).repeat_interleave(G),
        group_size=G)


def pass_at_k(model, examples: Sequence[Example], k: int, max_new_tokens: int, *,
              temperature: float = 1.0, generator: torch.Generator | None = None) -> float:
    """Share of `examples` for which at least one of `k` sampled completions is exactly the
    answer: whether sampling can find a right answer to reinforce (GRPO learns nothing on a
    prompt where it never does). Greedy exact match is `minigpt.evaluate`."""
    s = sample_groups(model, examples, k, max_new_tokens, temperature=temperature,
                      generator=generator)
    hit = torch.tensor([c == examples[g].answer for g, c in zip(s.group.tolist(),
                                                                 s.completions, strict=True)])
    return hit.view(len(examples), k).any(1).sum().item() / len(examples)
