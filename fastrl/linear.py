"""Log-probs and the policy loss straight from the last hidden states and the lm_head weight.

Trainers (TRL, verl, NeMo-RL, ...) compute per-token log-probs from `hidden @ weight.T` without
holding the (N, V) logits. Here, rows are processed `chunk` at a time:

    a = h W^T (+ b)                (R, V) one GEMM per chunk, in the hidden states' dtype
    z = s a, or c tanh(s a / c)    logit_scale s, Gemma-style softcap c (exact gradients)
    z' = z / tau                   then the fused row statistics of fastrl.ops (logp, H)

`linear_logprobs` (the op a trainer's own loss calls) saves only (N,) statistics; its backward
recomputes each chunk's logits once: dz (SPEC 6 from the upstream g = dL/dlogp, h = dL/dH),
then dX = dz W and dW += dz^T X (4 GEMMs per chunk in all; the upstream gradient is not known
in the forward). `fused_linear_policy_loss` knows its per-token gradient in the forward when
the loss is token-separable (`terms.is_token_separable`): per chunk ONE logits GEMM, the
statistics and dz in one pass (fastrl.ops.stats_and_grad_), then dX and dW: three GEMMs, no
recompute. Sequence-level options (GSPO ratio, sequence IS weights) take two phases (statistics
of every chunk, then the per-token gradient, then the logits again: four GEMMs).

Rows whose mask is 0 (prompt and padding positions) are never gathered: no GEMM work, logp = H
= 0 there, zero gradient. Finding them reads the mask's count on the host (one sync per call on
CUDA; the only one). bf16 / fp16 run their GEMMs in that dtype (fp32 accumulation inside the
GEMM); dW and db are accumulated across chunks in fp32 and cast once.
"""

from __future__ import annotations

import contextlib
import math

import torch
from torch import Tensor

from . import chunked, ops
from ._inputs import FLOAT_DTYPES, check_mask, check_temperature, describe, prepare_policy_inputs
from .config import LossConfig
from .terms import PolicyLossOutput, aggregation_weights, is_token_separable, policy_output

__all__ = ["fused_linear_policy_loss", "linear_logprobs"]


# --------------------------------------------------------------------------- chunk helpers
def _active_rows(mask: Tensor | None, N: int, device) -> Tensor:
    """Flat indices (R,) of the rows that count: all of them, or where mask != 0."""
    if mask is None:
        return torch.arange(N, device=device)
    return torch.nonzero(mask.reshape(-1) != 0).view(-1)


