"""sha256 digests for manifests: of files, of JSON-able data, and of state dicts."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path

import torch

_CHUNK = 1 << 20


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def canonical_json(obj) -> str:
    """The one JSON spelling of `obj`: sorted keys, no spaces, so equal data hashes equally."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def sha256_json(obj) -> str:
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def sha256_state_dict(state_dict: Mapping[str, torch.Tensor]) -> str:
    """Digest of a state dict that ignores key order but not names, dtypes, shapes or bytes.

    Each entry contributes its name, dtype, shape and raw little-endian bytes, in sorted key
    order; two tensors with equal values but different dtypes therefore hash differently.
    """
    h = hashlib.sha256()
    for name in sorted(state_dict):
        t = state_dict[name]
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"state_dict[{name!r}] must be a tensor, got {type(t).__name__}")
        t = t.detach().to("cpu").contiguous().reshape(-1)  # 0-d tensors cannot be viewed
        header = f"{name}|{t.dtype}|{tuple(state_dict[name].shape)}|".encode()
        h.update(len(header).to_bytes(8, "little"))
        h.update(header)
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()
