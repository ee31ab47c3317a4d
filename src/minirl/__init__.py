"""minirl: reinforcement fine-tuning pieces for MiniGPT (dense or MoE, LoRA or QLoRA).

GRPO's online loop is built from: `sample_groups` (G completions per prompt), `score` with a
`Reward` (`exact_match`, `partial_credit`, or a learner's own), `group_advantages`,
`token_logprobs` / `reference_logprobs` (with `adapters_off` for a LoRA policy's frozen
base) and `grpo_loss`. Offline, reward-weighted SFT reads a rewarded JSONL file
(`read_rewarded_jsonl`), weights it per prompt group (`group_weights`) into a minituner
`SequenceData`, and `mix_replay` / `add_replay` keep the pretraining tasks in the data.
See BLUEPRINT.md.

The Triton log-softmax functions (`selective_log_softmax_triton`, `entropy_from_logits_triton`,
`logprobs_and_entropy_triton`, `LogSoftmaxStats`) load on first access (module
`__getattr__`), as miniquant's do, and their kernels (`logprob_kernels`, which imports triton)
at the first launch or the first access of `minirl.logprob_kernels`;
`token_logprobs(..., backend="triton")` loads them too. `import minirl` needs no triton (Linux
only) and sets no environment variable; without triton a launch raises
`TritonUnavailableError`.
"""

from miniquant.triton_env import lazy_names

from .advantages import group_advantages, variance_fraction
from .grpo import grpo_loss
from .logprobs import (
    IMPLEMENTATIONS,
    NonFiniteLogitsError,
    adapters_off,
    entropy_from_logits,
    reference_logprobs,
    selective_log_softmax,
    token_logprobs,
)
from .loop import GRPOConfig, GRPOResult, grpo_train
from .replay import add_replay, mix_replay, replay_count, replay_examples
from .rewards import Reward, exact_match, partial_credit, score
from .sampling import Samples, pass_at_k, sample_groups
from .weighting import (
    RewardedRecords,
    group_weights,
    read_rewarded_jsonl,
    rewarded_sequence_data,
    sft_pairs,
)

# Loaded on first access, so that importing the package does not build the kernels.
# (and the kernel module itself, as `minirl.logprob_kernels.…`).
_TRITON_NAMES = {name: "logprob_triton" for name in
                 ("LogSoftmaxStats", "entropy_from_logits_triton",
                  "logprobs_and_entropy_triton", "selective_log_softmax_triton")}
__getattr__ = lazy_names(__name__, {**_TRITON_NAMES, "logprob_kernels": "logprob_kernels"})


# Lab -> {public name: dotted path} of what the lab rebuilds (docs/ARCHITECTURE.md, Lab sources).
REFERENCE = {
    "12-grpo": {
        "group_advantages": "minirl.advantages.group_advantages",
        "partial_credit": "minirl.rewards.partial_credit",
        "grpo_loss": "minirl.grpo.grpo_loss",
        "grpo_aggregate": "minirl.grpo._aggregate",
        "selective_log_softmax": "minirl.logprobs.selective_log_softmax",
        "token_logprobs": "minirl.logprobs.token_logprobs",
        "reference_logprobs": "minirl.logprobs.reference_logprobs",
        "entropy_from_logits": "minirl.logprobs.entropy_from_logits",
        "selective_log_softmax_torch": "minirl.logprobs._selective_log_softmax_torch",
        "SelectiveLogSoftmax": "minirl.logprobs._SelectiveLogSoftmax",
        "selective_log_softmax_by_triton": "minirl.logprobs._selective_log_softmax_triton",
        "LogSoftmaxStats": "minirl.logprob_triton.LogSoftmaxStats",
        "selective_log_softmax_triton": "minirl.logprob_triton.selective_log_softmax_triton",
        "logprobs_and_entropy_triton": "minirl.logprob_triton.logprobs_and_entropy_triton",
        "logsoftmax_stats_forward": "minirl.logprob_kernels.logsoftmax_stats_forward",
        "logsoftmax_stats_backward": "minirl.logprob_kernels.logsoftmax_stats_backward",
        "logsoftmax_stats_fwd_kernel": "minirl.logprob_kernels._logsoftmax_stats_fwd_kernel",
        "logsoftmax_stats_bwd_kernel": "minirl.logprob_kernels._logsoftmax_stats_bwd_kernel",
    },
}

__all__ = ["REFERENCE", "GRPOConfig", "GRPOResult", "IMPLEMENTATIONS", "NonFiniteLogitsError",
           "Reward", "RewardedRecords", "Samples", "adapters_off", "add_replay",
           "entropy_from_logits", "exact_match", "group_advantages", "group_weights", "grpo_loss",
           "grpo_train", "mix_replay", "partial_credit", "pass_at_k", "read_rewarded_jsonl",
           "reference_logprobs", "replay_count", "replay_examples", "rewarded_sequence_data",
           "sample_groups", "score", "selective_log_softmax", "sft_pairs", "token_logprobs",
           "variance_fraction"]
__all__ += sorted(_TRITON_NAMES)
