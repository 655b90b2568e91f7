"""fastrl: fused Triton kernels for the RL losses of LLM post-training.

    import fastrl
    out = fastrl.policy_loss(logits, tokens, advantages, old_logp, ref_logp, mask,
                             config=fastrl.LossConfig.grpo())
    out.loss.backward()

See docs/SPEC.md for the math and README.md for the layout.
"""

from .advantages import (
    dynamic_sampling_filter,
    group_advantages,
    overlong_penalty,
    whiten,
)
from .config import LossConfig
from .gae import gae
from .losses import (
    PolicyLossOutput,
    fused_linear_policy_loss,
    linear_logprobs,
    logprobs,
    policy_loss,
    policy_loss_from_logprobs,
    value_loss,
)
from .sampling import sample

__version__ = "0.1.0"

__all__ = [
    "LossConfig",
    "PolicyLossOutput",
    "dynamic_sampling_filter",
    "fused_linear_policy_loss",
    "gae",
    "group_advantages",
    "linear_logprobs",
    "logprobs",
    "overlong_penalty",
    "policy_loss",
    "policy_loss_from_logprobs",
    "sample",
    "value_loss",
    "whiten",
]
