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
from .losses import mean_loss, sequence_loss
from .trainer import TrainConfig, TrainResult, train

# Lab -> {public name: dotted path} of what the lab rebuilds (docs/ARCHITECTURE.md, Lab sources).
REFERENCE = {
    "04-lora": {
        "LoRALinear": "minituner.lora.LoRALinear",
        "lora_linear": "minituner.lora.lora_linear",
        "lora_function": "minituner.lora._LoRALinearFunction",
        "wrap_lora": "minituner.wrap.wrap_lora",
        "wrap_modules": "minituner.wrap.wrap_modules",
        "save_adapter": "minituner.adapters.save_adapter",
        "adapter_config": "minituner.adapters._config",
        "adapter_module_entries": "minituner.adapters._module_entries",
        "load_adapter": "minituner.adapters.load_adapter",
        "adapter_expected": "minituner.adapters._expected",
        "trainable_summary": "minituner.wrap.trainable_summary",
        "select_modules": "minituner.wrap.select_modules",
        "matches": "minituner.peft_format.matches",
    },
    "05-lora-finetune": {
        "reward_weights": "minituner.data.reward_weights",
        "SequenceData.with_rewards": "minituner.data.SequenceData.with_rewards",
        "sequence_loss": "minituner.losses.sequence_loss",
        "token_ce": "minituner.losses._token_ce",
        "mean_loss": "minituner.losses.mean_loss",
        "lr_at": "minituner.optim.lr_at",
        "clip_gradients": "minituner.optim.clip_gradients",
        "make_optimizer": "minituner.optim.make_optimizer",
        "training_run": "minituner.trainer._Run",
        "train": "minituner.trainer.train",
    },
    "06-qlora-preview": {
        "wrap_minigpt_qlora": "minituner.qlora.wrap_minigpt_qlora",
        "held_bytes": "minituner.memory.held_bytes",
        "predict": "minituner.memory.predict",
        "predict_training": "minituner.memory.predict_training",
        "regime_specs": "minituner.memory.regime_specs",
        "param_specs": "minituner.memory.param_specs",
    },
    "11-capstone-qlora-moe": {
        "wrap_minigpt_qlora": "minituner.qlora.wrap_minigpt_qlora",
        "update_norms": "minituner.lora_norms.update_norms",
    },
}

__all__ = ["REFERENCE", "AdapterLoadReport", "LoRALinear", "SequenceData", "TrainConfig",
           "TrainResult", "load_adapter", "lora_linear", "mean_loss", "memory", "peak_step_bytes",
           "qlora", "reward_weights", "save_adapter", "saved_activation_bytes", "sequence_loss",
           "train", "trainable_summary", "wrap_lora"]
