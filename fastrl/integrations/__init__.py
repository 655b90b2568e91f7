"""fastrl in other trainers (import them by name; nothing here imports the trainer libraries
until it is used):

- `fastrl.integrations.trl`: `GRPOTrainer`, a drop-in `trl.GRPOTrainer` on fastrl's log-probs
  and loss, and `loss_config_from_trl` (the LossConfig of a GRPOConfig).
- `fastrl.integrations.verl`: `install()` (fastrl's policy loss as verl loss modes, verl's
  log-prob / entropy computations on fastrl's ops) and `loss_config_from_verl`.
"""

from __future__ import annotations

from torch import Tensor


def logp_policy_inputs(logp: Tensor, advantages: Tensor, old, ref, mask, rollout, config, counts):
    """`fastrl._inputs.prepare_policy_inputs` for per-token log-probs logp (B, T) instead of
    logits, for trainers that have computed them already (SPEC 1-5 only read logp and H).
    `counts`: {"num_tokens": ..., "num_seqs": ...} overrides."""
    from .._inputs import prepare_policy_inputs

    return prepare_policy_inputs(
        None, None, advantages, old, ref, mask, rollout, config, counts, per_token=logp
    )
