"""Bad input to `python -m labkit`: each case ends in one line on stderr and exit status 2, never
a traceback, and nothing outside the experiment folder is read or written."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from labkit.__main__ import main as labkit_main
from labkit.hashing import sha256_file
from labkit.manifest import seal

pytestmark = pytest.mark.usefixtures("restore_torch_determinism")


def main(argv: list[str]) -> int:
    """The CLI in this process: `--numerics native`, since the pinned mode would re-run each
    command in a child process (tests/labkit/test_numerics.py covers that path)."""
    pinnable = argv[0] in ("run", "reproduce", "fingerprint")
    return labkit_main([*argv, "--numerics", "native"] if pinnable else argv)

EXPERIMENT = '''
def run(cfg, ctx):
    ctx.artifact("w.bin").write_bytes(bytes(range(cfg["seed"], cfg["seed"] + 8)))
    return {"seed": cfg["seed"]}
'''


def make_experiment(root: Path, config, script: str = EXPERIMENT) -> Path:
    exp = root / "99-tiny"
    exp.mkdir()
    (exp / "experiment.py").write_text(script)
    (exp / "config.json").write_text(json.dumps(config))
    return exp


def fails_with(capsys, argv: list[str], message: str) -> None:
    """`main(argv)` exits 2 with exactly one stderr line, which contains `message`."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert message in err, err


@pytest.fixture
def manifest(tmp_path, capsys) -> Path:
    """The manifest of a tiny experiment run through the CLI."""
    exp = make_experiment(tmp_path, {"seed": 3})
    assert main(["run", str(exp)]) == 0, capsys.readouterr().err
    capsys.readouterr()
    return exp / "manifest.json"


def reseal(path: Path, edit) -> None:
    """Edit the manifest at `path` and seal it again, as a forger (or a careless tool) would."""
    m = json.loads(path.read_text())
    edit(m)
    path.write_text(json.dumps(seal(m)))


# ---------------------------------------------------------------------------------------------
# run


def test_run_on_a_file(tmp_path, capsys):
    exp = make_experiment(tmp_path, {"seed": 0})
    fails_with(capsys, ["run", str(exp / "experiment.py")], "is not an experiment folder")
    assert sorted(p.name for p in exp.iterdir()) == ["config.json", "experiment.py"]


def test_run_on_a_missing_folder(tmp_path, capsys):
    fails_with(capsys, ["run", str(tmp_path / "nope")], "is not an experiment folder")
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("config, message", [
    ([{"seed": 0}], "config.json must be a JSON object, got a list"),
    ("seed", "config.json must be a JSON object, got str 'seed'"),
    (0, "config.json must be a JSON object, got int 0"),
    (None, "config.json must be a JSON object, got NoneType None"),
    ({"lr": 1.0}, "config.json has no 'seed'"),
    ({"seed": "0"}, "must give an integer 'seed', got str '0'"),
    ({"seed": True}, "must give an integer 'seed', got bool True"),
    ({"seed": 0, "threads": 0}, "'threads' must be a positive integer, got int 0"),
    ({"seed": 0, "tolerances": {"default": {"rtol": -1}}}, "'tolerances' must map"),
    ({"seed": 0, "tolerances": [1]}, "'tolerances' must map"),
])
def test_run_with_a_bad_config(tmp_path, capsys, config, message):
    exp = make_experiment(tmp_path, config)
    fails_with(capsys, ["run", str(exp)], message)
    assert sorted(p.name for p in exp.iterdir()) == ["config.json", "experiment.py"]


@pytest.mark.parametrize("name", ["../escape.bin", "sub/../../escape.bin", "/tmp/escape.bin",
                                  "", "."])
@pytest.mark.parametrize("method", ["artifact", "output"])
def test_run_refuses_to_write_outside_the_experiment(tmp_path, capsys, method, name):
    script = f"def run(cfg, ctx):\n    ctx.{method}({name!r}).write_bytes(b'x')\n    return {{}}\n"
    exp = make_experiment(tmp_path, {"seed": 0}, script)
    fails_with(capsys, ["run", str(exp)], f"artifact path {name!r} must be a relative path "
               "inside the experiment folder")
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["99-tiny", "config.json",
                                                            "experiment.py"]
    assert not Path("/tmp/escape.bin").exists()


# ---------------------------------------------------------------------------------------------
# reproduce


def test_the_fixture_reproduces(manifest, capsys):
    assert main(["reproduce", str(manifest)]) == 0
    assert "REPRODUCED" in capsys.readouterr().out


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["config"].pop("seed"), "'config' has no 'seed' (an integer)"),
    (lambda m: m.__setitem__("config", [3]), "'config' must be a JSON object, got a list"),
    (lambda m: m.__setitem__("artifacts", ["w.bin"]),
     "'artifacts' must be a JSON object, got a list"),
    (lambda m: m.__setitem__("inputs", None), "'inputs' must be a JSON object, got NoneType"),
    (lambda m: m.__setitem__("env", "cpu"), "'env' must be a JSON object, got str 'cpu'"),
    (lambda m: m["artifacts"].__setitem__("w.bin", 7),
     "'artifacts' must map names to sha256 strings; 'w.bin' does not"),
    (lambda m: m["inputs"].__setitem__("/etc/hostname", "0" * 64),
     "input path '/etc/hostname' must be relative to the experiment folder"),
])
def test_reproduce_refuses_a_malformed_manifest(manifest, capsys, edit, message):
    reseal(manifest, edit)
    fails_with(capsys, ["reproduce", str(manifest)], message)


@pytest.mark.parametrize("name", ["../outside.bin", "../../etc/hostname", "a/../../outside.bin",
                                  "ABSOLUTE"])
def test_reproduce_refuses_an_artifact_outside_the_experiment(manifest, capsys, tmp_path, name):
    # Even with the right digest of the outside file, the manifest is refused before any read.
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"not the experiment's")
    name = str(outside) if name == "ABSOLUTE" else name
    reseal(manifest, lambda m: m["artifacts"].__setitem__(name, sha256_file(outside)))
    fails_with(capsys, ["reproduce", str(manifest)],
               f"artifact path {name!r} must be a relative path inside the experiment folder")


def test_reproduce_refuses_an_artifact_linked_outside(manifest, capsys, tmp_path):
    outside = tmp_path / "outside.bin"
    outside.write_bytes((manifest.parent / "w.bin").read_bytes())     # same bytes, same digest
    (manifest.parent / "w.bin").unlink()
    os.symlink(outside, manifest.parent / "w.bin")
    fails_with(capsys, ["reproduce", str(manifest)], "artifact 'w.bin' resolves outside")


# ---------------------------------------------------------------------------------------------
# the course's commands moved to `python -m course`


@pytest.mark.parametrize("argv, new", [
    (["check", "00-setup-minigpt"], "python -m course check 00-setup-minigpt"),
    (["course", "--check"], "python -m course build --check"),
    (["grade", "subs"], "python -m course grade subs"),
    (["lab"], "python -m course lab"),
])
def test_a_course_command_says_where_it_moved(capsys, argv, new):
    fails_with(capsys, argv, f"is a course command: {new}")
