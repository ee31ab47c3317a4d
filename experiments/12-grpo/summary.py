"""RESULTS.md's section on experiment 12 (reward-weighted SFT and GRPO on the QLoRA models),
made from its manifest.

`python -m labkit readme` puts what `readme(manifest)` returns in this experiment's block of
RESULTS.md. Only `make readme` reads this file; experiment.py does not import it.
"""

from __future__ import annotations

from labkit.readme import paragraph, table

# RESULTS.md's names for the runs experiment.py records, in its order.
RUNS = {"sft": "(a) SFT on gold answers", "rw_global": "(b) reward-weighted SFT, global weights",
        "rw_group": "(c) reward-weighted SFT, per-group weights",
        "grpo": "(d) GRPO from the warm start", "grpo_cold": "(e) GRPO from the base",
        "grpo_replay": "(f) GRPO + replay", "grpo_kl": "(f) GRPO + KL to the base",
        "grpo_async": "(f) GRPO + replay, asynchronous generation",
        "grpo_partial": "(f) GRPO + replay, partial-credit reward",
        "grpo_dapo": "(g) GRPO, token-level aggregation (dapo)",
        "grpo_dr": "(g) GRPO, constant normaliser (dr_grpo)",
        "rw_file": "(h) reward-weighted SFT on data/rev_rewarded.jsonl"}
MODELS = ("dense", "moe")


def rows(manifest: dict) -> list[list[str]]:
    cfg, metrics = manifest["config"], manifest["metrics"]
    held, k = cfg["held_out"], cfg["eval"]["k"]
    out = []
    for kind in MODELS:
        start = metrics[kind]["start"]
        out.append([kind, "warm start", f"{start['base'][held]:.2f} → {start['warm'][held]:.2f}",
                    f"{start['warm'][f'{held}_pass@{k}']:.2f}", f"{start['warm']['sort']:.2f}"])
        for name in [n for n in RUNS if n in metrics[kind]["runs"]]:
            r = metrics[kind]["runs"][name]
            before = start[r["start"]][held]
            out.append([kind, RUNS[name], f"{before:.2f} → {r['after'][held]:.2f}",
                        f"{r['after'][f'{held}_pass@{k}']:.2f}", f"{r['after']['sort']:.2f}"])
    return out


def readme(manifest: dict) -> str:
    cfg = manifest["config"]
    held, k, g = cfg["held_out"], cfg["eval"]["k"], cfg["grpo"]
    intro = paragraph(
        f"Reinforcement fine-tuning of the QLoRA models with only a verifier for `{held}` "
        f"(`{cfg['reward']}` unless the row says otherwise), from experiment 11's setting "
        f"([12 report](experiments/12-grpo/REPORT.md)). GRPO samples {g['group_size']} "
        f"answers to each of {g['prompts_per_step']} prompts per iteration for {g['steps']} "
        "iterations and weights each answer by its advantage within its group. Exact match "
        f"on `{held}` (greedy, {cfg['eval']['n']} prompts), pass@{k}, and `sort` after "
        "(forgetting):")
    tbl = table(["model", "run", f"{held} before → after", f"{held} pass@{k} after",
                 "sort after"], rows(manifest))
    return f"{intro}\n\n{tbl}\n\n" + "\n".join(findings(manifest)) + "\n"


def gain(metrics: dict, kind: str, name: str) -> str:
    return f"{metrics[kind]['runs'][name]['gain']:+.2f}"


