"""A cgroup (v2) per submission: its memory, task count and CPU weight, whatever it starts.

prlimit's limits are per process: four children of one kernel may each reserve the
"16 GiB". A cgroup counts every process and thread the sandbox starts, and the tmpfs pages
its /tmp and home hold, together. Where cgroups v2 are mounted and the grader may create
groups under its own (root, or a delegated systemd scope), each submission's sandbox runs in

    <the grader's cgroup>/course-grade/<name>/   memory.max, memory.swap.max = 0,
                                                pids.max, cpu.weight (equal shares)

and the group is killed and removed when the kernel closes. Elsewhere (cgroups v1, no
permission) `why_not()` says why, the grader prints it once, and the prlimit limits of
sandbox.Limits are the only ones.
"""

from __future__ import annotations

import os
import shlex
import signal
import time
from pathlib import Path

MOUNT = Path("/sys/fs/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")


def _own() -> Path:
    """This process's cgroup directory (the "0::/path" line of /proc/self/cgroup)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return MOUNT / line[3:].lstrip("/")
    raise OSError("no cgroup v2 entry in /proc/self/cgroup")


def base() -> Path:
    """The folder the submissions' groups go in, made once with the controllers on."""
    group = _own() / "course-grade"
    group.mkdir(exist_ok=True)
    have = set((group / "cgroup.controllers").read_text().split())
    missing = [c for c in CONTROLLERS if c not in have]
    if missing:     # enable them for our new child: possible when our own cgroup allows it
        (group.parent / "cgroup.subtree_control").write_text(
            " ".join(f"+{c}" for c in missing))
    (group / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in CONTROLLERS))
    return group


def why_not() -> str:
    """"" when per-submission cgroups work here, else why they do not."""
    if not (MOUNT / "cgroup.controllers").is_file():
        return f"cgroups v2 are not mounted at {MOUNT} (v1 only)"
    try:
        probe = Cgroup(f"probe-{os.getpid()}", memory_bytes=1 << 30, tasks=16)
        probe.remove()
    except OSError as e:
        return f"cannot create a cgroup under {_safe_own()} ({type(e).__name__}: {e})"
    return ""


def _safe_own() -> str:
    try:
        return str(_own())
    except OSError:
        return "this process's cgroup"


class Cgroup:
    """One submission's group; `wrap(argv)` runs argv inside it."""

    def __init__(self, name: str, memory_bytes: int, tasks: int, weight: int = 100):
        self.path = base() / name
        self.path.mkdir()
        for key, value in (("memory.max", memory_bytes), ("memory.swap.max", 0),
                           ("pids.max", tasks), ("cpu.weight", weight)):
            (self.path / key).write_text(str(value))

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run by a shell that first moves itself into the group (its children follow)."""
        procs = shlex.quote(str(self.path / "cgroup.procs"))
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *argv]

    def remove(self) -> None:
        """Kill whatever is left in the group, then remove it; never raises."""
        try:
            if (self.path / "cgroup.kill").exists():
                (self.path / "cgroup.kill").write_text("1")
            else:
                for pid in (self.path / "cgroup.procs").read_text().split():
                    os.kill(int(pid), signal.SIGKILL)
            for _ in range(50):
                try:
                    self.path.rmdir()
                    return
                except OSError:
                    time.sleep(0.02)
        except (OSError, ValueError):
            pass
