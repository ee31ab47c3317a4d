"""RESULTS.md's section on experiment 00 (the base models), made from its manifest.

`python -m labkit readme` puts what `readme(manifest)` returns in this experiment's block of
RESULTS.md. Only `make readme` reads this file; experiment.py does not import it.
"""

from __future__ import annotations

from labkit.readme import paragraph, table


def columns(cfg: dict) -> list[str]:
    """Every task, alphabetical, the held-out one included."""
    return sorted([*cfg["tasks"], cfg["held_out"]])


def steps_phrase(cfg: dict, metrics: dict) -> str:
    """"4000 AdamW steps each", or each model's own count when they differ."""
    steps = {name: metrics[name]["steps"] for name in cfg["models"]}
    if len(set(steps.values())) == 1:
        return f"{next(iter(steps.values()))} AdamW steps each"
    return "AdamW, " + ", ".join(f"{n} steps for {name}" for name, n in steps.items())


def moe_phrase(cfg: dict) -> str:
    """"; the MoE has 8 SwiGLU experts, top-2" (nothing if no model has experts)."""
    moes = [spec["model"] for spec in cfg["models"].values() if "n_experts" in spec["model"]]
    return "".join(f"; the MoE has {m['n_experts']} SwiGLU experts, top-{m['top_k']}"
                   for m in moes)


def row(name: str, cfg: dict, metrics: dict, timings: dict) -> list[str]:
    exact = metrics[name]["exact_match"]
    seconds = timings.get(f"{name}_train_s")
    return [name, f"{metrics[name]['params'] / 1e6:.2f}M",
            *(f"{exact[task]:.2f}" for task in columns(cfg)),
            "—" if seconds is None else f"{seconds:.0f} s"]


def readme(manifest: dict) -> str:
    cfg, metrics = manifest["config"], manifest["metrics"]
    header = ["model", "params",
              *(f"{t} (held out)" if t == cfg["held_out"] else t for t in columns(cfg)),
              "train time"]
    intro = paragraph(
        f"Exact match (greedy, {cfg['eval_n']} eval-split prompts per task) of the base models "
        "every later lab starts from, from [the committed manifest]"
        f"(experiments/00-pretrain-base/manifest.json) ({steps_phrase(cfg, metrics)} on "
        f"{manifest['env']['threads']} CPU threads{moe_phrase(cfg)}):")
    rows = [row(name, cfg, metrics, manifest.get("timings", {})) for name in cfg["models"]]
    return f"{intro}\n\n{table(header, rows)}\n"
