"""The fused per-token op, as torch.library custom ops with autograd, and its backend dispatch.

`token_logprobs(logits, tokens, temperature, inplace)` returns fp32 (logp, entropy), each (B, T),
for logits (B, T, V). It is the only op that touches the (.., V) logits; everything else in the
policy loss is O(N) torch math on its outputs (fastrl/losses.py), so autograd hands this op's
backward g = dL/dlogp and h = dL/dH per token, and the backward writes SPEC 6's gradient

    dL/dz_tj = (1/tau) * [ g_t * (1[j = y_t] - p_tj) - h_t * p_tj * (log p_tj + H_t) ]

in one pass over the logits (no (N, V) intermediate besides the gradient itself).

Registered ops (namespace "fastrl", so torch.compile(fullgraph=True) traces through them):
  fastrl::token_stats(logits, tokens, temperature) -> (logp, entropy, lse)    # fp32 (B, T) x 3
  fastrl::token_stats_grad(logits, tokens, lse, entropy, g, h, temperature) -> grad (B, T, V)
  fastrl::token_stats_grad_(logits, ...) -> ()   # writes the gradient into `logits` (in-place)

Backends (chosen per call at run time, so also inside compiled graphs):
  * FASTRL_BACKEND unset / "auto": Triton kernels (fastrl/kernels/policy_loss.py) for CUDA
    tensors, the chunked torch path for CPU tensors;
  * FASTRL_BACKEND=triton: the Triton kernels on any device (on CPU with TRITON_INTERPRET=1);
  * FASTRL_BACKEND=torch: the chunked torch path on any device.
The chunked torch path processes `chunk_rows(V)` rows at a time (about CHUNK_BYTES of fp32 per
temporary), so its transient memory is bounded and independent of N; it never makes an fp32
copy of all the logits.

Float hyper-parameters: the op schemas take `temperature` as a Python float (a double in the
schema, and what Inductor passes); it is turned into an fp32 1/tau (Triton scalar argument) or
used as a weak Python scalar on fp32 tensors (torch path), never promoting anything to fp64.
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

BACKENDS = ("auto", "triton", "torch")
CHUNK_BYTES = 32 << 20  # fp32 bytes per temporary of the chunked torch path (a few exist at once)


def backend_for(device: torch.device) -> str:
    """The backend a call on `device` uses: "triton" or "torch" (reads FASTRL_BACKEND)."""
    backend = os.environ.get("FASTRL_BACKEND", "auto").strip().lower() or "auto"
    if backend not in BACKENDS:
        raise ValueError(f"FASTRL_BACKEND={backend!r} is invalid: expected one of {BACKENDS}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch"
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            f"FASTRL_BACKEND=triton on {device} tensors needs the Triton interpreter: set "
            "TRITON_INTERPRET=1 before triton is first imported"
        )
    return backend


def chunk_rows(V: int) -> int:
    """Rows per chunk of the torch path: chunk_rows * V * 4 bytes <= CHUNK_BYTES (at least 1)."""
    return max(1, CHUNK_BYTES // (4 * max(V, 1)))


# --------------------------------------------------------------------------- chunked torch path
def _rows(x: Tensor, r0: int, r1: int) -> Tensor:
    """Rows r0:r1 of a (B, T, V) tensor as (R, V): a view when (B, T) flatten, else a gather."""
    B, T, V = x.shape
    if x.stride(0) == T * x.stride(1) or B == 1:
        return x.reshape(B * T, V)[r0:r1] if x.stride(0) == T * x.stride(1) else x[0, r0:r1]
    idx = torch.arange(r0, r1, device=x.device)
    return x[idx // T, idx % T]  # (R, V) copy in x's dtype: chunk-sized


def _scaled(rows: Tensor, temperature: float) -> Tensor:
    """z' = z / tau as fp32 (R, V); no copy for fp32 rows at tau = 1 (x / 1.0 == x exactly)."""
    if temperature == 1.0 and rows.dtype == torch.float32:
        return rows
    return rows.float() / temperature


