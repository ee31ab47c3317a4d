"""Trusted test kernels forked from one warm process, so that a submission does not pay for
starting Python and importing torch and the course a second time.

    Zygote(sandbox).spawn(connection_file, cwd, log)  ->  ForkedProcess
        the zygote (`python -m course.grader.zygote`, started once per grading run with the
        trusted kernel's environment) has imported ipykernel, torch and the course packages
        and run nothing else; for each request it forks, and the child becomes a fresh
        IPython kernel with its own HOME, limits and session, listening on the connection
        file's sockets. No test code ever runs in the zygote, so each child starts from the
        same state, as a newly launched kernel would.

Only the trusted kernel starts this way: the learner's starts inside its own sandbox.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .sandbox import Sandbox

# What the labs' setup cells and tests import (one that does not load here is skipped);
# matplotlib shares the zygote's config folder, so its font cache is built once.
WARM = ("torch", "numpy", "ipykernel.kernelapp", "course.grader.trusted_side",
        "course.notebook.harness", "matplotlib.pyplot", "safetensors.torch", "triton",
        "triton.language", "labkit", "minigpt", "miniquant", "minimoe", "minimoe.kernels",
        "minituner", "minirl")


class ForkedProcess:
    """The part of subprocess.Popen the kernel uses, for a child of the zygote (which reaps
    it: this process cannot wait for it)."""

    def __init__(self, pid: int):
        self.pid = pid

    def poll(self) -> int | None:
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return 0
        return None

    def wait(self, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return 0


class Zygote:
    """One warm process per grading run; `spawn` is safe from several threads."""

    def __init__(self, sandbox: Sandbox):
        self.sandbox, self.lock, self.proc, self.home = sandbox, threading.Lock(), None, None

    def spawn(self, connection: Path, cwd: Path, log: Path) -> ForkedProcess:
        request = {"connection": str(connection), "cwd": str(cwd), "log": str(log),
                   "env": {k: str(v) for k, v in self.sandbox.env(cwd).items()},
                   "limits": _limits(self.sandbox)}
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.close_locked()
                self.home = Path(tempfile.mkdtemp(prefix="labkit-zygote-"))
                self.sandbox.prepare(self.home, 0)
                self.proc = subprocess.Popen(   # it exits when this process closes its stdin
                    [sys.executable, "-m", "course.grader.zygote"], stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                    env=self.sandbox.env(self.home), cwd=self.home, start_new_session=True)
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            answer = self.proc.stdout.readline()
        if not answer.strip().isdigit():
            raise RuntimeError("the trusted kernels' zygote did not fork")
        return ForkedProcess(int(answer))

    def close(self) -> None:
        with self.lock:
            self.close_locked()

    def close_locked(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)
        self.proc = self.home = None


def _limits(sandbox: Sandbox) -> dict[str, int]:
    lim = sandbox.limits
    return {"RLIMIT_AS": lim.memory_bytes, "RLIMIT_FSIZE": lim.file_bytes,
            "RLIMIT_NOFILE": lim.open_files, "RLIMIT_CPU": lim.cpu_seconds, "RLIMIT_CORE": 0}


def _child(request: dict) -> None:
    """In the forked child: become the kernel the request asks for (never returns)."""
    import resource  # Unix only, as is this module's use (autograde._zygote)

    os.setsid()
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    out = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    tempfile.tempdir = None             # found again from TMPDIR, not the zygote's own
    for name, value in request["limits"].items():
        resource.setrlimit(getattr(resource, name), (value, value))
    from ipykernel.kernelapp import IPKernelApp

    IPKernelApp.launch_instance(argv=["-f", request["connection"]])
    os._exit(0)


def main() -> None:
    """The zygote: import, then fork one kernel per line of stdin; print each child's pid."""
    import importlib

    for name in WARM:
        with contextlib.suppress(Exception):     # a module that cannot load is loaded later
            importlib.import_module(name)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)     # a kernel that exits is reaped at once
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            try:
                _child(request)
            finally:
                os._exit(1)
        print(pid, flush=True)


if __name__ == "__main__":
    main()