def _gather(hidden: Tensor, idx: Tensor) -> Tensor:
    """Rows `idx` (flat indices) of hidden (B, T, H) or (N, H), any strides, as (R, H)."""
    if hidden.dim() == 2:
        return hidden.index_select(0, idx)
    T = hidden.shape[1]
    return hidden[idx // T, idx % T]


class _Buffer:
    """One (chunk, V) logits buffer reused by every chunk of a call: a fresh allocation per
    chunk would cost page faults on every chunk (large CPU allocations are mmapped)."""

    def __init__(self, chunk: int, weight: Tensor):
        self.data = torch.empty(chunk, weight.shape[0], dtype=weight.dtype, device=weight.device)

    def rows(self, R: int) -> Tensor:
        return self.data[:R]


def _logits(rows: Tensor, weight: Tensor, bias, logit_scale: float, softcap, buf: _Buffer):
    """z (R, V) in the rows' dtype (in `buf`): s (h W^T + b), then c tanh(. / c) with a
    softcap."""
    z = buf.rows(rows.shape[0])
    if bias is None:
        torch.mm(rows, weight.t(), out=z)
    else:
        torch.addmm(bias, rows, weight.t(), out=z)
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _chain_factor(z: Tensor, logit_scale: float, softcap):
    """dz/da (R, V) fp32 for a softcap (s (1 - (z / c)^2)); else None (the factor is s)."""
    if softcap is None:
        return None
    t = z.float() / softcap  # a new tensor (z.float() is z itself for fp32)
    return t.mul_(t).neg_().add_(1.0).mul_(logit_scale)


def _to_pre_activation(dz: Tensor, factor, logit_scale: float) -> Tensor:
    """dL/da from dL/dz, in place."""
    if factor is not None:
        return dz.mul_(factor)  # fp32 factor: computed in fp32, cast on store
    if logit_scale != 1.0:
        dz.mul_(logit_scale)
    return dz


class _Grads:
    """grad_hidden (N, H) in hidden's dtype; grad_weight (V, H) and grad_bias (V,) in fp32.

    Nothing is zero-filled that the chunks overwrite anyway: the first chunk writes dW (and db)
    directly, and grad_hidden is zeroed only when some rows are skipped (`n_active` < N)."""

    def __init__(self, N: int, n_active: int, weight: Tensor, bias, hidden_dtype):
        V, H = weight.shape
        dev = weight.device
        alloc = torch.empty if n_active == N else torch.zeros
        self.hidden = alloc(N, H, dtype=hidden_dtype, device=dev)
        self.weight = torch.empty(V, H, dtype=torch.float32, device=dev)
        self.bias = None if bias is None else torch.empty(V, dtype=torch.float32, device=dev)
        self.started = False

    def add(self, idx: Tensor, rows: Tensor, dz: Tensor, weight: Tensor) -> None:
        """dX[idx] = dz W; dW += dz^T X; db += sum_rows dz (dz (R, V) in the GEMM dtype)."""
        dz = dz.to(rows.dtype)
        self.hidden.index_copy_(0, idx, dz @ weight)
        first, self.started = not self.started, True
        if dz.dtype == torch.float32:  # beta = 0 on the first chunk: no zero fill, no read
            self.weight.addmm_(dz.t(), rows, beta=0.0 if first else 1.0)
        elif first:  # a bf16 / fp16 GEMM, accumulated across chunks in fp32
            self.weight.copy_(dz.t() @ rows)
        else:
            self.weight.add_(dz.t() @ rows)
        if self.bias is not None:
            db = dz.sum(0, dtype=torch.float32)
            if first:
                self.bias.copy_(db)
            else:
                self.bias.add_(db)

    def result(self, weight: Tensor, bias):
        if not self.started:  # every row masked: the gradients are zero
            self.weight.zero_()
            if self.bias is not None:
                self.bias.zero_()
        db = None if self.bias is None else self.bias.to(bias.dtype)
        return self.hidden, self.weight.to(weight.dtype), db


def _bias_or_empty(bias, weight):
    return weight.new_empty(0) if bias is None else bias


# --------------------------------------------------------------------------- linear_logprobs ops
@torch.library.custom_op("fastrl::linear_token_stats", mutates_args=())
def linear_token_stats(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    mask: Tensor | None,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """(logp, entropy, lse), each fp32 (N,), of z = softcap(s (hidden W^T + b)) / tau for the
    rows of hidden (N', .., H) flattened to N; 0 where mask == 0 (never computed)."""
    N = tokens.numel()
    stats = [torch.zeros(N, dtype=torch.float32, device=hidden.device) for _ in range(3)]
    y = tokens.reshape(-1)
    active = _active_rows(mask, N, hidden.device)
    buf = _Buffer(min(chunk, max(active.numel(), 1)), weight)
    for s in range(0, active.numel(), chunk):
        idx = active[s : s + chunk]
        z = _logits(_gather(hidden, idx), weight, bias, logit_scale, softcap, buf)
        out = ops._row_stats(z[None], y.index_select(0, idx)[None], temperature)
        for dst, val in zip(stats, out):
            dst.index_copy_(0, idx, val[0])
        del z
    return tuple(stats)


@linear_token_stats.register_fake
def _(hidden, weight, bias, tokens, mask, temperature, logit_scale, softcap, chunk):
    N = tokens.numel()
    return tuple(hidden.new_empty(N, dtype=torch.float32) for _ in range(3))


@torch.library.custom_op("fastrl::linear_token_stats_backward", mutates_args=())
def linear_token_stats_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    mask: Tensor | None,
    lse: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor | None,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    chunk: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden (N, H), grad_weight (V, H), grad_bias (V,) or (0,)) from g = dL/dlogp and
    h = dL/dH (N,): per chunk the logits again, SPEC 6's dz, then dX = dz W, dW += dz^T X."""
    N = tokens.numel()
    y = tokens.reshape(-1)
    active = _active_rows(mask, N, hidden.device)
    grads = _Grads(N, active.numel(), weight, bias, hidden.dtype)
    g_all = grad_logp.reshape(-1).float()
    h_all = None if grad_entropy is None else grad_entropy.reshape(-1).float()
    buf = _Buffer(min(chunk, max(active.numel(), 1)), weight)
    for s in range(0, active.numel(), chunk):
        idx = active[s : s + chunk]
        rows = _gather(hidden, idx)
        z = _logits(rows, weight, bias, logit_scale, softcap, buf)
        factor = _chain_factor(z, logit_scale, softcap)
        pick = lambda t, idx=idx: t.index_select(0, idx)[None]  # noqa: E731
        dz = z[None]  # dL/dz overwrites the logits (each row is read before it is written)
        ops._row_grad_(
            z[None], pick(y), pick(lse), pick(entropy), pick(g_all),
            None if h_all is None else pick(h_all), temperature, dz,
        )  # fmt: skip
        grads.add(idx, rows, _to_pre_activation(z, factor, logit_scale), weight)
        del z, dz, factor
    dh, dw, db = grads.result(weight, bias)
    return dh, dw, _bias_or_empty(db, weight)


@linear_token_stats_backward.register_fake
def _(hidden, weight, bias, tokens, mask, lse, entropy, grad_logp, grad_entropy, temperature,
      logit_scale, softcap, chunk):  # fmt: skip
    N, H = tokens.numel(), weight.shape[1]
    V = weight.shape[0] if bias is not None else 0
    return hidden.new_empty(N, H), torch.empty_like(weight), weight.new_empty(V)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, tokens, mask, temperature, logit_scale, softcap, chunk = inputs
    logp, entropy, lse = output
    ctx.save_for_backward(hidden, weight, bias, tokens, mask, lse, entropy)
    ctx.args = (temperature, logit_scale, softcap, chunk)
    ctx.has_bias = bias is not None
    ctx.hidden_shape = hidden.shape
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_logp, grad_entropy, grad_lse):
    ops.refuse_double_backward("linear_logprobs")
    hidden, weight, bias, tokens, mask, lse, entropy = ctx.saved_tensors
    if grad_logp is None:
        grad_logp = torch.zeros_like(lse)
    with torch.autocast(hidden.device.type, enabled=False):  # the forward's dtype, as is
        dh, dw, db = linear_token_stats_backward(
            hidden, weight, bias, tokens, mask, lse, entropy, grad_logp, grad_entropy, *ctx.args
        )
    return (dh.view(ctx.hidden_shape), dw, db if ctx.has_bias else None, None, None, None, None,
            None, None)  # fmt: skip


