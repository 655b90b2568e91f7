"""TRL adapter: the `LossConfig` whose numbers equal TRL GRPOTrainer's loss for a `GRPOConfig`.

    from fastrl.integrations.trl import loss_config_from_trl
    cfg = loss_config_from_trl(grpo_args)  # a trl.GRPOConfig (or any object with its fields)
    out = fastrl.policy_loss(completion_logits, completion_ids, inputs["advantages"],
                             inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps"),
                             inputs["completion_mask"], config=cfg,
                             num_tokens=normalizer)   # loss_type dapo / cispo: TRL's normalizer

TRL (>= 0.2x, the GRPOTrainer of `trl.trainer.grpo_trainer`) and SPEC.md agree on the clipped
surrogate, k3, delta, CISPO, SAPO and the four normalisations; this maps the names. What SPEC
does not express raises a ValueError naming the option rather than giving other numbers:
loss types luspo / vespo, `off_policy_mask_threshold`, `top_entropy_quantile < 1`, a lower
vLLM importance-sampling bound (`vllm_importance_sampling_clip_min`), and KL bias correction
with sequence-level ratios (TRL multiplies by the sequence ratio, SPEC 4 by the token ratio).

Two normalisers are the caller's: for `dapo` / `cispo` TRL divides by `num_items_in_batch`
rescaled to one accumulation window (pass it as `num_tokens`), and TRL divides the `grpo`,
`bnpo`, `dr_grpo` losses by the gradient-accumulation steps afterwards (do the same). TRL's
importance ratios have no clamp at exp(+-20); SPEC's only differ where exp would overflow.
"""

from __future__ import annotations

from typing import Any

from ..config import LossConfig

# TRL loss_type -> (policy, agg)
_LOSS_TYPES = {
    "grpo": ("ppo", "seq-mean-token-mean"),
    "bnpo": ("ppo", "token-mean"),
    "dr_grpo": ("ppo", "seq-mean-token-sum-norm"),
    "dapo": ("ppo", "token-mean"),
    "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
}
_VLLM_IS_MODES = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
}


def _unsupported(option: str, value: Any, why: str) -> ValueError:
    return ValueError(f"TRL option {option}={value!r} has no fastrl equivalent: {why}")


def loss_config_from_trl(args: Any, **overrides: Any) -> LossConfig:
    """LossConfig equal to TRL's GRPO loss for `args` (a trl.GRPOConfig); `overrides` last."""
    get = lambda name, default=None: getattr(args, name, default)  # noqa: E731
    loss_type = get("loss_type", "dapo")
    if loss_type not in _LOSS_TYPES:
        raise _unsupported("loss_type", loss_type, f"supported: {sorted(_LOSS_TYPES)}")
    if get("off_policy_mask_threshold") is not None:
        raise _unsupported("off_policy_mask_threshold", get("off_policy_mask_threshold"), "")
    if (get("top_entropy_quantile", 1.0) or 1.0) < 1.0:
        raise _unsupported("top_entropy_quantile", get("top_entropy_quantile"), "")
    policy, agg = _LOSS_TYPES[loss_type]
    eps_low = get("epsilon", 0.2)
    eps_high = get("epsilon_high") if get("epsilon_high") is not None else eps_low
    level = get("importance_sampling_level", "token")
    beta = float(get("beta", 0.0) or 0.0)
    bias_correction = bool(get("use_bias_correction_kl", False)) and beta > 0
    if bias_correction and level == "sequence":
        raise _unsupported(
            "use_bias_correction_kl",
            True,
            "with importance_sampling_level='sequence' TRL weights the KL by the sequence ratio, "
            "SPEC 4 by the token ratio",
        )
    fields: dict[str, Any] = dict(
        policy=policy,
        agg=agg,
        ratio_level=level,
        kl_coef=beta,
        kl_estimator="k3",
        kl_bias_correction=bias_correction,
        temperature=float(get("temperature", 1.0)),
        clip_delta=get("delta"),
        sapo_tau_pos=float(get("sapo_temperature_pos", 1.0)),
        sapo_tau_neg=float(get("sapo_temperature_neg", 1.05)),
    )
    if loss_type == "cispo":  # TRL caps the ratio at epsilon_high itself: clip(r, 0, eps_high)
        if eps_high < 1:
            raise _unsupported(
                "epsilon_high", eps_high, "CISPO caps the ratio at epsilon_high, which must be >= 1"
            )
        fields.update(clip_low=1.0, clip_high=eps_high - 1.0)
    else:
        fields.update(clip_low=eps_low, clip_high=eps_high)
    if loss_type == "dr_grpo":
        fields["max_len"] = int(get("max_completion_length"))
    if get("use_vllm", False) and get("vllm_importance_sampling_correction", False):
        mode = get("vllm_importance_sampling_mode")
        if mode not in _VLLM_IS_MODES:
            raise _unsupported("vllm_importance_sampling_mode", mode, f"{sorted(_VLLM_IS_MODES)}")
        if get("vllm_importance_sampling_clip_min") is not None:
            raise _unsupported(
                "vllm_importance_sampling_clip_min",
                get("vllm_importance_sampling_clip_min"),
                "SPEC 3 bounds the weight from above only",
            )
        cap = get("vllm_importance_sampling_clip_max")
        if cap is None:
            raise _unsupported("vllm_importance_sampling_clip_max", None, "SPEC 3 needs a cap")
        level_is, mode_is = _VLLM_IS_MODES[mode]
        fields.update(rollout_is=level_is, rollout_is_mode=mode_is, rollout_is_cap=float(cap))
    fields.update(overrides)
    return LossConfig().replace(**fields)


__all__ = ["loss_config_from_trl"]
