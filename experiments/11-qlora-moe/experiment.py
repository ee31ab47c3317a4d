"""Experiment 11: QLoRA on MiniGPT-MoE. NF4 attention and NF4 experts, LoRA on attention and on
every expert, fine-tuned on the held-out task; against LoRA on the float MoE and dense QLoRA
(experiment 06's recipe) at the same steps and seed; a reward-weighted SFT run; routing and
LoRA norms per expert; the memory bill measured beside the predictor, and extrapolated.

Run:        python -m labkit run experiments/11-qlora-moe
Reproduce:  python -m labkit reproduce experiments/11-qlora-moe/manifest.json
Outputs: adapter_<run>/ (each run's final adapter, PEFT format with expert LoRA as
`target_parameters`, hashed in the manifest), metrics.json, <run>.jsonl (trainer logs),
curves.png, routing.png, lora_norms.png, memory.png, REPORT.md, manifest.json.
`write_report` makes REPORT.md from the metrics, the config and the timings of the same run,
so a report is always that of the manifest beside it.

The long runs use the MoE's sort-based PyTorch backend (`backend="torch"`): on a CPU the
Triton kernels run in the interpreter, about a thousand times slower. `triton_check` runs one
training step of the same QLoRA model on both backends and records how far apart the loss
and every LoRA gradient are — the kernels compute this training, the PyTorch path is how
a CPU affords it.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from labkit import RunContext, sha256_json  # noqa: E402
from labkit.readme import paragraph, table  # noqa: E402
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
from minituner.lora_norms import TargetNorms, adapter_norms, grid, total_norm  # noqa: E402
from minituner.qlora import wrap_minigpt_qlora  # noqa: E402

MB = 2**20


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
    write_report(metrics, cfg, ctx)
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


# --- the report ------------------------------------------------------------------------------
# Every number in REPORT.md is computed here from the metrics, the config, the timings of the
# same run, and the two base checkpoints' configs (the files the run records). A sentence whose
# claim depends on the numbers picks its words by comparing them.

RUN_LABELS = {"qlora_moe": "QLoRA-MoE after SFT", "lora_moe": "LoRA on the float MoE",
              "dense_qlora": "dense QLoRA (experiment 06's recipe)",
              "qlora_moe_rw": "QLoRA-MoE, reward-weighted SFT"}
REGIME_LABELS = {"full": "full fine-tune (float)", "lora": "LoRA, float base",
                 "qlora": "QLoRA, NF4 base"}
SCALE_MODELS = {"mixtral-8x7b": ("Mixtral-8x7B", memory.MIXTRAL_8X7B),
                "qwen3-30b-a3b": ("Qwen3-30B-A3B", memory.QWEN3_30B_A3B)}
PARTS = ("weights", "grads", "optimizer", "activations")
GB = 1e9
PAPER_GPU_GB = 48          # the QLoRA paper fine-tunes LLaMA-65B on one 48 GB GPU
GPU_SIZES_GB = (40, 48, 80)   # memory of common data-centre GPUs (A100 40 GB, L40S, H100)


def _sci(x: float) -> str:
    """1.6399e-06 -> "1.6e-6"."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def _side(a: float, b: float, n: int) -> int:
    """1 if exact-match score a is above b by more than two standard errors (n prompts each),
    -1 if below, 0 if within."""
    se = math.sqrt((a * (1 - a) + b * (1 - b)) / n)
    return 0 if abs(a - b) <= 2 * se else (1 if a > b else -1)


def _noise(side: int, n: int) -> str:
    return (f"within two standard errors at {n} prompts" if side == 0
            else f"more than two standard errors apart at {n} prompts")


def _times(a: float, b: float, less: str = "less", more: str = "more",
           same: str = "as much") -> str:
    """How a compares with b: "2.5× less", "1.2× more" or `same`."""
    if a == b or not a or not b:
        return same
    return f"{b / a:.1f}× {less}" if a < b else f"{a / b:.1f}× {more}"


