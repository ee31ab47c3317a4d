"""Experiment 11: QLoRA on MiniGPT-MoE. NF4 attention and NF4 experts, LoRA on attention and on
every expert, fine-tuned on the held-out task; against LoRA on the float MoE and dense QLoRA
(experiment 06's recipe) at the same steps and seed; a reward-weighted SFT run; routing and
LoRA norms per expert; the memory bill measured beside the predictor, and extrapolated.

Run:        python -m labkit run experiments/11-qlora-moe
Reproduce:  python -m labkit reproduce experiments/11-qlora-moe/manifest.json
Outputs: adapter_<run>/ (each run's final adapter, PEFT format with expert LoRA as
`target_parameters`, hashed in the manifest), metrics.json, <run>.jsonl (trainer logs),
curves.png, routing.png, lora_norms.png, memory.png, REPORT.md, manifest.json.
report.py makes REPORT.md from a manifest (tables of its numbers, and fixed text): the run's
own at the end of the run, the committed one with `python -m labkit report
experiments/11-qlora-moe`.

The long runs use the MoE's sort-based PyTorch backend (`backend="torch"`): on a CPU the
Triton kernels run in the interpreter, about a thousand times slower. `triton_check` runs one
training step of the same QLoRA model on both backends and records how far apart the loss
and every LoRA gradient are — the kernels compute this training, the PyTorch path is how
a CPU affords it.
"""

from __future__ import annotations

import copy
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from labkit import RunContext, sha256_json  # noqa: E402
from labkit.experiment import load_script  # noqa: E402
from minigpt import CharTokenizer, base_path, evaluate, load_checkpoint, tasks  # noqa: E402
from minigpt.generate import greedy_generate  # noqa: E402
from minimoe import MoEMLP  # noqa: E402
from minituner import (  # noqa: E402
    SequenceData,
    TrainConfig,
    memory,
    peak_step_bytes,
    save_adapter,
    saved_activation_bytes,
    train,
)
from minituner.lora_norms import adapter_norms, total_norm  # noqa: E402
from minituner.qlora import wrap_minigpt_qlora  # noqa: E402

MB = 2**20
# REPORT.md's writer, report(manifest) -> str, lives beside this file: tables and fixed text.
report = load_script(Path(__file__).with_name("report.py"), "experiment_11_report").report


def pairs_of(tok: CharTokenizer, examples) -> list[tuple[list[int], list[int]]]:
    return [(tok.encode(e.prompt), tok.encode(e.answer) + [tok.eos_id]) for e in examples]


def train_examples(cfg: dict):
    return (tasks.make_examples(cfg["held_out"], cfg["n_train"], cfg["seed"], "train")
            + tasks.make_mixture(tasks.PRETRAIN_TASKS, cfg["replay_per_task"], cfg["seed"] + 1,
                                 "train"))


def build(base: Path, regime: str, cfg: dict, backend: str = "torch"):
    """A model of `regime`: "full" (float, all trainable), "lora" (float base + LoRA, experts
    too), "qlora" (NF4 base + LoRA)."""
    model = load_checkpoint(base)
    model.set_moe_backend(backend)          # the config's moe_backend, and every MoE MLP's
    if regime != "full":
        wrap_minigpt_qlora(model, quant_scheme=cfg["quant_scheme"], quantize=regime == "qlora",
                           **cfg["lora"])
    return model


def exact_match(model, cfg: dict) -> dict[str, float]:
    return {t: evaluate(model, t, n=cfg["eval_n"], seed=cfg["seed"]) for t in tasks.TASKS}


def routing_counts(model, cfg: dict) -> dict[str, list[list[int]]]:
    """Per task: tokens routed to each expert, per layer ([n_layer][E]), on eval prompts
    (prompt and answer tokens, top-k slots counted)."""
    tok = CharTokenizer()
    moes = [m for m in model.modules() if isinstance(m, MoEMLP)]
    out = {}
    with torch.no_grad():
        for t in tasks.TASKS:
            ex = tasks.make_examples(t, cfg["routing_n"], cfg["seed"], "eval")
            x = SequenceData.from_pairs(pairs_of(tok, ex), pad_id=tok.pad_id).tokens
            model.eval()(x)
            out[t] = [torch.bincount(m.last_experts.reshape(-1), minlength=m.n_experts).tolist()
                      for m in moes]
    return out


