"""Resumable training state on disk: save every few steps, resume bit-exactly after a crash.

A checkpoint is a directory of four files, none of them a pickle:

    trainable.safetensors   the trainable parameters, by name
    optimizer.safetensors   AdamW's per-parameter state, keys "<param name>:<state key>"
    rng.safetensors         torch's RNG state (CPU, and CUDA when training there) and the
                            batch order (its generator state and the current epoch's permutation)
    state.json              format tag, steps done, position in the epoch, the run's results so
                            far and its open loss window, the config fingerprint, a data hash

Saving fills a fresh temporary directory beside the target and swaps it in with two renames
(`checkpoint` -> `checkpoint.old`, temporary -> `checkpoint`; `minigpt.checkpoint.atomic_path`),
then deletes the old one, so a crash never leaves a half-written `checkpoint`; a crash between
the two renames leaves only `checkpoint.old`, which `load_state` then reads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError

from minigpt.atomic import atomic_path

from .data import BatchOrder, SequenceData

FORMAT = "minituner.train_state/1"
_FILES = ("trainable.safetensors", "optimizer.safetensors", "rng.safetensors", "state.json")

# TrainConfig fields that only say where and how to report: a resumed run may change them.
# Every other field shapes the trajectory (steps too: it sets the cosine schedule).
_UNFINGERPRINTED = frozenset({"progress", "save_every", "out_dir", "log_path"})


@dataclass
class TrainingState:
    params: dict[str, torch.Tensor]                # trainable parameters by name
    optimizer: dict[str, dict[str, torch.Tensor]]  # parameter name -> AdamW state tensors
    tensors: dict[str, torch.Tensor]               # RNG states and batch order
    progress: dict                                 # JSON: step, results so far, open window
    config: dict                                   # config_fingerprint(cfg)
    data_sha256: str                               # data_digest(training data)


def snapshot(named: list[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer,
             order: BatchOrder, progress: dict, config: dict, data_sha256: str,
             buffers: dict[str, torch.Tensor] | None = None) -> TrainingState:
    """The state to resume from after the step just done (tensors referenced, not copied).
    `buffers`: tensors that training changes besides the parameters (an MoE router's
    selection bias), kept beside the RNG states."""
    tensors = {"torch_cpu": torch.get_rng_state(), "batch_generator": order.generator.get_state(),
               "batch_perm": order.perm, **{f"buffer:{n}": b for n, b in (buffers or {}).items()}}
    device = named[0][1].device
    if device.type == "cuda":
        tensors["torch_cuda"] = torch.cuda.get_rng_state(device)
    optimizer = {n: dict(opt.state[p]) for n, p in named if opt.state[p]}
    return TrainingState(dict(named), optimizer, tensors, {**progress, "batch_pos": order.pos},
                         config, data_sha256)


@torch.no_grad()
def restore(state: TrainingState, named: list[tuple[str, torch.nn.Parameter]],
            opt: torch.optim.Optimizer, order: BatchOrder,
            buffers: dict[str, torch.Tensor] | None = None) -> None:
    """Put parameters, optimizer state, buffers, batch order and RNG back as `snapshot` saw
    them.

    Call `check_compatible` first: this assumes the names and shapes match.
    """
    for n, b in (buffers or {}).items():
        if f"buffer:{n}" not in state.tensors:
            raise ValueError(f"the training checkpoint holds no {n}: it was saved from a model "
                             f"without it")
        b.copy_(state.tensors[f"buffer:{n}"])
    for n, p in named:
        p.copy_(state.params[n])
        if n in state.optimizer:
            # AdamW keeps its step counter on the CPU (non-capturable), the moments by p.
            opt.state[p] = {k: t if k == "step" else t.to(p.device)
                            for k, t in state.optimizer[n].items()}
    order.load(state.tensors["batch_generator"], state.tensors["batch_perm"],
               state.progress["batch_pos"])
    torch.set_rng_state(state.tensors["torch_cpu"])
    device = named[0][1].device
    if "torch_cuda" in state.tensors and device.type == "cuda":
        torch.cuda.set_rng_state(state.tensors["torch_cuda"], device)


def config_fingerprint(cfg) -> dict:
    """The TrainConfig fields that shape the trajectory, as JSON values (tuples -> lists).

    `accumulate` is left out at its default 1, so a run that does not accumulate writes and
    resumes the checkpoints it wrote before the option existed; any other value is kept, and
    resuming under another refused, as a resumed run must end bit-identical to a straight one.
    """
    fields = {k: v for k, v in asdict(cfg).items() if k not in _UNFINGERPRINTED
              and not (k == "accumulate" and v == 1)}
    return json.loads(json.dumps(fields))


def trained_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The buffers a training step changes, which a resumable state must keep: the selection
    biases of MoE routers (`MoEMLP.router_bias`, moved by `minimoe.update_router_biases`)."""
    return {n: b for n, b in model.named_buffers() if n.rsplit(".", 1)[-1] == "router_bias"}