def _score_row(label: str, scores: dict | None, order: list[str], held: str) -> list[str]:
    if scores is None:
        return [label] + ["not evaluated"] * len(order)
    return [label] + [f"**{scores[t]:.2f}**" if t == held else f"{scores[t]:.2f}"
                      for t in order]


def _header(cfg: dict, ctx: RunContext) -> str:
    trained = ", ".join(f"{name} {ctx.timings[f'{name}_train_s']:.1f} s"
                        for name in RUN_LABELS if f"{name}_train_s" in ctx.timings)
    return paragraph(
        "Every number here comes from `metrics.json` of the run that wrote `manifest.json`, and "
        "this report is written by that run (`write_report` in `experiment.py`). That manifest "
        "records the sha256 of both base checkpoints from experiment 00 and of the training "
        "data. To re-run the whole thing and compare: "
        "`python -m labkit reproduce experiments/11-qlora-moe/manifest.json`. "
        f"Training took {trained} on the recording machine (the manifest's `timings`; its "
        "`env` says which machine, `git` which commit, and `wall_time_s` how long the whole "
        "run took).")


def _setup(metrics: dict, cfg: dict, moe, trained_params: int) -> str:
    held, train_cfg = cfg["held_out"], cfg["train"]
    lora = cfg["lora"]
    blocksize = cfg["quant_scheme"].rsplit("_", 1)[-1]
    clip = TrainConfig(**train_cfg, seed=cfg["seed"])
    aids = []
    if clip.grad_clip_value:
        aids.append(f"**element-wise gradient clipping** (each element to ±{clip.grad_clip_value:g}"
                    + (f", then the global norm to {clip.grad_clip:g})" if clip.grad_clip
                       else ")"))
    if clip.checkpoint_every:
        per = clip.checkpoint_every
        aids.append(f"**gradient checkpointing** ({per} block{'s' if per > 1 else ''} "
                    "per segment)")
    aids_line = (f"{'Two stabilisers are' if len(aids) == 2 else 'One stabiliser is'} on for "
                 f"every run: {' and '.join(aids)}." if aids
                 else "No gradient clipping by element and no gradient checkpointing.")
    items = [
        f"The base is the MoE MiniGPT of experiment 00: {moe.n_layer} layers, d_model "
        f"{moe.n_embd}, {moe.n_experts} SwiGLU experts of width {moe.d_ff} in every block, "
        f"top-{moe.top_k} routing. It was pretrained on every task except `{held}`.",
        "QLoRA-MoE quantizes the attention projections and all experts to NF4 (blocksize "
        f"{blocksize}, double quantization) and holds the experts as `[{moe.n_experts}, in, "
        "out]` NF4 tensors.",
        f"LoRA (r={lora['r']}, α={lora['alpha']:g}) goes on q/k/v/o, and every expert gets its "
        f"own r={lora['r']} pair in each of gate, up and down (`minimoe.attach_expert_lora`).",
        "The routers stay float and frozen. The run trains "
        f"{trained_params:,} LoRA parameters (the float32 gradients the memory table counts, "
        "over 4 bytes).",
        f"Training: {train_cfg['steps']} steps at batch {train_cfg['batch_size']} on "
        f"{cfg['n_train']:,} `{held}` examples plus {cfg['replay_per_task']:,} replay examples "
        f"of each pretraining task; AdamW, lr {train_cfg['lr']:g}.",
        aids_line,
        "Every run uses the same data, steps and seed.",
    ]
    return "\n".join(paragraph(f"- {item}", "  ") for item in items)


def _triton(metrics: dict, cfg: dict) -> str:
    t = metrics["triton_check"]
    intro = paragraph(
        "**Which MoE path.** The long runs use the MoE's sort-based PyTorch backend, because on "
        "a CPU the Triton kernels run in the interpreter and are very slow. To show that the "
        "Triton kernels compute this same training, one training step of the QLoRA-MoE model "
        f"(batch {cfg['triton_check']['batch']}) was run on both backends:")
    rows = [["PyTorch backend", f"{t['loss_torch']:.5f}", "—"],
            ["Triton kernels", f"{t['loss_triton']:.5f}", _sci(t["max_rel_grad_diff"])]]
    return intro + "\n\n" + table(
        ["", "loss", f"worst relative difference over {t['tensors']} gradient tensors"], rows)


