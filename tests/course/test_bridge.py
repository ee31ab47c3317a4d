"""The bridge between the trusted test kernel and the learner's kernel (course.grader: wire,
learner_side, trusted_side): data only comes back, and what the tests see equals one process,
but where that would trust the learner's side: it sets no state here (the RNG after a call),
writes back only into declared outputs, and never passes for a tensor or a C-backed class.

The kernel-backed tests start one learner kernel (no sandbox: these test the bridge, the
sandbox has its own tests) and talk to it from this process, as the trusted kernel does.
"""

from __future__ import annotations

import base64
import contextlib
import json
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from course.grader import wire
from course.grader.jupyter_kernel import Kernel
from course.grader.sandbox import Sandbox
from course.grader.trusted_side import Bridge, LearnerError, LearnerKernelLost, Remote
from course.notebook import bridged
from course.notebook.forbid import forbid

ROOT = Path(__file__).resolve().parents[2]


def reply(tree, tensors=None) -> str:
    blob = save(tensors) if tensors else b""
    return json.dumps({"v": tree, "st": base64.b64encode(blob).decode()})


# -- wire: what decodes, and what does not ----------------------------------------------------

def test_every_data_type_round_trips_with_its_exact_type():
    value = [1, 2.5, True, None, "s", (1, (2,)), {"k": [3], 4: 5}, {1, 2}, frozenset({3}),
             b"\x00\xff", 1 + 2j, torch.float16, torch.device("cpu"), torch.Size([2, 3]),
             slice(1, None, 2), Ellipsis, float("nan")]
    enc = wire.Encoder(lambda obj: 0)
    back = wire.decode(wire.pack(enc(value), enc.tensors), lambda h: h).value
    assert [type(v) for v in back] == [type(v) for v in value]
    assert back[:-1] == value[:-1] and back[-1] != back[-1]


def test_tensors_come_back_as_plain_tensors_with_grad_and_parameter_kind():
    p = torch.nn.Parameter(torch.randn(2, 3))
    p.grad = torch.ones(2, 3)
    enc = wire.Encoder(lambda obj: 0)
    t, q = wire.decode(wire.pack(enc([torch.arange(4), p]), enc.tensors), lambda h: h).value
    assert type(t) is torch.Tensor and torch.equal(t, torch.arange(4))
    assert type(q) is torch.nn.Parameter and torch.equal(q, p) and torch.equal(q.grad, p.grad)


def test_a_learner_subclass_of_a_data_type_is_a_handle_not_data():
    class AlwaysEqual(list):
        def __eq__(self, other):
            return True

    enc = wire.Encoder(lambda obj: 7)
    got = wire.decode(wire.pack(enc(AlwaysEqual([1])), enc.tensors), lambda h: h).value
    assert type(got) is wire.Handle and got.number == 7 and "AlwaysEqual" in got.cls


@pytest.mark.parametrize("tree, why", [
    ({"X": []}, "unknown node"),
    ({"L": [1], "T": [2]}, "not data"),
    ({"t": "t9", "p": False, "r": False, "g": None, "o": None, "d": "cpu"}, "not in the reply"),
    ({"t": "t9", "p": False, "r": False, "g": None, "o": None, "d": "meta"}, "on device"),
    ({"dt": "object"}, "unknown node"),
    ({"dev": "file:///etc"}, "unknown node"),
    ({"h": "1", "c": "x", "k": True}, "unknown node"),
    ([1], "not data"),
])
def test_a_malformed_reply_is_refused(tree, why):
    with pytest.raises(wire.InvalidReply, match=why):
        wire.decode(reply(tree), lambda h: h)


def test_a_grad_of_another_shape_and_a_deep_or_huge_reply_are_refused():
    t = {"t0": torch.zeros(2), "t1": torch.zeros(3)}
    with pytest.raises(wire.InvalidReply, match="shape"):
        wire.decode(reply({"t": "t0", "p": False, "r": False, "g": "t1", "o": None,
                           "d": "cpu"}, t),
                    lambda h: h)
    deep = 0
    for _ in range(200):
        deep = {"L": [deep]}
    with pytest.raises(wire.InvalidReply, match="deep"):
        wire.decode(reply(deep), lambda h: h)
    with pytest.raises(wire.InvalidReply, match="at most"):
        wire.decode("x" * (wire.MAX_REPLY + 1), lambda h: h)
    with pytest.raises(wire.InvalidReply, match="safetensors"):
        wire.decode(json.dumps({"v": 1, "st": base64.b64encode(b"junk").decode()}), lambda h: h)


