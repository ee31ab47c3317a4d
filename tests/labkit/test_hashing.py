"""labkit.hashing (digests of state dicts, JSON and files) and labkit.seed."""

from __future__ import annotations

import hashlib
import json
import random

import numpy as np
import pytest
import torch

from labkit import seed_everything, sha256_file, sha256_json, sha256_state_dict

# ---------------------------------------------------------------------------------------------
# sha256_state_dict


def test_state_dict_hash_ignores_key_order():
    a, b = torch.arange(6.0), torch.ones(2, 3, dtype=torch.bfloat16)
    h = sha256_state_dict({"a": a, "b": b})
    assert h == sha256_state_dict({"b": b, "a": a})
    assert len(h) == 64 and int(h, 16) >= 0


def test_state_dict_hash_is_of_values_not_identity():
    a = torch.linspace(-1, 1, 7)
    assert sha256_state_dict({"w": a}) == sha256_state_dict({"w": a.clone()})
    # A non-contiguous view hashes as its contiguous copy (same logical tensor).
    m = torch.arange(12.0).reshape(3, 4)
    assert sha256_state_dict({"w": m.t()}) == sha256_state_dict({"w": m.t().contiguous()})
    # A parameter hashes like its data (requires_grad does not matter).
    p = torch.nn.Parameter(a.clone())
    assert sha256_state_dict({"w": p}) == sha256_state_dict({"w": a})


@pytest.mark.parametrize("index", [0, 3, 6])
def test_state_dict_hash_sees_one_ulp(index):
    a = torch.linspace(-1, 1, 7)
    b = a.clone()
    b[index] = torch.nextafter(a[index], torch.tensor(float("inf")))
    assert not torch.equal(a, b)
    assert sha256_state_dict({"w": a}) != sha256_state_dict({"w": b})


def test_state_dict_hash_sees_dtype_with_identical_bytes():
    f, i = torch.zeros(4, dtype=torch.float32), torch.zeros(4, dtype=torch.int32)
    assert f.view(torch.uint8).tolist() == i.view(torch.uint8).tolist()
    assert sha256_state_dict({"w": f}) != sha256_state_dict({"w": i})
    assert sha256_state_dict({"w": f}) != sha256_state_dict({"w": f.to(torch.bfloat16)})


def test_state_dict_hash_sees_shape_with_identical_bytes():
    flat = torch.arange(6.0)
    assert sha256_state_dict({"w": flat}) != sha256_state_dict({"w": flat.reshape(2, 3)})
    assert sha256_state_dict({"w": flat.reshape(2, 3)}) != \
        sha256_state_dict({"w": flat.reshape(3, 2)})


def test_state_dict_hash_sees_names_and_boundaries():
    t = torch.ones(3)
    assert sha256_state_dict({"a": t}) != sha256_state_dict({"b": t})
    # Moving bytes from one entry to the next must change the digest.
    x = torch.arange(4.0)
    assert sha256_state_dict({"a": x[:2], "b": x[2:]}) != \
        sha256_state_dict({"a": x[:1], "b": x[1:]})
    assert sha256_state_dict({}) != sha256_state_dict({"a": torch.zeros(0)})


def test_state_dict_hash_of_a_model():
    torch.manual_seed(0)
    m1 = torch.nn.Linear(3, 2)
    torch.manual_seed(0)
    m2 = torch.nn.Linear(3, 2)
    assert sha256_state_dict(m1.state_dict()) == sha256_state_dict(m2.state_dict())
    with torch.no_grad():
        m2.bias[1] += 1e-3
    assert sha256_state_dict(m1.state_dict()) != sha256_state_dict(m2.state_dict())


@pytest.mark.parametrize("bad", [[1.0, 2.0], np.zeros(3), 3.0, None])
def test_state_dict_hash_rejects_non_tensors(bad):
    with pytest.raises(ValueError, match="must be a tensor"):
        sha256_state_dict({"ok": torch.zeros(1), "bad": bad})


def test_state_dict_hash_scalar_tensors():
    assert sha256_state_dict({"s": torch.tensor(1.0)}) != \
        sha256_state_dict({"s": torch.tensor(2.0)})
    sha256_state_dict(torch.nn.BatchNorm1d(3).state_dict())


# ---------------------------------------------------------------------------------------------
# sha256_json


def test_json_hash_is_canonical():
    a = {"b": 1, "a": [1, 2, {"y": 0.5, "x": "é"}], "c": None}
    b = {"c": None, "a": [1, 2, {"x": "é", "y": 0.5}], "b": 1}
    assert sha256_json(a) == sha256_json(b)
    canonical = '{"a":[1,2,{"x":"é","y":0.5}],"b":1,"c":null}'
    assert sha256_json(a) == hashlib.sha256(canonical.encode()).hexdigest()
    # Same after a JSON round trip with other formatting.
    assert sha256_json(json.loads(json.dumps(a, indent=4))) == sha256_json(a)


@pytest.mark.parametrize("other", [
    {"a": 1, "b": 3},            # value
    {"a": 1, "B": 2},            # key
    {"a": 1, "b": 2, "c": 0},    # extra key
    {"a": 1, "b": 2.5},          # type
    {"a": 1, "b": "2"},          # type
])
def test_json_hash_sees_changes(other):
    assert sha256_json({"a": 1, "b": 2}) != sha256_json(other)


def test_json_hash_list_order_matters():
    assert sha256_json([1, 2]) != sha256_json([2, 1])


# ---------------------------------------------------------------------------------------------
# sha256_file


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (5 << 19) + 3])
def test_file_hash_matches_hashlib(tmp_path, size):
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    path.write_bytes(data)
    assert sha256_file(path) == hashlib.sha256(data).hexdigest()
    assert sha256_file(str(path)) == hashlib.sha256(data).hexdigest()


def test_file_hash_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        sha256_file(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# seed_everything


def _draws():
    return (torch.rand(5).tolist(), random.random(), np.random.rand(3).tolist(),
            torch.randint(0, 1000, (4,)).tolist())


@pytest.mark.usefixtures("restore_torch_determinism")
def test_seed_everything_repeats():
    seed_everything(123)
    first = _draws()
    seed_everything(123)
    assert _draws() == first
    seed_everything(124)
    assert _draws() != first


@pytest.mark.usefixtures("restore_torch_determinism")
def test_seed_everything_each_generator_is_seeded():
    seed_everything(5)
    t, r, n, _ = _draws()
    torch.manual_seed(5)
    random.seed(5)
    np.random.seed(5)
    assert (torch.rand(5).tolist(), random.random(), np.random.rand(3).tolist()) == (t, r, n)


@pytest.mark.usefixtures("restore_torch_determinism")
def test_seed_everything_threads_and_determinism():
    seed_everything(0, threads=1)
    assert torch.get_num_threads() == 1
    assert torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("bad", [1.0, "1", None, True, np.float64(3)])
def test_seed_everything_rejects_non_int(bad):
    with pytest.raises(ValueError, match="seed"):
        seed_everything(bad)
