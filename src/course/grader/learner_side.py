"""The learner's kernel's half of the bridge: do what the trusted side asks, answer with data.

The trusted test process runs `serve_loop()` here, one execution per stretch of tests, and
sends its requests through Jupyter's stdin channel: each request is the reply to one of this
kernel's input requests, whose prompt carries the answer to the request before (so a request
costs a message each way, not a cell). A request is a base64 pickle of one of

    bind names           (forget every autograd graph kept for backward; the learner's
                          globals among `names`)
    getattr h name | setattr h name value | delattr h name | getitem h key
    setitem h key value | len h | iter h | contains h value | repr h | bool h | deepcopy h
    call h args kwargs   (tensors in args as wire.Slot; the torch RNG state, grad mode and
                          default dtype of the trusted side; which tensors are the declared
                          outputs: the tensors the call changed in place are named, declared
                          ones sent back whole with their .grad; nothing else of this side's
                          state travels back)
    backward gid grads   (the gradients of a call's outputs -> those of its inputs)

and its answer is wire.pack's text, with what the learner's code printed meanwhile.
It runs inside the learner's process, so nothing here is trusted: the learner can rewrite it,
and all they can change is the data their own side answers with.
"""

from __future__ import annotations

import base64
import contextlib
import copy
import io
import pickle

import torch

from .wire import BUILTIN_ERRORS, END, MAX_PRINTED, REPLY_MARK, Encoder, Slot, pack

_objects: dict[int, object] = {}    # handle number -> the learner's object (kept alive)
_numbers: dict[int, int] = {}       # id(object) -> handle number
_graphs: dict[int, tuple[list, list]] = {}   # gid -> (input leaves, followed outputs)
_forbidden: list = []               # the forbid blocks the trusted side has open, innermost last
MAX_FILES_BYTES = 64 << 20          # what fetch_dir sends back, in all


def _handle(obj) -> int:
    number = _numbers.get(id(obj))
    if number is None:
        number = _numbers[id(obj)] = len(_objects) + 1
        _objects[number] = obj
    return number


class _Unpickler(pickle.Unpickler):
    def persistent_load(self, pid):
        return _objects[pid[1]]


def _fill(value, tensors: list):
    """`value` with every wire.Slot replaced by its tensor; a container without one is
    itself (it may be an object of the learner's, reached through its handle)."""
    if type(value) is Slot:
        return tensors[value.index]
    if type(value) in (list, tuple):
        items = [_fill(v, tensors) for v in value]
        same = all(a is b for a, b in zip(items, value, strict=True))
        return value if same else type(value)(items)
    if type(value) is dict:
        items = {k: _fill(v, tensors) for k, v in value.items()}
        return value if all(items[k] is v for k, v in value.items()) else items
    return value


def _call(request: dict) -> dict:
    """Call the target; the result, the tensors it changed in place (index -> the whole
    storage of a declared output, None for any other) and the .grad it set on an output."""
    flags = request["requires_grad"]
    tensors = [t.requires_grad_(True) if rg else t
               for t, rg in zip(request["tensors"], flags, strict=True)]
    # A Triton kernel writes through pointers (no version bump), and may write outside the
    # view it was given: a tensor changed is one whose whole storage changed, sent back whole.
    for t, g in zip(tensors, request["grads"], strict=True):
        if g is not None:
            t.grad = g
    before = [_storage(t).clone() for t in tensors]
    grads = [None if t.grad is None else (t.grad, t.grad.clone()) for t in tensors]
    args, kwargs = _fill(request["args"], tensors), _fill(request["kwargs"], tensors)
    torch.set_rng_state(request["rng"])
    torch.set_default_dtype(request["dtype"])
    with torch.set_grad_enabled(request["grad"]):
        result = _objects[request["target"]](*args, **kwargs)
    outputs = request["outputs"]
    changed = {i: _storage(t) if outputs[i] else None
               for i, (t, b) in enumerate(zip(tensors, before, strict=True))
               if not torch.equal(_storage(t), b)}
    new_grads = {i: t.grad for i, (t, g) in enumerate(zip(tensors, grads, strict=True))
                 if outputs[i] and ((g is None) != (t.grad is None) or (g is not None and (
                     t.grad is not g[0] or not torch.equal(t.grad, g[1]))))}
    return {"value": result, "changed": changed, "grads": new_grads}


def _storage(t: torch.Tensor) -> torch.Tensor:
    """The bytes of `t`'s whole storage, as a uint8 tensor sharing it (NaN compares equal)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _followed(result) -> list[torch.Tensor]:
    """The result's tensors that carry an autograd graph, in encoding order."""
    found, stack = [], [result]
    while stack:
        v = stack.pop(0)
        if type(v) in (torch.Tensor, torch.nn.Parameter) and v.requires_grad:
            found.append(v)
        elif type(v) in (list, tuple):
            stack[:0] = list(v)
        elif type(v) is dict:
            stack[:0] = list(v.values())
    return found


