"""A cgroup v2 per submission (course.grader.cgroup), on a fake cgroup tree: what is written
where, the command that enters the group, and the reason given where there are none."""

from __future__ import annotations

from pathlib import Path

import pytest

from course.grader import cgroup


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


def test_without_cgroups_v2_the_reason_is_given(tmp_path, monkeypatch):
    monkeypatch.setattr(cgroup, "MOUNT", tmp_path)
    assert "v1 only" in cgroup.why_not()
