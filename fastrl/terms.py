"""SPEC 1-5 on per-token tensors: the math every path of fastrl shares, written once.

From per-token log-probs `logp` and entropies `H` (fp32 (B, T), however they were computed: the
fused kernels, the LM-head path, a trainer's own forward) and the per-token inputs (advantages,
old / ref / rollout log-probs, mask, in `PolicyInputs`), this module gives the per-token loss
terms (SPEC 1-4), their aggregation (SPEC 5), the aggregation weights c_t = d loss / d L_t, the
metrics and the `PolicyLossOutput` every policy loss returns. Everything here is O(B T): the
(N, V) logits never enter. The hand-computed tables of tests/test_spec_tables.py check it
independently of any kernel.

Production (ops, linear, losses, value, the integrations) and the eager oracle
(`fastrl.reference`) both import it; the oracle's own part is the eager log-softmax over the
logits, never imported by production.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ._inputs import PolicyInputs, zero_uncounted
from .config import AGGS, LossConfig

LOG_RATIO_CLAMP = 20.0  # SPEC 1 / 3: exp(clamp(x, -20, 20)), verl's clamp
LOW_VAR_KL_CLAMP = 10.0  # SPEC 4: verl's clamp of k3
# the metrics of a policy loss, in the order PolicyLossOutput.metrics holds them (the last three
# with rollout IS only)
METRICS = ("clipfrac", "clipfrac_low", "clipfrac_high", "dualclip_frac", "approx_kl", "kl",
           "entropy", "ratio_mean", "ratio_max", "is_weight_mean", "is_weight_max",
           "is_clipfrac")  # fmt: skip


@dataclass
class PolicyLossOutput:
    """What every policy loss returns (`fastrl.policy_loss`, `policy_loss_from_logprobs`,
    `fused_linear_policy_loss`): the 0-dim `loss` (differentiable w.r.t. the logits, the LM
    head's inputs or the given log-probs), fp32 per-token `logp`, `entropy`, `kl` and `ratio`
    shaped like the tokens (detached), and `metrics` (detached 0-dim tensors: clipfrac,
    clipfrac_low / high, dualclip_frac, approx_kl, kl, entropy, ratio_mean / max, and the
    rollout IS weight statistics when rollout IS is on)."""

    loss: Tensor  # scalar, differentiable w.r.t. the logits
    logp: Tensor  # per token (like tokens), detached
    entropy: Tensor  # per token, detached
    kl: Tensor  # per token, detached (zeros when no ref_logp is given)
    metrics: dict[str, Tensor] = field(default_factory=dict)  # detached 0-dim tensors
    # per token, detached: the importance ratio of SPEC 1 (GSPO: the sequence ratio, repeated
    # over the sequence's tokens; 1 where the mask is 0), for a trainer's own clip metrics
    ratio: Tensor | None = None


# --------------------------------------------------------------------------- helpers
class Masked:
    """A mask (B, T) and what the loss derives from it, each formed once per call: `counted`
    (m > 0), the count Σ m with its `> 0` test and its clamp, the sequence lengths |y_i| = Σ_t m,
    and a 0-dim fp32 zero for torch.where (a Python 0.0 there becomes a fill kernel of its own
    on a GPU, every time). The helpers below take a Masked or a plain mask; one Masked shared
    by a loss and its metrics (`_terms_and_metrics`) runs the same operations on the same
    inputs as plain masks would (bitwise the same numbers) with fewer launches: a GRPO call
    made 168 (an H200 profile), 102 then (counted on the CPU); the metrics' token means in one
    stacked reduction (`masked_means`) took policy_output from 95 dispatched ops to 63."""

    def __init__(self, mask: Tensor):
        self.mask = mask
        self.counted = mask > 0
        self.zero = torch.zeros((), dtype=torch.float32, device=mask.device)
        self._count = self._lengths = None

    def count(self) -> tuple[Tensor, Tensor, Tensor]:
        """(Σ m, Σ m > 0, Σ m clamped to >= 1e-20)."""
        if self._count is None:
            c = self.mask.sum()
            self._count = (c, c > 0, c.clamp(min=1e-20))
        return self._count

    def lengths(self) -> Tensor:
        """|y_i| = Σ_t m (B,)."""
        if self._lengths is None:
            self._lengths = self.mask.sum(-1)
        return self._lengths


def _masked(mask) -> Masked:
    return mask if isinstance(mask, Masked) else Masked(mask)


def masked_mean(x: Tensor, mask: Tensor | Masked) -> Tensor:
    """Σ m·x / Σ m, and 0 (not NaN) when nothing counts. Entries with m = 0 never reach the
    result, not even a NaN there."""
    m = _masked(mask)
    _, any_counted, count = m.count()
    total = torch.where(m.counted, x * m.mask, m.zero).sum()
    return torch.where(any_counted, total / count, m.zero)


def masked_means(xs: list[Tensor], mask: Tensor | Masked) -> tuple[Tensor, ...]:
    """`masked_mean` of each x in `xs` (each like the mask, fp32), as one reduction over the
    stacked (k, ...) values: a handful of launches for k metrics instead of five each. Returns
    k 0-dim tensors (views of one (k,) result)."""
    m = _masked(mask)
    _, any_counted, count = m.count()
    stacked = torch.stack(xs)  # (k, B, T)
    totals = torch.where(m.counted, stacked * m.mask, m.zero).flatten(1).sum(1)  # (k,)
    return torch.where(any_counted, totals / count, m.zero).unbind(0)


def masked_max(x: Tensor, mask: Tensor | Masked) -> Tensor:
    """max of x over counted entries, 0 when nothing counts (no host sync)."""
    if x.numel() == 0:
        return x.new_zeros(())
    m = _masked(mask)
    top = torch.where(m.counted, x, float("-inf")).amax()
    return torch.where(m.count()[1], top, m.zero)


def masked_sum(x: Tensor, mask: Tensor | Masked, dim=None, keepdim: bool = False) -> Tensor:
    """Σ m·x (over `dim`, or everything); entries with m = 0 never reach it, not even a NaN."""
    m = _masked(mask)
    masked = torch.where(m.counted, x * m.mask, m.zero)
    return masked.sum() if dim is None else masked.sum(dim, keepdim=keepdim)


def _positive_count(count: Tensor | float, device) -> Tensor | float:
    """A caller's count: a tensor becomes fp32 on `device`, NaN where it is not a finite number
    > 0 (a bad tensor count, inf included, gives a NaN loss, never a finite wrong one such as
    the 0 of x / inf, without a host sync); a Python number is returned as is (LossConfig has
    checked it)."""
    if not isinstance(count, Tensor):
        return count
    count = count.to(device=device, dtype=torch.float32).reshape(())
    return torch.where(torch.isfinite(count) & (count > 0), count, float("nan"))


def nan_if_inf(x: Tensor) -> Tensor:
    """x with ±inf replaced by NaN: a caller's log-probs (old, reference, rollout) as the loss
    reads them, so that a non-finite one makes the loss NaN (SPEC 1: never the finite value the
    ±20 clamp of the log-ratio would give it; a logp of -inf from a -inf logit is the policy's
    own, not an input, and keeps the clamp's r = e^-20)."""
    return torch.where(torch.isinf(x), float("nan"), x)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str) -> Tensor:
    """Per-token KL(π || π_ref) estimate with x = ref_logp - logp (SPEC 4)."""
    x = nan_if_inf(ref_logp) - logp
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
    mask: Tensor | Masked,
    agg: str,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
    max_len: int | None = None,
) -> Tensor:
    """One scalar from per-token losses L (B, T) and mask m (B, T) (SPEC 5).

    What the mask excludes never reaches the result (a NaN at m = 0 included). An empty batch
    (B = 0 or T = 0) gives 0 under every aggregation. A caller's tensor count that is not a
    finite number > 0 gives NaN (never a finite wrong loss)."""
    m = _masked(mask)
    B, T = loss_mat.shape
    device = m.mask.device
    # B = 0: the sums below are 0, and 0 / 1 keeps the loss 0 (not 0 / 0)
    num_seqs = max(B, 1) if num_seqs is None else _positive_count(num_seqs, device)
    if agg == "token-mean":
        total = masked_sum(loss_mat, m)
        local_tokens, any_counted, _ = m.count()
        bad_count = None  # a caller's tensor count: NaN when it is not a finite number > 0
        if num_tokens is None:
            num_tokens = local_tokens
        elif isinstance(num_tokens, Tensor):
            bad_count = 0.0 * _positive_count(num_tokens, device)
        num_tokens = _positive_count(num_tokens, device)
        # an empty batch sums to 0: the loss (and its gradient) is 0 there, not NaN; a caller's
        # bad tensor count still makes it NaN (as the seq-mean aggregations do)
        loss = torch.where(any_counted, total / num_tokens, m.zero)
        return loss if bad_count is None else loss + bad_count
    if agg == "seq-mean-token-mean":
        per_seq = masked_sum(loss_mat, m, dim=-1) / m.lengths().clamp(min=1)
        return per_seq.sum() / num_seqs
    if agg == "seq-mean-token-sum":
        return masked_sum(loss_mat, m) / num_seqs
    if agg == "seq-mean-token-sum-norm":
        max_len = max(T, 1) if max_len is None else max_len
        return masked_sum(loss_mat, m) / (num_seqs * max_len)
    if agg == "token-sum":  # verl's token-sum: no normaliser
        return masked_sum(loss_mat, m)
    raise ValueError(f"unknown agg {agg!r}; expected one of {AGGS}")


