"""What crosses between the learner's kernel and the trusted test process, and how.

    trusted -> learner   pickle (the learner's side may unpickle what the grader sends;
                         a learner object the grader holds travels as its handle number)
    learner -> trusted   data only: a JSON tree of tagged nodes plus one safetensors blob
                         (and the text the learner's code printed meanwhile);
                         `decode` rebuilds plain Python values of exact types, plain tensors
                         (dtype and shape from the safetensors header) and `Handle`s

Nothing the learner's side sends can become an object of the learner's making: a node of an
unknown tag, a tensor name not in the blob, too deep a tree or too large a message is an
`InvalidReply`. The tags:

    null bool int float str          themselves (JSON; NaN and ±Infinity as JSON5 spells them)
    {"L": [...]} {"T": [...]}        list, tuple
    {"D": [[key, value], ...]}       dict (keys of any data type)
    {"S": [...]} {"F": [...]}        set, frozenset
    {"B": base64} {"C": [re, im]}    bytes, complex
    {"t": name, "p": is Parameter, "r": requires_grad, "g": name of .grad or null,
     "o": index among the outputs autograd follows, or null, "d": "cpu" or "cuda[:n]"}
    {"dt": "float32"} {"dev": "cpu"} {"sz": [...]} {"sl": [start, stop, step]} {"E": 0}
                                     torch.dtype, torch.device, torch.Size, slice, Ellipsis
    {"h": number, "c": "module.Class ..." (its class hierarchy), "k": callable}
                                     an object of the learner's: a handle to it (never
                                     one of a torch.Tensor subclass: refused, a proxy is
                                     no tensor to torch's C++)
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass

import torch

MAX_REPLY = 64 << 20         # characters of one reply (the kernel's message cap)
MAX_DEPTH = 64
MAX_PRINTED = 20_000         # characters of the learner's printing kept per request
MAX_NODES = 200_000
TENSOR_BASE = "torch._C.TensorBase"     # in the class hierarchy of every tensor subclass
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128)}


class InvalidReply(Exception):
    """What the learner's side sent is not data this module reads."""


@dataclass(frozen=True)
class Handle:
    """An object that stays in the learner's kernel: its number there, the qualified name of
    its class (as the learner's side reports it) and whether it is callable."""
    number: int
    cls: str
    callable: bool


@dataclass
class Decoded:
    value: object
    outputs: dict          # {output index: tensor} of the tensors autograd follows
    printed: str = ""      # what the learner's code printed while answering


# -- learner side: encode ---------------------------------------------------------------------

class Encoder:
    """Turns a learner-side value into (tree, tensors); `handle(obj)` numbers the rest."""

    def __init__(self, handle, follow=None, shared=None):
        self.handle, self.follow = handle, follow      # follow: tensor -> output index | None
        self.shared = shared          # an object sent as a handle even if it is data
        self.tensors: dict[str, torch.Tensor] = {}

    def tensor(self, t: torch.Tensor) -> str:
        name = f"t{len(self.tensors)}"
        self.tensors[name] = t.detach().to("cpu").contiguous().clone()
        return name

    def __call__(self, v, depth: int = 0):
        if depth > MAX_DEPTH:
            raise ValueError("the value is nested too deeply to send")
        kind, enc = type(v), (lambda x: self(x, depth + 1))
        if v is self.shared and v is not None:
            return self._handle(v)
        if v is None or kind in (bool, int, str):
            return v
        if kind is float:
            return v
        if kind in (list, tuple, set, frozenset):
            tag = {list: "L", tuple: "T", set: "S", frozenset: "F"}[kind]
            return {tag: [enc(x) for x in v]}
        if kind is dict:
            return {"D": [[enc(k), enc(x)] for k, x in v.items()]}
        if kind is bytes:
            return {"B": base64.b64encode(v).decode()}
        if kind is complex:
            return {"C": [v.real, v.imag]}
        if kind in (torch.Tensor, torch.nn.Parameter):
            grad = v.grad if v.is_leaf else None
            out = self.follow(v) if self.follow else None
            return {"t": self.tensor(v), "p": kind is torch.nn.Parameter, "r": v.requires_grad,
                    "g": None if grad is None else self.tensor(grad), "o": out,
                    "d": str(v.device)}
        if kind is torch.dtype:
            return {"dt": str(v).removeprefix("torch.")}
        if kind is torch.device:
            return {"dev": str(v)}
        if kind is torch.Size:
            return {"sz": list(v)}
        if kind is slice:
            return {"sl": [enc(v.start), enc(v.stop), enc(v.step)]}
        if v is Ellipsis:
            return {"E": 0}
        return self._handle(v)

    def _handle(self, v) -> dict:
        return {"h": self.handle(v), "k": callable(v), "c": " ".join(
            f"{c.__module__}.{c.__qualname__}" for c in type(v).__mro__)[:2000]}


def pack(tree, tensors: dict[str, torch.Tensor], printed: str = "") -> str:
    """One reply's text: the tree, the tensors (safetensors, base64) and what was printed."""
    from safetensors.torch import save

    blob = save(tensors) if tensors else b""
    return json.dumps({"v": tree, "st": base64.b64encode(blob).decode(), "out": printed})


# -- trusted side: decode ---------------------------------------------------------------------