linear_token_stats.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- the fused policy loss
torch.library.define(
    "fastrl::linear_policy_grad",
    f"(Tensor hidden, Tensor weight, Tensor? bias, {ops.POLICY_ARGS_SCHEMA}, float logit_scale, "
    "float? softcap, int chunk) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.impl("fastrl::linear_policy_grad", "default")
def _linear_policy_grad(hidden, weight, bias, *args):
    """(logp, entropy) fp32 (B, T) and the gradients (hidden (N, H), weight, bias or (0,)) of
    the policy loss of SPEC 1-5 on z = softcap(s (hidden W^T + b)), all in the forward.
    `args`: the per-token inputs (ops.POLICY_ARGS_SCHEMA, (B, T)), then logit_scale, softcap and
    chunk; hidden's rows flatten to N = B T."""
    x = ops.policy_inputs_from_op(None, args[:-3])
    logit_scale, softcap, chunk = args[-3:]
    tokens, mask = x.tokens, x.mask
    tau = x.config.temperature
    B, T = tokens.shape
    N = B * T
    logp, entropy = (torch.zeros(N, dtype=torch.float32, device=hidden.device) for _ in range(2))
    active = _active_rows(mask, N, hidden.device)
    grads = _Grads(N, active.numel(), weight, bias, hidden.dtype)
    chunks = [active[s : s + chunk] for s in range(0, active.numel(), chunk)]
    buf = _Buffer(min(chunk, max(active.numel(), 1)), weight)
    if is_token_separable(x.config):
        flat = ops.flat_inputs(x)
        with ops._autograd_enabled():  # we run inside a custom op: below autograd
            weights = aggregation_weights(x).reshape(1, N)
        for idx in chunks:  # three GEMMs per chunk
            rows = _gather(hidden, idx)
            z = _logits(rows, weight, bias, logit_scale, softcap, buf)
            factor = _chain_factor(z, logit_scale, softcap)
            x_rows = ops.select_rows(flat, idx)
            lp, ent = ops.stats_and_grad_(
                z[None], x_rows.tokens, tau, x_rows, z[None], weights.index_select(1, idx)
            )
            logp.index_copy_(0, idx, lp[0])
            entropy.index_copy_(0, idx, ent[0])
            grads.add(idx, rows, _to_pre_activation(z, factor, logit_scale), weight)
            del z, factor
    else:  # sequence-level options: statistics of every row first (four GEMMs per chunk)
        lse = torch.zeros(N, dtype=torch.float32, device=hidden.device)
        y = tokens.reshape(-1)
        for idx in chunks:
            z = _logits(_gather(hidden, idx), weight, bias, logit_scale, softcap, buf)
            for dst, val in zip((logp, entropy, lse), ops._row_stats(
                    z[None], y.index_select(0, idx)[None], tau)):  # fmt: skip
                dst.index_copy_(0, idx, val[0])
            del z
        g, h = ops.token_grads(logp.view(B, T), entropy.view(B, T), x)
        dh, dw, db = linear_token_stats_backward(
            hidden, weight, bias, tokens, mask, lse, entropy, g.reshape(-1),
            None if h is None else h.reshape(-1), tau, logit_scale, softcap, chunk,
        )  # fmt: skip
        return logp.view(B, T), entropy.view(B, T), dh, dw, db
    dh, dw, db = grads.result(weight, bias)
    return logp.view(B, T), entropy.view(B, T), dh, dw, _bias_or_empty(db, weight)


@torch.library.register_fake("fastrl::linear_policy_grad")
def _(hidden, weight, bias, *args):
    B, T = args[0].shape  # tokens
    V = weight.shape[0] if bias is not None else 0
    stats = [hidden.new_empty((B, T), dtype=torch.float32) for _ in range(2)]
    return (*stats, hidden.new_empty(B * T, weight.shape[1]), torch.empty_like(weight),
            weight.new_empty(V))  # fmt: skip


linear_policy_grad = torch.ops.fastrl.linear_policy_grad.default


# --------------------------------------------------------------------------- public functions
def _check_linear(hidden, weight, bias, logit_scale, softcap, chunk_size):
    """Validate the LM-head arguments; returns (V, H)."""
    for name, t in (("hidden", hidden), ("weight", weight)):
        if not isinstance(t, Tensor) or t.dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"{name} must be a float32 / bfloat16 / float16 tensor, got {describe(t)}"
            )
    if weight.dim() != 2 or hidden.dim() not in (2, 3) or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not fit: expected "
            "hidden (B, T, H) or (N, H) and weight (V, H) with the same H"
        )
    V, H = weight.shape
    if H < 1 or V < 1:
        raise ValueError(f"weight must be (V, H) with V >= 1 and H >= 1, got {tuple(weight.shape)}")
    if weight.device != hidden.device or weight.dtype != hidden.dtype:
        raise ValueError(
            f"weight is {weight.dtype} on {weight.device}; expected the hidden states' "
            f"{hidden.dtype} on {hidden.device}"
        )
    if bias is not None and (
        not isinstance(bias, Tensor)
        or tuple(bias.shape) != (V,)
        or bias.dtype != weight.dtype
        or bias.device != weight.device
    ):
        raise ValueError(f"bias must be a ({V},) tensor like weight, got {describe(bias)}")
    if (
        isinstance(logit_scale, bool)
        or not isinstance(logit_scale, (int, float))
        or not (math.isfinite(logit_scale) and logit_scale > 0)
    ):
        raise ValueError(f"logit_scale must be a finite float > 0, got {logit_scale!r}")
    if softcap is not None and (
        isinstance(softcap, bool)
        or not isinstance(softcap, (int, float))
        or not (math.isfinite(softcap) and softcap > 0)
    ):
        raise ValueError(f"softcap must be None or a finite float > 0, got {softcap!r}")
    if chunk_size is not None and (
        isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1
    ):
        raise ValueError(f"chunk_size must be an int >= 1 or None, got {chunk_size!r}")
    return V, H