def _findings(metrics: dict, cfg: dict, moe, dense) -> list[str]:
    held, n = cfg["held_out"], cfg["eval_n"]
    others = [t for t in tasks.TASKS if t != held]
    runs, before = metrics["runs"], metrics["before"]["qlora_moe"]
    after = {name: r["exact_match_after"] for name, r in runs.items()}
    q, lo, d, rw = (after.get(name) for name in RUN_LABELS)
    mem = metrics["memory"]
    out = [paragraph(f"- **{RUN_LABELS.get(name, name)} was not evaluated**: "
                     f"{r.get('not_evaluated')}", "  ")
           for name, r in runs.items() if after[name] is None]

    if q and lo:
        side = _side(q[held], lo[held], n)
        head = {0: "The NF4 base costs nothing measurable here.",
                1: "The NF4 base costs nothing here.",
                -1: "The NF4 base costs accuracy here."}[side]
        verb = {0: "as well as", 1: "better than", -1: "less well than"}[side]
        weights = _times(mem["qlora"]["measured"]["weights"], mem["lora"]["measured"]["weights"],
                         less="smaller", more="larger", same="the same size")
        out.append(paragraph(
            f"- **{head}** QLoRA-MoE learns `{held}` {verb} LoRA on the float MoE "
            f"({q[held]:.2f} against {lo[held]:.2f}, {_noise(side, n)}), with weights in "
            f"memory {weights} (adapters included; table below).", "  "))

    if q and d:
        side = _side(d[held], q[held], n)
        verb = {0: "as well as", 1: "better than", -1: "less well than"}[side]
        active = moe.top_k * moe.d_ff
        width = ("a wider" if dense.d_ff > active else "a narrower" if dense.d_ff < active
                 else "an equally wide")
        same = "the same" if dense.n_embd == moe.n_embd else "a different"
        mean_d = sum(d[t] for t in others) / len(others)
        mean_q = sum(q[t] for t in others) / len(others)
        side_p = _side(mean_d, mean_q, n * len(others))
        ends = {0: "level with", 1: "above", -1: "below"}[side_p]
        out.append(paragraph(
            f"- **The dense model learns `{held}` {verb} QLoRA-MoE in "
            f"{cfg['train']['steps']} steps** ({d[held]:.2f} against {q[held]:.2f}, "
            f"{_noise(side, n)}). It has {same} embedding width ({dense.n_embd}) and one "
            f"{dense.d_ff}-wide MLP instead of {moe.n_experts} experts of {moe.d_ff} with "
            f"{moe.top_k} active, so each token sees {width} MLP ({dense.d_ff} against "
            f"{active} active units). On the pretraining tasks it ends {ends} QLoRA-MoE (mean "
            f"{mean_d:.2f} against {mean_q:.2f}); its base was not scored here, so this compares "
            "where the two end, not how much each forgot.", "  "))

    if q:
        worst = max(others, key=lambda t: before[t] - q[t])
        side = _side(q[worst], before[worst], n)
        head = ("Forgetting is real at these steps." if side == -1 else
                "No pretraining task dropped by more than two standard errors at these steps.")
        move = "drops" if q[worst] < before[worst] else "goes"
        ends = [f"{RUN_LABELS[name]} ends at {after[name][worst]:.2f}"
                for name in ("lora_moe", "dense_qlora") if after.get(name)]
        tail = (f"; {' and '.join(ends)} (their bases were not scored here)" if ends else "")
        out.append(paragraph(
            f"- **{head}** With {cfg['replay_per_task']:,} replay examples of each pretraining "
            f"task, `{worst}` {move} from {before[worst]:.2f} to {q[worst]:.2f} on QLoRA-MoE"
            f"{tail}. Experiment 05 shows what more replay buys.", "  "))

    r = runs.get("qlora_moe_rw")
    if r is not None and rw:
        out.append(_reward_bullet(r, rw, q, before, cfg))
    return out


