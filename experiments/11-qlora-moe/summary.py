"""RESULTS.md's section on experiment 11 (the capstone, QLoRA on MiniGPT-MoE), made from its
manifest.

`python -m labkit readme` puts what `readme(manifest)` returns in this experiment's block of
RESULTS.md. Only `make readme` reads this file; experiment.py does not import it.
"""

from __future__ import annotations

from labkit.readme import paragraph, table

MIB, GB = 2**20, 1e9
# RESULTS.md's names for the runs and models experiment.py records.
RUNS = {"qlora_moe": "QLoRA on the NF4 MoE", "lora_moe": "LoRA on the float MoE",
        "dense_qlora": "dense QLoRA (experiment 06's recipe)",
        "qlora_moe_rw": "QLoRA-MoE, reward-weighted SFT on its own samples"}
MODELS = {"mixtral-8x7b": "Mixtral-8x7B", "qwen3-30b-a3b": "Qwen3-30B-A3B"}
# Why a run's row reads as it does, where the numbers alone would mislead; shown under the table.
NOTES = {"qlora_moe_rw": (
    "The reward-weighted row learns nothing: none of the model's own `{held}` samples is "
    "right (experiment 12 measures the MoE base's pass@8 on `{held}` at 0.00), so the "
    "weights only re-teach what it already does. "
    "[Experiment 12](#from-reward-weighted-sft-to-grpo-experiment-12) measures what does "
    "learn from a reward: per-group weights and GRPO, from a short supervised warm start.")}
# Runs that start from the model metrics["before"] measured (the fresh NF4 MoE with LoRA);
# the others start from another base, whose score before is not recorded here.
FROM_BEFORE = ("qlora_moe", "qlora_moe_rw")
PAPER = "llama-65b"
PAPER_GPU_GB = 48        # the QLoRA paper fine-tunes LLaMA-65B on one 48 GB GPU
BILL = {"weights": "weights", "grads": "gradients", "optimizer": "Adam state"}


def scientific(x: float) -> str:
    """1.6577e-06 -> "1.7e-6"."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def forgotten(metrics: dict, held_out: str) -> str:
    """The pretraining task the QLoRA-MoE run lost most of: the column that shows forgetting."""
    before = metrics["before"]["qlora_moe"]
    # A run the NaN guard stopped has no scores after: then no task leads, the first is shown.
    after = metrics["runs"]["qlora_moe"]["exact_match_after"] or before
    return max((t for t in before if t != held_out), key=lambda t: before[t] - after[t])


def in_order(names, known: dict) -> list[str]:
    """RESULTS.md's order (a manifest stores its keys sorted), then any name it does not know."""
    return [n for n in known if n in names] + sorted(n for n in names if n not in known)


def cell(name: str, task: str, metrics: dict) -> str:
    after = metrics["runs"][name]["exact_match_after"]
    if after is None:                       # a run the NaN guard stopped is not evaluated
        return "not evaluated"
    if name in FROM_BEFORE:
        return f"{metrics['before']['qlora_moe'][task]:.2f} → {after[task]:.2f}"
    return f"{after[task]:.2f}"


def intro(manifest: dict) -> str:
    cfg, metrics = manifest["config"], manifest["metrics"]
    train = cfg["train"]
    experts = len(next(iter(metrics["before"]["routing"].values()))[0])
    aids = [name for name, on in (("element-wise gradient clipping", train.get("grad_clip_value")),
                                  ("gradient checkpointing", train.get("checkpoint_every"))) if on]
    return paragraph(
        f"The MoE base goes to NF4 in its attention and in all {experts} experts of every block, "
        f"with LoRA r={cfg['lora']['r']} on attention and on each expert. It is fine-tuned "
        f"{train['steps']} steps on the held-out task"
        f"{', with ' + ' and '.join(aids) if aids else ''} "
        "([11 report](experiments/11-qlora-moe/REPORT.md)). Exact match on "
        f"`{cfg['held_out']}`, {cfg['eval_n']} prompts, same data, steps and seed for every row "
        "(the scores before are the NF4 MoE's, where the QLoRA-MoE runs start):")


def runs_table(manifest: dict) -> str:
    metrics, held_out = manifest["metrics"], manifest["config"]["held_out"]
    forgot = forgotten(metrics, held_out)
    rows = [[RUNS.get(name, name), cell(name, held_out, metrics), cell(name, forgot, metrics)]
            for name in in_order(metrics["runs"], RUNS)]
    notes = [paragraph(NOTES[name].format(held=held_out))
             for name in in_order(metrics["runs"], RUNS) if name in NOTES]
    return "\n\n".join([table(["run", f"{held_out} before → after",
                                f"{forgot} after (forgetting)"], rows), *notes])


