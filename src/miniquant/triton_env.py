"""Where the course's kernels get triton: imported at the first kernel, never at package import.

triton has wheels for Linux only, so every package here imports without it (`import
miniquant`, `minimoe`, ... load no kernel module) and changes no environment variable. The
kernel modules (miniquant.dequant_kernel, minimoe.kernels, minirl.logprob_kernels) load at
the first launch, and each takes `triton` and `tl` from here (`from miniquant.triton_env
import tl, triton`, resolved by the module `__getattr__` below): that import is the moment
the Triton mode is chosen. Without a CUDA device, Triton kernels only run through its
interpreter, which must be chosen before `triton` is imported (`TRITON_INTERPRET=1`; see
miniquant/triton_dequant.py for what that decision can and cannot affect), so `import_triton`
sets it then, when CUDA is absent and the variable unset. An explicit `TRITON_INTERPRET` is
always respected.

Without triton, the first kernel raises `TritonUnavailableError`, the one error for it
(also raised by the kernel labs' setup cells, through `course.notebook.harness.require_triton`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os

import torch

TRITON_MISSING = ("the Triton kernels need triton, which has wheels for Linux only; on macOS "
                  "or Windows open the lab in Colab, a GitHub Codespace, or WSL2 (see the "
                  "README's \"Where it runs\")")


class TritonUnavailableError(ImportError):
    """triton is not installed: raised by the first kernel launch (or a kernel lab's setup),
    one line saying where the kernels run. `where` (a lab, a function) prefixes it."""

    def __init__(self, where: str | None = None):
        super().__init__(f"{where}: {TRITON_MISSING}" if where else TRITON_MISSING,
                         name="triton")


def triton_installed() -> bool:
    """Whether `import triton` can work, found without importing it (so without choosing the
    Triton mode)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):      # a module left half-imported, or blocked
        return False


def import_triton():
    """(triton, triton.language), importing triton on the first call: TRITON_INTERPRET=1 first
    when there is no CUDA device and the variable is unset. TritonUnavailableError without
    triton (then nothing is set)."""
    if not triton_installed():
        raise TritonUnavailableError()
    if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    import triton
    import triton.language as tl

    if os.environ.get("TRITON_INTERPRET") == "1" and _release(triton.__version__) < (3, 7):
        _squeeze_interpreter_index()
    return triton, tl


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as "3.6.0" or "3.7.1+git1234"."""
    major, minor = (version.split("+")[0].split(".") + ["0"])[:2]
    return int(major), int("".join(c for c in minor if c.isdigit()) or 0)


def _squeeze_interpreter_index() -> None:
    """Let triton 3.6's interpreter take a scalar as a loop bound under NumPy 2.4 and later.

    The interpreter holds a kernel's scalar argument as a one-element array and gives
    `tl.tensor.__index__` as `int(array)`, which NumPy 2.4 refuses for an array of shape [1]
    ("only 0-dimensional arrays can be converted to Python scalars"): every `range(0, K,
    BLOCK_K)` of the kernels here. Triton 3.7 squeezes the array first; import_triton calls this
    on older releases only, and it wraps the interpreter's per-launch patch of tl.tensor to do
    the same (its scope restores both after the launch). A release without that function is
    left as it is.
    """
    import triton.runtime.interpreter as interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "squeezes_index", False):
        return

    def patch_and_squeeze(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_and_squeeze.squeezes_index = True
    interpreter._patch_lang_tensor = patch_and_squeeze


def __getattr__(name: str):
    # `triton` and `tl` are imported on first access (a kernel module's import line).
    if name in ("triton", "tl"):
        triton, tl = import_triton()
        globals().update(triton=triton, tl=tl)
        return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lazy_names(package: str, where: dict[str, str]):
    """A package's module `__getattr__` that imports `package.<where[name]>` at the first
    access of `name` and returns that module's `name` (the module itself where the name is the
    module's), so that importing the package builds no kernel and imports no triton."""
    def __getattr__(name: str):
        if name not in where:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(f".{where[name]}", package)
        return module if where[name] == name else getattr(module, name)
    return __getattr__


def interpreted(kernel) -> bool:
    """Whether a @triton.jit kernel was built for the interpreter (decided at decoration;
    triton is imported already, since the kernel was built with it)."""
    from triton.runtime import JITFunction

    return not isinstance(kernel, JITFunction)


def not_on_cuda(name: str, device: torch.device) -> ValueError:
    """The error for a tensor a compiled (CUDA) kernel cannot read."""
    return ValueError(f"{name} is on {device}, but Triton compiles for CUDA here: move it to a "
                      "GPU, or run on CPU with TRITON_INTERPRET=1 set before triton is imported")


# Not `triton` and `tl`: a star import must not import triton.
__all__ = ["TRITON_MISSING", "TritonUnavailableError", "import_triton", "interpreted",
           "not_on_cuda", "triton_installed"]
