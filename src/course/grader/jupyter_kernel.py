"""One submission's Jupyter kernel, in its sandbox: start it, run code with a time limit, kill it.

The kernel talks to the grader over Unix sockets in its private folder (the sandbox has no
network). Only what the grader sends reaches the kernel, one cell at a time: the notebook
file, with its hidden tests, never enters the sandbox.

A cell over its time limit is interrupted; if it is still running `GRACE_S` later (a bare
`except:` swallowed the KeyboardInterrupt) the kernel is killed, with every process it
started, and `Reply.status` says so, for the caller to restart and replay.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
import zmq
from jupyter_client import BlockingKernelClient
from jupyter_client.session import new_id_bytes

from .cgroup import Cgroup
from .sandbox import RUN, Sandbox
from .zygote import Zygote

GRACE_S = 10.0             # after an interrupt, how long a cell gets to stop by itself
START_TIMEOUT_S = 120.0
MAX_TEXT = 100_000         # characters of text output kept per request
MAX_OUTPUTS = 100          # outputs kept per request
MAX_IMAGE = 2_000_000      # bytes of a base64 image kept
MAX_CELL_BYTES = 4_000_000         # every mime type of every output of one request, together
MAX_SUBMISSION_BYTES = 16_000_000  # the same over a whole submission (every request)
# The only mime types kept (the rest is dropped: HTML and scripts are a hostile page's means).
KEPT_MIME = ("text/plain", "image/png", "image/jpeg")
MAX_MESSAGE = 64 << 20     # a larger message from the kernel drops its connection


@dataclass
class Reply:
    status: str                     # "ok", "error", "timeout", "killed" (swallowed), "dead"
    outputs: list = field(default_factory=list)       # nbformat outputs, capped
    error: str = ""                 # "ename: evalue" of an error
    expressions: dict = field(default_factory=dict)   # user_expressions, as the kernel sent

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def size(output: dict) -> int:
    """Characters an output holds: its text, its traceback and every mime type's data."""
    data = output.get("data", {})
    data = sum(len(str(v)) for v in data.values()) if isinstance(data, dict) else 0
    return (len(str(output.get("text", ""))) + data
            + sum(len(str(line)) for line in output.get("traceback", [])))


def _cap(outputs: list, output: dict, budget: list[int] | None = None) -> None:
    """Append `output` unless the request (or, with `budget` = [characters left], the
    submission) already printed too much: then a note, once. Only KEPT_MIME data stays."""
    if isinstance(output.get("data"), dict):
        output["data"] = {m: v for m, v in output["data"].items() if m in KEPT_MIME}
        if not output["data"] and output.get("output_type") != "stream":
            output["data"] = {"text/plain": "[output of a kind the grader does not keep]"}
    text = sum(len(o.get("text", "")) for o in outputs)
    used = sum(size(o) for o in outputs)
    left = MAX_CELL_BYTES - used if budget is None else min(MAX_CELL_BYTES - used, budget[0])
    if len(outputs) >= MAX_OUTPUTS or text >= MAX_TEXT or left <= 0:
        if not outputs or outputs[-1].get("name") != "labkit":
            outputs.append(nbformat.v4.new_output("stream", name="labkit",
                                                  text="[output cut by the grader]\n"))
        return
    if output.get("output_type") == "stream":
        output["text"] = output["text"][:min(MAX_TEXT - text, left)]
    if "traceback" in output:
        output["traceback"] = [str(line)[:2000] for line in output["traceback"][:200]]
    for mime, data in list(output.get("data", {}).items()):
        if not isinstance(data, str) or len(data) > min(MAX_IMAGE, left):
            output["data"][mime] = f"[{mime} of {len(str(data))} characters cut by the grader]"
    if size(output) > left:
        return _cap(outputs, {"output_type": "stream", "name": "labkit", "text": ""}, [0])
    outputs.append(output)
    if budget is not None:
        budget[0] -= size(output)


