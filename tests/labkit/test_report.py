"""labkit.report: REPORT.md written again from a committed manifest by experiment.py's
`report(manifest)`, `--check` failing on a report that no longer matches, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from labkit import write_manifest
from labkit.__main__ import main
from labkit.errors import InputError
from labkit.report import render_report, write_report

EXPERIMENT = '''
def run(cfg, ctx):
    metrics = {"accuracy": 0.8125}
    ctx.output("REPORT.md").write_text(report({"config": cfg, "metrics": metrics}))
    return metrics


def report(manifest):
    return f"| accuracy |\\n|---|\\n| {manifest['metrics']['accuracy']:.2f} |\\n"
'''


def experiment(tmp_path: Path, source: str = EXPERIMENT, accuracy: float = 0.8125) -> Path:
    exp = tmp_path / "01-demo"
    exp.mkdir()
    (exp / "experiment.py").write_text(source)
    write_manifest(exp / "manifest.json", {
        "experiment": "01-demo", "config": {"seed": 0}, "seed": 0,
        "git": {"commit": "abc1234def", "dirty": False}, "code": {}, "env": {}, "data": {},
        "inputs": {}, "artifacts": {}, "metrics": {"accuracy": accuracy}, "timings": {},
        "wall_time_s": 1.0, "peak_memory_mb": 1.0})
    return exp


def test_report_is_rewritten_from_the_manifest_and_then_checks(tmp_path, capsys):
    exp = experiment(tmp_path)
    assert render_report(exp) == "| accuracy |\n|---|\n| 0.81 |\n"
    assert main(["report", str(exp), "--check"]) == 1       # no REPORT.md yet
    assert "out of date with its manifest" in capsys.readouterr().err
    assert not (exp / "REPORT.md").exists()
    assert main(["report", str(exp)]) == 0
    assert (exp / "REPORT.md").read_text() == render_report(exp)
    assert main(["report", str(exp), "--check"]) == 0
    (exp / "REPORT.md").write_text("| accuracy |\n|---|\n| 0.99 |\n")   # a hand-typed number
    assert write_report(exp, check=True) is False
    assert (exp / "REPORT.md").read_text().endswith("0.99 |\n")       # --check writes nothing


def test_an_experiment_without_a_report_writer_is_refused(tmp_path, capsys):
    exp = experiment(tmp_path, source="def run(cfg, ctx):\n    return {}\n")
    with pytest.raises(InputError, match="defines no report"):
        render_report(exp)
    assert main(["report", str(exp)]) == 2
    assert "its REPORT.md is written by its run alone" in capsys.readouterr().err


def test_an_edited_manifest_is_refused(tmp_path):
    exp = experiment(tmp_path)
    path = exp / "manifest.json"
    path.write_text(path.read_text().replace("0.8125", "0.9"))
    with pytest.raises(InputError, match="edited"):
        render_report(exp)
