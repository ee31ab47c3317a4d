"""Experiment 07: which router? Softmax top-k, sigmoid with a selection bias, group-limited.

Lab 07 builds the routers one function at a time; this run trains MiniGPT-MoE from scratch
with each of them in the model (`MiniGPTConfig.moe_router` and its options) and compares what
a router is for: how evenly it spreads tokens over the experts, and how well the model learns.
Runs (config "routers"), each experiment 00's MoE on the same data from the same seed:

  softmax_aux    softmax top-k with the load-balancing loss (coef 0.01): experiment 00's recipe
  softmax_none   softmax top-k with nothing to balance it
  sigmoid_bias   sigmoid scores with a selection bias and DeepSeek-V3's auxiliary-loss-free
                 update (`moe_bias_update_rate`), no balancing loss
  group_v3       group-limited: the experts in 4 groups, the top-k taken inside the 2 groups
                 with the largest sum of their top-2 scores (V3's rule), sigmoid + bias as above
  group_v2       group-limited by each group's largest score (V2's rule): the top-k taken inside
                 the best of 2 groups of 4, softmax scores and the balancing loss, as
                 DeepSeek-V2 trained it. Fewer groups than k: with topk_group >= k the max
                 rule is plain top-k (the k best experts lie in the k best groups by max)

Measured for each:
- load balance: MaxVio = (max expert load / mean expert load) − 1 per MoE layer (0 is even),
  on the same held-out tokens (the eval split of the pretraining tasks) every `eval_every`
  steps and at the end, with the final share of each expert per layer;
- the held-out loss on those tokens' answers, and exact match (greedy) per task;
- held-out learning: each pretrained model fully fine-tuned for a few steps on the task it
  never saw (`rev`) with replay, as Lab 05 does with LoRA, then scored on `rev` and the rest.

Run:        python -m labkit run experiments/07-moe-routing
Reproduce:  python -m labkit reproduce experiments/07-moe-routing/manifest.json
Outputs: metrics.json, balance.png, load.png, REPORT.md (`report` makes it from a manifest:
the run's own at its end, the committed one with `python -m labkit report
experiments/07-moe-routing`), manifest.json. The models are not kept: experiment 00's MoE is
the one later labs load.
"""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from labkit import RunContext, sha256_json  # noqa: E402
from labkit.readme import paragraph  # noqa: E402
from minigpt import CharTokenizer, MiniGPT, MiniGPTConfig, evaluate, tasks  # noqa: E402
from minimoe import MoEMLP  # noqa: E402
from minituner import SequenceData, TrainConfig, train  # noqa: E402
from minituner.losses import mean_loss  # noqa: E402


def task_data(examples, tok: CharTokenizer) -> SequenceData:
    pairs = [(tok.encode(e.prompt), tok.encode(e.answer) + [tok.eos_id]) for e in examples]
    return SequenceData.from_pairs(pairs, pad_id=tok.pad_id)


@torch.no_grad()
def expert_load(model: MiniGPT, data: SequenceData, batch_size: int = 256) -> list[list[float]]:
    """Per MoE layer, the share of the routing slots of `data`'s tokens (padding excluded)
    that each expert receives: [L][E], each row summing to 1."""
    was_training = model.training
    model.eval()
    mlps = [b.mlp for b in model.blocks if isinstance(b.mlp, MoEMLP)]
    counts = torch.zeros(len(mlps), model.config.n_experts)                     # [L, E]
    for start in range(0, len(data), batch_size):
        tokens = data.tokens[start:start + batch_size]                          # [b, l]
        real = (torch.arange(tokens.shape[1]) < data.lengths[start:start + batch_size, None])
        model(tokens)
        for c, mlp in zip(counts, mlps, strict=True):
            chosen = mlp.last_experts[real.flatten()]                           # [T_real, k]
            c += torch.bincount(chosen.flatten(), minlength=model.config.n_experts)
    model.train(was_training)
    return (counts / counts.sum(dim=1, keepdim=True)).tolist()


def max_vio(shares: list[float]) -> float:
    """(max load / mean load) − 1 of one layer's expert shares (Wang et al. 2024's MaxVio)."""
    return max(shares) * len(shares) - 1.0


def probe(held: SequenceData):
    """The eval_fn `train` calls every `eval_every` steps: held-out loss and MaxVio per layer."""
    def fn(model) -> dict:
        load = expert_load(model, held)
        return {"held_loss": mean_loss(model, held), "max_vio": [max_vio(s) for s in load]}
    return fn


