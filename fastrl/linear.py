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
statistics and dz (fastrl.ops.stats_and_grad_: one pass on the CPU, two sweeps of the chunk on
the GPU), then dX and dW: three GEMMs, no
recompute. Sequence-level options (GSPO ratio, sequence IS weights) take two phases (statistics
of every chunk, then the per-token gradient, then the logits again: four GEMMs).

Rows whose mask is 0 (prompt and padding positions) are never gathered: no GEMM work, logp = H
= 0 there, zero gradient. Finding them reads the mask's count on the host (one sync per call on
CUDA; the only one). bf16 / fp16 run their GEMMs in that dtype (fp32 accumulation inside the
GEMM); dW and db are accumulated across chunks in fp32 and cast once.

Layout: this module holds the public functions and their input checks; the chunk loops and the
torch.library custom ops are in `fastrl._linear_ops`; `group=` (or a DTensor weight sharded
along the vocabulary) runs `fastrl.vocab_parallel`: each rank's shard of the vocabulary rows,
merged per row by one all-gather of four fp32 (logp_r, H_r, and the shard's max m_r and log s_r).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import ops, vocab_parallel
from ._inputs import (
    FLOAT_DTYPES,
    check_bool,
    check_int,
    check_mask,
    check_number,
    check_temperature,
    check_temperature_rows,
    describe,
    prepare_policy_inputs,
)
from ._linear_ops import (  # noqa: F401 (re-exported: the ops' historical home)
    default_chunk,
    linear_policy_grad,
    linear_token_stats,
    linear_token_stats_backward,
)
from .config import LossConfig
from .packing import check_cu_seqlens, packing_for_rows
from .terms import PolicyLossOutput, output_of_logprobs

__all__ = ["fused_linear_policy_loss", "linear_logprobs"]


# --------------------------------------------------------------------------- input checks
def _check_linear(hidden, weight, bias, logit_scale, softcap, shard=False):
    """Validate the LM-head arguments; returns (V, H). `shard`: weight is one rank's shard of
    the vocabulary rows (V = V_r, which may be 0)."""
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
    if shard and vocab_parallel.is_dtensor(hidden):
        raise ValueError(
            "hidden is a DTensor: the vocab-parallel LM head takes the hidden states as a plain "
            "tensor, the same on every rank (e.g. a replicated DTensor's .to_local())"
        )
    V, H = weight.shape
    if H < 1 or V < (0 if shard else 1):
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
        what = " (this rank's shard of the vocabulary)" if shard else ""
        raise ValueError(
            f"bias must be a ({V},) tensor of weight's dtype {weight.dtype} on {weight.device}"
            f"{what}, got {describe(bias)}"
        )
    check_number("logit_scale", logit_scale, "a float > 0", lambda c: c > 0)
    if softcap is not None:
        check_number("softcap", softcap, "None or a float > 0", lambda c: c > 0)
    return V, H


def _check_tokens(tokens, hidden: Tensor, V: int | None) -> None:
    """tokens: int64 / int32, hidden's shape without H, hidden's device; values in [0, V) (read
    on CPU tensors only, outside compiled graphs: no device sync; V None: not here)."""
    if not isinstance(tokens, Tensor) or tokens.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"tokens must be an int64 / int32 tensor, got {describe(tokens)}")
    if tuple(tokens.shape) != tuple(hidden.shape[:-1]) or tokens.device != hidden.device:
        raise ValueError(
            f"tokens must have shape {tuple(hidden.shape[:-1])} (hidden without H) on "
            f"{hidden.device}, got {describe(tokens)}"
        )
    if V is None:
        return
    if tokens.device.type == "cpu" and tokens.numel() and not torch.compiler.is_compiling():
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"tokens must lie in [0, V) = [0, {V}), got values in [{lo}, {hi}]")


