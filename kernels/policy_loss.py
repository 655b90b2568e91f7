"""Triton kernels of the fused policy loss: one streaming pass per logits row, and the gradient.

Notation of SPEC.md: a row is the logits z (length V) of one token, z' = z / tau, y the sampled
token, lse = logsumexp(z'), p_j = exp(z'_j - lse), logp = z'_y - lse, H = lse - sum_j p_j z'_j.

* `_token_stats_fwd_kernel` (one program per row) reads the row ONCE, in BLOCK_V chunks, with an
  online max / sum-exp / sum(exp * z') and writes lse, logp and H (fp32, one value per row).
* `_token_stats_bwd_kernel` (one program per row) reads the row a second time and writes
  SPEC 6's gradient
      dL/dz_j = (1/tau) * [ g * (1[j = y] - p_j) - h * p_j * (log p_j + H) ]
  with g = dL/dlogp and h = dL/dH of that row (computed by autograd from the O(N) per-token
  terms). A row with g = h = 0 (a masked token) writes zeros without reading its logits.

So the forward + backward of the loss reads the logits twice and writes the gradient once; the
per-token terms in between are O(N) torch math (fastrl/losses.py).

Logits are addressed as (B, T, V) with arbitrary strides over B and T (e.g. a `logits[:, :-1]`
view is read in place, never copied); the V dimension must have stride 1 (the caller copies
otherwise). Row offsets are int64, so N * V > 2^31 is fine. An out-of-range token (y < 0 or
y >= V) gives logp = NaN for that row (never a silently wrong number). A -inf logit (a masked
vocabulary entry) has p = 0 and contributes 0 to H and to the gradient (p log p -> 0); a NaN or
+inf logit makes lse, logp and H of its row NaN (so the loss is NaN: never hidden).

Launchers only below; autograd and backend dispatch live in fastrl/ops.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _token_stats_fwd_kernel(
    logits_ptr,  # (B, T, V) fp32 / bf16 / fp16, stride over V is 1
    tokens_ptr,  # (B * T,) int32 / int64, contiguous
    logp_ptr,  # (B * T,) fp32 out: z'_y - lse
    entropy_ptr,  # (B * T,) fp32 out: lse - sum_j p_j z'_j
    lse_ptr,  # (B * T,) fp32 out: logsumexp(z')
    T,
    V,
    stride_logits_b,
    stride_logits_t,
    inv_temp,  # fp32 scalar, 1 / tau
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row - b * T
    row_ptr = logits_ptr + b * stride_logits_b + t * stride_logits_t
    cols = tl.arange(0, BLOCK_V)

    # online softmax statistics, all relative to the running max m:
    #   s = sum_j exp(z'_j - m),  w = sum_j exp(z'_j - m) * z'_j
    m = float("-inf")
    s = 0.0
    w = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + cols
        valid = offs < V
        z = tl.load(row_ptr + offs, mask=valid, other=float("-inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        # a row that so far holds only -inf keeps s = w = 0 instead of exp(-inf + inf) = NaN
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        scale = tl.exp(m - m_safe)
        e = tl.exp(z - m_safe)
        s = s * scale + tl.sum(e, axis=0)
        # p * z' := 0 where p = 0 (masked-out lanes and -inf logits: lim p log p = 0)
        w = w * scale + tl.sum(e * tl.where(e > 0.0, z, 0.0), axis=0)
        m = m_new

    lse = m + tl.log(s)
    entropy = lse - w / s
    y = tl.load(tokens_ptr + row).to(tl.int64)
    y_ok = (y >= 0) & (y < V)
    z_y = tl.load(row_ptr + y, mask=y_ok, other=0.0).to(tl.float32) * inv_temp
    logp = tl.where(y_ok, z_y - lse, float("nan"))
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)


@triton.jit
def _token_stats_bwd_kernel(
    logits_ptr,  # (B, T, V) fp32 / bf16 / fp16, stride over V is 1
    tokens_ptr,  # (B * T,) int32 / int64, contiguous
    lse_ptr,  # (B * T,) fp32
    entropy_ptr,  # (B * T,) fp32
    grad_logp_ptr,  # (B * T,) fp32: g = dL/dlogp
    grad_entropy_ptr,  # (B * T,) fp32: h = dL/dH (unused unless HAS_GRAD_ENTROPY)
    grad_ptr,  # (B, T, V) out, dtype of the logits; may be the logits' own storage
    T,
    V,
    stride_logits_b,
    stride_logits_t,
    stride_grad_b,
    stride_grad_t,
    inv_temp,  # fp32 scalar, 1 / tau
    HAS_GRAD_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row - b * T
    row_ptr = logits_ptr + b * stride_logits_b + t * stride_logits_t
    out_ptr = grad_ptr + b * stride_grad_b + t * stride_grad_t
    cols = tl.arange(0, BLOCK_V)

    g = tl.load(grad_logp_ptr + row)
    if HAS_GRAD_ENTROPY:
        h = tl.load(grad_entropy_ptr + row)
    else:
        h = g * 0.0
    if (g == 0.0) & (h == 0.0):
        # masked token: zero gradient, the logits are not read
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            tl.store(
                out_ptr + offs,
                tl.zeros([BLOCK_V], dtype=tl.float32).to(grad_ptr.dtype.element_ty),
                mask=offs < V,
            )
    else:
        lse = tl.load(lse_ptr + row)
        entropy = tl.load(entropy_ptr + row)
        y = tl.load(tokens_ptr + row).to(tl.int64)
        for start in range(0, V, BLOCK_V):
            offs = start + cols
            valid = offs < V
            z = tl.load(row_ptr + offs, mask=valid, other=0.0).to(tl.float32) * inv_temp
            log_p = z - lse
            p = tl.exp(log_p)
            d = -g * p
            if HAS_GRAD_ENTROPY:
                # p (log p + H) := 0 where p = 0 (a -inf logit has no entropy gradient)
                d -= h * p * tl.where(p > 0.0, log_p + entropy, 0.0)
            d = tl.where(offs == y, d + g, d) * inv_temp
            tl.store(out_ptr + offs, d.to(grad_ptr.dtype.element_ty), mask=valid)


def _launch_config(V: int, elem_size: int) -> tuple[int, int]:
    """(BLOCK_V, num_warps) for a row of V elements: about 16 KB of logits per loop step.

    Heuristic, not autotuned (autotuning would re-run the in-place backward)."""
    max_block = 8192 if elem_size <= 2 else 4096
    block = min(max(triton.next_power_of_2(V), 32), max_block)  # >= 32: no size-1 blocks
    num_warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 4096 else 16
    return block, num_warps


def token_stats_fwd(logits: torch.Tensor, tokens: torch.Tensor, temperature: float):
    """lse, logp and entropy of every row in one pass.

    logits (B, T, V) with stride(-1) == 1 (any strides over B, T); tokens (B, T) int32/int64.
    Returns (logp, entropy, lse), each fp32 (B, T)."""
    B, T, V = logits.shape
    assert V == 1 or logits.stride(-1) == 1, "the V dimension of the logits must be contiguous"
    logp, entropy, lse = (
        torch.empty((B, T), dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    if B * T == 0:
        return logp, entropy, lse
    block, num_warps = _launch_config(V, logits.element_size())
    _token_stats_fwd_kernel[(B * T,)](
        logits,
        tokens.contiguous(),
        logp,
        entropy,
        lse,
        T,
        V,
        logits.stride(0),
        logits.stride(1),
        1.0 / float(temperature),
        BLOCK_V=block,
        num_warps=num_warps,
    )
    return logp, entropy, lse


def token_stats_bwd(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor | None,
    temperature: float,
    out: torch.Tensor,
) -> torch.Tensor:
    """Write dL/dz (SPEC 6) into `out` (B, T, V), which may be `logits` itself (in-place).

    logits (B, T, V); tokens, lse, entropy, grad_logp, grad_entropy (B, T) (fp32, the last two
    are g and h; grad_entropy None means h = 0). Returns `out`."""
    B, T, V = logits.shape
    if B * T == 0:
        return out
    assert out.shape == logits.shape and (V == 1 or out.stride(-1) == 1)
    block, num_warps = _launch_config(V, logits.element_size())
    g = grad_logp.float().contiguous()
    h = g if grad_entropy is None else grad_entropy.float().contiguous()
    _token_stats_bwd_kernel[(B * T,)](
        logits,
        tokens.contiguous(),
        lse.contiguous(),
        entropy.contiguous(),
        g,
        h,
        out,
        T,
        V,
        logits.stride(0),
        logits.stride(1),
        out.stride(0),
        out.stride(1),
        1.0 / float(temperature),
        HAS_GRAD_ENTROPY=grad_entropy is not None,
        BLOCK_V=block,
        num_warps=num_warps,
    )
    return out
