"""labkit.threads: torch's OpenMP workers wait passively in every process the course starts."""

from __future__ import annotations

import os
import subprocess
import sys

from labkit.threads import PASSIVE, VARIABLE

# Prints the policy at the moment `import torch` starts: the OpenMP runtime reads it then.
SPY = """
import os, sys
class Spy:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("at torch's import:", os.environ.get("OMP_WAIT_POLICY"))
            sys.meta_path.remove(self)
sys.meta_path.insert(0, Spy())
"""


def _child(code: str, **env: str) -> str:
    base = {k: v for k, v in os.environ.items() if k != VARIABLE}
    out = subprocess.run([sys.executable, "-c", SPY + code], env={**base, **env}, check=True,
                         capture_output=True, text=True, timeout=120)
    return out.stdout.strip()


def test_importing_labkit_sets_passive_waiting_before_torch_loads():
    assert _child("import labkit") == f"at torch's import: {PASSIVE}"


def test_the_command_lines_set_it_before_torch_loads():
    for package in ("labkit", "course"):
        code = f"import {package}.__main__"
        assert _child(code).splitlines()[0] == f"at torch's import: {PASSIVE}", package


def test_a_policy_the_user_chose_is_kept():
    assert _child("import labkit", OMP_WAIT_POLICY="ACTIVE") == "at torch's import: ACTIVE"


def test_wait_passively_says_when_it_is_too_late():
    code = "import torch\nfrom labkit.threads import wait_passively\nprint(wait_passively())"
    assert _child(code).splitlines() == ["at torch's import: None", "False"]


def test_the_tests_and_their_children_wait_passively():
    # conftest.py imports labkit before torch; notebook kernels and experiment runs the tests
    # start inherit the variable.
    assert os.environ.get(VARIABLE) is not None
