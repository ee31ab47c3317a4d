"""REPORT.md of experiment 11, made from a manifest: tables of its recorded numbers, and fixed
text that says what was run and how to read them.

`report(manifest)` reads the manifest's `config`, `metrics` and `timings` (and the shapes of
the base checkpoints it records). experiment.py calls it at the end of a run with its own;
`python -m labkit report experiments/11-qlora-moe` calls it with the committed manifest, whose
keys are sorted, so nothing here follows the order of a dict in the metrics.
"""

from __future__ import annotations

import functools
import math

from labkit.readme import prose, table
from minigpt import base_path, load_checkpoint, tasks
from minituner import TrainConfig, memory
from minituner.lora_norms import TargetNorms, grid

MB = 2**20
RUN_LABELS = {"qlora_moe": "QLoRA-MoE after SFT", "lora_moe": "LoRA on the float MoE",
              "dense_qlora": "dense QLoRA (experiment 06's recipe)",
              "qlora_moe_rw": "QLoRA-MoE, reward-weighted SFT"}
REGIME_LABELS = {"full": "full fine-tune (float)", "lora": "LoRA, float base",
                 "qlora": "QLoRA, NF4 base"}
SCALE_MODELS = {"mixtral-8x7b": ("Mixtral-8x7B", memory.MIXTRAL_8X7B),
                "qwen3-30b-a3b": ("Qwen3-30B-A3B", memory.QWEN3_30B_A3B),
                "llama-65b": ("LLaMA-65B, the QLoRA paper's setting", memory.LLAMA_65B)}
PARTS = ("weights", "grads", "optimizer", "activations")
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "w_gate", "w_up", "w_down")  # file order
GB = 1e9
GPU_SIZES_GB = (40, 48, 80)   # common data-centre GPUs (A100 40 GB, L40S, H100)


def score_rows(m: dict, order: list[str]) -> list[list[str]]:
    """Exact match per task (the held-out one last, in bold), train seconds, how a run ended."""
    def cells(s):
        return (["not evaluated"] * len(order) if s is None else
                [f"{s[t]:.2f}" if t != order[-1] else f"**{s[t]:.2f}**" for t in order])

    rows = [["QLoRA-MoE before fine-tuning", *cells(m["metrics"]["before"]["qlora_moe"]), "", ""]]
    for name, label in RUN_LABELS.items():
        r, s = m["metrics"]["runs"][name], m["metrics"]["runs"][name]["stopped_early"]
        end = (f"stopped at step {s['step']}: {s['reason']} in `{s['tensor']}`" if s
               else "finished") + (f"; {r['not_evaluated']}" if "not_evaluated" in r else "")
        rows.append([label, *cells(r["exact_match_after"]),
                     f"{m['timings'].get(f'{name}_train_s', math.nan):.1f}", end])
    return rows


def comparison_rows(metrics: dict, held: str, n: int) -> list[list[str]]:
    """a − b beside two standard errors of the difference (n prompts each)."""
    others = [t for t in tasks.TASKS if t != held]
    before = metrics["before"]["qlora_moe"]
    q, lo, d, rw = (metrics["runs"][name]["exact_match_after"] for name in RUN_LABELS)
    if None in (q, lo, d, rw):
        return []
    lost = max(others, key=lambda t: before[t] - q[t])
    moved = max(others, key=lambda t: abs(rw[t] - before[t]))
    mean_d, mean_q = (sum(s[t] for t in others) / len(others) for s in (d, q))
    rows = []
    for label, a, b, k in (
            (f"`{held}`: QLoRA-MoE − LoRA on the float MoE", q[held], lo[held], n),
            (f"`{held}`: dense QLoRA − QLoRA-MoE", d[held], q[held], n),
            ("pretraining tasks' mean: dense QLoRA − QLoRA-MoE", mean_d, mean_q, n * len(others)),
            (f"`{lost}` (most forgotten): QLoRA-MoE after − before", q[lost], before[lost], n),
            (f"`{moved}` (most moved): reward-weighted SFT − before", rw[moved], before[moved], n)):
        two_se = 2 * math.sqrt((a * (1 - a) + b * (1 - b)) / k)
        rows.append([label, f"{a:.2f}", f"{b:.2f}", f"{a - b:+.2f}", f"{two_se:.2f}",
                     "yes" if abs(a - b) > two_se else "no"])
    return rows