def aggregation_weights(x: PolicyInputs) -> Tensor:
    """c_t = d loss / d L_t (B, T): the aggregation of SPEC 5 is linear in the per-token losses,
    so loss = Σ_t c_t L_t, with c_t known from the mask and the counts alone: c_t = s_i m_t where
    token t counts (0 elsewhere), s_i the derivative of `aggregate` w.r.t. a masked sum (its
    normaliser's reciprocal: 1 / num_tokens, 1 / (|y_i| num_seqs), ...). Formed in closed form
    with the operations autograd of `aggregate` runs, in its order (bitwise its numbers for a
    mask of finite values >= 0, what check_mask accepts: tests/test_spec_tables.py checks every
    aggregation against autograd), in a few launches and no autograd engine call: it runs on
    every loss call. Packed inputs: (1, N), computed on the
    padded sequences."""
    if x.packing is not None:
        return x.packing.unpad(aggregation_weights(x.packing.padded_inputs(x)))
    m = Masked(x.mask)
    B, T = m.mask.shape
    device = m.mask.device
    agg, num_seqs = x.config.agg, x.num_seqs
    num_seqs = max(B, 1) if num_seqs is None else _positive_count(num_seqs, device)
    one = torch.ones((), dtype=torch.float32, device=device)  # d loss / d loss
    if agg == "token-mean":
        local_tokens, any_counted, _ = m.count()
        num_tokens = local_tokens if x.num_tokens is None else x.num_tokens
        scale = torch.where(any_counted, one / _positive_count(num_tokens, device), m.zero)
    elif agg == "seq-mean-token-mean":
        scale = ((one / num_seqs).expand(B) / m.lengths().clamp(min=1))[:, None]  # (B, 1)
    elif agg == "seq-mean-token-sum":
        scale = one / num_seqs
    elif agg == "seq-mean-token-sum-norm":
        max_len = max(T, 1) if x.config.max_len is None else x.config.max_len
        scale = one / (num_seqs * max_len)
    elif agg == "token-sum":
        scale = one
    else:
        raise ValueError(f"unknown agg {agg!r}; expected one of {AGGS}")
    return torch.where(m.counted, scale, m.zero) * m.mask


