"""Public loss functions: the fused `policy_loss` and `logprobs` (and `value_loss`).

The fused policy loss is split in three, so that the (N, V) logits are touched by exactly one op:

1. `fastrl.ops.token_logprobs` (Triton on CUDA, chunked torch on CPU): one pass over each logits
   row gives logp_t = z'_y - lse and H_t = lse - sum_j p_j z'_j (fp32, (B, T)).
2. `fastrl.terms.policy_terms`: every option of SPEC 1-5 as O(N) torch math on (B, T) tensors:
   ratio, clipped / CISPO / SAPO / REINFORCE term, rollout IS weight, KL, entropy bonus,
   aggregation, metrics. Autograd through it yields g_t = dloss/dlogp_t and h_t = dloss/dH_t.
3. the op's backward writes dloss/dz_tj = (1/tau)[g_t(1[j=y_t] - p_tj) - h_t p_tj(log p_tj + H_t)]
   in one more pass over the logits (SPEC 6).

Forward + backward thus read the logits twice and write the gradient once; the only (N, V)
tensor created is the gradient itself (or none, with `inplace=True`). Sequence-level options
(GSPO ratios, sequence IS weights, seq-mean aggregations) are per-sequence reductions in step 2.
"""

from __future__ import annotations

import torch
from torch import Tensor

from . import ops
from ._inputs import (
    check_bool,
    check_logits_tokens,
    check_mask,
    check_temperature,
    check_temperature_rows,
    describe,
    prepare_policy_inputs,
)
from .config import LossConfig
from .linear import fused_linear_policy_loss, linear_logprobs
from .packing import check_cu_seqlens, packing_for_rows
from .terms import PolicyLossOutput, output_of_logprobs, policy_terms
from .value import value_loss

__all__ = [
    "PolicyLossOutput",
    "fused_linear_policy_loss",
    "linear_logprobs",
    "logprobs",
    "policy_loss",
    "policy_loss_from_logprobs",
    "policy_terms",
    "value_loss",
]


def _compiling() -> bool:
    return torch.compiler.is_compiling()


