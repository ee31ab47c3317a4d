"""Save and load MiniGPT checkpoints as safetensors, the config stored in the file's metadata."""

from __future__ import annotations

import json
import os
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import load_file, save_file

from .model import MiniGPT, MiniGPTConfig

BASE_EXPERIMENT = "00-pretrain-base"
BASE_NAMES = ("dense", "moe")


def save_checkpoint(model: MiniGPT, path: str | Path) -> None:
    """Write `model`'s weights and config; the file appears whole or not at all."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    try:
        save_file(state, tmp, metadata={"config": json.dumps(model.config.to_dict())})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


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


def repo_root() -> Path:
    """The course checkout: $MINIQLORA_ROOT, else the nearest parent holding experiments/."""
    if env := os.environ.get("MINIQLORA_ROOT"):
        return Path(env)
    for parent in Path(__file__).resolve().parents:
        if (parent / "experiments" / BASE_EXPERIMENT).is_dir():
            return parent
    raise FileNotFoundError("cannot find the course checkout (a folder holding "
                            f"experiments/{BASE_EXPERIMENT}); set MINIQLORA_ROOT to it")


def base_path(name: str) -> Path:
    if name not in BASE_NAMES:
        raise ValueError(f"name must be one of {BASE_NAMES}, got {name!r}")
    return repo_root() / "experiments" / BASE_EXPERIMENT / f"base_{name}.safetensors"


def load_base(name: str = "dense") -> MiniGPT:
    """The pretrained base model of experiment 00: 'dense' or 'moe'."""
    return load_checkpoint(base_path(name))
