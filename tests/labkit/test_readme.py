"""labkit.readme: the generated blocks of the course's documents (README.md, RESULTS.md,
experiments/README.md), each filled from an experiment's manifest by its summary.py, the
reproduce table, the GPU benchmark blocks (their contents are tested in
tests/benchmarks/test_bench_gpu.py), and the real documents, which must match the committed
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
    COMPILE_MARKER,
    CPU_MARKER,
    DOCS,
    END,
    TABLE_MARKER,
    gpu_marker,
    load_summary,
    marker,
    relink,
    render,
    write_docs,
    write_readme,
)

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ["00-pretrain-base", "05-lora-finetune", "06-qlora-preview", "07-moe-routing",
               "11-qlora-moe"]
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


def test_every_document_is_filled_and_links_open_from_its_folder(tmp_path):
    """RESULTS.md and experiments/README.md are filled like README.md; in a document below
    the root a body's links are rewritten to open the same files from there."""
    root = course(tmp_path, "# Demo\n")
    (root / "RESULTS.md").write_text(section(marker("01-demo")))
    (root / "experiments" / "README.md").write_text(section(TABLE_MARKER))
    assert write_docs(root, check=True) == ["RESULTS.md", "experiments/README.md"]
    assert (root / "RESULTS.md").read_text() == section(marker("01-demo"))   # nothing written
    assert write_docs(root) == ["RESULTS.md", "experiments/README.md"]
    assert write_docs(root) == [] and write_readme(root, check=True)
    assert "accuracy 0.81" in (root / "RESULTS.md").read_text()
    table = (root / "experiments" / "README.md").read_text()
    assert "| [01-demo](01-demo/REPORT.md) | 12.5 min |" in table
    assert (root / "README.md").read_text() == "# Demo\n"


def test_one_stale_document_is_named(tmp_path):
    root = course(tmp_path, section(marker("01-demo")))
    assert write_docs(root) == ["README.md"]
    (root / "RESULTS.md").write_text(section(marker("01-demo")))
    assert write_docs(root, check=True) == ["RESULTS.md"]
    assert not write_readme(root, check=True)


def test_a_refused_block_writes_no_document(tmp_path):
    root = course(tmp_path, section(marker("01-demo")))
    results = section(marker("01-demo")) + f"\n{marker('99-nowhere')}\n{END}\n"
    (root / "RESULTS.md").write_text(results)
    with pytest.raises(InputError, match="RESULTS.md line 11: no experiment folder"):
        write_docs(root)
    assert (root / "README.md").read_text() == section(marker("01-demo"))
    assert (root / "RESULTS.md").read_text() == results


def test_no_document_at_all(tmp_path):
    with pytest.raises(InputError, match="none of README.md, RESULTS.md, experiments/README.md"):
        write_docs(tmp_path)


@pytest.mark.parametrize("doc, body, expected", [
    ("README.md", "[a](experiments/x/REPORT.md)", "[a](experiments/x/REPORT.md)"),
    ("experiments/README.md", "[a](experiments/x/REPORT.md) [b](RESULTS.md#top)",
     "[a](x/REPORT.md) [b](../RESULTS.md#top)"),
    ("experiments/README.md", "[c](https://example.org/x) [d](#here) [e](/abs.md)",
     "[c](https://example.org/x) [d](#here) [e](/abs.md)"),
])
def test_relink(doc, body, expected):
    assert relink(body, doc) == expected


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
    assert capsys.readouterr().out == "wrote README.md\n"
    assert main(["readme", "--root", str(root), "--check"]) == 0
    (root / "RESULTS.md").write_text(section(marker("01-demo")))
    assert main(["readme", "--root", str(root), "--check"]) == 1
    assert capsys.readouterr().err == ("RESULTS.md is out of date with the manifests: run make "
                                       "readme\n")
    assert main(["readme", "--root", str(root)]) == 0
    assert main(["readme", "--root", str(root)]) == 0
    assert capsys.readouterr().out == ("wrote RESULTS.md\nREADME.md, RESULTS.md: already match "
                                       "the manifests\n")
    (root / "README.md").write_text(section(marker("99-nowhere")))
    assert main(["readme", "--root", str(root)]) == 2
    assert "README.md line 5: no experiment folder" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# the real documents and summaries


def test_the_documents_match_the_manifests():
    """What `python -m labkit readme --check` checks: every document of DOCS."""
    stale = write_docs(ROOT, check=True)
    assert stale == [], f"{', '.join(stale)} out of date with the manifests: run make readme"
    assert write_readme(ROOT, check=True)