def policy_loss(
    logits: Tensor,
    tokens: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    config: LossConfig | str | None = None,
    *,
    inplace: bool = False,
    check_finite: bool = False,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    **overrides,
) -> PolicyLossOutput:
    """The fused policy loss of SPEC 1-6 (PPO / GRPO / DAPO / Dr.GRPO / GSPO / CISPO / SAPO / ...).

    Shapes (B sequences of T tokens, vocabulary V; or flat N tokens):
        logits        (B, T, V) or (N, V), fp32 / bf16 / fp16. Any strides over B and T: a
                      `logits[:, :-1]` view is read in place. Only a V dimension that is not
                      contiguous (stride(-1) != 1) is copied first.
        tokens        (B, T) or (N,), int64 or int32, in [0, V). Checked on CPU tensors; on CUDA an
                      out-of-range token makes its logp (hence the loss) NaN, never a wrong number.
        advantages    (B,), (B, T), or (N,) / (1, N) with flat inputs
        old_logp, ref_logp, rollout_logp, mask: like tokens (mask bool, 0/1 integer or float
                      >= 0, 1 = counts). Constants of the loss: detached, no gradient flows to
                      them (nor to the advantages), also when they require grad.
        config        a LossConfig, a preset name or None (= ppo); keyword `overrides` replace its
                      fields (num_tokens / num_seqs may be 0-dim tensors: no host sync).
        temperature   (an override) a float, or a tensor of per-token temperatures tau_t: like
                      tokens, (B,) one per sequence (broadcast over T), (S,) per packed sequence
                      or () one for all; any float dtype (used in fp32), finite and > 0 (checked
                      on CPU tensors). A constant: no gradient flows to it (detached).
        cu_seqlens    (S + 1,) int, optional: the flat rows are S packed sequences, sequence i
                      being rows cu_seqlens[i]:cu_seqlens[i + 1] (padding-free batches); then
                      `advantages` may be (S,) (N = S is refused unless each sequence is
                      one row: pass (1, N) then) and every sequence-level option follows the
                      boundaries, equal to the padded (S, T) batch of the same sequences
                      (fastrl.packing). `max_seqlen` (the longest sequence) avoids reading
                      cu_seqlens on the host; seq-mean-token-sum-norm needs `max_len` here.

    Math (SPEC.md): logp_t = z'_y - lse, H_t = lse - sum_j p_j z'_j with z' = z / tau (tau_t, the
    token's own, with a temperature tensor); per-token
    L_t = w_t l_t + beta kl_t - c_H H_t, aggregated by `config.agg`; the gradient is
    dloss/dz_tj = (1/tau)[g_t (1[j=y_t] - p_tj) - h_t p_tj (log p_tj + H_t)], g = dloss/dlogp,
    h = dloss/dH, written in the forward (one pass over the logits on the CPU, a statistics and a
    gradient sweep on the GPU; the backward only scales it
    by the upstream gradient, with no pass at all when that is 1).
    fp16 logits: the gradient is written in the backward instead (`fastrl.logprobs`' backward,
    a second pass over the logits), once the upstream gradient is known: a loss scale
    (torch.amp.GradScaler) then lifts its small entries, p_j g / tau ~ 1e-8 and below, above
    fp16's underflow, as it does for eager code. Formed in the forward and stored in fp16 they
    were flushed to 0 before any scale could reach them (91 % of the entries at V = 4096 with a
    global token count of 16384). bf16 has fp32's range and keeps the one-pass path.

    Returns PolicyLossOutput(loss (0-dim, differentiable w.r.t. logits), logp, entropy, kl (like
    tokens, fp32, detached; 0 at a token whose mask is 0: such a row reaches neither the loss
    nor its gradient, and with a gradient on fp32 / bf16 logits the Triton kernels do not read
    it (the CPU backend skips long runs of such rows), as fused_linear_policy_loss skips it; its
    ratio is 1), metrics (detached 0-dim tensors: clipfrac, clipfrac_low,
    clipfrac_high, dualclip_frac, approx_kl, kl, entropy, ratio_mean, ratio_max, and
    is_weight_mean / is_weight_max / is_clipfrac with rollout IS: the mean of the weights
    applied, after the cap; the largest weight before it, to show how far the sampler
    drifted; the share outside [floor, cap])). Nothing syncs with the host
    unless `check_finite=True`, which raises a ValueError when the loss or the logp of a counted
    token (mask > 0) is NaN / inf (NaN / inf in the logits of a counted row otherwise propagate
    to the loss, never hidden; a masked row's, which reach neither the loss nor its gradient,
    pass the check too).

    inplace=True: this call overwrites the logits' storage with dloss/dlogits (no new (N, V)
    buffer; the gradient that flows back *is* the logits tensor). Safe only when nothing else
    reads those logits after this call: the logits come from a layer whose backward does not
    need its output (an lm_head Linear / matmul, possibly followed by slicing or a division by a
    temperature), no other loss or op in the graph uses the same logits (another loss on them, a
    softmax saved for backward, ...), the caller does not read them after this call, and
    backward runs once (no retain_graph double backward). Misuse detected by autograd's version
    counter raises (the write bumps it), as does a later fastrl call that reads the overwritten
    rows (`policy_loss` on the same or an overlapping slice, `logprobs`, before or after the
    backward: a ValueError at that call); misuse neither can see gives wrong numbers. With a
    non-contiguous V dimension the gradient lands in the internal copy instead.
    Logits that are a slice `base[:, a:b]` of a contiguous (B, S, V) output (the lm_head's,
    sliced to the completion; with a bias, the (B S, V) result F.linear's output views) hand the
    whole base's storage on as its gradient, the rows outside a:b zeroed in the backward: no (B,
    S, V) buffer is made for the slice's backward, and the same rules then hold for the whole
    base (its other rows read 0 after backward). The loss is then a function of the base, not of
    the slice: `torch.autograd.grad(loss, logits)` or `logits.retain_grad()` need inplace=False.
    A second inplace loss on another slice of the same base turns the first to autograd's
    copying form (gradients exact); a third raises autograd's "modified by an inplace operation"
    (use inplace=False for it); one on the same or an overlapping slice is refused (ValueError:
    those rows hold a gradient); under torch.compile, and for fp16 logits (gradient in the
    backward), the slice's own path is taken. fp16 logits are written in the backward, so a
    loss on the same base made *before* the inplace one (whose backward autograd runs after
    the later-made one's) reads its logits after that write: autograd's "modified by an inplace
    operation". In fp16, give inplace=True only to the first loss made on a base.
    The default (inplace=False) allocates the gradient and is always autograd-safe.

    Backend: CUDA -> Triton kernels; CPU -> chunked torch path (bounded memory); override with
    env FASTRL_BACKEND=triton|torch (see fastrl.ops)."""
    inplace, check_finite = check_bool("inplace", inplace), check_bool("check_finite", check_finite)
    check_range = False if _compiling() else None  # None: check the values on CPU only
    x = prepare_policy_inputs(
        logits,
        tokens,
        advantages,
        old_logp,
        ref_logp,
        mask,
        rollout_logp,
        config,
        overrides,
        check_range=check_range,
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
        temperature_tensor=True,
    )
    ops.check_not_overwritten(logits, "policy_loss")
    if torch.is_grad_enabled() and x.logits.requires_grad:
        if inplace:
            _check_inplace(logits)
        if x.logits.dtype == torch.float16:  # the gradient in the backward, after the loss scale
            logp, entropy = ops.token_logprobs(x.logits, x.tokens, x.temperature, inplace, x.mask)
            out = output_of_logprobs(logp, entropy, x)  # (0 at masked tokens, as below)
            logp = logp.detach()
        else:
            weights = ops.loss_weights(x)  # (formed once: the op and the loss's value take them)
            version = ops.storage_version(logits)
            logp, entropy, grad = _policy_grad(x, inplace, weights)
            if inplace:
                ops.note_overwritten(logits, version, grad)
            with torch.no_grad():
                out = ops.policy_output(logp, entropy, x, weights)
            if inplace and not _compiling():  # a slice base[:, a:b]: the base's storage handed on
                out.loss = ops.attach_inplace_grad(out.loss, logits, x.logits, grad)
            else:
                out.loss = ops.attach_grads(out.loss, [x.logits], [grad])
    else:  # (0 at masked tokens, as the fused op gives them, which are not read either)
        logp, entropy = ops.token_logprobs(x.logits, x.tokens, x.temperature, mask=x.mask)
        out = ops.policy_output(logp, entropy, x)
    if check_finite:
        _check_finite(out.loss, x.unflatten(logp), x.unflatten(x.mask))
    return out