def routing_rows(metrics: dict, held: str) -> list[list[str]]:
    """Each expert's share (%) of the held-out task's routed slots, all layers."""
    share = {}
    for when, counts in (("before", metrics["before"]["routing"]),
                         ("after", metrics["runs"]["qlora_moe"].get("routing_after"))):
        if counts:
            slots = [sum(col) for col in zip(*counts[held], strict=True)]   # layers summed
            share[when] = [x / sum(slots) for x in slots]
    rows = [[when, *(f"{100 * x:.1f}" for x in s)] for when, s in share.items()]
    if len(share) == 2:
        rows.append(["change", *(f"{100 * (a - b):+.1f}" for a, b in
                                 zip(share["after"], share["before"], strict=True))])
    return rows


def norm_grids(metrics: dict) -> tuple[str, str]:
    """The tables `python -m minituner.lora_norms --grid` prints from the saved adapter, and
    how many times the largest expert's summed update is the smallest's."""
    norms = metrics["runs"]["qlora_moe"]["lora_norms"]
    order = sorted(norms, key=lambda n: (int(n.split(".")[1]),
                                         PROJECTIONS.index(n.rsplit(".", 1)[1])))
    sums = [sum(col) for col in zip(*(v for v in norms.values() if len(v) > 1), strict=True)]
    ratio = f"{max(sums) / min(sums):.1f}×" if min(sums) > 0 else "not finite"
    return grid([TargetNorms(name, norms[name]) for name in order]), ratio


def memory_rows(mem: dict) -> list[list[str]]:
    rows = []
    for r, label in REGIME_LABELS.items():
        got, want = mem[r]["measured"], mem[r]["predicted"]
        rows.append([label, *(f"{got[k] / MB:.2f}" for k in PARTS), f"{got['total'] / MB:.3f}",
                     f"{want['total'] / MB:.3f}", f"{got['total'] / want['total']:.4f}",
                     " / ".join(f"{got[k] - want[k]:,}" for k in PARTS[:3])])
    q = mem["qlora"]["measured"]
    return rows + [[f"{REGIME_LABELS[r]} ÷ QLoRA", *(f"{mem[r]['measured'][k] / q[k]:.1f}×"
                                                    for k in (*PARTS, "total")), "", "", ""]
                   for r in ("full", "lora")]


def checkpointing_rows(ck: dict) -> list[list[str]]:
    return [[label, f"{ck[f'{key}_off'] / MB:.2f}", f"{ck[f'{key}_on'] / MB:.2f}",
             f"{ck[f'{key}_off'] / ck[f'{key}_on']:.3g}×"]
            for label, key in (("kept by the forward (measured)", "activations"),
                               ("peak over forward + backward (measured)", "peak"),
                               ("predicted peak of saved activations", "predicted"))]


def scale_rows(ex: dict, bits: int) -> list[list[str]]:
    labels = {"full": f"full, {bits}-bit", "lora": f"LoRA, {bits}-bit base", "qlora": "**QLoRA**"}
    rows = []
    for key, (name, shape) in SCALE_MODELS.items():
        moe = f", E={shape.n_experts}, top-{shape.top_k}" if shape.n_experts else ""
        for i, regime in enumerate(r for r in labels if r in ex[key]):
            p, total = ex[key][regime], ex[key][regime]["total"] / GB
            fits = [f"{g} GB" for g in GPU_SIZES_GB if total <= g] + ["none of them"]
            rows.append([f"{name} ({ex[key]['params'] / GB:.1f} B{moe})" if i == 0 else "",
                         labels[regime], *(f"{p[k] / GB:.2f}" for k in PARTS),
                         f"**{total:.2f}**" if regime == "qlora" else f"{total:.2f}",
                         f"{100 * p['activations'] / p['weights']:.1f} %", fits[0]])
    return rows


@functools.cache
def bases() -> tuple:
    """The MoE and the dense base checkpoints' configs (the files the manifest records)."""
    return tuple(load_checkpoint(base_path(kind)).config for kind in ("moe", "dense"))


