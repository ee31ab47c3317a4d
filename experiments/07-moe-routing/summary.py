"""RESULTS.md's section on experiment 07 (the routers compared), made from its manifest.

`python -m labkit readme` puts what `readme(manifest)` returns in this experiment's block of
RESULTS.md. Only `make readme` reads this file; experiment.py does not import it.
"""

from __future__ import annotations

from labkit.readme import paragraph, table

# RESULTS.md's names for the routers experiment.py trains, in the order of its config (the
# manifest keeps its keys sorted).
NAMES = {"softmax_aux": "softmax top-k + balancing loss",
         "softmax_none": "softmax top-k, no balancing",
         "sigmoid_bias": "sigmoid top-k + selection bias (aux-loss-free)",
         "group_v3": "group-limited, V3 (best 2 of 4 groups by top-2 sum, sigmoid + bias)",
         "group_v2": "group-limited, V2 (best of 2 groups by max, softmax + balancing loss)"}


def rows(manifest: dict) -> list[list[str]]:
    cfg, routers = manifest["config"], manifest["metrics"]["routers"]
    held = cfg["held_out"]
    out = []
    for name in sorted(routers, key=lambda n: list(NAMES).index(n) if n in NAMES else len(NAMES)):
        r = routers[name]
        vio = r["max_vio"]
        out.append([f"`{name}`", NAMES.get(name, ""), f"{sum(vio) / len(vio):.2f}",
                    f"{max(vio):.2f}", f"{r['held_loss']:.4f}",
                    f"{r['pretrain_mean_exact_match']:.2f}", f"{r['after_finetune'][held]:.2f}",
                    f"{r['after_finetune']['sort']:.2f}"])
    return out


def findings(manifest: dict) -> list[str]:
    """The most and least even routers, and which learned best, every number from the
    manifest."""
    cfg, s = manifest["config"], manifest["metrics"]["summary"]
    held = cfg["held_out"]
    even = sorted(s, key=lambda n: s[n]["max_vio_mean"])
    loss = sorted(s, key=lambda n: s[n]["held_loss"])
    learned = sorted(s, key=lambda n: -s[n][f"{held}_after_finetune"])

    def vio(n):
        return f"`{n}` ({s[n]['max_vio_mean']:.2f})"

    return [
        paragraph(f"- **Balance.** The most even router at the end is {vio(even[0])}, the "
                  f"least {vio(even[-1])} (mean MaxVio over layers).", "  "),
        paragraph(f"- **Learning.** The lowest held-out loss is `{loss[0]}`'s "
                  f"({s[loss[0]]['held_loss']:.4f}; the highest `{loss[-1]}`'s, "
                  f"{s[loss[-1]]['held_loss']:.4f}). After the same fine-tune `{held}` is "
                  f"{s[learned[0]][f'{held}_after_finetune']:.2f} for `{learned[0]}` and "
                  f"{s[learned[-1]][f'{held}_after_finetune']:.2f} for `{learned[-1]}`.",
                  "  "),
        paragraph(f"- **Evenness is not learning.** `{even[1]}`, the second most even, ranks "
                  f"{loss.index(even[1]) + 1} of {len(s)} on held-out loss; `{even[-1]}`, the "
                  f"least even, ranks {learned.index(even[-1]) + 1} of {len(s)} on `{held}` "
                  "after the fine-tune. Each router is one seed of one run: read the balance "
                  "column as the routers' mechanics and the learning columns as one sample.",
                  "  "),
    ]


def readme(manifest: dict) -> str:
    cfg = manifest["config"]
    m, t, ft, held = cfg["model"], cfg["train"], cfg["finetune"], cfg["held_out"]
    intro = paragraph(
        f"The same MiniGPT-MoE ({m['n_experts']} experts, top-{m['top_k']}, {m['n_layer']} "
        f"blocks) trained from the same initial weights with each router "
        f"([07 report](experiments/07-moe-routing/REPORT.md)): {t['steps']} steps on the "
        f"pretraining tasks, then {ft['steps']} steps of full fine-tuning on `{held}` with "
        "replay. MaxVio = max expert load / mean load − 1 on held-out tokens (0 is even), at "
        "the end of pretraining; held-out loss on the eval split's answers; exact match "
        f"greedy on {cfg['eval_n']} prompts per task:")
    tbl = table(["router", "what it is", "MaxVio, mean of layers", "MaxVio, worst layer",
                 "held-out loss", "pretraining tasks, exact match", f"{held} after fine-tune",
                 "sort after fine-tune"], rows(manifest))
    return f"{intro}\n\n{tbl}\n\n" + "\n".join(findings(manifest)) + "\n"