def _torch_token_stats(logits: Tensor, tokens: Tensor, temperature: float):
    """logp, entropy, lse (fp32 (B, T)) of logits (B, T, V), `chunk_rows(V)` rows at a time.

    Same formulas as the reference: z' = z / tau, lse = logsumexp(z'), logp = z'_y - lse,
    H = lse - sum_j p_j z'_j. Out-of-range tokens give logp = NaN (no device-side assert)."""
    B, T, V = logits.shape
    out = [torch.empty(B * T, dtype=torch.float32, device=logits.device) for _ in range(3)]
    y_all = tokens.reshape(-1).long()
    step = chunk_rows(V)
    for r0 in range(0, B * T, step):
        r1 = min(B * T, r0 + step)
        z = _scaled(_rows(logits, r0, r1), temperature)  # (R, V) fp32
        lse = torch.logsumexp(z, dim=-1)  # (R,)
        # a +inf logit makes the row's lse (so logp and H) NaN, as in the Triton kernel
        lse = torch.where(lse == float("inf"), float("nan"), lse)
        y = y_all[r0:r1]
        y_ok = (y >= 0) & (y < V)
        z_y = z.gather(1, torch.where(y_ok, y, 0)[:, None]).squeeze(1)
        out[0][r0:r1] = torch.where(y_ok, z_y - lse, float("nan"))
        p = torch.sub(z, lse[:, None]).exp_()  # (R, V) fp32
        # p * z' := 0 where p = 0 and z' = -inf (a masked vocabulary entry: lim p log p = 0);
        # NaN / +inf logits already made lse non-finite
        p.mul_(z).nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
        out[1][r0:r1] = lse - p.sum(-1)
        out[2][r0:r1] = lse
        del z, p
    return out[0].view(B, T), out[1].view(B, T), out[2].view(B, T)


def _torch_token_stats_grad(logits, tokens, lse, entropy, g, h, temperature, out):
    """SPEC 6's gradient into `out` (B, T, V), chunk by chunk; `out` may be `logits` itself.

    dL/dz = (1/tau) [g (1[j=y] - p) - h p (log p + H)] = (1/tau) [g 1[j=y] - p (g + h (log p + H))]
    computed per chunk as  d = p * (a log p + c),  a = -h / tau,  c = -(g + h H) / tau,  then
    d[y] += g / tau  (two (R, V) fp32 temporaries)."""
    B, T, V = logits.shape
    inv_temp = 1.0 / temperature
    y_all = tokens.reshape(-1).long()
    lse, entropy, g = lse.reshape(-1), entropy.reshape(-1), g.reshape(-1).float()
    h = None if h is None else h.reshape(-1).float()
    # fp32 (B, T)-flattenable destination: write the chunk's result straight into it
    direct = out.dtype == torch.float32 and (out.stride(0) == T * out.stride(1) or B == 1)
    step = chunk_rows(V)
    for r0 in range(0, B * T, step):
        r1 = min(B * T, r0 + step)
        g_r = g[r0:r1, None]
        log_p = torch.sub(_scaled(_rows(logits, r0, r1), temperature), lse[r0:r1, None])
        p = log_p.exp()  # (R, V)
        if h is None:
            d = p.mul_(g_r * -inv_temp)
        else:
            h_r = h[r0:r1, None]
            log_p.clamp_(min=-1e30)  # -inf logit: p = 0 and p * (a log p + c) must stay 0
            coef = log_p.mul_(h_r * -inv_temp).add_((g_r + h_r * entropy[r0:r1, None]) * -inv_temp)
            d = torch.mul(p, coef, out=_rows(out, r0, r1)) if direct else p.mul_(coef)
        del log_p
        y = y_all[r0:r1]
        y_ok = (y >= 0) & (y < V)
        d.scatter_add_(1, torch.where(y_ok, y, 0)[:, None], torch.where(y_ok, g_r * inv_temp, 0.0))
        if out.stride(0) == T * out.stride(1) or B == 1:
            dst = _rows(out, r0, r1)
            if d.data_ptr() != dst.data_ptr():
                dst.copy_(d)
        else:
            idx = torch.arange(r0, r1, device=out.device)
            out[idx // T, idx % T] = d.to(out.dtype)
        del d, p
    return out


# --------------------------------------------------------------------------- custom ops
def _check_v_contiguous(logits: Tensor) -> None:
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        raise ValueError(
            f"logits {tuple(logits.shape)} with strides {logits.stride()}: the V dimension must "
            "be contiguous here (fastrl.policy_loss / logprobs copy such inputs first)"
        )


@torch.library.custom_op("fastrl::token_stats", mutates_args=())
def token_stats(
    logits: Tensor, tokens: Tensor, temperature: float
) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, entropy, lse), each fp32 (B, T), of logits (B, T, V) and tokens (B, T)."""
    return _token_stats_impl(logits, tokens, temperature)


def _token_stats_impl(logits, tokens, temperature):
    _check_v_contiguous(logits)
    temperature = float(temperature)
    if backend_for(logits.device) == "triton":
        from .kernels.policy_loss import token_stats_fwd

        return token_stats_fwd(logits, tokens, temperature)
    return _torch_token_stats(logits, tokens, temperature)


@token_stats.register_fake
def _(logits, tokens, temperature):
    B, T, _ = logits.shape
    return tuple(logits.new_empty((B, T), dtype=torch.float32) for _ in range(3))


def _grad_into(logits, tokens, lse, entropy, g, h, temperature, out):
    temperature = float(temperature)
    if backend_for(logits.device) == "triton":
        from .kernels.policy_loss import token_stats_bwd

        return token_stats_bwd(logits, tokens, lse, entropy, g, h, temperature, out)
    return _torch_token_stats_grad(logits, tokens, lse, entropy, g, h, temperature, out)


@torch.library.custom_op("fastrl::token_stats_grad", mutates_args=())
def token_stats_grad(
    logits: Tensor,
    tokens: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor | None,
    temperature: float,
) -> Tensor:
    """dL/dz (B, T, V) in the logits' dtype, contiguous, from g = grad_logp and h = grad_entropy."""
    _check_v_contiguous(logits)
    out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
    return _grad_into(logits, tokens, lse, entropy, grad_logp, grad_entropy, temperature, out)


