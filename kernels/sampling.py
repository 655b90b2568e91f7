"""One-pass Gumbel-max sampler (SPEC 10): token, its log-prob and the row's entropy.

For a row z (V,) and z' = z / τ, one sweep over the vocabulary in blocks of BLOCK_V carries,
relative to the running max m (online, rescaled when m grows: policy_loss._lse_merge),
    m = max z',  s = Σ e^(z' - m),  w = Σ e^(z' - m)·(z' - m)
and a running argmax of z'_j + G_j, with G_j = -log(E_j) Gumbel noise, E_j = -log(1 - U_j)
~ Exp(1) and U_j uniform from Philox keyed by (seed, row·V + j): counter-based, so the same
seed gives the same tokens whatever the launch configuration (one program per row or split-V).
At the end
    lse = m + log s,   logp_y = (z'_y - m) - log s,   H = lse - Σ p z' = log s - w / s,
max-shifted, so that H has no cancellation at large logit offsets or low temperature (both of
its terms are >= 0). Entries equal to -inf (a truncated top-k / top-p support) get probability 0
and never win. A row holding a NaN logit gives logp = H = NaN (its token is the argmax over the
other entries: some value in [0, V)). GREEDY skips the noise (argmax of z').

Two launch shapes (`_split_config` of policy_loss decides; `split_chunk` forces it):
  * `_sample_fwd_kernel`, grid (N,): one program sweeps its whole row;
  * split-V for few rows and a large V (decode): `_sample_split_fwd_kernel`, grid (N, SPLITS),
    reduces slices of CHUNK columns to partials (m, s, w, best key, its index and z') in fp32 /
    int64 scratch (N, SPLITS), then `_sample_merge_fwd_kernel`, grid (N,), merges them (log-sum-exp
    merge; the best key, the earliest slice on ties) and writes the same outputs. The noise of
    (row, j) does not depend on the split, so both give the same token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .policy_loss import _lse_merge, _split_config


@triton.jit
def _sample_slice(
    row_ptr,
    stride_lv,
    seed,
    row,
    V,
    lo,
    hi,
    inv_temperature,
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Columns lo <= j < hi of one row, BLOCK_V at a time -> (m, s, w, n_nan, best_key, best_idx,
    # best_z): the statistics of _lse_merge over z'_j (NaN logits counted in n_nan, then treated
    # as -inf), and the first maximum of key_j = z'_j + G_j (z'_j if GREEDY) with its z'.
    NEG_INF: tl.constexpr = float("-inf")
    m = tl.full((), NEG_INF, tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    w = tl.zeros((), dtype=tl.float32)
    n_nan = tl.zeros((), dtype=tl.int32)
    best_key = tl.full((), NEG_INF, tl.float32)  # running max of z' + G
    best_idx = tl.zeros((), dtype=tl.int64)  # its column (0 while every key is -inf)
    best_z = tl.full((), NEG_INF, tl.float32)  # z' of the running winner
    for start in range(lo, hi, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        inside = cols < hi
        z = tl.load(row_ptr + cols.to(tl.int64) * stride_lv, mask=inside, other=NEG_INF)
        z = z.to(tl.float32) * inv_temperature
        is_nan = z != z
        n_nan += tl.sum(is_nan.to(tl.int32), 0)
        z = tl.where(is_nan, NEG_INF, z)
        m, s, w = _lse_merge(m, s, w, z, 1.0, 0.0)
        if GREEDY:
            key = z
        else:
            bits = tl.randint(seed, row * V + cols.to(tl.int64))  # uint32
            u = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # U in (0, 1]
            # E = -log(1 - U) ~ Exp(1); a series where 1 - U would lose the small values
            expo = tl.where(u < 1e-4, u + 0.5 * u * u, -tl.log(1.0 - u))
            key = z - tl.log(expo)
        key = tl.where(inside & (z > NEG_INF), key, NEG_INF)
        blk_best = tl.max(key, 0)
        blk_idx = tl.argmax(key, 0)  # first maximum in the block
        blk_z = tl.sum(tl.where(tl.arange(0, BLOCK_V) == blk_idx, z, 0.0), 0)
        better = blk_best > best_key  # strict: the earliest block wins ties
        best_key = tl.where(better, blk_best, best_key)
        best_idx = tl.where(better, start + blk_idx.to(tl.int64), best_idx)
        best_z = tl.where(better, blk_z, best_z)
    return m, s, w, n_nan, best_key, best_idx, best_z


@triton.jit
def _sample_store(tokens_ptr, logp_ptr, entropy_ptr, row, m, s, w, n_nan, best_idx, best_z):
    # token = best_idx, logp = (z'_y - m) - log s, H = log s - w / s; logp = H = NaN for a row
    # with a NaN logit.
    log_s = tl.log(s)
    bad = n_nan > 0
    tl.store(tokens_ptr + row, best_idx.to(tl.int64))
    tl.store(logp_ptr + row, tl.where(bad, float("nan"), (best_z - m) - log_s))
    tl.store(entropy_ptr + row, tl.where(bad, float("nan"), log_s - w / s))


@triton.jit
def _sample_fwd_kernel(
    logits_ptr,  # (N, V) any float
    seed_ptr,  # (1,) int64: Philox key
    tokens_ptr,  # (N,) int64 out
    logp_ptr,  # (N,) fp32 out
    entropy_ptr,  # (N,) fp32 out
    V,
    stride_ln,
    stride_lv,
    inv_temperature,
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # grid (N,): program `row` sweeps columns [0, V) of its row (_sample_slice), then writes
    # token, logp and H (_sample_store).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    seed = tl.load(seed_ptr)
    m, s, w, n_nan, best_key, best_idx, best_z = _sample_slice(
        row_ptr, stride_lv, seed, row, V, 0, V, inv_temperature, GREEDY, BLOCK_V
    )
    _sample_store(tokens_ptr, logp_ptr, entropy_ptr, row, m, s, w, n_nan, best_idx, best_z)


@triton.jit
def _sample_split_fwd_kernel(
    logits_ptr,  # (N, V) any float
    seed_ptr,  # (1,) int64: Philox key
    part_m_ptr,  # (N, SPLITS) fp32 out: max z' of the slice
    part_s_ptr,  # (N, SPLITS) fp32 out: Σ e^(z' - m) of the slice; NaN if it holds a NaN logit
    part_w_ptr,  # (N, SPLITS) fp32 out: Σ e^(z' - m)·(z' - m) of the slice
    part_key_ptr,  # (N, SPLITS) fp32 out: max of z' + G over the slice
    part_idx_ptr,  # (N, SPLITS) int64 out: its column (first maximum)
    part_z_ptr,  # (N, SPLITS) fp32 out: its z'
    V,
    CHUNK,  # columns per slice (the last one may be shorter)
    SPLITS,
    stride_ln,
    stride_lv,
    inv_temperature,
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # split-V stage 1, grid (N, SPLITS): program (row, k) reduces the columns
    # k·CHUNK <= j < min((k + 1)·CHUNK, V) to its partials (same per-column noise as the
    # one-program kernel: Philox counter row·V + j).
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    seed = tl.load(seed_ptr)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    m, s, w, n_nan, best_key, best_idx, best_z = _sample_slice(
        row_ptr, stride_lv, seed, row, V, lo, hi, inv_temperature, GREEDY, BLOCK_V
    )
    out = row * SPLITS + split
    tl.store(part_m_ptr + out, m)
    tl.store(part_s_ptr + out, tl.where(n_nan > 0, float("nan"), s))
    tl.store(part_w_ptr + out, w)
    tl.store(part_key_ptr + out, best_key)
    tl.store(part_idx_ptr + out, best_idx)
    tl.store(part_z_ptr + out, best_z)


@triton.jit
def _sample_merge_fwd_kernel(
    part_m_ptr,  # (N, SPLITS) fp32: partials of _sample_split_fwd_kernel
    part_s_ptr,  # (N, SPLITS) fp32
    part_w_ptr,  # (N, SPLITS) fp32
    part_key_ptr,  # (N, SPLITS) fp32
    part_idx_ptr,  # (N, SPLITS) int64
    part_z_ptr,  # (N, SPLITS) fp32
    tokens_ptr,  # (N,) int64 out
    logp_ptr,  # (N,) fp32 out
    entropy_ptr,  # (N,) fp32 out
    SPLITS,
    BLOCK_S: tl.constexpr,
):
    # split-V stage 2, grid (N,): merge a row's SPLITS partials, BLOCK_S at a time: (m, s, w) by
    # the log-sum-exp merge (_lse_merge; a NaN s_k marks a NaN logit), the token as the largest
    # key (the earliest slice on ties, as the one-program sweep), then _sample_store.
    NEG_INF: tl.constexpr = float("-inf")
    row = tl.program_id(0).to(tl.int64)
    base = row * SPLITS
    m = tl.full((), NEG_INF, tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    w = tl.zeros((), dtype=tl.float32)
    n_nan = tl.zeros((), dtype=tl.int32)
    best_key = tl.full((), NEG_INF, tl.float32)
    best_k = base  # flat index of the winning partial (int64)
    ks = tl.arange(0, BLOCK_S)
    for start in range(0, SPLITS, BLOCK_S):
        k = start + ks
        valid = k < SPLITS
        part_m = tl.load(part_m_ptr + base + k, mask=valid, other=NEG_INF)
        part_s = tl.load(part_s_ptr + base + k, mask=valid, other=0.0)
        part_w = tl.load(part_w_ptr + base + k, mask=valid, other=0.0)
        is_nan = part_s != part_s
        n_nan += tl.sum(is_nan.to(tl.int32), 0)
        part_m = tl.where(is_nan, NEG_INF, part_m)  # counted, then an empty partial
        part_s = tl.where(is_nan, 0.0, part_s)
        m, s, w = _lse_merge(m, s, w, part_m, part_s, part_w)
        key = tl.load(part_key_ptr + base + k, mask=valid, other=NEG_INF)
        blk_best = tl.max(key, 0)
        blk_k = tl.argmax(key, 0)  # first maximum: the earliest slice
        better = blk_best > best_key
        best_key = tl.where(better, blk_best, best_key)
        best_k = tl.where(better, base + start + blk_k.to(tl.int64), best_k)
    best_idx = tl.load(part_idx_ptr + best_k)
    best_z = tl.load(part_z_ptr + best_k)
    _sample_store(tokens_ptr, logp_ptr, entropy_ptr, row, m, s, w, n_nan, best_idx, best_z)


def sample_rows(
    logits: torch.Tensor,
    seed: torch.Tensor,
    temperature: float,
    greedy: bool,
    *,
    split_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample every row. logits (N, V) any float, any strides; seed (1,) int64 on the logits'
    device. Returns tokens (N,) int64, logp (N,) fp32, entropy (N,) fp32.

    One program per row, or split-V for few rows and a large V (policy_loss._split_config;
    `split_chunk` forces it: 0 = one program per row, k > 0 = slices of k columns). Both give
    the same tokens for the same seed, and logp / entropy equal to fp32 rounding."""
    N, V = logits.shape
    dev = logits.device
    tokens = torch.empty(N, dtype=torch.int64, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    entropy = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return tokens, logp, entropy
    BLOCK_V = min(4096, triton.next_power_of_2(V))
    inv_temperature = 1.0 if greedy else 1.0 / temperature
    splits, chunk = _split_config(N, V, BLOCK_V, dev, split_chunk)
    if splits == 1:
        _sample_fwd_kernel[(N,)](
            logits, seed, tokens, logp, entropy, V,
            logits.stride(0), logits.stride(1), inv_temperature,
            GREEDY=greedy, BLOCK_V=BLOCK_V, num_warps=8 if BLOCK_V >= 2048 else 4,
        )  # fmt: skip
        return tokens, logp, entropy
    BLOCK_V = min(BLOCK_V, max(16, triton.next_power_of_2(chunk)))
    part = torch.empty((5, N, splits), dtype=torch.float32, device=dev)  # m, s, w, key, z'
    part_idx = torch.empty((N, splits), dtype=torch.int64, device=dev)
    _sample_split_fwd_kernel[(N, splits)](
        logits, seed, part[0], part[1], part[2], part[3], part_idx, part[4], V, chunk, splits,
        logits.stride(0), logits.stride(1), inv_temperature,
        GREEDY=greedy, BLOCK_V=BLOCK_V, num_warps=8 if BLOCK_V >= 2048 else 4,
    )  # fmt: skip
    BLOCK_S = min(1024, triton.next_power_of_2(splits))
    _sample_merge_fwd_kernel[(N,)](
        part[0], part[1], part[2], part[3], part_idx, part[4], tokens, logp, entropy, splits,
        BLOCK_S=BLOCK_S, num_warps=1 if BLOCK_S <= 256 else 4,
    )  # fmt: skip
    return tokens, logp, entropy
