"""How `make check` starts a notebook kernel without two known, harmless messages.

- ipykernel warns "Kernel is running over TCP without encryption" unless the kernel manager
  provisions CurveZMQ keys. `client_options()` asks jupyter_client to (`transport_encryption`
  "auto": used when the kernelspec declares curve support and pyzmq has it), so the kernel's
  sockets are encrypted and the warning has no cause.
- bitsandbytes logs "Failed to load CPU gemm_4bit_forward" when a notebook imports it on a
  CPU with AVX512-BF16. The kernel loads this module as an IPython extension, before any
  cell runs, and `load_ipython_extension` drops exactly that record at its logger
  (`miniquant.bnb.quiet_bitsandbytes`); every other warning still shows.
"""

from __future__ import annotations

import zmq
from traitlets.config import Config

EXTENSION = __name__


def client_options() -> dict:
    """Keyword arguments for nbclient's NotebookClient: the kernel manager's configuration
    and the kernel's command-line arguments (this module as an extension)."""
    encryption = "auto" if zmq.has("curve") else "disabled"
    return {"config": Config({"KernelManager": {"transport_encryption": encryption}}),
            "extra_arguments": [f"--IPKernelApp.extensions={EXTENSION}"]}


def load_ipython_extension(ipython) -> None:
    """Run by the kernel at start (IPython's extension hook); binds no name in the notebook."""
    from miniquant.bnb import quiet_bitsandbytes

    quiet_bitsandbytes()