def _check_tokens(tokens, hidden: Tensor, V: int) -> None:
    """tokens: int64 / int32, hidden's shape without H, hidden's device; values in [0, V) (read
    on CPU tensors only, outside compiled graphs: no device sync)."""
    if not isinstance(tokens, Tensor) or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be an int64 / int32 tensor, got {describe(tokens)}")
    if tuple(tokens.shape) != tuple(hidden.shape[:-1]) or tokens.device != hidden.device:
        raise ValueError(
            f"tokens must have shape {tuple(hidden.shape[:-1])} (hidden without H) on "
            f"{hidden.device}, got {describe(tokens)}"
        )
    if tokens.device.type == "cpu" and tokens.numel() and not torch.compiler.is_compiling():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"tokens must lie in [0, V) = [0, {V}), got values in [{lo}, {hi}]")


def _autocast_dtype(device: torch.device):
    """The dtype torch.autocast would run `F.linear` in on `device`, or None when it is off."""
    kind = device.type
    if not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def _under_autocast(hidden: Tensor, weight: Tensor, bias: Tensor | None):
    """Inside torch.autocast the LM head runs as `F.linear` would: hidden, weight and bias are
    cast to the autocast dtype (differentiable casts, so an fp32 weight receives an fp32
    gradient) and the fused op then runs with autocast off, in that one dtype. Returns
    (hidden, weight, bias, context)."""
    dtype = _autocast_dtype(hidden.device)
    if dtype is None:
        return hidden, weight, bias, contextlib.nullcontext()
    cast = lambda t: t if t is None or t.dtype == dtype else t.to(dtype)  # noqa: E731
    off = torch.autocast(hidden.device.type, enabled=False)
    return cast(hidden), cast(weight), cast(bias), off