def finetune(name: str, model, data: SequenceData, cfg: dict, ctx: RunContext,
             diagnose: bool = False) -> dict:
    """Train, then evaluate (and with `diagnose`, the routing and LoRA norms after). A run
    the NaN guard stopped is recorded as such (`stopped_early`: step, tensor, reason); if its
    model no longer gives finite router logits, `not_evaluated` says so instead of scores."""
    result = train(model, data, TrainConfig(**cfg["train"], seed=cfg["seed"],
                                            log_path=str(ctx.output(f"{name}.jsonl"))))
    ctx.timings[f"{name}_train_s"] = round(result.wall_time_s, 1)
    out = {"loss_curve": result.losses, "stopped_early": result.stopped_early}
    try:
        out["exact_match_after"] = exact_match(model, cfg)
        if diagnose:
            out["routing_after"] = routing_counts(model, cfg)
    except FloatingPointError as err:
        out["exact_match_after"], out["not_evaluated"] = None, str(err)
    save_adapter(model, ctx.out_dir / f"adapter_{name}")
    ctx.artifact_files(f"adapter_{name}")
    norms = adapter_norms(ctx.out_dir / f"adapter_{name}")
    out["adapter_norm"] = total_norm(norms)
    if diagnose:        # what `python -m minituner.lora_norms adapter_<run>` prints
        out["lora_norms"] = {t.name: t.experts for t in norms}
    return out


def sampled_rewards(model, pairs, cfg: dict) -> tuple[list, list[float]]:
    """The model's own answers to the training prompts and their graded rewards: the
    fraction of answer positions right, 1.0 only for an exact match (and its <eos>)."""
    rw = cfg["reward"]
    tok = CharTokenizer()
    gen = torch.Generator().manual_seed(cfg["seed"] + 7)
    prompts = [p for p, _ in pairs] * rw["samples_per_prompt"]
    golds = [a[:-1] for _, a in pairs] * rw["samples_per_prompt"]
    outs = greedy_generate(model, prompts, rw["max_new_tokens"], tok.eos_id,
                           temperature=rw["temperature"], generator=gen)
    rewards = []
    for out, gold in zip(outs, golds, strict=True):
        hits = sum(a == b for a, b in zip(out, gold, strict=False))
        rewards.append(1.0 if out == gold else hits / max(len(gold), len(out), 1) * 0.5)
    return [(p, o + [tok.eos_id]) for p, o in zip(prompts, outs, strict=True)], rewards