def model_config(spec: dict, cfg: dict) -> MiniGPTConfig:
    return MiniGPTConfig(**cfg["model"], **spec.get("model", {}))


def scores(model: MiniGPT, cfg: dict) -> dict[str, float]:
    return {t: evaluate(model, t, n=cfg["eval_n"], seed=cfg["seed"]) for t in tasks.TASKS}


def finetune(model: MiniGPT, spec: dict, cfg: dict, tok: CharTokenizer) -> tuple[dict, float]:
    """Held-out learning: every weight trained on `rev` with replay; (scores, wall seconds)."""
    ft = cfg["finetune"]
    examples = (tasks.make_examples(cfg["held_out"], ft["n_train"], cfg["seed"], "train")
                + tasks.make_mixture(cfg["tasks"], ft["replay_per_task"], cfg["seed"] + 1,
                                     "train"))
    keys = ("steps", "batch_size", "lr", "warmup_steps")
    result = train(model, task_data(examples, tok),
                   TrainConfig(**{k: ft[k] for k in keys}, seed=cfg["seed"],
                               aux_loss_coef=spec["aux_loss_coef"], progress=cfg["progress"]))
    return scores(model, cfg), result.wall_time_s


def one_router(name: str, spec: dict, data: SequenceData, held: SequenceData, cfg: dict,
               ctx: RunContext, tok: CharTokenizer) -> dict:
    torch.manual_seed(cfg["seed"])       # every router starts from the same initial weights
    model = MiniGPT(model_config(spec, cfg))
    tc = cfg["train"]
    result = train(model, data, TrainConfig(**tc, seed=cfg["seed"],
                                            aux_loss_coef=spec["aux_loss_coef"],
                                            progress=cfg["progress"]),
                   eval_fn=probe(held))
    ctx.timings[f"{name}_train_s"] = round(result.wall_time_s, 1)
    load = expert_load(model, held)
    pretrained = scores(model, cfg)
    after, seconds = finetune(model, spec, cfg, tok)
    ctx.timings[f"{name}_finetune_s"] = round(seconds, 1)
    return {
        "final_loss": result.final_loss,
        "loss_curve": result.losses,
        "eval_steps": [e["step"] for e in result.evals],
        "held_loss_curve": [e["held_loss"] for e in result.evals],
        "max_vio_curve": [e["max_vio"] for e in result.evals],
        "expert_load": [[round(x, 4) for x in layer] for layer in load],
        "max_vio": [max_vio(s) for s in load],
        "held_loss": result.evals[-1]["held_loss"],
        "exact_match": pretrained,
        "pretrain_mean_exact_match": sum(pretrained[t] for t in cfg["tasks"]) / len(cfg["tasks"]),
        "after_finetune": after,
    }


def run(cfg: dict, ctx: RunContext) -> dict:
    tok = CharTokenizer()
    train_ex = tasks.make_mixture(cfg["tasks"], cfg["n_per_task"], cfg["seed"])
    held_ex = tasks.make_mixture(cfg["tasks"], cfg["held_n_per_task"], cfg["seed"], "eval")
    ctx.record_data("train", sha256_json([(e.prompt, e.answer) for e in train_ex]))
    ctx.record_data("held", sha256_json([(e.prompt, e.answer) for e in held_ex]))
    data, held = task_data(train_ex, tok), task_data(held_ex, tok)
    routers = {name: one_router(name, spec, data, held, cfg, ctx, tok)
               for name, spec in cfg["routers"].items()}
    metrics = {"routers": routers, "summary": summary(routers, cfg)}
    plot_balance(routers, ctx.output("balance.png"))
    plot_load(routers, ctx.output("load.png"))
    ctx.output("REPORT.md").write_text(report({"config": cfg, "metrics": metrics,
                                               "timings": ctx.timings}))
    return metrics


def summary(routers: dict, cfg: dict) -> dict:
    """Per router: the mean MaxVio over layers at the end, the held-out loss, and exact match
    on the held-out task after fine-tuning."""
    held = cfg["held_out"]
    return {name: {"max_vio_mean": sum(r["max_vio"]) / len(r["max_vio"]),
                   "held_loss": r["held_loss"],
                   "pretrain_exact_match": r["pretrain_mean_exact_match"],
                   f"{held}_after_finetune": r["after_finetune"][held]}
            for name, r in routers.items()}


