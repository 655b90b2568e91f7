"""Triton kernels of the fused policy loss: one streaming pass per logits row, and the gradient.

Notation of SPEC.md: a row is the logits z (length V) of one token, z' = z / tau, y the sampled
token, lse = logsumexp(z'), p_j = exp(z'_j - lse), logp = z'_y - lse, H = lse - sum_j p_j z'_j.

* `_token_stats_fwd_kernel` (one program per row) reads the row ONCE, in BLOCK_V chunks, with an
  online max / sum-exp / sum(exp * (z' - m)) (max-shifted, so H has no cancellation at large
  logit offsets or low temperature) and writes lse, logp and H (fp32, one value per row).
* split-V (`_token_stats_split_fwd_kernel` + `_token_stats_merge_fwd_kernel`): when there are few
  rows and a long vocabulary, SPLITS programs per row each reduce one slice of it to partial
  (max, sum-exp, sum exp * shift) and a merge kernel combines them exactly, so a small batch
  still fills the GPU.
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
    entropy_ptr,  # (B * T,) fp32 out: H = lse - sum_j p_j z'_j = log s - w / s
    lse_ptr,  # (B * T,) fp32 out: logsumexp(z') = m + log s
    T,
    V,
    stride_logits_b,
    stride_logits_t,
    inv_temp,  # fp32 scalar, 1 / tau
    BLOCK_V: tl.constexpr,
):
    # one program per row (grid (B * T,)): one online pass over the whole row keeps, relative
    # to the running max m,  s = sum_j exp(z'_j - m)  and  w = sum_j exp(z'_j - m) * (z'_j - m)
    # (_token_stats_slice), so that H = log s - w / s has no cancellation (both terms >= 0)
    # whatever the offset of the logits or the temperature.
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row - b * T
    row_ptr = logits_ptr + b * stride_logits_b + t * stride_logits_t
    m, s, w, n_nan = _token_stats_slice(row_ptr, 0, V, inv_temp, BLOCK_V)
    _token_stats_store(
        row_ptr, tokens_ptr, logp_ptr, entropy_ptr, lse_ptr, row, V, inv_temp, m, s, w, n_nan
    )


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
    d = tl.where(old, m - m_safe, 0.0)
    a = tl.where(old, tl.exp(d), 0.0)
    w = a * (w + s * d)
    s = a * s
    live = part_m > float("-inf")
    part_d = tl.where(live, part_m - m_safe, 0.0)
    part_a = tl.where(live, tl.exp(part_d), 0.0)
    s += tl.sum(part_a * part_s, axis=0)
    w += tl.sum(part_a * (part_w + part_s * part_d), axis=0)
    return m_new, s, w


@triton.jit
def _token_stats_slice(row_ptr, lo, hi, inv_temp, BLOCK_V: tl.constexpr):
    # Online statistics of z'_j = z_j / tau over the columns lo <= j < hi of one row, read in
    # BLOCK_V chunks: (m, s, w, n_nan) with m = max z', s = sum exp(z' - m),
    # w = sum exp(z' - m) (z' - m) (-inf logits contribute 0) and n_nan the number of NaN logits
    # (counted, then left out of m, s, w: a NaN row is reported NaN by the caller, whatever the
    # NaN semantics of max on the hardware).
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    w = tl.zeros((), dtype=tl.float32)
    n_nan = tl.zeros((), dtype=tl.int32)
    cols = tl.arange(0, BLOCK_V)
    for start in range(lo, hi, BLOCK_V):
        offs = start + cols
        z = tl.load(row_ptr + offs, mask=offs < hi, other=float("-inf")).to(tl.float32) * inv_temp
        is_nan = z != z
        n_nan += tl.sum(is_nan.to(tl.int32), axis=0)
        m, s, w = _lse_merge(m, s, w, tl.where(is_nan, float("-inf"), z), 1.0, 0.0)
    return m, s, w, n_nan


@triton.jit
def _token_stats_store(
    row_ptr, tokens_ptr, logp_ptr, entropy_ptr, lse_ptr, row, V, inv_temp, m, s, w, n_nan
):
    # From a row's merged (m, s, w, n_nan): lse = m + log s, H = log s - w / s and
    # logp = z'_y - lse = (z'_y - m) - log s (max-shifted: exact at large offsets; NaN for y
    # outside [0, V)); all three NaN when the row holds a NaN logit.
    log_s = tl.log(s)
    bad = n_nan > 0
    lse = tl.where(bad, float("nan"), m + log_s)
    entropy = tl.where(bad, float("nan"), log_s - w / s)
    y = tl.load(tokens_ptr + row).to(tl.int64)
    y_ok = (y >= 0) & (y < V)
    z_y = tl.load(row_ptr + y, mask=y_ok, other=0.0).to(tl.float32) * inv_temp
    logp = tl.where(y_ok & (n_nan == 0), (z_y - m) - log_s, float("nan"))
    tl.store(logp_ptr + row, logp)
    tl.store(entropy_ptr + row, entropy)
    tl.store(lse_ptr + row, lse)


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
    inv_temp,  # fp32 scalar, 1 / tau
    BLOCK_V: tl.constexpr,
):
    # split-V stage 1, grid (B * T, SPLITS): program (row, k) reduces the slice
    # k * CHUNK <= j < min((k + 1) * CHUNK, V) of its row to the partial (m_k, s_k, w_k) of
    # _token_stats_slice; _token_stats_merge_fwd_kernel combines them per row.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    b = row // T
    t = row - b * T
    row_ptr = logits_ptr + b * stride_logits_b + t * stride_logits_t
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    m, s, w, n_nan = _token_stats_slice(row_ptr, lo, hi, inv_temp, BLOCK_V)
    out = row * SPLITS + split
    tl.store(part_m_ptr + out, m)
    tl.store(part_s_ptr + out, tl.where(n_nan > 0, float("nan"), s))
    tl.store(part_w_ptr + out, w)


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
    T,
    V,
    SPLITS,
    stride_logits_b,
    stride_logits_t,
    inv_temp,  # fp32 scalar, 1 / tau
    BLOCK_S: tl.constexpr,
):
    # split-V stage 2, grid (B * T,): the log-sum-exp merge (_lse_merge) of a row's SPLITS
    # partials, BLOCK_S at a time, then the outputs of _token_stats_fwd_kernel.
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    t = row - b * T
    row_ptr = logits_ptr + b * stride_logits_b + t * stride_logits_t
    m = tl.full((), float("-inf"), tl.float32)
    s = tl.zeros((), dtype=tl.float32)
    w = tl.zeros((), dtype=tl.float32)
    n_nan = tl.zeros((), dtype=tl.int32)
    ks = tl.arange(0, BLOCK_S)
    for start in range(0, SPLITS, BLOCK_S):
        k = start + ks
        valid = k < SPLITS
        part_m = tl.load(part_m_ptr + row * SPLITS + k, mask=valid, other=float("-inf"))
        part_s = tl.load(part_s_ptr + row * SPLITS + k, mask=valid, other=0.0)
        part_w = tl.load(part_w_ptr + row * SPLITS + k, mask=valid, other=0.0)
        is_nan = part_s != part_s
        n_nan += tl.sum(is_nan.to(tl.int32), axis=0)
        part_m = tl.where(is_nan, float("-inf"), part_m)  # counted, then an empty partial
        part_s = tl.where(is_nan, 0.0, part_s)
        m, s, w = _lse_merge(m, s, w, part_m, part_s, part_w)
    _token_stats_store(
        row_ptr, tokens_ptr, logp_ptr, entropy_ptr, lse_ptr, row, V, inv_temp, m, s, w, n_nan
    )


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


_SPLIT_SM_COUNT = 132  # SMs assumed off CUDA (the interpreter, tests): an H100 SXM
_SPLIT_MIN_CHUNK = 8192  # never fewer logits than this per split-V program
_SPLIT_WAVES = 4  # split-V aims at about this many programs per SM


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device` (torch caches the properties: no sync)."""
    if device.type != "cuda":
        return _SPLIT_SM_COUNT
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.cuda.get_device_properties(index).multi_processor_count


