"""Experiment 05: teach the held-out task to the dense base with LoRA (r=8), with and without
replaying a little of the pretraining tasks.

Run:        python -m labkit run experiments/05-lora-finetune
Reproduce:  python -m labkit reproduce experiments/05-lora-finetune/manifest.json
Outputs: adapter_<run>/ (PEFT-format adapters; experiment 06 loads adapter_rev_replay),
metrics.json, <run>.jsonl (the trainer's log), curves.png, REPORT.md, manifest.json.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from labkit import RunContext, sha256_json  # noqa: E402
from minigpt import CharTokenizer, base_path, evaluate, load_checkpoint, tasks  # noqa: E402
from minituner import SequenceData, TrainConfig, save_adapter, train, trainable_summary, wrap_lora  # noqa: E402
from minituner.lora_norms import total_norm  # noqa: E402
from minituner.qlora import BLOCK_LINEARS  # noqa: E402


def pairs_of(tok: CharTokenizer, examples) -> list[tuple[list[int], list[int]]]:
    return [(tok.encode(e.prompt), tok.encode(e.answer) + [tok.eos_id]) for e in examples]


def exact_match(model, cfg: dict) -> dict[str, float]:
    return {t: evaluate(model, t, n=cfg["eval_n"], seed=cfg["seed"]) for t in tasks.TASKS}


def finetune(name: str, spec: dict, cfg: dict, base: Path, ctx: RunContext) -> dict:
    tok = CharTokenizer()
    examples = tasks.make_examples(cfg["held_out"], cfg["n_train"], cfg["seed"], "train")
    if spec["replay"]:
        examples += tasks.make_mixture(tasks.PRETRAIN_TASKS, cfg["replay_per_task"],
                                       cfg["seed"] + 1, "train")
    pairs = pairs_of(tok, examples)
    ctx.record_data(name, sha256_json(pairs))
    model = load_checkpoint(base)
    wrap_lora(model, BLOCK_LINEARS, **cfg["lora"])
    trainable, total = trainable_summary(model)
    train_cfg = TrainConfig(**cfg["train"], seed=cfg["seed"], progress=True,
                            log_path=str(ctx.output(f"{name}.jsonl")))
    held_out_n = max(1, cfg["eval_n"] // 4)     # a cheaper exact match during training

    def eval_fn(m):
        return {"held_out_exact_match": evaluate(m, cfg["held_out"], n=held_out_n,
                                                 seed=cfg["seed"])}

    result = train(model, SequenceData.from_pairs(pairs, pad_id=tok.pad_id), train_cfg,
                   eval_fn=eval_fn)
    ctx.timings[f"{name}_train_s"] = round(result.wall_time_s, 1)
    save_adapter(model, ctx.out_dir / f"adapter_{name}")
    ctx.artifact_files(f"adapter_{name}")
    return {
        "examples": len(pairs),
        "trainable_params": trainable,
        "total_params": total,
        "final_loss": result.final_loss,
        "loss_curve": result.losses,
        "log_every": train_cfg.log_every,
        "evals": result.evals,
        "exact_match_after": exact_match(model, cfg),
        "adapter_norm": total_norm(ctx.out_dir / f"adapter_{name}"),
    }


def plot(metrics: dict, cfg: dict, path) -> None:
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 3.6))
    for name in cfg["runs"]:
        m = metrics[name]
        steps = [m["log_every"] * (i + 1) for i in range(len(m["loss_curve"]))]
        ax1.plot(steps, m["loss_curve"], label=f"{name}: train")
        ev = m["evals"]
        ax1.plot([e["step"] for e in ev], [e["val_loss"] for e in ev], "o--",
                 label=f"{name}: validation")
        ax2.plot([0] + [e["step"] for e in ev],
                 [metrics["before"][cfg["held_out"]]]
                 + [e["held_out_exact_match"] for e in ev], "o-", label=name)
    ax1.set(xlabel="step", ylabel="loss (answer tokens)", yscale="log",
            title="LoRA r=8 on the held-out task")
    ax2.set(xlabel="step", ylabel=f"exact match on '{cfg['held_out']}'", ylim=(-0.02, 1.02),
            title="Greedy exact match during training")
    for ax in (ax1, ax2):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_report(metrics: dict, cfg: dict, ctx: RunContext) -> None:
    runs = list(cfg["runs"])
    rows = [f"| {t}{' (held out)' if t == cfg['held_out'] else ''} | "
            f"{metrics['before'][t]:.3f} | "
            + " | ".join(f"{metrics[r]['exact_match_after'][t]:.3f}" for r in runs) + " |"
            for t in tasks.TASKS]
    first = metrics[runs[0]]
    text = f"""# Experiment 05: LoRA fine-tuning on the held-out task

The dense base from experiment 00 has never seen a `{cfg['held_out']}:` prompt. We freeze it
and train rank-{cfg['lora']['r']} LoRA adapters (alpha {cfg['lora']['alpha']}) on all seven
projections of every block: {first['trainable_params']:,} trainable parameters out of
{first['total_params']:,} ({first['trainable_params'] / first['total_params']:.2%}).
Two runs, same steps and seed: `rev_only` trains on {cfg['n_train']} `{cfg['held_out']}`
examples; `rev_replay` adds {cfg['replay_per_task']} examples of each pretraining task.
Exact match is greedy decoding on {cfg['eval_n']} evaluation-split prompts per task. Every
number comes from `metrics.json` of the run that wrote `manifest.json`; `python -m labkit
reproduce experiments/05-lora-finetune/manifest.json` re-runs it.

| task | base | {' | '.join(f'after LoRA, {r}' for r in runs)} |
|---|---|{'---|' * len(runs)}
{chr(10).join(rows)}

![curves](curves.png)

Training on the new task alone teaches it and wrecks the others: the adapter is free to
repurpose every projection, and nothing in the loss asks it to keep the old behaviour. A
small replay of the old tasks keeps them while the new one is learned, at the same cost.
Train time on this CPU: {', '.join(f"{r} {ctx.timings[f'{r}_train_s']:.0f} s" for r in runs)}.
The adapters are in `adapter_<run>/` in PEFT format; experiment 06 loads `adapter_rev_replay`
onto an NF4 copy of the same base.
"""
    ctx.output("REPORT.md").write_text(text)


def run(cfg: dict, ctx: RunContext) -> dict:
    base = ctx.record_input(base_path(cfg["base"]))
    metrics = {"before": exact_match(load_checkpoint(base), cfg)}
    for name, spec in cfg["runs"].items():
        metrics[name] = finetune(name, spec, cfg, base, ctx)
    plot(metrics, cfg, ctx.output("curves.png"))
    write_report(metrics, cfg, ctx)
    return metrics