def policy_loss_from_logprobs(
    logp: Tensor,
    entropy: Tensor | None,
    advantages: Tensor,
    old_logp: Tensor | None = None,
    ref_logp: Tensor | None = None,
    mask: Tensor | None = None,
    rollout_logp: Tensor | None = None,
    config: LossConfig | str | None = None,
    *,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    **overrides,
) -> PolicyLossOutput:
    """The policy loss of SPEC 1-5 from per-token log-probs someone already has (a trainer's own
    forward, `linear_logprobs`, another engine): the same options, outputs and metrics as
    `policy_loss`, with the loss differentiable w.r.t. `logp` (and `entropy`). A `temperature`
    override (float or tensor) is accepted and, as the log-probs are given, not used.

    Shapes: logp (B, T) or (N,), float (computed in fp32); entropy like logp, or None (then H = 0:
    no entropy bonus allowed, the `entropy` metric is 0); advantages (B,), (B, T) or (N,);
    old_logp / ref_logp / rollout_logp / mask like logp (constants: detached, as in
    `policy_loss`, so no gradient reaches a mask that requires grad); config, overrides and
    packed sequences (`cu_seqlens`, `max_seqlen` with (N,) inputs) as in `policy_loss`. O(N)
    work: the per-token math of `fastrl.terms`, plain autograd."""
    if not isinstance(logp, Tensor) or not logp.is_floating_point() or logp.dim() not in (1, 2):
        raise ValueError(f"logp must be a (B, T) or (N,) float tensor, got {describe(logp)}")
    if entropy is not None and (
        not isinstance(entropy, Tensor)
        or not entropy.is_floating_point()
        or entropy.shape != logp.shape
        or entropy.device != logp.device
    ):
        raise ValueError(
            f"entropy must be None or a float tensor like logp {tuple(logp.shape)} on "
            f"{logp.device}, got {describe(entropy)}"
        )
    x = prepare_policy_inputs(
        None, None, advantages, old_logp, ref_logp, mask, rollout_logp, config, overrides,
        per_token=logp, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, temperature_tensor=True,
    )  # fmt: skip
    if entropy is None and x.config.entropy_coef != 0:
        raise ValueError(
            f"entropy_coef={x.config.entropy_coef} needs the per-token entropy: pass entropy"
        )
    lp = logp.float().reshape(x.mask.shape)
    ent = torch.zeros_like(lp) if entropy is None else entropy.float().reshape(x.mask.shape)
    return output_of_logprobs(lp, ent, x)  # (masked tokens cut from the graph)


def _policy_grad(x, inplace: bool, weights):
    """(logp, entropy, dloss/dlogits) in the forward; the gradient overwrites the logits with
    `inplace` (then the returned gradient is the logits tensor itself, detached). `weights`:
    `ops.loss_weights(x)`."""
    logits = x.logits
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        logits = logits.contiguous()  # the only copy: a V dimension that is not contiguous
    if inplace:
        with torch.no_grad():
            target = logits.detach()  # shares the version counter: autograd sees the write
            logp, entropy = ops.policy_loss_grad_(target, *ops.op_inputs(x, weights))
        return logp, entropy, target
    return ops.policy_loss_grad(logits.detach(), *ops.op_inputs(x, weights))


