"""RESULTS.md's paragraphs and memory table on experiment 06 (QLoRA preview), made from its
manifest.

`python -m labkit readme` puts what `readme(manifest)` returns in this experiment's block of
RESULTS.md (the second half of the section it shares with experiment 05, whose adapter it
loads). Only `make readme` reads this file; experiment.py does not import it.
"""

from __future__ import annotations

from labkit.readme import paragraph, table

MIB, GIB = 2**20, 2**30
PARTS = ("weights", "grads", "optimizer", "activations")
# RESULTS.md's names for the rows experiment.py records under metrics["memory"].
MINIGPT_ROWS = {"LoRA, float32 base": "LoRA on float32", "QLoRA, NF4 base": "QLoRA on NF4"}
NUMBERS = {1: "one", 2: "two", 3: "three", 4: "four", 5: "five"}


def float_name(bits: int) -> str:
    return {16: "bf16", 32: "float32"}.get(bits, f"{bits}-bit")


def part_name(part: str, weight_bits: int | None = None) -> str:
    """How a sentence names one item of a memory bill."""
    if part == "weights" and weight_bits is not None:
        return f"the {weight_bits}-bit weights"
    return {"weights": "the weights", "grads": "the gradients", "optimizer": "the AdamW state",
            "activations": "the activations"}[part]


def parity_sentence(manifest: dict) -> str:
    cfg, par = manifest["config"], manifest["metrics"]["parity"]
    tol = cfg["logit_tolerance"]["mean_abs_diff_rel"]
    met = par["mean_abs_diff"] <= tol * par["mean_abs_logit"]
    changed = max(abs(par["exact_match_float_base"][t] - par["exact_match_nf4_base"][t])
                  for t in par["exact_match_float_base"])
    steps = cfg["memory"]["steps"]
    return paragraph(
        f"The same `{cfg['adapters'][0][0]}` adapter on an NF4 copy of the base "
        "([06 report](experiments/06-qlora-preview/REPORT.md)) moves the logits by "
        f"{par['mean_abs_diff']:.3f} on average (mean |logit| {par['mean_abs_logit']:.2f}; "
        f"{'tolerance' if met else 'over its tolerance of'} {tol * 100:g} %), keeps "
        f"{par['argmax_agreement']:.1%} of the argmaxes, and changes no task's exact match by "
        f"more than {changed:.3f}. Memory, measured after {NUMBERS.get(steps, steps)} AdamW "
        f"steps (batch {cfg['memory']['batch_size']}) and predicted by "
        "`minituner.memory.predict_training`:")


def memory_table(manifest: dict) -> str:
    metrics, bits = manifest["metrics"], manifest["config"]["extrapolate"]["weight_bits"]
    llama = {"full": "full", "lora": f"LoRA on {float_name(bits)}", "qlora": "QLoRA"}
    rows = [[f"MiniGPT, {MINIGPT_ROWS.get(name, name)} (MiB)",
             *(f"{row['measured'][p] / MIB:.2f}" for p in (*PARTS, "total"))]
            for name, row in metrics["memory"].items()]
    rows += [[f"LLaMA-7B, {llama.get(regime, regime)}, predicted (GiB)",
              *(f"{bill[p] / GIB:.1f}" for p in (*PARTS, "total"))]
             for regime, bill in metrics["llama_7b"].items()]
    return table(["", "weights", "grads", "Adam", "activations", "total"], rows)


def small_model_clause(memory: dict) -> str:
    """What decides MiniGPT's bill: "activations dominate and QLoRA saves 6 % of the total"."""
    lora, qlora = (memory[name]["measured"] for name in MINIGPT_ROWS)
    top = max(PARTS, key=lora.get)
    who = ("activations dominate" if top == "activations" and lora[top] > lora["total"] / 2
           else f"{part_name(top)} are the largest item")
    saving = 1 - qlora["total"] / lora["total"]
    return (f"At MiniGPT's size {who} and QLoRA {'saves' if saving >= 0 else 'adds'} "
            f"{abs(saving):.0%} of the total")


def notes(manifest: dict) -> str:
    ex, big = manifest["config"]["extrapolate"], manifest["metrics"]["llama_7b"]
    top = max(PARTS, key=big["lora"].get)
    return paragraph(
        f"(7B: {float_name(ex['weight_bits'])} weights outside NF4, {ex['tokens']} tokens a step "
        f"with {float_name(ex['act_bits'])} activations, float32 gradients, AdamW state and "
        f"LoRA factors.) {small_model_clause(manifest['metrics']['memory'])}; at 7B "
        f"{part_name(top, ex['weight_bits'])} are the largest item of LoRA's bill, and NF4 "
        f"takes the total from {big['lora']['total'] / GIB:.1f} to "
        f"{big['qlora']['total'] / GIB:.1f} GiB.")


def readme(manifest: dict) -> str:
    return f"{parity_sentence(manifest)}\n\n{memory_table(manifest)}\n\n{notes(manifest)}\n"
