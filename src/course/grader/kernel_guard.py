"""The grader's agent inside a student's kernel: a fingerprint of the machinery that runs cells.

This file is not imported by the grader. Its source is sent to each fresh kernel, before any
student code runs, and `install(secret, name)` puts one object in `builtins` under a random
`name`. The grader then asks it, before every test cell, for a fingerprint of everything a
submission could bend to pass tests it did not pass: input and AST transformers, IPython
event hooks, trace/profile functions, builtins, the IPython and ipykernel methods that run a
cell, the exception hooks, and audit hooks added later. The grader compares each
fingerprint with the first one (taken before the student's first cell) outside the kernel.

Every test cell ends with a call `name.proof(label)`; it publishes an HMAC of the label
under the per-run secret, so a test cell whose body was skipped or rewritten cannot report
that it ran. Every answer carries an HMAC, so it cannot be replayed from an earlier run.
Only the standard library and IPython are used: this runs in the student's environment.
"""

import builtins
import hashlib
import hmac
import json
import sys
import threading

# IPython/ipykernel machinery whose identity must not change while a notebook runs.
WATCHED = {
    "IPython.core.interactiveshell.InteractiveShell": (
        "run_cell", "run_cell_async", "run_ast_nodes", "run_code", "transform_cell",
        "transform_ast", "should_run_async", "user_expressions", "showtraceback"),
    "IPython.core.compilerop.CachingCompiler": ("__call__", "ast_parse", "cache"),
    "ipykernel.ipkernel.IPythonKernel": ("do_execute", "run_cell"),
    "ipykernel.kernelbase.Kernel": ("execute_request", "dispatch_shell", "send_response"),
    "jupyter_client.session.Session": ("send", "sign", "serialize"),
}
# Event callbacks that IPython, ipykernel and matplotlib's inline backend register honestly.
TRUSTED_MODULES = ("IPython.", "ipykernel.", "matplotlib_inline.", "matplotlib.")


def _resolve(dotted):
    module, _, attr = dotted.rpartition(".")
    return getattr(sys.modules[module], attr) if module in sys.modules else None


def _ident(obj):
    """A stable identity of a callable: the object and, for a function, its code object."""
    func = getattr(obj, "__func__", obj)
    return f"{id(func)}:{id(getattr(func, '__code__', None))}"


def _describe(callback):
    func = getattr(callback, "__func__", callback)
    return f"{getattr(func, '__module__', '?')}.{getattr(func, '__qualname__', repr(func))}"


class Guard:
    """What `install` leaves in builtins; the grader calls `fingerprint` and `proof`."""

    def __init__(self, secret, shell):
        self._secret = secret.encode()
        self._shell = shell
        self._hooks_added = []
        sys.addaudithook(self._audit)

    def _audit(self, event, args):
        if event == "sys.addaudithook":
            self._hooks_added.append(event)

    def _mac(self, text):
        return hmac.new(self._secret, text.encode(), hashlib.sha256).hexdigest()

    def _state(self):
        shell = self._shell
        kernel = getattr(shell, "kernel", None)
        state = {
            "sys.gettrace": repr(sys.gettrace()), "sys.getprofile": repr(sys.getprofile()),
            "threading.gettrace": repr(threading.gettrace()),
            "threading.getprofile": repr(threading.getprofile()),
            "sys.excepthook": _ident(sys.excepthook),
            "sys.flags.optimize": sys.flags.optimize,
            "audit hooks added": len(self._hooks_added),
            "input_transformers_cleanup": [_ident(f) for f in shell.input_transformers_cleanup],
            "input_transformers_post": [_ident(f) for f in shell.input_transformers_post],
            "ast_transformers": [_ident(f) for f in shell.ast_transformers],
            "shell.compile": _ident(type(shell.compile)),
        }
        for event, callbacks in shell.events.callbacks.items():
            state[f"events.{event}"] = sorted(
                _describe(cb) for cb in callbacks if not _describe(cb).startswith(TRUSTED_MODULES))
        for name, value in vars(builtins).items():
            state[f"builtins.{name}"] = _ident(value)
        for dotted, methods in WATCHED.items():
            cls = _resolve(dotted)
            for method in methods:
                state[f"{dotted}.{method}"] = _ident(getattr(cls, method, None))
        for label, obj in (("shell", shell), ("kernel", kernel)):
            overrides = {m for ms in WATCHED.values() for m in ms} & set(vars(obj) if obj else ())
            state[f"{label} instance overrides"] = sorted(overrides)
        return state

    def fingerprint(self, label):
        """JSON of {"state": ..., "mac": HMAC(label + state)}, for the grader to compare."""
        state = json.dumps(self._state(), sort_keys=True)
        return json.dumps({"state": json.loads(state), "mac": self._mac(label + state)})

    def proof(self, label):
        """Publish HMAC(label): the last line of every test cell, reached only if it passed."""
        from IPython.display import publish_display_data
        publish_display_data({"application/x-labkit-proof": self._mac(label)})


def install(secret, name):
    """Put a Guard in builtins under `name` (random per run); the grader's first request."""
    from IPython import get_ipython
    setattr(builtins, name, Guard(secret, get_ipython()))
