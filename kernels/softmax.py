"""Online softmax statistics and the split-V launch heuristic, shared by the policy-loss kernels
(policy_loss.py) and the sampler (sampling.py).

Notation of SPEC.md: a row is the logits z (length V) of one token, z' = z / tau. Over any set of
columns, relative to its max m (all fp32):
    s = sum_j exp(z'_j - m),   w = sum_j exp(z'_j - m) * (z'_j - m)     (every term of w <= 0)
and from the whole row's (m, s, w):
    lse = m + log s,   H = lse - sum_j p_j z'_j = log s - w / s,   logp_y = (z'_y - m) - log s
max-shifted, so H has no cancellation at large logit offsets or low temperature. A -inf logit
(a masked vocabulary entry) contributes 0; a NaN logit makes its row NaN, whatever the NaN
semantics of max on the hardware (the row sweep lets it into s).

`@triton.jit` helpers (inlined into the kernels that call them), then host helpers:
  * `_row_stats_sweep` (with `_row_block_stats`, `_row_stats_finish`, `_exp2`, `_log2`: _ftz): a row's
    (m, s, w), BLOCK_V logits at a time into per-column accumulators, one cross-thread max per
    block (the policy-loss kernels; the sampler keeps its statistics per group of 8 columns
    instead, with _exp2 / _log2, and merges them with _lse_merge);
  * `_lse_merge`: log-sum-exp merge of a block of partial (m, s, w) into running scalars;
  * `_lse_init`: the statistics of no terms (the split-V merge kernels start from it);
  * `_lse_store_partials`, `_lse_merge_partials`: split-V stage 1 writes a slice's partials,
    stage 2 merges a row's partials (a NaN s_k marks a slice that held a NaN logit);
  * `_lse_finish`: (log s, lse, H) of a row, NaN where it held a NaN logit;
  * host: `_sm_count`, `_split_config` (how many programs share a row), `_merge_config`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .launch import cdiv, next_power_of_2


@triton.jit
def _lse_merge(m, s, w, part_m, part_s, part_w):
    # Log-sum-exp merge of a block of partial statistics into the running ones (scalars):
    #   running (m, s, w): s = sum exp(z' - m), w = sum exp(z' - m) * (z' - m) over the terms seen;
    #   part_* (BLOCK,) fp32: the same statistics of disjoint sets of terms (a single logit z'_j
    #   is the partial (z'_j, 1, 0)); part_m = -inf is an empty partial (contributes 0).
    # With m_new = max(m, max part_m) and a_k = exp(m_k - m_new) (0 for an empty set):
    #   s <- sum_k a_k s_k,   w <- sum_k a_k (w_k + s_k (m_k - m_new))
    # Every term of w has the sign of (z' - m_new) <= 0: no cancellation. A +inf partial max
    # gives inf - inf = NaN (a +inf logit makes its row NaN); NaN partials are handled by callers.
    m_new = tl.maximum(m, tl.max(part_m, axis=0))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: keep s = w = 0
    old = m > float("-inf")
    # m - m_new overflows to -inf for finite logits near -+3.4e38; clamped to the lowest finite
    # fp32 (-3.4028234663852886e38) so that a = 0 multiplies a finite number (0 * -inf would be
    # NaN), as the torch path does
    # A set whose scale a underflows to 0 adds exactly 0: its s * d can still overflow to -inf
    # (s > 1 terms at d near -3.4e38), and 0 * -inf would be NaN
    d = tl.maximum(tl.where(old, m - m_safe, 0.0), -3.4028234663852886e38)
    a = tl.where(old, tl.exp(d), 0.0)
    w = tl.where(a > 0.0, a * (w + s * d), 0.0)
    s = a * s
    live = part_m > float("-inf")
    part_d = tl.maximum(tl.where(live, part_m - m_safe, 0.0), -3.4028234663852886e38)
    part_a = tl.where(live, tl.exp(part_d), 0.0)
    s += tl.sum(part_a * part_s, axis=0)
    w += tl.sum(tl.where(part_a > 0.0, part_a * (part_w + part_s * part_d), 0.0), axis=0)
    return m_new, s, w


@triton.jit
def _lse_init():
    # The statistics of no terms: (m, s, w, n_nan) = (-inf, 0, 0, 0), fp32 / int32 scalars.
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    w = tl.zeros((), dtype=tl.float32)
    n_nan = tl.zeros((), dtype=tl.int32)
    return m, s, w, n_nan


# --------------------------------------------------------------------------- a row, swept in blocks
_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = 2^(x log2 e)
_LN2 = tl.constexpr(0.6931471805599453)  # log x = log2(x) ln 2
_MIN_F32 = tl.constexpr(-3.4028234663852886e38)  # the lowest finite fp32


@triton.jit
def _interpret_probe():
    pass


# Whether triton runs these kernels in its interpreter (TRITON_INTERPRET=1, read by triton when it
# decorated them): numpy there, no inline PTX.
_INTERPRET = tl.constexpr(not isinstance(_interpret_probe, triton.runtime.JITFunction))


@triton.jit
def _exp2(x):
    # 2^x of fp32 x, element-wise (_ftz: results below 2^-126 are 0)
    return _ftz(x, "ex2.approx.ftz.f32 $0, $1;", True)


@triton.jit
def _log2(x):
    # log2 of fp32 x > 0, element-wise (_ftz: inputs below 2^-126 give -inf)
    return _ftz(x, "lg2.approx.ftz.f32 $0, $1;", False)


@triton.jit
def _ftz(x, ASM: tl.constexpr, EXP2: tl.constexpr):
    # Compiled: the one MUFU instruction of ASM (ex2 / lg2 .approx.ftz.f32). tl.exp2 / tl.log2
    # emit the non-ftz .approx.f32 forms, which ptxas expands with a compare and two predicated
    # multiplies (or a multiply and an add) per element so as to return / take denormals (below
    # 2^-126 = 1.2e-38); here those flush to 0: a probability below 1.2e-38 becomes 0 (its
    # gradient entry too, which the interpreter and the torch path keep as a denormal): nothing
    # next to the row's sums (>= 1) or to any gradient entry a bf16 / fp16 row holds at normal
    # range. The sampler's noise never takes the log of a denormal. The approximation is the one
    # tl.exp2 / tl.log2 use.
    # Interpreted: numpy's exp2 (EXP2) / log2, denormals kept.
    if _INTERPRET:
        if EXP2:
            return tl.exp2(x)
        else:
            return tl.log2(x)
    else:
        return tl.inline_asm_elementwise(ASM, "=f,f", [x], dtype=tl.float32, is_pure=True, pack=1)


@triton.jit
def _row_block_stats(z, m, s_acc, w_acc, k):
    # Fold a block z (BLOCK,) fp32 of raw logits (masked-out columns -inf) into the running
    # statistics of its row: a scalar m = max of the raw z so far and per-column accumulators
    # s_acc, w_acc (BLOCK,) with, over the blocks seen,
    #     s_acc = sum exp(c (z - m)),   w_acc = sum exp(c (z - m)) (z - m)       (c = 1 / tau)
    # k = c log2 e, so that exp(c (z - m)) = 2^((z - m) k). The only cross-thread step per block
    # is its max; when it raises m (a few blocks per row) the accumulators are rescaled:
    #     a = exp(c (m_old - m)),   w_acc <- a (w_acc + s_acc (m_old - m)),   s_acc <- a s_acc
    # (from m_old = -inf: a = 0 on accumulators that are 0). Per logit: a max, a subtract, a clamp,
    # a multiply, an exp2, and three adds / multiplies into s_acc and w_acc.
    # -inf logits contribute 0 (z - m is clamped to the lowest finite fp32 first, so that
    # exp * (z - m) is 0 * finite, not 0 * -inf). A NaN logit, or a +inf one (inf - inf), makes
    # its column's s_acc NaN, hence the row's s, lse and H (the clamp propagates NaN; the block
    # max may or may not, which changes nothing: s is NaN either way).
    m_new = tl.maximum(m, tl.max(z, axis=0))
    if m_new > m:
        d_m = tl.maximum(m - m_new, _MIN_F32)
        a = _exp2(d_m * k)
        w_acc = a * (w_acc + s_acc * d_m)
        s_acc = a * s_acc
        m = m_new
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # all -inf so far: z - 0 = -inf, exp = 0
    d = tl.maximum(z - m_safe, _MIN_F32, propagate_nan=tl.PropagateNan.ALL)
    e = _exp2(d * k)
    return m, s_acc + e, w_acc + e * d


@triton.jit
def _row_stats_sweep(row_ptr, lo, hi, inv_temp, BLOCK_V: tl.constexpr):
    # The statistics of z' = c z (c = inv_temp > 0) over the columns lo <= j < hi of one row
    # (pointer row_ptr, fp32 / bf16 / fp16, stride 1), read BLOCK_V at a time: whole blocks
    # without a mask, then the masked rest. Returns (m, s, w, n_nan) as _lse_finish and
    # _lse_store_partials take them: m = max z' = c max z (rounding is monotonic for c > 0),
    # s = sum exp(z' - m), w = c sum exp(z' - m) (z - max z) = sum exp(z' - m) (z' - m) up to
    # rounding; n_nan = 0 (a NaN or +inf logit makes s NaN instead: _row_block_stats).
    cols = tl.arange(0, BLOCK_V)
    k = inv_temp * _LOG2E
    m = tl.full((), float("-inf"), tl.float32)
    s_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    w_acc = tl.zeros([BLOCK_V], dtype=tl.float32)
    whole = lo + (hi - lo) // BLOCK_V * BLOCK_V
    for start in range(lo, whole, BLOCK_V):
        z = tl.load(row_ptr + start + cols).to(tl.float32)
        m, s_acc, w_acc = _row_block_stats(z, m, s_acc, w_acc, k)
    if whole < hi:
        offs = whole + cols
        z = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32)
        m, s_acc, w_acc = _row_block_stats(z, m, s_acc, w_acc, k)
    return _row_stats_finish(m, s_acc, w_acc, inv_temp)


@triton.jit
def _row_stats_finish(m, s_acc, w_acc, inv_temp):
    # (m, s, w, n_nan) in z' = c z units from the raw running max m and the per-column sums of
    # _row_block_stats (c = inv_temp): m' = c m, s = sum s_acc, w = c sum w_acc, n_nan = 0.
    s = tl.sum(s_acc, axis=0)
    w = tl.sum(w_acc, axis=0) * inv_temp
    return m * inv_temp, s, w, tl.zeros((), dtype=tl.int32)


@triton.jit
def _lse_store_partials(part_m_ptr, part_s_ptr, part_w_ptr, out, m, s, w, n_nan):
    # split-V stage 1: a slice's partials at flat index `out` of the (N, SPLITS) fp32 scratch;
    # s is stored as NaN when the slice held a NaN logit (the marker _lse_merge_partials reads).
    tl.store(part_m_ptr + out, m)
    tl.store(part_s_ptr + out, tl.where(n_nan > 0, float("nan"), s))
    tl.store(part_w_ptr + out, w)


@triton.jit
def _lse_merge_partials(m, s, w, n_nan, part_m_ptr, part_s_ptr, part_w_ptr, offs, valid):
    # split-V stage 2: merge the partials at flat indices `offs` (BLOCK_S,) (where `valid`) into
    # the running statistics; a NaN s_k is counted in n_nan, then merged as an empty partial.
    part_m = tl.load(part_m_ptr + offs, mask=valid, other=float("-inf"))
    part_s = tl.load(part_s_ptr + offs, mask=valid, other=0.0)
    part_w = tl.load(part_w_ptr + offs, mask=valid, other=0.0)
    is_nan = part_s != part_s
    n_nan += tl.sum(is_nan.to(tl.int32), axis=0)
    part_m = tl.where(is_nan, float("-inf"), part_m)
    part_s = tl.where(is_nan, 0.0, part_s)
    m, s, w = _lse_merge(m, s, w, part_m, part_s, part_w)
    return m, s, w, n_nan


@triton.jit
def _lse_finish(m, s, w, n_nan):
    # A whole row's (log s, lse = m + log s, H = log s - w / s); lse and H are NaN when the row
    # held a NaN logit (log s is returned as is: callers form logp = (z'_y - m) - log s).
    log_s = tl.log(s)
    bad = n_nan > 0
    lse = tl.where(bad, float("nan"), m + log_s)
    entropy = tl.where(bad, float("nan"), log_s - w / s)
    return log_s, lse, entropy


# --------------------------------------------------------------------------- host helpers
_SPLIT_SM_COUNT = 132  # SMs assumed off CUDA (the interpreter, tests, AOT compiles): an H100 SXM
_SPLIT_MIN_CHUNK = 8192  # never fewer logits than this per split-V program
_SPLIT_WAVES = 4  # split-V aims at about this many programs per SM
_MAX_BLOCK_S = 1024  # partials merged per step by the stage-2 kernels


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (torch caches the properties: no sync);
    _SPLIT_SM_COUNT off CUDA."""
    if device.type != "cuda":
        return _SPLIT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_config(
    n_rows: int, V: int, block: int, device: torch.device | int, split_chunk: int | None = None
) -> tuple[int, int]:
    """(splits, chunk): how many programs share each row, each reducing `chunk` logits of it.

    `device`: the logits' device (its SM count, see _sm_count) or an SM count.
    One program per row (splits = 1) leaves most SMs idle at decode time (N of 1-64 rows) with a
    large V (up to 262144). Split V when there are fewer rows than 2 * SMs (132 SMs assumed off
    CUDA) and V >= 2 * _SPLIT_MIN_CHUNK: splits = min(V / _SPLIT_MIN_CHUNK, _SPLIT_WAVES * SMs /
    n_rows) (rounded up), chunk = V / splits rounded up to a multiple of `block` (whole BLOCK_V
    steps). E.g. on 132 SMs N = 1, V = 262144 -> 32 splits of 8192; N = 64, V = 151936 (bf16)
    -> 7 splits of 24576; N >= 264 -> one program per row.
    `split_chunk` forces the choice (tests): 0 -> one program per row, k > 0 -> slices of k.
    Not tuned on a GPU yet (none was available): the constants above are first guesses."""
    if split_chunk is not None:
        if split_chunk <= 0 or split_chunk >= V:
            return 1, V
        return cdiv(V, split_chunk), split_chunk
    sms = device if isinstance(device, int) else _sm_count(device)
    if n_rows >= 2 * sms or V < 2 * _SPLIT_MIN_CHUNK:
        return 1, V
    splits = min(cdiv(V, _SPLIT_MIN_CHUNK), cdiv(_SPLIT_WAVES * sms, n_rows))
    align = min(block, _SPLIT_MIN_CHUNK)  # whole BLOCK_V steps per slice
    chunk = cdiv(cdiv(V, splits), align) * align
    splits = cdiv(V, chunk)
    return (splits, chunk) if splits > 1 else (1, V)


def _merge_config(splits: int) -> tuple[int, int]:
    """(BLOCK_S, num_warps) of a split-V stage-2 kernel merging `splits` partials per row."""
    block_s = min(next_power_of_2(splits), _MAX_BLOCK_S)
    return block_s, 1 if block_s <= 256 else 4
