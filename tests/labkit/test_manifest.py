"""labkit.manifest (write, read, verify, environment) and labkit.atomic."""

from __future__ import annotations

import json
import os
import pathlib
import platform
import re

import numpy as np
import pytest
import torch

from labkit import ManifestError, read_manifest, write_manifest
from labkit.atomic import atomic_path, atomic_write_text
from labkit.hashing import sha256_json
from labkit.manifest import REQUIRED, SCHEMA, environment, git_state, seal


def body(**overrides) -> dict:
    """Every field a manifest needs, except the two write_manifest adds."""
    m = {
        "experiment": "06-qlora-preview",
        "config": {"seed": 0, "lr": 3e-3, "steps": 10, "tasks": ["rev"],
                   "nested": {"b": 1, "a": None}},
        "seed": 0,
        "git": {"commit": "abc123", "dirty": False},
        "code": {"06-qlora-preview/experiment.py": "3" * 64},
        "env": {"python": "3.11.7", "torch": "2.13.0"},
        "data": {"train": "0" * 64},
        "inputs": {"base": "1" * 64},
        "artifacts": {"adapter": "2" * 64},
        "metrics": {"accuracy": 0.8125, "loss": 0.123456789012345, "n": 200},
        "wall_time_s": 12.5,
        "peak_memory_mb": 301.25,
    }
    m.update(overrides)
    return m


def dump(path, obj):
    path.write_text(json.dumps(obj, indent=2), encoding="utf-8")


def test_round_trip(tmp_path):
    path = tmp_path / "manifest.json"
    written = write_manifest(path, body())
    assert written["schema"] == SCHEMA
    assert written["manifest_sha256"] == sha256_json(
        {k: v for k, v in written.items() if k != "manifest_sha256"})
    assert set(REQUIRED) <= set(written)
    got = read_manifest(path)
    assert got == written
    assert got["metrics"]["loss"] == 0.123456789012345        # floats survive exactly
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json"]


def test_write_creates_parent_and_overwrites(tmp_path):
    path = tmp_path / "a" / "b" / "manifest.json"
    write_manifest(path, body(seed=1))
    write_manifest(path, body(seed=2))
    assert read_manifest(path)["seed"] == 2


def test_write_ignores_a_stale_self_hash(tmp_path):
    path = tmp_path / "m.json"
    write_manifest(path, body(manifest_sha256="f" * 64))
    assert read_manifest(path)["manifest_sha256"] != "f" * 64


@pytest.mark.parametrize("edit", [
    lambda m: m["metrics"].__setitem__("accuracy", 0.99),
    lambda m: m["metrics"].__setitem__("loss", m["metrics"]["loss"] + 1e-12),
    lambda m: m.__setitem__("seed", 1),
    lambda m: m["config"].__setitem__("lr", 1e-3),
    lambda m: m["git"].__setitem__("dirty", True),
    lambda m: m.__setitem__("wall_time_s", 1.0),
    lambda m: m.__setitem__("extra", "field"),
    lambda m: m["config"]["nested"].pop("a"),
    lambda m: m.__setitem__("manifest_sha256", "0" * 64),
])
def test_edited_manifest_is_refused(tmp_path, edit):
    path = tmp_path / "manifest.json"
    write_manifest(path, body())
    m = json.loads(path.read_text())
    edit(m)
    dump(path, m)
    with pytest.raises(ManifestError, match="edited"):
        read_manifest(path)


def test_reformatting_is_not_an_edit(tmp_path):
    path = tmp_path / "manifest.json"
    write_manifest(path, body())
    m = json.loads(path.read_text())
    path.write_text(json.dumps(dict(reversed(list(m.items()))), separators=(",", ":")))
    assert read_manifest(path) == m


def test_missing_file(tmp_path):
    with pytest.raises(ManifestError, match="not found"):
        read_manifest(tmp_path / "manifest.json")
    with pytest.raises(ManifestError, match="not found"):
        read_manifest(tmp_path)                                 # a directory is not a manifest