def _split_config(
    n_rows: int, V: int, block: int, device: torch.device, split_chunk: int | None = None
) -> tuple[int, int]:
    """(splits, chunk): how many programs share each row, each reducing `chunk` logits of it.

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
        return triton.cdiv(V, split_chunk), split_chunk
    sms = _sm_count(device)
    if n_rows >= 2 * sms or V < 2 * _SPLIT_MIN_CHUNK:
        return 1, V
    splits = min(triton.cdiv(V, _SPLIT_MIN_CHUNK), triton.cdiv(_SPLIT_WAVES * sms, n_rows))
    align = min(block, _SPLIT_MIN_CHUNK)  # whole BLOCK_V steps per slice
    chunk = triton.cdiv(triton.cdiv(V, splits), align) * align
    splits = triton.cdiv(V, chunk)
    return (splits, chunk) if splits > 1 else (1, V)


def token_stats_fwd(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    temperature: float,
    *,
    split_chunk: int | None = None,
):
    """lse, logp and entropy of every row in one pass.

    logits (B, T, V) with stride(-1) == 1 (any strides over B, T); tokens (B, T) int32/int64.
    Returns (logp, entropy, lse), each fp32 (B, T). Few rows with a large V (decode) run the
    split-V kernels (see _split_config; `split_chunk` forces the choice: 0 = one program per
    row, k > 0 = slices of k logits); both paths agree to fp32 rounding."""
    B, T, V = logits.shape
    assert V == 1 or logits.stride(-1) == 1, "the V dimension of the logits must be contiguous"
    logp, entropy, lse = (
        torch.empty((B, T), dtype=torch.float32, device=logits.device) for _ in range(3)
    )
    N = B * T
    if N == 0:
        return logp, entropy, lse
    block, num_warps = _launch_config(V, logits.element_size())
    splits, chunk = _split_config(N, V, block, logits.device, split_chunk)
    tokens = tokens.contiguous()
    inv_temp = 1.0 / float(temperature)
    if splits == 1:
        _token_stats_fwd_kernel[(N,)](
            logits, tokens, logp, entropy, lse, T, V,
            logits.stride(0), logits.stride(1), inv_temp,
            BLOCK_V=block, num_warps=num_warps,
        )  # fmt: skip
        return logp, entropy, lse
    block, num_warps = _launch_config(min(chunk, block), logits.element_size())
    part = torch.empty((3, N, splits), dtype=torch.float32, device=logits.device)
    _token_stats_split_fwd_kernel[(N, splits)](
        logits, part[0], part[1], part[2], T, V, chunk, splits,
        logits.stride(0), logits.stride(1), inv_temp,
        BLOCK_V=block, num_warps=num_warps,
    )  # fmt: skip
    block_s = min(triton.next_power_of_2(splits), 1024)
    _token_stats_merge_fwd_kernel[(N,)](
        logits, tokens, part[0], part[1], part[2], logp, entropy, lse, T, V, splits,
        logits.stride(0), logits.stride(1), inv_temp,
        BLOCK_S=block_s, num_warps=1 if block_s <= 256 else 4,
    )  # fmt: skip
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


# --------------------------------------------------------------------------- upstream scale
@triton.jit
def _scale_grad_kernel(
    grad_ptr,  # (R, C) rows of a gradient, any dtype, stride over C is 1; scaled in place
    scale_ptr,  # (1,) the upstream gradient dL_total / dloss (any float dtype)
    C,
    stride_grad_r,
    BLOCK: tl.constexpr,
):
    # grad *= scale. A scale of exactly 1 (loss.backward()) returns before touching the row:
    # the only cost is the launch, and the host never reads the scale.
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        row = tl.program_id(0).to(tl.int64)
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ptrs = grad_ptr + row * stride_grad_r + offs
        x = tl.load(ptrs, mask=offs < C, other=0.0).to(tl.float32)
        tl.store(ptrs, (x * scale).to(grad_ptr.dtype.element_ty), mask=offs < C)


def scale_grad(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad *= scale in place, without a host sync and without a pass when scale == 1.

    grad: any shape whose last dim has stride 1 and whose leading dims flatten to rows of equal
    stride (a contiguous tensor, or (B, T, V) logits views with (B, T) flattening), else it is
    processed per leading index. scale: a one-element tensor on grad's device."""
    if grad.numel() == 0:
        return grad
    g = grad if grad.dim() >= 2 else grad.view(1, -1)
    if g.dim() > 2:
        try:
            g = g.view(-1, g.shape[-1])
        except RuntimeError:  # (B, T) do not flatten (a sliced view): one launch per b
            for sub in g.unbind(0):
                scale_grad(sub, scale)
            return grad
    R, C = g.shape
    assert C == 1 or g.stride(1) == 1
    BLOCK = 4096
    _scale_grad_kernel[(R, triton.cdiv(C, BLOCK))](g, scale.reshape(1), C, g.stride(0), BLOCK=BLOCK)
    return grad
