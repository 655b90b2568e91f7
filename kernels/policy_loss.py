"""Triton kernels of the fused policy loss: one streaming pass per logits row, and the gradient.

Notation of SPEC.md: a row is the logits z (length V) of one token, z' = z / tau, y the sampled
token, lse = logsumexp(z'), p_j = exp(z'_j - lse), logp = z'_y - lse, H = lse - sum_j p_j z'_j.

* `_token_stats_fwd_kernel` (one program per row) reads the row ONCE, in BLOCK_V chunks, with an
  online max / sum-exp / sum(exp * (z' - m)) (max-shifted, so H has no cancellation at large
  logit offsets or low temperature; softmax.py) and writes lse, logp and H (fp32, one value per
  row). The sums are kept per column (BLOCK_V accumulators, folded into one value at the row's
  end), so a block costs one cross-thread max, and the exponentials are single MUFU.EX2
  instructions (softmax._exp2): about 12 SASS instructions per logit on sm_90a against 30 when
  every block was reduced to scalars (benchmarks/kernel_report.py counts them).
* With SKIP_MASKED (the policy loss: `stats_and_grad_`'s `skip`), a row whose mask m_t is 0,
  which reaches neither the loss nor its gradient, is not read: its logp, H, lse, m and log s
  are stored as 0 (a masked row costs 20 bytes of stores instead of V logits read).
* split-V (`_token_stats_split_fwd_kernel` + `_token_stats_merge_fwd_kernel`): when there are few
  rows and a long vocabulary, SPLITS programs per row each reduce one slice of it to partial
  (max, sum-exp, sum exp * shift) and a merge kernel combines them exactly, so a small batch
  still fills the GPU.
* `_token_stats_bwd_kernel` (one program per row) reads the row a second time and writes
  SPEC 6's gradient
      dL/dz_j = (1/tau) * [ g * (1[j = y] - p_j) - h * p_j * (log p_j + H) ]
  with g = dL/dlogp and h = dL/dH of that row (from `policy_terms.token_grads` for a
  token-separable loss, else autograd of the O(N) per-token terms), p_j from the stored lse
  (or, HAS_SHIFT, from the stored m and log s: exp((z'_j - m) - log s), exact at any offset)
  and p_y from the stored logp (exact for a nearly one-hot row:
  `_row_grad_store`). A row with g = h = 0 (a masked token) writes zeros without reading its
  logits.
* `_policy_loss_fwd_kernel` (one program per row; FASTRL_ROWS_IN_FLIGHT makes the grid
  persistent, for measurements), only with FASTRL_ONE_PASS=1: for a token-separable loss
  (fastrl.terms.is_token_separable: the loss is sum_t c_t L_t(logp_t, H_t)) the two above in ONE
  program: the row's statistics, then g = c_t dL_t/dlogp_t and h = -c_t c_H
  (`policy_terms._token_grads`: SPEC 1-4's derivative with autograd's conventions), then the
  gradient sweep.
* `_scale_grad_kernel` (kernels/scale.py, re-exported here): grad *= the upstream gradient,
  skipped on the device when it is 1.

So the forward + backward of a token-separable loss runs, by default, the statistics kernel,
one O(N) kernel for every token's (g, h) (`policy_terms.token_grads`, the same
`_token_grads` the one-pass kernel inlines) and the gradient kernel: 2 reads + 1 write of the
logits. The one-pass kernel moves the same bytes on an H200 (its second sweep of a row comes
from HBM, not L2) and measured slower there (`one_pass_enabled`). Sequence-level options (GSPO
ratio, sequence IS weights) need every row's statistics before any g_t: the statistics kernel,
the O(N) torch math of the per-token terms (fastrl/terms.py), then the gradient kernel.

Temperature: every kernel that reads logits takes `inv_temp` (fp32 scalar, 1 / tau) and, with the
constexpr flag ROW_TEMP, reads each row's own 1 / tau_t from `inv_temp_ptr` (fp32 (B * T,)) instead:
per-token temperature, z'_tj = z_tj / tau_t, and every formula above with that row's tau_t. With
ROW_TEMP off the pointer is a dummy that is never read (the scalar path compiles as before).

Logits are addressed as (B, T, V) with arbitrary strides over B and T (e.g. a `logits[:, :-1]`
view is read in place, never copied); the V dimension must have stride 1 (the caller copies
otherwise). Row offsets are int64, so N * V > 2^31 is fine. An out-of-range token (y < 0 or
y >= V) gives logp = NaN for that row (never a silently wrong number). A -inf logit (a masked
vocabulary entry) has p = 0 and contributes 0 to H and to the gradient (p log p -> 0); a NaN or
+inf logit makes lse, logp and H of its row NaN (so the loss is NaN: never hidden).

Launchers below the kernels: `row_stats`, `row_grad_`, `scale_`, `stats_and_grad_` (the
backend-interface names the CPU backend uses too) and `policy_rows_`, each running the
LaunchConfigs of its `*_configs` function; autograd and backend dispatch live in fastrl/ops.py.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .launch import EXACT_PRODUCTS, LaunchConfig, Ptr, config, next_power_of_2
from .policy_terms import SWITCHES, _token_grads, switch_args, token_grads
from .scale import _scale_grad_kernel, scale_, scale_configs  # noqa: F401 (backend interface)
from .softmax import (
    _LOG2E,
    _SPLIT_SM_COUNT,
    _exp2,
    _lse_finish,
    _lse_init,
    _lse_merge_partials,
    _lse_store_partials,
    _merge_config,
    _row_stats_sweep,
    _sm_count,
    _split_config,
)


@triton.jit
def _row_ptr(base_ptr, row, T, stride_b, stride_t):
    # The first element of flat row `row` (int64) = (b, t) of a (B, T, V) tensor with strides
    # (stride_b, stride_t, 1): a strided view such as logits[:, :-1] is addressed in place.
    b = row // T
    return base_ptr + b * stride_b + (row - b * T) * stride_t


@triton.jit
def _row_inv_temp(inv_temp, inv_temp_ptr, row, ROW_TEMP: tl.constexpr):
    # 1 / tau of row `row`: its own 1 / tau_t from inv_temp_ptr with ROW_TEMP (a temperature
    # per token), else the scalar inv_temp (the pointer is then a dummy, never read).
    if ROW_TEMP:
        inv_temp = tl.load(inv_temp_ptr + row)
    return inv_temp


@triton.jit
def _token_stats_fwd_kernel(
    logits_ptr,  # (B, T, V) fp32 / bf16 / fp16, stride over V is 1
    tokens_ptr,  # (B * T,) int32 / int64, contiguous
    logp_ptr,  # (B * T,) fp32 out: z'_y - lse
    entropy_ptr,  # (B * T,) fp32 out: H = lse - sum_j p_j z'_j = log s - w / s
    lse_ptr,  # (B * T,) fp32 out: logsumexp(z') = m + log s
    shift_ptr,  # (B * T,) fp32 out: m = max_j z'_j (written only when STORE_SHIFT)
    log_s_ptr,  # (B * T,) fp32 out: log s (written only when STORE_SHIFT)
    T,
    V,
    stride_logits_b,
    stride_logits_t,
    inv_temp,  # fp32 scalar, 1 / tau (unused when ROW_TEMP)
    inv_temp_ptr,  # (B * T,) fp32: 1 / tau_t of each row (read only when ROW_TEMP)
    mask_ptr,  # (B * T,) fp32: the loss's mask m_t (read only when SKIP_MASKED)
    ROW_TEMP: tl.constexpr,  # per-row temperature: inv_temp = inv_temp_ptr[row]
    STORE_SHIFT: tl.constexpr,  # also write m and log s, for an exact gradient kernel
    SKIP_MASKED: tl.constexpr,  # a row with m_t = 0 is not read: its outputs are 0
    BLOCK_V: tl.constexpr,
):
    # one program per row (grid (B * T,)): one online pass over the whole row keeps, relative
    # to the running max m,  s = sum_j exp(z'_j - m)  and  w = sum_j exp(z'_j - m) * (z'_j - m)
    # (_row_stats_sweep), so that H = log s - w / s has no cancellation (both terms >= 0)
    # whatever the offset of the logits or the temperature. With STORE_SHIFT, m and log s
    # themselves: the gradient kernel then forms log p_j = (z'_j - m) - log s, exact at any
    # offset (from lse, rounded at |lse|'s scale, an entry is ~6e-8 |lse| off).
    # With SKIP_MASKED a masked row (m_t = 0: it reaches neither the loss nor its gradient)
    # costs five stores (logp, H, lse, m, log s) instead of a pass over its V logits.
    row = tl.program_id(0).to(tl.int64)
    if _row_counted(mask_ptr, row, SKIP_MASKED):
        row_ptr = _row_ptr(logits_ptr, row, T, stride_logits_b, stride_logits_t)
        inv_temp = _row_inv_temp(inv_temp, inv_temp_ptr, row, ROW_TEMP)
        m, s, w, n_nan = _row_stats_sweep(row_ptr, 0, V, inv_temp, BLOCK_V)
        _row_outputs_store(
            row_ptr, tokens_ptr, logp_ptr, entropy_ptr, lse_ptr, shift_ptr, log_s_ptr, row, V,
            inv_temp, m, s, w, n_nan, STORE_SHIFT,
        )  # fmt: skip
    else:
        _masked_row_store(logp_ptr, entropy_ptr, lse_ptr, shift_ptr, log_s_ptr, row, STORE_SHIFT)


@triton.jit
def _row_outputs_store(row_ptr, tokens_ptr, logp_ptr, entropy_ptr, lse_ptr, shift_ptr, log_s_ptr,
                       row, V, inv_temp, m, s, w, n_nan, STORE_SHIFT: tl.constexpr):  # fmt: skip
    # A read row's outputs from its (m, s, w, n_nan): logp, H and lse (_token_stats_store), and
    # with STORE_SHIFT its m and log s.
    _, _, _, log_s = _token_stats_store(
        row_ptr, tokens_ptr, logp_ptr, entropy_ptr, lse_ptr, row, V, inv_temp, m, s, w, n_nan
    )
    if STORE_SHIFT:
        tl.store(shift_ptr + row, m)
        tl.store(log_s_ptr + row, log_s)


@triton.jit
def _row_counted(mask_ptr, row, SKIP_MASKED: tl.constexpr):
    # Whether row `row` is read: always, or with SKIP_MASKED only where its mask m_t > 0.
    counted = True
    if SKIP_MASKED:
        counted = tl.load(mask_ptr + row) > 0.0  # (as `x.mask > 0`: counted)
    return counted


@triton.jit
def _masked_row_store(logp_ptr, entropy_ptr, lse_ptr, shift_ptr, log_s_ptr, row,
                      STORE_SHIFT: tl.constexpr):  # fmt: skip
    # The outputs of a row that SKIP_MASKED does not read: logp = H = lse (= m + log s) = 0. Its
    # g = h = 0 (c_t = 0), so the gradient kernel writes its zeros without reading the logits.
    tl.store(logp_ptr + row, 0.0)
    tl.store(entropy_ptr + row, 0.0)
    tl.store(lse_ptr + row, 0.0)
    if STORE_SHIFT:
        tl.store(shift_ptr + row, 0.0)
        tl.store(log_s_ptr + row, 0.0)


@triton.jit
def _token_stats_store(
    row_ptr, tokens_ptr, logp_ptr, entropy_ptr, lse_ptr, row, V, inv_temp, m, s, w, n_nan
):
    # From a row's merged (m, s, w, n_nan): lse = m + log s, H = log s - w / s and
    # logp = z'_y - lse = (z'_y - m) - log s (max-shifted: exact at large offsets; NaN for y
    # outside [0, V)); all three NaN when the row holds a NaN logit. Also returns log s (NaN
    # there too), for a gradient formed in the same program from (z' - m) - log s.
    log_s, lse, entropy = _lse_finish(m, s, w, n_nan)
    y = tl.load(tokens_ptr + row).to(tl.int64)
    y_ok = (y >= 0) & (y < V)
    z_y = tl.load(row_ptr + y, mask=y_ok, other=0.0).to(tl.float32) * inv_temp
    logp = tl.where(y_ok & (n_nan == 0), (z_y - m) - log_s, float("nan"))
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)
    return logp, lse, entropy, tl.where(n_nan > 0, float("nan"), log_s)


@triton.jit
def _token_stats_split_fwd_kernel(
    logits_ptr,  # (B, T, V) fp32 / bf16 / fp16, stride over V is 1
    part_m_ptr,  # (B * T, SPLITS) fp32 out: max of z' over the slice
    part_s_ptr,  # (B * T, SPLITS) fp32 out: sum exp(z' - m) over the slice; NaN if it has a NaN
    part_w_ptr,  # (B * T, SPLITS) fp32 out: sum exp(z' - m) (z' - m) over the slice
    T,
    V,
    CHUNK,  # columns per slice (the last slice may be shorter)
    SPLITS,  # slices per row
    stride_logits_b,
    stride_logits_t,
    inv_temp,  # fp32 scalar, 1 / tau (unused when ROW_TEMP)
    inv_temp_ptr,  # (B * T,) fp32: 1 / tau_t of each row (read only when ROW_TEMP)
    mask_ptr,  # (B * T,) fp32: the loss's mask m_t (read only when SKIP_MASKED)
    ROW_TEMP: tl.constexpr,  # per-row temperature: inv_temp = inv_temp_ptr[row]
    SKIP_MASKED: tl.constexpr,  # a row with m_t = 0 is not read (nor its partials written)
    BLOCK_V: tl.constexpr,
):
    # split-V stage 1, grid (B * T, SPLITS): program (row, k) reduces the slice
    # k * CHUNK <= j < min((k + 1) * CHUNK, V) of its row to the partial (m_k, s_k, w_k) of
    # _row_stats_sweep; _token_stats_merge_fwd_kernel combines them per row.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    if _row_counted(mask_ptr, row, SKIP_MASKED):
        row_ptr = _row_ptr(logits_ptr, row, T, stride_logits_b, stride_logits_t)
        inv_temp = _row_inv_temp(inv_temp, inv_temp_ptr, row, ROW_TEMP)
        lo = split * CHUNK
        hi = tl.minimum(lo + CHUNK, V)
        m, s, w, n_nan = _row_stats_sweep(row_ptr, lo, hi, inv_temp, BLOCK_V)
        _lse_store_partials(
            part_m_ptr, part_s_ptr, part_w_ptr, row * SPLITS + split, m, s, w, n_nan
        )


@triton.jit
def _token_stats_merge_fwd_kernel(
    logits_ptr,  # (B, T, V) fp32 / bf16 / fp16, stride over V is 1 (only z_y is read)
    tokens_ptr,  # (B * T,) int32 / int64, contiguous
    part_m_ptr,  # (B * T, SPLITS) fp32: partials of _token_stats_split_fwd_kernel
    part_s_ptr,  # (B * T, SPLITS) fp32
    part_w_ptr,  # (B * T, SPLITS) fp32
    logp_ptr,  # (B * T,) fp32 out: z'_y - lse
    entropy_ptr,  # (B * T,) fp32 out: log s - w / s
    lse_ptr,  # (B * T,) fp32 out: m + log s
    shift_ptr,  # (B * T,) fp32 out: m (written only when STORE_SHIFT)
    log_s_ptr,  # (B * T,) fp32 out: log s (written only when STORE_SHIFT)
    T,
    V,
    SPLITS,
    stride_logits_b,
    stride_logits_t,
    inv_temp,  # fp32 scalar, 1 / tau (unused when ROW_TEMP)
    inv_temp_ptr,  # (B * T,) fp32: 1 / tau_t of each row (read only when ROW_TEMP)
    mask_ptr,  # (B * T,) fp32: the loss's mask m_t (read only when SKIP_MASKED)
    ROW_TEMP: tl.constexpr,  # per-row temperature: inv_temp = inv_temp_ptr[row]
    STORE_SHIFT: tl.constexpr,  # also write m and log s (as _token_stats_fwd_kernel)
    SKIP_MASKED: tl.constexpr,  # a row with m_t = 0: every output 0, its partials not read
    BLOCK_S: tl.constexpr,
):
    # split-V stage 2, grid (B * T,): the log-sum-exp merge (softmax._lse_merge_partials) of a
    # row's SPLITS partials, BLOCK_S at a time, then the outputs of _token_stats_fwd_kernel
    # (the partials are already in z' units; inv_temp scales z_y only).
    row = tl.program_id(0).to(tl.int64)
    if _row_counted(mask_ptr, row, SKIP_MASKED):
        row_ptr = _row_ptr(logits_ptr, row, T, stride_logits_b, stride_logits_t)
        inv_temp = _row_inv_temp(inv_temp, inv_temp_ptr, row, ROW_TEMP)
        m, s, w, n_nan = _lse_init()
        ks = tl.arange(0, BLOCK_S)
        for start in range(0, SPLITS, BLOCK_S):
            k = start + ks
            m, s, w, n_nan = _lse_merge_partials(
                m, s, w, n_nan, part_m_ptr, part_s_ptr, part_w_ptr, row * SPLITS + k, k < SPLITS
            )
        _row_outputs_store(
            row_ptr, tokens_ptr, logp_ptr, entropy_ptr, lse_ptr, shift_ptr, log_s_ptr, row, V,
            inv_temp, m, s, w, n_nan, STORE_SHIFT,
        )  # fmt: skip
    else:
        _masked_row_store(logp_ptr, entropy_ptr, lse_ptr, shift_ptr, log_s_ptr, row, STORE_SHIFT)


@triton.jit
def _token_stats_bwd_kernel(
    logits_ptr,  # (B, T, V) fp32 / bf16 / fp16, stride over V is 1
    tokens_ptr,  # (B * T,) int32 / int64, contiguous
    logp_ptr,  # (B * T,) fp32: the forward's logp = (z'_y - m) - log s
    lse_ptr,  # (B * T,) fp32
    entropy_ptr,  # (B * T,) fp32
    grad_logp_ptr,  # (B * T,) fp32: g = dL/dlogp
    grad_entropy_ptr,  # (B * T,) fp32: h = dL/dH (unused unless HAS_GRAD_ENTROPY)
    grad_ptr,  # (B, T, V) out, dtype of the logits; may be the logits' own storage
    shift_ptr,  # (B * T,) fp32: the statistics kernel's m (read only when HAS_SHIFT)
    log_s_ptr,  # (B * T,) fp32: its log s (read only when HAS_SHIFT)
    T,
    V,
    stride_logits_b,
    stride_logits_t,
    stride_grad_b,
    stride_grad_t,
    inv_temp,  # fp32 scalar, 1 / tau (unused when ROW_TEMP)
    inv_temp_ptr,  # (B * T,) fp32: 1 / tau_t of each row (read only when ROW_TEMP)
    ROW_TEMP: tl.constexpr,  # per-row temperature: inv_temp = inv_temp_ptr[row]
    HAS_GRAD_ENTROPY: tl.constexpr,
    HAS_SHIFT: tl.constexpr,  # log p_j = (z'_j - m) - log s (exact), not z'_j - lse
    BLOCK_V: tl.constexpr,
):
    # one program per row (grid (B * T,)): dL/dz_j = (1/tau) [g (1[j = y] - p_j)
    # - h p_j (log p_j + H)] with log p_j = z'_j - lse (the forward's logp at j = y),
    # BLOCK_V columns at a time (tau = tau_t, the row's own temperature, with ROW_TEMP; lse
    # and H were computed with it).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = _row_ptr(logits_ptr, row, T, stride_logits_b, stride_logits_t)
    out_ptr = _row_ptr(grad_ptr, row, T, stride_grad_b, stride_grad_t)
    g = tl.load(grad_logp_ptr + row)
    if HAS_GRAD_ENTROPY:
        h = tl.load(grad_entropy_ptr + row)
    else:
        h = g * 0.0
    logp = tl.load(logp_ptr + row)
    lse = tl.load(lse_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    y = tl.load(tokens_ptr + row).to(tl.int64)
    inv_temp = _row_inv_temp(inv_temp, inv_temp_ptr, row, ROW_TEMP)
    shift, log_s = lse, 0.0
    if HAS_SHIFT:
        shift, log_s = tl.load(shift_ptr + row), tl.load(log_s_ptr + row)
    _row_grad_store(
        row_ptr, out_ptr, V, y, logp, shift, log_s, entropy, g, h, inv_temp, HAS_GRAD_ENTROPY,
        BLOCK_V,
    )  # fmt: skip


@triton.jit
def _row_grad_store(
    row_ptr,
    out_ptr,
    V,
    y,
    logp,
    shift,
    log_s,
    entropy,
    g,
    h,
    inv_temp,
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # SPEC 6 for one row into out_ptr: dL/dz_j = (1/tau) [g (1[j = y] - p_j) - h p_j (log p_j
    # + H)], BLOCK_V columns at a time. g = h = 0 (a masked token) writes zeros without reading
    # the logits. log p_j = (z'_j - shift) - log_s: the one-pass kernel passes (m, log s), the
    # row max and log of its sum, so p_j is max-shifted and exact at any logit offset; a
    # gradient kernel with only the stored lse = m + log s passes (lse, 0), whose rounding at
    # |lse|'s scale costs p_j about 6e-8 |lse| (README "Precision"). Except at j = y: that
    # entry is formed once per row from the row's logp = (z'_y - m) - log s, as the forward
    # formed it. With the stored lse, z'_y - lse is off by about eps |lse| (eps = 2^-24), all
    # of which lands in 1 - p_y: in a nearly one-hot row (1 - p_y ~ 1e-4, |lse| ~ 30) about 2 %
    # of the entry. From logp, the error of 1 - p_y is that of torch's own log_softmax backward
    # (about eps). (A scalar before the loop, not a select of logp inside it: that kept one more
    # value live per element and made triton 3.6 spill at BLOCK_V >= 4096 with the entropy term.)
    cols = tl.arange(0, BLOCK_V)
    whole = V // BLOCK_V * BLOCK_V  # whole blocks (no mask), then the masked rest
    if (g == 0.0) & (h == 0.0):
        _zero_row_store(out_ptr, V, BLOCK_V)
    else:
        p_y = tl.exp(logp)
        d_y = g * (1.0 - p_y)
        if HAS_GRAD_ENTROPY:
            d_y -= h * p_y * tl.where(p_y > 0.0, logp + entropy, 0.0)
        d_y = d_y * inv_temp
        gc = -g * inv_temp  # d_j = (1/tau)(-g p_j - h p_j (log p_j + H)) = p_j (gc - hc (...))
        hc = h * inv_temp
        y_col = tl.where((y >= 0) & (y < V), y, -1).to(tl.int32)  # in [0, V), or -1: none
        for start in range(0, whole, BLOCK_V):
            z = tl.load(row_ptr + start + cols).to(tl.float32)
            d = _grad_block(z, inv_temp, shift, log_s, entropy, gc, hc, HAS_GRAD_ENTROPY)
            if (y_col >= start) & (y_col < start + BLOCK_V):  # the block holding column y
                d = tl.where(start + cols == y_col, d_y, d)
            tl.store(out_ptr + start + cols, d.to(out_ptr.dtype.element_ty))
        if whole < V:
            offs = whole + cols
            valid = offs < V
            z = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32)
            d = _grad_block(z, inv_temp, shift, log_s, entropy, gc, hc, HAS_GRAD_ENTROPY)
            d = tl.where(offs == y_col, d_y, d)
            tl.store(out_ptr + offs, d.to(out_ptr.dtype.element_ty), mask=valid)


@triton.jit
def _zero_row_store(out_ptr, V, BLOCK_V: tl.constexpr):
    # out_ptr[0:V] = 0 (a row whose gradient is 0: nothing of it is read)
    cols = tl.arange(0, BLOCK_V)
    whole = V // BLOCK_V * BLOCK_V  # whole blocks (no mask), then the masked rest
    zeros = tl.zeros([BLOCK_V], dtype=tl.float32).to(out_ptr.dtype.element_ty)
    for start in range(0, whole, BLOCK_V):
        tl.store(out_ptr + start + cols, zeros)
    if whole < V:
        tl.store(out_ptr + whole + cols, zeros, mask=whole + cols < V)


@triton.jit
def _grad_block(z, inv_temp, shift, log_s, entropy, gc, hc, HAS_GRAD_ENTROPY: tl.constexpr):
    # SPEC 6 for a block of raw logits z (BLOCK,) fp32 of a row, column y aside:
    # log p = (z / tau - shift) - log_s, p = 2^(log p log2 e), and
    # d = p gc (gc = -g / tau), or with the entropy term d = p (gc - hc (log p + H))
    # (hc = h / tau), := 0 where p = 0 (a -inf logit has no entropy gradient).
    log_p = (z * inv_temp - shift) - log_s
    p = _exp2(log_p * _LOG2E)
    if HAS_GRAD_ENTROPY:
        return p * (gc - hc * tl.where(p > 0.0, log_p + entropy, 0.0))
    else:
        return p * gc


@triton.jit(do_not_specialize=SWITCHES)  # one binary for every option (a 1 is not a constant)
def _policy_loss_fwd_kernel(
    logits_ptr,  # (B, T, V) fp32 / bf16 / fp16, stride over V is 1
    tokens_ptr,  # (B * T,) int32 / int64, contiguous
    logp_ptr,  # (B * T,) fp32 out: z'_y - lse
    entropy_ptr,  # (B * T,) fp32 out: H
    lse_ptr,  # (B * T,) fp32 out: logsumexp(z')
    grad_ptr,  # (B, T, V) out, dtype of the logits; may be the logits' own storage
    weight_ptr,  # (B * T,) fp32: c_t = dloss / dL_t (0 where the mask is 0)
    adv_ptr,  # (B * T,) fp32: A_t
    old_ptr,  # (B * T,) fp32: old_logp (read only when has_old)
    ref_ptr,  # (B * T,) fp32: ref_logp (read only when kl_est >= 0)
    is_weight_ptr,  # (B * T,) fp32: rollout IS weight w_t, detached (read only when has_is)
    mask_ptr,  # (B * T,) fp32: the mask m_t; a row with m_t = 0 is not read (outputs 0)
    N,  # rows, B * T
    T,
    V,
    stride_logits_b,
    stride_logits_t,
    stride_grad_b,
    stride_grad_t,
    inv_temp,  # fp32 scalar, 1 / tau (unused when ROW_TEMP)
    inv_temp_ptr,  # (B * T,) fp32: 1 / tau_t of each row (read only when ROW_TEMP)
    has_old,  # 0: pi_old = pi (on-policy: r = 1, the gradient of logp)
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
    ROW_TEMP: tl.constexpr,  # per-row temperature: inv_temp = inv_temp_ptr[row]
    HAS_GRAD_ENTROPY: tl.constexpr,  # entropy_coef != 0: h = -c_t entropy_coef
    BLOCK_V: tl.constexpr,
):
    # A token-separable policy loss with each row in ONE program: the row's statistics
    # (_row_stats_sweep), then g = c_t dL_t/dlogp_t (policy_terms._token_terms) and h = -c_t c_H,
    # then SPEC 6's gradient (_row_grad_store): one launch, no per-row statistics stored for a
    # second kernel and no O(N) autograd between them. Grid (G,): program p takes rows p, p + G,
    # ... (G = N by default, `_rows_in_flight`: a persistent grid small enough for the second
    # sweep to hit L2 starved HBM of bytes in flight on an H200).
    # A masked row (m_t = 0) is not read: its outputs and its gradient row are zeros.
    for row in range(tl.program_id(0).to(tl.int64), N, tl.num_programs(0)):
        out_ptr = _row_ptr(grad_ptr, row, T, stride_grad_b, stride_grad_t)
        if _row_counted(mask_ptr, row, True):
            row_ptr = _row_ptr(logits_ptr, row, T, stride_logits_b, stride_logits_t)
            inv_temp = _row_inv_temp(inv_temp, inv_temp_ptr, row, ROW_TEMP)
            m, s, w, n_nan = _row_stats_sweep(row_ptr, 0, V, inv_temp, BLOCK_V)
            logp, lse, entropy, log_s = _token_stats_store(
                row_ptr, tokens_ptr, logp_ptr, entropy_ptr, lse_ptr, row, V, inv_temp, m, s, w,
                n_nan,
            )  # fmt: skip
            g, h = _token_grads(
                row, row < N, logp, weight_ptr, adv_ptr, old_ptr, ref_ptr, is_weight_ptr,
                has_old, has_is, policy, ratio_lo, ratio_hi, has_dual, clip_dual, clip_delta,
                kl_coef, kl_est, kl_bias, entropy_coef, sapo_tau_pos, sapo_tau_neg,
            )  # fmt: skip
            y = tl.load(tokens_ptr + row).to(tl.int64)
            _row_grad_store(
                row_ptr, out_ptr, V, y, logp, m, log_s, entropy, g, h, inv_temp,
                HAS_GRAD_ENTROPY, BLOCK_V,
            )  # fmt: skip
        else:
            _masked_row_store(logp_ptr, entropy_ptr, lse_ptr, lse_ptr, lse_ptr, row, False)
            _zero_row_store(out_ptr, V, BLOCK_V)


# --------------------------------------------------------------------------- launch configurations
_F32 = torch.float32


def _launch_config(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of a sweep that folds each block of a row into running row
    statistics in split-V's first stage and the one-pass kernel (the statistics kernel with one
    program per row takes `_stats_launch_config`, measured since): blocks of 2048 elements, 2
    warps (32 elements a thread), blocks of 1 warp for short rows.

    Chosen on an H200 (benchmarks/results/bench_kernel_configs_cuda.json; N = 16384 bf16 rows,
    V = 151936) for the sweep of before 2026-11-27, which reduced every block to scalars (four
    block-wide reductions per block): the one-pass kernel took 4.57 ms at (2048, 2), 4.61 at
    (4096, 4), 4.89 at (8192, 16); the statistics kernel 2.41 ms at (2048, 2), 2.45 at (4096,
    4), 3.29 at (8192, 16) (1.40 ms is a bare read of the logits). The sweep of today
    (softmax._row_stats_sweep: per-column sums, one block max) issues about 11-12 SASS
    instructions per logit instead of 30 at these blocks (kernel_report.py); it holds two fp32
    sums per logit a thread owns, so its registers grow with BLOCK_V / (32 warps): 128 at
    (2048, 2) for the statistics kernel. Its best block has not been measured yet (the
    kernel-configs stage of benchmarks/run_all.py sweeps 8 to 32 logits a thread). Heuristic,
    not autotuned (autotuning would re-run the in-place backward); fp32 rows (not measured)
    take the same blocks."""
    block = min(max(next_power_of_2(V), 32), 2048)  # >= 32: no size-1 blocks
    return block, 1 if block <= 256 else 2