@pytest.mark.parametrize("text", ["", "{", "{'a': 1}", "not json", "\xff\xfe"])
def test_invalid_json(tmp_path, text):
    path = tmp_path / "manifest.json"
    path.write_bytes(text.encode("latin-1"))
    with pytest.raises(ManifestError, match="not valid JSON"):
        read_manifest(path)


@pytest.mark.parametrize("value", [[], [1, 2], "manifest", 3, None])
def test_not_an_object(tmp_path, value):
    path = tmp_path / "manifest.json"
    dump(path, value)
    with pytest.raises(ManifestError, match="JSON object"):
        read_manifest(path)


@pytest.mark.parametrize("field", ["metrics", "seed", "manifest_sha256", "schema", "env"])
def test_missing_field(tmp_path, field):
    path = tmp_path / "manifest.json"
    m = write_manifest(path, body())
    del m[field]
    dump(path, m)
    with pytest.raises(ManifestError, match=f"missing fields.*'{field}'"):
        read_manifest(path)


def test_write_refuses_missing_fields(tmp_path):
    b = body()
    del b["metrics"], b["inputs"]
    with pytest.raises(ManifestError, match="missing fields.*'inputs'.*'metrics'"):
        write_manifest(tmp_path / "m.json", b)
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("schema", [0, 3, "1", None])
def test_wrong_schema(tmp_path, schema):
    path = tmp_path / "manifest.json"
    dump(path, seal({**body(), "schema": schema}))   # correctly sealed: only the schema is off
    with pytest.raises(ManifestError, match="schema"):
        read_manifest(path)


@pytest.mark.parametrize("overrides, message", [
    ({"config": {"lr": 1}}, "'config' has no 'seed'"),
    ({"config": [0]}, "'config' must be a JSON object, got a list"),
    ({"artifacts": ["adapter"]}, "'artifacts' must be a JSON object, got a list"),
    ({"artifacts": {"../../etc/hostname": "2" * 64}}, "artifact path '../../etc/hostname'"),
    ({"artifacts": {"/etc/hostname": "2" * 64}}, "artifact path '/etc/hostname'"),
    ({"inputs": {"/etc/hostname": "1" * 64}}, "input path '/etc/hostname' must be relative"),
    ({"data": {"train": None}}, "'data' must map names to sha256 strings; 'train' does not"),
])
def test_malformed_fields_are_refused_on_write_and_read(tmp_path, overrides, message):
    path = tmp_path / "manifest.json"
    with pytest.raises(ManifestError, match=re.escape(message)):
        write_manifest(path, body(**overrides))
    assert not any(tmp_path.iterdir())
    dump(path, seal({**body(**overrides), "schema": SCHEMA}))     # sealed, so only the shape
    with pytest.raises(ManifestError, match=re.escape(message)):
        read_manifest(path)


def test_inputs_may_name_a_sibling_experiment(tmp_path):
    path = tmp_path / "manifest.json"
    m = write_manifest(path, body(inputs={"../00-pretrain-base/base_dense.safetensors": "1" * 64}))
    assert read_manifest(path) == m


def test_manifest_error_is_a_value_error():
    assert issubclass(ManifestError, ValueError)


# ---------------------------------------------------------------------------------------------
# atomicity


