"""torch's CPU threads sleep between parallel regions instead of spinning: set before torch loads.

torch runs its CPU operators on an OpenMP thread team (libgomp on Linux, libomp on macOS).
Left to its default, a worker that finishes its share of an operator keeps spinning on its
core for a while, waiting for the next one. On a machine whose cores are also busy with
something else (a laptop running a browser and a video call, a 2-core CI runner running two
processes), the spinning worker holds the core the other thread of the team is waiting for,
and a tiny model's step can take tens of times longer than on one thread.
`OMP_WAIT_POLICY=PASSIVE` makes the workers sleep instead.

The OpenMP runtime reads the variable once, when torch loads it, so it must be in the
environment before the process's first `import torch`. labkit's `__init__` calls
`wait_passively()` before it imports anything else; every command line of the course
(`python -m labkit`, `python -m course`) imports labkit before torch, and the processes they
start (notebook kernels, experiment runs) inherit the variable. A value the user set is kept.
"""

from __future__ import annotations

import os
import sys

VARIABLE = "OMP_WAIT_POLICY"
PASSIVE = "PASSIVE"


def wait_passively() -> bool:
    """Set OMP_WAIT_POLICY=PASSIVE unless the environment already names a policy. True when it
    still takes effect in this process (torch not imported yet), False when only the child
    processes started from here will wait passively."""
    os.environ.setdefault(VARIABLE, PASSIVE)
    return "torch" not in sys.modules
