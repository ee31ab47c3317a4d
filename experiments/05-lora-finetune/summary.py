"""RESULTS.md's paragraph and table on experiment 05 (LoRA fine-tuning), made from its manifest.

`python -m labkit readme` puts what `readme(manifest)` returns in this experiment's block of
RESULTS.md (the first half of the section it shares with experiment 06). Only `make readme`
reads this file; experiment.py does not import it.
"""

from __future__ import annotations

from labkit.readme import paragraph, table


def label(name: str, cfg: dict) -> str:
    """A run's row: "LoRA, rev only" or "LoRA, rev + replay"."""
    return f"LoRA, {cfg['held_out']} {'+ replay' if cfg['runs'][name]['replay'] else 'only'}"


def trainable(metrics: dict, cfg: dict) -> str:
    """The trainable parameter count, "88,064" (each run's, should they ever differ)."""
    counts = dict.fromkeys(f"{metrics[name]['trainable_params']:,}" for name in cfg["runs"])
    return " and ".join(counts)


def readme(manifest: dict) -> str:
    cfg, metrics = manifest["config"], manifest["metrics"]
    train, held_out = cfg["train"], cfg["held_out"]
    tasks = sorted(metrics["before"])
    intro = paragraph(
        f"LoRA r={cfg['lora']['r']} on every block projection of the {cfg['base']} base "
        f"({trainable(metrics, cfg)} trainable parameters, {train['steps']} steps × "
        f"{train['batch_size']}), on the held-out task alone ({cfg['n_train']:,} examples) or "
        f"with a replay of {cfg['replay_per_task']:,} examples of each pretraining task "
        "([05 report](experiments/05-lora-finetune/REPORT.md)); exact match, "
        f"{cfg['eval_n']} prompts per task:")
    header = ["model", *(f"{t} (held out)" if t == held_out else t for t in tasks)]
    runs = [("base", metrics["before"])]
    runs += [(label(name, cfg), metrics[name]["exact_match_after"]) for name in cfg["runs"]]
    rows = [[name, *(f"{exact[t]:.2f}" for t in tasks)] for name, exact in runs]
    return f"{intro}\n\n{table(header, rows)}\n"
