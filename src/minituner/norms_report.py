"""Text and figures for `lora_norms`: the ranking, the markdown grids (the tables of
experiments/11-qlora-moe/REPORT.md), and a heatmap of expert targets × experts."""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from minigpt.atomic import atomic_path

if TYPE_CHECKING:         # lora_norms imports this module; the type is for annotations only
    from .lora_norms import TargetNorms


def _updates(norms: list[TargetNorms]) -> list[tuple[str, float]]:
    """(label, norm) per update matrix: a module's, or one expert's as `name[e3]`."""
    return [(t.name if len(t.experts) == 1 else f"{t.name}[e{e}]", x)
            for t in norms for e, x in enumerate(t.experts)]


def norms_table(norms: list[TargetNorms], top: int | None = None) -> str:
    """One line per update, largest ‖s·B·A‖_F first (ties in file order); `top` keeps the
    first `top` lines and says how many were left out."""
    rows = sorted(_updates(norms), key=lambda row: -row[1])
    shown = rows if top is None else rows[:top]
    lines = [f"{'‖s·B·A‖_F':>11}  update"] + [f"{x:11.4f}  {label}" for label, x in shown]
    if len(shown) < len(rows):
        lines.append(f"{'':11}  … and {len(rows) - len(shown)} smaller")
    return "\n".join(lines)


def _markdown(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def _cell(x: float) -> str:
    """Three significant digits, trailing zeros kept (3.50, 34.0, 123)."""
    return f"{x:#.3g}".rstrip(".")


def _expert_grid(experts: list[TargetNorms]) -> str:
    """expert projection | e0 … e(E-1), one row per expert target, then the column sums."""
    E = max(len(t.experts) for t in experts)
    rows = [[t.name] + [_cell(x) for x in t.experts] + [""] * (E - len(t.experts))
            for t in experts]
    sums = [sum(t.experts[e] for t in experts if e < len(t.experts)) for e in range(E)]
    rows.append(["**sum**"] + [f"**{_cell(x)}**" for x in sums])
    return _markdown(["expert projection"] + [f"e{e}" for e in range(E)], rows)


def _block_split(name: str) -> tuple[str, str]:
    """'blocks.3.attn.q_proj' -> ('3', 'attn.q_proj'): the first index, what follows it."""
    parts = name.split(".")
    i = next((i for i, p in enumerate(parts[:-1]) if p.isdigit()), None)
    return ("", name) if i is None else (parts[i], ".".join(parts[i + 1:]))


def _shortest(labels: list[str]) -> dict[str, str]:
    """Each label cut to its last k dot-parts, for the smallest k that keeps them distinct."""
    for k in range(1, max(len(s.split(".")) for s in labels) + 1):
        short = {s: ".".join(s.split(".")[-k:]) for s in labels}
        if len(set(short.values())) == len(short):
            return short
    return {s: s for s in labels}


def _module_grid(modules: list[TargetNorms]) -> str:
    """projection × block (b0, b1, …; '-' for a name without a block index)."""
    cells = {_block_split(t.name): t.experts[0] for t in modules}
    if len(cells) < len(modules):        # two names share a (block, projection): list them
        return _markdown(["module", "‖s·B·A‖_F"], [[t.name, _cell(t.total)] for t in modules])
    blocks = sorted({b for b, _ in cells}, key=lambda b: (b == "", int(b) if b else 0))
    projs = list(dict.fromkeys(p for _, p in cells))
    short = _shortest(projs)
    head = "attention projection" if all("attn" in t.name for t in modules) else "module"
    rows = [[short[p]] + [_cell(cells[b, p]) if (b, p) in cells else "" for b in blocks]
            for p in projs]
    return _markdown([head] + [f"b{b}" if b else "-" for b in blocks], rows)


def grid(norms: list[TargetNorms]) -> str:
    """Markdown: the expert targets × experts table (with a sum row), then the module targets
    as projection × block, as in experiments/11-qlora-moe/REPORT.md."""
    experts = [t for t in norms if len(t.experts) > 1]
    modules = [t for t in norms if len(t.experts) == 1]
    parts = ([_expert_grid(experts)] if experts else []) + (
        [_module_grid(modules)] if modules else [])
    return "\n\n".join(parts)


def plot_norms(norms: list[TargetNorms], path: str | Path) -> None:
    """A PNG: heatmap of expert targets × experts, bars for module targets; written atomically
    (a temporary file beside `path`, then a rename). Agg canvas, no pyplot state."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    experts = [t for t in norms if len(t.experts) > 1]
    modules = [t for t in norms if len(t.experts) == 1]
    groups = [g for g in (experts, modules) if g]
    if not groups:
        raise ValueError("no targets to plot")
    heights = [0.9 + 0.2 * len(g) for g in groups]
    fig = Figure(figsize=(8, sum(heights) + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(groups), 1, squeeze=False,
                        gridspec_kw={"height_ratios": heights})[:, 0]
    if experts:
        _heatmap(fig, axes[0], experts)
    if modules:
        _bars(axes[-1], modules)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def _heatmap(fig, ax, experts: list[TargetNorms]) -> None:
    E = max(len(t.experts) for t in experts)
    data = [t.experts + [math.nan] * (E - len(t.experts)) for t in experts]   # [targets, E]
    im = ax.imshow(data, aspect="auto", cmap="magma", interpolation="nearest")
    ax.set_yticks(range(len(experts)), [t.name for t in experts], fontsize=7)
    ax.set_xticks(range(E))
    ax.set(xlabel="expert", title="‖s·B_e·A_e‖_F per expert")
    fig.colorbar(im, ax=ax)


def _bars(ax, modules: list[TargetNorms]) -> None:
    ax.barh(range(len(modules)), [t.total for t in modules], color="C0")
    ax.set_yticks(range(len(modules)), [t.name for t in modules], fontsize=7)
    ax.invert_yaxis()
    ax.set(xlabel="‖s·B·A‖_F", title="module targets")
