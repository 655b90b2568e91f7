"""fastrl in other trainers (import them by name; nothing here imports the trainer libraries
until it is used):

- `fastrl.integrations.trl`: `GRPOTrainer`, a drop-in `trl.GRPOTrainer` on fastrl's log-probs
  and loss, and `loss_config_from_trl` (the LossConfig of a GRPOConfig).
- `fastrl.integrations.verl`: `install()` (fastrl's policy loss as verl loss modes, verl's
  log-prob / entropy computations on fastrl's ops) and `loss_config_from_verl`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def logp_policy_inputs(logp: Tensor, advantages: Tensor, old, ref, mask, rollout, config, counts):
    """`fastrl._inputs.prepare_policy_inputs` for per-token log-probs logp (B, T) instead of
    logits, for trainers that have computed them already: SPEC 1-5 (`terms.token_terms` /
    `aggregate`) only read logp and H, so the logits slot holds a (B, T, 1) zero view that takes
    no memory and is never read. `counts`: {"num_tokens": ..., "num_seqs": ...} overrides."""
    from .._inputs import prepare_policy_inputs

    B, T = logp.shape
    no_logits = logp.new_zeros(()).expand(B, T, 1)
    no_tokens = torch.zeros((), dtype=torch.long, device=logp.device).expand(B, T)
    return prepare_policy_inputs(
        no_logits, no_tokens, advantages, old, ref, mask, rollout, config, counts, False
    )