def _stats_launch_config(V: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the statistics kernel with one program per row: blocks of 1024
    elements and 1 warp (32 logits a thread, as (2048, 2)). Measured on an H200
    (bench_kernel_configs_cuda.json, commit c0e7779, N = 16384 bf16 rows): 1.347 ms at V =
    151936 (0.96x a bare read of the logits, 1.400 ms) and 0.307 at V = 32000, against 1.425 and
    0.337 at (2048, 2), 1.49-1.52 / 0.35-0.37 at (2048, 4) and (4096, 4), more at larger blocks.
    Split-V's stage 1 and the one-pass kernel keep `_launch_config`."""
    return min(max(next_power_of_2(V), 32), 1024), 1


def _grad_launch_config(V: int, elem_size: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) of the gradient kernel, an element-wise sweep (no reduction): about
    16 KB of logits per block (8192 bf16 / fp16, 4096 fp32), 16 warps for the largest blocks.
    Measured on an H200 (bench_kernel_configs_cuda.json): 2.49 ms at N = 16384, V = 151936
    bf16, 93 % of a copy of the logits; every block size from 2048 to 16384 within 2 %."""
    max_block = 8192 if elem_size <= 2 else 4096
    block = min(max(next_power_of_2(V), 32), max_block)
    num_warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 4096 else 16
    return block, num_warps


def _partials_aligned(N: int, splits: int) -> bool:
    """Whether part[k] of an fp32 (3, N, splits) scratch starts on a 16-byte boundary."""
    return (N * splits * 4) % 16 == 0


def row_stats_configs(
    N: int,
    V: int,
    dtype: torch.dtype,
    device_sms: int = _SPLIT_SM_COUNT,
    split_chunk: int | None = None,
    *,
    tokens_dtype: torch.dtype = torch.int64,
    row_temp: bool = False,
    shift: bool = False,
    skip: bool = False,
) -> tuple[LaunchConfig, ...]:
    """The launches of `row_stats` for N rows of V logits of `dtype` on a device with
    `device_sms` SMs: (one program per row,) or (split-V stage 1, stage 2) (_split_config;
    `split_chunk` forces it as in row_stats); `row_temp`: a temperature per row (ROW_TEMP);
    `shift`: the kernel that writes lse also writes m and log s (STORE_SHIFT); `skip`: rows
    whose mask is 0 are not read (SKIP_MASKED). Example arguments: logits (1, N, V)
    contiguous."""
    block, _ = _launch_config(V)
    splits, chunk = _split_config(N, V, block, device_sms, split_chunk)  # not cached: tests spy
    flags = (bool(row_temp), bool(shift), bool(skip))
    return _row_stats_configs(N, V, dtype, tokens_dtype, splits, chunk, *flags)


@functools.lru_cache(maxsize=256)
def _row_stats_configs(
    N, V, dtype, tokens_dtype, splits, chunk, row_temp, shift=False, skip=False
) -> tuple[LaunchConfig, ...]:
    block, num_warps = _stats_launch_config(V)
    logits = {"logits_ptr": Ptr(dtype)}
    shape = {"T": N, "V": V}
    strides = {"stride_logits_b": N * V, "stride_logits_t": V}
    temp = {"inv_temp": 1.0, "inv_temp_ptr": Ptr(_F32), "mask_ptr": Ptr(_F32)}
    stats = {"logp_ptr": Ptr(_F32), "entropy_ptr": Ptr(_F32), "lse_ptr": Ptr(_F32)}
    tokens = {"tokens_ptr": Ptr(tokens_dtype)}
    shifts = {"shift_ptr": Ptr(_F32), "log_s_ptr": Ptr(_F32)}
    if splits == 1:
        args = {**logits, **tokens, **stats, **shifts, **shape, **strides, **temp}
        return (
            config(
                _token_stats_fwd_kernel,
                (N,),
                num_warps,
                args,
                ROW_TEMP=row_temp,
                STORE_SHIFT=shift,
                SKIP_MASKED=skip,
                BLOCK_V=block,
                options=EXACT_PRODUCTS,
            ),
        )
    block, _ = _launch_config(V)
    block, num_warps = _launch_config(min(chunk, block))
    aligned = _partials_aligned(N, splits)
    parts = {f"part_{k}_ptr": Ptr(_F32, aligned or k == "m") for k in "msw"}
    split_args = {**logits, **parts, **shape, "CHUNK": chunk, "SPLITS": splits, **strides, **temp}
    block_s, warps_s = _merge_config(splits)
    merge_args = {
        **logits, **tokens, **parts, **stats, **shifts, **shape, "SPLITS": splits, **strides,
        **temp,
    }  # fmt: skip
    return (
        config(
            _token_stats_split_fwd_kernel, (N, splits), num_warps, split_args, ROW_TEMP=row_temp,
            SKIP_MASKED=skip, BLOCK_V=block, options=EXACT_PRODUCTS,
        ),
        config(
            _token_stats_merge_fwd_kernel, (N,), warps_s, merge_args, ROW_TEMP=row_temp,
            STORE_SHIFT=shift, SKIP_MASKED=skip, BLOCK_S=block_s, options=EXACT_PRODUCTS,
        ),
    )  # fmt: skip


@functools.lru_cache(maxsize=256)
def row_grad_configs(
    N: int,
    V: int,
    dtype: torch.dtype,
    has_grad_entropy: bool,
    *,
    tokens_dtype: torch.dtype = torch.int64,
    row_temp: bool = False,
    has_shift: bool = False,
) -> tuple[LaunchConfig, ...]:
    """The launch of `row_grad_` for N rows of V logits of `dtype` (the gradient in the same
    dtype), with or without h = dL/dH, with a scalar or (`row_temp`) a per-row temperature,
    p_j from lse or (`has_shift`) from the statistics kernel's m and log s (HAS_SHIFT).
    Example arguments: logits and out (1, N, V) contiguous."""
    block, num_warps = _grad_launch_config(V, dtype.itemsize)
    args = {
        "logits_ptr": Ptr(dtype), "tokens_ptr": Ptr(tokens_dtype), "logp_ptr": Ptr(_F32),
        "lse_ptr": Ptr(_F32), "entropy_ptr": Ptr(_F32), "grad_logp_ptr": Ptr(_F32),
        "grad_entropy_ptr": Ptr(_F32),
        "grad_ptr": Ptr(dtype), "shift_ptr": Ptr(_F32), "log_s_ptr": Ptr(_F32), "T": N, "V": V,
        "stride_logits_b": N * V, "stride_logits_t": V, "stride_grad_b": N * V,
        "stride_grad_t": V, "inv_temp": 1.0, "inv_temp_ptr": Ptr(_F32),
    }  # fmt: skip
    flags = {
        "ROW_TEMP": bool(row_temp), "HAS_GRAD_ENTROPY": bool(has_grad_entropy),
        "HAS_SHIFT": bool(has_shift),
    }  # fmt: skip
    return (
        config(
            _token_stats_bwd_kernel,
            (N,),
            num_warps,
            args,
            **flags,
            BLOCK_V=block,
            options=EXACT_PRODUCTS,
        ),
    )


def _rows_in_flight(N: int) -> int:
    """Programs P of the one-pass kernel's grid, each looping over rows p, p + P, ...: one per
    row (P = N). Measured on an H200 (bench_kernel_configs_cuda.json, N = 16384 bf16): a
    persistent grid sized to keep the rows in flight within the L2 (P = 132, the plan of
    docs/DESIGN.md) took 8.5 ms at V = 151936 against 4.9 ms for a program per row, and every
    grid between (264, 1056) fell between them: too few bytes in flight to feed HBM cost more
    than the second sweep's L2 hits saved. FASTRL_ROWS_IN_FLIGHT=P forces P (0: one program per
    row), for measurements."""
    env = os.environ.get("FASTRL_ROWS_IN_FLIGHT")
    rows = N
    if env is not None:
        if not env.isdigit():
            raise ValueError(f"FASTRL_ROWS_IN_FLIGHT must be an int >= 0, got {env!r}")
        rows = int(env) or N
    return max(1, min(N, rows))


def policy_rows_configs(
    N: int,
    V: int,
    dtype: torch.dtype,
    has_grad_entropy: bool,
    *,
    tokens_dtype: torch.dtype = torch.int64,
    row_temp: bool = False,
) -> tuple[LaunchConfig, ...]:
    """The launch of `policy_rows_` (the one-pass kernel of a token-separable loss) for N rows
    of V logits of `dtype`, with or without an entropy bonus, a scalar or a per-row
    temperature: `_rows_in_flight` programs. Example arguments: logits and out (1, N, V)
    contiguous, a ppo loss with every per-token input."""
    grid = _rows_in_flight(N)
    return _policy_rows_configs(
        N, V, dtype, bool(has_grad_entropy), tokens_dtype, bool(row_temp), grid
    )


@functools.lru_cache(maxsize=256)
def _policy_rows_configs(N, V, dtype, has_grad_entropy, tokens_dtype, row_temp, grid):
    block, num_warps = _launch_config(V)
    if block == 2048:
        # 4 warps, not 2: 16 logits a thread. At 2 warps (32) the one-pass kernel holds 238-250
        # registers (triton 3.6 / 3.9, sm_90a): two programs per SM at most
        num_warps = 4
    rows = {k: Ptr(_F32) for k in ("logp_ptr", "entropy_ptr", "lse_ptr")}
    inputs = {
        k: Ptr(_F32)
        for k in ("weight_ptr", "adv_ptr", "old_ptr", "ref_ptr", "is_weight_ptr", "mask_ptr")
    }
    args = {
        "logits_ptr": Ptr(dtype), "tokens_ptr": Ptr(tokens_dtype), **rows, "grad_ptr": Ptr(dtype),
        **inputs, "N": N, "T": N, "V": V, "stride_logits_b": N * V, "stride_logits_t": V,
        "stride_grad_b": N * V, "stride_grad_t": V, "inv_temp": 1.0, "inv_temp_ptr": Ptr(_F32),
        "has_old": 1, "has_is": 1, "policy": 0, "ratio_lo": 0.8, "ratio_hi": 1.2, "has_dual": 1,
        "clip_dual": 3.0, "clip_delta": float("inf"), "kl_coef": 0.04, "kl_est": 3, "kl_bias": 0,
        "entropy_coef": 0.01, "sapo_tau_pos": 1.0, "sapo_tau_neg": 1.05,
    }  # fmt: skip
    flags = {"ROW_TEMP": row_temp, "HAS_GRAD_ENTROPY": has_grad_entropy}
    return (
        config(
            _policy_loss_fwd_kernel,
            (grid,),
            num_warps,
            args,
            **flags,
            BLOCK_V=block,
            options=EXACT_PRODUCTS,
        ),
    )


# --------------------------------------------------------------------------- launchers
def inv_temperature(temperature, N: int, device: torch.device):
    """(inv_temp, inv_temp_rows) of the kernels' temperature arguments: a float tau gives the fp32
    scalar 1 / tau and no rows (ROW_TEMP off); a tensor of N per-row temperatures (any shape with
    N elements, e.g. (B, T)) gives the scalar 1.0 and 1 / tau_t as a contiguous fp32 (N,) tensor
    on `device` (ROW_TEMP on). The values are the caller's to check (finite, > 0)."""
    if isinstance(temperature, torch.Tensor):
        tau = temperature.detach().to(device=device, dtype=torch.float32).reshape(N)
        return 1.0, torch.reciprocal(tau).contiguous()
    return 1.0 / float(temperature), None