def _reward_bullet(r: dict, rw: dict, q: dict | None, before: dict, cfg: dict) -> str:
    held, n, reward = cfg["held_out"], cfg["eval_n"], cfg["reward"]
    others = [t for t in tasks.TASKS if t != held]
    n_samples = len(train_examples(cfg)) * reward["samples_per_prompt"]
    learned = _side(rw[held], before[held], n) == 1
    head = (f"Reward-weighted SFT learned `{held}` ({before[held]:.2f} → {rw[held]:.2f})."
            if learned else "Reward-weighted SFT learned nothing new.")
    per = r.get("exact_samples_per_task")
    stayed = "stayed at" if rw[held] == before[held] else f"went from {before[held]:.2f} to"
    first = (f"Of {n_samples:,} samples, {r['exact_samples']:,} were exact, and the mean "
             f"reward was {r['mean_reward']:.2f}.")
    if per is None:
        first += (" This record does not split them by task (`exact_samples_per_task` is "
                  f"recorded from the next run on), so whether any `{held}` sample was right "
                  f"is not recorded here; `{held}` {stayed} {rw[held]:.2f}.")
    else:
        split = ", ".join(f"{per[t]:,} `{t}`" for t in tasks.TASKS if per.get(t))
        if split:
            first += f" The exact ones by task: {split}."
        if per.get(held, 0) == 0:
            first += f" Not one `{held}` sample was right, so `{held}` {stayed} {rw[held]:.2f}."
        else:
            first += f" {per[held]:,} `{held}` samples were right."
    moved = {t: rw[t] - before[t] for t in others}
    biggest = max(others, key=lambda t: abs(moved[t]))
    kept = all(_side(rw[t], before[t], n) == 0 for t in others)
    second = ("Reward weighting can only amplify what the model already samples"
              + (f", and it kept the pretraining tasks where they were (the largest change, "
                 f"{moved[biggest]:+.2f} on `{biggest}`, is within two standard errors)."
                 if kept else
                 f"; the pretraining tasks moved, most `{biggest}` ({before[biggest]:.2f} → "
                 f"{rw[biggest]:.2f})."))
    third = ""
    if q:
        third = (f"Plain SFT on gold answers reached {q[held]:.2f} on `{held}` in the same "
                 "steps. To reach a task the model cannot yet do, reward-weighted training "
                 "needs a policy that sometimes succeeds. "
                 "[Experiment 12](../12-grpo/REPORT.md) measures what does learn from a reward: "
                 "per-group weights and GRPO from a short supervised warm start.")
    lines = [paragraph(
        f"- **{head}** The fresh QLoRA model sampled {reward['samples_per_prompt']} answer"
        f"{'s' if reward['samples_per_prompt'] > 1 else ''} per training prompt at temperature "
        f"{reward['temperature']:g}. The reward was 1 for an exact answer, and otherwise half "
        "the fraction of positions right. The loss was weighted by the normalized rewards "
        "(`minituner.reward_weights`: the worst-rewarded example gets weight 0, the mean is 1).",
        "  ")]
    lines += [paragraph(f"  - {text}", "    ") for text in (first, second, third) if text]
    return "\n".join(lines)


def _routing(metrics: dict, cfg: dict) -> str:
    held = cfg["held_out"]
    after = metrics["runs"]["qlora_moe"].get("routing_after")
    if after is None:
        return "No routing was measured after fine-tuning: the model was not evaluated."
    figure = "![routing](routing.png)\n\n"
    before = metrics["before"]["routing"]
    i = list(before).index(held)
    b, a = _share(before)[i], _share(after)[i]
    if before[held] == after[held]:
        return figure + paragraph(f"The routers were frozen, and the routing of `{held}` did "
                                  "not move.")
    e = int((a - b).abs().argmax())
    way = "up" if a[e] > b[e] else "down"
    return figure + paragraph(
        "The routers were frozen, and still the routing moved. A router reads its block's "
        "input, and the attention adapters and the experts below it changed that input. After "
        f"fine-tuning, `{held}` sends {a[e] * 100:.0f} % of its slots (all layers) to expert "
        f"{e}, {way} from {b[e] * 100:.0f} %, the largest change of any expert.")