def _autocast_dtype(device: torch.device):
    """The dtype torch.autocast would run `F.linear` in on `device`, or None when it is off or
    does not exist there (`meta`: torch.is_autocast_enabled("meta") raises)."""
    kind = device.type
    if not ops.has_autocast(kind) or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def _under_autocast(hidden: Tensor, weight: Tensor, bias: Tensor | None):
    """Inside torch.autocast the LM head runs as `F.linear` would: hidden, weight and bias are
    cast to the autocast dtype (differentiable casts, so an fp32 weight receives an fp32
    gradient) and the fused op then runs with autocast off, in that one dtype. Returns
    (hidden, weight, bias, context). (A `hidden` that is no tensor is returned as is, for
    `_check_linear` to name.)"""
    if not isinstance(hidden, Tensor):
        return hidden, weight, bias, contextlib.nullcontext()
    dtype = _autocast_dtype(hidden.device)
    if dtype is None:
        return hidden, weight, bias, contextlib.nullcontext()
    cast = lambda t: t if t is None or t.dtype == dtype else t.to(dtype)  # noqa: E731
    off = torch.autocast(hidden.device.type, enabled=False)
    return cast(hidden), cast(weight), cast(bias), off


# --------------------------------------------------------------------------- public functions
def linear_logprobs(
    hidden: Tensor,
    weight: Tensor,
    tokens: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float | Tensor = 1.0,
    entropy: bool = False,
    mask: Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    group=None,
    cu_seqlens: Tensor | None = None,
):
    """Per-token log-probs (and entropies) of `tokens` under the LM head, never holding (N, V).

    hidden (B, T, H) or (N, H), fp32 / bf16 / fp16, any strides (a `hidden[:, P-1:-1]` view is
    not copied: rows are gathered chunk by chunk); weight (V, H) (and bias (V,)) in the same
    dtype; tokens (B, T) / (N,) int64 / int32 in [0, V); mask like tokens (bool, 0/1 integer or
    float): rows with mask == 0 are skipped (no GEMM work; logp = H = 0 there, zero gradient);
    a constant (detached: no gradient flows to a float mask).

    Math: z = softcap(s (h W^T + b)) with s = logit_scale and softcap(a) = c tanh(a / c) when
    `softcap` = c is set (Gemma), z' = z / temperature, logp_t = z'_y - logsumexp(z'),
    H_t = -sum_j p_j log p_j. `temperature`: a float, or a tensor of per-token tau_t (like
    tokens, (B,) one per sequence, (S,) one per packed sequence with `cu_seqlens`, or (); a
    constant: detached, no gradient). Returns fp32 logp shaped like tokens, or (logp, H) with
    `entropy=True`; both differentiable w.r.t. hidden, weight and bias (the exact entropy
    gradient of SPEC 6), through torch.library custom ops (torch.compile traces them).
    Transient memory: a few (chunk_size, V) tensors (default `default_chunk(V, device)` rows:
    ~64 MB of fp32 logits on the CPU, 2048 rows on a GPU).

    Vocab-parallel (`group`: a torch.distributed process group of P ranks, or a `weight` that is
    a DTensor sharded along dim 0 on a 1-D DeviceMesh): weight (V_r, H) and bias (V_r,) are this
    rank's contiguous shard of the vocabulary rows, in rank order (uneven shards allowed);
    hidden, tokens (global ids in [0, V)) and mask are the same on every rank. Each shard's
    per-row (logp_r, H_r, m_r, log s_r) are merged by one all-gather of 4 fp32 per row (16 B
    sent, 16 P B received per counted row; forward); the backward keeps dW_r and db_r local and
    all-reduces dX (N x H in hidden's dtype). Memory: the single-device op's on V_r columns plus
    (P, R, 4) fp32. Runs eagerly (torch.compile graph-breaks around it); see
    `fastrl.vocab_parallel`.

    Packed sequences (`cu_seqlens` (S + 1,) with (N, H) hidden) are accepted and checked; rows
    are independent, so the result is the same as without."""
    chunk_size = check_int("chunk_size", chunk_size, optional=True)  # numpy's integers too
    entropy = check_bool("entropy", entropy)
    if cu_seqlens is not None:
        if not (isinstance(tokens, Tensor) and tokens.dim() == 1):
            raise ValueError(
                f"cu_seqlens is given, so hidden / tokens must be flat (N, H) / (N,) rows of "
                f"packed sequences, got tokens {describe(tokens)}"
            )
        check_cu_seqlens(cu_seqlens, tokens.shape[0])
    if group is not None or vocab_parallel.is_dtensor(weight) or vocab_parallel.is_dtensor(bias):
        return _linear_logprobs_vp(hidden, weight, tokens, bias, temperature, entropy, mask,
                                   logit_scale, softcap, chunk_size, group, cu_seqlens)  # fmt: skip
    hidden, weight, bias, autocast_off = _under_autocast(hidden, weight, bias)
    V, H = _check_linear(hidden, weight, bias, logit_scale, softcap)
    _check_tokens(tokens, hidden, V)
    temperature, tau_rows = _check_linear_temperature(temperature, tokens, cu_seqlens)
    if mask is not None:
        mask = check_mask("mask", mask, tuple(tokens.shape), tokens.device, as_float=False)
    with autocast_off:
        logp, ent, *_ = linear_token_stats(
            hidden, weight, bias, tokens, mask, temperature, float(logit_scale),
            None if softcap is None else float(softcap),
            chunk_size or default_chunk(V, hidden.device), tau_rows, ops.SOURCE_KEY,
        )  # fmt: skip
    logp, ent = logp.view(tokens.shape), ent.view(tokens.shape)
    return (logp, ent) if entropy else logp


