"""verl adapter: the `LossConfig` of a verl actor config (`actor_rollout_ref.actor`).

    from fastrl.integrations.verl import loss_config_from_verl
    cfg = loss_config_from_verl(config.actor_rollout_ref.actor)   # a DictConfig or a dict
    out = fastrl.policy_loss(response_logits, responses, advantages, old_log_prob,
                             ref_log_prob, response_mask, config=cfg)

SPEC.md follows verl's names and clamps (loss_agg_mode, the dual clip `clip_ratio_c`, the +-20
ratio clamp, low_var_kl), so this mostly renames:

    clip_ratio / clip_ratio_low / clip_ratio_high -> clip_low / clip_high
    clip_ratio_c                                   -> clip_dual (policy_loss.loss_mode vanilla)
    loss_agg_mode                                  -> agg (loss_scale_factor -> max_len)
    use_kl_loss, kl_loss_coef, kl_loss_type        -> kl_coef, kl_estimator
    entropy_coeff                                  -> entropy_coef
    policy_loss.loss_mode vanilla / gspo / gpg     -> ppo / ppo + sequence ratios / reinforce

verl's kl_loss_type names differ from SPEC's: verl's "k3" is the clamped low_var_kl (SPEC's
`low_var_kl`), "kl" is k1 and "mse" is k2. What SPEC cannot express raises a ValueError naming
the option: the clip-cov / kl-cov loss modes, the "full" KL and the straight-through "+" KL
variants. verl's GSPO clamps the sequence log-ratio at +10 rather than +-20, which only matters
where the ratio is above e^10.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..config import LossConfig

_KL_TYPES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2"}
_KL_TYPES.update({"low_var_kl": "low_var_kl", "k3": "low_var_kl"})
_LOSS_MODES = {"vanilla": "ppo", "gspo": "ppo", "gpg": "reinforce"}


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def loss_config_from_verl(actor: Any, **overrides: Any) -> LossConfig:
    """LossConfig equal to verl's actor loss for `actor` (a mapping / DictConfig / dataclass
    with verl's actor fields); `overrides` are applied last (e.g. `temperature`, `num_tokens`)."""
    clip = _get(actor, "clip_ratio", 0.2)
    loss_mode = _get(_get(actor, "policy_loss", {}), "loss_mode", "vanilla")
    if loss_mode not in _LOSS_MODES:
        raise ValueError(
            f"verl policy_loss.loss_mode={loss_mode!r} has no fastrl equivalent; supported: "
            f"{sorted(_LOSS_MODES)}"
        )
    fields: dict[str, Any] = dict(
        policy=_LOSS_MODES[loss_mode],
        ratio_level="sequence" if loss_mode == "gspo" else "token",
        clip_low=float(_get(actor, "clip_ratio_low", clip)),
        clip_high=float(_get(actor, "clip_ratio_high", clip)),
        clip_dual=float(_get(actor, "clip_ratio_c", 3.0)) if loss_mode == "vanilla" else None,
        agg=_get(actor, "loss_agg_mode", "token-mean"),
        entropy_coef=float(_get(actor, "entropy_coeff", 0.0)),
    )
    scale = _get(actor, "loss_scale_factor")
    if scale is not None:
        fields["max_len"] = int(scale)
    if _get(actor, "use_kl_loss", False):
        kl_type = _get(actor, "kl_loss_type", "low_var_kl")
        if kl_type not in _KL_TYPES:
            raise ValueError(
                f"verl kl_loss_type={kl_type!r} has no fastrl equivalent; supported: "
                f"{sorted(_KL_TYPES)}"
            )
        fields.update(kl_coef=float(_get(actor, "kl_loss_coef", 0.001)),
                      kl_estimator=_KL_TYPES[kl_type])  # fmt: skip
    fields.update(overrides)
    return LossConfig().replace(**fields)


__all__ = ["loss_config_from_verl"]
