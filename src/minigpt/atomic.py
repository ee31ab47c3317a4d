"""Write a file or a folder atomically: all of it or none of it, never half.

`atomic_path` is the model packages' one atomic writer: minigpt's checkpoints, and every file
minituner writes (adapters, metrics log, training state). It lives in minigpt, the lowest
layer that writes files. labkit keeps its own (labkit/atomic.py), since the design keeps
labkit and the model packages from importing each other.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path` (a file to write, or with `directory` an empty
    folder to fill); when the block succeeds, move it over `path`; on an exception remove it
    and leave `path` as it was.

    Beside `path`, so the final move is a rename on one filesystem (atomic on POSIX). A file
    replaces the old one in one rename. A folder cannot be renamed over a non-empty one: the
    old folder is renamed to `<path>.old` first and deleted after, so a crash between the two
    renames leaves only `<path>.old` (a reader may fall back to it; minituner.checkpoint does).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    prefix = f".{path.name}."
    if directory:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, suffix=".tmp", dir=path.parent))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=path.parent)
        os.close(fd)
        tmp = Path(name)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # mkstemp makes 0600; give the file the usual mode
    try:
        yield tmp
        if directory:
            _swap_dir(tmp, path)
        else:
            os.replace(tmp, path)
    finally:
        if directory:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


def _swap_dir(new: Path, path: Path) -> None:
    """Rename `new` to `path`, moving an existing `path` aside to `<path>.old` first."""
    old = path.with_name(path.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)
