"""minigpt: the tiny GPT (dense or MoE) every lab trains, its tokenizer and synthetic tasks."""

from . import tasks
from .checkpoint import base_dir, base_path, load_base, load_checkpoint, save_checkpoint
from .generate import answers, evaluate, greedy_generate
from .model import Block, CausalSelfAttention, MiniGPT, MiniGPTConfig, SwiGLU
from .tokenizer import CharTokenizer

# Lab -> {public name: dotted path} of what the lab rebuilds (docs/ARCHITECTURE.md, Lab sources).
REFERENCE = {
    "00-setup-minigpt": {
        "CharTokenizer.encode": "minigpt.tokenizer.CharTokenizer.encode",
        "CharTokenizer.decode": "minigpt.tokenizer.CharTokenizer.decode",
    },
    "05-lora-finetune": {
        "evaluate": "minigpt.generate.evaluate",
        "answers": "minigpt.generate.answers",
        "greedy_generate": "minigpt.generate.greedy_generate",
    },
}

__all__ = ["REFERENCE", "Block", "CausalSelfAttention", "CharTokenizer", "MiniGPT", "MiniGPTConfig",
           "SwiGLU", "answers", "base_dir", "base_path", "evaluate", "greedy_generate", "load_base",
           "load_checkpoint", "save_checkpoint", "tasks"]
