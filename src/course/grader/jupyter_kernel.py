"""One submission's Jupyter kernel, in its sandbox: start it, run code with a time limit, kill it.

The kernel talks to the grader over Unix sockets in its private folder (the sandbox has no
network). Only what the grader sends reaches the kernel, one cell at a time: the notebook
file, with its hidden tests, never enters the sandbox.

A cell over its time limit is interrupted; if it is still running `GRACE_S` later (a bare
`except:` swallowed the KeyboardInterrupt) the kernel is killed, with every process it
started, and `Reply.status` says so, for the caller to restart and replay.

What the grader holds of a kernel's output is bounded in bytes, whatever the kernel sends:
a sandboxed kernel is reached through a relay process of its own (relay.py), which passes
on only whole messages of at most MAX_MESSAGE bytes and holds at most relay.MAX_HELD bytes
a socket while the grader is not reading; each of the grader's sockets queues at most
QUEUED messages (ZMQ's receive high-water mark); the grader reads every output message,
counts its bytes and unpacks only those of the request it waits for, up to MAX_READ bytes a
request (the rest is dropped unread, with one note in the cell's output); what came for no
request is drained unread. Then `_cap` keeps at most MAX_CELL_BYTES characters a cell.
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
from .relay import MAX_FRAME, MAX_MEMORY, MAX_MESSAGE, Relay
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
QUEUED = 2                 # messages queued for the grader per socket (ZMQ's RCVHWM)
MAX_READ = 16 << 20        # bytes of one request's output messages unpacked; the rest dropped
MAX_STATUS = 4096          # bytes of a status message's content (an idle one is ~30)
DRAIN_S = 1.0              # the longest the grader drains unread output before a request
OUTPUTS = ("stream", "display_data", "execute_result", "error")


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


def connect(info: dict) -> BlockingKernelClient:
    """A client of the kernel `info` describes, each of its sockets holding at most QUEUED
    messages of frames of at most MAX_MESSAGE bytes (channels not started yet)."""
    context = zmq.Context()
    context.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE)   # every socket the client opens
    context.setsockopt(zmq.RCVHWM, QUEUED)
    client = BlockingKernelClient(context=context)
    client.load_connection_info(info)
    return client


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
        # A sandboxed kernel is reached through a relay of its own (see the module docstring).
        here = {**info, "ip": str(self.private / "kernel")}
        self.relay = None if sandbox.unsafe else Relay(here)
        self.client = connect(self.relay.connection() if self.relay else here)
        if wait:
            self.wait_until_ready()

    def wait_until_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while not any((self.private / f"kernel-{p}").exists() for p in (1, 2)):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the sandboxed kernel did not start: {self.stderr()}")
            time.sleep(0.05)
        # Never asked for input: stdin is not listened to; the relay passes no heartbeat.
        self.client.start_channels(stdin=False, hb=self.relay is None)
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
        return self.proc.poll() is None and (self.relay is None or self.relay.alive())

    def cause_of_death(self) -> str:
        """Why the kernel's process ended, in a learner's words (from its exit status: a
        signal's number, or 128 + it through bubblewrap)."""
        code = self.proc.poll()
        if code is None and self.relay is not None and not self.relay.alive():
            return (f"it sent more in one message than the grader takes (a part over "
                    f"{MAX_FRAME >> 20} MiB, or over {MAX_MEMORY >> 20} MiB at once)")
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
        reply, taken = Reply("ok"), [0]       # taken: bytes of this request's outputs read
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
                msg, size = self._message(0.2)
            except queue.Empty:
                continue
            if msg is None or msg["parent"] != msg_id:
                continue                # another request's, or no message: dropped unread
            if msg["kind"] == "clear_output":
                reply.outputs.clear()
            elif msg["kind"] in OUTPUTS:
                self._take(reply.outputs, msg, size, taken)
            elif msg["kind"] == "status" and self._idle(msg):
                return self._finish(msg_id, reply, timed_out=interrupted is not None)

    def _message(self, timeout: float) -> tuple[dict | None, int]:
        """The next message on iopub with its content left packed, as jupyter_client's
        `deserialize` makes it plus "kind" and "parent" (its msg_type, and its parent's
        msg_id), and its size in bytes; None for what is not a signed Jupyter message.
        queue.Empty when none comes within `timeout` s."""
        socket = self.client.iopub_channel.socket
        if not socket.poll(int(timeout * 1000)):
            raise queue.Empty
        frames = socket.recv_multipart(copy=False)
        size = sum(len(frame) for frame in frames)
        try:
            _, parts = self.client.session.feed_identities(frames, copy=False)
            msg = self.client.session.deserialize(parts, content=False, copy=False)
            msg["kind"], msg["parent"] = msg["msg_type"], msg["parent_header"].get("msg_id")
        except Exception:   # a tampered kernel's bytes (unsigned, not JSON, not a dict)
            return None, size
        return msg, size

    def _take(self, outputs: list, msg: dict, size: int, taken: list[int]) -> None:
        """Keep `msg`'s output (`_cap`), unpacked only while this request's output messages
        came to at most MAX_READ bytes; past that they are dropped unread, said once."""
        taken[0] += size
        if taken[0] > MAX_READ:
            _cap(outputs, {"output_type": "stream", "name": "labkit", "text": ""}, [0])
            return
        try:
            msg["content"] = self.client.session.unpack(msg["content"])
            _cap(outputs, nbformat.v4.output_from_msg(msg), self.budget)
        except (KeyError, TypeError, ValueError, AttributeError):
            pass                    # a malformed message from a tampered kernel: dropped

    def _idle(self, msg: dict) -> bool:
        if len(msg["content"]) > MAX_STATUS:
            return False
        try:
            return self.client.session.unpack(msg["content"]).get("execution_state") == "idle"
        except (ValueError, TypeError, AttributeError):
            return False

    def _drain(self) -> None:
        """Drop, unread, what the kernel published since our last request (for the trusted
        kernel's bridge, or after a reply): left there, it would hold the socket's queue and
        the next request's own messages would wait behind it. At most DRAIN_S long, as a
        kernel may publish without end."""
        socket = self.client.iopub_channel.socket
        deadline = time.monotonic() + DRAIN_S
        while time.monotonic() < deadline and socket.poll(0):
            socket.recv_multipart(copy=False)

    def _finish(self, msg_id: str, reply: Reply, timed_out: bool) -> Reply:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                msg = self.client.get_shell_msg(timeout=1)
                ours = msg["parent_header"].get("msg_id") == msg_id
                ours = ours and isinstance(msg["content"], dict)
            except Exception:   # none yet (queue.Empty), or a tampered kernel's bytes
                continue
            if ours:
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
        if self.relay is not None:
            self.relay.close()
        if self.group is not None:
            self.group.remove()
        self.client.stop_channels()
        self.client.context.destroy(linger=0)
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)
        remove_tree(self.private)
