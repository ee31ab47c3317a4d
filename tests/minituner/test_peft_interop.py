"""Adapters cross to PEFT and back on tiny HF and MiniGPT models (peft_roundtrip.CASES):
attention LoRA, QLoRA, and expert LoRA in PEFT's target_parameters form, both directions."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("transformers")

from peft_roundtrip import CASES  # noqa: E402


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("model, kind, direction, fn", CASES,
                         ids=[f"{m}-{k}-{d}" for m, k, d, _ in CASES])
def test_round_trip_same_logits(model, kind, direction, fn):
    diff, effect = fn()
    assert effect > 1e-2, "the adapter did not change the logits: the test would prove nothing"
    assert diff < 1e-5, f"{model}, {kind}, {direction}: logits differ by {diff:.2e}"