def test_write_is_atomic_when_rename_fails(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    old = write_manifest(path, body(seed=1))
    old_text = path.read_text()

    def boom(src, dst):
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk gone"):
        write_manifest(path, body(seed=2))
    monkeypatch.undo()
    assert path.read_text() == old_text
    assert read_manifest(path) == old
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_write_is_atomic_when_writing_crashes_halfway(tmp_path, monkeypatch):
    path = tmp_path / "manifest.json"
    old = write_manifest(path, body(seed=1))
    real_write_text = pathlib.Path.write_text

    def half_then_crash(self, data, *args, **kwargs):
        real_write_text(self, data[: len(data) // 2], *args, **kwargs)
        raise KeyboardInterrupt("killed mid-write")

    monkeypatch.setattr(pathlib.Path, "write_text", half_then_crash)
    with pytest.raises(KeyboardInterrupt):
        write_manifest(path, body(seed=2))
    monkeypatch.undo()
    assert read_manifest(path) == old
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_write_fails_before_touching_disk_on_unserialisable(tmp_path):
    path = tmp_path / "manifest.json"
    old = write_manifest(path, body(seed=1))
    with pytest.raises(TypeError):
        write_manifest(path, body(metrics={"acc": torch.tensor(0.5)}))
    assert read_manifest(path) == old
    assert [p.name for p in tmp_path.iterdir()] == ["manifest.json"]


def test_atomic_path_leaves_original_on_exception(tmp_path):
    path = tmp_path / "out.txt"
    path.write_text("original")
    with pytest.raises(RuntimeError, match="halfway"), atomic_path(path) as tmp:
        assert tmp.parent == path.parent and tmp != path
        tmp.write_text("partial new cont")
        raise RuntimeError("halfway")
    assert path.read_text() == "original"
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_atomic_path_without_original(tmp_path):
    path = tmp_path / "sub" / "new.bin"
    with pytest.raises(ValueError), atomic_path(path) as tmp:
        tmp.write_bytes(b"x")
        raise ValueError
    assert not path.exists()
    assert list(path.parent.iterdir()) == []


def test_atomic_path_replaces_on_success(tmp_path):
    path = tmp_path / "out.npy"
    path.write_text("old")
    with atomic_path(path) as tmp:
        assert path.read_text() == "old"       # not visible until the block ends
        with open(tmp, "wb") as f:
            np.save(f, np.arange(3))
    np.testing.assert_array_equal(np.load(path), np.arange(3))
    atomic_write_text(path, "héllo\n")
    assert path.read_text(encoding="utf-8") == "héllo\n"
    assert [p.name for p in tmp_path.iterdir()] == ["out.npy"]


def test_atomic_write_keeps_normal_permissions(tmp_path):
    umask = os.umask(0o022)
    try:
        plain = tmp_path / "plain.txt"
        plain.write_text("x")
        atomic_write_text(tmp_path / "atomic.txt", "x")
    finally:
        os.umask(umask)
    assert (tmp_path / "atomic.txt").stat().st_mode & 0o777 == plain.stat().st_mode & 0o777


# ---------------------------------------------------------------------------------------------
# environment and git


def test_environment_fields():
    env = environment()
    for key in ("python", "torch", "triton", "bitsandbytes", "numpy", "safetensors",
                "platform", "cpu", "cpu_id", "threads", "numerics", "device"):
        assert key in env, key
    assert env["python"] == platform.python_version()
    assert env["torch"] == torch.__version__
    assert env["numpy"] == np.__version__
    assert env["threads"] == torch.get_num_threads()
    expected_device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    assert env["device"] == expected_device
    assert all(isinstance(v, str) and v for k, v in env.items()
               if k not in ("threads", "cpu_id", "numerics"))
    assert env["numerics"]["intra_op_threads"] == torch.get_num_threads()
    assert env["numerics"]["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    json.dumps(env)                                              # JSON-able as is


def test_git_state_outside_a_repo(tmp_path):
    assert git_state(tmp_path) == {"commit": "unknown", "dirty": True}


def test_artifact_files_records_every_file_of_a_folder(tmp_path):
    from labkit import RunContext
    ctx = RunContext(exp_dir=tmp_path, out_dir=tmp_path)
    (tmp_path / "adapter" / "sub").mkdir(parents=True)
    for name in ("b.json", "a.safetensors", "sub/c.bin"):
        (tmp_path / "adapter" / name).write_text(name)
    assert ctx.artifact_files("adapter") == ["adapter/a.safetensors", "adapter/b.json",
                                             "adapter/sub/c.bin"]
    assert ctx.artifacts == ["adapter/a.safetensors", "adapter/b.json", "adapter/sub/c.bin"]
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no file"):
        ctx.artifact_files("empty")
    with pytest.raises(ManifestError, match="climbs out|relative"):
        ctx.artifact_files("../elsewhere")
