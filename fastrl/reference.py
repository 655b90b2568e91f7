"""SPEC.md in plain PyTorch: the oracle of every test and the "eager" baseline of the benchmarks.

Written to be read, CleanRL style: paper names (`ratio`, `pg_loss1`, `pg_loss2`, `clipfrac`,
`approx_kl`), one formula per line, no fusion and no memory tricks (it materialises several fp32
copies of the logits, which is exactly what the fused path avoids). Never change it to agree
with a kernel: the kernels are checked against it.

Shapes: B sequences, T tokens each, V vocabulary; N = B * T for flat inputs.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._inputs import (
    PolicyInputs,
    check_logits_tokens,
    check_temperature,
    prepare_policy_inputs,
)
from .config import AGGS, LossConfig

LOG_RATIO_CLAMP = 20.0  # SPEC 1 / 3: exp(clamp(x, -20, 20)), verl's clamp
LOW_VAR_KL_CLAMP = 10.0  # SPEC 4: verl's clamp of k3
WHITEN_EPS = 1e-8  # SPEC 7


@dataclass
class PolicyLossOutput:
    """What `policy_loss` returns (the fused `fastrl.policy_loss` returns the same object)."""

    loss: Tensor  # scalar, differentiable w.r.t. the logits
    logp: Tensor  # per token (like tokens), detached
    entropy: Tensor  # per token, detached
    kl: Tensor  # per token, detached (zeros when no ref_logp is given)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached 0-dim tensors


# --------------------------------------------------------------------------- helpers
def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Σ m·x / Σ m, and 0 (not NaN) when nothing counts. Entries with m = 0 never reach the
    result, not even a NaN there."""
    count = mask.sum()
    total = torch.where(mask > 0, x * mask, 0.0).sum()
    return torch.where(count > 0, total / count.clamp(min=1e-20), 0.0)


def masked_max(x: Tensor, mask: Tensor) -> Tensor:
    """max of x over counted entries, 0 when nothing counts (no host sync)."""
    if x.numel() == 0:
        return x.new_zeros(())
    top = torch.where(mask > 0, x, float("-inf")).amax()
    return torch.where(mask.sum() > 0, top, 0.0)


def masked_sum(x: Tensor, mask: Tensor, dim=None, keepdim: bool = False) -> Tensor:
    """Σ m·x (over `dim`, or everything); entries with m = 0 never reach it, not even a NaN."""
    masked = torch.where(mask > 0, x * mask, 0.0)
    return masked.sum() if dim is None else masked.sum(dim, keepdim=keepdim)


def _positive_count(count: Tensor | float, device) -> Tensor | float:
    """A caller's count: a tensor becomes fp32 on `device`, NaN where it is not > 0 (a bad
    tensor count gives a NaN loss, never a finite wrong one, without a host sync); a Python
    number is returned as is (LossConfig has checked it)."""
    if not isinstance(count, Tensor):
        return count
    count = count.to(device=device, dtype=torch.float32).reshape(())
    return torch.where(count > 0, count, float("nan"))


def token_logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0):
    """logp_t = z'_y - lse and H_t = lse - Σ_j p_j z'_j with z' = z / τ (SPEC notation).

    logits (..., V) any float dtype; tokens (...) int. Returns fp32 (logp, entropy), each (...).
    H is computed from max-shifted values, H = log Σ_j e_j - Σ_j e_j u_j / Σ_j e_j with
    u = z' - max z' and e = exp(u) (the same number, without the ε·|z'|² cancellation)."""
    z = logits.float() / temperature  # (..., V) fp32 copy
    log_probs = torch.log_softmax(z, dim=-1)  # (..., V)
    logp = log_probs.gather(-1, tokens.long().unsqueeze(-1)).squeeze(-1)
    u = z - z.amax(-1, keepdim=True)  # (..., V), <= 0
    e = torch.exp(u)
    # e_j u_j -> 0 where u_j = -inf (a masked vocabulary entry has p = 0); 0 * -inf would be NaN
    u_finite = torch.where(u == float("-inf"), 0.0, u)
    sum_e = e.sum(-1)
    entropy = torch.log(sum_e) - (e * u_finite).sum(-1) / sum_e
    return logp, entropy