def _answer(request: dict):
    op, target = request["op"], request.get("target")
    obj = _objects.get(target) if isinstance(target, int) else None
    if op == "bind":
        import __main__
        _graphs.clear()
        return {name: vars(__main__)[name] for name in request["names"]
                if name in vars(__main__)}
    if op == "getattr":
        return getattr(obj, request["name"])
    if op == "setattr":
        return setattr(obj, request["name"], _fill(request["value"], request["tensors"]))
    if op == "delattr":
        return delattr(obj, request["name"])
    if op == "getitem":
        return obj[_fill(request["key"], request["tensors"])]
    if op == "setitem":
        obj[_fill(request["key"], request["tensors"])] = _fill(request["value"],
                                                               request["tensors"])
        return None
    if op == "len":
        return len(obj)
    if op == "iter":
        return list(iter(obj))
    if op == "contains":
        return _fill(request["value"], request["tensors"]) in obj
    if op in ("repr", "str"):
        return (repr if op == "repr" else str)(obj)[:2000]
    if op == "bool":
        return bool(obj)
    if op == "deepcopy":
        return copy.deepcopy(obj)
    if op == "setdata":             # a copy the trusted side changed in place, written back
        with torch.no_grad():
            getattr(obj, request["name"]).copy_(request["tensors"][0])
        return None
    if op == "isinstance":
        return isinstance(obj, request["cls"])
    if op == "subclass":
        return any(f"{c.__module__}.{c.__qualname__}" == request["base"] for c in obj.__mro__)
    if op == "run_check":           # a check the lab declares must run here (bridged.in_learner)
        import __main__

        namespace = vars(__main__)      # globals() in the check is the learner's
        exec(compile(request["source"], f"<check {request['name']}>", "exec"), namespace)
        check = namespace.pop(request["name"])
        return check(*_fill(request["args"], request["tensors"]),
                     **_fill(request["kwargs"], request["tensors"]))
    if op in ("forbid", "unforbid"):
        return _forbid(request)
    if op in ("learner_dir", "read_dir", "write_dir"):
        return _files(op, request)
    raise ValueError(f"unknown request {op!r}")


def _forbid(request: dict) -> None:
    """Open (or close, the innermost) a forbid block of the trusted side's, here."""
    import importlib

    import __main__

    from ..notebook.forbid import forbid

    if request["op"] == "unforbid":
        _forbidden.pop().__exit__(None, None, None)
        return None
    targets = []
    for spec in request["specs"]:
        if spec[0] == "h":
            targets.append(_objects[spec[1]])
        elif spec[0] == "ha":
            targets.append((_objects[spec[1]], spec[2]))
        else:                                   # ("m", module, name) or ("c", module, class, name)
            owner = importlib.import_module(spec[1])
            for part in (spec[2].split(".") if spec[0] == "c" else []):
                owner = getattr(owner, part)
            targets.append((owner, spec[-1]))
    block = forbid(targets, vars(__main__), request["why"])
    block.__enter__()
    _forbidden.append(block)
    return None


def _files(op: str, request: dict):
    """A fresh folder; the regular files under one (as bytes); a folder holding given files."""
    import os
    import tempfile
    from pathlib import Path

    if op == "learner_dir":
        return tempfile.mkdtemp(prefix="lab-")
    if op == "write_dir":
        folder = Path(tempfile.mkdtemp(prefix="lab-"))
        for name, data in request["files"].items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
        return str(folder)
    files, total, root = {}, 0, Path(request["path"])
    for path in sorted(root.rglob("*")):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            total += len(data)
            if total > MAX_FILES_BYTES:
                raise ValueError(f"more than {MAX_FILES_BYTES} bytes of files under {root}")
            files[os.path.relpath(path, root)] = data
    return files


def _backward(request: dict) -> list:
    leaves, outputs = _graphs[request["gid"]]
    pairs = [(o, g) for o, g in zip(outputs, request["grads"], strict=False) if g is not None]
    for leaf in leaves:             # each backward returns its own input gradients; the
        leaf.grad = None            # learner's parameters accumulate, as in one process
    if pairs:
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs], retain_graph=True)
    return [leaf.grad if leaf.requires_grad else None for leaf in leaves]


class _Printed(io.StringIO):
    """What the learner's code prints while answering one request (the first MAX_PRINTED
    characters): it travels in the answer, and the trusted side shows it or not."""

    def write(self, text) -> int:
        text = str(text)
        if self.tell() < MAX_PRINTED:
            super().write(text[:MAX_PRINTED - self.tell()])
        return len(text)


def answer(payload: str) -> str:
    """The answer to one request (see the module docstring), as text."""
    encoder, printed = Encoder(_handle), _Printed()
    try:
        with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
            request = _Unpickler(io.BytesIO(base64.b64decode(payload))).load()
            if request["op"] == "call":
                done = _call(request)
                followed = _followed(done["value"]) if request["grad"] else []
                gid = None
                if followed:
                    gid = len(_graphs) + 1
                    leaves = [t for t, rg in zip(request["tensors"],
                                                 request["requires_grad"], strict=True) if rg]
                    _graphs[gid] = (leaves, followed)
                index = {id(t): i for i, t in enumerate(followed)}
                encoder.follow = lambda t: index.pop(id(t), None)  # the first copy only
                tree = encoder({"value": done["value"], "changed": done["changed"],
                                "grads": done["grads"], "gid": gid})
            elif request["op"] == "share":  # the tests' object, kept here: the reply is its handle
                encoder.shared = _fill(request["value"], request["tensors"])
                tree = encoder({"value": encoder.shared})
            elif request["op"] == "backward":
                tree = encoder({"value": _backward(request)})
            else:
                tree = encoder({"value": _answer(request)})
        return pack(tree, encoder.tensors, printed.getvalue())
    except BaseException as e:  # the learner's error, reported as data  # noqa: BLE001
        base = next((c.__name__ for c in type(e).__mro__ if c.__name__ in BUILTIN_ERRORS
                     and c.__module__ == "builtins"), None)
        return pack({"D": [["error", {"L": [type(e).__name__[:200], base, str(e)[:4000]]}]]},
                    {}, printed.getvalue())


def serve_loop() -> None:
    """Answer requests until the trusted side sends wire.END (see the module docstring)."""
    text = ""
    while (payload := input(REPLY_MARK + text)) != END:
        text = answer(payload)
