"""labkit: run an experiment into a self-sealed manifest, reproduce it, seed, hash, measure.

The experiments' package (`python -m labkit run|reproduce|fingerprint|report|readme`): it needs
only the runtime dependencies and imports none of the model packages, so experiments can
import it freely. The nbgrader course is the package `course`, Lab 13's compiler probe
`gpucompile` (docs/ARCHITECTURE.md, Layers).
"""

from . import measure
from .experiment import ReproduceReport, RunContext, reproduce, run_experiment
from .hashing import sha256_file, sha256_json, sha256_state_dict
from .manifest import ManifestError, read_manifest, write_manifest
from .seed import seed_everything

__all__ = ["ManifestError", "ReproduceReport", "RunContext", "measure", "read_manifest",
           "reproduce", "run_experiment", "seed_everything", "sha256_file", "sha256_json",
           "sha256_state_dict", "write_manifest"]
