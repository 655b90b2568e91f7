"""Public loss functions. (Placeholder: delegates to the reference until the fused path lands.)"""

from .reference import PolicyLossOutput, logprobs, policy_loss, value_loss

__all__ = ["PolicyLossOutput", "logprobs", "policy_loss", "value_loss"]
