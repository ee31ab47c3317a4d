"""The sample data in data/ is what scripts/make_sample_data.py makes, its digests are right,
minirl reads it, and its rewards are what the course's verifiers give each candidate."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import random
import shutil
from pathlib import Path

import pytest
import torch

import minirl
from minigpt import tasks

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "data"
REWARDED = DATA / "rev_rewarded.jsonl"


def _load_script():
    spec = importlib.util.spec_from_file_location("make_sample_data",
                                                  ROOT / "scripts" / "make_sample_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


script = _load_script()


def _lines() -> list[dict]:
    return [json.loads(line) for line in REWARDED.read_text().splitlines()]


def test_committed_files_are_the_scripts_output_byte_for_byte():
    files = script.sample_files()
    assert sorted(files) == ["SHA256SUMS", "rev_rewarded.jsonl"]
    for name, data in files.items():
        assert (DATA / name).read_bytes() == data, \
            f"data/{name} is not the script's output (rerun scripts/make_sample_data.py):\n" \
            + "\n".join(script.differences(files, DATA))
    assert script.sample_files() == files, "two runs of the script gave different bytes"


def test_sha256sums_and_readme_hold_the_committed_files_digests():
    lines = (DATA / "SHA256SUMS").read_text().splitlines()
    recorded = {name: digest for digest, name in (line.split("  ", 1) for line in lines)}
    assert sorted(recorded) == ["rev_rewarded.jsonl"]
    readme = (DATA / "README.md").read_text()
    for name, digest in recorded.items():
        actual = hashlib.sha256((DATA / name).read_bytes()).hexdigest()
        assert actual == digest, f"data/{name} has sha256 {actual}, data/SHA256SUMS " \
                                 f"records {digest}"
        assert f"{digest}  {name}" in readme, f"data/README.md does not quote {name}'s digest"


def test_files_stay_small():
    for path in DATA.iterdir():
        assert path.stat().st_size < 20_000, f"{path} is {path.stat().st_size} bytes"


def test_every_line_parses_through_minirl():
    records = minirl.read_rewarded_jsonl(REWARDED)
    raw = _lines()
    assert len(records) == len(raw) >= 30
    assert records.prompts == [r["prompt"] for r in raw]
    assert records.answers == [r["answer"] for r in raw]
    assert records.rewards.tolist() == [r["reward"] for r in raw]
    partial = minirl.read_rewarded_jsonl(REWARDED, reward_field="partial_credit")
    assert partial.rewards.tolist() == [r["partial_credit"] for r in raw]
    assert set(raw[0]) == {"prompt", "answer", "reward", "partial_credit", "kind"}


def test_rewards_are_the_verifiers_on_the_tasks_own_answer():
    train = {ex.prompt for ex in tasks.make_examples(tasks.HELD_OUT, 2000, seed=0)}
    for n, r in enumerate(_lines(), start=1):
        prompt, answer = r["prompt"], r["answer"]
        assert prompt in train, f"line {n}: {prompt} is not among Lab 05's 2000 rev examples"
        right = prompt[len("rev:"):-1][::-1]          # the word reversed, derived here
        ex = tasks.Example(tasks.HELD_OUT, prompt, right)
        where = f"line {n}: answer {answer!r} to {prompt} (right: {right!r})"
        assert r["reward"] == minirl.exact_match(ex, answer) == float(answer == right), \
            f"{where}: reward {r['reward']}, minirl.exact_match gives " \
            f"{minirl.exact_match(ex, answer)}"
        hits = sum(a == b for a, b in zip(right, answer, strict=False))
        assert r["partial_credit"] == minirl.partial_credit(ex, answer) \
            == hits / max(len(right), len(answer)), \
            f"{where}: partial_credit {r['partial_credit']}, minirl.partial_credit gives " \
            f"{minirl.partial_credit(ex, answer)}"
        assert (r["kind"] == "correct") == (r["reward"] == 1.0), \
            f"{where}: kind {r['kind']!r} but reward {r['reward']}"


def test_groups_with_and_without_reward_variance():
    records = minirl.read_rewarded_jsonl(REWARDED)
    spread = [records.rewards[records.groups == g].unique().numel() > 1
              for g in records.groups.unique()]
    assert any(spread) and not all(spread), spread
    kinds = {r["kind"] for r in _lines()}
    assert {"correct", "copied", "swapped", "dropped", "unrelated"} <= kinds
    w = minirl.group_weights(records.rewards, records.groups)
    for g, has_spread in zip(records.groups.unique().tolist(), spread, strict=True):
        assert bool(w[records.groups == g].any()) == has_spread
    data = minirl.rewarded_sequence_data(records)
    assert torch.equal(data.weights, w) and len(data) == len(records)


def test_check_passes_on_a_copy_and_names_an_edited_reward(tmp_path, capsys):
    copy = tmp_path / "data"
    shutil.copytree(DATA, copy)
    assert script.main(["--check", "--out", str(copy)]) == 0
    lines = (copy / "rev_rewarded.jsonl").read_text().splitlines()
    record = json.loads(lines[4])
    record["reward"] = 1.0 - record["reward"]
    lines[4] = json.dumps(record)
    (copy / "rev_rewarded.jsonl").write_text("\n".join(lines) + "\n")
    minirl.read_rewarded_jsonl(copy / "rev_rewarded.jsonl")     # still a valid file
    capsys.readouterr()
    assert script.main(["--check", "--out", str(copy)]) == 1
    err = capsys.readouterr().err
    assert f"rev_rewarded.jsonl, line 5: 'reward' is {record['reward']!r} in the file, the " \
           f"script gives {1.0 - record['reward']!r}" in err, err
    assert "its sha256 is not the one" in err and "SHA256SUMS" in err, err


def test_check_names_a_missing_file_and_a_stale_digest(tmp_path, capsys):
    script.write(script.sample_files(), tmp_path)
    (tmp_path / "SHA256SUMS").write_text("0" * 64 + "  rev_rewarded.jsonl\n")
    assert script.main(["--check", "--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert "SHA256SUMS, line 1" in err and "its sha256 is not the one" in err, err
    (tmp_path / "rev_rewarded.jsonl").unlink()
    assert script.main(["--check", "--out", str(tmp_path)]) == 1
    assert "rev_rewarded.jsonl is missing" in capsys.readouterr().err


def test_writing_makes_the_committed_files(tmp_path):
    assert script.main(["--out", str(tmp_path / "new")]) == 0
    for name in ("rev_rewarded.jsonl", "SHA256SUMS"):
        assert (tmp_path / "new" / name).read_bytes() == (DATA / name).read_bytes()
    assert sorted(p.name for p in (tmp_path / "new").iterdir()) == ["SHA256SUMS",
                                                                   "rev_rewarded.jsonl"]


@pytest.mark.parametrize("kind", ["copied", "swapped", "dropped", "unstopped", "substituted",
                                  "unrelated", "empty"])
def test_every_corruption_is_a_wrong_answer(kind):
    rng = random.Random(0)
    for ex in script.sample_prompts(30, seed=1):
        assert script.CORRUPTIONS[kind](ex.answer, rng) != ex.answer, (kind, ex)