def _norms(metrics: dict) -> str:
    norms = metrics["runs"]["qlora_moe"]["lora_norms"]
    experts = {name: v for name, v in norms.items() if len(v) > 1}
    attn = {name: v[0] for name, v in norms.items() if len(v) == 1}
    n_exp = len(next(iter(experts.values())))
    sums = [sum(v[e] for v in experts.values()) for e in range(n_exp)]
    hi = max(range(n_exp), key=sums.__getitem__)
    lo = min(range(n_exp), key=sums.__getitem__)
    spread = (f"expert {hi}'s update ({sums[hi]:.1f}) is {sums[hi] / sums[lo]:.1f}× expert "
              f"{lo}'s ({sums[lo]:.1f}), the largest against the smallest" if sums[lo] > 0 else
              f"expert {hi}'s update is {sums[hi]:.1f} and expert {lo} did not move")
    if not all(math.isfinite(x) for x in sums):
        spread = "the updates are not all finite"
    top = sorted(attn, key=attn.get, reverse=True)[:2]
    text = paragraph(
        "The figure and the tables show ‖s·B_e·A_e‖_F per expert for every expert projection, "
        "read from the saved adapter: `python -m minituner.lora_norms "
        "experiments/11-qlora-moe/adapter_qlora_moe --grid` prints these tables. Summed over "
        f"the {len(experts)} expert projections, {spread}. Each expert has its own adapter, so "
        "how far it moves is set by the tokens routed to it. Among the attention adapters, "
        + " and ".join(f"`{name}` ({attn[name]:.1f})" for name in top) + " moved most.")
    return grid([TargetNorms(name, v) for name, v in norms.items()]) + "\n\n" + text


