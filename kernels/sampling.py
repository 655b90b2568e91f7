"""One-pass Gumbel-max sampler (SPEC 10): token, its log-prob and the row's entropy.

For a row z (V,) and z' = z / τ, one sweep over the vocabulary in blocks of BLOCK_V carries
    M = max z',  S = Σ e^(z' - M),  Q = Σ e^(z' - M)·z'      (online, rescaled when M grows)
and a running argmax of z'_j + G_j, with G_j = -log(E_j) Gumbel noise, E_j = -log(1 - U_j)
~ Exp(1) and U_j uniform from Philox keyed by (seed, row·V + j): counter-based, so the same
seed gives the same tokens whatever the launch configuration. At the end
    lse = M + log S,   logp_y = z'_y - lse,   H = lse - Q / S.
Entries equal to -inf (a truncated top-k / top-p support) get probability 0 and never win.
GREEDY skips the noise (argmax of z').
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


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
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    seed = tl.load(seed_ptr)
    NEG_INF: tl.constexpr = float("-inf")
    m = tl.full((), NEG_INF, tl.float32)  # running max of z'
    s = tl.zeros((), dtype=tl.float32)  # Σ e^(z' - m)
    q = tl.zeros((), dtype=tl.float32)  # Σ e^(z' - m) z'
    best_key = tl.full((), NEG_INF, tl.float32)  # running max of z' + G
    best_idx = tl.zeros((), dtype=tl.int64)
    best_z = tl.full((), NEG_INF, tl.float32)  # z' of the running winner
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)  # (BLOCK_V,)
        inside = cols < V
        z = tl.load(row_ptr + cols.to(tl.int64) * stride_lv, mask=inside, other=NEG_INF)
        z = z.to(tl.float32) * inv_temperature
        finite = z > NEG_INF
        m_new = tl.maximum(m, tl.max(z, 0))
        m_safe = tl.where(m_new > NEG_INF, m_new, 0.0)
        alpha = tl.where(m > NEG_INF, tl.exp(m - m_safe), 0.0)
        e = tl.where(finite, tl.exp(z - m_safe), 0.0)
        s = s * alpha + tl.sum(e, 0)
        q = q * alpha + tl.sum(e * tl.where(finite, z, 0.0), 0)
        m = m_new
        if GREEDY:
            key = z
        else:
            bits = tl.randint(seed, row * V + cols.to(tl.int64))  # uint32
            u = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10  # U in (0, 1]
            # E = -log(1 - U) ~ Exp(1); a series where 1 - U would lose the small values
            expo = tl.where(u < 1e-4, u + 0.5 * u * u, -tl.log(1.0 - u))
            key = z - tl.log(expo)
        key = tl.where(inside & finite, key, NEG_INF)
        blk_best = tl.max(key, 0)
        blk_idx = tl.argmax(key, 0)  # first maximum in the block
        blk_z = tl.sum(tl.where(tl.arange(0, BLOCK_V) == blk_idx, z, 0.0), 0)
        better = blk_best > best_key  # strict: the earliest block wins ties
        best_key = tl.where(better, blk_best, best_key)
        best_idx = tl.where(better, start + blk_idx.to(tl.int64), best_idx)
        best_z = tl.where(better, blk_z, best_z)
    lse = m + tl.log(s)
    tl.store(tokens_ptr + row, best_idx)
    tl.store(logp_ptr + row, best_z - lse)
    tl.store(entropy_ptr + row, lse - q / s)


def sample_rows(
    logits: torch.Tensor, seed: torch.Tensor, temperature: float, greedy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch one program per row. logits (N, V) any float, any strides; seed (1,) int64 on the
    logits' device. Returns tokens (N,) int64, logp (N,) fp32, entropy (N,) fp32."""
    N, V = logits.shape
    dev = logits.device
    tokens = torch.empty(N, dtype=torch.int64, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    entropy = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return tokens, logp, entropy
    BLOCK_V = min(4096, triton.next_power_of_2(V))
    _sample_fwd_kernel[(N,)](
        logits, seed, tokens, logp, entropy, V,
        logits.stride(0), logits.stride(1),
        1.0 if greedy else 1.0 / temperature,
        GREEDY=greedy, BLOCK_V=BLOCK_V, num_warps=8 if BLOCK_V >= 2048 else 4,
    )  # fmt: skip
    return tokens, logp, entropy
