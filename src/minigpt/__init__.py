"""minigpt: the tiny GPT (dense or MoE) every lab trains, its tokenizer and synthetic tasks."""

from . import tasks
from .checkpoint import base_dir, base_path, load_base, load_checkpoint, save_checkpoint
from .generate import answers, evaluate, greedy_generate
from .model import Block, CausalSelfAttention, MiniGPT, MiniGPTConfig, SwiGLU
from .tokenizer import CharTokenizer

# What each lab rebuilds from this package, by a public name -> where it lives (a dotted path,
# private helpers and kernels included). While a lab's test runs a learner's code, the harness
# switches these off (course.notebook.harness.reference): the lab names the public key only,
# so moving code here changes this table, never a lab. Resolved when a test asks (a kernel
# module loads then, in a lab that has triton); tests/course/test_reference.py resolves all.
REFERENCE = {
    "05-lora-finetune": {
        "evaluate": "minigpt.generate.evaluate",
        "answers": "minigpt.generate.answers",
        "greedy_generate": "minigpt.generate.greedy_generate",
    },
}

__all__ = ["REFERENCE", "Block", "CausalSelfAttention", "CharTokenizer", "MiniGPT", "MiniGPTConfig",
           "SwiGLU", "answers", "base_dir", "base_path", "evaluate", "greedy_generate", "load_base",
           "load_checkpoint", "save_checkpoint", "tasks"]