def memory_row(model, cfg: dict, regime: str, x, y) -> dict:
    """Held bytes after `memory.steps` AdamW steps and the activations of one forward and
    loss (measured), beside `memory.predict_training` from the shape and the token count."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    model.train()
    for _ in range(cfg["memory"]["steps"]):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    held = memory.held_bytes(model, opt).as_dict()
    # The ledger leaves out what the caller passed in; autograd keeps the targets, and the
    # input ids too when the embedding trains.
    ids = y.nbytes + (x.nbytes if regime == "full" else 0)
    held["activations"] = saved_activation_bytes(model, x, y) + ids
    held["total"] = sum(held[k] for k in ("weights", "grads", "optimizer", "activations"))
    shape = memory.TransformerShape.of(model.config)
    pred = memory.predict_training(shape, regime, x.numel(), r=cfg["lora"]["r"]).as_dict()
    return {"measured": held, "predicted": pred, "tokens": x.numel()}


def memory_table(base: Path, cfg: dict) -> dict:
    tok = CharTokenizer()
    pairs = pairs_of(tok, tasks.make_examples(cfg["held_out"], cfg["memory"]["batch_size"],
                                              cfg["seed"], "train"))
    x, y, _ = SequenceData.from_pairs(pairs, pad_id=tok.pad_id).batch(torch.arange(len(pairs)))
    rows = {regime: memory_row(build(base, regime, cfg), cfg, regime, x, y)
            for regime in memory.REGIMES}
    # What gradient checkpointing (one block per segment) saves on the QLoRA model: the bytes
    # the forward keeps, and the peak over a whole forward + backward (activations, gradients,
    # the backward's temporaries and, when on, the recomputed block).
    model = build(base, "qlora", cfg).train()
    shape = memory.TransformerShape.of(model.config)
    row = {}
    for on in (False, True):
        model.set_gradient_checkpointing(int(on))
        key = "on" if on else "off"
        row[f"activations_{key}"] = saved_activation_bytes(model, x, y) + y.nbytes
        row[f"peak_{key}"] = peak_step_bytes(model, x, y)
        row[f"predicted_{key}"] = memory.activation_bytes(shape, "qlora", x.numel(),
                                                          r=cfg["lora"]["r"], checkpointing=on)
    rows["checkpointing"] = row
    return rows


def extrapolate(cfg: dict) -> dict:
    """Mixtral-8x7B and Qwen3-30B-A3B from their published shapes (activations for
    `tokens` with checkpointing), and the QLoRA paper's 65B setting, from the same predictor."""
    e = cfg["extrapolate"]
    out = {}
    for name, shape in (("mixtral-8x7b", memory.MIXTRAL_8X7B),
                        ("qwen3-30b-a3b", memory.QWEN3_30B_A3B)):
        out[name] = {"params": shape.n_params()} | {
            regime: memory.predict_training(shape, regime, e["tokens"], r=e["r"],
                                            weight_bits=e["weight_bits"],
                                            act_bits=e["weight_bits"],
                                            checkpointing=True).as_dict()
            for regime in memory.REGIMES}
    # QLoRA paper: LLaMA-65B, LoRA r=64 on every projection, 16-bit adapters, gradient
    # checkpointing, paged AdamW (its state lives in CPU memory, paged in when used).
    p = e["qlora_paper"]
    pred = memory.predict_training(memory.LLAMA_65B, "qlora", p["tokens"], r=p["r"],
                                   weight_bits=16, act_bits=16, lora_bits=p["lora_bits"],
                                   checkpointing=True).as_dict()
    out["llama-65b"] = {"params": memory.LLAMA_65B.n_params(), "qlora": pred,
                        "gpu_total_paged_optimizer": pred["total"] - pred["optimizer"]}
    return out


def triton_check(base: Path, cfg: dict) -> dict:
    """One loss and backward of the QLoRA-MoE model on each backend, same batch."""
    tok = CharTokenizer()
    pairs = pairs_of(tok, tasks.make_examples(cfg["held_out"], cfg["triton_check"]["batch"],
                                              cfg["seed"], "train"))
    x, y, _ = SequenceData.from_pairs(pairs, pad_id=tok.pad_id).batch(torch.arange(len(pairs)))
    grads, losses = [], []
    for backend in ("torch", "triton"):
        torch.manual_seed(cfg["seed"])
        model = build(base, "qlora", cfg, backend=backend)
        for n, p in model.named_parameters():
            if n.endswith("lora_B"):
                torch.nn.init.normal_(p, std=0.02, generator=torch.Generator().manual_seed(1))
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        losses.append(loss.item())
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    worst = max(float((grads[1][n] - g).abs().max() / g.abs().max().clamp_min(1e-30))
                for n, g in grads[0].items())
    return {"loss_torch": losses[0], "loss_triton": losses[1], "tensors": len(grads[0]),
            "max_rel_grad_diff": worst}