def _memory(metrics: dict, cfg: dict) -> str:
    mem = metrics["memory"]
    regimes = [r for r in REGIME_LABELS if r in mem]
    tokens = mem["qlora"]["tokens"]
    intro = paragraph(
        "Weights, gradients and AdamW state were counted tensor by tensor after "
        f"{cfg['memory']['steps']} step{'s' if cfg['memory']['steps'] > 1 else ''} "
        "(`minituner.memory.held_bytes`). Activations were counted as the bytes one forward and "
        "its loss keep for the backward (`minituner.saved_activation_bytes` with the targets, "
        "plus the id tensors autograd keeps), for batch "
        f"{cfg['memory']['batch_size']} = {tokens} tokens, without checkpointing. "
        "\"Predicted\" is `minituner.memory.predict_training` from the model's shape and the "
        "token count alone.")
    rows = [[REGIME_LABELS[r]] + [f"{mem[r]['measured'][p] / MB:.2f}" for p in PARTS]
            + [f"{mem[r]['measured']['total'] / MB:.3f}",
               f"{mem[r]['predicted']['total'] / MB:.3f}",
               f"{mem[r]['measured']['total'] / mem[r]['predicted']['total']:.4f}"]
            for r in regimes]
    mem_table = table(["regime", "weights", "grads", "Adam", "activations", "total (measured)",
                       "total (predicted)", "measured / predicted"], rows)
    off = max(abs(mem[r]["measured"]["total"] / mem[r]["predicted"]["total"] - 1)
              for r in regimes)
    exact = [name for part, name in (("weights", "weights"), ("grads", "gradients"))
             if all(mem[r]["measured"][part] == mem[r]["predicted"][part] for r in regimes)]
    adam = {r: mem[r]["measured"]["optimizer"] - mem[r]["predicted"]["optimizer"]
            for r in regimes}
    tensors = metrics["triton_check"]["tensors"]     # the QLoRA model's trained tensors
    if all(v == 0 for v in adam.values()):
        exact.append("Adam state")
        adam_text = ""
    else:
        adam_text = ("; Adam state is off by " + ", ".join(f"{adam[r]:,}" for r in regimes)
                     + " bytes")
        if adam["qlora"] == 4 * tensors and all(v % 4 == 0 for v in adam.values()):
            adam_text += (f" (4 bytes per trained tensor, {tensors} in the QLoRA model: "
                          "AdamW's step counter)")
    bullets = [paragraph(
        f"- **The predictor matches every row to {off * 100:.2g} %.** "
        + (" and ".join(exact).capitalize() + " are exact" if exact else "Nothing is exact")
        + adam_text + ". The activation count is the MoE model in `minituner.memory`, built on "
        "minimoe's own account of what its MLP saves (`minimoe.saved_per_token`): per token and "
        "MoE layer, the routing tensors, and per routed slot what each regime's expert path "
        "keeps. `tests/minituner/test_memory.py::test_moe_activation_bytes_match_the_ledger` "
        "checks it against the storage ledger.", "  ")]
    total = {r: mem[r]["measured"]["total"] for r in regimes}
    weights = {r: mem[r]["measured"]["weights"] for r in regimes}
    bullets.append(paragraph(
        f"- **QLoRA holds {_times(total['qlora'], total['full'])} than full fine-tuning and "
        f"{_times(total['qlora'], total['lora'])} than LoRA** ({total['qlora'] / MB:.1f} "
        f"against {total['full'] / MB:.1f} and {total['lora'] / MB:.1f} MiB). Its weights are "
        f"{_times(weights['qlora'], weights['lora'], 'smaller', 'larger', 'the same size')} "
        f"than LoRA's ({weights['lora'] / MB:.2f} → {weights['qlora'] / MB:.2f} MiB, adapters "
        "included).", "  "))
    act_q, act_l = (mem[r]["measured"]["activations"] for r in ("qlora", "lora"))
    fewer = "fewer" if act_q < act_l else "more" if act_q > act_l else "as many"
    why = (" The NF4 experts must be dequantized to run, but each expert linear is "
           "checkpointed: its compact float copy (`[n_active, in, out]`) is not kept for the "
           "backward but dequantized again there, as bitsandbytes does for a dense 4-bit layer. "
           "The same checkpoint drops the gathered inputs and x·Aᵀ that LoRA on float experts "
           "keeps. It is not free: the backward recomputes the expert linears, dequantization "
           "included; that time is not measured here." if act_q < act_l else "")
    bullets.append(paragraph(
        f"- **QLoRA keeps {fewer} activations than LoRA** ({act_q / MB:.1f} against "
        f"{act_l / MB:.1f} MiB).{why}", "  "))
    ck = mem["checkpointing"]
    ck_rows = [[label, f"{ck[f'{key}_off'] / MB:.2f}", f"{ck[f'{key}_on'] / MB:.2f}",
                f"{ck[f'{key}_off'] / ck[f'{key}_on']:.3g}×"]
               for label, key in (("kept by the forward (measured)", "activations"),
                                  ("peak over forward + backward (measured)", "peak"),
                                  ("predicted peak of saved activations", "predicted"))]
    ck_table = "\n".join("  " + line
                         for line in table(["", "off", "on", "ratio"], ck_rows).splitlines())
    kept, peak = (ck[f"{k}_off"] / ck[f"{k}_on"] for k in ("activations", "peak"))
    per = cfg["train"]["checkpoint_every"] or 1
    ck_text = paragraph(
        "  The measured peak (`minituner.peak_step_bytes`) counts everything alive at any "
        "operator: saved activations, gradients, and the backward's temporaries, including the "
        "recomputed block and its transient dequantized experts. The prediction counts only the "
        f"block inputs and one block's saved activations. At {tokens} tokens, those temporaries "
        f"are {'a large part' if peak < kept else 'a small part'} of the peak, so the peak "
        f"{'falls' if peak > 1 else 'does not fall'} by {peak:.3g}× where what the forward "
        f"keeps falls by {kept:.3g}×. The forward then keeps one d_model vector per token per "
        "segment instead of a whole block's activations, so the saving should grow with depth "
        "(not measured here).", "  ")
    bullets.append(paragraph(
        f"- **Gradient checkpointing** ({per} block{'s' if per > 1 else ''} per segment) on "
        "the QLoRA model:", "  ") + f"\n\n{ck_table}\n\n{ck_text}")
    return f"{intro}\n\n{mem_table}\n\n![memory](memory.png)\n\n" + "\n".join(bullets)


