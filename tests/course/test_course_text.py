"""What the course's text promises: runtimes from the measured table, in markers that never
split a paragraph, links that open a file, sample answers for instructors that never reach
learners, and help that stays collapsed until asked for."""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote

import jupytext
import pytest

from course.__main__ import main
from course.authoring import reflection
from course.authoring.build import INSTRUCTOR_TAG, lab_names
from course.authoring.runtimes import (
    fill,
    line_start_markers,
    misplaced_markers,
    problems,
    typed_claims,
    write,
)
from course.learner import released_labs
from labkit.errors import InputError

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


MARKER = "<!-- runtime:02-nf4 -->about 9 s<!-- /runtime -->"


def test_no_runtime_marker_starts_a_line():
    """Rule: a marker that starts a line opens an HTML block and splits its paragraph."""
    assert misplaced_markers(ROOT) == []


@pytest.mark.parametrize(("name", "text"), [
    ("guide.md", f"The whole notebook runs in\n{MARKER}.\n"),
    ("guide.md", f"- Stay on the CPU; the whole notebook runs in\n  {MARKER}.\n"),
    ("guide.md", f"Intro.\n\n- {MARKER} for the solution.\n"),
    ("guide.md", f"> Quoted: the notebook runs in\n> {MARKER}.\n"),
    ("lab.py", f"# %% [markdown]\n# The whole notebook runs in\n# {MARKER}.\n"),
    ("lab.py", f"# %% [markdown]\n# - The notebook runs in\n#   {MARKER}.\n"),
])
def test_a_marker_starting_a_line_is_caught(name, text):
    assert line_start_markers(Path(name), text) == [text.count("\n", 0, text.index("<!--")) + 1]


@pytest.mark.parametrize(("name", "text"), [
    ("guide.md", f"The whole notebook\nruns in {MARKER}.\n"),
    ("guide.md", f"- Stay on the CPU; the whole notebook\n  runs in {MARKER}.\n"),
    ("lab.py", f"# %% [markdown]\n# The whole notebook\n# runs in {MARKER}.\n"),
])
def test_a_marker_after_a_word_is_accepted(name, text):
    assert line_start_markers(Path(name), text) == []


def test_the_writer_refuses_a_marker_that_starts_a_line(tmp_path, capsys):
    """Rule: `make times` names file and line and writes nothing while a marker starts one."""
    guide = tmp_path / "labs" / "02-nf4" / "README.md"
    guide.parent.mkdir(parents=True)
    guide.write_text(f"# Lab 02\n\nThe whole notebook runs in\n{MARKER}.\n")
    for other in ("README.md", "RESULTS.md", "experiments/README.md", "labs/INSTRUCTORS.md"):
        (tmp_path / other).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / other).write_text("# Notes\n")
    table = {"cores": 2, "labs": {"02-nf4": {"seconds": 5.0}}}
    (tmp_path / "labs" / "runtimes.json").write_text(json.dumps(table))
    found = misplaced_markers(tmp_path)
    assert len(found) == 1 and found[0].startswith("labs/02-nf4/README.md:4: a runtime marker "
                                                   "starts the line"), found
    assert found[0] in problems(tmp_path, ["02-nf4"])
    with pytest.raises(InputError, match="README.md:4"):
        write(tmp_path, {**table, "cores": 16})
    assert "about 9 s" in guide.read_text()
    assert json.loads((tmp_path / "labs" / "runtimes.json").read_text()) == table
    assert main(["times", "--root", str(tmp_path), "02-nf4"]) == 2     # before measuring
    assert "labs/02-nf4/README.md:4: a runtime marker starts the line" in capsys.readouterr().err


# A relative link: inline `[text](target)` or `![alt](target)`, `href="target"`, or a
# reference definition `[id]: target`; code spans and fenced code are cut out first.
LINKS = re.compile(r"\]\(\s*<?([^)\s>]+)|href=\"([^\"]+)\"|^\s*\[[^\]]+\]:\s*<?([^\s>]+)", re.M)
CODE = re.compile(r"```.*?```|`[^`\n]*`", re.S)


