"""minituner: the training loop, LoRA layers and PEFT-format adapters (Labs 04–06).

See BLUEPRINT.md. QLoRA composition (qlora.py) comes with the rest of the minituner issue.
"""

from .activations import saved_activation_bytes
from .adapters import AdapterLoadReport, load_adapter, save_adapter, trainable_summary, wrap_lora
from .data import SequenceData, reward_weights
from .lora import LoRALinear, lora_linear
from .train import TrainConfig, TrainResult, mean_loss, train

__all__ = ["AdapterLoadReport", "LoRALinear", "SequenceData", "TrainConfig", "TrainResult",
           "load_adapter", "lora_linear", "mean_loss", "reward_weights", "save_adapter",
           "saved_activation_bytes", "train", "trainable_summary", "wrap_lora"]