def head(m: dict) -> str:
    cfg, mem, tc = m["config"], m["metrics"]["memory"], m["metrics"]["triton_check"]
    held, train, lora, (moe, _) = cfg["held_out"], cfg["train"], cfg["lora"], bases()
    stable = TrainConfig(**train, seed=cfg["seed"])
    return f"""# Experiment 11: QLoRA on MiniGPT-MoE

Every number here is from the manifest of the run that wrote it (`manifest.json`; its metrics
are also `metrics.json`): `report.py` makes this file from the manifest's config, metrics and
timings, as tables plus fixed text, at the end of the run, and `python -m labkit report
experiments/11-qlora-moe` makes it again from the committed manifest. That manifest records
the sha256 of both base checkpoints from experiment 00 and of the training data; `python -m
labkit reproduce experiments/11-qlora-moe/manifest.json` re-runs the whole thing and
compares. Train times are wall seconds on the recording machine (the manifest's `env` says
which machine, `git` which commit, and `wall_time_s` how long the whole run took).

**The setup.** The base is the MoE MiniGPT of experiment 00, pretrained on every task except
`{held}`: {moe.n_layer} layers, d_model {moe.n_embd}, {moe.n_experts} SwiGLU experts of width
{moe.d_ff} in every block, top-{moe.top_k} routing. QLoRA-MoE quantizes the attention
projections and all experts to NF4 (blocksize {cfg["quant_scheme"].rsplit("_", 1)[-1]}, double
quantization) and holds the experts as `[{moe.n_experts}, in, out]` NF4 tensors. LoRA
(r={lora["r"]}, α={lora["alpha"]:g}) goes on q/k/v/o, and every expert gets its own
r={lora["r"]} pair in each of gate, up and down (`minimoe.attach_expert_lora`). The routers
stay float and frozen: the run trains {mem["qlora"]["measured"]["grads"] // 4:,} LoRA
parameters (the float32 gradients the memory table counts, over 4 bytes). Every run trains
{train["steps"]} steps at batch {train["batch_size"]} on {cfg["n_train"]:,} `{held}` examples
plus {cfg["replay_per_task"]:,} replay examples of each pretraining task (AdamW, lr
{train["lr"]:g}), with the same data, steps and seed, and two stabilisers (0 is off):
element-wise gradient clipping (each element to ±{stable.grad_clip_value:g}, then the global
norm to {stable.grad_clip:g}) and gradient checkpointing ({stable.checkpoint_every} block(s)
per segment).

**Which MoE path.** The long runs use the MoE's sort-based PyTorch backend, because on a CPU
the Triton kernels run in the interpreter and are very slow. To show that the Triton kernels
compute this same training, one training step of the QLoRA-MoE model (batch
{cfg["triton_check"]["batch"]}) was run on both backends:

{table(["", "loss", f"worst relative difference over {tc['tensors']} gradient tensors"],
       [["PyTorch backend", f"{tc['loss_torch']:.5f}", "—"],
        ["Triton kernels", f"{tc['loss_triton']:.5f}", f"{tc['max_rel_grad_diff']:.1e}"]])}
"""


