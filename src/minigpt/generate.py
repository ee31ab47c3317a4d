"""Greedy (or temperature-sampled) decoding and exact-match evaluation."""

from __future__ import annotations

from collections import defaultdict

import torch

from .tasks import make_examples
from .tokenizer import CharTokenizer


@torch.no_grad()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, eos_id: int,
                    temperature: float = 0.0, generator: torch.Generator | None = None
                    ) -> list[list[int]]:
    """Continue each prompt until <eos> or `max_new_tokens`: the most likely token
    (temperature 0), or a token drawn from softmax(logits / temperature) with `generator`.

    Prompts of equal length are decoded together as one batch (no padding needed); the
    returned continuations exclude the prompt and the <eos>.
    """
    if not temperature >= 0.0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    was_training = model.training
    model.eval()
    by_len: dict[int, list[int]] = defaultdict(list)
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompts[{i}] is empty; generation needs at least one token")
        by_len[len(p)].append(i)
    out: list[list[int]] = [[] for _ in prompts]
    device = next(model.parameters()).device
    for idxs in by_len.values():
        seq = torch.tensor([prompts[i] for i in idxs], device=device)          # [b, L]
        done = torch.zeros(len(idxs), dtype=torch.bool, device=device)
        for _ in range(max_new_tokens):
            logits = model(seq[:, -model.config.block_size:])[:, -1]           # [b, V]
            if temperature:
                probs = (logits.float() / temperature).softmax(-1)
                nxt = torch.multinomial(probs, 1, generator=generator)[:, 0]   # [b]
            else:
                nxt = logits.argmax(dim=-1)                                    # [b]
            done |= nxt == eos_id
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            if done.all():
                break
        for row, i in enumerate(idxs):
            gen = seq[row, len(prompts[i]):].tolist()
            out[i] = gen[:gen.index(eos_id)] if eos_id in gen else gen
    model.train(was_training)
    return out


def answers(model, prompts: list[str], tokenizer: CharTokenizer | None = None,
            max_new_tokens: int = 10) -> list[str]:
    tok = tokenizer or CharTokenizer()
    gen = greedy_generate(model, [tok.encode(p) for p in prompts], max_new_tokens, tok.eos_id)
    return [tok.decode(g) for g in gen]


def evaluate(model, task: str, n: int = 200, seed: int = 0,
             tokenizer: CharTokenizer | None = None) -> float:
    """Exact-match accuracy of greedy answers on `n` eval-split examples of `task`."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    examples = make_examples(task, n, seed=seed, split="eval")
    got = answers(model, [ex.prompt for ex in examples], tokenizer)
    return sum(g == ex.answer for g, ex in zip(got, examples, strict=True)) / n