def _check_linear_temperature(temperature, tokens: Tensor, cu_seqlens):
    """(float temperature, per-row fp32 (N,) tau or None) of linear_logprobs' `temperature`
    (tokens already checked)."""
    if not isinstance(temperature, Tensor):
        return check_temperature(temperature), None
    flat = tokens.dim() == 1
    B, T = (1, tokens.shape[0]) if flat else tuple(tokens.shape)
    packing = None
    if cu_seqlens is not None and temperature.dim() == 1:  # (S,) allowed: per sequence
        packing = packing_for_rows(cu_seqlens, T, tokens.device)
    rows = check_temperature_rows(temperature, B, T, flat, tokens.device, packing)
    return 1.0, rows.reshape(-1)


def _eager(fn):
    """`fn` run eagerly: under torch.compile a graph break around it (collectives and a host read
    are no graph). torch.compiler.disable is applied at call time, only when compiling: applied
    at import it would import torch._dynamo with fastrl (seconds)."""

    def run(*args):
        if torch.compiler.is_compiling():
            return torch.compiler.disable(fn)(*args)
        return fn(*args)

    return run


@_eager
def _linear_logprobs_vp(hidden, weight, tokens, bias, temperature, entropy, mask, logit_scale,
                        softcap, chunk_size, group, cu_seqlens):  # fmt: skip
    weight, bias, group, shard = vocab_parallel.resolve(weight, bias, group)
    hidden, weight, bias, autocast_off = _under_autocast(hidden, weight, bias)

    def check():
        _check_linear(hidden, weight, bias, logit_scale, softcap, shard=True)
        _check_tokens(tokens, hidden, None)  # the range: against the whole vocabulary, in plan
        tau, tau_rows = _check_linear_temperature(temperature, tokens, cu_seqlens)
        tau = tau if tau_rows is None else tau_rows  # a float, or fp32 (N,) per row
        m = None if mask is None else check_mask("mask", mask, tuple(tokens.shape),
                                                 tokens.device, as_float=False)  # fmt: skip
        return tau, m, tau, vocab_parallel.call_constants(logit_scale, softcap)

    params = [t for t in (hidden, weight, bias) if isinstance(t, Tensor)]
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in params)
    tau, plan = vocab_parallel.plan(
        group, shard, check, weight, tokens, chunk_size, hidden, wants_grad
    )
    with autocast_off:
        logp, ent = vocab_parallel.linear_logprobs(
            hidden, weight, bias, tokens, tau, float(logit_scale),
            None if softcap is None else float(softcap), plan,
        )  # fmt: skip
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
    group=None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    **overrides,
) -> PolicyLossOutput:
    """`policy_loss(softcap(s (hidden @ weight.T + bias)), ...)` without the (N, V) logits.

    Shapes: hidden (B, T, H) or (N, H) (the lm_head's input, any strides); weight (V, H);
    bias (V,) or None; tokens, advantages, old / ref / rollout log-probs, mask, config and
    packed sequences (`cu_seqlens`, `max_seqlen` with (N, H) hidden) exactly as in
    `policy_loss`, the `temperature` override included (a float, or a tensor of per-token
    tau_t as in `policy_loss`); logit_scale / softcap / chunk_size as in `linear_logprobs` (rows
    per GEMM: a few (chunk_size, V) buffers live at once). Rows with mask == 0 do no GEMM work
    (their logp / entropy are reported as 0). With a token-separable config the
    gradient is computed in the forward: per chunk of rows one logits GEMM, the loss statistics
    and dL/dz (fastrl.ops.stats_and_grad_), then dX = dz W and dW += dz^T X (three GEMMs, no
    recompute); the backward scales those gradients by the upstream gradient (no pass when it is 1).
    Sequence-level options (GSPO ratio, sequence IS weights) take two phases (four GEMMs). In
    fp16 (hidden states, or torch.autocast's dtype) the gradient waits for the backward
    (`linear_logprobs`' backward: the logits GEMM again, four GEMMs), so that a loss scale
    (torch.amp.GradScaler) reaches dz before fp16 would flush its small entries to 0, as in
    eager code (see `fastrl.policy_loss`).
    Returns the same PolicyLossOutput as `policy_loss` (loss differentiable w.r.t. hidden,
    weight and bias).

    Vocab-parallel (`group`, or a DTensor weight), as in `linear_logprobs`: weight / bias are
    this rank's shard, every per-token input is replicated, and loss, logp, H and metrics are the
    same on every rank. Per chunk of counted rows one all-gather of 4 fp32 per row (16 B sent,
    16 P B received) merges the shards' statistics before g, h and dz (sequence-level options:
    one all-gather for all rows, then the gradient pass); dW_r, db_r stay local and dX (N x H,
    hidden's dtype) is all-reduced once, in the forward (fp16: in the backward, as above)."""
    chunk_size = check_int("chunk_size", chunk_size, optional=True)  # numpy's integers too
    if group is not None or vocab_parallel.is_dtensor(weight) or vocab_parallel.is_dtensor(bias):
        return _fused_linear_policy_loss_vp(
            hidden, weight, tokens, advantages, old_logp, ref_logp, mask, rollout_logp, config,
            bias, logit_scale, softcap, chunk_size, group, overrides, cu_seqlens, max_seqlen,
        )  # fmt: skip
    hidden, weight, bias, autocast_off = _under_autocast(hidden, weight, bias)
    V, H = _check_linear(hidden, weight, bias, logit_scale, softcap)
    _check_tokens(tokens, hidden, V)
    x = prepare_policy_inputs(
        None, tokens, advantages, old_logp, ref_logp, mask, rollout_logp, config, overrides,
        cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, temperature_tensor=True,
    )  # fmt: skip
    weights = ops.loss_weights(x)  # (formed once: the op and the loss's value take them)
    args = ops.op_inputs(x, weights)
    scale, cap = float(logit_scale), None if softcap is None else float(softcap)
    chunk = chunk_size or default_chunk(V, hidden.device)
    params = [t for t in (hidden, weight, bias) if t is not None]
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in params)
    if wants_grad and hidden.dtype == torch.float16:  # the gradient after the loss scale
        with autocast_off:
            logp, entropy = _linear_stats(hidden, weight, bias, x, scale, cap, chunk, mask is None)
            return output_of_logprobs(logp, entropy, x)
    with autocast_off:
        out, grads = _linear_policy_forward(hidden, weight, bias, x, weights, args, scale, cap,
                                            chunk, wants_grad, all_rows=mask is None)  # fmt: skip
    return _attach(out, params, grads, wants_grad)


