"""labkit: run an experiment into a self-sealed manifest, reproduce it, seed, hash, measure.

This top level is the experiment half and needs only the runtime dependencies; the nbgrader
course (build, check, grade, the lab test harness) is the subpackage `labkit.course`, which
needs the development dependencies and is never imported from here. Imports none of the model
packages (miniquant, minimoe, minigpt, minituner), so experiments can import it freely.
"""

from . import measure
from .experiment import ReproduceReport, RunContext, reproduce, run_experiment
from .hashing import sha256_file, sha256_json, sha256_state_dict
from .manifest import ManifestError, read_manifest, write_manifest
from .seed import seed_everything

__all__ = ["ManifestError", "ReproduceReport", "RunContext", "measure", "read_manifest",
           "reproduce", "run_experiment", "seed_everything", "sha256_file", "sha256_json",
           "sha256_state_dict", "write_manifest"]
