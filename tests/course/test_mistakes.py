"""The mistakes catalogue (course.authoring.mistakes): every exercise has plausible mistakes
that apply to its solution, the recorded verdicts are current, and the runner tells a
visible, named catch from an unnamed, hidden-only or missed one on a toy lab."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from course.authoring import mistakes
from course.authoring.build import lab_names
from labkit.errors import InputError

ROOT = Path(__file__).resolve().parents[2]
LABS = lab_names(ROOT)
# Catalogues whose recorded run is still to come, and why; `check-mistakes --write LAB` ends it.
@pytest.mark.parametrize("lab", LABS)
def test_catalogue_applies_and_covers_every_exercise(lab):
    assert not mistakes.problems(ROOT, lab), "\n".join(mistakes.problems(ROOT, lab))
    assert not mistakes.shortfall(ROOT, lab), "\n".join(mistakes.shortfall(ROOT, lab))


@pytest.mark.parametrize("lab", LABS)
def test_recorded_verdicts_are_current_and_visible(lab):
    path = mistakes.table_path(ROOT, lab)
    assert path.is_file(), f"{path.relative_to(ROOT)} is missing: run " \
        f"`python -m course check-mistakes --write {lab}`"
    table = json.loads(path.read_text())
    assert table["sources"] == mistakes.sources_sha256(ROOT, lab), (
        f"solutions/{lab}.py or its catalogue changed since {path.relative_to(ROOT)} was "
        f"recorded: run `python -m course check-mistakes --write {lab}`")
    names = [(m.exercise, m.name) for m in mistakes.load(ROOT, lab)]
    assert [(r["exercise"], r["name"]) for r in table["mistakes"]] == names
    left = [f"{r['exercise']}: {r['name']} ({r['verdict']})" for r in table["mistakes"]
            if r["verdict"] != "visible" and not r["left"]]
    assert not left, f"{lab}: mistakes no visible test catches by naming its rule, and no " \
        "`left` reason given:\n  " + "\n  ".join(left)


def test_guide_blocks_match_the_recorded_verdicts():
    assert not mistakes.stale_blocks(ROOT), \
        f"run `python -m course check-mistakes --fill`: {mistakes.stale_blocks(ROOT)}"


TOY = '''\
# %% [markdown]
# # Toy lab

# %%
import math

@solution mean
def mean(xs, eps=0.0):
    ### BEGIN SOLUTION
    return sum(xs) / len(xs) + eps
    ### END SOLUTION

@test test_mean
assert mean([1, 2, 3, 4]) == 2.5, f"divide by the count (len), got {mean([1, 2, 3, 4])}"
assert mean([2, 2]) == 2, "two values"
### BEGIN HIDDEN TESTS
# case: eps other than the default
assert mean([1], eps=1) == 2
### END HIDDEN TESTS

@solution later
def later():
    ### BEGIN SOLUTION
    return 1
    ### END SOLUTION

@test test_later
assert later() == 1
'''



def _header(m: re.Match) -> str:
    """A percent-format cell header with nbgrader's metadata for `@solution id` / `@test id`."""
    test = m[1] == "test"
    meta = {"grade": test, "grade_id": m[2], "locked": test, **({"points": 1} if test else {}),
            "schema_version": 3, "solution": not test, "task": False}
    return f"# %% nbgrader={json.dumps(meta)}"


TOY = re.sub(r"^@(solution|test) (\w+)$", _header, TOY, flags=re.MULTILINE)

CATALOGUE = '''\
[[mistake]]
exercise = "mean"
name = "divides by one less"
rule = "count"
find = "/ len(xs)"
replace = "/ (len(xs) - 1)"

[[mistake]]
exercise = "mean"
name = "a constant answer"
rule = "nowhere in any message"
find = "sum(xs) / len(xs) + eps"
replace = "2.5 + eps"

[[mistake]]
exercise = "mean"
name = "ignores eps"
rule = "eps"
find = " + eps"
replace = ""

[[mistake]]
exercise = "mean"
name = "harmless"
rule = "anything"
find = "sum(xs) / len(xs)"
replace = "math.fsum(xs) / len(xs)"
left = "the same numbers"

[[mistake]]
exercise = "mean"
name = "crashes the process"
rule = "process crashed"
find = "return sum(xs) / len(xs) + eps"
replace = "import os; os._exit(1)"
'''


@pytest.fixture
def toy(tmp_path):
    (tmp_path / "solutions" / "mistakes").mkdir(parents=True)
    (tmp_path / "labs" / "99-toy").mkdir(parents=True)
    (tmp_path / "solutions" / "99-toy.py").write_text(TOY)
    (tmp_path / "solutions" / "mistakes" / "99-toy.toml").write_text(CATALOGUE)
    return tmp_path