# -- one learner kernel, asked from here -----------------------------------------------------

LEARNER = '''
import math, torch, torch.nn as nn
from pathlib import Path

def scale(x, s=2.0):
    return x * s + 1

class Lin(nn.Module):
    def __init__(self, base, r=4):
        super().__init__()
        if r <= 0:
            raise ValueError(f"r must be positive, got {r}")
        base.requires_grad_(False)
        self.base, self.drop = base, nn.Dropout(0.5)
        self.A = nn.Parameter(torch.randn(r, base.in_features))
        self.B = nn.Parameter(torch.zeros(base.out_features, r))

    def forward(self, x):
        return self.base(x) + self.drop(x) @ self.A.t() @ self.B.t()

class MatMul(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return x @ w

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w.t(), x.t() @ g

def triple_into(out, x):
    out.copy_(x * 3)

def shout():
    print("printed by the learner")
    raise KeyError("nope")

class Custom(Exception):
    pass

def custom():
    raise Custom("mine")

def stop(x):
    raise StopIteration

class AlwaysEqual(list):
    def __eq__(self, other):
        return True

def always_equal():
    return AlwaysEqual([0])

def calls_sum(x):
    return torch.sum(x)

def save_to(folder):
    (Path(folder) / "a.txt").write_text("hi")

def read_from(folder):
    return (Path(folder) / "b.txt").read_text()

def fill_dict(d):
    d["n"] = 3

def noise(n):
    return torch.rand(n)

def reseed():                   # a learner's side that sets its own RNG state, then draws
    torch.manual_seed(0)
    return torch.rand(2)

def zero_x(x, y):               # a wrong axpy: x zeroed in place, y given back
    x.zero_()
    return y

class Sub(torch.Tensor):
    pass

def sub_result():
    return torch.ones(2).as_subclass(Sub)

def generator():
    return torch.Generator().manual_seed(1)

import triton, triton.language as tl

@triton.jit
def fill_kernel(out, N, BLOCK: tl.constexpr):    # one element past N: outside a view
    i = tl.arange(0, BLOCK)
    tl.store(out + i, i.to(tl.float32) + 1, mask=i < N + 1)

import minimoe

def calls_route(*args):
    return minimoe.route(*args)

def clip_(params, top):
    for p in params:
        p.grad.clamp_(-top, top)

def scale_grads(params):
    for p in params:
        p.grad = p.grad * 2

CONST = torch.arange(5.)
# the learner's kernel patches torch: only its own process is fooled
torch.testing.assert_close = lambda *a, **k: None
torch.allclose = lambda *a, **k: True
'''
NAMES = ["scale", "Lin", "MatMul", "triple_into", "shout", "custom", "always_equal",
         "calls_sum", "save_to", "read_from", "fill_dict", "fill_kernel", "calls_route",
         "clip_", "scale_grads", "noise", "reseed", "zero_x", "sub_result", "generator", "stop",
         "CONST", "not_defined"]


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    kernel = Kernel(Sandbox(ROOT, unsafe=True), slot=0)
    assert kernel.run(LEARNER, timeout=120).ok
    with contextlib.chdir(tmp_path_factory.mktemp("workspace")):   # the trusted kernel's cwd
        bridge = Bridge(kernel.connection(), timeout=60)
    ns: dict = {}
    bridge.bind(ns, NAMES)
    yield bridge, ns, kernel
    bridged.BRIDGE = None
    bridge.close()
    kernel.close()


def test_names_bind_as_data_or_proxies(learner):
    _, ns, _ = learner
    assert "not_defined" not in ns
    assert type(ns["CONST"]) is torch.Tensor and torch.equal(ns["CONST"], torch.arange(5.))
    assert type(ns["scale"]) is Remote


