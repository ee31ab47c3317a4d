"""minirl: reinforcement fine-tuning pieces for MiniGPT (dense or MoE, LoRA or QLoRA).

GRPO's online loop is built from: `sample_groups` (G completions per prompt), `score` with a
`Reward` (`exact_match`, `partial_credit`, or a learner's own), `group_advantages`,
`token_logprobs` / `reference_logprobs` (with `adapters_off` for a LoRA policy's frozen
base) and `grpo_loss`. Offline, reward-weighted SFT reads a rewarded JSONL file
(`read_rewarded_jsonl`), weights it per prompt group (`group_weights`) into a minituner
`SequenceData`, and `mix_replay` / `add_replay` keep the pretraining tasks in the data.
See BLUEPRINT.md.
"""

from .advantages import group_advantages, variance_fraction
from .grpo import grpo_loss
from .logprobs import (
    IMPLEMENTATIONS,
    NonFiniteLogitsError,
    adapters_off,
    reference_logprobs,
    selective_log_softmax,
    token_logprobs,
)
from .replay import add_replay, mix_replay, replay_count, replay_examples
from .rewards import Reward, exact_match, partial_credit, score
from .sampling import Samples, sample_groups
from .weighting import (
    RewardedRecords,
    group_weights,
    read_rewarded_jsonl,
    rewarded_sequence_data,
    sft_pairs,
)

__all__ = ["IMPLEMENTATIONS", "NonFiniteLogitsError", "Reward", "RewardedRecords", "Samples",
           "adapters_off", "add_replay", "exact_match", "group_advantages", "group_weights",
           "grpo_loss", "mix_replay", "partial_credit", "read_rewarded_jsonl",
           "reference_logprobs", "replay_count", "replay_examples", "rewarded_sequence_data",
           "sample_groups", "score", "selective_log_softmax", "sft_pairs", "token_logprobs",
           "variance_fraction"]
