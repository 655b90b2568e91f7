"""Loss configuration: one dataclass for every knob of SPEC.md sections 1-5, plus presets.

`LossConfig()` with no arguments is the `ppo` preset. Every preset takes keyword overrides:

    cfg = LossConfig.grpo(kl_coef=0.01)
    cfg = LossConfig.dapo(clip_high=0.3, entropy_coef=1e-3)

All values are checked in `__post_init__`; an impossible value raises a `LossConfigError` (a
`ValueError`) that names the field, the value and what was expected, and carries them as
`.field`, `.value` and `.expected`. `dataclasses.replace(cfg, field=value)` re-checks.
"""

from __future__ import annotations

import numbers
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

POLICIES = ("ppo", "cispo", "sapo", "reinforce")
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")
AGGS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_IS_MODES = ("truncate", "mask")
SEQ_RATIO_GRADS = ("mean", "token")
KL_BIAS_RATIOS = ("token", "sequence")


FP32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max
# The smallest temperature taken, everywhere (losses, log-probs, the sampler): the kernels and the
# torch path form z' = z * (1 / tau) in fp32, and the kernels scale by (1 / tau) * log2(e) for
# exp2, so that product must be finite there: 2 / FP32_MAX = 5.88e-39 (at 1 / FP32_MAX, the
# floor until 2026-11-27, it was inf and every row NaN).
TAU_MIN = 2.0 / FP32_MAX
# its text in error messages, formed once: an f-string with a format spec, formed on every call,
# is what torch.compile(fullgraph=True, dynamic=True) cannot trace ("BUILD_STRING type error")
TAU_MIN_TEXT = f"{TAU_MIN:.3g}"


class LossConfigError(ValueError):
    """An impossible LossConfig value: `field` (its name), `value` and `expected` (what it must
    be, in words), for callers that report it under their own names (the trainer's flags)."""

    def __init__(self, field: str, value: Any, expected: str) -> None:
        super().__init__(f"LossConfig.{field}={value!r} is invalid: expected {expected}")
        self.field, self.value, self.expected = field, value, expected


def _is_real(x: Any) -> bool:
    """An int or float, numpy's scalars included (numbers.Real); never a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    """An integer, numpy's integers included (numbers.Integral); never a bool."""
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _plain(x: Any) -> Any:
    """A real number as Python's own int / float (numpy's np.float64 is a float subclass whose
    repr, 'np.float64(0.2)', the custom ops' config key could not read back)."""
    if type(x) in (int, float) or not _is_real(x):
        return x
    return int(x) if isinstance(x, numbers.Integral) else float(x)


def _is_finite32(x: Any) -> bool:
    """A real number that stays finite in fp32, where the kernels and the loss use it (1e39 is
    a finite Python float but inf in fp32: a loss of inf, or a clamp that cannot convert it)."""
    return _is_real(x) and abs(x) <= FP32_MAX  # False for NaN and inf