def relative_links(markdown: str) -> list[str]:
    """The links of `markdown` to a path (no scheme, not an anchor of the page itself),
    without their #fragment or ?query, %-escapes decoded."""
    targets = ["".join(groups) for groups in LINKS.findall(CODE.sub("", markdown))]
    return [unquote(re.split(r"[#?]", t)[0]) for t in targets
            if not re.match(r"[a-zA-Z][\w+.-]*:|#", t)]


def broken_link(base: Path, link: str) -> str | None:
    """Why `link`, opened from folder `base` of the served checkout, opens no file (or None):
    a folder opens an error dialog in JupyterLab. A learner's copy work/NN-name.ipynb counts
    as a file for every released lab."""
    target = (ROOT / link.lstrip("/") if link.startswith("/") else base / link).resolve()
    if not target.is_relative_to(ROOT):
        return "leaves the checkout"
    if target.parent == ROOT / "work" and target.stem in released_labs(ROOT):
        return None
    return None if target.is_file() else "is a folder" if target.is_dir() else "resolves to nothing"


def test_relative_links_open_a_file():
    """Rule: every relative link of a lab guide and of a notebook's markdown opens a file,
    never a folder or nothing. A notebook's links are read from its release folder
    labs/NN-name/ and from the learner's copy's folder work/: both must open."""
    sources = [(guide, guide.read_text(), [guide.parent])
               for guide in sorted(ROOT.glob("labs/*/README.md"))]
    sources += [(ROOT / "solutions" / f"{lab}.py",
                 "\n\n".join(c.source for c in jupytext.read(
                     ROOT / "solutions" / f"{lab}.py", fmt="py:percent").cells
                     if c.cell_type == "markdown"), [ROOT / "labs" / lab, ROOT / "work"])
                for lab in LABS]
    bad = [f"{path.relative_to(ROOT)}: ({link}) {why} from {base.relative_to(ROOT)}/"
           for path, text, bases in sources for link in relative_links(text)
           for base in bases if (why := broken_link(base, link))]
    assert bad == [], "a relative link must open a file, not a folder:\n" + "\n".join(bad)


def test_link_rule_catches_folders_and_nothing():
    links = relative_links("[a](../../experiments) · [b](../../src/x.md#top) "
                           '[c](https://example.org) <a href="../../nope.md">d</a> '
                           "`kernel[grid](x)` [e](#here)\n\n[f]: ../../experiments/\n")
    assert links == ["../../experiments", "../../src/x.md", "../../nope.md",
                     "../../experiments/"]
    base = ROOT / "labs" / LABS[0]
    assert [broken_link(base, link) for link in links] == [
        "is a folder", "resolves to nothing", "resolves to nothing", "is a folder"]
    assert broken_link(base, "README.md") is None
    assert broken_link(base, f"../../work/{LABS[0]}.ipynb") is None


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


def test_guides_and_notebooks_share_one_reflection_list():
    assert not reflection.stale(ROOT, LABS), \
        f"`make course` copies each notebook's questions into {reflection.stale(ROOT, LABS)}"


def test_a_guide_that_differs_from_its_notebook_is_caught(tmp_path):
    (tmp_path / "solutions").mkdir()
    (tmp_path / "labs" / "99-toy").mkdir(parents=True)
    (tmp_path / "solutions" / "99-toy.py").write_text(
        "# %% [markdown]\n# ### Reflection\n#\n# 1. Why?\n# 2. How?\n")
    guide = tmp_path / "labs" / "99-toy" / "README.md"
    guide.write_text("## Reflection questions\n\n<!-- reflection:99-toy -->\n1. Why?\n"
                     "<!-- /reflection -->\n")
    assert reflection.stale(tmp_path, ["99-toy"]) == ["labs/99-toy/README.md"]
    assert reflection.write(tmp_path, ["99-toy"]) == ["labs/99-toy/README.md"]
    assert "1. Why?\n2. How?\n<!-- /reflection -->" in guide.read_text()
    assert reflection.stale(tmp_path, ["99-toy"]) == []
    guide.write_text("## Reflection questions\n\n1. Why?\n")       # no block at all
    assert reflection.stale(tmp_path, ["99-toy"]) == ["labs/99-toy/README.md"]


@pytest.mark.parametrize("lab", LABS)
def test_hints_are_collapsed(lab):
    text = (ROOT / "solutions" / f"{lab}.py").read_text()
    assert text.count("<details>") == text.count("</details>") >= 1, \
        f"{lab}: every exercise's hints go in <details> sections"
