"""fastrl in other trainers (import them by name; nothing here imports the trainer libraries
until it is used):

- `fastrl.integrations.trl`: `GRPOTrainer`, a drop-in `trl.GRPOTrainer` on fastrl's log-probs
  and loss, and `loss_config_from_trl` (the LossConfig of a GRPOConfig).
- `fastrl.integrations.verl`: `install()` (fastrl's policy loss as verl loss modes, verl's
  log-prob / entropy computations on fastrl's ops) and `loss_config_from_verl`.
"""

from __future__ import annotations
