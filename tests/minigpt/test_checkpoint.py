"""minigpt.checkpoint: where the base checkpoints are found, and the atomic writer that
minigpt's and minituner's files go through."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from minigpt import base_dir, base_path
from minigpt.atomic import atomic_path
from minigpt.checkpoint import BASE_DIR_ENV

ROOT = Path(__file__).resolve().parents[2]


def test_base_path_defaults_to_experiment_00(monkeypatch):
    monkeypatch.delenv(BASE_DIR_ENV, raising=False)
    assert base_dir() == ROOT / "experiments" / "00-pretrain-base"
    assert base_path("moe") == ROOT / "experiments" / "00-pretrain-base" / "base_moe.safetensors"


def test_base_dir_setting_moves_every_base(monkeypatch, tmp_path):
    monkeypatch.setenv(BASE_DIR_ENV, str(tmp_path))
    assert base_dir() == tmp_path
    assert [base_path(n) for n in ("dense", "moe")] == [tmp_path / "base_dense.safetensors",
                                                        tmp_path / "base_moe.safetensors"]


def test_load_base_reads_the_setting(tmp_path):
    """In a fresh process, as a learner would set it: load_base looks only there."""
    env = {**os.environ, BASE_DIR_ENV: str(tmp_path)}
    done = subprocess.run([sys.executable, "-c", "import minigpt; minigpt.load_base('dense')"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert f"checkpoint not found: {tmp_path / 'base_dense.safetensors'}" in done.stderr


@pytest.mark.parametrize("name", ["Dense", "", "base_dense"])
def test_base_path_bad_name(name):
    with pytest.raises(ValueError, match="name must be one of"):
        base_path(name)


def test_atomic_file_replaces_or_leaves_alone(tmp_path):
    path = tmp_path / "sub" / "f.txt"
    with atomic_path(path) as tmp:
        assert tmp.parent == path.parent and tmp != path
        tmp.write_text("one")
    assert path.read_text() == "one"
    with pytest.raises(OSError, match="disk full"), atomic_path(path) as tmp:
        tmp.write_text("half")
        raise OSError("disk full")
    assert path.read_text() == "one"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.txt"]   # no temporary left
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_atomic_directory_swaps_in_whole(tmp_path):
    path = tmp_path / "ckpt"
    for text in ("first", "second"):
        with atomic_path(path, directory=True) as tmp:
            assert tmp.is_dir() and not any(tmp.iterdir())
            (tmp / "a").write_text(text)
            (tmp / "b").write_text(text)
        assert {p.name: p.read_text() for p in path.iterdir()} == {"a": text, "b": text}
    with pytest.raises(RuntimeError, match="crash"), atomic_path(path, directory=True) as tmp:
        (tmp / "a").write_text("torn")
        raise RuntimeError("crash")
    assert {p.name: p.read_text() for p in path.iterdir()} == {"a": "second", "b": "second"}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]       # no .old, no .tmp