def test_calls_and_autograd_equal_one_process(learner):
    _, ns, _ = learner
    x = torch.randn(3, 4, requires_grad=True)
    ns["scale"](x, s=3.0).sum().backward()
    assert torch.equal(x.grad, torch.full((3, 4), 3.0))
    xx = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    ww = torch.randn(4, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(ns["MatMul"].apply, (xx, ww))


def test_modules_rng_attributes_and_write_back(learner):
    _, ns, _ = learner
    layer = ns["Lin"](torch.nn.Linear(4, 2), r=3)
    assert isinstance(layer, torch.nn.Module) and layer.train() is layer
    assert type(layer.A) is torch.nn.Parameter and not layer.base.weight.requires_grad
    assert isinstance(layer.drop, torch.nn.Dropout) and layer.drop.p == 0.5
    torch.manual_seed(7)
    y1 = layer(torch.ones(2, 4))
    torch.manual_seed(7)
    assert torch.equal(y1, layer(torch.ones(2, 4))), "the RNG state did not travel"
    with torch.no_grad():
        layer.B.fill_(1.0)                      # a copy, changed here: written back
    layer.eval()
    layer(torch.ones(2, 4)).sum().backward()
    assert layer.A.grad is not None and torch.equal(layer.B, torch.ones(2, 3))
    assert [n for n, p in layer.named_parameters() if p.requires_grad] == ["A", "B"]
    assert bridged.is_subclass(ns["Lin"], torch.nn.Module)


def test_a_seed_gives_a_call_its_draws_and_no_reply_sets_this_sides_rng(learner):
    """Each call draws from this side's RNG state, as it would in one process; this side's
    RNG then moves on from its own state alone, whatever the learner's side did with its own."""
    bridge, ns, kernel = learner
    torch.manual_seed(3)
    first = ns["noise"](2)
    torch.manual_seed(3)
    assert torch.equal(first, torch.rand(2)), "the RNG state did not travel with the call"
    torch.manual_seed(3)
    assert not torch.equal(ns["noise"](2), ns["noise"](2)), \
        "two calls in a row drew the same numbers: this side's RNG must move on after a call"
    after = []
    for call in (lambda: ns["reseed"](), lambda: ns["scale"](1.0), lambda: ns["noise"](9)):
        torch.manual_seed(5)
        call()
        after.append(torch.rand(4))
    assert all(torch.equal(a, after[0]) for a in after), \
        "the trusted RNG was set from the learner's side: after a call it must depend on " \
        "this side's state only"
    bridge.pause()
    assert kernel.run("_ = torch.rand(5)", timeout=30).ok     # a learner's cell draws
    torch.manual_seed(3)
    assert torch.equal(ns["noise"](2), first), "a seed here gives the call its draws"


def test_only_declared_outputs_are_written_back(learner):
    """A call's in-place change comes back into a buffer an `outputs` block declares (a view
    of its storage included), never into any other tensor argument, such as an input the
    test computes its expectation from."""
    _, ns, _ = learner
    out = torch.zeros(3)
    ns["triple_into"](out, torch.ones(3))
    assert torch.equal(out, torch.zeros(3)), "an undeclared buffer was written back"
    with bridged.outputs(out):
        ns["triple_into"](out[:2], torch.ones(2))
    assert out.tolist() == [3.0, 3.0, 0.0], "a declared output (as a view) was not written back"
    x, y = torch.ones(3), torch.full((3,), 2.0)
    with bridged.outputs(out):
        got = ns["zero_x"](x, y)
    assert torch.equal(x, torch.ones(3)) and torch.equal(got, y), \
        "an input the call zeroed in place was written back: only declared outputs are"


def raised(call, error: type = Exception) -> str:
    """The message of the `error` that call() raises; "" when it raises none."""
    try:
        call()
    except error as e:
        return str(e)
    return ""


def test_an_input_changed_in_place_fails_the_unchanged_rule_apart_and_beside(learner):
    _, ns, _ = learner
    rule = "axpy leaves x and y as they were"
    x, y = torch.ones(3), torch.full((3,), 2.0)

    def check(f):
        with bridged.unchanged(rule, x=x, y=y):
            f(x, y)

    assert raised(lambda: check(ns["zero_x"]), AssertionError) == \
        f"{rule}: x was changed in place", "apart: an input changed in place passed `unchanged`"
    assert raised(lambda: check(ns["scale"])) == "", "a call that changes nothing failed it"
    bridge, bridged.BRIDGE = bridged.BRIDGE, None       # beside: the learner's code is here
    try:
        def zero_x(x, y):
            x.zero_()
            return y

        assert raised(lambda: check(zero_x), AssertionError) == \
            f"{rule}: x was changed in place", "beside: an input changed in place passed it"
    finally:
        bridged.BRIDGE = bridge


def test_a_tensor_subclass_result_is_refused_and_a_proxy_claims_no_c_class(learner):
    """A proxy that says it is a tensor (or a generator, a storage) would have torch's C++
    read its memory as one: a tensor subclass is refused, and a proxy's class is never one
    whose instances hold C data (a plain Remote then: torch raises TypeError)."""
    _, ns, _ = learner
    assert "Sub, a subclass of torch.Tensor: give a plain" in raised(ns["sub_result"],
                                                                     wire.InvalidReply), \
        "a tensor-subclass result was not refused"
    g = ns["generator"]()
    assert type(g) is Remote and not isinstance(g, torch.Generator), \
        "a proxy claimed torch.Generator: torch's C++ would read its memory as one"
    with pytest.raises(TypeError):
        torch.rand(2, generator=g)
    for hierarchy in ("torch.Tensor torch._C.TensorBase builtins.object",
                      "torch.storage.UntypedStorage torch._C.StorageBase builtins.object",
                      "numpy.ndarray builtins.object"):
        claimed = Remote(None, wire.Handle(1, hierarchy, False)).__class__
        assert claimed is object, f"a proxy for a {hierarchy.split()[0]} claims {claimed}"
    assert Remote(None, wire.Handle(1, "collections.OrderedDict builtins.dict builtins.object",
                                    False)).__class__ is dict


def test_a_kernels_writes_come_back_whole_storage_and_shared_objects_change(learner):
    _, ns, _ = learner
    buffer = torch.zeros(6)
    with bridged.outputs(buffer):
        ns["fill_kernel"][(1,)](buffer[1:5], 4, BLOCK=8)     # no version bump; writes past it
    assert buffer.tolist() == [0, 1, 2, 3, 4, 5]
    d = bridged.share({})
    ns["fill_dict"](d)
    assert d["n"] == 3
    m = bridged.share(torch.nn.Linear(2, 2))
    assert isinstance(m, torch.nn.Linear) and m.eval() is m


def test_a_parameters_grad_travels_and_comes_back_changed(learner):
    _, ns, _ = learner
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.tensor([-5.0, 0.5, 5.0])
    ns["clip_"]([p], 1.0)                           # not declared: not written back
    assert p.grad.tolist() == [-5.0, 0.5, 5.0], "an undeclared tensor's .grad was written back"
    with bridged.outputs(p):
        ns["clip_"]([p], 1.0)                       # in place
        assert p.grad.tolist() == [-1.0, 0.5, 1.0]
        ns["scale_grads"]([p])                      # replaced
    assert p.grad.tolist() == [-2.0, 1.0, 2.0]
    layer = ns["Lin"](torch.nn.Linear(4, 2))
    assert bridged.is_instance(layer, ns["Lin"]) and not bridged.is_instance(layer,
                                                                             ns["MatMul"])


def test_many_requests_then_a_cell_of_the_learners(learner):
    """Requests are answered by one serving loop in the learner's kernel; once paused, the
    kernel runs the learner's next cell at once (the grader's client is not stalled)."""
    bridge, ns, kernel = learner
    for _ in range(1200):
        ns["scale"](1.0)
    assert bridge.requests >= 1200 and bridge.loop is not None
    bridge.pause()
    reply = kernel.run("x = 1", timeout=30)
    assert reply.ok, reply.error
    assert ns["scale"](1.0) == 3.0          # the next request starts the loop again


def test_the_learners_own_input_gets_end_of_file(learner):
    bridge, _, kernel = learner
    bridge.pause()
    assert kernel.run("def asks():\n    return input('name? ')", timeout=30).ok
    bridge.bind(ns := {}, ["asks"])
    with pytest.raises(LearnerError, match="EOFError"):
        ns["asks"]()


def test_forbid_a_course_object_in_both_kernels(learner):
    import minimoe

    _, ns, _ = learner
    with forbid([minimoe.route], ns, why="route is off"), pytest.raises(AssertionError,
                                                                       match="route is off"):
        ns["calls_route"](torch.randn(4, 3), 2)


def test_errors_arrive_as_builtin_bases_or_learner_error(learner, capsys):
    _, ns, _ = learner
    with pytest.raises(ValueError, match="r must be positive"):
        ns["Lin"](torch.nn.Linear(2, 2), r=0)
    with pytest.raises(KeyError):
        ns["shout"]()
    assert "printed by the learner" in capsys.readouterr().out
    with pytest.raises(LearnerError, match="Custom: mine"):
        ns["custom"]()
    assert "StopIteration" in raised(lambda: list(map(ns["stop"], [1, 2])), LearnerError), \
        "a learner's StopIteration ended the test's own loop: it must arrive as LearnerError"


def test_the_learners_patches_and_objects_cannot_pass_a_check(learner):
    _, ns, _ = learner
    got = ns["always_equal"]()
    assert type(got) is Remote and got != [1] and not torch.allclose(torch.zeros(1),
                                                                     torch.ones(1))
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.zeros(1), torch.ones(1))


