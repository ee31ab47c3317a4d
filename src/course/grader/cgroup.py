"""A cgroup per submission: its memory and task count (and, on v2, CPU weight), whatever it
starts.

prlimit's limits are per process: four children of one kernel may each reserve the
"16 GiB". A cgroup counts every process and thread the sandbox starts, and the tmpfs pages
its /tmp and home hold, together. Where the grader may create groups under its own (root,
or a delegated systemd scope), each submission's sandbox runs in

    v2  <the grader's cgroup>/course-grade/<name>/   memory.max, memory.swap.max = 0,
                                                    pids.max, cpu.weight (equal shares)
    v1  <its memory cgroup>/course-grade/<name>/     memory.limit_in_bytes (and
                                                    memory.memsw.limit_in_bytes: no swap)
        <its pids cgroup>/course-grade/<name>/       pids.max

(v1: `MOUNT/memory` and `MOUNT/pids` hierarchies; a hybrid system's empty v2 at
`MOUNT/unified` counts as v1), and the groups are killed and removed when the kernel
closes. Elsewhere (no cgroups, no permission) `why_not()` says why, the grader says which
limits hold (`summary`), and the prlimit limits of sandbox.Limits are the only ones.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import time
from pathlib import Path

MOUNT = Path("/sys/fs/cgroup")
SELF = Path("/proc/self/cgroup")
CONTROLLERS = ("memory", "pids", "cpu")
V1_CONTROLLERS = ("memory", "pids")


def version() -> str:
    """"v2", "v1" (the memory and pids hierarchies are mounted, as on a hybrid system) or ""."""
    if (MOUNT / "cgroup.controllers").is_file():
        return "v2"
    return "v1" if all((MOUNT / c).is_dir() for c in V1_CONTROLLERS) else ""


def _own(controller: str = "") -> Path:
    """This process's cgroup directory: v2's (the "0::/path" line of /proc/self/cgroup), or
    with `controller`, that of the v1 hierarchy holding it (a "4:memory:/path" line)."""
    for line in SELF.read_text().splitlines():
        number, names, path = (line.split(":", 2) + ["", ""])[:3]
        if controller and controller in names.split(","):
            return MOUNT / names / path.lstrip("/")
        if not controller and number == "0":
            return MOUNT / path.lstrip("/")
    raise OSError(f"no cgroup {controller or 'v2'} entry in {SELF}")


def base() -> Path:
    """v2: the folder the submissions' groups go in, made once with the controllers on."""
    group = _own() / "course-grade"
    group.mkdir(exist_ok=True)
    have = set((group / "cgroup.controllers").read_text().split())
    missing = [c for c in CONTROLLERS if c not in have]
    if missing:     # enable them for our new child: possible when our own cgroup allows it
        (group.parent / "cgroup.subtree_control").write_text(
            " ".join(f"+{c}" for c in missing))
    (group / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in CONTROLLERS))
    return group


def _layout(kind: str, memory_bytes: int, tasks: int, weight: int
            ) -> list[tuple[Path, list[tuple[str, int]]]]:
    """[(folder a group goes in, [(file, value) written in the group])]: one on v2, one per
    hierarchy on v1 (memory.memsw.* exists only where swap is accounted: see OPTIONAL)."""
    if kind == "v2":
        return [(base(), [("memory.max", memory_bytes), ("memory.swap.max", 0),
                          ("pids.max", tasks), ("cpu.weight", weight)])]
    if kind == "v1":
        folders = {c: _own(c) / "course-grade" for c in V1_CONTROLLERS}
        for folder in folders.values():
            folder.mkdir(exist_ok=True)
        return [(folders["memory"], [("memory.limit_in_bytes", memory_bytes),
                                     ("memory.memsw.limit_in_bytes", memory_bytes)]),
                (folders["pids"], [("pids.max", tasks)])]
    raise OSError(f"no cgroups at {MOUNT}")


OPTIONAL = {"memory.memsw.limit_in_bytes"}


def why_not() -> str:
    """"" when per-submission cgroups work here, else why they do not."""
    kind = version()
    if not kind:
        return f"no cgroups at {MOUNT} (neither v2 nor the v1 memory and pids hierarchies)"
    try:
        probe = Cgroup(f"probe-{os.getpid()}", memory_bytes=1 << 30, tasks=16)
        probe.remove()
    except OSError as e:
        return (f"cannot create a cgroup ({kind}) under {_safe_own(kind)} "
                f"({type(e).__name__}: {e})")
    return ""


def _safe_own(kind: str) -> str:
    try:
        return str(_own("memory" if kind == "v1" else ""))
    except OSError:
        return "this process's cgroup"


def summary(limits, why: str, processes: bool) -> str:
    """The line the grader prints: which limits hold, per submission (`why` = why_not(), ""
    where a cgroup each applies) and per process (sandbox.Limits; `processes`: whether
    prlimit's process count is applied, as root only)."""
    gib = f"{limits.memory_bytes / (1 << 30):g} GiB"
    per_process = (f"per process (prlimit): {gib} of address space, "
                   f"{limits.cpu_seconds / 3600:g} h of CPU, files up to "
                   f"{limits.file_bytes >> 20} MiB, {limits.open_files} open files"
                   + (f", {limits.processes} processes per uid" if processes else ""))
    if why:
        return f"resource limits: {per_process}; none per submission: {why}"
    kind = version()
    return (f"resource limits: per submission (a cgroup {kind} each): {gib} of memory, "
            f"tmpfs pages included, {limits.processes} tasks"
            + (", an equal CPU weight" if kind == "v2" else "") + f"; {per_process}")


class Cgroup:
    """One submission's group (a folder in each v1 hierarchy); `wrap(argv)` runs argv in it."""

    def __init__(self, name: str, memory_bytes: int, tasks: int, weight: int = 100):
        self.paths: list[Path] = []
        try:
            for folder, settings in _layout(version(), memory_bytes, tasks, weight):
                path = folder / name
                path.mkdir()
                self.paths.append(path)
                for key, value in settings:
                    if key not in OPTIONAL or (path / key).exists():
                        (path / key).write_text(str(value))
        except OSError:
            self.remove()
            raise

    @property
    def path(self) -> Path:
        return self.paths[0]

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run by a shell that first moves itself into the group (its children follow)."""
        enter = " && ".join(f"echo $$ > {shlex.quote(str(p / 'cgroup.procs'))}"
                            for p in self.paths)
        return ["sh", "-c", f'{enter} && exec "$@"', "sh", *argv]

    def remove(self) -> None:
        """Kill whatever is left in the group, then remove it; never raises."""
        for path in reversed(self.paths):
            _remove(path)


def _remove(path: Path) -> None:
    try:
        if (path / "cgroup.kill").exists():
            (path / "cgroup.kill").write_text("1")
        else:
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for _ in range(50):
            try:
                path.rmdir()
                return
            except OSError:
                time.sleep(0.02)
    except (OSError, ValueError):
        pass