@dataclass(frozen=True)
class LossConfig:
    """Every option of the fused policy loss (SPEC.md sections 1-5)."""

    policy: str = "ppo"
    """Per-token policy term (SPEC 2): `ppo` (clipped surrogate; GRPO, DAPO, Dr.GRPO and GSPO
    use it), `cispo` (clipped, stop-gradient IS weight times log-prob), `sapo` (soft sigmoid
    gate) or `reinforce` (-A * logp, no ratio)."""

    clip_low: float = 0.2
    """epsilon_low: the ratio is clipped from below at 1 - clip_low. In [0, 1]; 1 means no
    lower bound (CISPO)."""

    clip_high: float = 0.2
    """epsilon_high: the ratio is clipped from above at 1 + clip_high (DAPO's clip-higher uses
    0.28). Must be >= 0."""

    clip_dual: float | None = None
    """Dual-clip constant c (verl `clip_ratio_c`): for A < 0 the loss is capped at -A * c.
    None disables it; otherwise must be > 1."""

    clip_delta: float | None = None
    """Two-sided bound delta (INTELLECT-2; TRL `delta`): the unclipped ratio is replaced by
    min(r, delta). None disables it; otherwise must be > 1 + clip_high."""

    ratio_level: str = "token"
    """`token` (PPO/GRPO: one ratio per token) or `sequence` (GSPO: the ratio of the
    length-normalised sequence log-likelihoods, broadcast over the sequence's tokens)."""

    seq_ratio_grad: str = "mean"
    """Gradient of the sequence ratio (`ratio_level="sequence"` only; SPEC 1). `mean` (GSPO
    paper, TRL): log r_i = sum_t m_t (logp_t - old_t) / |y_i| and the gradient flows through
    the mean, d log r_i / d logp_t = m_t / |y_i|. `token` (GSPO-token, verl's `gspo` loss mode):
    log r_it = sg(log r_i) + logp_t - sg(logp_t), the same value with d log r_it / d logp_t = 1
    for its own token only. The two gradients agree when the advantage is constant over each
    sequence; they differ for per-token advantages."""

    kl_coef: float = 0.0
    """beta, the weight of the per-token KL to the reference policy. >= 0; when > 0 the caller
    must pass `ref_logp`."""

    kl_estimator: str = "k3"
    """KL estimator (SPEC 4): `k1`, `k2`, `k3` (TRL's, unclamped), `low_var_kl` (verl's
    clamped k3) or `abs`."""

    kl_bias_correction: bool = False
    """Multiply each token's KL by an importance ratio (differentiable), as in DeepSeek-V3.2 and
    TRL's `use_bias_correction_kl`; which ratio is `kl_bias_ratio`."""

    kl_bias_ratio: str = "token"
    """The ratio of `kl_bias_correction` (SPEC 4): `token` (r_t = exp(logp_t - old_t), the
    unbiased reverse-KL gradient) or `sequence` (the GSPO sequence ratio r_i of SPEC 1, with
    the gradient of `seq_ratio_grad`; what TRL multiplies by under
    `importance_sampling_level="sequence"`). `sequence` couples the tokens of a sequence."""

    entropy_coef: float = 0.0
    """c_H, the weight of the entropy bonus: the loss gets -c_H * H_t per token. >= 0."""

    temperature: float = 1.0
    """tau: logits are divided by it before the softmax. Must be finite and >= 5.88e-39
    (TAU_MIN: 1 / tau times log2 e finite in fp32); use the sampler's temperature so that
    training log-probs match the rollout's."""

    agg: str = "token-mean"
    """How per-token losses become one scalar (SPEC 5): `token-mean`, `seq-mean-token-mean`,
    `seq-mean-token-sum`, `seq-mean-token-sum-norm` or `token-sum` (verl: the plain masked sum,
    no normaliser)."""

    num_tokens: float | None = None
    """Global token count for `token-mean` (across data-parallel ranks and gradient
    accumulation steps; TRL `num_items_in_batch`). None = the local sum of the mask. May also be
    passed as a 0-dim tensor to `policy_loss` to avoid a host sync."""

    num_seqs: float | None = None
    """Global sequence count B for the `seq-mean-*` aggregations. None = the local batch size."""

    max_len: int | None = None
    """L_max for `seq-mean-token-sum-norm` (Dr.GRPO). None = the padded length T."""

    rollout_is: str | None = None
    """Rollout correction (SPEC 3): None (off), `token` or `sequence` truncated importance
    sampling between the trainer's pi_old and the sampler's own log-probs (`rollout_logp`)."""

    rollout_is_cap: float | None = 2.0
    """Cap C of the rollout IS weight. Must be > 0 when `rollout_is` is set."""

    rollout_is_mode: str = "truncate"
    """`truncate` (w = clamp(w, C_min, C)) or `mask` (w = w * 1[C_min <= w <= C])."""

    rollout_is_floor: float | None = None
    """Lower bound C_min of the rollout IS weight (TRL `vllm_importance_sampling_clip_min`;
    IcePop masks outside [C_min, C]). None: no lower bound. Otherwise a finite number >= 0 and
    < `rollout_is_cap`; only used when `rollout_is` is set."""

    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for A > 0. Must be > 0."""

    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for A <= 0. Must be > 0."""

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> LossConfigError:
            return LossConfigError(name, getattr(self, name), expected)

        def choice(name: str, allowed: tuple) -> None:
            if getattr(self, name) not in allowed:
                raise bad(name, "one of " + ", ".join(repr(a) for a in allowed))

        def real(name: str, expected: str, ok, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if not _is_finite32(v) or not ok(v):
                raise bad(name, expected + " (finite in fp32: |x| <= 3.4e38)")
            object.__setattr__(self, name, _plain(v))

        choice("policy", POLICIES)
        choice("ratio_level", RATIO_LEVELS)
        choice("kl_estimator", KL_ESTIMATORS)
        choice("agg", AGGS)
        choice("rollout_is", ROLLOUT_IS_LEVELS + (None,))
        choice("rollout_is_mode", ROLLOUT_IS_MODES)
        choice("seq_ratio_grad", SEQ_RATIO_GRADS)
        choice("kl_bias_ratio", KL_BIAS_RATIOS)
        if self.seq_ratio_grad != "mean" and self.ratio_level != "sequence":
            raise bad(
                "seq_ratio_grad",
                f"'mean' unless ratio_level='sequence' (it is the gradient of the sequence "
                f"ratio; ratio_level={self.ratio_level!r})",
            )
        real("clip_low", "a finite number in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        real("clip_high", "a finite number >= 0", lambda v: v >= 0.0)
        real("clip_dual", "None or a finite number > 1", lambda v: v > 1.0, optional=True)
        real(
            "clip_delta",
            f"None or a finite number > 1 + clip_high = {1 + self.clip_high}",
            lambda v: v > 1.0 + self.clip_high,
            optional=True,
        )
        real("kl_coef", "a finite number >= 0", lambda v: v >= 0.0)
        real("entropy_coef", "a finite number >= 0", lambda v: v >= 0.0)
        real(
            "temperature",
            "a finite number >= " + TAU_MIN_TEXT + " (1 / temperature · log2 e finite in fp32)",
            lambda v: v >= TAU_MIN,
        )
        real("num_tokens", "None or a finite number > 0", lambda v: v > 0, optional=True)
        real("num_seqs", "None or a finite number > 0", lambda v: v > 0, optional=True)
        if self.max_len is not None and (not _is_int(self.max_len) or self.max_len < 1):
            raise bad("max_len", "None or an int >= 1")
        object.__setattr__(self, "max_len", _plain(self.max_len))
        real("rollout_is_cap", "None or a finite number > 0", lambda v: v > 0.0, optional=True)
        if self.rollout_is is not None and self.rollout_is_cap is None:
            raise bad(
                "rollout_is_cap",
                f"a finite number > 0 because rollout_is={self.rollout_is!r} is set",
            )
        real(
            "rollout_is_floor",
            f"None or a finite number >= 0 and < rollout_is_cap = {self.rollout_is_cap}",
            lambda v: v >= 0.0 and (self.rollout_is_cap is None or v < self.rollout_is_cap),
            optional=True,
        )
        real("sapo_tau_pos", "a finite number > 0", lambda v: v > 0.0)
        real("sapo_tau_neg", "a finite number > 0", lambda v: v > 0.0)
        if not isinstance(self.kl_bias_correction, bool):
            raise bad("kl_bias_correction", "a bool")

    # ------------------------------------------------------------------ helpers
    def replace(self, **overrides: Any) -> LossConfig:
        """A copy with `overrides` applied (and validated). Unknown names raise a ValueError."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown LossConfig field(s) {unknown}; known fields: {sorted(known)}"
            )
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------ presets (SPEC 5)
    @classmethod
    def _preset(cls, base: dict[str, Any], overrides: dict[str, Any]) -> LossConfig:
        return cls().replace(**{**base, **overrides})

    @classmethod
    def ppo(cls, **overrides: Any) -> LossConfig:
        """PPO: clip 0.2 / 0.2, token ratios, no KL (shaping is the trainer's), token-mean."""
        return cls._preset({}, overrides)

    @classmethod
    def grpo(cls, **overrides: Any) -> LossConfig:
        """GRPO: clip 0.2 / 0.2, token ratios, k3 KL with beta = 0.04, seq-mean-token-mean."""
        base = dict(kl_coef=0.04, kl_estimator="k3", agg="seq-mean-token-mean")
        return cls._preset(base, overrides)

    @classmethod
    def dapo(cls, **overrides: Any) -> LossConfig:
        """DAPO: clip-higher 0.2 / 0.28, token ratios, no KL, token-mean (over the global count)."""
        return cls._preset(dict(clip_high=0.28), overrides)

    @classmethod
    def dr_grpo(cls, **overrides: Any) -> LossConfig:
        """Dr.GRPO: clip 0.2 / 0.2, no KL, seq-mean-token-sum-norm (constant normaliser)."""
        return cls._preset(dict(agg="seq-mean-token-sum-norm"), overrides)

    @classmethod
    def gspo(cls, **overrides: Any) -> LossConfig:
        """GSPO: sequence-level ratio, clip 3e-4 / 4e-4, no KL, seq-mean-token-mean."""
        base = dict(
            clip_low=3e-4, clip_high=4e-4, ratio_level="sequence", agg="seq-mean-token-mean"
        )
        return cls._preset(base, overrides)

    @classmethod
    def cispo(cls, **overrides: Any) -> LossConfig:
        """CISPO: stop-gradient IS weight clipped to [0, 5], no KL, token-mean."""
        return cls._preset(dict(policy="cispo", clip_low=1.0, clip_high=4.0), overrides)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LossConfig:
        """A preset by name: one of `PRESETS`."""
        if name not in PRESETS:
            raise ValueError(f"unknown LossConfig preset {name!r}; expected one of {PRESETS}")
        return getattr(cls, name)(**overrides)


PRESETS = ("ppo", "grpo", "dapo", "dr_grpo", "gspo", "cispo")


def resolve_config(config: LossConfig | str | None, overrides: dict[str, Any]) -> LossConfig:
    """The config a loss call uses: `config` (a LossConfig, a preset name or None = ppo) with
    keyword `overrides` of LossConfig fields applied."""
    if config is None:
        config = _preset_named("ppo")
    elif isinstance(config, str):
        config = _preset_named(config)
    elif not isinstance(config, LossConfig):
        raise ValueError(
            f"config must be a LossConfig, a preset name or None, got {type(config).__name__}"
        )
    return config.replace(**overrides) if overrides else config


_PRESETS_MADE: dict[str, LossConfig] = {}


def _preset_named(name: str) -> LossConfig:
    """`LossConfig.preset(name)`, made once per name (a LossConfig is frozen, so one instance
    serves every call): building and validating it took about 80 us of host time, on every loss
    call that names its preset. Inside a torch.compile trace it is made afresh (no global state
    there)."""
    import torch

    if torch.compiler.is_compiling():
        return LossConfig.preset(name)
    config = _PRESETS_MADE.get(name)
    if config is None:
        config = _PRESETS_MADE[name] = LossConfig.preset(name)  # raises on an unknown name
    return config
