"""TRL's GRPOConfig as a fastrl LossConfig (`loss_config_from_trl`), importable without TRL.

Which TRL loss type is which SPEC policy and aggregation, how TRL's clip / delta / KL / vLLM
importance-sampling options map, and the options SPEC cannot express (a ValueError naming the
TRL option). `fastrl.integrations.trl` re-exports it beside the drop-in GRPOTrainer.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Mapping
from typing import Any

from ..config import LossConfig, LossConfigError

# TRL loss_type -> (policy, agg)
_LOSS_TYPES = {
    "grpo": ("ppo", "seq-mean-token-mean"),
    "bnpo": ("ppo", "token-mean"),
    "dr_grpo": ("ppo", "seq-mean-token-sum-norm"),
    "dapo": ("ppo", "token-mean"),
    "luspo": ("ppo", "seq-mean-token-sum"),
    "cispo": ("cispo", "token-mean"),
    "sapo": ("sapo", "seq-mean-token-mean"),
}
# loss types whose loss TRL divides by the gradient-accumulation steps (the others are already
# normalised by the accumulation window's token count)
_PER_STEP_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "sapo", "luspo")
_VLLM_IS_MODES = {
    "token_truncate": ("token", "truncate"),
    "token_mask": ("token", "mask"),
    "sequence_truncate": ("sequence", "truncate"),
    "sequence_mask": ("sequence", "mask"),
}


# The GRPOConfig options read here, with TRL 1.16's defaults: what an object without the
# attribute, or a mapping without the key, means (tests check them against trl.GRPOConfig)
_TRL_DEFAULTS = {
    "loss_type": "dapo",
    "off_policy_mask_threshold": None,
    "top_entropy_quantile": 1.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "importance_sampling_level": "token",
    "beta": 0.0,
    "use_bias_correction_kl": True,
    "temperature": 1.0,
    "delta": None,
    "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05,
    "entropy_coef": 0.0,
    "use_adaptive_entropy": False,
    "max_completion_length": 512,
    "use_vllm": False,
    "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask",
    "vllm_importance_sampling_clip_max": 3.0,
    "vllm_importance_sampling_clip_min": None,
}


# LossConfig field -> the TRL option it is read from (for errors)
_TRL_OPTIONS = {
    "clip_low": "epsilon",
    "clip_high": "epsilon_high (epsilon when None)",
    "clip_delta": "delta",
    "kl_coef": "beta",
    "temperature": "temperature",
    "entropy_coef": "entropy_coef",
    "sapo_tau_pos": "sapo_temperature_pos",
    "sapo_tau_neg": "sapo_temperature_neg",
    "rollout_is_cap": "vllm_importance_sampling_clip_max",
    "rollout_is_floor": "vllm_importance_sampling_clip_min",
}


def _unsupported(option: str, value: Any, why: str) -> ValueError:
    return ValueError(f"TRL option {option}={value!r} has no fastrl equivalent: {why}")


def _option_reader(args: Any):
    """get(name) over `args`: a GRPOConfig-like object's attributes or a mapping's keys (e.g.
    `GRPOConfig.to_dict()`), TRL's default (`_TRL_DEFAULTS`) where one is absent; with TRL
    installed, a key that is no GRPOConfig field is refused (a misspelt option would silently
    read as its default). ValueError for anything else (None, a number, a string)."""
    if isinstance(args, Mapping):
        try:
            import trl

            known = {f.name for f in dataclasses.fields(trl.GRPOConfig)}
        except ImportError:  # (no TRL: the keys cannot be checked)
            known = None
        unknown = sorted(k for k in args if known is not None and k not in known)
        if unknown:
            raise ValueError(
                f"args: {unknown} are not trl.GRPOConfig fields (a misspelt option would be "
                "read as its default)"
            )
        return lambda name: args.get(name, _TRL_DEFAULTS[name])
    if args is None or isinstance(args, (str, bytes, numbers.Number)):
        raise ValueError(
            f"args must be a trl.GRPOConfig (or an object or mapping with its fields), got "
            f"{type(args).__name__} {args!r}"
        )
    return lambda name: getattr(args, name, _TRL_DEFAULTS[name])


def config_from_options(
    values: dict[str, Any], overrides: dict[str, Any], options: Mapping[str, str], source: str
) -> LossConfig:
    """LossConfig().replace(**values) for a trainer's config read into LossConfig field
    `values` (the caller's `overrides` among them): an invalid value is reported as the `source`
    option it came from (`options`: LossConfig field -> that trainer's option; TRL's here,
    verl's in fastrl.integrations.verl), unless the caller's override set that field (then
    LossConfigError, under fastrl's name)."""
    try:
        return LossConfig().replace(**values)
    except LossConfigError as e:
        option = options.get(e.field)
        if option is None or e.field in overrides:
            raise
        raise ValueError(
            f"{source} option {option} gives LossConfig.{e.field}={e.value!r}, which is "
            f"invalid: expected {e.expected}"
        ) from e


def loss_config_from_trl(args: Any, **overrides: Any) -> LossConfig:
    """LossConfig equal to TRL's GRPO loss for `args` (a trl.GRPOConfig, any object with its
    fields, or a mapping of them, e.g. its `to_dict()`); `overrides` are LossConfig fields
    applied last. Passing `entropy_coef` as an override means the caller handles TRL's entropy
    bonus (then TRL's own is not checked)."""
    get = _option_reader(args)
    loss_type = get("loss_type")
    if loss_type not in _LOSS_TYPES:
        raise _unsupported("loss_type", loss_type, f"supported: {sorted(_LOSS_TYPES)}")
    if get("off_policy_mask_threshold") is not None:
        raise _unsupported(
            "off_policy_mask_threshold",
            get("off_policy_mask_threshold"),
            "SPEC has no off-policy sequence mask (DeepSeek-V3.2's KL-thresholded drop)",
        )
    quantile = get("top_entropy_quantile")
    if quantile is not None and quantile < 1.0:  # 0.0 too: TRL then keeps the top token only
        raise _unsupported(
            "top_entropy_quantile",
            get("top_entropy_quantile"),
            "SPEC has no entropy-quantile token mask (it needs a global quantile)",
        )
    policy, agg = _LOSS_TYPES[loss_type]
    eps_low = get("epsilon")
    eps_high = get("epsilon_high") if get("epsilon_high") is not None else eps_low
    level = get("importance_sampling_level")
    beta = float(get("beta") or 0.0)
    bias_correction = bool(get("use_bias_correction_kl")) and beta > 0
    fields: dict[str, Any] = dict(
        policy=policy,
        agg=agg,
        ratio_level=level,
        kl_coef=beta,
        kl_estimator="k3",
        kl_bias_correction=bias_correction,
        # TRL multiplies the KL by `coef_1`, the ratio of importance_sampling_level
        kl_bias_ratio=level,
        temperature=float(get("temperature")),
        # TRL applies `delta` (two-sided clipping) to the PPO-style losses only; cispo / sapo
        # ignore it there, so they do here
        clip_delta=get("delta") if policy == "ppo" else None,
        sapo_tau_pos=float(get("sapo_temperature_pos")),
        sapo_tau_neg=float(get("sapo_temperature_neg")),
    )
    if "entropy_coef" not in overrides:
        entropy_coef = float(get("entropy_coef") or 0.0)
        if get("use_adaptive_entropy"):
            raise _unsupported(
                "use_adaptive_entropy",
                True,
                "the coefficient changes during training; use fastrl.integrations.trl."
                "GRPOTrainer, which applies TRL's adaptive bonus",
            )
        if entropy_coef != 0 and loss_type != "bnpo":
            raise _unsupported(
                "entropy_coef",
                entropy_coef,
                f"TRL subtracts entropy_coef times the local token-mean entropy, while "
                f"loss_type={loss_type!r} normalises the policy term with agg={agg!r}; they "
                f"agree for loss_type='bnpo' only (fastrl.integrations.trl.GRPOTrainer adds "
                f"TRL's bonus itself)",
            )
        fields["entropy_coef"] = entropy_coef
    if loss_type == "cispo":  # TRL caps the ratio at epsilon_high itself: clip(r, 0, eps_high)
        if eps_high < 1:
            raise _unsupported(
                "epsilon_high", eps_high, "CISPO caps the ratio at epsilon_high, which must be >= 1"
            )
        fields.update(clip_low=1.0, clip_high=eps_high - 1.0)
    else:
        fields.update(clip_low=eps_low, clip_high=eps_high)
    delta = fields["clip_delta"]
    if delta is not None and not (isinstance(delta, (int, float)) and delta > 1 + eps_high):
        raise ValueError(
            f"TRL option delta={delta!r} must be > 1 + epsilon_high = {1 + eps_high} (the "
            "two-sided bound caps the ratio above the clip range), or None"
        )
    if loss_type == "dr_grpo":
        max_len = get("max_completion_length")
        if not isinstance(max_len, numbers.Integral) or isinstance(max_len, bool) or max_len < 1:
            raise ValueError(
                f"TRL option max_completion_length={max_len!r}: loss_type='dr_grpo' divides "
                "every sequence's token sum by it, so it must be an int >= 1"
            )
        fields["max_len"] = int(max_len)
    if get("use_vllm") and get("vllm_importance_sampling_correction"):
        mode = get("vllm_importance_sampling_mode")
        if mode not in _VLLM_IS_MODES:
            raise _unsupported("vllm_importance_sampling_mode", mode, f"{sorted(_VLLM_IS_MODES)}")
        cap = get("vllm_importance_sampling_clip_max")
        if cap is None:
            raise _unsupported(
                "vllm_importance_sampling_clip_max", None, "SPEC 3 needs an upper bound"
            )
        floor = get("vllm_importance_sampling_clip_min")
        level_is, mode_is = _VLLM_IS_MODES[mode]
        fields.update(
            rollout_is=level_is,
            rollout_is_mode=mode_is,
            rollout_is_cap=float(cap),
            rollout_is_floor=None if floor is None else float(floor),
        )
    fields.update(overrides)  # (an invalid value named as the TRL option it came from)
    return config_from_options(fields, overrides, _TRL_OPTIONS, "TRL")
