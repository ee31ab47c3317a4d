"""labkit: seeding, manifests, reproduce, memory, and the course/grading pipeline.

Depends on none of the course packages, so experiments and notebooks can import it freely.
"""

from . import memory
from .experiment import ReproduceReport, RunContext, reproduce, run_experiment
from .hashing import sha256_file, sha256_json, sha256_state_dict
from .manifest import ManifestError, read_manifest, write_manifest
from .seed import seed_everything

__all__ = ["ManifestError", "ReproduceReport", "RunContext", "memory", "read_manifest",
           "reproduce", "run_experiment", "seed_everything", "sha256_file", "sha256_json",
           "sha256_state_dict", "write_manifest"]
