"""Importing a package (and every module under it) sets no environment variable and imports no
triton: the Triton mode (compiled or TRITON_INTERPRET=1) is chosen at the first kernel launch
(docs/ARCHITECTURE.md, Invariants). tests/test_without_triton.py holds the same without triton."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

PACKAGES = ["miniquant", "minimoe", "minigpt", "minituner", "minirl", "labkit", "gpucompile",
            "course"]
# The kernel modules import triton (and choose its mode) when they load, at the first launch.
KERNEL_MODULES = ("miniquant.dequant_kernel", "minimoe.kernels", "minirl.logprob_kernels")
CHILD = f'''
import importlib, json, os, pkgutil, sys
before = dict(os.environ)
package = importlib.import_module(sys.argv[1])
for m in pkgutil.walk_packages(package.__path__, sys.argv[1] + "."):
    if m.name not in {KERNEL_MODULES!r} and not m.name.endswith("__main__"):
        importlib.import_module(m.name)
changed = sorted(k for k in set(os.environ) | set(before) if os.environ.get(k) != before.get(k))
print(json.dumps({{"changed": changed, "triton": "triton" in sys.modules}}))
'''


@pytest.mark.parametrize("package", PACKAGES)
def test_importing_sets_nothing_and_loads_no_triton(package):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRITON")}
    out = subprocess.run([sys.executable, "-c", CHILD, package], capture_output=True, text=True,
                         env=env, timeout=300, check=True).stdout
    seen = json.loads(out.strip().splitlines()[-1])
    assert seen["changed"] == [], (
        f"importing {package} and its modules changed {seen['changed']}: an import sets "
        "nothing; the Triton mode is chosen at the first kernel launch")
    assert seen["triton"] is False, (
        f"importing {package} imported triton: kernel modules load at the first launch")
