"""Triton kernels of the per-token policy-loss math (SPEC 1-5 on per-token values, O(N)).

A token-separable loss (fastrl.terms.is_token_separable) is loss = sum_t c_t L_t(logp_t, H_t),
with c_t = dloss / dL_t the aggregation weights (fastrl.terms.aggregation_weights) and
    L_t = w_t l_t(r_t) + beta kl_t - c_H H_t,   r_t = exp(clamp(logp_t - old_t, -20, 20)).

* `_token_terms` (a helper, inlined): l_t's policy term, kl_t, r_t, the dual-clip indicator and
  dL_t / dlogp_t of one token, with autograd's conventions for fastrl.terms.token_terms (clamp
  ends included, a tie of max / min split in half, nothing through the detached parts).
  `_token_grads` takes its derivative; `_policy_terms_fwd_kernel` its values.
* `_token_grads` (a helper, inlined): g_t = c_t dL_t/dlogp_t and h_t = -c_t c_H of a token from
  its inputs; `_token_grads_fwd_kernel` (one program per BLOCK tokens, launcher `token_grads`)
  forms them for every token between the statistics kernel and the gradient kernel of the
  logits (kernels/policy_loss.py), the one-pass kernel inside its row programs.
* `_policy_terms_fwd_kernel` (one program per BLOCK tokens): from logp and H (however they were
  computed) the per-token kl_t and r_t, and per program the partial sums of the loss
  sum_t c_t L_t and of the metrics' masked sums (sum_t m_t v_t over counted tokens, m_t > 0),
  the mask's count and the largest counted ratio. `policy_terms` (the launcher) adds the
  partials on the device: the loss and the metrics of fastrl.terms.policy_output in one launch
  and a handful of small reductions, where the torch math takes about 50 (one launch each on a
  GPU, a call of V = 32000 was host-bound: benchmarks/results, H200).

What the mask excludes (m_t = 0, c_t = 0) never reaches a sum, not even a NaN there; a counted
token with a NaN logp makes the loss and the metrics NaN (never hidden).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import EXACT_PRODUCTS, LaunchConfig, Ptr, cdiv, config

_F32 = torch.float32

# Codes of the runtime (not constexpr) switches: one compiled kernel serves every token-separable
# option; the per-token scalar math costs nothing next to a logits row.
POLICY_CODES = {"ppo": 0, "cispo": 1, "sapo": 2, "reinforce": 3}
KL_CODES = {None: -1, "k1": 0, "abs": 1, "k2": 2, "k3": 3, "low_var_kl": 4}
SWITCHES = ["has_old", "has_is", "policy", "has_dual", "kl_est", "kl_bias"]
_LOG_RATIO_CLAMP = tl.constexpr(20.0)  # fastrl.terms.LOG_RATIO_CLAMP (SPEC 1 / 3)
_LOW_VAR_KL_CLAMP = tl.constexpr(10.0)  # fastrl.terms.LOW_VAR_KL_CLAMP (SPEC 4)

# The partial sums a _policy_terms_fwd_kernel program writes, in this order: the loss, the mask's
# count, then the masked sums of the metrics named (fastrl.terms' metric names).
SUMS = ("loss", "count", "clipfrac", "clipfrac_low", "clipfrac_high", "dualclip_frac",
        "approx_kl", "kl", "entropy", "ratio_mean")  # fmt: skip
_N_SUMS = tl.constexpr(len(SUMS))
_TERMS_BLOCK = 1024  # tokens per _policy_terms_fwd_kernel program


@triton.jit
def _clamp_grad(x, lo, hi, dx):
    # clamp(x, lo, hi) and its derivative, as torch.clamp: a NaN stays NaN (PTX's plain min /
    # max would return the other operand), and the derivative is dx where lo <= x <= hi (both
    # ends included), else 0 (at a NaN too).
    inside = (x >= lo) & (x <= hi)
    y = tl.minimum(
        tl.maximum(x, lo, propagate_nan=tl.PropagateNan.ALL), hi, propagate_nan=tl.PropagateNan.ALL
    )
    return y, tl.where(inside, dx, 0.0)


@triton.jit
def _load_logp(ptr, offs, inb):
    # a caller's log-probs (old_logp / ref_logp) at offs: +-inf is read as NaN
    # (fastrl.terms.nan_if_inf: a non-finite input makes the loss NaN, never the finite value
    # the +-20 clamp of the log-ratio would give it)
    x = tl.load(ptr + offs, mask=inb, other=0.0)
    return tl.where((x == float("inf")) | (x == float("-inf")), float("nan"), x)


@triton.jit
def _max_grad(a, b, da, db):
    # torch.maximum(a, b) (NaN if either is) and its derivative (a tie splits it half and half,
    # as autograd does)
    d = tl.where(a > b, da, tl.where(a < b, db, 0.5 * (da + db)))
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL), d


@triton.jit
def _token_terms(
    logp,
    adv,
    old,
    ref,
    is_weight,
    policy,
    ratio_lo,
    ratio_hi,
    has_dual,
    clip_dual,
    clip_delta,
    kl_coef,
    kl_est,
    kl_bias,
    sapo_tau_pos,
    sapo_tau_neg,
):
    # SPEC 1-4 for a token of a token-separable loss (fp32 scalars or blocks), as
    # fastrl.terms.token_terms computes them. Returns (loss, dloss, r, kl, dual):
    #   loss  = w l + beta kl (beta kl only when kl_est >= 0 and beta != 0; the entropy term is
    #           the caller's), dloss = d loss / d logp (autograd's conventions; the caller
    #           multiplies by c_t), r the ratio, kl the KL estimate (0 when kl_est < 0), dual 1.0
    #           where ppo's dual clip bites (0 for the other policies, which have none).
    # A NaN (a NaN logp or old_logp at a counted token) reaches every value it touches, as in
    # torch; a derivative through the ratio's clamp is 0 there, as autograd's.
    #   r = exp(clamp(logp - old, -20, 20)), dr = r inside the clamp, else 0
    lr = logp - old
    lr_c, dlr = _clamp_grad(lr, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP, 1.0)
    r = tl.exp(lr_c)
    dr = tl.where(dlr != 0.0, r, 0.0)
    cr, dcr = _clamp_grad(r, ratio_lo, ratio_hi, dr)  # clip(r, 1 - eps_low, 1 + eps_high)
    # ppo: max(-A min(r, delta), -A clip(r)), then for A < 0 the dual clip min(., -A c)
    u, du = _clamp_grad(r, float("-inf"), clip_delta, dr)  # clip_delta = +inf: none
    pg, d_ppo = _max_grad(-adv * u, -adv * cr, -adv * du, -adv * dcr)
    pg3 = -adv * clip_dual
    dual_on = (policy == 0) & (has_dual != 0) & (adv < 0.0)  # ppo's dual clip only
    dual = tl.where(dual_on & (pg > pg3), 1.0, 0.0)
    d_dual = tl.where(pg < pg3, d_ppo, tl.where(pg > pg3, 0.0, 0.5 * d_ppo))
    d_ppo = tl.where(dual_on, d_dual, d_ppo)
    pg = tl.where(dual_on, tl.minimum(pg, pg3, propagate_nan=tl.PropagateNan.ALL), pg)
    # cispo: -sg(clip(r)) A logp;  reinforce: -A logp
    l_cispo = -cr * adv * logp
    d_cispo = -cr * adv
    # sapo: -sigmoid(tau (r - 1)) (4 / tau) A, tau by the sign of A
    tau = tl.where(adv > 0.0, sapo_tau_pos, sapo_tau_neg)
    sig = tl.sigmoid(tau * (r - 1.0))
    l_sapo = -sig * (4.0 / tau) * adv
    d_sapo = tl.where(dlr != 0.0, -4.0 * adv * sig * (1.0 - sig) * dr, 0.0)
    l_pg = tl.where(
        policy == 0, pg, tl.where(policy == 1, l_cispo, tl.where(policy == 2, l_sapo, -adv * logp))
    )
    d_pg = tl.where(
        policy == 0, d_ppo, tl.where(policy == 1, d_cispo, tl.where(policy == 2, d_sapo, -adv))
    )
    loss = is_weight * l_pg
    g = is_weight * d_pg
    kl = tl.zeros_like(r)  # (0 * r would be NaN where r is)
    if kl_est >= 0:
        # KL to the reference, x = ref - logp (dx / dlogp = -1)
        x = ref - logp
        e = tl.exp(x)
        kl = -x  # k1
        d_kl = tl.zeros_like(x) + 1.0  # (0 * x: NaN at x = inf, a -inf logp)
        if kl_est == 1:  # abs
            kl = tl.abs(x)
            d_kl = -tl.where(x > 0.0, 1.0, tl.where(x < 0.0, -1.0, 0.0))
        elif kl_est == 2:  # k2
            kl = 0.5 * x * x
            d_kl = -x
        elif kl_est == 3:  # k3
            kl = e - x - 1.0
            d_kl = 1.0 - e
        elif kl_est == 4:  # low_var_kl: clamp(k3(clamp(x, +-20)), +-10)
            x_c, dx_c = _clamp_grad(x, -_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP, -1.0)
            e_c = tl.exp(x_c)
            kl, d_kl = _clamp_grad(
                e_c - x_c - 1.0, -_LOW_VAR_KL_CLAMP, _LOW_VAR_KL_CLAMP, (e_c - 1.0) * dx_c
            )
        if kl_bias != 0:  # kl * r (token-level bias correction)
            d_kl = d_kl * r + kl * dr
            if kl_est == 3:  # inside the clamp (dr = r) k3's sum is -x r: formed directly, as
                # its two terms of size e^x r cancel (fastrl.terms._k3_times_ratio_slope)
                d_kl = tl.where(dlr != 0.0, -x * r, d_kl)
            kl = kl * r
        # a zero coefficient drops the term (0 * an overflowed k3 would be NaN), as terms does
        loss = tl.where(kl_coef != 0.0, loss + kl_coef * kl, loss)
        g = tl.where(kl_coef != 0.0, g + kl_coef * d_kl, g)
    return loss, g, r, kl, dual


@triton.jit
def _masked_total(v, m, counted):
    # sum_t m_t v_t over the counted tokens (a NaN where m_t = 0 never reaches it)
    return tl.sum(tl.where(counted, v * m, 0.0), axis=0)


@triton.jit
def _token_grads(
    offs,
    inb,
    logp,
    weight_ptr,
    adv_ptr,
    old_ptr,
    ref_ptr,
    is_weight_ptr,
    has_old,
    has_is,
    policy,
    ratio_lo,
    ratio_hi,
    has_dual,
    clip_dual,
    clip_delta,
    kl_coef,
    kl_est,
    kl_bias,
    entropy_coef,
    sapo_tau_pos,
    sapo_tau_neg,
):
    # (g, h) of the tokens at offs (one row index, or a block of them; inb: which exist):
    # g_t = c_t dL_t/dlogp_t (_token_terms' derivative) and h_t = dloss/dH_t = -c_t c_H, what
    # the gradient sweep of a row needs. An uncounted token (c_t = 0) gets g = 0 exactly, even
    # where its logp is NaN (0 * NaN); a counted one with a NaN logp (a NaN / +inf logit in its
    # row) gets g = NaN, so its row's gradient is NaN (the clamp's derivative would give g = 0,
    # and g = h = 0 writes zeros).
    c = tl.load(weight_ptr + offs, mask=inb, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=inb, other=0.0)
    old = logp
    if has_old != 0:
        old = _load_logp(old_ptr, offs, inb)
    ref = logp
    if kl_est >= 0:
        ref = _load_logp(ref_ptr, offs, inb)
    is_weight = tl.zeros_like(c) + 1.0
    if has_is != 0:
        is_weight = tl.load(is_weight_ptr + offs, mask=inb, other=1.0)
    _, dloss, _, _, _ = _token_terms(
        logp, adv, old, ref, is_weight, policy, ratio_lo, ratio_hi, has_dual, clip_dual,
        clip_delta, kl_coef, kl_est, kl_bias, sapo_tau_pos, sapo_tau_neg,
    )  # fmt: skip
    g = c * dloss
    g = tl.where(c != 0.0, tl.where(logp != logp, float("nan"), g), 0.0)
    return g, -c * entropy_coef


@triton.jit(do_not_specialize=SWITCHES)  # one binary for every option (a 1 is not a constant)
def _token_grads_fwd_kernel(
    logp_ptr,  # (N,) fp32: logp_t (from the statistics kernel)
    weight_ptr,  # (N,) fp32: c_t = dloss / dL_t (0 where the mask is 0)
    adv_ptr,  # (N,) fp32: A_t
    old_ptr,  # (N,) fp32: old_logp (read only when has_old)
    ref_ptr,  # (N,) fp32: ref_logp (read only when kl_est >= 0)
    is_weight_ptr,  # (N,) fp32: rollout IS weight w_t, detached (read only when has_is)
    g_ptr,  # (N,) fp32 out: g_t = dloss / dlogp_t
    h_ptr,  # (N,) fp32 out: h_t = dloss / dH_t = -c_t entropy_coef
    N,
    has_old,  # 0: pi_old = pi (r = 1)
    has_is,  # 0: w_t = 1
    policy,  # POLICY_CODES
    ratio_lo,  # 1 - clip_low
    ratio_hi,  # 1 + clip_high
    has_dual,  # 0: no dual clip
    clip_dual,
    clip_delta,  # +inf: none
    kl_coef,
    kl_est,  # KL_CODES; -1: no KL term
    kl_bias,  # 1: kl * r (token-level bias correction)
    entropy_coef,
    sapo_tau_pos,
    sapo_tau_neg,
    BLOCK: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK),): between the statistics kernel and the gradient kernel of a
    # token-separable loss, every token's (g_t, h_t) in one launch (the per-token autograd of
    # fastrl/terms.py takes dozens of small launches on a GPU).
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    logp = tl.load(logp_ptr + offs, mask=inb, other=0.0)
    g, h = _token_grads(
        offs, inb, logp, weight_ptr, adv_ptr, old_ptr, ref_ptr, is_weight_ptr, has_old, has_is,
        policy, ratio_lo, ratio_hi, has_dual, clip_dual, clip_delta, kl_coef, kl_est, kl_bias,
        entropy_coef, sapo_tau_pos, sapo_tau_neg,
    )  # fmt: skip
    tl.store(g_ptr + offs, g, mask=inb)
    tl.store(h_ptr + offs, h, mask=inb)


@triton.jit(do_not_specialize=SWITCHES)  # one binary for every option (a 1 is not a constant)
def _policy_terms_fwd_kernel(
    logp_ptr,  # (N,) fp32: logp_t
    entropy_ptr,  # (N,) fp32: H_t
    mask_ptr,  # (N,) fp32: m_t (a token counts where m_t > 0)
    weight_ptr,  # (N,) fp32: c_t = dloss / dL_t (0 where the mask is 0)
    adv_ptr,  # (N,) fp32: A_t
    old_ptr,  # (N,) fp32: old_logp (read only when has_old)
    ref_ptr,  # (N,) fp32: ref_logp (read only when kl_est >= 0)
    is_weight_ptr,  # (N,) fp32: rollout IS weight w_t, detached (read only when has_is)
    kl_ptr,  # (N,) fp32 out: kl_t (0 without ref_logp)
    ratio_ptr,  # (N,) fp32 out: r_t where the token counts, 1 elsewhere
    sums_ptr,  # (G, N_SUMS) fp32 out: this program's partial sums, in the order of SUMS
    max_ptr,  # (G,) fp32 out: the largest counted r_t of this program (-inf: none; NaN: a NaN)
    N,
    has_old,  # 0: pi_old = pi (r = 1)
    has_is,  # 0: w_t = 1
    policy,  # POLICY_CODES
    ratio_lo,  # 1 - clip_low
    ratio_hi,  # 1 + clip_high
    has_dual,  # 0: no dual clip
    clip_dual,
    clip_delta,  # +inf: none
    kl_coef,
    kl_est,  # KL_CODES; -1: no ref_logp
    kl_bias,  # 1: kl * r (token-level bias correction)
    entropy_coef,
    sapo_tau_pos,
    sapo_tau_neg,
    BLOCK: tl.constexpr,
):
    # Grid (cdiv(N, BLOCK),): program p takes tokens p BLOCK ... (p + 1) BLOCK - 1 and writes
    # row p of the partial sums (fixed order: the same inputs give the same bits every call).
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    logp = tl.load(logp_ptr + offs, mask=inb, other=0.0)
    entropy = tl.load(entropy_ptr + offs, mask=inb, other=0.0)
    m = tl.load(mask_ptr + offs, mask=inb, other=0.0)
    c = tl.load(weight_ptr + offs, mask=inb, other=0.0)
    adv = tl.load(adv_ptr + offs, mask=inb, other=0.0)
    old = logp
    if has_old != 0:
        old = _load_logp(old_ptr, offs, inb)
    ref = logp
    if kl_est >= 0:
        ref = _load_logp(ref_ptr, offs, inb)
    is_weight = tl.zeros_like(logp) + 1.0  # (0 * logp: NaN at logp = -inf)
    if has_is != 0:
        is_weight = tl.load(is_weight_ptr + offs, mask=inb, other=1.0)
    loss, _, r, kl, dual = _token_terms(
        logp, adv, old, ref, is_weight, policy, ratio_lo, ratio_hi, has_dual, clip_dual,
        clip_delta, kl_coef, kl_est, kl_bias, sapo_tau_pos, sapo_tau_neg,
    )  # fmt: skip
    loss = tl.where(entropy_coef != 0.0, loss - entropy_coef * entropy, loss)
    counted = m > 0.0  # false beyond N (m = 0 there)
    tl.store(kl_ptr + offs, kl, mask=inb)
    tl.store(ratio_ptr + offs, tl.where(counted, r, 1.0), mask=inb)
    high = tl.where((adv > 0.0) & (r > ratio_hi), 1.0, 0.0)
    low = tl.where((adv < 0.0) & (r < ratio_lo), 1.0, 0.0)
    out = sums_ptr + pid.to(tl.int64) * _N_SUMS
    tl.store(out + 0, tl.sum(tl.where(counted, c * loss, 0.0), axis=0))
    tl.store(out + 1, tl.sum(m, axis=0))
    tl.store(out + 2, _masked_total(high + low, m, counted))
    tl.store(out + 3, _masked_total(low, m, counted))
    tl.store(out + 4, _masked_total(high, m, counted))
    tl.store(out + 5, _masked_total(dual, m, counted))
    tl.store(out + 6, _masked_total(old - logp, m, counted))
    tl.store(out + 7, _masked_total(kl, m, counted))
    tl.store(out + 8, _masked_total(entropy, m, counted))
    tl.store(out + 9, _masked_total(r, m, counted))
    top = tl.max(tl.where(counted, r, float("-inf")), axis=0)
    any_nan = tl.sum(tl.where(counted & (r != r), 1, 0), axis=0) > 0
    tl.store(max_ptr + pid, tl.where(any_nan, float("nan"), top))


# --------------------------------------------------------------------------- launch
def switch_args(terms, with_kl: bool) -> tuple:
    """The loss's runtime switches and constants as the kernels take them, in their order (has_old
    ... sapo_tau_neg: SWITCHES and the floats between them), from a fastrl.terms.TokenGradTerms;
    with_kl: whether the KL term (or metric) is formed (kl_est = -1 otherwise)."""
    return (
        int(terms.old_logp is not None), int(terms.is_weight is not None),
        POLICY_CODES[terms.policy], 1.0 - terms.clip_low, 1.0 + terms.clip_high,
        int(terms.clip_dual is not None), 0.0 if terms.clip_dual is None else terms.clip_dual,
        float("inf") if terms.clip_delta is None else terms.clip_delta, terms.kl_coef,
        KL_CODES[terms.kl_estimator if with_kl else None], int(terms.kl_bias_correction),
        terms.entropy_coef, terms.sapo_tau_pos, terms.sapo_tau_neg,
    )  # fmt: skip


@functools.lru_cache(maxsize=64)
def policy_terms_configs(N: int) -> tuple[LaunchConfig, ...]:
    """The launch of `policy_terms` on N tokens: one program per _TERMS_BLOCK tokens (at least
    one). Example arguments: contiguous fp32 inputs, a ppo loss with every per-token input."""
    names = ("logp_ptr", "entropy_ptr", "mask_ptr", "weight_ptr", "adv_ptr", "old_ptr",
             "ref_ptr", "is_weight_ptr", "kl_ptr", "ratio_ptr", "sums_ptr", "max_ptr")  # fmt: skip
    args = {
        **{k: Ptr(_F32) for k in names}, "N": N, "has_old": 1, "has_is": 1, "policy": 0,
        "ratio_lo": 0.8, "ratio_hi": 1.2, "has_dual": 1, "clip_dual": 3.0,
        "clip_delta": float("inf"), "kl_coef": 0.04, "kl_est": 3, "kl_bias": 0,
        "entropy_coef": 0.01, "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05,
    }  # fmt: skip
    grid = (max(1, cdiv(N, _TERMS_BLOCK)),)
    return (
        config(_policy_terms_fwd_kernel, grid, 4, args, BLOCK=_TERMS_BLOCK, options=EXACT_PRODUCTS),
    )


def policy_terms(logp, entropy, mask, terms):
    """The per-token terms and the reductions of a token-separable loss, on the device.

    logp, entropy, mask: fp32 (N,) contiguous; terms: a fastrl.terms.TokenGradTerms of the same
    N tokens (weights c_t = dloss / dL_t, 0 where the mask is 0, advantages, old / ref log-probs
    (ref_logp: whenever given, for the kl metric, also with kl_coef = 0), rollout IS weight, the
    loss's constants).
    Returns (kl (N,), ratio (N,) with 1 where the token does not count, totals (len(SUMS),) in
    the order of SUMS: the loss sum_t c_t L_t, the count sum_t m_t and the masked sums, and the
    largest counted ratio: -inf when nothing counts, NaN when a counted ratio is NaN), fp32."""
    N = logp.numel()
    dev = logp.device
    kl, ratio = torch.empty(N, dtype=_F32, device=dev), torch.empty(N, dtype=_F32, device=dev)
    (cfg,) = policy_terms_configs(N)
    G = cfg.grid[0]
    sums = torch.empty((G, len(SUMS)), dtype=_F32, device=dev)
    top = torch.empty(G, dtype=_F32, device=dev)
    if N == 0:  # nothing counts: every sum is 0 and the max is -inf
        sums.zero_()
        top.fill_(float("-inf"))
        return kl, ratio, sums[0], top[0]
    with_kl = terms.ref_logp is not None
    per_token = (terms.old_logp, terms.ref_logp, terms.is_weight)
    old, ref, is_weight = (logp if t is None else t for t in per_token)  # logp: never read
    cfg(
        logp, entropy, mask, terms.weight, terms.advantages, old, ref, is_weight, kl, ratio, sums, top,
        N, *switch_args(terms, with_kl),
    )  # fmt: skip
    if G == 1:
        return kl, ratio, sums[0], top[0]
    return kl, ratio, sums.sum(0), top.amax()


@functools.lru_cache(maxsize=64)
def token_grads_configs(N: int) -> tuple[LaunchConfig, ...]:
    """The launch of `token_grads` on N tokens: one program per _TERMS_BLOCK tokens (at least
    one). Example arguments: contiguous fp32 inputs, a ppo loss with every per-token input."""
    names = ("logp_ptr", "weight_ptr", "adv_ptr", "old_ptr", "ref_ptr", "is_weight_ptr", "g_ptr",
             "h_ptr")  # fmt: skip
    args = {
        **{k: Ptr(_F32) for k in names}, "N": N, "has_old": 1, "has_is": 1, "policy": 0,
        "ratio_lo": 0.8, "ratio_hi": 1.2, "has_dual": 1, "clip_dual": 3.0,
        "clip_delta": float("inf"), "kl_coef": 0.04, "kl_est": 3, "kl_bias": 0,
        "entropy_coef": 0.01, "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05,
    }  # fmt: skip
    grid = (max(1, cdiv(N, _TERMS_BLOCK)),)
    return (
        config(_token_grads_fwd_kernel, grid, 4, args, BLOCK=_TERMS_BLOCK, options=EXACT_PRODUCTS),
    )


def token_grads(logp, terms):
    """(g, h) fp32 (N,): g_t = dloss / dlogp_t and h_t = dloss / dH_t = -c_t entropy_coef of a
    token-separable loss, from logp fp32 (N,) contiguous and `terms` (a
    fastrl.terms.TokenGradTerms of the same N tokens), in one launch: what the gradient kernel
    of the logits needs (the one-pass kernel forms the same values inside its row programs)."""
    N = logp.numel()
    g, h = (
        torch.empty(N, dtype=_F32, device=logp.device),
        torch.empty(N, dtype=_F32, device=logp.device),
    )
    if N == 0:
        return g, h
    (cfg,) = token_grads_configs(N)
    with_kl = terms.kl_coef != 0 and terms.ref_logp is not None
    per_token = (terms.old_logp, terms.ref_logp if with_kl else None, terms.is_weight)
    old, ref, is_weight = (logp if t is None else t for t in per_token)  # logp: never read
    cfg(
        logp, terms.weight, terms.advantages, old, ref, is_weight, g, h, N,
        *switch_args(terms, with_kl),
    )  # fmt: skip
    return g, h