def logprobs(logits: Tensor, tokens: Tensor, temperature: float = 1.0, entropy: bool = False):
    """Reference of `fastrl.logprobs`: per-token log-probs (and entropy when asked)."""
    temperature = check_temperature(temperature)
    check_logits_tokens(logits, tokens, check_range=True)
    logp, ent = token_logprobs(logits, tokens, temperature)
    return (logp, ent) if entropy else logp


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token KL(π || π_ref) estimate with x = ref_logp - logp (SPEC 4)."""
    x = ref_logp - logp
    if estimator == "k1":
        return -x
    if estimator == "abs":
        return x.abs()
    if estimator == "k2":
        return 0.5 * x**2
    if estimator == "k3":
        return torch.exp(x) - x - 1
    if estimator == "low_var_kl":
        x = torch.clamp(x, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        kl = torch.exp(x) - x - 1
        return torch.clamp(kl, -LOW_VAR_KL_CLAMP, LOW_VAR_KL_CLAMP)
    raise ValueError(f"unknown kl_estimator {estimator!r}")


def aggregate(
    loss_mat: Tensor,
    mask: Tensor,
    agg: str,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """One scalar from per-token losses L (B, T) and mask m (B, T) (SPEC 5).

    What the mask excludes never reaches the result (a NaN at m = 0 included). An empty batch
    gives 0. A caller's tensor count that is not > 0 gives NaN (never a finite wrong loss)."""
    B, T = loss_mat.shape
    seq_lengths = mask.sum(-1)  # |y_i|
    num_seqs = B if num_seqs is None else _positive_count(num_seqs, mask.device)
    total = masked_sum(loss_mat, mask)
    if agg == "token-mean":
        local_tokens = mask.sum()
        if num_tokens is None:
            num_tokens = local_tokens
        num_tokens = _positive_count(num_tokens, mask.device)
        # an empty batch sums to 0: the loss (and its gradient) is 0 there, not NaN
        return torch.where(local_tokens > 0, total / num_tokens, 0.0)
    if agg == "seq-mean-token-mean":
        per_seq = masked_sum(loss_mat, mask, dim=-1) / seq_lengths.clamp(min=1)
        return per_seq.sum() / num_seqs
    if agg == "seq-mean-token-sum":
        return total / num_seqs
    if agg == "seq-mean-token-sum-norm":
        max_len = T if max_len is None else max_len
        return total / (num_seqs * max_len)
    if agg == "token-sum":  # verl's token-sum: no normaliser
        return total
    raise ValueError(f"unknown agg {agg!r}; expected one of {AGGS}")


def aggregation_weights(x: PolicyInputs) -> Tensor:
    """c_t = d loss / d L_t (B, T): the aggregation of SPEC 5 is linear in the per-token losses,
    so loss = Σ_t c_t L_t, with c_t known from the mask and the counts alone (autograd of
    `aggregate` itself, so the two never disagree)."""
    with torch.enable_grad():
        zeros = torch.zeros_like(x.mask, requires_grad=True)
        loss = aggregate(zeros, x.mask, x.config.agg, x.num_tokens, x.num_seqs, x.config.max_len)
        (weights,) = torch.autograd.grad(loss, zeros)
    return weights


# --------------------------------------------------------------------------- policy loss
@dataclass
class TokenTerms:
    """SPEC 1-4 per token, each (B, T), and the per-token total L_t of SPEC 5."""

    per_token_loss: Tensor  # L_t = w_t·ℓ_t + β·kl_t - c_H·H_t (differentiable)
    kl: Tensor  # kl_t (differentiable)
    ratio: Tensor  # r_t (token or sequence level)
    dual_clipped: Tensor  # 1 where the dual clip bites
    is_weight: Tensor | None = None  # w_t after truncation / masking (rollout IS only)
    is_weight_raw: Tensor | None = None  # w_t before it
    is_over_cap: Tensor | None = None  # 1 where w_t lies outside [floor, cap] (truncated / masked)


