"""How a dead kernel is described to a learner (Kernel.cause_of_death), from its exit status
as Python gives it (a negative signal number) and as bubblewrap does (128 + the signal)."""

from __future__ import annotations

import signal
from types import SimpleNamespace

import pytest

from course.grader.jupyter_kernel import Kernel


@pytest.mark.parametrize("code, words", [
    (-signal.SIGSEGV, "segfault is usually an out-of-range load or store in a Triton kernel"),
    (128 + signal.SIGSEGV, "segfault is usually an out-of-range load or store"),
    (-signal.SIGKILL, "killed (out of memory"),
    (128 + signal.SIGKILL, "killed (out of memory"),
    (-signal.SIGABRT, "aborted"),
    (-signal.SIGTERM, "ended on signal SIGTERM"),
    (3, "exited with status 3 (os._exit"),
    (200, "exited with status 200"),
    (None, "stopped answering"),
])
def test_cause_of_death(code, words):
    kernel = Kernel.__new__(Kernel)
    kernel.proc = SimpleNamespace(poll=lambda: code)
    kernel.relay = None           # no relay: the kernel's own process decides
    assert words in kernel.cause_of_death()
