"""The trusted test process's half of the bridge: learner names as proxies, data as data.

A test cell here runs with every name the lab asks the learner to write bound to what the
learner's kernel holds under it (`Bridge.bind`): data values (numbers, strings, tensors,
containers of them) as exact copies, anything else as a `Remote`, a proxy whose every use is
a request to the learner's kernel (course.grader.learner_side) answered with data:

    remote(*args)      arguments travel by value (pickled); what the call writes in a
                       tensor argument is written back only into the buffers an `outputs`
                       block declares (and their .grad); any other tensor it changes in
                       place stays as it was here, recorded for `unchanged`. This side's
                       torch RNG state and grad mode travel with the call, so a seed gives
                       the draws it would in one process; nothing comes back to set them,
                       and after the call this side's RNG moves on from its own state alone
                       (`_move_on`). With grad enabled, the outputs that carry a graph are
                       joined to this side's autograd (`_RemoteCall`): backward sends their
                       gradients back and returns those of the inputs
    remote.name        getattr (tensors come back as copies, .grad included)
    remote.name = v    setattr; also [], len, iter, in, repr, str, bool, copy.deepcopy
    isinstance(r, C)   by the nearest class of torch, builtins or the course packages in the
                       learner's object's own class hierarchy, as the learner's side reports it

A learner's exception comes back as its builtin base (`ValueError`, ...) or `LearnerError`.
While `Bridge.hidden` is set (hidden tests), nothing the learner's kernel prints is shown.
Nothing of this process's state (RNG, defaults, grad mode, globals) is ever set from what the
learner's side answers: answers are data, put only where a test asked for them.
"""

from __future__ import annotations

import base64
import builtins
import contextlib
import io
import pickle
import queue
import sys
import tempfile
import time
import types
import weakref
from pathlib import Path, PurePosixPath

import torch

from . import wire
from .buffers import Buffers
from .remote import Remote, _Pickler

REPLY_TIMEOUT_S = 300.0
LOOP = "__import__('course.grader.learner_side', fromlist=['serve_loop']).serve_loop()"
class LearnerError(Exception):
    """The learner's code raised an exception that is not one of wire.BUILTIN_ERRORS."""


class LearnerKernelLost(Exception):
    """The learner's kernel stopped answering (died, or ignored an interrupt)."""


class _RemoteCall(torch.autograd.Function):
    """A learner's call inside this side's autograd graph: forward asks for the call, backward
    for the gradients of its inputs (see learner_side._backward)."""

    @staticmethod
    def forward(ctx, bridge, box, _anchor, *inputs):
        ctx.bridge, ctx.gid, ctx.n = bridge, box["gid"], len(inputs)
        return tuple(box["outputs"][i] for i in range(len(box["outputs"])))

    @staticmethod
    def backward(ctx, *grads):
        got = ctx.bridge.ask("backward", gid=ctx.gid, grads=list(grads))
        return (None, None, None, *(got + [None] * (ctx.n - len(got)))[:ctx.n])


def _slots(value, tensors: list):
    """`value` with every tensor in its lists, tuples and dicts moved into `tensors`."""
    if isinstance(value, torch.Tensor) and type(value) is not Remote:
        tensors.append(value)
        return wire.Slot(len(tensors) - 1)
    if type(value) in (list, tuple):
        return type(value)(_slots(v, tensors) for v in value)
    if type(value) is dict:
        return {k: _slots(v, tensors) for k, v in value.items()}
    return value


def _ship(t: torch.Tensor) -> torch.Tensor:
    """What of a tensor travels: its values, detached, a Parameter still a Parameter (a
    leaf's .grad, which pickling drops, travels beside it: `Bridge.call`)."""
    shipped = t.detach()
    if type(t) is torch.nn.Parameter:
        shipped = torch.nn.Parameter(shipped, requires_grad=t.requires_grad)
    return shipped


def _move_on() -> None:
    """This side's RNG after a call: a fresh stream seeded from its own state, as if the call
    had drawn (the next call, or a draw here, does not repeat its draws); never anything the
    learner's side says."""
    torch.default_generator.manual_seed(int(torch.randint(1 << 62, ())))