def test_hidden_mode_drops_the_learners_printing(learner, capsys):
    bridge, ns, _ = learner
    bridge.hidden = True
    try:
        with pytest.raises(KeyError):
            ns["shout"]()
    finally:
        bridge.hidden = False
    assert "printed by the learner" not in capsys.readouterr().out


def test_forbid_files_and_in_process_checks_reach_the_learners_kernel(learner, tmp_path):
    _, ns, _ = learner
    with forbid([(torch, "sum")], ns, why="no sum"), pytest.raises(AssertionError,
                                                                    match="no sum"):
        ns["calls_sum"](torch.ones(2))
    assert ns["calls_sum"](torch.ones(2)) == 2
    folder = bridged.learner_dir()
    ns["save_to"](folder)
    before = set(Path(tempfile.gettempdir()).glob("lab-fetched-*"))
    fetched = bridged.fetch_dir(folder)
    assert (fetched / "a.txt").read_text() == "hi"
    assert fetched.parent == bridged.BRIDGE.workspace \
        and set(Path(tempfile.gettempdir()).glob("lab-fetched-*")) == before, \
        "fetch_dir's folder must be made in the trusted kernel's workspace, not in /tmp"
    (tmp_path / "b.txt").write_text("yo")
    assert ns["read_from"](bridged.send_dir(tmp_path)) == "yo"

    def probe(n):
        return [type(scale).__name__, n]  # noqa: F821  (a learner global, there)

    assert bridged.in_learner(probe, 3) == ["function", 3]


def test_a_tampered_server_gives_an_error_never_a_value(learner):
    bridge, ns, kernel = learner
    bridge.pause()
    assert kernel.run("import course.grader.learner_side as _s\n_real = _s.answer\n"
                      "_s.answer = lambda payload: None", timeout=30).ok
    try:
        with pytest.raises(LearnerKernelLost, match="no answer"):
            ns["scale"](torch.ones(1))
        assert bridge.loop is None          # the loop died of it; the next starts afresh
        assert kernel.run("_s.answer = lambda payload: '{\"v\": {\"X\": 1}, \"st\": \"\"}'",
                          timeout=30).ok
        with pytest.raises(wire.InvalidReply):
            ns["scale"](torch.ones(1))
    finally:
        bridge.pause()
        assert kernel.run("_s.answer = _real", timeout=30).ok
