"""The grader's only connection to a sandboxed kernel: each message passed on whole, if small.

ZMQ bounds a receiver's queue in messages (RCVHWM) and its frames in bytes (MAXMSGSIZE), not
a message's frames together: one message of many frames fills the receiver's memory without
end, whether or not it reads. So the grader never connects to a learner's kernel itself;
a relay does, one process per kernel, its address space limited to MAX_MEMORY:

    kernel iopub (XPUB)             ->  SUB     relay  XPUB    ->  the grader's SUB
    kernel shell, control (ROUTER) <->  DEALER  relay  DEALER <->  the grader's DEALERs

ZMQ hands a reader a message only once it is whole, so the relay holds each message whole
once, up to MAX_MEMORY. Every message is read as soon as it is there and passed on when its
frames come to at most MAX_MESSAGE bytes; a larger one is let go, and its request gets a
notice, so a kernel printing large lines goes on being graded. Past MAX_MEMORY, or past
MAX_FRAME bytes in one frame (ZMQ then drops the connection, and what the kernel sent
meanwhile is lost), the relay ends. What
waits for room at the grader (while it is not reading) is held in an Outbox of at most
MAX_HELD bytes per socket, and what finds it full is dropped. On iopub, a dropped message's
request gets in its place, once, a stream message named "labkit" saying so (signed with the
kernel's key, as the kernel signs). Should the relay end, the grader counts the kernel as
dead (jupyter_kernel.Kernel.alive). The grader's sockets to the relay hold at most QUEUED
messages each (jupyter_kernel.connect), so what the grader holds of a kernel's output is
bounded in bytes whatever the kernel sends.

    python relay.py FOLDER    connection file on stdin (one line); binds FOLDER/relay-<port>;
                              ends when stdin closes (the grader gone)
"""

from __future__ import annotations

import collections
import hmac
import json
import shutil
import subprocess
import sys
import tempfile
import uuid
from hashlib import sha256
from pathlib import Path

import zmq

MAX_MESSAGE = 16 << 20      # bytes of one message passed on, its frames together
MAX_FRAME = 256 << 20      # bytes of one frame read (and let go); a larger one ends the relay
MAX_MEMORY = 1 << 30        # the relay's address space (about 110 MiB used idle)
QUEUED = 2                  # messages each socket of the relay queues (RCVHWM, SNDHWM)
MAX_HELD = 64 << 20         # bytes waiting for room at one socket (Outbox); past it, dropped
MAX_HEADER = 1 << 16        # bytes of a dropped message's header and parent read for a notice
DELIM = b"<IDS|MSG>"
# channel: (the socket toward the kernel, the socket toward the grader)
CHANNELS = {"iopub": (zmq.SUB, zmq.XPUB), "shell": (zmq.DEALER, zmq.DEALER),
            "control": (zmq.DEALER, zmq.DEALER)}


def notice(frames: list, text: str, key: bytes) -> tuple[bytes, list] | None:
    """(the parent header, a stream message "labkit" to that parent saying `text`, signed as
    the kernel signs) in place of a dropped message, or None when its header and parent are
    not small JSON. `frames`: [topic..., DELIM, hmac, header, parent, metadata, content...]."""
    try:
        at = next(i for i, f in enumerate(frames) if len(f) == len(DELIM) and f.bytes == DELIM)
        header, parent = frames[at + 2], frames[at + 3]
        if len(header) + len(parent) > MAX_HEADER:
            return None
        head, parent = json.loads(header.bytes), parent.bytes
        head.update(msg_id=uuid.uuid4().hex, msg_type="stream")
        parts = [json.dumps(head).encode(), parent, b"{}",
                 json.dumps({"name": "labkit", "text": text}).encode()]
    except (StopIteration, IndexError, ValueError, TypeError, AttributeError):
        return None
    mac = hmac.new(key, digestmod=sha256)
    for part in parts:
        mac.update(part)
    return parent, [*frames[:at], DELIM, mac.hexdigest().encode(), *parts]


def receive(socket) -> tuple[list, int]:
    """One message from `socket`: its frames while they come to at most MAX_MESSAGE bytes
    (later ones are let go as they are read), and its size in bytes."""
    frames, size = [], 0
    while True:
        frame = socket.recv(copy=False)
        size += len(frame)
        if size <= MAX_MESSAGE:
            frames.append(frame)
        if not frame.more:
            return frames, size


