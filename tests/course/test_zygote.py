"""Trusted kernels forked from the warm zygote (course.grader.zygote): each is a fresh kernel
of its own, with its own folder, environment and limits, and needs no import of torch."""

from __future__ import annotations

from pathlib import Path

import pytest

from course.grader import autograde
from course.grader.jupyter_kernel import Kernel
from course.grader.sandbox import Sandbox
from course.grader.zygote import Zygote

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def zygote():
    z = Zygote(Sandbox(ROOT, unsafe=True))
    yield z
    z.close()


def text(reply) -> str:
    assert reply.ok, reply.error
    return "".join(o.get("text", "") for o in reply.outputs)


def test_forked_kernels_are_fresh_and_apart(zygote):
    a = Kernel(Sandbox(ROOT, unsafe=True), zygote=zygote)
    b = Kernel(Sandbox(ROOT, unsafe=True), zygote=zygote)
    try:
        assert text(a.run("import sys, os\nprint('torch' in sys.modules, os.getcwd(), "
                          "os.environ['HOME'], os.environ['OMP_NUM_THREADS'])", 60)).split() \
            == ["True", str(a.private), str(a.private), "1"]
        assert text(a.run("secret = 42\nprint(secret)", 60)) == "42\n"
        assert "NameError" in b.run("print(secret)", 60).error       # nothing shared
        limit = Sandbox(ROOT).limits.memory_bytes
        assert text(b.run("import resource\nprint(resource.getrlimit(resource.RLIMIT_AS)[0])",
                          60)) == f"{limit}\n"
        assert a.proc.pid != b.proc.pid and a.alive() and b.alive()
    finally:
        a.close()
        b.close()
    assert not a.alive() and not b.alive() and not a.private.exists()


def test_a_kernel_that_exits_is_seen_dead_and_the_next_still_starts(zygote):
    k = Kernel(Sandbox(ROOT, unsafe=True), zygote=zygote)
    try:
        assert k.run("import os\nos._exit(3)", 30).status == "dead"
        assert not k.alive()
    finally:
        k.close()
    again = Kernel(Sandbox(ROOT, unsafe=True), zygote=zygote)
    try:
        assert text(again.run("print(1 + 1)", 60)) == "2\n"
    finally:
        again.close()



def test_no_zygote_for_make_check_or_off_linux(monkeypatch):
    """Grading forks its trusted kernels; a learner's `make check`, and anything on macOS or
    Windows, starts its trusted kernel as a process."""
    trusted = Sandbox(ROOT, unsafe=True)
    monkeypatch.setattr(autograde.sys, "platform", "darwin")
    assert autograde._zygote(trusted) is None
    monkeypatch.setattr(autograde.sys, "platform", "linux")
    assert isinstance(autograde._zygote(trusted), Zygote)
    assert autograde._zygote(Sandbox(ROOT, unsafe=True, own_env=True)) is None