def test_results_md_is_current():
    """RESULTS.md alone, which holds every result."""
    assert (ROOT / "RESULTS.md").read_text(encoding="utf-8") == render(ROOT, "RESULTS.md"), \
        "RESULTS.md is out of date with the manifests: run make readme"


def test_every_block_is_in_its_document():
    """Each block stands once, where the README and the experiments' guide point to it: the
    results in RESULTS.md, the reproduce table in experiments/README.md, none in README.md."""
    text = {doc: (ROOT / doc).read_text(encoding="utf-8") for doc in DOCS}
    results = [marker(e) for e in [*EXPERIMENTS, "12-grpo"]]
    results += [gpu_marker("dequant"), gpu_marker("moe"), gpu_marker("logprobs"), COMPILE_MARKER,
                CPU_MARKER]
    assert [text["RESULTS.md"].count(m) for m in results] == [1] * len(results)
    assert text["experiments/README.md"].count(TABLE_MARKER) == 1
    assert "<!-- generated from " not in text["README.md"]


def experiments_copy(tmp_path: Path) -> Path:
    """tmp_path/experiments with a link to each experiment folder (not experiments/README.md)."""
    (tmp_path / "experiments").mkdir()
    for exp in (ROOT / "experiments").iterdir():
        if exp.is_dir():
            (tmp_path / "experiments" / exp.name).symlink_to(exp)
    return tmp_path / "experiments"


def results_copy(tmp_path: Path) -> tuple[Path, str]:
    """A checkout of README.md and RESULTS.md, with links to what their blocks are made from;
    RESULTS.md's text."""
    experiments_copy(tmp_path)
    (tmp_path / "benchmarks").symlink_to(ROOT / "benchmarks")
    for name in ("README.md", "RESULTS.md"):
        (tmp_path / name).write_text((ROOT / name).read_text(encoding="utf-8"), encoding="utf-8")
    return tmp_path, (ROOT / "RESULTS.md").read_text(encoding="utf-8")


def test_a_number_edited_by_hand_is_caught(tmp_path, capsys):
    """The check above fails for an edit inside a generated block (on a copy of RESULTS.md),
    naming RESULTS.md."""
    root, results = results_copy(tmp_path)
    start = results.index(marker("00-pretrain-base"))
    number = re.compile(r"\d+\.\d+").search(results, start)
    edited = results[:number.start()] + number[0] + "1" + results[number.end():]
    (root / "RESULTS.md").write_text(edited, encoding="utf-8")
    assert write_docs(root, check=True) == ["RESULTS.md"]
    assert not write_readme(root, check=True)
    assert render(root, "RESULTS.md") == results
    assert main(["readme", "--root", str(root), "--check"]) == 1
    assert capsys.readouterr().err == ("RESULTS.md is out of date with the manifests: run make "
                                       "readme\n")


@pytest.mark.parametrize("part", ["dequant", "moe", "logprobs"])
def test_a_gpu_block_edited_by_hand_is_caught(tmp_path, part):
    """The GPU blocks are checked the same way: typed text in one (a GPU's numbers claimed
    by hand, or a "not yet run" kept after a result was committed) makes RESULTS.md stale."""
    root, results = results_copy(tmp_path)
    start = results.index(gpu_marker(part)) + len(gpu_marker(part))
    end = results.index(END, start)
    edited = results[:start] + "\n\nMeasured by hand: 0.95 of copy.\n\n" + results[end:]
    (root / "RESULTS.md").write_text(edited, encoding="utf-8")
    assert write_docs(root, check=True) == ["RESULTS.md"]
    assert render(root, "RESULTS.md") == results


def test_the_reproduce_table_edited_by_hand_is_caught(tmp_path):
    """experiments/README.md's table is checked the same way (on a copy of the folder's
    guide, beside links to the experiments)."""
    experiments_copy(tmp_path)
    guide = (ROOT / "experiments" / "README.md").read_text(encoding="utf-8")
    (tmp_path / "experiments" / "README.md").write_text(guide.replace(" | 2 | pinned |",
                                                                      " | 4 | pinned |", 1))
    assert write_docs(tmp_path, check=True) == ["experiments/README.md"]
    assert render(tmp_path, "experiments/README.md") == guide


def test_the_results_have_every_gpu_block():
    results = (ROOT / "RESULTS.md").read_text(encoding="utf-8")
    parts = ("dequant", "moe", "logprobs")
    assert [results.count(gpu_marker(part)) for part in parts] == [1, 1, 1]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "GPU; not yet run" not in readme             # the lab map links to them instead
    assert "RESULTS.md#benchmarks" in readme


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