class Outbox:
    """The messages waiting for room at one socket (the grader not reading, or the kernel
    busy), at most `limit` bytes of them: ZMQ's queues count messages, this counts bytes."""

    def __init__(self, socket):
        self.socket, self.messages, self.bytes = socket, collections.deque(), 0

    def add(self, frames: list, size: int, limit: int = MAX_HELD) -> bool:
        """Queue a message; False (not queued) when it would take the box over `limit`."""
        if self.bytes + size > limit:
            return False
        self.messages.append((frames, size))
        self.bytes += size
        return True

    def flush(self) -> None:
        while self.messages:
            try:
                self.socket.send_multipart(self.messages[0][0], copy=False, flags=zmq.NOBLOCK)
            except zmq.Again:           # no room there yet: kept
                return
            self.bytes -= self.messages.popleft()[1]


def relay(peer: dict, iopub, key: bytes, stop: int, lost: tuple = ()) -> None:
    """Pass each message from a socket of `peer` to its peer's Outbox (peer None: read and
    dropped, the grader's subscriptions) until `stop` (a file descriptor) is readable or a
    socket of `lost` (monitors of the kernel's connections) says one dropped. Every
    socket is read as soon as it can be, so no message piles up unread; one over MAX_MESSAGE
    bytes, or finding its Outbox full, is dropped, and on `iopub` (the kernel's) its parent
    gets a notice, once per parent."""
    boxes = {other: Outbox(other) for other in peer.values() if other is not None}
    poller = zmq.Poller()
    for socket in peer:
        poller.register(socket, zmq.POLLIN)
    for socket in (stop, *lost):
        poller.register(socket, zmq.POLLIN)
    noticed = None                  # the parent of the last notice: one per request
    while True:
        for box in boxes.values():
            box.flush()
        waiting = any(box.messages for box in boxes.values())
        for socket, _ in poller.poll(10 if waiting else None):
            if socket == stop or socket in lost:
                return
            frames, size = receive(socket)
            if peer[socket] is None:
                continue
            box = boxes[peer[socket]]
            if size <= MAX_MESSAGE and box.add(frames, size):
                continue
            text = (f"[a message of {size:,} bytes, over the grader's {MAX_MESSAGE >> 20} MiB, "
                    "was dropped]\n" if size > MAX_MESSAGE else f"[output dropped: over "
                    f"{MAX_HELD >> 20} MiB of it waited for the grader]\n")
            said = notice(frames, text, key) if socket is iopub else None
            if said is not None and said[0] != noticed:
                noticed = said[0]
                box.add(said[1], sum(len(f) for f in said[1]), MAX_HELD + MAX_HEADER * 16)


def main(folder: str) -> None:
    import resource  # POSIX only: here, not where the grader imports this module

    resource.setrlimit(resource.RLIMIT_AS, (MAX_MEMORY, MAX_MEMORY))
    info = json.loads(sys.stdin.readline())
    context = zmq.Context()
    context.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME)     # a larger frame drops its connection
    context.setsockopt(zmq.RCVHWM, QUEUED)
    context.setsockopt(zmq.SNDHWM, QUEUED)
    peer, iopub, lost = {}, None, []
    for channel, (inner, outer) in CHANNELS.items():
        kernel, grader = context.socket(inner), context.socket(outer)
        if inner == zmq.SUB:
            kernel.setsockopt(zmq.SUBSCRIBE, b"")
            grader.setsockopt(zmq.XPUB_NODROP, 1)    # full: EAGAIN, not a silent drop
            iopub = kernel
        lost.append(kernel.get_monitor_socket(zmq.EVENT_DISCONNECTED))
        kernel.connect(f"ipc://{info['ip']}-{info[f'{channel}_port']}")
        grader.bind(f"ipc://{folder}/relay-{info[f'{channel}_port']}")
        peer[kernel], peer[grader] = grader, None if inner == zmq.SUB else kernel
    relay(peer, iopub, info["key"].encode(), sys.stdin.fileno(), tuple(lost))


class Relay:
    """The grader's side of one kernel's relay: `connection()` for the grader's client."""

    def __init__(self, info: dict):
        """`info`: the kernel's connection (its sockets at `info["ip"]`-<port>, its key)."""
        self.info = info
        self.folder = Path(tempfile.mkdtemp(prefix="labkit-relay-"))
        self.proc = subprocess.Popen([sys.executable, __file__, str(self.folder)],
                                     stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        self.proc.stdin.write(json.dumps(info).encode() + b"\n")
        self.proc.stdin.flush()

    def connection(self) -> dict:
        return {**self.info, "ip": str(self.folder / "relay")}

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        shutil.rmtree(self.folder, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1])
