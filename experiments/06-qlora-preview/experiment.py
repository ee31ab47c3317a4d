"""Experiment 06: QLoRA preview. The same LoRA adapter on a float base and on an NF4 base;
one epoch of QLoRA training; the memory bill of LoRA versus QLoRA, measured and predicted.

Run (after experiment 05, whose adapters it loads):
            python -m labkit run experiments/06-qlora-preview
Reproduce:  python -m labkit reproduce experiments/06-qlora-preview/manifest.json
Outputs: adapter_qlora/ (the adapter trained on the NF4 base), metrics.json, qlora.jsonl,
memory.png, REPORT.md (`report` makes it from a manifest: the run's own at its end, the committed
one with `python -m labkit report experiments/06-qlora-preview`), manifest.json.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from labkit import RunContext, sha256_json  # noqa: E402
from labkit.readme import prose, table  # noqa: E402
from minigpt import CharTokenizer, base_path, evaluate, load_checkpoint, tasks  # noqa: E402
from minituner import (  # noqa: E402
    SequenceData,
    TrainConfig,
    load_adapter,
    memory,
    save_adapter,
    train,
    wrap_lora,
)
from minituner.activations import saved_activation_bytes  # noqa: E402
from minituner.lora_norms import total_norm  # noqa: E402
from minituner.qlora import BLOCK_LINEARS, wrap_minigpt_qlora  # noqa: E402

MB = 2**20


def pairs_of(tok: CharTokenizer, examples) -> list[tuple[list[int], list[int]]]:
    return [(tok.encode(e.prompt), tok.encode(e.answer) + [tok.eos_id]) for e in examples]


def lora_model(base: Path, cfg: dict, adapter: Path | None = None):
    """Float base + LoRA, with `adapter`'s weights if given."""
    model = load_checkpoint(base)
    wrap_lora(model, BLOCK_LINEARS, **cfg["lora"])
    if adapter is not None:
        load_adapter(model, adapter)
    return model


def qlora_model(base: Path, cfg: dict, adapter: Path | None = None):
    """NF4 base + LoRA (quantized first, then wrapped), with `adapter`'s weights if given."""
    model = load_checkpoint(base)
    wrap_minigpt_qlora(model, quant_scheme=cfg["quant_scheme"], **cfg["lora"])
    if adapter is not None:
        load_adapter(model, adapter)
    return model


def fixed_prompts(cfg: dict) -> torch.Tensor:
    """[n_tasks · prompts_per_task, L] prompt + answer tokens of evaluation examples, padded."""
    tok = CharTokenizer()
    examples = [e for t in tasks.TASKS
                for e in tasks.make_examples(t, cfg["prompts_per_task"], cfg["seed"], "eval")]
    return SequenceData.from_pairs(pairs_of(tok, examples), pad_id=tok.pad_id).tokens


@torch.no_grad()
def parity(base: Path, cfg: dict, adapter: Path) -> dict:
    """Model A (float base + adapter) against model B (NF4 base + the same adapter)."""
    a, b = lora_model(base, cfg, adapter).eval(), qlora_model(base, cfg, adapter).eval()
    x = fixed_prompts(cfg)
    la, lb = a(x), b(x)
    exact_a = {t: evaluate(a, t, n=cfg["eval_n"], seed=cfg["seed"]) for t in tasks.TASKS}
    exact_b = {t: evaluate(b, t, n=cfg["eval_n"], seed=cfg["seed"]) for t in tasks.TASKS}
    diff = (la - lb).abs().mean().item()
    drop = max(exact_a[t] - exact_b[t] for t in tasks.TASKS)
    tol = cfg["logit_tolerance"]
    return {
        "prompts": x.shape[0],
        "within_tolerance": (diff <= tol["mean_abs_diff_rel"] * la.abs().mean().item()
                             and drop <= tol["exact_match_drop"]),
        "max_exact_match_drop": drop,
        "mean_abs_diff": diff,
        "max_abs_diff": (la - lb).abs().max().item(),
        "mean_abs_logit": la.abs().mean().item(),
        "argmax_agreement": (la.argmax(-1) == lb.argmax(-1)).float().mean().item(),
        "exact_match_float_base": exact_a,
        "exact_match_nf4_base": exact_b,
    }


def epoch(base: Path, cfg: dict, ctx: RunContext) -> dict:
    """One epoch of QLoRA on the held-out task plus replay, from a fresh adapter."""
    tok = CharTokenizer()
    examples = (tasks.make_examples(cfg["held_out"], cfg["n_train"], cfg["seed"], "train")
                + tasks.make_mixture(tasks.PRETRAIN_TASKS, cfg["replay_per_task"],
                                     cfg["seed"] + 1, "train"))
    pairs = pairs_of(tok, examples)
    ctx.record_data("qlora_epoch", sha256_json(pairs))
    data = SequenceData.from_pairs(pairs, pad_id=tok.pad_id)
    steps = len(data) // cfg["train"]["batch_size"]          # one pass over the data
    model = qlora_model(base, cfg)
    result = train(model, data, TrainConfig(**cfg["train"], steps=steps, seed=cfg["seed"],
                                            log_path=str(ctx.output("qlora.jsonl"))))
    ctx.timings["qlora_epoch_train_s"] = round(result.wall_time_s, 1)
    losses = result.losses
    save_adapter(model, ctx.out_dir / "adapter_qlora")
    ctx.artifact_files("adapter_qlora")
    return {
        "steps": steps,
        "loss_curve": losses,
        "log_every": cfg["train"]["log_every"],
        "all_finite": all(torch.isfinite(torch.tensor(losses)).tolist()),
        "stopped_early": result.stopped_early,
        "loss_fell": losses[-1] < losses[0],
        "exact_match_after": {t: evaluate(model, t, n=cfg["eval_n"], seed=cfg["seed"])
                              for t in tasks.TASKS},
        "adapter_norm": total_norm(ctx.out_dir / "adapter_qlora"),
    }