def exactness(memory: dict) -> str:
    """How closely the predictor gives each held item: "weights and gradients to the byte,
    Adam state to within N bytes"."""
    regimes = [memory[r] for r in ("full", "lora", "qlora")]
    worst = {part: max(abs(r["measured"][part] - r["predicted"][part]) for r in regimes)
             for part in BILL}
    exact = [BILL[part] for part, bytes_off in worst.items() if bytes_off == 0]
    phrases = [" and ".join(exact) + " to the byte"] if exact else []
    phrases += [f"{BILL[part]} to within {bytes_off:,} bytes"
                for part, bytes_off in worst.items() if bytes_off]
    return ", ".join(phrases)


def memory_bullet(memory: dict) -> str:
    total = {r: memory[r]["measured"]["total"] / MIB for r in ("full", "lora", "qlora")}
    weights = {r: memory[r]["measured"]["weights"] / MIB for r in ("lora", "qlora")}
    off = max(abs(memory[r]["measured"]["total"] / memory[r]["predicted"]["total"] - 1)
              for r in ("full", "lora", "qlora"))
    return paragraph(
        f"- **Memory.** At {memory['qlora']['tokens']} tokens QLoRA holds {total['qlora']:.1f} "
        f"MiB against {total['lora']:.1f} for LoRA and {total['full']:.1f} for full "
        f"fine-tuning; the base weights are {weights['lora'] / weights['qlora']:.1f}× smaller "
        f"({weights['lora']:.2f} → {weights['qlora']:.2f} MiB). `predict_training` gives every "
        f"total from the shape and token count to within {off * 100:.2g} % "
        f"({exactness(memory)}, activations by a per-token count for the MoE layers).", "  ")


def factor(off: float, on: float) -> tuple[str, str]:
    """("cuts", "10.5×") for what checkpointing did to a count, or ("raises", ...)."""
    return ("cuts" if on <= off else "raises"), f"{max(off, on) / min(off, on):.3g}×"


def activations_bullet(memory: dict) -> str:
    qlora, lora = (memory[r]["measured"]["activations"] for r in ("qlora", "lora"))
    fewer = "fewer" if qlora < lora else "more" if qlora > lora else "as many"
    why = (": the NF4 experts are dequantized again in the backward instead of kept"
           if qlora < lora else "")
    ck = memory["checkpointing"]
    (kept_verb, kept), (peak_verb, peak) = (factor(ck["activations_off"], ck["activations_on"]),
                                            factor(ck["peak_off"], ck["peak_on"]))
    effect = (f"{kept_verb} what the forward keeps {kept} and "
              f"{'' if peak_verb == kept_verb else peak_verb + ' '}the step's measured peak {peak}")
    return paragraph(
        f"- **Activations.** QLoRA keeps {fewer} than LoRA ({qlora / MIB:.1f} against "
        f"{lora / MIB:.1f} MiB){why}. Checkpointing {effect} "
        f"({ck['peak_off'] / MIB:.1f} → {ck['peak_on'] / MIB:.1f} MiB).", "  ")


def real_models_bullet(manifest: dict) -> str:
    ex, cfg = manifest["metrics"]["extrapolate"], manifest["config"]["extrapolate"]
    models = in_order([name for name in ex if name != PAPER], MODELS)
    first, rest = models[0], models[1:]
    named = [f"{MODELS.get(first, first)} at {ex[first]['qlora']['total'] / GB:.1f} GB "
             f"({cfg['tokens']} tokens with checkpointing; {ex[first]['full']['total'] / GB:.1f} "
             f"GB for a {cfg['weight_bits']}-bit full fine-tune)"]
    named += [f"{MODELS.get(m, m)} at {ex[m]['qlora']['total'] / GB:.1f} GB" for m in rest]
    paper = ex[PAPER]["qlora"]["total"] / GB
    return paragraph(
        f"- **Real models.** The same predictor puts QLoRA of {' and '.join(named)}. It puts the "
        f"QLoRA paper's 65B setting at {paper:.1f} GB, "
        f"{'under' if paper < PAPER_GPU_GB else 'over'} the paper's {PAPER_GPU_GB} GB GPU.", "  ")


def triton_bullet(manifest: dict) -> str:
    device = manifest["env"].get("device", "cpu")
    how = "interpreter" if device == "cpu" else f"compiled, {device}"
    diff = manifest["metrics"]["triton_check"]["max_rel_grad_diff"]
    return paragraph(
        f"- **Triton check.** One training step on the Triton kernels ({how}) matches the "
        f"PyTorch MoE path to {scientific(diff)} in every gradient.", "  ")


def readme(manifest: dict) -> str:
    memory = manifest["metrics"]["memory"]
    bullets = [memory_bullet(memory), activations_bullet(memory), real_models_bullet(manifest),
               triton_bullet(manifest)]
    return f"{intro(manifest)}\n\n{runs_table(manifest)}\n\n" + "\n".join(bullets) + "\n"
