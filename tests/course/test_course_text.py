"""What the course's text promises: runtimes from the measured table, sample answers for
instructors that never reach learners, and help that stays collapsed until asked for."""

from __future__ import annotations

import re
from pathlib import Path

import jupytext
import pytest

from labkit.course.build import INSTRUCTOR_TAG, lab_names
from labkit.course.runtimes import fill, problems, typed_claims

ROOT = Path(__file__).resolve().parents[2]
LABS = lab_names(ROOT)


def test_every_stated_runtime_comes_from_the_table():
    assert problems(ROOT, LABS) == []


@pytest.mark.parametrize("sentence", [
    "The whole notebook runs in about 10 s on a laptop CPU.",
    "The notebook runs in well under a minute.",
    "On a 2-core CPU lab 00 takes about 5–7 s.",
    "Keep the notebook fast: it runs in 10 to 20 s.",
    "Each cell takes a few seconds.",
])
def test_typed_runtimes_are_caught(sentence):
    assert typed_claims(Path("guide.md"), f"Intro.\n\n{sentence}\n") != []
    assert typed_claims(Path("lab.py"), f"# %% [markdown]\n# {sentence}\n") != []


@pytest.mark.parametrize("sentence", [
    "### B. Blockwise codes (about 40 min)",
    "After about 20 minutes on one exercise, open the solution.",
    "The tests marked slow (experiment re-runs, the RSS measurement): 165 s on 2 cores.",
    "The notebook runs in <!-- runtime:02-nf4 -->about 9 s (measured)<!-- /runtime -->.",
    "Its forward runs the Lab 08 kernel and its backward runs yours.",
])
def test_other_durations_are_not_runtime_claims(sentence):
    assert typed_claims(Path("guide.md"), sentence) == []


def test_markers_are_filled_from_the_table():
    table = {"cores": 2, "labs": {"02-nf4": {"seconds": 9.44}}}
    text = ("runs in <!-- runtime:02-nf4 -->old<!-- /runtime -->; "
            "<!-- runtime:99-x -->?<!-- /runtime -->")
    assert fill(text, table) == ("runs in <!-- runtime:02-nf4 -->about 9 s (the solution, "
                                 "measured on a 2-core CPU)<!-- /runtime -->; "
                                 "<!-- runtime:99-x -->?<!-- /runtime -->")


@pytest.mark.parametrize("lab", LABS)
def test_reflection_has_sample_answers_for_instructors_only(lab):
    nb = jupytext.read(ROOT / "solutions" / f"{lab}.py", fmt="py:percent")
    sources = [c.source for c in nb.cells]
    reflection = next((i for i, s in enumerate(sources) if "Reflection" in s), None)
    assert reflection is not None, f"{lab}: no reflection questions"
    answers = [c for c in nb.cells[reflection:] if INSTRUCTOR_TAG in c.metadata.get("tags", [])]
    assert answers, f"{lab}: no instructor-tagged sample answers after the reflection questions"
    questions = len(re.findall(r"^\s*\d+\. ", sources[reflection].split("Reflection", 1)[1],
                               re.M))
    given = len(re.findall(r"^\s*\d+\. ", answers[0].source, re.M))
    assert given >= questions, f"{lab}: {questions} questions, {given} sample answers"
    release = (ROOT / "labs" / lab / f"{lab}.ipynb").read_text()
    first = answers[0].source.splitlines()[-1].strip()[:60]
    assert first not in release, f"labs/{lab}: the release holds the sample answers"


@pytest.mark.parametrize("lab", LABS)
def test_hints_are_collapsed(lab):
    text = (ROOT / "solutions" / f"{lab}.py").read_text()
    assert text.count("<details>") == text.count("</details>") >= 1, \
        f"{lab}: every exercise's hints go in <details> sections"
