"""The committed reports are their manifests': every experiment whose experiment.py defines
`report(manifest)` has a REPORT.md equal to what it makes from the committed manifest
(`python -m labkit report EXP --check`), so no number in a report can drift from the run."""

from __future__ import annotations

from pathlib import Path

import pytest

from labkit.experiment import load_experiment
from labkit.report import REPORT, render_report

ROOT = Path(__file__).resolve().parents[2]
REPORTED = sorted(p.parent.name for p in (ROOT / "experiments").glob("*/experiment.py")
                  if callable(getattr(load_experiment(p.parent), "report", None)))


def test_the_report_writers_are_found():
    assert {"06-qlora-preview", "11-qlora-moe"} <= set(REPORTED)


@pytest.mark.parametrize("name", REPORTED)
def test_report_is_made_from_the_committed_manifest(name):
    exp = ROOT / "experiments" / name
    assert (exp / REPORT).read_text(encoding="utf-8") == render_report(exp), (
        f"experiments/{name}/{REPORT} differs from what its manifest makes: run "
        f"python -m labkit report experiments/{name}")