def _attach(out: PolicyLossOutput, params, grads, wants_grad) -> PolicyLossOutput:
    """out.loss made differentiable w.r.t. `params`, whose gradients `grads` are known."""
    if wants_grad:
        pairs = [(p, gr) for p, gr in zip(params, grads) if p.requires_grad]
        out.loss = ops.attach_grads(out.loss, [p for p, _ in pairs], [gr for _, gr in pairs])
    return out


def _linear_stats(hidden, weight, bias, x, scale, cap, chunk, all_rows):
    """(logp, H) fp32 shaped like x.tokens of the policy inputs `x` under the LM head, through
    the differentiable op (`linear_token_stats`: its backward forms dz from the upstream
    gradient). `all_rows`: no mask was given (the op then reads none: no host sync)."""
    tau_rows = None if x.temperature_rows is None else x.temperature_rows.reshape(-1)
    logp, entropy, *_ = linear_token_stats(
        hidden, weight, bias, x.tokens.reshape(-1), None if all_rows else x.mask.reshape(-1),
        x.config.temperature, scale, cap, chunk, tau_rows, ops.SOURCE_KEY,
    )  # fmt: skip
    return logp.view(x.tokens.shape), entropy.view(x.tokens.shape)


def _linear_policy_forward(hidden, weight, bias, x, weights, args, scale, cap, chunk, wants_grad,
                           all_rows):  # fmt: skip
    """The PolicyLossOutput (loss detached) and, with `wants_grad`, the gradients of
    (hidden, weight[, bias]) computed in the forward. `weights`: ops.loss_weights(x) (also in
    `args`). `all_rows`: no mask was given, so every row counts (the ops then take all rows
    without reading the mask: no host sync)."""
    if wants_grad:
        logp, entropy, dh, dw, db = linear_policy_grad(
            hidden.detach(), weight.detach(), None if bias is None else bias.detach(), *args,
            scale, cap, chunk, all_rows,
        )  # fmt: skip
    else:
        logp, entropy = _linear_stats(hidden, weight, bias, x, scale, cap, chunk, all_rows)
    with torch.no_grad():
        out = ops.policy_output(logp, entropy, x, weights)
    if not wants_grad:
        return out, None
    return out, [dh.view(hidden.shape), dw] + ([] if bias is None else [db])