def data_digest(data: SequenceData) -> str:
    h = hashlib.sha256()
    for t in (data.tokens, data.answer_mask, data.lengths, data.weights):
        h.update(b"none" if t is None else t.cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def json_default(o):
    """JSON for what eval functions tend to return besides plain numbers (tensors, numpy)."""
    return o.tolist() if hasattr(o, "tolist") else str(o)


def _write(state: TrainingState, dir: Path) -> None:
    flat_opt = {f"{name}:{key}": t for name, st in state.optimizer.items()
                for key, t in st.items()}
    for file, tensors in (("trainable", state.params), ("optimizer", flat_opt),
                          ("rng", state.tensors)):
        safetensors.torch.save_file({k: t.detach().cpu().contiguous() for k, t in tensors.items()},
                                    dir / f"{file}.safetensors")
    meta = {"format": FORMAT, "progress": state.progress, "config": state.config,
            "data_sha256": state.data_sha256}
    (dir / "state.json").write_text(json.dumps(meta, default=json_default), encoding="utf-8")


def save_state(state: TrainingState, path: str | Path) -> None:
    """Write `state` to the directory `path`, replacing any checkpoint there atomically."""
    with atomic_path(path, directory=True) as tmp:
        _write(state, tmp)


def load_state(path: str | Path) -> TrainingState:
    """Read a checkpoint directory written by `save_state`."""
    path = Path(path)
    if not path.exists():
        old = path.with_name(path.name + ".old")
        if not old.is_dir():
            raise FileNotFoundError(f"no training checkpoint at {path}")
        path = old
    missing = [f for f in _FILES if not (path / f).is_file()]
    if missing:
        raise ValueError(f"{path} is not a training checkpoint: missing {', '.join(missing)}")
    try:
        meta = json.loads((path / "state.json").read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise ValueError(f"format is {meta.get('format')!r}, expected {FORMAT!r}")
        flat = {name: safetensors.torch.load_file(path / f"{name}.safetensors")
                for name in ("trainable", "optimizer", "rng")}
        optimizer: dict[str, dict[str, torch.Tensor]] = {}
        for key, t in flat["optimizer"].items():
            name, _, state_key = key.rpartition(":")
            optimizer.setdefault(name, {})[state_key] = t
        return TrainingState(flat["trainable"], optimizer, flat["rng"], meta["progress"],
                             meta["config"], meta["data_sha256"])
    except (OSError, ValueError, KeyError, AttributeError, SafetensorError) as e:
        raise ValueError(f"cannot read the training checkpoint {path}: {e}") from e


def check_compatible(state: TrainingState, config: dict, data_sha256: str,
                     trainable: dict[str, torch.Size]) -> None:
    """Refuse to resume into another config, other data or other trainable parameters."""
    keys = sorted(set(state.config) | set(config))
    diff = [f"{k} (checkpoint {state.config.get(k, '<absent>')!r}, now "
            f"{config.get(k, '<absent>')!r})" for k in keys if state.config.get(k) != config.get(k)]
    if diff:
        raise ValueError("cannot resume: the TrainConfig differs from the checkpoint's in "
                         + "; ".join(diff))
    saved = {k: tuple(t.shape) for k, t in state.params.items()}
    now = {k: tuple(s) for k, s in trainable.items()}
    problems = []
    if extra := sorted(now.keys() - saved.keys()):
        problems.append(f"not in the checkpoint: {extra}")
    if gone := sorted(saved.keys() - now.keys()):
        problems.append(f"in the checkpoint but not trainable here: {gone}")
    problems += [f"{k} is {list(now[k])} here, {list(saved[k])} in the checkpoint"
                 for k in sorted(now.keys() & saved.keys()) if now[k] != saved[k]]
    if problems:
        raise ValueError("cannot resume: the model's trainable parameters do not match the "
                         "checkpoint's: " + "; ".join(problems))
    if state.data_sha256 != data_sha256:
        raise ValueError(f"cannot resume: the training data differs from the checkpoint's "
                         f"(sha256 {data_sha256[:12]}…, checkpoint {state.data_sha256[:12]}…)")


__all__ = ["FORMAT", "TrainingState", "check_compatible", "config_fingerprint", "data_digest",
           "load_state", "restore", "save_state", "snapshot", "trained_buffers"]
