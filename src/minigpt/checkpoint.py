"""Save and load MiniGPT checkpoints as safetensors, the config stored in the file's metadata;
find the pretrained base checkpoints (written atomically, see atomic.py).

The base checkpoints `base_dense.safetensors` and `base_moe.safetensors` live in one folder,
found by `base_dir()`: the environment variable MINIGPT_BASE_DIR when set, else the folder
experiment 00 writes them to, `experiments/00-pretrain-base` of the course checkout that
holds this package (searched once). Code that needs a base checkpoint calls `base_path(name)`
and never builds the path itself.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .atomic import atomic_path
from .model import MiniGPT, MiniGPTConfig

BASE_DIR_ENV = "MINIGPT_BASE_DIR"
BASE_EXPERIMENT = "00-pretrain-base"     # the experiment that writes the base checkpoints
BASE_NAMES = ("dense", "moe")


def save_checkpoint(model: MiniGPT, path: str | Path) -> None:
    """Write `model`'s weights and config; the file appears whole or not at all."""
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    with atomic_path(path) as tmp:
        save_file(state, tmp, metadata={"config": json.dumps(model.config.to_dict())})


def load_checkpoint(path: str | Path) -> MiniGPT:
    """Rebuild a MiniGPT from a checkpoint written by `save_checkpoint`."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    with safe_open(path, framework="pt") as f:
        meta = f.metadata() or {}
    if "config" not in meta:
        raise ValueError(f"{path} has no MiniGPT config in its metadata; "
                         "was it written by minigpt.save_checkpoint?")
    try:
        model = MiniGPT(MiniGPTConfig(**json.loads(meta["config"])))
    except TypeError as e:
        raise ValueError(f"{path} has a config MiniGPTConfig does not accept: {e}") from None
    state = load_file(path)
    expected = model.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    wrong = sorted(k for k in expected.keys() & state.keys()
                   if expected[k].shape != state[k].shape)
    if missing or unexpected or wrong:
        raise ValueError(f"{path} does not fit its own config: missing keys {missing}, "
                         f"unexpected keys {unexpected}, shape mismatches {wrong}")
    model.load_state_dict(state)
    return model


@functools.cache
def repo_root() -> Path:
    """The course checkout holding this package: the nearest parent with an experiments/ folder
    for experiment 00 (searched once)."""
    for parent in Path(__file__).resolve().parents:
        if (parent / "experiments" / BASE_EXPERIMENT).is_dir():
            return parent
    raise FileNotFoundError(f"cannot find the course checkout (a folder holding experiments/"
                            f"{BASE_EXPERIMENT}) above {Path(__file__).parent}; set "
                            f"{BASE_DIR_ENV} to the folder holding the base checkpoints")


def base_dir() -> Path:
    """The folder holding the base checkpoints: $MINIGPT_BASE_DIR, else experiment 00's folder
    in the course checkout (see the module docstring)."""
    if env := os.environ.get(BASE_DIR_ENV):
        return Path(env)
    return repo_root() / "experiments" / BASE_EXPERIMENT


def base_path(name: str) -> Path:
    """The path of the pretrained base checkpoint `name` ('dense' or 'moe'), which may not
    exist yet (`make run EXP=experiments/00-pretrain-base` writes it)."""
    if name not in BASE_NAMES:
        raise ValueError(f"name must be one of {BASE_NAMES}, got {name!r}")
    return base_dir() / f"base_{name}.safetensors"


def load_base(name: str = "dense") -> MiniGPT:
    """The pretrained base model of experiment 00: 'dense' or 'moe'."""
    return load_checkpoint(base_path(name))