def memory_row(model: torch.nn.Module, cfg: dict, regime: str) -> dict:
    """Bytes held after `memory.steps` AdamW steps, the activations of one step, and the
    prediction from the model's shape alone."""
    mcfg = cfg["memory"]
    tok = CharTokenizer()
    pairs = pairs_of(tok, tasks.make_examples(cfg["held_out"], mcfg["batch_size"],
                                              cfg["seed"], "train"))
    x, y, mask = SequenceData.from_pairs(pairs, pad_id=tok.pad_id).batch(
        torch.arange(len(pairs)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    for _ in range(mcfg["steps"]):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    held = memory.held_bytes(model, opt).as_dict()
    held["activations"] = saved_activation_bytes(model, x)
    held["total"] = held["weights"] + held["grads"] + held["optimizer"] + held["activations"]
    pred = memory.predict_training(memory.TransformerShape.of(model.config), regime, x.numel(),
                                   r=cfg["lora"]["r"])
    return {"measured": held, "predicted": pred.as_dict(), "tokens": x.numel()}


def adapter_swap(base: Path, cfg: dict, adapters: dict[str, Path]) -> dict:
    """Two adapters, one NF4 base: load one, then the other, into the same model."""
    model = qlora_model(base, cfg).eval()
    x = fixed_prompts(cfg)
    out = {}
    with torch.no_grad():
        for name, path in adapters.items():
            load_adapter(model, path)
            out[name] = {"logits": model(x),
                         "exact_match": {t: evaluate(model, t, n=cfg["eval_n"], seed=cfg["seed"])
                                         for t in tasks.TASKS}}
    first, second = (out[n] for n in adapters)
    return {"adapters": list(adapters),
            "mean_abs_diff": (first["logits"] - second["logits"]).abs().mean().item(),
            "exact_match": {n: o["exact_match"] for n, o in out.items()}}


def extrapolate(cfg: dict) -> dict:
    e = cfg["extrapolate"]
    return {regime: memory.predict_training(
        memory.LLAMA_7B, regime, e["tokens"], r=cfg["lora"]["r"], weight_bits=e["weight_bits"],
        act_bits=e["act_bits"]).as_dict() for regime in memory.REGIMES}


def plot_memory(rows: dict, path) -> None:
    parts = ["weights", "grads", "optimizer", "activations"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    for i, row in enumerate(rows.values()):
        left = 0.0
        for j, part in enumerate(parts):
            width = row["measured"][part] / MB
            ax.barh(i, width, left=left, color=f"C{j}", label=part if i == 0 else None)
            left += width
    ax.set_yticks(range(len(rows)), list(rows))
    ax.set(xlabel="MiB (measured after two AdamW steps; activations of one step)",
           title="MiniGPT: LoRA on a float base vs QLoRA on NF4")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --- the report: tables of a manifest's numbers, and fixed text --------------------------------

PARTS = ("weights", "grads", "optimizer", "activations", "total")


def bill_rows(rows: dict[str, dict], parts: tuple, lora: str, qlora: str, unit: int,
              fmt: str) -> list[list[str]]:
    """One row per setup (in name order), then LoRA over QLoRA and LoRA minus QLoRA."""
    lo, q = rows[lora], rows[qlora]
    return ([[name, *(format(rows[name][p] / unit, fmt) for p in parts)] for name in sorted(rows)]
            + [["ratio (LoRA / QLoRA)", *(f"{lo[p] / max(q[p], 1):.2f}×" for p in parts)],
               ["saving (LoRA − QLoRA)", *(format((lo[p] - q[p]) / unit, fmt) for p in parts)]])


def report(m: dict) -> str:
    """REPORT.md from a manifest (its `config` and `metrics`)."""
    cfg, metrics = m["config"], m["metrics"]
    par, ep, swap, mem = (metrics[k] for k in ("parity", "qlora_epoch", "swap", "memory"))
    tol, ex, s, (a, b) = (cfg["logit_tolerance"], cfg["extrapolate"], memory.LLAMA_7B,
                          swap["adapters"])
    rel = tol["mean_abs_diff_rel"]
    parity = [["mean abs logit difference", f"{par['mean_abs_diff']:.4f}"],
              [f"its tolerance: {rel:.0%} of A's mean abs logit ({par['mean_abs_logit']:.2f})",
               f"{rel * par['mean_abs_logit']:.4f}"],
              ["max abs logit difference", f"{par['max_abs_diff']:.3f}"],
              ["same argmax", f"{par['argmax_agreement']:.2%}"],
              [f"largest drop of a task's exact match (at most {tol['exact_match_drop']})",
               f"{par['max_exact_match_drop']:.3f}"],
              ["within both tolerances", f"**{par['within_tolerance']}**"]]
    scores = {f"A: float base + {a}": par["exact_match_float_base"],
              f"B: NF4 base + {a}": par["exact_match_nf4_base"],
              "NF4 base + the adapter of one epoch of QLoRA": ep["exact_match_after"],
              **{f"NF4 base, {n} swapped in": swap["exact_match"][n] for n in (a, b)}}
    measured = {name: {**row["measured"], "predicted total": row["predicted"]["total"]}
                for name, row in mem.items()}
    return prose(f"""# Experiment 06: QLoRA preview

Every number below is from the manifest of the run that wrote it (`manifest.json`, with the
sha256 of the base checkpoint and of both adapters it loads from experiment 05): `python -m
labkit report experiments/06-qlora-preview` makes this file again from it, `python -m labkit
reproduce experiments/06-qlora-preview/manifest.json` re-runs the run.

## One adapter, two bases; one epoch; two adapters, one base

Model A is the float32 dense base with experiment 05's `{a}` adapter, model B the same base
in NF4 ({cfg['quant_scheme']}, double quantization) with the same adapter, which was trained
against the float weights: on NF4 it sees each weight moved by up to half a code gap times
its block's absmax. B against A on {par['prompts']} fixed evaluation sequences (all tasks):

{table(["", "B against A"], parity)}

One epoch of QLoRA trains a fresh adapter on the NF4 base: {ep['steps']} steps over
{cfg['n_train']} `{cfg['held_out']}` examples plus {cfg['replay_per_task']} of each
pretraining task, its loss from {ep['loss_curve'][0]:.3f} (first {ep['log_every']} steps) to
{ep['loss_curve'][-1]:.4f} (last window); every logged loss finite: {ep['all_finite']}; NaN
guard fired: {ep['stopped_early'] is not None}. The adapter swap loads `{a}` and `{b}` in
turn into one NF4 model: mean abs logit difference {swap['mean_abs_diff']:.3f}. Exact match:

{table(["model", *tasks.TASKS], [[n, *(f"{x[t]:.3f}" for t in tasks.TASKS)]
                                 for n, x in scores.items()])}

## Memory at MiniGPT scale (MiB)

Held bytes counted tensor by tensor after {cfg['memory']['steps']} AdamW steps
(`minituner.memory.held_bytes`), plus what one forward keeps for its backward (batch
{cfg['memory']['batch_size']}, {mem['QLoRA, NF4 base']['tokens']} tokens;
`minituner.activations.saved_activation_bytes`), beside `minituner.memory.predict_training`
from the model's shape alone. At this scale activations dominate; gradients and Adam state
are the adapter's, the same in both setups.

{table(["setup", "weights", "grads", "Adam", "activations", "total", "predicted total"],
       bill_rows(measured, (*PARTS, "predicted total"), "LoRA, float32 base",
                 "QLoRA, NF4 base", MB, ".2f"))}

![memory](memory.png)

## At 7B scale (predicted, GiB)

`memory.predict_training(LLAMA_7B, ...)`: {s.n_layer} layers, d_model {s.d_model}, d_ff
{s.d_ff}; weights {ex['weight_bits']}-bit outside NF4, activations {ex['act_bits']}-bit for
{ex['tokens']} tokens a step, LoRA r={cfg['lora']['r']} on all seven projections, float32
adapters, gradients and Adam state. Full fine-tuning against QLoRA is a multi-GPU node
against one consumer GPU.

{table(["regime", "weights", "grads", "Adam", "activations", "total"],
       bill_rows(metrics["llama_7b"], PARTS, "lora", "qlora", 2**30, ".1f"))}
""")


def run(cfg: dict, ctx: RunContext) -> dict:
    base = ctx.record_input(base_path(cfg["base"]))
    adapters = {}    # a list in the config: manifests store dicts with sorted keys
    for name, rel in cfg["adapters"]:
        folder = (ctx.exp_dir / rel).resolve()
        for file in ("adapter_model.safetensors", "adapter_config.json"):
            ctx.record_input(folder / file)
        adapters[name] = folder
    first = next(iter(adapters.values()))
    metrics = {"parity": parity(base, cfg, first)}
    metrics["qlora_epoch"] = epoch(base, cfg, ctx)
    rows = {"LoRA, float32 base": memory_row(lora_model(base, cfg), cfg, "lora"),
            "QLoRA, NF4 base": memory_row(qlora_model(base, cfg), cfg, "qlora")}
    metrics["memory"] = rows
    metrics["swap"] = adapter_swap(base, cfg, adapters)
    metrics["llama_7b"] = extrapolate(cfg)
    plot_memory(rows, ctx.output("memory.png"))
    ctx.output("REPORT.md").write_text(report({"config": cfg, "metrics": metrics}))
    return metrics
