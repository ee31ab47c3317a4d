"""minituner: the training loop (now) and LoRA / QLoRA fine-tuning (Labs 04–06, BLUEPRINT.md)."""

from .data import SequenceData
from .train import TrainConfig, TrainResult, train

__all__ = ["SequenceData", "TrainConfig", "TrainResult", "train"]
