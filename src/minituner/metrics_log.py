"""The training loop's JSONL metrics log: one object per line, safe to follow while it grows."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

from minigpt.atomic import atomic_path

from .checkpoint import json_default


class MetricsLog:
    """JSON lines, one per logged window or evaluation, flushed as written.

    Resuming from a checkpoint at step s keeps the lines up to step s and drops the rest (the
    steps the crashed run did after its last checkpoint, which the resumed run redoes).
    """

    def __init__(self, path: str | Path, resume_step: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.exists():
            kept = []
            for line in self.path.read_text(encoding="utf-8").splitlines():
                with contextlib.suppress(ValueError, KeyError, TypeError):  # cut by a crash
                    if json.loads(line)["step"] <= resume_step:
                        kept.append(line + "\n")
            with atomic_path(self.path) as tmp:
                tmp.write_text("".join(kept), encoding="utf-8")
        self.file = open(self.path, "a" if resume_step is not None else "w",  # noqa: SIM115
                         encoding="utf-8")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record, default=json_default) + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()