def test_verdicts_on_a_toy_lab(toy):
    got = {m.name: mistakes.judge(toy, m, timeout=60) for m in mistakes.load(toy, "99-toy")}
    assert {k: r.verdict for k, r in got.items()} == {
        "divides by one less": "visible", "a constant answer": "unnamed",
        "ignores eps": "hidden", "harmless": "missed", "crashes the process": "visible"}
    assert got["divides by one less"].test == "test_mean"
    assert "divide by the count" in got["divides by one less"].message
    assert got["harmless"].left == "the same numbers"
    assert got["crashes the process"].message == \
        "DeadKernelError: the Python process crashed in this test"
    # the later exercise's tests are not run: a mistake is caught by its own exercise's tests
    assert mistakes.apply(mistakes.source_notebook(toy / "solutions" / "99-toy.py"),
                          mistakes.load(toy, "99-toy")[0])[1] == 3
    assert mistakes.shortfall(toy, "99-toy") == [
        "99-toy: exercise 'later' has 0 catalogued mistake(s); at least 3 are needed"]


def test_record_and_fill_the_guides(toy):
    guide = toy / "labs" / "99-toy" / "README.md"
    guide.write_text("# Toy\n\nsee <!-- mistakes:99-toy -->\n<!-- /mistakes -->\n")
    (toy / "labs" / "INSTRUCTORS.md").write_text("<!-- mistakes:summary -->\n<!-- /mistakes -->\n")
    rows = [mistakes.Result("99-toy", "mean", "ignores eps", "hidden", "test_mean", "m", ""),
            mistakes.Result("99-toy", "mean", "harmless", "missed", "", "", "same numbers")]
    mistakes.record(toy, rows)
    text = guide.read_text()
    assert "2 catalogued mistakes: 0 caught by a visible test" in text
    assert "| `mean` | harmless | **nothing** (same numbers) |" in text
    assert "| 99-toy | 2 | 0 | 0 | 1 | 1 |" in (toy / "labs" / "INSTRUCTORS.md").read_text()
    assert mistakes.stale_blocks(toy) == []
    guide.write_text(text.replace("harmless", "edited"))
    assert mistakes.stale_blocks(toy) == ["labs/99-toy/README.md"]


@pytest.mark.parametrize("entry, message", [
    ('exercise = "nope"\nname = "x"\nrule = "r"\nfind = "/ len(xs)"\nreplace = ""',
     "names exercise 'nope'; the lab's exercises are ['mean', 'later']"),
    ('exercise = "mean"\nname = "x"\nrule = "r"\nfind = "not there"\nreplace = ""',
     "`find` occurs 0 times"),
    ('exercise = "mean"\nname = "x"\nrule = "r"\nfind = "xs"\nreplace = ""',
     "`find` occurs 2 times"),
    ('exercise = "mean"\nname = "x"\nrule = "r"\nfind = "import math"\nreplace = ""',
     "`find` occurs 0 times"),       # outside every solution region
])
def test_a_patch_that_does_not_apply_once_is_named(toy, entry, message):
    (toy / "solutions" / "mistakes" / "99-toy.toml").write_text(f"[[mistake]]\n{entry}\n")
    assert any(message in p for p in mistakes.problems(toy, "99-toy"))


@pytest.mark.parametrize("entry, message", [
    ('exercise = "mean"\nname = "x"\nfind = "a"\nreplace = ""', "missing or empty: ['rule']"),
    ('exercise = "mean"\nname = "x"\nrule = "r"\nfind = "a"\nreplace = ""\nwhy = "?"',
     "unknown keys: ['why']"),
    ('exercise = "mean"\nname = "x"\nrule = " "\nfind = "a"\nreplace = ""',
     "missing or empty: ['rule']"),
])
def test_a_malformed_entry_is_named(toy, entry, message):
    (toy / "solutions" / "mistakes" / "99-toy.toml").write_text(f"[[mistake]]\n{entry}\n")
    with pytest.raises(InputError, match=r"99-toy.toml: mistake 1 \('x'\)") as e:
        mistakes.load(toy, "99-toy")
    assert message in str(e.value)


def test_the_command_refuses_an_unknown_lab(toy):
    with pytest.raises(InputError, match=r"unknown lab\(s\) \['00-nope'\]; available: "
                       r"\['99-toy'\]"):
        mistakes.check_mistakes(toy, ["00-nope"])


def test_first_runs_one_mistake_per_exercise_and_records_nothing(toy, capsys):
    with pytest.raises(InputError, match="cannot --write"):
        mistakes.check_mistakes(toy, ["99-toy"], write=True, first=True)
    assert mistakes.check_mistakes(toy, ["99-toy"], first=True) is True     # only 'mean''s first
    out = capsys.readouterr().out
    assert "divides by one less" in out and "ignores eps" not in out
    assert not mistakes.table_path(toy, "99-toy").exists()


def test_the_record_follows_the_code_a_run_goes_through(toy):
    """Text (refilled by `make times`) and jupyter-only cells (skipped, as when graded) do
    not stale a record; a code cell or the catalogue does."""
    source = toy / "solutions" / "99-toy.py"
    digest = mistakes.sources_sha256(toy, "99-toy")
    source.write_text(source.read_text() + "\n# %% [markdown]\n# runs in 3 s\n"
                      '\n# %% tags=["jupyter-only"]\nprint(mean([1]))\n')
    assert mistakes.sources_sha256(toy, "99-toy") == digest
    source.write_text(source.read_text() + "\n# %%\nprint(mean([1]))\n")
    assert mistakes.sources_sha256(toy, "99-toy") != digest