@_eager
def _fused_linear_policy_loss_vp(hidden, weight, tokens, advantages, old_logp, ref_logp, mask,
                                 rollout_logp, config, bias, logit_scale, softcap, chunk_size,
                                 group, overrides, cu_seqlens, max_seqlen):  # fmt: skip
    weight, bias, group, shard = vocab_parallel.resolve(weight, bias, group)
    hidden, weight, bias, autocast_off = _under_autocast(hidden, weight, bias)

    def check():
        _check_linear(hidden, weight, bias, logit_scale, softcap, shard=True)
        _check_tokens(tokens, hidden, None)  # the range: against the whole vocabulary, in plan
        x = prepare_policy_inputs(
            None, tokens, advantages, old_logp, ref_logp, mask, rollout_logp, config, overrides,
            cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, temperature_tensor=True,
        )  # fmt: skip
        # no mask given: every row counts, found without reading one (torch.nonzero: a sync)
        consts = vocab_parallel.call_constants(logit_scale, softcap, x.config)
        return x, None if mask is None else x.mask, vocab_parallel.row_temperature(x), consts

    params = [t for t in (hidden, weight, bias) if isinstance(t, Tensor)]
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in params)
    x, plan = vocab_parallel.plan(
        group, shard, check, weight, tokens, chunk_size, hidden, wants_grad
    )
    cap = None if softcap is None else float(softcap)
    if wants_grad and hidden.dtype == torch.float16:  # the gradient after the loss scale
        with autocast_off:
            logp, entropy = vocab_parallel.linear_logprobs(
                hidden, weight, bias, x.tokens, vocab_parallel.row_temperature(x),
                float(logit_scale), cap, plan,
            )  # fmt: skip
            return output_of_logprobs(logp, entropy, x)
    with autocast_off, torch.no_grad():
        logp, entropy, grads = vocab_parallel.policy_grads(
            hidden.detach(), weight.detach(), None if bias is None else bias.detach(), x,
            float(logit_scale), cap, plan, wants_grad,
        )  # fmt: skip
        out = ops.policy_output(logp, entropy, x)
    if wants_grad:
        dh, dw, db = grads
        grads = [dh.view(hidden.shape), dw] + ([] if bias is None else [db])
    return _attach(out, params, grads, wants_grad)