def _scale(metrics: dict, cfg: dict) -> str:
    ex, e = metrics["extrapolate"], cfg["extrapolate"]
    names = [m for m in SCALE_MODELS if m in ex]
    bits = e["weight_bits"]
    intro = paragraph(
        "The same predictor on the published configurations (`minituner.memory`), whose "
        "parameter counts it gives as "
        + " and ".join(f"{ex[m]['params'] / GB:.1f} B ({SCALE_MODELS[m][0]})" for m in names)
        + f". The base is {bits}-bit outside NF4; LoRA r={e['r']} on every projection and "
        "every expert; float32 adapters, gradients and Adam state; activations for "
        f"{e['tokens']} tokens in {bits} bits with gradient checkpointing.")
    rows = []
    labels = {"full": f"full, {bits}-bit", "lora": f"LoRA, {bits}-bit base", "qlora": "**QLoRA**"}
    for m in names:
        label, shape = SCALE_MODELS[m]
        for i, regime in enumerate(r for r in labels if r in ex[m]):
            p = ex[m][regime]
            total = f"{p['total'] / GB:.2f}"
            rows.append([f"{label} (E={shape.n_experts}, top-{shape.top_k})" if i == 0 else "",
                         labels[regime]] + [f"{p[part] / GB:.2f}" for part in PARTS]
                        + [f"**{total}**" if regime == "qlora" else total])
    scale_table = table(["model", "regime", "weights", "grads", "Adam", "activations", "total"],
                        rows)

    def gpu(gb: float) -> str:
        fits = [g for g in GPU_SIZES_GB if gb <= g]
        return (f"fits one {fits[0]} GB GPU" if fits
                else f"needs more than one {GPU_SIZES_GB[-1]} GB GPU")

    fit = " ".join(
        f"QLoRA of {SCALE_MODELS[m][0]} needs {ex[m]['qlora']['total'] / GB:.1f} GB and "
        f"{gpu(ex[m]['qlora']['total'] / GB)}, where LoRA on a {bits}-bit base needs "
        f"{ex[m]['lora']['total'] / GB:.1f} GB." for m in names)
    acts = " and ".join(f"{ex[m]['qlora']['activations'] / GB:.2f} GB "
                        f"({100 * ex[m]['qlora']['activations'] / ex[m]['qlora']['weights']:.1f}"
                        " % of the QLoRA weights)" for m in names)
    fit_text = paragraph(f"{fit} With checkpointing, {e['tokens']} tokens of activations take "
                         f"{acts}.")
    p, pc = ex["llama-65b"], e["qlora_paper"]
    q = p["qlora"]
    total = q["total"] / GB
    paper = paragraph(
        "**Sanity check against the QLoRA paper.** The paper fine-tunes LLaMA-65B on one "
        f"{PAPER_GPU_GB} GB GPU. The predictor was run with the paper's setting: r={pc['r']} on "
        f"every projection, {pc['lora_bits']}-bit adapters, gradient checkpointing, "
        f"{pc['tokens']} tokens. It gives weights {q['weights'] / GB:.2f}, gradients "
        f"{q['grads'] / GB:.2f}, Adam {q['optimizer'] / GB:.2f} and activations "
        f"{q['activations'] / GB:.2f}, a total of **{total:.1f} GB, "
        f"{'under' if total < PAPER_GPU_GB else 'over'} {PAPER_GPU_GB} GB**. With the paper's "
        "paged optimizer, whose state sits in CPU memory, the total is "
        f"{p['gpu_total_paged_optimizer'] / GB:.1f} GB.")
    return f"{intro}\n\n{scale_table}\n\n{fit_text}\n\n{paper}"


