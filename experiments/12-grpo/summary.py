"""README.md's section on experiment 12 (reward-weighted SFT and GRPO on the QLoRA models),
made from its manifest.

`python -m labkit readme` puts what `readme(manifest)` returns in this experiment's block of
README.md. Only the README reads this file; experiment.py does not import it.
"""

from __future__ import annotations

from labkit.readme import paragraph, table

# The README's names for the runs experiment.py records, in its order.
RUNS = {"sft": "(a) SFT on gold answers", "rw_global": "(b) reward-weighted SFT, global weights",
        "rw_group": "(c) reward-weighted SFT, per-group weights",
        "grpo": "(d) GRPO from the warm start", "grpo_cold": "(e) GRPO from the base",
        "grpo_replay": "(f) GRPO + replay", "grpo_kl": "(f) GRPO + KL to the base",
        "grpo_async": "(f) GRPO + replay, asynchronous generation",
        "grpo_partial": "(f) GRPO + replay, partial-credit reward"}
MODELS = ("dense", "moe")


def rows(manifest: dict) -> list[list[str]]:
    cfg, metrics = manifest["config"], manifest["metrics"]
    held, k = cfg["held_out"], cfg["eval"]["k"]
    out = []
    for kind in MODELS:
        start = metrics[kind]["start"]
        out.append([kind, "warm start", f"{start['base'][held]:.2f} → {start['warm'][held]:.2f}",
                    f"{start['warm'][f'{held}_pass@{k}']:.2f}", f"{start['warm']['sort']:.2f}"])
        for name in [n for n in RUNS if n in metrics[kind]["runs"]]:
            r = metrics[kind]["runs"][name]
            before = start[r["start"]][held]
            out.append([kind, RUNS[name], f"{before:.2f} → {r['after'][held]:.2f}",
                        f"{r['after'][f'{held}_pass@{k}']:.2f}", f"{r['after']['sort']:.2f}"])
    return out


def readme(manifest: dict) -> str:
    cfg, metrics = manifest["config"], manifest["metrics"]
    held, k, g = cfg["held_out"], cfg["eval"]["k"], cfg["grpo"]
    s = metrics["summary"]
    intro = paragraph(
        f"Reinforcement fine-tuning of the QLoRA models with only a verifier for `{held}` "
        f"(`{cfg['reward']}` unless the row says otherwise), from experiment 11's setting "
        f"([12 report](experiments/12-grpo/REPORT.md)). GRPO samples {g['group_size']} "
        f"answers to each of {g['prompts_per_step']} prompts per iteration for {g['steps']} "
        "iterations and weights each answer by its advantage within its group. Exact match "
        f"on `{held}` (greedy, {cfg['eval']['n']} prompts), pass@{k}, and `sort` after "
        "(forgetting):")
    tbl = table(["model", "run", f"{held} before → after", f"{held} pass@{k} after",
                 "sort after"], rows(manifest))
    after = paragraph(
        f"GRPO's gain over its warm start: {s[f'{held}_gain_dense']:+.2f} dense, "
        f"{s[f'{held}_gain_moe']:+.2f} MoE; `sort` after GRPO with replay: "
        f"{s['sort_after_dense']:.2f} dense, {s['sort_after_moe']:.2f} MoE. The report says "
        "which targets were met and why the others were not.")
    return f"{intro}\n\n{tbl}\n\n{after}\n"