# --- figures and report ----------------------------------------------------------------------

def plot_balance(routers: dict, path) -> None:
    fig, (ax_vio, ax_loss) = plt.subplots(1, 2, figsize=(11, 3.6))
    for name, r in routers.items():
        mean_vio = [sum(v) / len(v) for v in r["max_vio_curve"]]
        ax_vio.plot(r["eval_steps"], mean_vio, label=name)
        ax_loss.plot(r["eval_steps"], r["held_loss_curve"], label=name)
    ax_vio.set(xlabel="step", ylabel="MaxVio, mean over layers",
               title="load imbalance on held-out tokens (0 = even)")
    ax_loss.set(xlabel="step", ylabel="cross-entropy (answer tokens)", yscale="log",
                title="held-out loss")
    for ax in (ax_vio, ax_loss):
        ax.grid(alpha=0.3)
    ax_vio.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_load(routers: dict, path) -> None:
    loads = {name: torch.tensor(r["expert_load"]) for name, r in routers.items()}   # [L, E]
    top = max(2.0, max(float(x.max()) * x.shape[1] for x in loads.values()))
    fig, axes = plt.subplots(1, len(loads), figsize=(2.6 * len(loads), 2.6), squeeze=False)
    for ax, (name, load) in zip(axes[0], loads.items(), strict=True):
        im = ax.imshow(load * load.shape[1], vmin=0, vmax=top, cmap="magma", aspect="auto")
        ax.set(title=name, xlabel="expert")
        ax.set_xticks(range(load.shape[1]))
        ax.set_yticks(range(load.shape[0]))
    axes[0][0].set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="load / mean load")
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


# The report's order of the routers (a manifest keeps its config's keys sorted).
ORDER = ("softmax_aux", "softmax_none", "sigmoid_bias", "group_v3", "group_v2")


def report(m: dict) -> str:
    """REPORT.md from a manifest (its `config`, `metrics` and `timings`)."""
    cfg, held, timings = m["config"], m["config"]["held_out"], m.get("timings", {})
    routers = m["metrics"]["routers"]
    others = [t for t in tasks.TASKS if t != held]
    head = ("| router | balancing | MaxVio per layer (end) | held-out loss | "
            + " | ".join(others) + f" | {held} after fine-tune | sort after | train s |\n|"
            + "---|" * (len(others) + 7))
    rows = []
    for name in sorted(routers, key=lambda n: ORDER.index(n) if n in ORDER else len(ORDER)):
        r, spec = routers[name], cfg["routers"][name]
        vio = " ".join(f"{v:.2f}" for v in r["max_vio"])
        rows.append(f"| {name} | {spec['balancing']} | {vio} | {r['held_loss']:.4f} | "
                    + " | ".join(f"{r['exact_match'][t]:.2f}" for t in others)
                    + f" | {r['after_finetune'][held]:.2f} | {r['after_finetune']['sort']:.2f}"
                    f" | {timings.get(f'{name}_train_s', float('nan')):.0f} |")
    mc, t, ft = cfg["model"], cfg["train"], cfg["finetune"]
    intro = paragraph(
        "Every number here is from `metrics.json` of the run that wrote `manifest.json`; "
        "`python -m labkit reproduce experiments/07-moe-routing/manifest.json` re-runs it. "
        f"Each router trains the same MiniGPT-MoE ({mc['n_layer']} blocks, {mc['n_experts']} "
        f"experts, top-{mc['top_k']}) from the same initial weights on the same data: "
        f"{t['steps']} AdamW steps of {t['batch_size']} sequences of the pretraining tasks. "
        "MaxVio is (max expert load / mean load) − 1 on the eval split's tokens "
        f"({cfg['held_n_per_task']} examples per task, padding excluded): 0 is perfectly "
        f"even, {mc['n_experts'] - 1} is every token on one expert. The held-out loss is the "
        "answer tokens' cross-entropy there; exact match is greedy on "
        f"{cfg['eval_n']} eval prompts per task. Then each model is fine-tuned "
        f"({ft['steps']} steps, every weight, on `{held}` with replay) and scored again. "
        "Times are wall seconds on the recording machine.")
    return f"""# Experiment 07: routers compared

{intro}

{head}
{chr(10).join(rows)}

![MaxVio and held-out loss during training](balance.png)

![each expert's load per layer at the end](load.png)
"""
