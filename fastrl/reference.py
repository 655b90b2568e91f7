"""SPEC.md in plain PyTorch: the eager oracle of every test (shown in benchmarks for context, never
as a speed baseline). No production module imports it: the per-token math it shares with the
fused paths is `fastrl.terms`; what is its own is the eager log-softmax over the logits, the
value loss, the advantages and DAPO's shaping, each written out plainly.

Written to be read, CleanRL style: paper names (`ratio`, `pg_loss1`, `pg_loss2`, `clipfrac`,
`approx_kl`), one formula per line, no fusion and no memory tricks (it materialises several fp32
copies of the logits, which is exactly what the fused path avoids). Never change it to agree
with a kernel: the kernels are checked against it.

Shapes: B sequences, T tokens each, V vocabulary; N = B * T for flat inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._inputs import (
    check_logits_tokens,
    check_temperature,
    prepare_policy_inputs,
)
from .config import LossConfig

# SPEC 1-5 on per-token tensors (shared with production, checked by hand-computed tables in
# tests/test_spec_tables.py), re-exported here so the oracle reads as one module
from .terms import (  # noqa: F401
    LOG_RATIO_CLAMP,
    LOW_VAR_KL_CLAMP,
    PolicyLossOutput,
    TokenTerms,
    aggregate,
    aggregation_weights,
    is_token_separable,
    kl_penalty,
    masked_max,
    masked_mean,
    masked_sum,
    policy_output,
    policy_terms,
    token_terms,
)

WHITEN_EPS = 1e-8  # SPEC 7


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
    """The policy loss of SPEC 1-5, eagerly. Same signature and output as `fastrl.policy_loss`,
    except that it computes every row: at a token whose mask is 0 its logp / entropy / kl are
    that row's values, where fastrl's fused losses (which do not read a masked row) report 0.

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
        temperature_tensor=True,
    )
    tau = x.config.temperature if x.temperature_rows is None else x.temperature_rows[..., None]
    logp, entropy = token_logprobs(x.logits, x.tokens, tau)  # (B, T) each
    # A masked token's loss term is multiplied by m = 0, so its exact gradient is 0; autograd
    # would form 0 * inf = NaN there when the term overflows (k3's exp(ref - logp) at a very
    # unlikely masked token), so such tokens see a detached copy.
    counted = x.mask > 0
    logp = torch.where(counted, logp, logp.detach())
    entropy = torch.where(counted, entropy, entropy.detach())
    return policy_output(logp, entropy, x)


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
        values_clipped = torch.clamp(values_2d, old_values - clip, old_values + clip)
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
        if n == 1 or bool((r == r[0]).all()):
            continue  # a group of one has no baseline, an all-equal group no signal: A = 0
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
        std = group_std
    elif scale == "batch":
        std = _unbiased_std(rewards) if rewards.numel() > 1 else rewards.new_zeros(())
    else:
        raise ValueError(f"unknown scale {scale!r}; expected group, batch or none")
    # with eps = 0 an all-equal group (or batch) has std + eps = 0 and A = 0, not 0 / 0
    return torch.where(std + eps == 0, 0.0, centered / (std + eps)).float()


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
