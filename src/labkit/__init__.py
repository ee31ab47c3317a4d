"""labkit: run an experiment into a self-sealed manifest, reproduce it, seed, hash, measure.

The experiments' package (`python -m labkit run|reproduce|fingerprint|report|readme`): it needs
only the runtime dependencies and imports none of the model packages, so experiments can
import it freely. The nbgrader course is the package `course`, Lab 13's compiler probe
`gpucompile` (docs/ARCHITECTURE.md, Layers).
"""

from .threads import wait_passively

wait_passively()   # before anything below imports torch (labkit/threads.py says why)

from . import measure  # noqa: E402
from .experiment import ReproduceReport, RunContext, reproduce, run_experiment  # noqa: E402
from .hashing import sha256_file, sha256_json, sha256_state_dict  # noqa: E402
from .manifest import ManifestError, read_manifest, write_manifest  # noqa: E402
from .seed import seed_everything  # noqa: E402

# Lab -> {public name: dotted path} of what the lab rebuilds (docs/ARCHITECTURE.md, Lab sources).
REFERENCE = {"00-setup-minigpt": {"sha256_state_dict": "labkit.hashing.sha256_state_dict"}}

__all__ = ["REFERENCE", "ManifestError", "ReproduceReport", "RunContext", "measure",
           "read_manifest", "reproduce", "run_experiment", "seed_everything", "sha256_file",
           "sha256_json", "sha256_state_dict", "write_manifest"]