def default_chunk(V: int) -> int:
    """Rows per chunk of the LM-head paths: about 64 MB of fp32 logits (a few such
    temporaries exist at once)."""
    return 2 * chunked.chunk_rows(V)


def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    entropy: bool = False,
    mask: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
):
    """Per-token log-probs (and entropies) of `tokens` under the LM head, never holding (N, V).

    hidden (B, T, H) or (N, H), fp32 / bf16 / fp16, any strides (a `hidden[:, P-1:-1]` view is
    not copied: rows are gathered chunk by chunk); weight (V, H) (and bias (V,)) in the same
    dtype; tokens (B, T) / (N,) int64 / int32 in [0, V); mask like tokens (bool, 0/1 integer or
    float): rows with mask == 0 are skipped (no GEMM work; logp = H = 0 there, zero gradient).

    Math: z = softcap(s (h W^T + b)) with s = logit_scale and softcap(a) = c tanh(a / c) when
    `softcap` = c is set (Gemma), z' = z / temperature, logp_t = z'_y - logsumexp(z'),
    H_t = -sum_j p_j log p_j. Returns fp32 logp shaped like tokens, or (logp, H) with
    `entropy=True`; both differentiable w.r.t. hidden, weight and bias (the exact entropy
    gradient of SPEC 6), through torch.library custom ops (torch.compile traces them).
    Transient memory: a few (chunk_size, V) tensors (default `default_chunk(V)` rows)."""
    hidden, weight, bias, autocast_off = _under_autocast(hidden, weight, bias)
    V, H = _check_linear(hidden, weight, bias, logit_scale, softcap, chunk_size)
    temperature = check_temperature(temperature)
    _check_tokens(tokens, hidden, V)
    if mask is not None:
        mask = check_mask("mask", mask, tuple(tokens.shape), tokens.device, as_float=False)
    with autocast_off:
        logp, ent, _ = linear_token_stats(
            hidden, weight, bias, tokens, mask, temperature, float(logit_scale),
            None if softcap is None else float(softcap), chunk_size or default_chunk(V),
        )  # fmt: skip
    logp, ent = logp.view(tokens.shape), ent.view(tokens.shape)
    return (logp, ent) if entropy else logp