def _diverged(metrics: dict) -> str:
    runs = metrics["runs"]
    stopped = {name: r["stopped_early"] for name, r in runs.items() if r["stopped_early"]}
    if not stopped:
        outcome = (f"In the run above, all {len(runs)} runs finished with "
                   "`stopped_early: null`.")
    else:
        outcome = "In the run above, " + "; ".join(
            f"{name} stopped at step {s['step']} ({s['reason']} in `{s['tensor']}`)"
            for name, s in stopped.items()) + "."
    return paragraph(
        "The trainer's NaN guard stops a run at the first non-finite loss, gradient or "
        "parameter, and at a forward that refuses NaN (the MoE router raises on NaN logits). "
        "`metrics.json` and the manifest then record, per run, `stopped_early`: the step, the "
        "tensor and the reason; a model that can no longer be evaluated gets `not_evaluated` "
        "instead of scores. "
        "`tests/experiments/test_experiments_finetune.py::"
        "test_11_diverging_run_is_stopped_and_recorded` "
        f"runs this experiment with a diverging learning rate to check it. {outcome}")


def write_report(metrics: dict, cfg: dict, ctx: RunContext) -> None:
    """REPORT.md from this run's metrics, config and timings (and the base checkpoints'
    shapes): every number computed, every comparison worded from the numbers it compares."""
    held = cfg["held_out"]
    moe = load_checkpoint(base_path("moe")).config
    dense = load_checkpoint(base_path("dense")).config
    trained = metrics["memory"]["qlora"]["measured"]["grads"] // 4
    order = [t for t in tasks.TASKS if t != held] + [held]
    score_rows = [_score_row("QLoRA-MoE before fine-tuning", metrics["before"]["qlora_moe"],
                             order, held)]
    score_rows += [_score_row(RUN_LABELS.get(name, name), r["exact_match_after"], order, held)
                   for name, r in metrics["runs"].items()]
    scores = table(["model"] + [f"**{t}** (held out)" if t == held else t for t in order],
                   score_rows)
    text = f"""# Experiment 11: QLoRA on MiniGPT-MoE

{_header(cfg, ctx)}

**The setup.**
{_setup(metrics, cfg, moe, trained)}

{_triton(metrics, cfg)}

## What it learned, and what it forgot (exact match, {cfg['eval_n']} eval examples per task)

{scores}

![loss curves](curves.png)

{chr(10).join(_findings(metrics, cfg, moe, dense))}

## Routing before and after, and which experts learned

{_routing(metrics, cfg)}

![LoRA norms](lora_norms.png)

{_norms(metrics)}

## Memory at MiniGPT-MoE scale (MiB)

{_memory(metrics, cfg)}

## At real scale (predicted, GB = 1e9 bytes)

{_scale(metrics, cfg)}

## What this experiment does not show
{paragraph("- **GPU timing.** These runs are on the CPU; the Triton path was checked for "
           "correctness only.", "  ")}
{paragraph("- **An activation count for the Triton dispatch.** The predictor counts what the "
           "PyTorch dispatch keeps, the path these runs use. On the Triton kernels QLoRA keeps "
           "the same bytes, while full fine-tuning and LoRA keep less: their autograd Function "
           "saves the MLP input once instead of gathered copies "
           "(`tests/minituner/test_memory.py::test_moe_activation_bytes_on_the_triton_dispatch`"
           ").", "  ")}
{paragraph("- **Expert LoRA in the PEFT adapter format.** PEFT has no stacked-expert layer, so "
           "the adapters here are not saved in PEFT format.", "  ")}

## When a run diverges
{_diverged(metrics)}
"""
    ctx.output("REPORT.md").write_text(text)