def _check_inplace(logits: Tensor) -> None:
    """inplace=True writes the gradient into the logits' storage: refuse storage that autograd
    or the caller still owns: a leaf (whatever its base: `x[:, :-1].requires_grad_()` is a
    leaf whose storage is the caller's x) or a view of a leaf (one that requires grad or not);
    expanded / overlapping memory."""
    base = logits._base
    if logits.is_leaf or (base is not None and base.is_leaf):
        raise ValueError(
            f"inplace=True would overwrite logits {tuple(logits.shape)} that are (a view of) a "
            "leaf tensor (one made with requires_grad_(), or its base), i.e. the caller's own "
            "tensor: use inplace=False, or pass "
            "logits produced by an op (e.g. the lm_head's output)"
        )
    if any(st == 0 and n > 1 for st, n in zip(logits.stride(), logits.shape)):
        raise ValueError(
            f"inplace=True needs logits whose entries have their own memory, got shape "
            f"{tuple(logits.shape)} with strides {logits.stride()} (expanded): use inplace=False"
        )


def _check_finite(loss: Tensor, logp: Tensor, mask: Tensor) -> None:
    """Raise if the loss or the logp of a counted token (mask > 0; logp and mask like tokens) is
    NaN / inf (a host sync: opt-in). A masked token's logp reaches nothing: not checked."""
    if not bool(torch.isfinite(loss)):
        raise ValueError(
            f"policy_loss: the loss is {loss.item()} (not finite); check the logits for NaN/inf, "
            "the tokens for values outside [0, V) and a tensor num_tokens / num_seqs for a "
            "value that is not a finite number > 0"
        )
    bad = ~torch.isfinite(logp.detach()) & (mask > 0)
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        raise ValueError(
            f"policy_loss: logp of shape {tuple(logp.shape)} has {int(bad.sum())} non-finite "
            f"value(s) at counted tokens, first at index {where}; check the logits for NaN/inf "
            "and the tokens for "
            "values outside [0, V)"
        )


def logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature: float | Tensor = 1.0,
    entropy: bool = False,
    *,
    mask: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
):
    """Per-token log-probs logp_t = z'_y - lse, z' = z / tau (and entropies H_t when `entropy`).

    logits (B, T, V) or (N, V) fp32 / bf16 / fp16 (any strides over B, T); tokens like logits
    without V, int64 / int32. Returns fp32 logp (and H) shaped like tokens. One streaming pass
    over the logits; differentiable (the backward is SPEC 6 with g = dL/dlogp, h = dL/dH); under
    torch.no_grad it is the fast path for pi_old / pi_ref log-probs (no (N, V) allocation).
    temperature: a float, or a tensor of per-token temperatures tau_t (like tokens, (B,) one per
    sequence, (S,) per packed sequence with `cu_seqlens`, or () one for all; finite, > 0; used in
    fp32): each row z_t is divided by its own tau_t, and the gradient w.r.t. the logits is
    SPEC 6's with 1/tau_t. The temperature is a constant: no gradient flows to it (detached).
    mask: None, or like tokens (bool, 0/1 integer or float >= 0; a constant): a row whose mask
    is 0 (prompt, padding) gives logp = H = 0 and a zero gradient, and is not read, as in
    `linear_logprobs` (the Triton kernels skip each such row; the CPU backend skips runs of
    them long enough to pay, e.g. the padding at a sequence's end). Without it every row is read.
    Packed sequences (`cu_seqlens` (S + 1,) with (N, V) logits) are accepted and checked; the
    rows are independent, so the result is the same as without."""
    check_bool("entropy", entropy)
    if not isinstance(temperature, Tensor):
        temperature = check_temperature(temperature)
    logits3, tokens2, flat = check_logits_tokens(
        logits, tokens, check_range=False if _compiling() else None
    )
    B, T = tokens2.shape
    if cu_seqlens is not None:
        if not flat:
            raise ValueError(
                f"cu_seqlens is given, so logits must be flat (N, V) rows of packed sequences, "
                f"got {tuple(logits.shape)}"
            )
        check_cu_seqlens(cu_seqlens, T)
    if isinstance(temperature, Tensor):
        packing = None
        if cu_seqlens is not None and temperature.dim() == 1:  # (S,) allowed: per sequence
            packing = packing_for_rows(cu_seqlens, T, logits.device)
        temperature = check_temperature_rows(temperature, B, T, flat, logits.device, packing)
    if mask is not None:
        mask = check_mask("mask", mask, tuple(tokens.shape), tokens.device)
    ops.check_not_overwritten(logits, "logprobs")
    logp, ent = ops.token_logprobs(logits3, tokens2, temperature, mask=mask, entropy=entropy)
    if flat:
        logp, ent = logp.squeeze(0), ent.squeeze(0)
    return (logp, ent) if entropy else logp