@token_stats_grad.register_fake
def _(logits, tokens, lse, entropy, grad_logp, grad_entropy, temperature):
    return torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)


@torch.library.custom_op("fastrl::token_stats_grad_", mutates_args=("logits",))
def token_stats_grad_(
    logits: Tensor,
    tokens: Tensor,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor | None,
    temperature: float,
) -> None:
    """Like token_stats_grad, but overwrites `logits` with the gradient (in-place)."""
    _check_v_contiguous(logits)
    _grad_into(logits, tokens, lse, entropy, grad_logp, grad_entropy, temperature, logits)


@token_stats_grad_.register_fake
def _(logits, tokens, lse, entropy, grad_logp, grad_entropy, temperature):
    return None


# --------------------------------------------------------------------------- autograd
@torch.library.custom_op("fastrl::token_logprobs", mutates_args=())
def _token_logprobs_op(
    logits: Tensor, tokens: Tensor, temperature: float, inplace: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """token_stats plus an `inplace` flag that only its backward reads."""
    return _token_stats_impl(logits, tokens, temperature)


@_token_logprobs_op.register_fake
def _(logits, tokens, temperature, inplace):
    B, T, _ = logits.shape
    return tuple(logits.new_empty((B, T), dtype=torch.float32) for _ in range(3))


def _setup_context(ctx, inputs, output):
    logits, tokens, temperature, inplace = inputs
    logp, entropy, lse = output
    ctx.save_for_backward(logits, tokens, lse, entropy)
    ctx.temperature = temperature
    ctx.inplace = inplace
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_logp, grad_entropy, grad_lse):
    logits, tokens, lse, entropy = ctx.saved_tensors
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    if ctx.inplace:
        token_stats_grad_(logits, tokens, lse, entropy, grad_logp, grad_entropy, ctx.temperature)
        torch.autograd.graph.increment_version(logits)
        return logits.detach(), None, None, None
    grad = token_stats_grad(logits, tokens, lse, entropy, grad_logp, grad_entropy, ctx.temperature)
    return grad, None, None, None


_token_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(
    logits: Tensor, tokens: Tensor, temperature: float = 1.0, inplace: bool = False
) -> tuple[Tensor, Tensor]:
    """Differentiable per-token (logp, entropy), fp32 (B, T), of logits (B, T, V), tokens (B, T).

    One pass over the logits forward; one pass (reading them again and writing dL/dz) backward.
    A V dimension that is not contiguous is copied first (the only copy this op makes).
    `inplace=True` makes the backward write dL/dz into the logits' storage (see
    fastrl.policy_loss for when that is safe)."""
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        logits = logits.contiguous()
    logp, entropy, _ = _token_logprobs_op(logits, tokens, float(temperature), bool(inplace))
    return logp, entropy
