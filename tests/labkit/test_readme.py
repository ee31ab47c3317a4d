"""labkit.readme: README.md's generated blocks, each filled from an experiment's manifest by its
summary.py, the reproduce table, the GPU benchmark blocks (their contents are tested in
tests/benchmarks/test_bench_gpu.py), and the real README, which must match the committed
manifests and GPU results."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from labkit import read_manifest, write_manifest
from labkit.__main__ import main
from labkit.errors import InputError
from labkit.readme import (
    END,
    TABLE_MARKER,
    gpu_marker,
    load_summary,
    marker,
    render,
    write_readme,
)

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ["00-pretrain-base", "05-lora-finetune", "06-qlora-preview", "11-qlora-moe"]
MIB, GIB = 2**20, 2**30

SUMMARY = """def readme(manifest):
    return f"accuracy {manifest['metrics']['accuracy']:.2f}\\n"
"""


def body(**overrides) -> dict:
    """Every field write_manifest needs (as in test_manifest.py)."""
    m = {
        "experiment": "01-demo",
        "config": {"seed": 0, "threads": 4},
        "seed": 0,
        "git": {"commit": "abc1234def", "dirty": False},
        "code": {"01-demo/experiment.py": "3" * 64},
        "env": {"python": "3.11.7", "numerics": {"mode": "pinned"}},
        "data": {"train": "0" * 64},
        "inputs": {},
        "artifacts": {},
        "metrics": {"accuracy": 0.8125},
        "wall_time_s": 750.0,
        "peak_memory_mb": 301.25,
    }
    m.update(overrides)
    return m


def course(tmp_path: Path, readme: str, summary: str = SUMMARY, **manifest) -> Path:
    """A checkout with one experiment, 01-demo (its summary.py and manifest), and README.md."""
    exp = tmp_path / "experiments" / "01-demo"
    exp.mkdir(parents=True)
    (exp / "summary.py").write_text(summary)
    write_manifest(exp / "manifest.json", body(**manifest))
    (tmp_path / "README.md").write_text(readme)
    return tmp_path


def section(opening: str, inside: str = "stale 0.12\n") -> str:
    return f"# Demo\n\nintro\n\n{opening}\n{inside}{END}\n\ntail\n"


def flat(text: str) -> str:
    """Whitespace collapsed, so a number's words are found whichever line they were wrapped to."""
    return " ".join(text.split())


# ---------------------------------------------------------------------------------------------
# render and write on a small checkout


def test_render_fills_the_block_and_is_idempotent(tmp_path):
    root = course(tmp_path, section(marker("01-demo")))
    text = render(root)
    assert text == section(marker("01-demo"), "\naccuracy 0.81\n\n")
    assert not write_readme(root, check=True)                  # stale, and left as it was
    assert "stale 0.12" in (root / "README.md").read_text()
    assert not write_readme(root)                              # was stale: written
    assert (root / "README.md").read_text() == text
    assert write_readme(root) and write_readme(root, check=True)
    assert render(root) == text
    assert sorted(p.name for p in root.iterdir()) == ["README.md", "experiments"]


def test_the_reproduce_table(tmp_path):
    root = course(tmp_path, section(TABLE_MARKER))
    (root / "experiments" / "02-unrun").mkdir()                # no manifest: no row
    rows = render(root).split("\n")
    assert rows[rows.index("| experiment | recorded run | threads | numerics | commit | "
                           "peak memory |") + 2] == (
        "| [01-demo](experiments/01-demo/REPORT.md) | 12.5 min | 4 | pinned | `abc1234` | "
        "301 MB |")
    assert "02-unrun" not in render(root)


def test_the_reproduce_table_of_an_older_manifest(tmp_path):
    root = course(tmp_path, section(TABLE_MARKER), config={"seed": 0}, env={}, wall_time_s=95.4)
    assert "| 95 s | 2 | not recorded |" in render(root)


# ---------------------------------------------------------------------------------------------
# what is refused, and where