def row_stats(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature,
    *,
    split_chunk: int | None = None,
    shift: bool = False,
    skip: torch.Tensor | None = None,
    entropy: bool = True,
):
    """lse, logp and entropy of every row in one pass.

    logits (B, T, V) with stride(-1) == 1 (any strides over B, T); tokens (B, T) int32/int64;
    temperature a float tau, or a tensor (B, T) of per-row temperatures tau_t (ROW_TEMP).
    Returns (logp, entropy, lse), each fp32 (B, T). Few rows with a large V (decode) run the
    split-V kernels (see _split_config; `split_chunk` forces the choice: 0 = one program per
    row, k > 0 = slices of k logits); both paths agree to fp32 rounding. With `shift`, returns
    (logp, entropy, lse, shifted): shifted = (m, log s) fp32 (B, T) of each row (lse = m +
    log s), for row_grad_'s exact p_j (None when N = 0). `skip`: None, or the loss's mask
    (B * T elements, any float dtype): a row whose mask is 0 is not read, and every output of it
    (logp, entropy, lse, m, log s) is 0. `entropy` (False: the caller needs no H) is not read:
    the kernels form H in the same sweep, at the logits' read rate."""
    del entropy
    B, T, V = logits.shape
    assert V == 1 or logits.stride(-1) == 1, "the V dimension of the logits must be contiguous"
    logp, entropy, lse = (
        torch.empty((B, T), dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    N = B * T
    done = (logp, entropy, lse)
    if N == 0:
        return (*done, None) if shift else done
    tokens = tokens.contiguous()
    inv_temp, inv_rows = inv_temperature(temperature, N, logits.device)
    cfgs = row_stats_configs(
        N, V, logits.dtype, _sm_count(logits.device), split_chunk, tokens_dtype=tokens.dtype,
        row_temp=inv_rows is not None, shift=shift, skip=skip is not None,
    )  # fmt: skip
    # (with a scalar temperature, `lse` stands in for the per-row pointer: never read; without
    # `shift`, it stands in for m and log s, never written; without `skip`, for the mask)
    mask = lse if skip is None else skip.detach().reshape(N).float().contiguous()
    temp = (inv_temp, lse if inv_rows is None else inv_rows, mask)
    strides = (logits.stride(0), logits.stride(1), *temp)
    shifted = (torch.empty_like(lse), torch.empty_like(lse)) if shift else (lse, lse)
    if len(cfgs) == 1:
        cfgs[0](logits, tokens, logp, entropy, lse, *shifted, T, V, *strides)
        return (*done, shifted) if shift else done
    split, merge = cfgs
    splits, chunk = split.arg("SPLITS"), split.arg("CHUNK")
    part = torch.empty((3, N, splits), dtype=torch.float32, device=logits.device)
    split(logits, part[0], part[1], part[2], T, V, chunk, splits, *strides)
    merge(
        logits, tokens, part[0], part[1], part[2], logp, entropy, lse, *shifted, T, V, splits,
        *strides,
    )  # fmt: skip
    return (*done, shifted) if shift else done


def row_grad_(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    logp: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    temperature,
    out: torch.Tensor,
    shifted: tuple[torch.Tensor, torch.Tensor] | None = None,
    skip: torch.Tensor | None = None,
) -> torch.Tensor:
    """Write dL/dz (SPEC 6) into `out` (B, T, V), which may be `logits` itself (in-place).

    logits (B, T, V); tokens, logp, lse, entropy (`row_stats`' outputs), grad_logp,
    grad_entropy (B, T) (fp32, the last two are g and h; grad_entropy None means h = 0);
    temperature a float tau or a (B, T) tensor of per-row tau_t (the one the statistics were
    computed with); shifted: None (p_j = exp(z'_j - lse)) or row_stats(shift=True)'s (m, log s)
    (p_j = exp((z'_j - m) - log s): exact at any offset of the logits; `lse` is then not read and
    may be None). `skip` (the mask given to row_stats, where g = h = 0) is not needed here: a
    row with g = h = 0 is written as zeros without being read. Returns `out`."""
    del skip
    B, T, V = logits.shape
    N = B * T
    if N == 0:
        return out
    assert out.shape == logits.shape and (V == 1 or out.stride(-1) == 1)
    tokens = tokens.contiguous()
    inv_temp, inv_rows = inv_temperature(temperature, N, logits.device)
    (cfg,) = row_grad_configs(
        N, V, logits.dtype, grad_entropy is not None, tokens_dtype=tokens.dtype,
        row_temp=inv_rows is not None, has_shift=shifted is not None,
    )  # fmt: skip
    g = grad_logp.float().contiguous()
    h = g if grad_entropy is None else grad_entropy.float().contiguous()
    m, log_s = (lse, lse) if shifted is None else (t.contiguous() for t in shifted)
    lse = m if lse is None else lse.contiguous()  # (with `shifted`: never read)
    cfg(
        logits, tokens, logp.contiguous(), lse, entropy.contiguous(), g, h, out, m, log_s, T, V,
        logits.stride(0), logits.stride(1), out.stride(0), out.stride(1), inv_temp,
        lse if inv_rows is None else inv_rows,
    )  # fmt: skip
    return out


def one_pass_enabled() -> bool:
    """Whether a token-separable loss takes the one-pass kernel (`policy_rows_`): only with the
    environment variable FASTRL_ONE_PASS=1 (the A/B of the benchmarks). By default (unset or
    0) it takes the statistics kernel, one O(N) kernel for every token's (g, h)
    (policy_terms.token_grads) and the gradient kernel: measured faster on an H200
    (benchmarks/results/bench_kernel_configs_cuda.json, commit c0e7779, N = 16384 bf16: the
    one-pass kernel 4.40-4.54 ms at V = 151936 against 1.35 + 2.45 for the statistics and
    gradient kernels, 0.90-0.93 at V = 32000 against 0.31 + 0.52; its second sweep of a row
    comes from HBM, not L2)."""
    value = os.environ.get("FASTRL_ONE_PASS", "0")
    if value not in ("0", "1"):
        raise ValueError(f"FASTRL_ONE_PASS must be 0 or 1, got {value!r}")
    return value == "1"


def policy_rows_(logits, tokens, temperature, terms, out, mask=None):
    """(logp, entropy) fp32 (B, T) of logits (B, T, V) and dL/dz written into `out` (B, T, V,
    may be `logits`) for the token-separable loss `terms` (a fastrl.terms.TokenGradTerms: per-token
    fp32 (B * T,) tensors and the loss's constants), in one program per row that reads
    the row for its statistics, forms g_t = c_t dL_t/dlogp_t and h_t = -c_t c_H, and sweeps the
    row again for the gradient (_policy_loss_fwd_kernel). temperature: a float, or a (B, T)
    tensor of per-row temperatures. mask: None (every row read), or the loss's mask (B * T
    elements): a row where it is 0 is not read (logp = H = 0, a zero gradient row)."""
    B, T, V = logits.shape
    N = B * T
    logp, entropy, lse = (torch.empty(N, dtype=torch.float32, device=logits.device) for _ in "lhs")
    if N == 0:
        return logp.view(B, T), entropy.view(B, T)
    assert out.shape == logits.shape and (V == 1 or out.stride(-1) == 1)
    tokens = tokens.contiguous()
    inv_temp, inv_rows = inv_temperature(temperature, N, logits.device)
    (cfg,) = policy_rows_configs(
        N, V, logits.dtype, terms.entropy_coef != 0, tokens_dtype=tokens.dtype,
        row_temp=inv_rows is not None,
    )  # fmt: skip
    with_kl = terms.kl_coef != 0 and terms.ref_logp is not None
    per_token = (terms.old_logp, terms.ref_logp if with_kl else None, terms.is_weight)
    old, ref, is_weight = (lse if t is None else t for t in per_token)  # lse: never read
    if mask is None:
        mask = torch.ones(N, dtype=torch.float32, device=logits.device)
    mask = mask.detach().reshape(N).float().contiguous()
    cfg(
        logits, tokens, logp, entropy, lse, out, terms.weight, terms.advantages, old, ref,
        is_weight, mask, N, T, V, logits.stride(0), logits.stride(1), out.stride(0), out.stride(1),
        inv_temp, lse if inv_rows is None else inv_rows, *switch_args(terms, with_kl),
    )  # fmt: skip
    return logp.view(B, T), entropy.view(B, T)


def stats_and_grad_(
    logits, tokens, temperature, grad_fn, out, rows_grads=None, row_terms=None, skip=None
):
    """fp32 (B, T) logp and H of logits (B, T, V), and dL/dz written into `out` (B, T, V, may be
    `logits`) from (g, h) = grad_fn(logp, H) (temperature: a float, or a (B, T) tensor of per-row
    temperatures). `row_terms`: None, or (for a token-separable loss) a function returning its
    fastrl.terms.TokenGradTerms (or None where it has none): then the statistics kernel (with
    each row's m and log s), (g, h) from one O(N) kernel (policy_terms.token_grads) and the
    gradient kernel (p_j from m and log s: exact at any offset); or, with FASTRL_ONE_PASS=1 and
    rows too many for split-V, one program per row does it all (`policy_rows_`). Otherwise (a
    sequence-level loss) the statistics kernel, g and h from grad_fn (O(N) torch), then the
    gradient kernel, with m and log s too. Either way the logits are read twice.
    `skip`: None, or the loss's mask (B * T elements): a row where it is 0 is not read (by either
    path), its logp and H are 0 and its gradient row zeros (grad_fn and row_terms must give it
    g = h = 0, as a mask of 0 does). `rows_grads` (the torch backend's one-pass hook) is not used
    here: the interface is the same as fastrl.chunked's."""
    B, T, V = logits.shape
    one_pass = one_pass_enabled()  # (a bad FASTRL_ONE_PASS is refused whatever the loss)
    terms = None if row_terms is None else row_terms()
    if terms is not None and one_pass:
        block, _ = _launch_config(V)
        if _split_config(B * T, V, block, logits.device)[0] == 1:
            return policy_rows_(logits, tokens, temperature, terms, out, skip)
    # m and log s too: p_j = exp((z'_j - m) - log s), exact at any offset, as in one pass
    logp, entropy, lse, shifted = row_stats(logits, tokens, temperature, shift=True, skip=skip)
    if terms is None:  # a sequence-level loss: (g, h) from the O(N) torch math
        g, h = grad_fn(logp, entropy)
    else:  # one O(N) kernel
        g, h = token_grads(logp.reshape(-1), terms)
        h = h if terms.entropy_coef != 0 else None  # (HAS_GRAD_ENTROPY off)
    row_grad_(logits, tokens, logp, lse, entropy, g, h, temperature, out, shifted)
    return logp, entropy
