"""minituner: the training loop, LoRA layers and PEFT-format adapters (Labs 04–06).

See BLUEPRINT.md. QLoRA composition (qlora.py) and the loop's fine-tuning features come
with the rest of the minituner issue.
"""

from .adapters import AdapterLoadReport, load_adapter, save_adapter, trainable_summary, wrap_lora
from .data import SequenceData
from .lora import LoRALinear, lora_linear
from .train import TrainConfig, TrainResult, train

__all__ = ["AdapterLoadReport", "LoRALinear", "SequenceData", "TrainConfig", "TrainResult",
           "load_adapter", "lora_linear", "save_adapter", "train", "trainable_summary",
           "wrap_lora"]
