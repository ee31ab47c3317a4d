"""A cgroup per submission (course.grader.cgroup), on fake cgroup trees (v2, and v1 as on a
hybrid machine): which version is found, what is written where, the command that enters the
group, the line saying which limits hold, and the reason given where there are none. Where
this machine lets the grader make groups, a real one stops a memory hog and a fork bomb."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from course.grader import cgroup
from course.grader.sandbox import Limits


@pytest.fixture
def fake(tmp_path, monkeypatch):
    mount = tmp_path / "cgroup"
    own = mount / "grader.scope"
    own.mkdir(parents=True)
    for folder in (mount, own):
        (folder / "cgroup.controllers").write_text("cpu memory pids io\n")
        (folder / "cgroup.subtree_control").write_text("")
    monkeypatch.setattr(cgroup, "MOUNT", mount)
    monkeypatch.setattr(cgroup, "_own", lambda: own)
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):     # a real cgroupfs fills each new group's files
        real_mkdir(self, *args, **kwargs)
        if self.is_relative_to(mount):
            (self / "cgroup.controllers").write_text("cpu memory pids\n")
            (self / "cgroup.subtree_control").write_text("")
            (self / "cgroup.procs").write_text("")

    monkeypatch.setattr(Path, "mkdir", mkdir)
    return own


def test_a_group_holds_the_limits_and_the_command_enters_it(fake):
    group = cgroup.Cgroup("sub-1", memory_bytes=3 << 30, tasks=512)
    assert group.path == fake / "course-grade" / "sub-1"
    assert (group.path / "memory.max").read_text() == str(3 << 30)
    assert (group.path / "memory.swap.max").read_text() == "0"
    assert (group.path / "pids.max").read_text() == "512"
    assert (fake / "course-grade" / "cgroup.subtree_control").read_text() == \
        "+memory +pids +cpu"
    argv = group.wrap(["bwrap", "--x"])
    assert argv[:2] == ["sh", "-c"] and str(group.path / "cgroup.procs") in argv[2]
    assert argv[-2:] == ["bwrap", "--x"]
    group.remove()                      # our fake group keeps its files: never raises


def test_without_cgroups_the_reason_is_given(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroup, "MOUNT", tmp_path)
    assert cgroup.version() == ""
    assert cgroup.why_not() == (f"no cgroups at {tmp_path} (neither v2 nor the v1 memory and "
                                "pids hierarchies)")
    line = cgroup.summary(Limits(), cgroup.why_not(), processes=False)
    assert line.startswith("resource limits: per process (prlimit): 16 GiB of address space")
    assert "none per submission: no cgroups at" in line, "the one line says which limits hold"


@pytest.fixture
def fake_v1(tmp_path, monkeypatch):
    """A hybrid machine: v1 memory, pids and cpu hierarchies, an empty v2 at unified/; this
    process in /grader of the memory hierarchy and at the root of the pids one."""
    mount = tmp_path / "cgroup"
    for name in ("memory/grader", "pids", "cpu", "unified"):
        (mount / name).mkdir(parents=True)
    (mount / "unified" / "cgroup.controllers").write_text("")
    own = tmp_path / "self-cgroup"
    own.write_text("9:name=systemd:/\n8:pids:/\n4:memory:/grader\n1:cpu,cpuacct:/\n0::/\n")
    monkeypatch.setattr(cgroup, "MOUNT", mount)
    monkeypatch.setattr(cgroup, "SELF", own)
    real_mkdir = Path.mkdir

    def mkdir(self, *args, **kwargs):     # a real v1 memory group has its swap limit file
        real_mkdir(self, *args, **kwargs)
        if self.is_relative_to(mount / "memory") and self.parent.name == "course-grade":
            (self / "memory.memsw.limit_in_bytes").write_text("max")

    monkeypatch.setattr(Path, "mkdir", mkdir)
    return mount


def test_cgroups_v1_give_a_submission_memory_and_tasks(fake_v1):
    assert cgroup.version() == "v1", "the v1 memory and pids hierarchies make a v1 machine"
    group = cgroup.Cgroup("sub-1", memory_bytes=3 << 30, tasks=512)
    memory = fake_v1 / "memory" / "grader" / "course-grade" / "sub-1"
    pids = fake_v1 / "pids" / "course-grade" / "sub-1"
    assert group.paths == [memory, pids]
    assert (memory / "memory.limit_in_bytes").read_text() == str(3 << 30)
    assert (memory / "memory.memsw.limit_in_bytes").read_text() == str(3 << 30), "no swap"
    assert (pids / "pids.max").read_text() == "512"
    argv = group.wrap(["bwrap", "--x"])
    assert all(str(p / "cgroup.procs") in argv[2] for p in (memory, pids)), \
        "the command enters the group of each hierarchy"
    line = cgroup.summary(Limits(), "", processes=True)
    assert line.startswith("resource limits: per submission (a cgroup v1 each): 16 GiB of "
                           "memory, tmpfs pages included, 1024 tasks; per process (prlimit)")
    assert "CPU weight" not in line, "v1 groups set no CPU weight: the line must not claim one"


def test_cgroups_v2_are_found_first(fake):
    assert cgroup.version() == "v2"
    assert "an equal CPU weight" in cgroup.summary(Limits(), "", processes=True)


@pytest.mark.skipif(cgroup.why_not() != "", reason=f"no cgroup per submission here: "
                    f"{cgroup.why_not()}")
def test_here_a_group_stops_a_memory_hog_and_a_fork_bomb():
    group = cgroup.Cgroup(f"test-{os.getpid()}", memory_bytes=200 << 20, tasks=8)
    try:
        hog = subprocess.run(group.wrap([sys.executable, "-c", "b = bytearray(600 << 20)"]),
                             capture_output=True)
        assert hog.returncode != 0, "a submission's memory limit stops a 600 MiB allocation"
        bomb = subprocess.run(group.wrap([sys.executable, "-c", FORKS]), capture_output=True,
                              text=True)
        assert "refused at" in bomb.stdout, "a submission's task limit stops a fork bomb"
    finally:
        group.remove()


FORKS = """
import subprocess
started = []
try:
    for _ in range(20):
        started.append(subprocess.Popen(["sleep", "5"]))
except OSError:
    print("refused at", len(started))
"""
