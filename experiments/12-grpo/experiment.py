"""Experiment 12: from reward-weighted SFT to GRPO on the QLoRA models of experiment 11.

The learner's question: the model has never seen `rev` and we have only a verifier (a reward
for any answer), not gold answers; what turns rewards into a model that answers? Runs, each
on a fresh QLoRA copy (NF4 base, LoRA r=8 everywhere, experts included):

  (a) sft          supervised fine-tuning on gold answers (experiment 11's recipe): the ceiling
  (b) rw_global    SFT on the warm start's own samples, weights normalised over all of them
  (c) rw_group     the same samples, weights normalised within each prompt's group
  (d) grpo         GRPO from the warm start
  (e) grpo_cold    GRPO from the base (no warm start)
  (f) grpo_replay  GRPO from the warm start with a replay term (pretraining tasks, gold CE)
      grpo_kl      GRPO from the warm start with β · KL to the base (adapters off)
      grpo_async   (f) with asynchronous generation (each batch one update stale)
      grpo_partial (f) rewarded with partial credit instead of exact match
  (g) grpo_dapo    (d) with DAPO's token-level aggregation (every completion token weighs the
                   same, `loss_type="dapo"`) instead of GRPO's per-completion mean
      grpo_dr      (d) with Dr. GRPO's constant normaliser (`loss_type="dr_grpo"`)
  (h) rw_file      reward-weighted SFT, per-group weights, on the course's sample file
                   `data/rev_rewarded.jsonl` (hand-made candidates, no sampling)

on the dense base, and (a), (d), (f), grpo_partial and (g) on the MoE base. (d), grpo_dapo and
grpo_dr differ only in how token losses are aggregated: the mean completion length of each
(curve `completion_tokens`) shows the length bias of the per-completion mean. The reward is exact
match unless a run names another: partial credit gives a signal before any answer is right,
but from a warm start it lets a group settle on near misses (the lab shows the other side: from
scratch, partial credit is what gets a tiny model going). The warm start is a short SFT on gold
`rev` answers with replay (without replay it erases `sort`); (b)-(d), (f) and the variants
start from it, and their gains are measured against it. (h) reads the file Lab 05 opens
(`config["sample_data"]`, hashed in the manifest as an input): 44 answers to 8 prompts, where 6
groups hold one right answer among wrong ones, so 6 examples carry all the weight.

Run:        python -m labkit run experiments/12-grpo
Reproduce:  python -m labkit reproduce experiments/12-grpo/manifest.json
Outputs: adapter_<run>_<model>/ (each run's final adapter, PEFT format, hashed in the manifest;
`python -m minituner.lora_norms DIR` reads one), metrics.json, grpo_<run>.jsonl (one record
per iteration), curves.png, tasks.png,
REPORT.md, manifest.json. The MoE runs use its PyTorch backend (on a CPU the Triton kernels
run in the interpreter); the log-probabilities use the PyTorch path for the same reason
(`minirl.IMPLEMENTATIONS["triton"]` computes the same numbers, tested to 1e-6).
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from labkit import RunContext, sha256_json  # noqa: E402
from labkit.readme import paragraph  # noqa: E402
from minigpt import CharTokenizer, base_path, evaluate, load_checkpoint, tasks  # noqa: E402
from minigpt.checkpoint import repo_root  # noqa: E402
from minirl import (  # noqa: E402
    GRPOConfig,
    exact_match,
    grpo_train,
    partial_credit,
    pass_at_k,
    read_rewarded_jsonl,
    rewarded_sequence_data,
    sample_groups,
    score,
    sft_pairs,
)
from minirl.weighting import group_weights  # noqa: E402
from minituner import SequenceData, TrainConfig, reward_weights, save_adapter, train  # noqa: E402
from minituner.lora_norms import total_norm  # noqa: E402
from minituner.qlora import wrap_minigpt_qlora  # noqa: E402

MODELS = ("dense", "moe")


# The verifiers a run may name (config "reward", or a run's own "reward").
REWARDS = {"exact_match": exact_match, "partial_credit": partial_credit}


def build(kind: str, cfg: dict):
    model = load_checkpoint(base_path(kind))
    model.set_moe_backend("torch")
    wrap_minigpt_qlora(model, quant_scheme=cfg["quant_scheme"], quantize=True, **cfg["lora"])
    return model


def scores(model, cfg: dict) -> dict:
    """Greedy exact match on every task, and pass@k on the held-out one (k samples at T=1)."""
    ev = cfg["eval"]
    out = {t: evaluate(model, t, n=ev["n"], seed=cfg["seed"]) for t in tasks.TASKS}
    held = tasks.make_examples(cfg["held_out"], ev["n"], cfg["seed"], "eval")
    out[f"{cfg['held_out']}_pass@{ev['k']}"] = pass_at_k(
        model, held, ev["k"], ev["max_new_tokens"],
        generator=torch.Generator().manual_seed(cfg["seed"] + 5))
    return out


def gold_data(cfg: dict, section: dict) -> SequenceData:
    ex = (tasks.make_examples(cfg["held_out"], cfg["n_train"], cfg["seed"], "train")
          + tasks.make_mixture(tasks.PRETRAIN_TASKS, section["replay_per_task"], cfg["seed"] + 1,
                               "train"))
    return SequenceData.from_pairs(sft_pairs([e.prompt for e in ex], [e.answer for e in ex]),
                                   pad_id=CharTokenizer().pad_id)


def sft(model, data: SequenceData, section: dict, steps: int, cfg: dict) -> float:
    """Train; the wall time."""
    keys = ("batch_size", "lr", "warmup_steps", "grad_clip_value")
    result = train(model, data, TrainConfig(steps=steps, seed=cfg["seed"], aux_loss_coef=0.0,
                                            progress=cfg["progress"],
                                            **{k: section[k] for k in keys}))
    if result.stopped_early:
        raise RuntimeError(f"supervised training stopped: {result.stopped_early}")
    return result.wall_time_s


# --- reward-weighted SFT ---------------------------------------------------------------------

def sampled_groups(model, cfg: dict, ctx: RunContext, kind: str):
    """G samples of the warm start for `rw.prompts` held-out prompts and as many pretraining
    ones, scored: (examples, completions, rewards [N], groups [N])."""
    rw = cfg["rw"]
    prompts = (tasks.make_examples(cfg["held_out"], rw["prompts"], cfg["seed"] + 2, "train")
               + tasks.make_mixture(tasks.PRETRAIN_TASKS, rw["prompts"] // len(
                   tasks.PRETRAIN_TASKS), cfg["seed"] + 3, "train"))
    s = sample_groups(model, prompts, rw["group_size"], cfg["grpo"]["max_new_tokens"],
                      generator=torch.Generator().manual_seed(cfg["seed"] + 4))
    examples = [prompts[g] for g in s.group.tolist()]
    rewards = score(REWARDS[cfg["reward"]], examples, s.completions)
    ctx.record_data(f"rw_samples_{kind}", sha256_json([s.completions, rewards.tolist()]))
    return examples, s.completions, rewards, s.group


def task_share(examples, weights: torch.Tensor) -> dict[str, float]:
    """Each task's share of the summed weight (all 0 when every weight is: no group had
    reward variance, so nothing is trained)."""
    total = float(weights.sum()) or 1.0
    return {t: float(sum(w for e, w in zip(examples, weights.tolist(), strict=True)
                         if e.task == t)) / total for t in tasks.TASKS}


def reward_weighted(model, groups_data, normalise: str, cfg: dict) -> dict:
    examples, completions, rewards, group = groups_data
    weights = (reward_weights(rewards) if normalise == "global"
               else group_weights(rewards, group))
    tok = CharTokenizer()
    data = SequenceData.from_pairs(sft_pairs([e.prompt for e in examples], completions),
                                   pad_id=tok.pad_id)
    data.weights = weights
    seconds = sft(model, data, cfg["rw"], cfg["rw"]["steps"], cfg)
    return {"train_s": seconds, "task_share": task_share(examples, weights),
            "mean_reward": rewards.mean().item()}


def sample_file(model, cfg: dict, ctx: RunContext) -> dict:
    """Reward-weighted SFT (per-group weights, `cfg["rw"]`'s schedule) on the records of
    `cfg["sample_data"]`, a path from the course checkout's root."""
    records = read_rewarded_jsonl(ctx.record_input(repo_root() / cfg["sample_data"]))
    data = rewarded_sequence_data(records)
    seconds = sft(model, data, cfg["rw"], cfg["rw"]["steps"], cfg)
    return {"train_s": seconds, "records": len(records),
            "weighted_records": int((data.weights > 0).sum())}


# --- GRPO ------------------------------------------------------------------------------------

def grpo(model, name: str, variant: dict, reward: str, cfg: dict, ctx: RunContext) -> dict:
    settings = {**cfg["grpo"], **variant}
    gcfg = GRPOConfig(**settings, seed=cfg["seed"], progress=cfg["progress"],
                      log_path=str(ctx.output(f"grpo_{name}.jsonl")))
    prompts = tasks.make_examples(cfg["held_out"], cfg["n_train"], cfg["seed"], "train")
    result = grpo_train(model, prompts, REWARDS[reward], gcfg)
    every = cfg["curve_every"]

    def windows(key):
        values = result.curve(key)
        return [sum(values[i:i + every]) / len(values[i:i + every])
                for i in range(0, len(values), every)]

    return {"train_s": result.wall_time_s, "stopped_early": result.stopped_early,
            "curves": {k: windows(k) for k in ("reward", "variance_fraction", "mean_kl",
                                                "clip_fraction", "completion_tokens")}}


# --- the runs --------------------------------------------------------------------------------

def one_model(kind: str, cfg: dict, ctx: RunContext) -> tuple[dict, dict]:
    """(the scores before and after the warm start, every run of this model). Wall times go
    to `ctx.timings` (recorded, not compared), never into the metrics."""
    base = build(kind, cfg)
    before = scores(base, cfg)
    warm = copy.deepcopy(base)
    warm_s = sft(warm, gold_data(cfg, cfg["warm"]), cfg["warm"], cfg["warm"]["steps"][kind], cfg)
    start = {"base": before, "warm": scores(warm, cfg)}
    runs, samples = {}, None
    for name, spec in cfg["runs"].items():
        if kind not in spec["models"]:
            continue
        t0 = time.perf_counter()
        model = copy.deepcopy(warm if spec["start"] == "warm" else base)
        if spec["method"] == "sft":
            out = {"train_s": sft(model, gold_data(cfg, cfg["sft"]), cfg["sft"],
                                  cfg["sft"]["steps"], cfg)}
        elif spec["method"] in ("rw_global", "rw_group"):
            samples = samples or sampled_groups(warm, cfg, ctx, kind)
            out = reward_weighted(model, samples, spec["method"].removeprefix("rw_"), cfg)
        elif spec["method"] == "rw_file":
            out = sample_file(model, cfg, ctx)
        else:
            out = grpo(model, f"{name}_{kind}", spec.get("grpo", {}),
                       spec.get("reward", cfg["reward"]), cfg, ctx)
        ctx.timings[f"{name}_{kind}_train_s"] = round(out.pop("train_s"), 1)
        out["after"] = scores(model, cfg)
        folder = f"adapter_{name}_{kind}"
        save_adapter(model, ctx.out_dir / folder)
        ctx.artifact_files(folder)
        out["adapter_norm"] = total_norm(ctx.out_dir / folder)
        out["gain"] = out["after"][cfg["held_out"]] - start[spec["start"]][cfg["held_out"]]
        out["start"] = spec["start"]
        runs[name] = out
        ctx.timings[f"{name}_{kind}_s"] = round(time.perf_counter() - t0, 1)
    ctx.timings[f"warm_{kind}_train_s"] = round(warm_s, 1)
    return start, runs


def summary(metrics: dict, cfg: dict) -> dict:
    held = cfg["held_out"]
    out = {}
    for kind in MODELS:
        runs = metrics[kind]["runs"]
        out[f"{held}_gain_{kind}"] = runs["grpo"]["gain"]
        out[f"sort_after_{kind}"] = runs[cfg["forgetting_run"]]["after"]["sort"]
    return out


def run(cfg: dict, ctx: RunContext) -> dict:
    for kind in MODELS:
        ctx.record_input(base_path(kind))
    ctx.record_data("gold", sha256_json([(e.prompt, e.answer) for e in
                                         tasks.make_examples(cfg["held_out"], cfg["n_train"],
                                                             cfg["seed"], "train")]))
    metrics = {}
    for kind in MODELS:
        start, runs = one_model(kind, cfg, ctx)
        metrics[kind] = {"start": start, "runs": runs}
    metrics["summary"] = summary(metrics, cfg)
    plot_curves(metrics, ctx.output("curves.png"))
    plot_tasks(metrics, cfg, ctx.output("tasks.png"))
    write_report(metrics, cfg, ctx)
    return metrics


# --- figures and report ----------------------------------------------------------------------

def plot_curves(metrics: dict, path: Path) -> None:
    keys = (("reward", "mean reward"), ("variance_fraction", "groups with reward variance"),
            ("mean_kl", "KL to the base (k3)"))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.4))
    for kind, style in zip(MODELS, ("-", "--"), strict=True):
        for name, r in metrics[kind]["runs"].items():
            if "curves" not in r:
                continue
            for ax, (key, _) in zip(axes, keys, strict=True):
                ax.plot(r["curves"][key], style, label=f"{kind} {name}")
    for ax, (_, title) in zip(axes, keys, strict=True):
        ax.set(title=title, xlabel="iteration window")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tasks(metrics: dict, cfg: dict, path: Path) -> None:
    rows, labels = [], []
    for kind in MODELS:
        for label, s in (("base", metrics[kind]["start"]["base"]),
                         ("warm start", metrics[kind]["start"]["warm"])):
            rows.append([s[t] for t in tasks.TASKS])
            labels.append(f"{kind} {label}")
        for name, r in metrics[kind]["runs"].items():
            rows.append([r["after"][t] for t in tasks.TASKS])
            labels.append(f"{kind} {name}")
    fig, ax = plt.subplots(figsize=(6, 0.3 * len(rows) + 1.2))
    im = ax.imshow(rows, vmin=0, vmax=1, cmap="viridis", aspect="auto")
    ax.set_xticks(range(len(tasks.TASKS)), list(tasks.TASKS))
    ax.set_yticks(range(len(labels)), labels, fontsize=7)
    ax.set_title(f"exact match per task ({cfg['held_out']} is held out of pretraining)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


TARGETS = {"dense": 0.25, "moe": 0.15}   # issue 17: GRPO's gain on the held-out task
SORT_TARGET = 0.90                        # sort after the run with replay (or KL)


def report_rows(metrics: dict, cfg: dict, kind: str, timings: dict) -> list[str]:
    held, k = cfg["held_out"], cfg["eval"]["k"]
    pk = f"{held}_pass@{k}"
    others = [t for t in tasks.TASKS if t != held]

    def row(label, s, *extra):
        cells = [kind, label, f"{s[held]:.2f}", f"{s[pk]:.2f}", *(f"{s[t]:.2f}" for t in others),
                 *extra]
        return "| " + " | ".join(cells) + " |"

    start = metrics[kind]["start"]
    out = [row("base", start["base"], "", "", "", ""),
           row("warm start", start["warm"], "", "", f"{timings[f'warm_{kind}_train_s']:.0f}", "")]
    for name, r in metrics[kind]["runs"].items():
        c = r.get("curves")
        signal = f"{c['variance_fraction'][0]:.2f} → {c['variance_fraction'][-1]:.2f}" if c else ""
        kl = f"{c['mean_kl'][-1]:.2f}" if c else ""
        gain = f"{r['gain']:+.2f} ({r['start']})"
        if r.get("stopped_early"):
            gain += f"; stopped at {r['stopped_early']['step']}: {r['stopped_early']['reason']}"
        seconds = f"{timings[f'{name}_{kind}_train_s']:.0f}"
        out.append(row(name, r["after"], signal, kl, seconds, gain))
    return out


def targets(metrics: dict, cfg: dict) -> str:
    held, s = cfg["held_out"], metrics["summary"]
    rows = []
    for kind in MODELS:
        gain = s[f"{held}_gain_{kind}"]
        rows.append(f"| GRPO's gain on `{held}` over its warm start, {kind} | ≥ {TARGETS[kind]:.2f}"
                    f" | {gain:+.2f} | {'met' if gain >= TARGETS[kind] else 'missed'} |")
    for kind in MODELS:
        sort = s[f"sort_after_{kind}"]
        rows.append(f"| `sort` after `{cfg['forgetting_run']}`, {kind} | ≥ {SORT_TARGET:.2f} | "
                    f"{sort:.2f} | {'met' if sort >= SORT_TARGET else 'missed'} |")
    return "| target | wanted | measured | |\n|---|---|---|---|\n" + "\n".join(rows)


def write_report(metrics: dict, cfg: dict, ctx: RunContext) -> None:
    held, k, g = cfg["held_out"], cfg["eval"]["k"], cfg["grpo"]
    others = [t for t in tasks.TASKS if t != held]
    head = ("| model | run | " + " | ".join([held, f"{held} pass@{k}", *others])
            + " | groups with reward variance, first → last window | KL to the base, last "
            "window | train s | gain on " + held + " (over) |\n|" + "---|" * (len(others) + 8))
    rows = "\n".join(r for kind in MODELS for r in report_rows(metrics, cfg, kind, ctx.timings))
    shares = {name: r["task_share"] for name, r in metrics["dense"]["runs"].items()
              if "task_share" in r}
    share_rows = "\n".join(f"| {name} | " + " | ".join(f"{s[t]:.2f}" for t in tasks.TASKS)
                           + " |" for name, s in shares.items())
    intro = paragraph(
        "Every number here is from `metrics.json` of the run that wrote `manifest.json`; "
        "`python -m labkit reproduce experiments/12-grpo/manifest.json` re-runs it. Each run "
        f"starts from a fresh QLoRA copy (NF4 base, LoRA r={cfg['lora']['r']} everywhere, the "
        "experts included) of the base or of the warm start "
        f"({cfg['warm']['steps']['dense']} dense and {cfg['warm']['steps']['moe']} MoE SFT "
        f"steps on gold `{held}` answers with replay). Exact match is greedy decoding on "
        f"{cfg['eval']['n']} evaluation prompts per task; pass@{k} samples {k} answers at "
        f"temperature 1. The reward is `{cfg['reward']}` unless a run names another. "
        f"GRPO runs {g['steps']} iterations of {g['prompts_per_step']} prompts × "
        f"{g['group_size']} samples, one AdamW step each at lr {g['lr']}. Times are wall "
        "seconds of training and sampling on the recording machine (the manifest's env). "
        "Each run's final adapter is in `adapter_<run>_<model>/` (PEFT format, expert LoRA "
        "as `target_parameters`, hashed in the manifest); `python -m minituner.lora_norms` "
        "prints how far each of its modules and experts moved.")
    shares_intro = paragraph(
        "Share of the training weight per task in the reward-weighted runs (dense; the warm "
        f"start's own samples of {cfg['rw']['prompts']} `{held}` prompts and as many "
        f"pretraining ones, {cfg['rw']['group_size']} each):")
    text = f"""# Experiment 12: from reward-weighted SFT to GRPO

{intro}

{head}
{rows}

{targets(metrics, cfg)}

{shares_intro}

| run | {' | '.join(tasks.TASKS)} |
|---|{'---|' * len(tasks.TASKS)}
{share_rows}

![reward, variance and KL curves](curves.png)

![exact match per task and run](tasks.png)
"""
    ctx.output("REPORT.md").write_text(text)