def remove_tree(path: Path) -> None:
    """Delete `path` and everything under it; never raises and never recurses in Python (a
    submission may leave a folder thousands of levels deep, or folders it made unreadable)."""
    for argv in (["chmod", "-R", "u+rwx", str(path)], ["rm", "-rf", "--", str(path)]):
        try:
            subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=300, check=False)
        except (OSError, subprocess.SubprocessError):
            pass
    if path.exists():                       # no rm (not Linux or macOS): Python's, guarded
        try:
            shutil.rmtree(path, ignore_errors=True)
        except RecursionError:
            pass


class Kernel:
    """A fresh IPython kernel in `sandbox`; `run` code in it; `close` kills everything."""

    def __init__(self, sandbox: Sandbox, slot: int = 0, budget: list[int] | None = None,
                 uid: int | None = None, wait: bool = True, zygote: Zygote | None = None):
        """`budget`: [characters of output the submission has left], shared by the kernels
        of one submission (a restart does not refill it); `uid`: the sandbox's uid when the
        grader runs as root (a fresh one per submission, see Sandbox.command); `wait=False`
        returns once the process is launched (then `wait_until_ready` before using it);
        `zygote`: fork the kernel from it (a kernel without a sandbox only)."""
        self.sandbox, self.slot = sandbox, slot
        self.budget = [MAX_SUBMISSION_BYTES] if budget is None else budget
        self.private = Path(tempfile.mkdtemp(prefix="labkit-sandbox-"))
        sandbox.prepare(self.private, slot, uid)
        inside = self.private if sandbox.unsafe else RUN
        info = {"transport": "ipc", "ip": str(inside / "kernel"), "shell_port": 1,
                "iopub_port": 2, "stdin_port": 3, "control_port": 4, "hb_port": 5,
                "key": new_id_bytes().decode(), "signature_scheme": "hmac-sha256"}
        (self.private / "kernel.json").write_text(json.dumps(info))
        self.info = info
        argv = [sys.executable, "-m", "ipykernel_launcher", "-f", str(inside / "kernel.json")]
        self.log = open(self.private.parent / f"{self.private.name}.log", "w+b")  # noqa: SIM115
        argv = sandbox.command(argv, self.private, slot, uid)
        self.group = None
        if sandbox.cgroups and not sandbox.unsafe:
            self.group = Cgroup(self.private.name, sandbox.limits.memory_bytes,
                                sandbox.limits.processes)
            argv = self.group.wrap(argv)
        if zygote is not None and sandbox.unsafe:
            self.proc = zygote.spawn(self.private / "kernel.json", self.private,
                                     Path(self.log.name))
        else:
            self.proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL,
                stdout=self.log, stderr=subprocess.STDOUT, cwd=self.private,
                env=sandbox.env(self.private) if sandbox.unsafe else {}, start_new_session=True)
        context = zmq.Context()
        context.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)   # every socket the client opens
        self.client = BlockingKernelClient(context=context)
        self.client.load_connection_info({**info, "ip": str(self.private / "kernel")})
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any((self.private / f"kernel-{p}").exists() for p in (1, 2)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sandboxed kernel did not start: {self.stderr()}")
            time.sleep(0.05)
        self.client.start_channels()
        self.client.wait_for_ready(timeout=max(1.0, deadline - time.monotonic()))
        self.sandbox.seal(self.private)

    def connection(self) -> dict:
        """How a client on the host reaches this kernel (the trusted test kernel's bridge);
        from the grader's memory, never from a file the kernel could have rewritten."""
        return {**self.info, "ip": str(self.private / "kernel")}

    def send(self, code: str) -> None:
        """Start running `code` and return at once (nothing of it is read; a later `run`
        waits behind it)."""
        self.client.execute(code, silent=True, store_history=False, allow_stdin=False)

    def stderr(self) -> str:
        self.log.seek(0)
        return self.log.read().decode(errors="replace")[-500:]

    def alive(self) -> bool:
        return self.proc.poll() is None

    def cause_of_death(self) -> str:
        """Why the kernel's process ended, in a learner's words (from its exit status: a
        signal's number, or 128 + it through bubblewrap)."""
        code = self.proc.poll()
        if code is None:
            return "the kernel stopped answering"
        number = -code if code < 0 else code - 128 if code > 128 else 0
        if number in (signal.SIGSEGV, getattr(signal, "SIGBUS", None)):
            return ("the Python process crashed (a segfault is usually an out-of-range load "
                    "or store in a Triton kernel)")
        if number == getattr(signal, "SIGKILL", None):
            return "the Python process was killed (out of memory, or another hard limit)"
        if number == signal.SIGABRT:
            return "the Python process aborted (a C library or the interpreter gave up)"
        if number in set(signal.Signals):
            return f"the Python process ended on signal {signal.Signals(number).name}"
        return f"the Python process exited with status {code} (os._exit, or exit in a thread)"

    def run(self, code: str, timeout: float, silent: bool = False,
            expressions: dict | None = None, history: bool = True) -> Reply:
        """Execute `code`; its outputs, status and `expressions` (evaluated after success).
        `history=False` keeps it out of IPython's `In`/`_ih` (hidden tests)."""
        self._drain()
        msg_id = self.client.execute(code, silent=silent, store_history=history and not silent,
                                     user_expressions=expressions or {}, allow_stdin=False)
        reply = Reply("ok")
        deadline, interrupted = time.monotonic() + timeout, None
        while True:
            if not self.alive():
                return Reply("dead", reply.outputs, "the kernel died")
            now = time.monotonic()
            if interrupted is None and now > deadline:
                self.client.control_channel.send(self.client.session.msg("interrupt_request"))
                interrupted = now
            elif interrupted is not None and now > interrupted + GRACE_S:
                self.close()
                return Reply("killed", reply.outputs, f"still running {GRACE_S:g} s after "
                             "the interrupt (an except clause swallowed it)")
            try:
                msg = self.client.get_iopub_msg(timeout=0.2)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind = msg["msg_type"]
            if kind == "clear_output":
                reply.outputs.clear()
            elif kind in ("stream", "display_data", "execute_result", "error"):
                try:
                    _cap(reply.outputs, nbformat.v4.output_from_msg(msg), self.budget)
                except (KeyError, TypeError, ValueError, AttributeError):
                    continue        # a malformed message from a tampered kernel: dropped
            elif kind == "status" and msg["content"]["execution_state"] == "idle":
                return self._finish(msg_id, reply, timed_out=interrupted is not None)

    def _drain(self) -> None:
        """Drop what the kernel published for others since our last request (the trusted
        kernel's bridge asks it too): unread, it would fill the socket's queue, and the
        next request's own messages would be dropped."""
        while True:
            try:
                self.client.get_iopub_msg(timeout=0)
            except queue.Empty:
                return

    def _finish(self, msg_id: str, reply: Reply, timed_out: bool) -> Reply:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_shell_msg(timeout=1)
            except queue.Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                content = msg["content"]
                reply.expressions = content.get("user_expressions", {})
                if timed_out:
                    reply.status, reply.error = "timeout", "the cell hit the time limit"
                elif content.get("status") != "ok":
                    reply.status = "error"
                    reply.error = f"{content.get('ename', '?')}: {content.get('evalue', '')}"
                return reply
        return Reply("dead", reply.outputs, "the kernel sent no reply")

    def close(self) -> None:
        """Kill the sandbox (its PID namespace takes every process the notebook started);
        without a sandbox, the kernel's process group."""
        if self.log.closed:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        if self.group is not None:
            self.group.remove()
        self.client.stop_channels()
        self.client.context.destroy(linger=0)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        remove_tree(self.private)