def is_token_separable(cfg: LossConfig) -> bool:
    """True when L_t depends on token t's own logp_t and H_t only (token-level ratio, no
    sequence-level IS weight, no KL weighted by a sequence ratio): then every per-token gradient
    is known as soon as the row's logp and H are, and the fused paths compute dL/dz in the
    forward's pass over the row. Any option that couples the tokens of a sequence must make this
    False (the fused paths then take their two-pass path)."""
    seq_kl_weight = cfg.kl_coef != 0 and cfg.kl_bias_correction and cfg.kl_bias_ratio == "sequence"
    return cfg.ratio_level == "token" and cfg.rollout_is != "sequence" and not seq_kl_weight


def token_terms(logp: Tensor, entropy: Tensor, x: PolicyInputs) -> TokenTerms:
    """SPEC 1-4 and the per-token total of SPEC 5 from logp and entropy (fp32 (B, T)).

    Elementwise in the tokens, except the sequence-level options (GSPO ratio, sequence IS
    weights), which sum over each sequence's counted tokens."""
    cfg = x.config
    mask = x.mask  # (B, T) fp32
    A = x.advantages  # (B, T)
    old_logp = logp.detach() if x.old_logp is None else x.old_logp
    seq_lengths = mask.sum(-1, keepdim=True)  # (B, 1): |y_i|

    # SPEC 1: importance ratio
    token_log_ratio = logp - old_logp
    seq_log_ratio = None
    seq_kl_weight = cfg.kl_bias_correction and cfg.kl_bias_ratio == "sequence"
    if cfg.ratio_level == "sequence" or seq_kl_weight:
        # GSPO: length-normalised sequence log-ratio, broadcast over the sequence (B, T)
        seq_log_ratio = masked_sum(token_log_ratio, mask, -1, keepdim=True)
        seq_log_ratio = (seq_log_ratio / seq_lengths.clamp(min=1)).expand_as(logp)
        if cfg.seq_ratio_grad == "token":  # GSPO-token (verl): sg(log r_i) + logp_t - sg(logp_t)
            seq_log_ratio = seq_log_ratio.detach() + logp - logp.detach()
    if cfg.ratio_level == "token":
        log_ratio = token_log_ratio
    else:
        log_ratio = seq_log_ratio
    ratio = torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    clipped_ratio = torch.clamp(ratio, 1 - cfg.clip_low, 1 + cfg.clip_high)

    # SPEC 2: the per-token policy term
    dual_clipped = torch.zeros_like(mask)
    if cfg.policy == "ppo":
        unclipped_ratio = ratio if cfg.clip_delta is None else ratio.clamp(max=cfg.clip_delta)
        pg_loss1 = -A * unclipped_ratio
        pg_loss2 = -A * clipped_ratio
        pg_loss = torch.maximum(pg_loss1, pg_loss2)
        if cfg.clip_dual is not None:
            pg_loss3 = -A * cfg.clip_dual
            dual_clipped = ((A < 0) & (pg_loss > pg_loss3)).float()
            pg_loss = torch.where(A < 0, torch.minimum(pg_loss, pg_loss3), pg_loss)
    elif cfg.policy == "cispo":
        pg_loss = -clipped_ratio.detach() * A * logp
    elif cfg.policy == "sapo":
        tau = torch.where(A > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
        pg_loss = -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * A
    elif cfg.policy == "reinforce":
        pg_loss = -A * logp
    else:
        raise ValueError(f"unknown policy {cfg.policy!r}")

    # SPEC 3: rollout correction (truncated importance sampling), detached
    terms = {}
    if cfg.rollout_is is not None:
        log_is_weight = (old_logp - x.rollout_logp).detach()
        if cfg.rollout_is == "sequence":
            log_is_weight = masked_sum(log_is_weight, mask, -1, keepdim=True).expand_as(logp)
        is_weight_raw = torch.exp(torch.clamp(log_is_weight, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
        floor = 0.0 if cfg.rollout_is_floor is None else cfg.rollout_is_floor
        outside = (is_weight_raw > cfg.rollout_is_cap) | (is_weight_raw < floor)
        over_cap = outside.float()
        if cfg.rollout_is_mode == "truncate":  # w = clamp(w, floor, cap)
            is_weight = torch.clamp(is_weight_raw, min=floor, max=cfg.rollout_is_cap)
        else:  # w = w * 1[floor <= w <= cap]
            is_weight = is_weight_raw * (1 - over_cap)
        pg_loss = is_weight * pg_loss
        terms = {"is_weight": is_weight, "is_weight_raw": is_weight_raw, "is_over_cap": over_cap}

    # SPEC 4: KL to the reference policy
    if x.ref_logp is not None:
        kl = kl_penalty(logp, x.ref_logp, cfg.kl_estimator)
        if cfg.kl_bias_correction:
            bias_log_ratio = token_log_ratio if cfg.kl_bias_ratio == "token" else seq_log_ratio
            kl = kl * torch.exp(torch.clamp(bias_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    else:
        kl = torch.zeros_like(logp)

    # SPEC 5: per-token total. A zero coefficient drops its term rather than adding 0 * x
    # (which would turn an overflowed k3 into a NaN loss).
    per_token_loss = pg_loss
    if cfg.kl_coef != 0:
        per_token_loss = per_token_loss + cfg.kl_coef * kl
    if cfg.entropy_coef != 0:
        per_token_loss = per_token_loss - cfg.entropy_coef * entropy
    return TokenTerms(per_token_loss, kl, ratio, dual_clipped, **terms)


def policy_terms(logp: Tensor, entropy: Tensor, x: PolicyInputs):
    """SPEC 1-5 on per-token tensors: (loss, kl, metrics) from logp and entropy (fp32 (B, T)).

    Everything here is O(B*T): the (N, V) logits only enter through logp and H, so this one
    function serves both the eager reference (logp, H from log_softmax) and the fused path (logp,
    H from the one-pass kernel, whose backward turns g = dloss/dlogp and h = dloss/dH into the
    logits gradient). The hand-computed tests of SPEC's tables check it independently. No host
    sync: metrics stay tensors."""
    cfg = x.config
    mask = x.mask
    A = x.advantages
    old_logp = logp.detach() if x.old_logp is None else x.old_logp
    t = token_terms(logp, entropy, x)
    loss = aggregate(t.per_token_loss, mask, cfg.agg, x.num_tokens, x.num_seqs, cfg.max_len)

    with torch.no_grad():
        ratio = t.ratio
        clipfrac_high = ((A > 0) & (ratio > 1 + cfg.clip_high)).float()
        clipfrac_low = ((A < 0) & (ratio < 1 - cfg.clip_low)).float()
        metrics = {
            "clipfrac": masked_mean(clipfrac_high + clipfrac_low, mask),
            "clipfrac_low": masked_mean(clipfrac_low, mask),
            "clipfrac_high": masked_mean(clipfrac_high, mask),
            "dualclip_frac": masked_mean(t.dual_clipped, mask),
            "approx_kl": masked_mean(old_logp - logp, mask),
            "kl": masked_mean(t.kl, mask),
            "entropy": masked_mean(entropy, mask),
            "ratio_mean": masked_mean(ratio, mask),
            "ratio_max": masked_max(ratio, mask),
        }
        if t.is_weight is not None:
            metrics["is_weight_mean"] = masked_mean(t.is_weight, mask)
            metrics["is_weight_max"] = masked_max(t.is_weight_raw, mask)
            metrics["is_clipfrac"] = masked_mean(t.is_over_cap, mask)
        metrics = {k: v.detach() for k, v in metrics.items()}
    return loss, t.kl.detach(), metrics


def policy_loss(
    logits: Tensor,
    tokens: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    config: LossConfig | str | None = None,
    **overrides,
) -> PolicyLossOutput:
    """The policy loss of SPEC 1-5, eagerly. Same signature and output as `fastrl.policy_loss`.

    logits (B, T, V) or (N, V); tokens (B, T) or (N,); advantages (B,), (B, T) or (N,);
    old_logp / ref_logp / rollout_logp / mask like tokens. The gradient is plain autograd through
    log_softmax (several fp32 (B, T, V) tensors: this is the eager baseline)."""
    x = prepare_policy_inputs(
        logits,
        tokens,
        advantages,
        old_logp,
        ref_logp,
        mask,
        rollout_logp,
        config,
        overrides,
        check_range=True,
    )
    logp, entropy = token_logprobs(x.logits, x.tokens, x.config.temperature)  # (B, T) each
    return policy_output(logp, entropy, x)


def policy_output(logp: Tensor, entropy: Tensor, x: PolicyInputs) -> PolicyLossOutput:
    """`policy_terms`, packed as the PolicyLossOutput both policy losses return (per-token
    tensors back in the caller's layout)."""
    loss, kl, metrics = policy_terms(logp, entropy, x)
    return PolicyLossOutput(
        loss=loss,
        logp=x.unflatten(logp.detach()),
        entropy=x.unflatten(entropy.detach()),
        kl=x.unflatten(kl),
        metrics=metrics,
    )


# --------------------------------------------------------------------------- value loss
def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor | None = None,
    clip: float | None = 0.2,
    agg: str = "token-mean",
):
    """PPO's clipped value loss (SPEC 8). values / old_values / returns / mask (B, T).

    Returns (loss, vf_clipfrac)."""
    values_2d = values if values.dim() == 2 else values.unsqueeze(0)
    mask = torch.ones_like(values_2d) if mask is None else mask.reshape(values_2d.shape).float()
    returns = returns.reshape(values_2d.shape)
    old_values = old_values.reshape(values_2d.shape)
    if clip is None:
        values_clipped = values_2d
    else:
        values_clipped = old_values + torch.clamp(values_2d - old_values, -clip, clip)
    vf_loss1 = (values_2d - returns) ** 2
    vf_loss2 = (values_clipped - returns) ** 2
    vf_loss = 0.5 * aggregate(torch.maximum(vf_loss1, vf_loss2), mask, agg)
    vf_clipfrac = masked_mean((vf_loss2 > vf_loss1).float(), mask).detach()
    return vf_loss, vf_clipfrac


# --------------------------------------------------------------------------- advantages
def whiten(x: Tensor, mask: Tensor | None = None, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over counted entries, var unbiased (SPEC 7). Returns fp32.

    Only counted entries (m > 0) reach mean and var (a NaN at m = 0 stays at its own entry);
    every entry is transformed. Nothing counted: all zeros. Computed in float64, and var + eps
    as s²·(var(c/s) + eps/s²) with s = max |c| over counted c = x - mean, so huge x do not
    overflow when squared and tiny x still get the eps."""
    x = x.double()
    mask = torch.ones_like(x) if mask is None else mask.double()
    count = mask.sum()
    if count == 0:
        return torch.zeros_like(x, dtype=torch.float32)
    mean = masked_mean(x, mask)
    centered = x - mean
    scale = masked_max(centered.abs(), mask)  # s
    if scale == 0:
        var_scaled = torch.zeros_like(scale)
    else:
        var_scaled = masked_mean((centered / scale) ** 2, mask)  # var / s²
    if count > 1:
        var_scaled = var_scaled * count / (count - 1)  # Bessel's correction
    if scale > 1:
        std = scale * torch.sqrt(var_scaled + WHITEN_EPS / scale**2)  # s² would overflow
    else:
        std = torch.sqrt(scale**2 * var_scaled + WHITEN_EPS)  # s² underflows only next to eps
    whitened = centered / std
    if not shift_mean:
        whitened = whitened + mean
    return whitened.float()


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten_advantages: bool = True,
):
    """Generalised advantage estimation, verl's masked form (SPEC 7). All inputs (B, T).

    Returns (advantages, returns), fp32 (B, T). Rewards and values at tokens with m = 0 never
    reach the advantages (only returns = A + V at that same token)."""
    rewards, values, mask = rewards.float(), values.float(), mask.float()
    B, T = rewards.shape
    next_value = rewards.new_zeros(B)
    last_gae = rewards.new_zeros(B)
    advantages_reversed = []
    for t in reversed(range(T)):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        # m·x + (1 - m)·prev; a token with m = 0 keeps prev (a NaN there never reaches it)
        next_value = torch.where(m > 0, m * values[:, t] + (1 - m) * next_value, next_value)
        last_gae = torch.where(m > 0, m * gae_t + (1 - m) * last_gae, last_gae)
        advantages_reversed.append(last_gae)
    advantages = torch.stack(advantages_reversed[::-1], dim=1)
    returns = advantages + values
    if whiten_advantages:
        advantages = whiten(advantages, mask)
    return advantages, returns


def _groups(rewards: Tensor, group_size: int | None, group_ids: Tensor | None) -> list[Tensor]:
    """The indices of each group: contiguous blocks of group_size, or equal group_ids."""
    B = rewards.shape[0]
    if group_ids is not None:
        return [torch.nonzero(group_ids == g).flatten() for g in torch.unique(group_ids)]
    if group_size is None or group_size < 1 or B % group_size != 0:
        raise ValueError(
            f"group_size={group_size} must be an int >= 1 that divides the batch size {B}"
        )
    return [torch.arange(s, s + group_size) for s in range(0, B, group_size)]


def _unbiased_std(x: Tensor) -> Tensor:
    """Unbiased std of x (n,), scale-safe: the centred values are divided by their largest
    magnitude s before squaring, σ = s·std(c / s) (±1e200 in float64 does not overflow)."""
    centered = x - x.mean()
    scale = centered.abs().max()
    if scale == 0:
        return torch.zeros_like(scale)
    return scale * (centered / scale).std()


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    group_ids: Tensor | None = None,
    scale: str | None = None,
    estimator: str = "grpo",
    eps: float = 1e-6,
    mask: Tensor | None = None,
) -> Tensor:
    """Outcome advantages from per-response rewards (B,) grouped by prompt (SPEC 7).

    grpo: (R - μ_g) / (σ_g + eps) (`scale="group"`, the default), σ of the batch (`"batch"`),
    or no division (`"none"`, Dr.GRPO). rloo: n/(n-1)·(R - μ_g), SPEC's leave-one-out baseline
    (`scale` defaults to `"none"` for it; `"group"` / `"batch"` divide as for grpo).
    reinforce++: R - μ_g, whitened over the batch: over the tokens of `mask` (B, T) when given
    (returns (B, T)), else over the B responses (`scale` must be None).
    Groups of one and all-equal groups give 0. Computed in float64, returns fp32."""
    if scale is None:
        scale = {"grpo": "group", "rloo": "none", "reinforce++": "batch"}.get(estimator)
    rewards = rewards.double()
    centered = torch.zeros_like(rewards)
    group_std = torch.zeros_like(rewards)
    for idx in _groups(rewards, group_size, group_ids):
        r = rewards[idx]
        n = len(idx)
        if n == 1:
            continue  # a group of one has no baseline: A = 0
        centered[idx] = r - r.mean()
        if estimator == "rloo":
            centered[idx] = centered[idx] * n / (n - 1)
        group_std[idx] = _unbiased_std(r)
    if estimator == "reinforce++":
        if mask is None:
            return whiten(centered)
        return whiten(centered[:, None].expand(mask.shape), mask)
    if estimator not in ("grpo", "rloo"):
        raise ValueError(f"unknown estimator {estimator!r}; expected grpo, rloo or reinforce++")
    if scale == "none":
        return centered.float()
    if scale == "group":
        return (centered / (group_std + eps)).float()
    if scale == "batch":
        batch_std = _unbiased_std(rewards) if rewards.numel() > 1 else rewards.new_zeros(())
        return (centered / (batch_std + eps)).float()
    raise ValueError(f"unknown scale {scale!r}; expected group, batch or none")


# --------------------------------------------------------------------------- DAPO
def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (SPEC 9), added to the reward. lengths (B,) -> (B,)."""
    expected_len = max_len - cache_len
    penalty = []
    for length in lengths.tolist():
        if length <= expected_len:
            penalty.append(0.0)
        elif length <= max_len:
            penalty.append((expected_len - length) / cache_len * factor)
        else:
            penalty.append(-factor)
    return torch.tensor(penalty, dtype=torch.float32)


def dynamic_sampling_filter(rewards: Tensor, group_size: int) -> Tensor:
    """Indices of the groups whose rewards are not all equal (SPEC 9). rewards (B,) -> (K,)."""
    kept = []
    for g, idx in enumerate(_groups(rewards, group_size, None)):
        r = rewards[idx]
        if not torch.all(r == r[0]):
            kept.append(g)
    return torch.tensor(kept, dtype=torch.long)
