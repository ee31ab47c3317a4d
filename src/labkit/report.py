"""An experiment's REPORT.md written again from its committed manifest, without re-running it.

An experiment whose experiment.py defines `report(manifest) -> str` makes REPORT.md from a
manifest: tables of the recorded numbers plus fixed text. Its run calls it with its own config,
metrics and timings; `python -m labkit report experiments/NN-name` calls it with the verified
`manifest.json` beside it and rewrites REPORT.md, and with `--check` only says whether
REPORT.md still matches, so a report cannot drift from the numbers it shows
(`tests/experiments/test_reports.py` checks every such experiment). Part of labkit's
experiment half: stdlib and labkit only (the experiment's own imports aside).
"""

from __future__ import annotations

from pathlib import Path

from .atomic import atomic_write_text
from .errors import InputError
from .experiment import load_experiment
from .manifest import read_manifest

REPORT = "REPORT.md"


def render_report(exp_dir: str | Path) -> str:
    """REPORT.md as experiment.py's `report` makes it from the committed manifest."""
    exp_dir = Path(exp_dir)
    if not (exp_dir / "experiment.py").is_file():
        raise InputError(f"{exp_dir} is not an experiment folder (no experiment.py)")
    module = load_experiment(exp_dir)
    if not callable(getattr(module, "report", None)):
        raise InputError(f"{exp_dir / 'experiment.py'} defines no report(manifest) -> str: its "
                         f"{REPORT} is written by its run alone (python -m labkit run {exp_dir})")
    text = module.report(read_manifest(exp_dir / "manifest.json"))
    if not isinstance(text, str):
        raise InputError(f"{exp_dir / 'experiment.py'} report() returned "
                         f"{type(text).__name__}, expected the markdown as a str")
    return text


def write_report(exp_dir: str | Path, check: bool = False) -> bool:
    """Whether REPORT.md already matched the manifest. Without `check`, a REPORT.md that did
    not is rewritten (atomically); with it, nothing is written."""
    path = Path(exp_dir) / REPORT
    fresh = render_report(exp_dir)
    if path.is_file() and path.read_text(encoding="utf-8") == fresh:
        return True
    if not check:
        atomic_write_text(path, fresh)
    return False