def _tensors(text: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    if not isinstance(text, str):
        raise InvalidReply("the tensors are not base64 text")
    try:
        return load(base64.b64decode(text, validate=True)) if text else {}
    except Exception as e:  # a malformed blob, whatever the parser raised
        raise InvalidReply(f"the tensors do not read as safetensors ({type(e).__name__})") from e


def decode(text: str, handle) -> Decoded:
    """The value a reply holds; `handle(Handle)` gives the trusted side's proxy for one."""
    if not isinstance(text, str) or len(text) > MAX_REPLY:
        raise InvalidReply(f"a reply must be text of at most {MAX_REPLY} characters")
    try:
        message = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise InvalidReply("the reply is not JSON") from e
    if type(message) is not dict or not {"v", "st"} <= set(message) <= {"v", "st", "out"} \
            or type(message.get("out", "")) is not str:
        raise InvalidReply("the reply is not {v, st, out}")
    tensors, outputs, count = _tensors(message["st"]), {}, [0]

    def tensor(name) -> torch.Tensor:
        if type(name) is not str or name not in tensors:
            raise InvalidReply(f"tensor {name!r} is not in the reply")
        return tensors[name]

    def device(name) -> torch.device:
        if type(name) is not str or name.split(":")[0] not in ("cpu", "cuda"):
            raise InvalidReply(f"a tensor on device {name!r}")
        if name.startswith("cuda") and not torch.cuda.is_available():
            raise InvalidReply("a CUDA tensor where there is no GPU")
        return torch.device(name)

    def dec(node, depth: int):
        count[0] += 1
        if depth > MAX_DEPTH or count[0] > MAX_NODES:
            raise InvalidReply("the reply is too deep or too large")
        kind = type(node)
        if node is None or kind in (bool, int, str):
            return node
        if kind is float:
            return node
        if kind is not dict or len(node) not in (1, 3, 6):
            raise InvalidReply(f"a node of type {kind.__name__} is not data")
        d = lambda x: dec(x, depth + 1)  # noqa: E731
        if len(node) == 1:
            (tag, body), = node.items()
            if tag in ("L", "T", "S", "F") and type(body) is list:
                items = [d(x) for x in body]
                return {"L": list, "T": tuple, "S": set, "F": frozenset}[tag](items)
            if tag == "D" and type(body) is list and all(type(p) is list and len(p) == 2
                                                         for p in body):
                return {d(k): d(v) for k, v in body}
            if tag == "B" and type(body) is str:
                return base64.b64decode(body, validate=True)
            if tag == "C" and type(body) is list and len(body) == 2 and all(
                    type(x) in (int, float) for x in body):
                return complex(*body)
            if tag == "dt" and body in DTYPES:
                return DTYPES[body]
            if tag == "dev" and type(body) is str and body.split(":")[0] in ("cpu", "cuda"):
                return torch.device(body)
            if tag == "sz" and type(body) is list and all(type(x) is int for x in body):
                return torch.Size(body)
            if tag == "sl" and type(body) is list and len(body) == 3:
                return slice(*(d(x) for x in body))
            if tag == "E" and body == 0:
                return Ellipsis
        elif set(node) == {"h", "c", "k"} and type(node["h"]) is int \
                and type(node["c"]) is str and type(node["k"]) is bool:
            names = node["c"][:2000].split()
            if TENSOR_BASE in names:      # only a plain tensor is data; a proxy is no tensor
                raise InvalidReply(
                    f"your code gave a {names[0].rpartition('.')[2][:80]}, a subclass of "
                    "torch.Tensor: give a plain torch.Tensor (`.as_subclass(torch.Tensor)`)")
            return handle(Handle(node["h"], node["c"][:2000], node["k"]))
        elif set(node) == {"t", "p", "r", "g", "o", "d"} and type(node["p"]) is bool \
                and type(node["r"]) is bool:
            where = device(node["d"])
            t = tensor(node["t"]).to(where).clone()       # a name used twice: two tensors
            if node["o"] is not None:
                if type(node["o"]) is not int or node["o"] in outputs:
                    raise InvalidReply("a bad output index")
                outputs[node["o"]] = t
            if node["p"]:
                t = torch.nn.Parameter(t, requires_grad=node["r"] and t.is_floating_point())
            elif node["r"] and node["o"] is None and (t.is_floating_point() or t.is_complex()):
                t.requires_grad_(True)
            if node["g"] is not None:
                g = tensor(node["g"]).to(where).clone()
                if g.shape != t.shape or g.dtype != t.dtype:
                    raise InvalidReply("a .grad of another shape or dtype than its tensor")
                t.grad = g
            return t
        raise InvalidReply(f"unknown node {sorted(node)[:3]}")

    try:
        value = dec(message["v"], 0)
    except (TypeError, ValueError, OverflowError, RecursionError) as e:
        raise InvalidReply(f"the reply does not decode ({type(e).__name__})") from e
    return Decoded(value, outputs, message.get("out", "")[:MAX_PRINTED])


@dataclass(frozen=True)
class Slot:
    """In a pickled request: the tensor at this index of the request's tensor list."""
    index: int


REPLY_MARK = "\x1ecourse-reply\x1e"   # how an input prompt carrying an answer starts
END = "\x1eend\x1e"                   # the request that ends learner_side.serve_loop
# Exceptions the trusted side raises as themselves when the learner's code raises them (or a
# subclass); any other is a LearnerError. Tests may expect `except ValueError` and the like.
# Not StopIteration: raised by a call inside the test's map() or next(), it would end the
# test's own iteration early, silently.
BUILTIN_ERRORS = ("AssertionError", "AttributeError", "IndexError", "KeyError", "LookupError",
                  "NotImplementedError", "OverflowError", "RuntimeError", "TypeError",
                  "ValueError", "ZeroDivisionError", "ArithmeticError")
