"""minituner: the training loop, LoRA layers, PEFT-format adapters and QLoRA (Labs 04–06).

See BLUEPRINT.md. `minituner.qlora.wrap_minigpt_qlora` quantizes a MiniGPT's block
projections to NF4 and then wraps them with LoRA; `minituner.memory` predicts the memory
bill of full, LoRA and QLoRA training from a model's shape.
"""

from . import memory, qlora
from .activations import peak_step_bytes, saved_activation_bytes
from .adapters import AdapterLoadReport, load_adapter, save_adapter, trainable_summary, wrap_lora
from .data import SequenceData, reward_weights
from .lora import LoRALinear, lora_linear
from .trainer import TrainConfig, TrainResult, mean_loss, sequence_loss, train

__all__ = ["AdapterLoadReport", "LoRALinear", "SequenceData", "TrainConfig", "TrainResult",
           "load_adapter", "lora_linear", "mean_loss", "memory", "peak_step_bytes", "qlora",
           "reward_weights", "save_adapter", "saved_activation_bytes", "sequence_loss", "train",
           "trainable_summary", "wrap_lora"]