def _swap(value, swaps: dict):
    """`value` with each tensor whose id is in `swaps` replaced (autograd's outputs)."""
    if isinstance(value, torch.Tensor) and id(value) in swaps:
        return swaps[id(value)]
    if type(value) in (list, tuple):
        return type(value)(_swap(v, swaps) for v in value)
    if type(value) is dict:
        return {k: _swap(v, swaps) for k, v in value.items()}
    return value


class Bridge:
    """A Jupyter client of the learner's kernel, asking one request at a time of its
    serve_loop (see course.grader.learner_side); `pause` ends that loop."""

    def __init__(self, connection: dict, timeout: float = REPLY_TIMEOUT_S,
                 workspace: Path | None = None):
        import zmq
        from jupyter_client import BlockingKernelClient

        context = zmq.Context()
        context.setsockopt(zmq.MAXMSGSIZE, wire.MAX_REPLY + (1 << 20))
        self.client = BlockingKernelClient(context=context)
        self.client.load_connection_info(connection)
        self.client.start_channels(iopub=False)    # answers come on stdin, printing in them
        self.timeout, self.hidden = timeout, False
        self.loop: str | None = None      # msg_id of the learner's serve_loop execution
        self.owed = 0                     # its answers to read before the next request's
        # the trusted kernel's own folder (its cwd, removed with it): fetch_dir's copies
        self.workspace = Path.cwd() if workspace is None else Path(workspace)
        self.buffers = Buffers()          # what calls write back, what they changed without
        self.proxies: weakref.WeakValueDictionary[int, Remote] = weakref.WeakValueDictionary()
        self.requests = 0
        # copies of the learner's tensor attributes handed out in this test cell: (copy,
        # owner, name, version); one changed in place here (even a temporary one:
        # `layer.lora_B.zero_()`) is written back before the next request
        self.copies: list[tuple[torch.Tensor, int, str, int]] = []
        from course.notebook import bridged

        bridged.BRIDGE = self

    def proxy(self, handle: wire.Handle) -> Remote:
        remote = self.proxies.get(handle.number)
        if remote is None:
            remote = self.proxies[handle.number] = Remote(self, handle)
        return remote

    def _write_back(self) -> None:
        """Send the copies of attributes changed in place here (`layer.lora_B.zero_()`)."""
        for k, (t, owner, name, version) in enumerate(self.copies):
            if t._version != version:
                self._send({"op": "setdata", "target": owner, "name": name,
                            "tensors": [t.detach()]}, write_back=False)
                self.copies[k] = (t, owner, name, t._version)

    def _send(self, request: dict, write_back: bool = True) -> wire.Decoded:
        """Pickle `request`, send it to the learner's serve_loop, decode the answer."""
        if write_back and self.copies:
            self._write_back()
        buffer = io.BytesIO()
        _Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(request)
        self.requests += 1
        deadline = time.monotonic() + self.timeout
        try:
            self._ready(deadline)
            self.client.input(base64.b64encode(buffer.getvalue()).decode())
            self.owed = 1
            text = self._prompt(deadline)
            self.owed = 0
        except KeyboardInterrupt:
            self._interrupt()
            raise
        decoded = wire.decode(text, self.proxy)
        if decoded.printed and not self.hidden:
            sys.stdout.write(decoded.printed)
        return decoded

    def _ready(self, deadline: float) -> None:
        """Until the learner's kernel waits for a request: its serve_loop started, and the
        answers nobody waits for any more (a request that timed out) read and dropped."""
        if self.loop is None:
            self.loop = self.client.execute(LOOP, silent=True, store_history=False,
                                            allow_stdin=True)
            self.owed = 1                # its first prompt answers nothing
        while self.owed:
            self._prompt(deadline)
            self.owed -= 1

    def _prompt(self, deadline: float) -> str:
        """The next answer of serve_loop: the text of its next input request's prompt."""
        while True:
            try:
                msg = self.client.get_stdin_msg(timeout=0.1)
            except queue.Empty:
                if time.monotonic() > deadline:
                    self._interrupt()
                    raise TimeoutError(f"your code did not answer in {self.timeout:g} s") \
                        from None
                if not self.client.is_alive():
                    raise LearnerKernelLost("the kernel running your code died") from None
                if self._loop_ended():
                    raise LearnerKernelLost("the kernel running your code sent no answer "
                                            "(was the grader's bridge in it changed?)") from None
                continue
            if msg["parent_header"].get("msg_id") != self.loop \
                    or msg["msg_type"] != "input_request":
                continue
            prompt = msg["content"].get("prompt")
            if type(prompt) is str and prompt.startswith(wire.REPLY_MARK):
                return prompt[len(wire.REPLY_MARK):]
            self.client.input("\x04")    # the learner's own input(): EOFError, as with no stdin

    def _loop_ended(self, timeout: float = 0) -> bool:
        """Whether serve_loop's execution finished (its reply arrived); then it is gone."""
        while True:
            try:
                msg = self.client.get_shell_msg(timeout=timeout)
            except queue.Empty:
                return False
            if msg["parent_header"].get("msg_id") == self.loop:
                self.loop, self.owed = None, 0
                return True

    def pause(self) -> None:
        """End serve_loop (when the learner's kernel is to run a cell of theirs): answers
        still owed are dropped, END sent, its execution's reply awaited (10 s at most; a
        kernel still busy then is the grader's to interrupt, as for any cell)."""
        deadline = time.monotonic() + 10
        try:
            if self.loop is not None:
                self._ready(deadline)
                self.client.input(wire.END)
                while self.loop is not None and time.monotonic() < deadline:
                    self._loop_ended(timeout=0.1)
        except (TimeoutError, LearnerKernelLost):
            pass
        self.loop, self.owed = None, 0

    def _value(self, decoded: wire.Decoded):
        value = decoded.value
        if type(value) is not dict:
            raise wire.InvalidReply("a reply is a dict")
        if "error" in value:
            name, base, message = (str(x)[:4000] for x in value["error"])
            if base in wire.BUILTIN_ERRORS:
                raise getattr(builtins, base)(message if name == base else f"({name}) {message}")
            raise LearnerError(f"{name}: {message}")
        return value

    def ask(self, op: str, **fields):
        """One request that is not a call; its value."""
        tensors: list = []
        request = {"op": op, **{k: _slots(v, tensors) for k, v in fields.items()},
                   "tensors": [_ship(t) for t in tensors]}
        if op == "backward":
            request["grads"] = [None if g is None else g.detach() for g in fields["grads"]]
            request["tensors"] = []
        value = self._value(self._send(request))["value"]
        if op == "getattr" and isinstance(value, torch.Tensor):
            self.copies.append((value, fields["target"], fields["name"], value._version))
        return value

    def call(self, remote: Remote, args: tuple, kwargs: dict):
        tensors: list = []
        args, kwargs = _slots(list(args), tensors), _slots(dict(kwargs), tensors)
        grad, declared = torch.is_grad_enabled(), [self.buffers.declares(t) for t in tensors]
        request = {"op": "call", "target": object.__getattribute__(remote, "_number"),
                   "args": args, "kwargs": kwargs, "grad": grad,
                   "tensors": [_ship(t) for t in tensors],
                   "requires_grad": [t.requires_grad for t in tensors],
                   "grads": [t.grad.detach() if t.is_leaf and t.grad is not None else None
                             for t in tensors],
                   "outputs": declared, "rng": torch.get_rng_state(),
                   "dtype": torch.get_default_dtype()}
        try:
            decoded = self._send(request)
        finally:
            _move_on()
        value = self._value(decoded)
        if type(value.get("changed")) is not dict or type(value.get("grads")) is not dict:
            raise wire.InvalidReply("a call's reply names what it changed in two dicts")
        self.buffers.take_back(tensors, declared, value["changed"], value["grads"])
        result = value["value"]
        if value.get("gid") is None or not decoded.outputs:
            return result
        outputs = [decoded.outputs[i] for i in sorted(decoded.outputs)]
        inputs = [t for t in tensors if t.requires_grad]
        box = {"gid": value["gid"], "outputs": outputs}
        anchor = torch.zeros((), requires_grad=True)   # so that the outputs join the graph
        joined = _RemoteCall.apply(self, box, anchor, *inputs)
        return _swap(result, {id(o): j for o, j in zip(outputs, joined, strict=True)})

    def bind(self, namespace: dict, names: list[str]) -> None:
        """Each of `names` the learner's kernel defines, into `namespace` (see the module
        docstring); a name it does not define is removed, as if never defined."""
        self.copies.clear()
        self.buffers.touched.clear()
        found = self.ask("bind", names=list(names))
        for name in names:
            if type(found) is dict and name in found:
                namespace[name] = found[name]
            else:
                namespace.pop(name, None)

    # -- what course.notebook.bridged and forbid ask of the learner's kernel ----------------

    def owns(self, target) -> bool:
        """Whether `target` (or the owner of an (owner, name) pair) is the learner's."""
        if type(target) is tuple and len(target) == 2:
            target = target[0]
        return type(target) is Remote

    def _spec(self, target) -> tuple:
        from course.notebook.forbid import bindings

        if type(target) is Remote:
            return ("h", object.__getattribute__(target, "_number"))
        if not (type(target) is tuple and len(target) == 2 and isinstance(target[1], str)):
            found = [(o, n) for o, n in bindings(target) if not isinstance(o, dict)]
            if not found:
                raise LookupError(f"{target!r} is bound nowhere in the course packages")
            target = found[0]
        owner, name = target
        if type(owner) is Remote:
            return ("ha", object.__getattribute__(owner, "_number"), name)
        if isinstance(owner, types.ModuleType):
            return ("m", owner.__name__, name)
        if isinstance(owner, type):
            return ("c", owner.__module__, owner.__qualname__, name)
        raise TypeError(f"cannot forbid {target!r} in the learner's kernel")

    @contextlib.contextmanager
    def forbid(self, targets: list, why: str):
        self.ask("forbid", specs=[self._spec(t) for t in targets], why=why)
        try:
            yield
        finally:
            self.ask("unforbid")

    def is_subclass(self, cls: Remote, base: type) -> bool:
        return self.ask("subclass", target=object.__getattribute__(cls, "_number"),
                        base=f"{base.__module__}.{base.__qualname__}")

    def is_instance(self, obj: Remote, cls: Remote) -> bool:
        return self.ask("isinstance", target=object.__getattribute__(obj, "_number"),
                        cls=cls)

    def share(self, obj) -> Remote:
        return self.ask("share", value=obj)

    def in_learner(self, source: str, name: str, args: tuple, kwargs: dict):
        return self.ask("run_check", source=source, name=name, args=list(args), kwargs=kwargs)

    def learner_dir(self) -> str:
        return self.ask("learner_dir")

    def fetch_dir(self, path: str) -> Path:
        """The files under the learner's `path`, in a new folder of `workspace` (which goes
        with the trusted kernel: nothing stays in this machine's /tmp)."""
        files = self.ask("read_dir", path=path)
        if type(files) is not dict:
            raise wire.InvalidReply("a folder's files come as a dict")
        local = Path(tempfile.mkdtemp(prefix="lab-fetched-", dir=self.workspace))
        for name, data in files.items():
            parts = PurePosixPath(name).parts if type(name) is str else ()
            if type(name) is not str or type(data) is not bytes or not parts or ".." in parts \
                    or name.startswith("/"):
                raise wire.InvalidReply(f"a file name {name!r} outside the folder")
            (local / name).parent.mkdir(parents=True, exist_ok=True)
            (local / name).write_bytes(data)
        return local

    def send_dir(self, local: Path) -> str:
        files = {str(p.relative_to(local)): p.read_bytes()
                 for p in sorted(local.rglob("*")) if p.is_file()}
        return self.ask("write_dir", files=files)

    def close(self) -> None:
        self.client.stop_channels()