@pytest.mark.parametrize("readme, summary, message", [
    (f"# Demo\n\n{marker('01-demo')}\nbody\n", SUMMARY,
     f"README.md line 3: block has no '{END}' after it"),
    (section(marker("01-demo")) + f"\n{marker('01-demo')}\n", SUMMARY,
     f"README.md line 11: block has no '{END}' after it"),
    (f"{marker('01-demo')}\n{TABLE_MARKER}\n{END}\n", SUMMARY,
     f"README.md line 1: block has no '{END}' before the next marker on line 2"),
    (f"text\n{END}\n", SUMMARY, f"README.md line 2: '{END}' closes no block"),
    (section(marker("99-nowhere")), SUMMARY, "README.md line 5: no experiment folder"),
    (section(marker("01-demo")), "def summary(manifest):\n    return ''\n",
     "README.md line 5: .*summary.py must define readme\\(manifest\\) -> str"),
    (section(marker("01-demo")), "readme = 'not a function'\n",
     "README.md line 5: .*summary.py must define readme"),
    (section(marker("01-demo")), "def readme(manifest):\n    return 3\n",
     "README.md line 5: .*readme\\(\\) returned int, expected the markdown as a str"),
    (section("<!-- generated from experiments/01-demo/manifest.json by hand -->"), SUMMARY,
     "README.md line 5: unrecognised marker"),
    (section(gpu_marker("dequant")), SUMMARY,
     "README.md line 5: no benchmarks/summary.py \\(expected one defining PARTS"),
])
def test_refused_naming_the_line(tmp_path, readme, summary, message):
    root = course(tmp_path, readme, summary)
    with pytest.raises(InputError, match=message):
        render(root)
    with pytest.raises(InputError, match=message):
        write_readme(root)
    assert (root / "README.md").read_text() == readme


def test_a_folder_without_summary_py(tmp_path):
    root = course(tmp_path, section(marker("01-demo")))
    (root / "experiments" / "01-demo" / "summary.py").unlink()
    with pytest.raises(InputError, match=r"README.md line 5: .*01-demo has no summary.py"):
        render(root)


def test_an_edited_manifest_is_refused(tmp_path):
    root = course(tmp_path, section(marker("01-demo")))
    path = root / "experiments" / "01-demo" / "manifest.json"
    path.write_text(path.read_text().replace("0.8125", "0.9"))
    with pytest.raises(InputError, match="README.md line 5: manifest .* was edited"):
        render(root)


def test_cli(tmp_path, capsys):
    root = course(tmp_path, section(marker("01-demo")))
    assert main(["readme", "--root", str(root), "--check"]) == 1
    assert ("README.md is out of date with the manifests: run make readme"
            in capsys.readouterr().err)
    assert main(["readme", "--root", str(root)]) == 0
    assert main(["readme", "--root", str(root), "--check"]) == 0
    (root / "README.md").write_text(section(marker("99-nowhere")))
    assert main(["readme", "--root", str(root)]) == 2
    assert "README.md line 5: no experiment folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the real README and summaries


def test_the_readme_matches_the_manifests():
    assert write_readme(ROOT, check=True), \
        "README.md is out of date with the manifests: run make readme"


def readme_copy(tmp_path: Path) -> tuple[Path, str]:
    """A checkout of README.md and links to what its blocks are made from; the README."""
    for folder in ("experiments", "benchmarks"):
        (tmp_path / folder).symlink_to(ROOT / folder)
    return tmp_path, (ROOT / "README.md").read_text(encoding="utf-8")


def test_a_number_edited_by_hand_is_caught(tmp_path):
    """The check above fails for an edit inside a generated block (on a copy of README.md)."""
    root, readme = readme_copy(tmp_path)
    start = readme.index(marker("00-pretrain-base"))
    number = re.compile(r"\d+\.\d+").search(readme, start)
    edited = readme[:number.start()] + number[0] + "1" + readme[number.end():]
    (root / "README.md").write_text(edited, encoding="utf-8")
    assert not write_readme(root, check=True)
    assert render(root) == readme