# --------------------------------------------------------------------------- policy loss
@dataclass
class TokenTerms:
    """SPEC 1-4 per token, each (B, T), and the per-token total L_t of SPEC 5."""

    per_token_loss: Tensor  # L_t = w_t·ℓ_t + β·kl_t - c_H·H_t (differentiable)
    kl: Tensor  # kl_t (differentiable)
    ratio: Tensor  # r_t (token or sequence level)
    dual_clipped: Tensor | None  # 1 where the dual clip bites (None without a dual clip)
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


def rollout_is_weights(
    cfg: LossConfig, old_logp: Tensor, rollout_logp: Tensor, mask: Tensor
) -> dict[str, Tensor]:
    """SPEC 3, detached, (B, T) each: `is_weight` w_t (truncated or masked), `is_weight_raw`
    before that, `is_over_cap` 1 where the raw weight lies outside [floor, cap]. Token level:
    w_t = exp(old_t - rollout_t); sequence level: the exp of the masked sum over the sequence."""
    log_is_weight = (nan_if_inf(old_logp) - nan_if_inf(rollout_logp)).detach()
    if cfg.rollout_is == "sequence":
        log_is_weight = masked_sum(log_is_weight, mask, -1, keepdim=True).expand_as(old_logp)
    is_weight_raw = torch.exp(torch.clamp(log_is_weight, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    floor = 0.0 if cfg.rollout_is_floor is None else cfg.rollout_is_floor
    outside = (is_weight_raw > cfg.rollout_is_cap) | (is_weight_raw < floor)
    over_cap = outside.float()
    if cfg.rollout_is_mode == "truncate":  # w = clamp(w, floor, cap)
        is_weight = torch.clamp(is_weight_raw, min=floor, max=cfg.rollout_is_cap)
    else:  # w = w * 1[floor <= w <= cap]
        is_weight = is_weight_raw * (1 - over_cap)
    return {"is_weight": is_weight, "is_weight_raw": is_weight_raw, "is_over_cap": over_cap}


@dataclass(frozen=True)
class TokenGradTerms:
    """A token-separable policy loss as the Triton kernels take it (kernels.policy_terms:
    token_grads, or the one-pass kernel policy_loss.policy_rows_, for its gradient;
    policy_terms for its value and metrics): loss = sum_t c_t L_t(logp_t, H_t), so g_t and
    h_t follow from each row alone.
    Per-token tensors fp32 (N,) contiguous on the logits' device; the constants under
    LossConfig's names (SPEC 1-5)."""

    weight: Tensor  # c_t = d loss / d L_t (`aggregation_weights`; 0 where the mask is 0)
    advantages: Tensor  # A_t
    old_logp: Tensor | None  # None: pi_old = pi (r = 1)
    ref_logp: Tensor | None  # None: no KL (given with kl_coef = 0: for the kl metric only)
    is_weight: Tensor | None  # the detached token-level rollout IS weight w_t; None: 1
    policy: str
    clip_low: float
    clip_high: float
    clip_dual: float | None
    clip_delta: float | None
    kl_coef: float
    kl_estimator: str
    kl_bias_correction: bool  # kl * r, token level (kernels take no sequence-ratio one)
    entropy_coef: float
    sapo_tau_pos: float
    sapo_tau_neg: float


def token_grad_terms(
    x: PolicyInputs, weights: Tensor, logp: Tensor | None = None
) -> TokenGradTerms | None:
    """The TokenGradTerms of x's token-separable loss (`is_token_separable`) with aggregation
    weights c_t (`aggregation_weights`, x's layout), or None when a per-token input depends on
    the logits themselves (rollout IS without old_logp: w_t = exp(logp_t - rollout_t)).
    With the per-token `logp` (for the loss's value and metrics, `kernels.policy_terms`): never
    None (that w_t is formed from it), and ref_logp is kept whenever given (the kl metric, also
    with kl_coef = 0)."""
    cfg = x.config
    if cfg.rollout_is is not None and x.old_logp is None and logp is None:
        return None
    N = x.mask.numel()

    def flat(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().reshape(N).float().contiguous()

    is_weight = None
    if cfg.rollout_is is not None:
        old = x.old_logp if x.old_logp is not None else logp.detach()
        is_weight = rollout_is_weights(cfg, old, x.rollout_logp, x.mask)["is_weight"]
    with_ref = cfg.kl_coef != 0 or logp is not None
    return TokenGradTerms(
        weight=flat(weights), advantages=flat(x.advantages), old_logp=flat(x.old_logp),
        ref_logp=flat(x.ref_logp) if with_ref else None, is_weight=flat(is_weight),
        policy=cfg.policy, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
        clip_dual=cfg.clip_dual, clip_delta=cfg.clip_delta, kl_coef=cfg.kl_coef,
        kl_estimator=cfg.kl_estimator, kl_bias_correction=cfg.kl_bias_correction,
        entropy_coef=cfg.entropy_coef, sapo_tau_pos=cfg.sapo_tau_pos,
        sapo_tau_neg=cfg.sapo_tau_neg,
    )  # fmt: skip


def _k3_times_ratio_slope(
    kl_r: Tensor, logp: Tensor, ref_logp: Tensor, log_ratio: Tensor, r: Tensor
) -> Tensor:
    """kl_r = k3 * r (the bias correction, r = exp(clamp(log_ratio, +-20)), where ∂ log_ratio /
    ∂ logp is 1 in the token's own logp and 0 in the others') with its derivative in logp formed
    directly. Inside the clamp that derivative is (1 - e^x) r + (e^x - x - 1) r = -x r (x = ref -
    logp), and autograd through the product adds the two terms of size e^x r: in fp32 the sum
    keeps ~1e-3 of -x r at x = 10 and nothing of it beyond x ~ 17. Same value; inside the clamp
    the gradient is -x r, outside it autograd's (1 - e^x) r (r is constant there: no
    cancellation)."""
    inside = (log_ratio >= -LOG_RATIO_CLAMP) & (log_ratio <= LOG_RATIO_CLAMP)
    slope = torch.where(inside, (logp - ref_logp).detach() * r.detach(), 0.0)  # -x r
    exact = kl_r.detach() + slope * (logp - logp.detach())
    return torch.where(inside, exact, kl_r)


def token_terms(logp: Tensor, entropy: Tensor, x: PolicyInputs) -> TokenTerms:
    """SPEC 1-4 and the per-token total of SPEC 5 from logp and entropy (fp32 (B, T)).

    Elementwise in the tokens, except the sequence-level options (GSPO ratio, sequence IS
    weights), which sum over each sequence's counted tokens."""
    cfg = x.config
    mask = x.mask  # (B, T) fp32
    A = x.advantages  # (B, T)
    old_logp = logp.detach() if x.old_logp is None else nan_if_inf(x.old_logp)
    seq_lengths = None  # (B, 1): |y_i|, for the sequence-level options only
    if cfg.ratio_level == "sequence" or cfg.kl_bias_correction:
        seq_lengths = mask.sum(-1, keepdim=True)

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
    dual_clipped = None  # (no dual clip: nowhere)
    if cfg.policy == "ppo":
        unclipped_ratio = ratio if cfg.clip_delta is None else ratio.clamp(max=cfg.clip_delta)
        neg_A = -A
        pg_loss1 = neg_A * unclipped_ratio
        pg_loss2 = neg_A * clipped_ratio
        pg_loss = torch.maximum(pg_loss1, pg_loss2)
        if cfg.clip_dual is not None:
            pg_loss3 = neg_A * cfg.clip_dual
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
        terms = rollout_is_weights(cfg, old_logp, x.rollout_logp, mask)
        pg_loss = terms["is_weight"] * pg_loss

    # SPEC 4: KL to the reference policy
    if x.ref_logp is not None:
        kl = kl_penalty(logp, x.ref_logp, cfg.kl_estimator)
        if cfg.kl_bias_correction:
            bias_log_ratio = token_log_ratio if cfg.kl_bias_ratio == "token" else seq_log_ratio
            bias_ratio = torch.exp(torch.clamp(bias_log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
            kl = kl * bias_ratio
            if cfg.kl_estimator == "k3":
                # where ∂ log r / ∂ logp_t is 1, own token only: the token ratio, GSPO-token's
                # sequence ratio, and the mean sequence ratio of a sequence with one counted
                # token of weight >= 1 (m_t / max(|y|, 1) = 1); elsewhere nothing cancels
                exact = _k3_times_ratio_slope(kl, logp, x.ref_logp, bias_log_ratio, bias_ratio)
                if cfg.kl_bias_ratio == "token" or cfg.seq_ratio_grad == "token":
                    kl = exact
                else:
                    one = ((mask > 0).sum(-1, keepdim=True) == 1) & (seq_lengths >= 1)  # (B, 1)
                    kl = torch.where(one, exact, kl)
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
    H from the statistics kernel or pass, whose g = dloss/dlogp and h = dloss/dH the gradient
    sweep turns into the logits gradient). The hand-computed tests of SPEC's tables check it
    independently. No host sync: metrics stay tensors."""
    loss, kl, _, metrics = _terms_and_metrics(logp, entropy, x)
    return loss, kl, metrics


def _terms_and_metrics(logp: Tensor, entropy: Tensor, x: PolicyInputs):
    """`policy_terms` plus the per-token ratio: (loss, kl, ratio, metrics), kl and ratio detached
    in x's layout. Packed inputs ((1, N) rows of S sequences) are computed as the padded batch
    (S, T_max) of the same sequences (`fastrl.packing`), then brought back to (1, N)."""
    if x.packing is not None:
        pack = x.packing
        loss, kl, ratio, metrics = _terms_and_metrics(
            pack.pad(logp), pack.pad(entropy), pack.padded_inputs(x)
        )
        return loss, pack.unpad(kl), pack.unpad(ratio), metrics
    cfg = x.config
    mask = Masked(x.mask)  # one for the loss and the metrics
    A = x.advantages
    old_logp = logp.detach() if x.old_logp is None else x.old_logp
    t = token_terms(logp, entropy, x)
    loss = aggregate(t.per_token_loss, mask, cfg.agg, x.num_tokens, x.num_seqs, cfg.max_len)

    with torch.no_grad():
        ratio = t.ratio.detach()
        clipfrac_high = ((A > 0) & (ratio > 1 + cfg.clip_high)).float()
        clipfrac_low = ((A < 0) & (ratio < 1 - cfg.clip_low)).float()
        # the token means in one reduction (each its own five launches before)
        means = {
            "clipfrac": clipfrac_high + clipfrac_low,
            "clipfrac_low": clipfrac_low,
            "clipfrac_high": clipfrac_high,
            "approx_kl": (old_logp - logp).detach(),
            "kl": t.kl.detach(),
            "entropy": entropy.detach(),
            "ratio_mean": ratio,
        }
        if t.dual_clipped is not None:
            means["dualclip_frac"] = t.dual_clipped
        if t.is_weight is not None:
            means["is_weight_mean"] = t.is_weight
            means["is_clipfrac"] = t.is_over_cap
        metrics = dict(zip(means, masked_means(list(means.values()), mask)))
        if t.dual_clipped is None:  # the mean of no dual-clipped token is 0 exactly
            metrics["dualclip_frac"] = mask.zero.clone()
        metrics["ratio_max"] = masked_max(ratio, mask)
        if t.is_weight is not None:
            metrics["is_weight_max"] = masked_max(t.is_weight_raw, mask)
        metrics = {k: metrics[k] for k in METRICS if k in metrics}
    return loss, t.kl.detach(), t.ratio.detach(), metrics


def output_of_logprobs(logp: Tensor, entropy: Tensor, x: PolicyInputs) -> PolicyLossOutput:
    """`policy_output` of differentiable per-token (logp, H) (fp32, x's (B, T) layout): the loss
    differentiable w.r.t. them, its gradient left to their backward.

    What the mask excludes never reaches the loss or its gradient: at a masked token the
    per-token math gets 0 for logp (and H), as the fused losses report them there (they do not
    read a masked row). The loss never reads it there (every sum is masked), but a NaN / -inf
    value would give an inf in exp's or a product's backward, and 0 * inf = NaN would reach the
    caller's logp (and through its backward the model's weights); torch.where's backward hands
    a masked entry 0. Same values: the outputs (logp, entropy, kl: 0 at masked tokens) are
    those of the fused losses on the same log-probs."""
    return policy_output(*zero_uncounted(x.mask, logp, entropy), x)


def policy_output(logp: Tensor, entropy: Tensor, x: PolicyInputs) -> PolicyLossOutput:
    """`policy_terms`, packed as the PolicyLossOutput both policy losses return (per-token
    tensors back in the caller's layout)."""
    loss, kl, ratio, metrics = _terms_and_metrics(logp, entropy, x)
    return PolicyLossOutput(
        loss=loss,
        logp=x.unflatten(logp.detach()),
        entropy=x.unflatten(entropy.detach()),
        kl=x.unflatten(kl),
        metrics=metrics,
        ratio=x.unflatten(torch.where(x.mask > 0, ratio, 1.0)),
    )