def findings(manifest: dict) -> list[str]:
    """One bullet per lesson, every number from the manifest (runs the config left out are
    skipped)."""
    cfg, m = manifest["config"], manifest["metrics"]
    held, s = cfg["held_out"], m["summary"]
    dense, moe = m["dense"]["runs"], m["moe"]["runs"]
    worst = {kind: min((t for t in m[kind]["runs"]["grpo"]["after"] if t in m[kind]["start"]
                        ["warm"] and t != held and "@" not in t),
                       key=lambda t: m[kind]["runs"]["grpo"]["after"][t]) for kind in MODELS}
    out = [paragraph(
        f"- **GRPO learns `{held}` from a reward alone, and forgets without replay.** From the "
        f"warm start it gains {s[f'{held}_gain_dense']:+.2f} (dense) and "
        f"{s[f'{held}_gain_moe']:+.2f} (MoE) in {cfg['grpo']['steps']} iterations, while "
        f"`{worst['dense']}` falls to {m['dense']['runs']['grpo']['after'][worst['dense']]:.2f} "
        f"(dense) and `{worst['moe']}` to {m['moe']['runs']['grpo']['after'][worst['moe']]:.2f}"
        f" (MoE). A replay term keeps them (`sort` {s['sort_after_dense']:.2f} and "
        f"{s['sort_after_moe']:.2f}) at a smaller gain ({gain(m, 'dense', 'grpo_replay')} and "
        f"{gain(m, 'moe', 'grpo_replay')}).", "  ")]
    if "rw_global" in dense and "rw_group" in dense:
        g, p = dense["rw_global"]["task_share"][held], dense["rw_group"]["task_share"][held]
        out.append(paragraph(
            f"- **Offline reward-weighted SFT barely moves** ({gain(m, 'dense', 'rw_global')} "
            f"global, {gain(m, 'dense', 'rw_group')} per group): the warm start's own samples "
            f"hold few right `{held}` answers. Global weights give `{held}` {g:.0%} of the "
            f"weight, since the tasks the model already solves hold most of the right answers; "
            f"per-group weights give it {p:.0%}.", "  "))
    if "grpo_cold" in dense:
        c = dense["grpo_cold"]["curves"]["variance_fraction"]
        k = cfg["eval"]["k"]
        out.append(paragraph(
            f"- **Without a warm start there is little to reinforce.** From the dense base "
            f"(pass@{k} {m['dense']['start']['base'][f'{held}_pass@{k}']:.2f}) GRPO gains "
            f"{gain(m, 'dense', 'grpo_cold')}; the share of groups with any reward variance "
            f"goes {c[0]:.2f} → {c[-1]:.2f}.", "  "))
    if "grpo_kl" in dense:
        out.append(paragraph(
            f"- **A KL to the base holds the old tasks and the new one back.** With β = "
            f"{cfg['runs']['grpo_kl']['grpo']['kl_coef']} the gain is "
            f"{gain(m, 'dense', 'grpo_kl')} (`sort` {dense['grpo_kl']['after']['sort']:.2f}): the "
            f"base is the policy that cannot do `{held}`. Replay protects the old tasks without "
            "pulling the new one back.", "  "))
    if "grpo_async" in dense:
        out.append(paragraph(
            f"- **Asynchronous generation** (each batch sampled one update earlier) gains "
            f"{gain(m, 'dense', 'grpo_async')} against {gain(m, 'dense', 'grpo_replay')} for the "
            "same run in step; the reward curves are in the report.", "  "))
    if "grpo_partial" in dense and "grpo_partial" in moe:
        v = moe["grpo_partial"]["curves"]["variance_fraction"]
        out.append(paragraph(
            f"- **Partial credit is not a safe default.** In place of exact match it gains "
            f"{gain(m, 'dense', 'grpo_partial')} (dense) but {gain(m, 'moe', 'grpo_partial')} "
            f"(MoE), whose groups settle on near misses: groups with reward variance go "
            f"{v[0]:.2f} → {v[-1]:.2f}.", "  "))
    if all(n in moe for n in ("grpo_dapo", "grpo_dr")):
        length = {n: moe[n]["curves"]["completion_tokens"][-1]
                  for n in ("grpo", "grpo_dapo", "grpo_dr")}
        out.append(paragraph(
            f"- **How the token losses are aggregated** (MoE, from the warm start): GRPO's "
            f"per-completion mean gains {gain(m, 'moe', 'grpo')} with completions of "
            f"{length['grpo']:.1f} tokens in the last window; DAPO's token-level mean "
            f"{gain(m, 'moe', 'grpo_dapo')} ({length['grpo_dapo']:.1f} tokens), Dr. GRPO's "
            f"constant normaliser {gain(m, 'moe', 'grpo_dr')} ({length['grpo_dr']:.1f} "
            "tokens). The three weigh a token of a long completion differently (the lab's "
            "aggregation cell), yet all three runs end with completions of about the same "
            "length, so the gains do not come from answering longer or shorter. Each is one "
            "seed: the same three runs recorded on a CPU of another vendor, whose arithmetic "
            "differs only in last bits, ranked them differently, so no ranking is claimed.",
            "  "))
    if "rw_file" in dense:
        f, warm = dense["rw_file"], m["dense"]["start"]["warm"]
        out.append(paragraph(
            f"- **The sample file is for reading, not for training.** Reward-weighted SFT on "
            f"`{cfg['sample_data']}` ({f['records']} hand-made answers; the "
            f"{f['weighted_records']} that carry weight are the right answers of its mixed "
            f"groups) for {cfg['rw']['steps']} steps gains {gain(m, 'dense', 'rw_file')} on "
            f"unseen `{held}` prompts, while `sort` goes {warm['sort']:.2f} → "
            f"{f['after']['sort']:.2f}: a handful of examples repeated is memorised, and "
            "the old tasks pay for it.", "  "))
    return out