@pytest.mark.parametrize("part", ["dequant", "moe"])
def test_a_gpu_block_edited_by_hand_is_caught(tmp_path, part):
    """The GPU blocks are checked the same way: typed text in one (a GPU's numbers claimed
    by hand, or a "not yet run" kept after a result was committed) makes README.md stale."""
    root, readme = readme_copy(tmp_path)
    start = readme.index(gpu_marker(part)) + len(gpu_marker(part))
    end = readme.index(END, start)
    edited = readme[:start] + "\n\nMeasured by hand: 0.95 of copy.\n\n" + readme[end:]
    (root / "README.md").write_text(edited, encoding="utf-8")
    assert not write_readme(root, check=True)
    assert render(root) == readme


def test_the_real_readme_has_both_gpu_blocks():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert [readme.count(gpu_marker(part)) for part in ("dequant", "moe")] == [1, 1]
    assert "GPU; not yet run" not in readme             # the lab map links to them instead


def summary_text(name: str) -> tuple[str, dict]:
    """An experiment's generated section and its manifest."""
    exp = ROOT / "experiments" / name
    manifest = read_manifest(exp / "manifest.json")
    return load_summary(exp, name).readme(manifest), manifest


def test_00_numbers():
    text, manifest = summary_text("00-pretrain-base")
    m, timings = manifest["metrics"], manifest["timings"]
    dense = m["dense"]["exact_match"]
    assert (f"| dense | {m['dense']['params'] / 1e6:.2f}M | "
            + " | ".join(f"{dense[t]:.2f}" for t in sorted(dense))
            + f" | {timings['dense_train_s']:.0f} s |") in text
    assert f"| moe | {m['moe']['params'] / 1e6:.2f}M |" in text
    assert f"{m['moe']['steps']} AdamW steps" in flat(text)


def test_05_numbers():
    text, manifest = summary_text("05-lora-finetune")
    m = manifest["metrics"]
    assert f"({m['rev_only']['trainable_params']:,} trainable parameters" in flat(text)
    after = m["rev_only"]["exact_match_after"]
    assert "| LoRA, rev only | " + " | ".join(f"{after[t]:.2f}" for t in sorted(after)) in text
    assert f"| {m['before']['kv']:.2f} |" in text


def test_06_numbers():
    text, manifest = summary_text("06-qlora-preview")
    m = manifest["metrics"]
    par = m["parity"]
    assert f"moves the logits by {par['mean_abs_diff']:.3f} on average" in flat(text)
    assert f"keeps {par['argmax_agreement'] * 100:.1f}% of the argmaxes" in flat(text)
    qlora = m["memory"]["QLoRA, NF4 base"]["measured"]
    assert f"| {qlora['weights'] / MIB:.2f} |" in text
    assert f"| {qlora['total'] / MIB:.2f} |" in text
    big = m["llama_7b"]
    assert (f"from {big['lora']['total'] / GIB:.1f} to {big['qlora']['total'] / GIB:.1f} GiB"
            in flat(text))


def test_11_numbers():
    text, manifest = summary_text("11-qlora-moe")
    m = manifest["metrics"]
    rev = m["runs"]["qlora_moe"]["exact_match_after"]["rev"]
    assert f"| QLoRA on the NF4 MoE | {m['before']['qlora_moe']['rev']:.2f} → {rev:.2f} |" in text
    memory = m["memory"]
    assert (f"QLoRA holds {memory['qlora']['measured']['total'] / MIB:.1f} MiB against "
            f"{memory['lora']['measured']['total'] / MIB:.1f} for LoRA") in flat(text)
    mixtral = m["extrapolate"]["mixtral-8x7b"]["qlora"]["total"]
    assert f"Mixtral-8x7B at {mixtral / 1e9:.1f} GB" in flat(text)
    diff = m["triton_check"]["max_rel_grad_diff"]
    assert f"to {diff:.1e}".replace("e-0", "e-") in flat(text)


def imported_roots(path: Path) -> set[str]:
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    return roots


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_summary_imports_only_light_modules(name):
    """summary.py is read by `make readme`, which must not load the models or matplotlib; and
    an experiment's run must not depend on it."""
    exp = ROOT / "experiments" / name
    assert imported_roots(exp / "summary.py") <= {"__future__", "json", "pathlib", "labkit"}
    assert "summary" not in imported_roots(exp / "experiment.py")
    assert "summary.py" not in (exp / "experiment.py").read_text(encoding="utf-8")