def fused_linear_policy_loss(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    config: LossConfig | str | None = None,
    *,
    bias: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    **overrides,
) -> PolicyLossOutput:
    """`policy_loss(softcap(s (hidden @ weight.T + bias)), ...)` without the (N, V) logits.

    Shapes: hidden (B, T, H) or (N, H) (the lm_head's input, any strides); weight (V, H);
    bias (V,) or None; tokens, advantages, old / ref / rollout log-probs, mask and config exactly
    as in `policy_loss`; logit_scale / softcap as in `linear_logprobs`. Rows with mask == 0 do no
    GEMM work (their logp / entropy are reported as 0). With a token-separable config the
    gradient is computed in the forward: per chunk of rows one logits GEMM, the loss statistics
    and dL/dz in one pass, then dX = dz W and dW += dz^T X (three GEMMs, no recompute); the
    backward scales those gradients by the upstream gradient (no pass when it is 1).
    Sequence-level options (GSPO ratio, sequence IS weights) take two phases (four GEMMs).
    Returns the same PolicyLossOutput as `policy_loss` (loss differentiable w.r.t. hidden,
    weight and bias)."""
    hidden, weight, bias, autocast_off = _under_autocast(hidden, weight, bias)
    V, H = _check_linear(hidden, weight, bias, logit_scale, softcap, chunk_size)
    _check_tokens(tokens, hidden, V)
    x = prepare_policy_inputs(
        None, tokens, advantages, old_logp, ref_logp, mask, rollout_logp, config, overrides
    )
    args = ops.op_inputs(x)
    scale, cap = float(logit_scale), None if softcap is None else float(softcap)
    chunk = chunk_size or default_chunk(V)
    params = [t for t in (hidden, weight, bias) if t is not None]
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in params)
    with autocast_off:
        out, grads = _linear_policy_forward(hidden, weight, bias, x, args, scale, cap, chunk,
                                            wants_grad)  # fmt: skip
    if wants_grad:
        pairs = [(p, gr) for p, gr in zip(params, grads) if p.requires_grad]
        out.loss = ops.attach_grads(out.loss, [p for p, _ in pairs], [gr for _, gr in pairs])
    return out


def _linear_policy_forward(hidden, weight, bias, x, args, scale, cap, chunk, wants_grad):
    """The PolicyLossOutput (loss detached) and, with `wants_grad`, the gradients of
    (hidden, weight[, bias]) computed in the forward."""
    if wants_grad:
        logp, entropy, dh, dw, db = linear_policy_grad(
            hidden.detach(), weight.detach(), None if bias is None else bias.detach(), *args,
            scale, cap, chunk,
        )  # fmt: skip
    else:
        flat_tokens = x.tokens.reshape(-1)
        logp, entropy, _ = linear_token_stats(
            hidden, weight, bias, flat_tokens, x.mask.reshape(-1), x.config.temperature, scale,
            cap, chunk,
        )  # fmt: skip
        logp, entropy = logp.view(x.tokens.shape), entropy.view(x.tokens.shape)
    with torch.no_grad():
        out = policy_output(logp, entropy, x)
    if not wants_grad:
        return out, None
    return out, [dh.view(hidden.shape), dw] + ([] if bias is None else [db])
