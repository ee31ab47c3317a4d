"""Experiment 00: pretrain the base MiniGPTs, dense and MoE, on every task but the held-out one.

Run:        python -m labkit run experiments/00-pretrain-base
Reproduce:  python -m labkit reproduce experiments/00-pretrain-base/manifest.json
Outputs: base_<name>.safetensors (the checkpoints later labs load with minigpt.load_base),
metrics.json, loss_curve.png, REPORT.md, manifest.json.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from labkit import RunContext, sha256_json  # noqa: E402
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, evaluate, save_checkpoint, tasks  # noqa: E402
from minimoe import MoEMLP  # noqa: E402
from minituner import SequenceData, TrainConfig, train  # noqa: E402


def task_pairs(tok: CharTokenizer, examples) -> list[tuple[list[int], list[int]]]:
    return [(tok.encode(e.prompt), tok.encode(e.answer) + [tok.eos_id]) for e in examples]


@torch.no_grad()
def expert_load(model: MiniGPT, tok: CharTokenizer, n: int, seed: int) -> dict[str, list]:
    """Per task and layer: the fraction of routing slots each expert receives on eval prompts."""
    model.eval()
    load = {}
    for task in tasks.TASKS:
        prompts = [tok.encode(e.prompt) for e in tasks.make_examples(task, n, seed, "eval")]
        counts = [torch.zeros(model.config.n_experts) for _ in model.blocks]
        for p in prompts:
            model(torch.tensor([p]))
            for c, block in zip(counts, model.blocks, strict=True):
                assert isinstance(block.mlp, MoEMLP)
                c += torch.bincount(block.mlp.last_experts.flatten(),
                                    minlength=model.config.n_experts)
        load[task] = [[round(x, 4) for x in (c / c.sum()).tolist()] for c in counts]
    return load


def pretrain(name: str, spec: dict, data: SequenceData, cfg: dict, ctx: RunContext) -> dict:
    model = MiniGPT(MiniGPTConfig(**spec["model"]))
    train_cfg = TrainConfig(**spec["train"], seed=cfg["seed"])
    result = train(model, data, train_cfg)
    ctx.timings[f"{name}_train_s"] = round(result.wall_time_s, 1)
    save_checkpoint(model, ctx.artifact(f"base_{name}.safetensors"))
    exact = {t: evaluate(model, t, n=cfg["eval_n"], seed=cfg["seed"]) for t in tasks.TASKS}
    metrics = {
        "params": model.num_params(),
        "steps": train_cfg.steps,
        "final_loss": result.final_loss,
        "loss_curve": result.losses,
        "log_every": train_cfg.log_every,
        "exact_match": exact,
        "held_out_exact_match": exact[cfg["held_out"]],
        "pretrain_mean_exact_match": sum(exact[t] for t in cfg["tasks"]) / len(cfg["tasks"]),
    }
    if model.config.n_experts:
        metrics["expert_load"] = expert_load(model, CharTokenizer(), cfg["routing_n"],
                                             cfg["seed"])
    return metrics


def plot_losses(metrics: dict, path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for name, m in metrics.items():
        steps = [m["log_every"] * (i + 1) for i in range(len(m["loss_curve"]))]
        ax.plot(steps, m["loss_curve"], label=f"{name} ({m['params'] / 1e6:.2f}M params)")
    ax.set(xlabel="step", ylabel="train loss (answer tokens)", yscale="log",
           title="Pretraining MiniGPT on the task suite")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(metrics: dict, cfg: dict, ctx: RunContext) -> None:
    names = list(metrics)
    rows = ["| task | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for t in tasks.TASKS:
        mark = " (held out)" if t == cfg["held_out"] else ""
        rows.append(f"| {t}{mark} | " + " | ".join(
            f"{metrics[n]['exact_match'][t]:.3f}" for n in names) + " |")
    summary = [f"| {n} | {metrics[n]['params']:,} | {metrics[n]['steps']} | "
               f"{metrics[n]['final_loss']:.4f} | {ctx.timings[f'{n}_train_s']:.0f} s |"
               for n in names]
    text = f"""# Experiment 00: pretraining the base models

Both base models are trained from scratch on every task of the suite except
`{cfg['held_out']}`, which the fine-tuning labs teach later. Exact match is greedy decoding
on {cfg['eval_n']} prompts per task from the evaluation split (prompts never trained on).
All numbers below come from `metrics.json` of the run that wrote `manifest.json`;
`python -m labkit reproduce experiments/00-pretrain-base/manifest.json` re-runs it.

| model | parameters | steps | final loss | train time (this CPU) |
|---|---|---|---|---|
{chr(10).join(summary)}

![loss curves](loss_curve.png)

## Exact match per task

{chr(10).join(rows)}

The held-out task stays near zero: the models have never seen a `{cfg['held_out']}:` prompt.
That gap is what Labs 05, 06 and 11 close with LoRA and QLoRA.
"""
    if "moe" in metrics and "expert_load" in metrics["moe"]:
        text += """
## MoE routing

`metrics.json` → `moe.expert_load[task][layer][expert]` holds the fraction of routing
slots each expert receives on evaluation prompts of each task (1/E when balanced). Lab 07
plots it as a heatmap.
"""
    ctx.output("REPORT.md").write_text(text)


def run(cfg: dict, ctx: RunContext) -> dict:
    tok = CharTokenizer()
    pairs = task_pairs(tok, tasks.make_mixture(cfg["tasks"], cfg["n_per_task"], cfg["seed"]))
    ctx.record_data("train", sha256_json(pairs))
    data = SequenceData.from_pairs(pairs, pad_id=tok.pad_id)
    metrics = {name: pretrain(name, spec, data, cfg, ctx) for name, spec in cfg["models"].items()}
    plot_losses(metrics, ctx.output("loss_curve.png"))
    write_report(metrics, cfg, ctx)
    return metrics
