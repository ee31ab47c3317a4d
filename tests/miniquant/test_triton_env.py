"""miniquant.triton_env: triton 3.6's interpreter takes the kernels' scalar loop bounds too."""

from __future__ import annotations

import types

import numpy as np
import pytest

from miniquant import triton_env


@pytest.mark.parametrize("version, release", [
    ("3.6.0", (3, 6)), ("3.7.1+git1a2b", (3, 7)), ("4", (4, 0)), ("3.10.0rc1", (3, 10)),
])
def test_release_reads_major_and_minor(version, release):
    assert triton_env._release(version) == release


class Scope:
    """triton's _LangPatchScope: records each attribute it sets, restores them in reverse."""

    def __init__(self):
        self.changes = []

    def set_attr(self, obj, name, value):
        self.changes.append((obj, name, getattr(obj, name, None)))
        setattr(obj, name, value)


def test_the_wrapped_patch_makes_index_squeeze_a_one_element_array(monkeypatch):
    # triton 3.6's own patch: int() of the array, which NumPy >= 2.4 refuses for shape [1].
    def old_patch(tensor, scope):
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data))

    fake = types.SimpleNamespace(_patch_lang_tensor=old_patch)
    monkeypatch.setitem(__import__("sys").modules, "triton.runtime.interpreter", fake)
    monkeypatch.setattr(__import__("triton.runtime", fromlist=["x"]), "interpreter", fake,
                        raising=False)
    triton_env._squeeze_interpreter_index()
    triton_env._squeeze_interpreter_index()           # once only: the wrapper is not wrapped

    class Tensor:
        handle = types.SimpleNamespace(data=np.array([7]))

    scope = Scope()
    fake._patch_lang_tensor(Tensor, scope)
    assert range(0, Tensor(), 3) == range(0, 7, 3)
    assert [name for _, name, _ in scope.changes] == ["__index__", "__index__"]
    assert fake._patch_lang_tensor.squeezes_index