def learned(m: dict) -> str:
    cfg, metrics, (moe, dense) = m["config"], m["metrics"], bases()
    held, reward, rw = cfg["held_out"], cfg["reward"], metrics["runs"]["qlora_moe_rw"]
    order = [t for t in tasks.TASKS if t != held] + [held]
    samples = reward["samples_per_prompt"] * (
        cfg["n_train"] + cfg["replay_per_task"] * len(tasks.PRETRAIN_TASKS))
    weights = (metrics["memory"]["lora"]["measured"]["weights"]
               / metrics["memory"]["qlora"]["measured"]["weights"])
    return f"""## What it learned, and what it forgot (exact match, {cfg["eval_n"]} eval examples \
per task)

{table(["model", *order[:-1], f"**{held}** (held out)", "train s", "run"], score_rows(m, order))}

![loss curves](curves.png)

Each comparison below is one score minus another, beside two standard errors of that
difference (√(a(1−a)/k + b(1−b)/k) for k prompts each); a difference within them is not
resolved at this size.

{table(["comparison", "a", "b", "a − b", "2 SE", "beyond 2 SE"],
       comparison_rows(metrics, held, cfg["eval_n"]))}

- **The cost of the NF4 base** is the first row: the same MoE with LoRA, on NF4 or on float
  weights, whose weights in memory are {weights:.1f}× smaller on NF4 (adapters included; the
  memory table below).
- **The dense model** has embedding width {dense.n_embd} (the MoE: {moe.n_embd}) and one
  {dense.d_ff}-wide MLP where the MoE has {moe.n_experts} experts of {moe.d_ff} with
  {moe.top_k} active, so each token sees {dense.d_ff} MLP units against
  {moe.top_k * moe.d_ff}. Its base was not scored here, so the third row compares where the
  two end, not how much each forgot.
- **Forgetting** is measured with {cfg["replay_per_task"]:,} replay examples of each
  pretraining task; LoRA on the float MoE and dense QLoRA end in the same column of the
  scores table (their bases were not scored here). Experiment 05 shows what more replay buys.

**Reward-weighted SFT.** The fresh QLoRA model sampled {reward["samples_per_prompt"]}
answer(s) per training prompt at temperature {reward["temperature"]:g}. The reward was 1 for
an exact answer, and otherwise half the fraction of positions right. The loss was weighted by
the normalized rewards (`minituner.reward_weights`: the worst-rewarded example gets weight 0,
the mean is 1). Of {samples:,} samples, with a mean reward of {rw["mean_reward"]:.2f}, these
were exact:

{table(["", *tasks.TASKS, "all"],
       [["exact samples", *(f"{rw['exact_samples_per_task'][t]:,}" for t in tasks.TASKS),
         f"{rw['exact_samples']:,}"]])}

Reward weighting can only amplify what the model already samples: a task without exact
samples has nothing to amplify, and the last comparison is how far the tasks it already does
moved. Plain SFT on gold answers is the QLoRA-MoE row, in the same steps. To reach a
task the model cannot yet do, reward-weighted training needs a policy that sometimes
succeeds. [Experiment 12](../12-grpo/REPORT.md) measures what does learn from a reward:
per-group weights and GRPO from a short supervised warm start.
"""


def experts(m: dict) -> str:
    held, metrics = m["config"]["held_out"], m["metrics"]
    n_experts = len(metrics["before"]["routing"][held][0])
    grids, ratio = norm_grids(metrics)
    return f"""## Routing before and after, and which experts learned

![routing](routing.png)

The routers were frozen, and still the routing can move: a router reads its block's input,
and the attention adapters and the experts below it change that input. Each expert's share
of the slots of `{held}` (all layers, %):

{table(["", *(f"e{i}" for i in range(n_experts))], routing_rows(metrics, held))}

![LoRA norms](lora_norms.png)

{grids}

The figure and the tables show ‖s·B_e·A_e‖_F per expert for every expert projection, read
from the saved adapter: `python -m minituner.lora_norms
experiments/11-qlora-moe/adapter_qlora_moe --grid` prints these tables. Each expert has its
own adapter, so how far it moves is set by the tokens routed to it: in the **sum** row, the
largest expert's update is {ratio} the smallest's.
"""