def run(cfg: dict, ctx: RunContext) -> dict:
    base_moe = ctx.record_input(base_path("moe"))
    base_dense = ctx.record_input(base_path("dense"))
    tok = CharTokenizer()
    examples = train_examples(cfg)
    pairs = pairs_of(tok, examples)
    ctx.record_data("sft", sha256_json(pairs))
    data = SequenceData.from_pairs(pairs, pad_id=tok.pad_id)
    metrics = {"triton_check": triton_check(base_moe, cfg)}
    probe = build(base_moe, "qlora", cfg)
    metrics["before"] = {"qlora_moe": exact_match(probe, cfg),
                         "routing": routing_counts(probe, cfg)}
    runs = {}
    for name, base, regime in (("qlora_moe", base_moe, "qlora"), ("lora_moe", base_moe, "lora"),
                               ("dense_qlora", base_dense, "qlora")):
        runs[name] = finetune(name, build(base, regime, cfg), data, cfg, ctx,
                              diagnose=name == "qlora_moe")
    # Reward-weighted SFT: the fresh QLoRA model's own samples, weighted by their reward.
    model = build(base_moe, "qlora", cfg)
    sampled, rewards = sampled_rewards(copy.deepcopy(model), pairs, cfg)
    ctx.record_data("rw_sft", sha256_json([sampled, rewards]))
    rw_data = SequenceData.from_pairs(sampled, pad_id=tok.pad_id, rewards=rewards)
    runs["qlora_moe_rw"] = finetune("qlora_moe_rw", model, rw_data, cfg, ctx)
    runs["qlora_moe_rw"]["mean_reward"] = sum(rewards) / len(rewards)
    runs["qlora_moe_rw"]["exact_samples"] = sum(r == 1.0 for r in rewards)
    # Which tasks the exact samples came from (the samples repeat the prompts in order).
    sample_tasks = [e.task for e in examples] * cfg["reward"]["samples_per_prompt"]
    runs["qlora_moe_rw"]["exact_samples_per_task"] = {
        t: sum(r == 1.0 for r, s in zip(rewards, sample_tasks, strict=True) if s == t)
        for t in tasks.TASKS}
    metrics["runs"] = runs
    metrics["memory"] = memory_table(base_moe, cfg)
    metrics["extrapolate"] = extrapolate(cfg)
    plot_curves(runs, cfg, ctx.output("curves.png"))
    if "routing_after" in runs["qlora_moe"]:
        plot_routing(metrics["before"]["routing"], runs["qlora_moe"]["routing_after"],
                     ctx.output("routing.png"))
    plot_norms(runs["qlora_moe"]["lora_norms"], ctx.output("lora_norms.png"))
    plot_memory(metrics["memory"], ctx.output("memory.png"))
    ctx.output("REPORT.md").write_text(report({"config": cfg, "metrics": metrics,
                                               "timings": ctx.timings}))
    return metrics


# --- figures ---------------------------------------------------------------------------------

def plot_curves(runs: dict, cfg: dict, path) -> None:
    fig, ax = plt.subplots(figsize=(6, 3.2))
    every = cfg["train"]["log_every"]
    for name, r in runs.items():
        ax.plot([every * (i + 1) for i in range(len(r["loss_curve"]))], r["loss_curve"],
                label=name)
    ax.set(xlabel="step", ylabel=f"mean loss per {every} steps", yscale="log",
           title="Fine-tuning on the held-out task (same data, steps, seed)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _share(counts: dict) -> torch.Tensor:
    """{task: [layer][E]} -> [task, E] share of each task's slots per expert, layers summed."""
    m = torch.tensor([[sum(col) for col in zip(*layers, strict=True)]
                      for layers in counts.values()], dtype=torch.float64)
    return m / m.sum(1, keepdim=True)


def plot_routing(before: dict, after: dict, path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2), sharey=True)
    for ax, counts, title in ((axes[0], before, "before"), (axes[1], after, "after")):
        im = ax.imshow(_share(counts), vmin=0, vmax=0.4, cmap="viridis")
        ax.set(title=f"routing {title} fine-tuning", xlabel="expert")
        ax.set_yticks(range(len(counts)), list(counts))
    fig.colorbar(im, ax=axes, label="share of the task's slots (all layers)")
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_norms(norms: dict, path) -> None:
    experts = {n: v for n, v in norms.items() if len(v) > 1}
    fig, ax = plt.subplots(figsize=(7, 3.4))
    im = ax.imshow(torch.tensor(list(experts.values())), cmap="magma")
    ax.set_yticks(range(len(experts)), [n.replace("blocks.", "b").replace(".mlp.", " ")
                                        for n in experts], fontsize=7)
    ax.set(xlabel="expert", title="‖s·B_e·A_e‖_F after QLoRA fine-tuning")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_memory(rows: dict, path) -> None:
    parts = ["weights", "grads", "optimizer", "activations"]
    names = list(memory.REGIMES)
    fig, ax = plt.subplots(figsize=(6, 3))
    for i, name in enumerate(names):
        left = 0.0
        for j, part in enumerate(parts):
            width = rows[name]["measured"][part] / MB
            ax.barh(i, width, left=left, color=f"C{j}", label=part if i == 0 else None)
            left += width
        ax.plot([rows[name]["predicted"]["total"] / MB] * 2, [i - 0.45, i + 0.45], "k-",
                lw=2, label="predicted total" if i == 0 else None)
    ax.set_yticks(range(len(names)), names)
    ax.set(xlabel="MiB (bars measured)", title="MiniGPT-MoE: full vs LoRA vs QLoRA")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