def memory_section(m: dict) -> str:
    cfg, mem, tc = m["config"], m["metrics"]["memory"], m["metrics"]["triton_check"]
    return f"""## Memory at MiniGPT-MoE scale (MiB)

Weights, gradients and AdamW state were counted tensor by tensor after
{cfg["memory"]["steps"]} step(s) (`minituner.memory.held_bytes`). Activations were counted as
the bytes one forward and its loss keep for the backward (`minituner.saved_activation_bytes`
with the targets, plus the id tensors autograd keeps), for batch {cfg["memory"]["batch_size"]}
= {mem["qlora"]["tokens"]} tokens, without checkpointing. "Predicted" is
`minituner.memory.predict_training` from the model's shape and the token count alone. The
last two rows divide a regime's bill by QLoRA's.

{table(["regime", "weights", "grads", "Adam", "activations", "total (measured)",
        "total (predicted)", "measured / predicted",
        "measured − predicted, bytes: weights / grads / Adam"], memory_rows(mem))}

![memory](memory.png)

- **The predictor** gives weights and gradients to the byte. It leaves out AdamW's step
  counter, 4 bytes per trained tensor ({tc["tensors"]} in the QLoRA model). The activation
  count is the MoE model in `minituner.memory`, built on minimoe's own account of what its
  MLP saves (`minimoe.saved_per_token`): per token and MoE layer, the routing tensors, and
  per routed slot what each regime's expert path keeps.
  `tests/minituner/test_memory.py::test_moe_activation_bytes_match_the_ledger` checks it
  against the storage ledger.
- **QLoRA's activations.** The NF4 experts must be dequantized to run, but each expert
  linear's compact float copy (`[n_active, in, out]`) is not kept for the backward but
  dequantized again there, as bitsandbytes does for a dense 4-bit layer. Its LoRA term is
  checkpointed, which drops the gathered inputs and x·Aᵀ that LoRA on float experts keeps
  (the gated down projection is checkpointed whole). It is not free: the backward dequantizes
  again and recomputes the LoRA terms and the down projection; that time is not measured
  here.

**Gradient checkpointing** on the QLoRA model (MiB):

{table(["", "off", "on", "ratio"], checkpointing_rows(mem["checkpointing"]))}

The measured peak (`minituner.peak_step_bytes`) counts everything alive at any operator:
saved activations, gradients, and the backward's temporaries, including the recomputed block
and its transient dequantized experts. The prediction counts only the block inputs and one
block's saved activations. The gap between the first two ratios is those temporaries, at
{mem["qlora"]["tokens"]} tokens. The forward keeps one d_model vector per token per segment
instead of a whole block's activations, so the saving should grow with depth (not measured
here).
"""


def scale(m: dict) -> str:
    e, ex = m["config"]["extrapolate"], m["metrics"]["extrapolate"]
    paper = e["qlora_paper"]
    return f"""## At real scale (predicted, GB = 1e9 bytes)

The same predictor on the published configurations (`minituner.memory`, which gives the
parameter counts). The base is {e["weight_bits"]}-bit outside NF4; LoRA r={e["r"]} on every
projection and every expert; float32 adapters, gradients and Adam state; activations for
{e["tokens"]} tokens in {e["weight_bits"]} bits with gradient checkpointing. The last row is
a sanity check: the QLoRA paper fine-tunes LLaMA-65B on one 48 GB GPU, and the predictor was
run with its setting (r={paper["r"]} on every projection, {paper["lora_bits"]}-bit adapters,
gradient checkpointing, {paper["tokens"]} tokens). The last column is the smallest of
{", ".join(f"{g} GB" for g in GPU_SIZES_GB)} GPUs that holds the total.

{table(["model", "regime", "weights", "grads", "Adam", "activations", "total",
        "activations / weights", "fits one"], scale_rows(ex, e["weight_bits"]))}

With the paper's paged optimizer, whose state sits in CPU memory, LLaMA-65B's total is
{ex["llama-65b"]["gpu_total_paged_optimizer"] / GB:.1f} GB.
"""


LIMITS = """## What this experiment does not show

- **GPU timing.** These runs are on the CPU; the Triton path was checked for correctness
  only.
- **An activation count for the Triton dispatch.** The predictor counts what the PyTorch
  dispatch keeps, the path these runs use. On the Triton kernels QLoRA keeps the same bytes,
  while full fine-tuning and LoRA keep less: their autograd Function saves the MLP input
  once instead of gathered copies
  (`tests/minituner/test_memory.py::test_moe_activation_bytes_on_the_triton_dispatch`).
- **Expert LoRA in the PEFT adapter format.** PEFT has no stacked-expert layer, so the
  adapters here are not saved in PEFT format.

## When a run diverges

The trainer's NaN guard stops a run at the first non-finite loss, gradient or parameter, and
at a forward that refuses NaN (the MoE router raises on NaN logits). `metrics.json` and the
manifest then record, per run, `stopped_early`: the step, the tensor and the reason; a model
that can no longer be evaluated gets `not_evaluated` instead of scores. The `run` column of
the scores table shows both.
`tests/experiments/test_experiments_finetune.py::test_11_diverging_run_is_stopped_and_recorded`
runs this experiment with a diverging learning rate to check it.
"""


def report(m: dict) -> str:
    """REPORT.md from a manifest: its `config`, `metrics` and `timings` are read."""
    return prose("\n".join([head(m), learned(m), experts(m), memory_section(m), scale(m),
                            LIMITS]))
