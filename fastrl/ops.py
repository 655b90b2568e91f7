"""The fused per-token ops, as torch.library custom ops with autograd, and their backend dispatch.

Two ways through the (B, T, V) logits, both reading them once per use:

* `token_logprobs(logits, tokens, temperature, inplace)` -> fp32 (logp, entropy), each (B, T)
  (`fastrl.logprobs`, and any loss of the caller's own). Autograd hands its backward
  g = dL/dlogp and h = dL/dH per token, and the backward writes SPEC 6's gradient

      dL/dz_tj = (1/tau) * [ g_t * (1[j = y_t] - p_tj) - h_t * p_tj * (log p_tj + H_t) ]

  in one pass over the logits (no (N, V) intermediate besides the gradient itself).
* `policy_loss_grad` / `policy_loss_grad_` (in place): fastrl's own policy loss, whose g and h are
  O(N) functions of (logp, H) and the per-token inputs (`token_grads`: autograd on
  `terms.token_terms`, one implementation of SPEC 1-5). The forward computes the
  statistics, g, h and dL/dz together; the backward (`scale_grad_`) only multiplies by
  grad_output, and skips even that when it is exactly 1. On the torch path a token-separable
  loss (token-level ratio) is done chunk by chunk in ONE pass: per chunk of `chunk_rows(V)` rows
  one exp per logit gives the statistics and e = exp(z' - m), then g and h of those rows, then
  dL/dz = e * (...) written once in the logits' dtype; the element-wise work runs in
  cache-sized blocks of `sub_rows(V)` rows. Sequence-level options (GSPO, sequence IS weights)
  need every row's statistics first: e goes to the gradient buffer (fp32; in bf16 / fp16 the
  second pass forms e again from the logits), a second pass finishes it.

Registered ops (namespace "fastrl", so torch.compile(fullgraph=True) traces through them):
  fastrl::token_logprobs(logits, tokens, temperature, inplace, temperature_rows=None,
      skip=None, with_entropy=True) -> (logp, entropy, m, log_s)  # (B, T); m = max_j z'_j,
      log s = lse - m (for the backward); rows where the mask `skip` is 0: logp = H = 0, not
      read, zero gradient; with_entropy False: H not to be read (the CPU skips forming it)
  fastrl::token_stats_grad(logits, tokens, logp, m, log_s, entropy, g, h, temperature,
      temperature_rows=None, skip=None) -> grad (B, T, V)
  fastrl::token_stats_grad_(logits, ...) -> ()   # writes the gradient into `logits` (in-place)
  fastrl::policy_loss_grad(logits, tokens, <per-token inputs>, config) -> (logp, H, grad)
  fastrl::policy_loss_grad_(logits, ...) -> (logp, H)   # the gradient overwrites `logits`
  fastrl::scale_grad_(grad, scale) -> ()

Backends (chosen per call at run time, so also inside compiled graphs):
  * FASTRL_BACKEND unset / "auto": Triton kernels (fastrl/kernels/policy_loss.py) for CUDA
    tensors, the chunked torch path for CPU tensors;
  * FASTRL_BACKEND=triton: the Triton kernels on any device (on CPU with TRITON_INTERPRET=1);
  * FASTRL_BACKEND=torch: the chunked torch path on any device.
The chunked torch path (`fastrl.chunked`) processes `chunk_rows(V)` rows at a time (about
CHUNK_BYTES of fp32 per temporary, SUB_BYTES per cache-sized block), so its transient memory is
bounded and independent of N; it never makes an fp32 copy of all the logits.

Float hyper-parameters: the op schemas take `temperature` as a Python float (a double in the
schema, and what Inductor passes); it is turned into an fp32 1/tau (Triton scalar argument) or
used as a weak Python scalar on fp32 tensors (torch path), never promoting anything to fp64.

Per-token temperature: `Tensor? temperature_rows` (fp32 (B, T), one tau_t per row, detached; the
op's `float temperature` is then ignored) makes every formula above use the row's own tau_t:
z'_tj = z_tj / tau_t, and dL/dz_tj = (1/tau_t)[g_t (1[j = y_t] - p_tj) - h_t p_tj (log p_tj + H_t)].
The temperature is a constant of the loss: no gradient flows to it. The backends take either
form as their `temperature` argument (a float, or the (B, T) tensor: Triton's ROW_TEMP kernels,
the torch path's per-chunk (R, 1) column); `temperature_arg` picks it.
"""

from __future__ import annotations

import contextlib
import os

import torch
from torch import Tensor

from . import chunked
from ._op_args import (  # noqa: F401 (the ops' argument helpers, used as ops.<name>)
    POLICY_ARGS_SCHEMA,
    SOURCE_KEY,
    config_from_key,
    config_key,
    flat_inputs,
    op_inputs,
    policy_inputs_from_op,
    select_rows,
)

BACKENDS = ("auto", "triton", "torch")


def backend(device: torch.device):
    """The backend module of `device`: `fastrl.kernels.policy_loss` (Triton) or `fastrl.chunked`
    (torch). Both expose row_stats, row_grad_ and scale_ (see fastrl.chunked)."""
    if backend_for(device) == "triton":
        from .kernels import policy_loss as triton_backend

        return triton_backend
    return chunked


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


# --------------------------------------------------------------------------- custom ops
def _check_v_contiguous(logits: Tensor) -> None:
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        raise ValueError(
            f"logits {tuple(logits.shape)} with strides {logits.stride()}: the V dimension must "
            "be contiguous here (fastrl.policy_loss / logprobs copy such inputs first)"
        )


def temperature_arg(temperature, temperature_rows: Tensor | None = None):
    """The `temperature` argument of the backends: `temperature_rows` (per-row tau, (B, T) or
    any shape with one value per row; detached, fp32) when given, else the float."""
    if temperature_rows is not None:
        return temperature_rows.detach().float()
    if isinstance(temperature, Tensor):
        return temperature.detach().float()
    return float(temperature)


def _row_stats(
    logits: Tensor, tokens: Tensor, temperature, temperature_rows=None, skip=None, entropy=True
):
    """(logp, entropy, m, log_s), each fp32 (B, T), of logits (B, T, V) and tokens (B, T):
    m = max_j z'_j and log s = log sum_j exp(z'_j - m) (lse = m + log s), what `_row_grad_`
    needs for p_j = exp((z'_j - m) - log s), exact at any offset of the logits (exp(z'_j - lse)
    would carry lse's rounding at its own scale, eps |lse|, into every p_j).
    temperature: a float, or a (B, T) tensor of per-row temperatures (as is `temperature_rows`,
    which replaces it when given). skip: None, or a (B, T) mask: logp = H = 0 where it is 0,
    rows the backend need not read (the Triton kernels do not; the CPU skips long runs).
    entropy False: the caller never reads H (the CPU backend then does not form it)."""
    _check_v_contiguous(logits)
    tau = temperature_arg(temperature, temperature_rows)
    logp, entropy, lse, shifted = backend(logits.device).row_stats(
        logits, tokens, tau, shift=True, skip=skip, entropy=entropy
    )
    m, log_s = (lse, lse.clone()) if shifted is None else shifted  # (None: no rows)
    return logp, entropy, m, log_s


def _row_grad_(
    logits,
    tokens,
    logp,
    m,
    log_s,
    entropy,
    g,
    h,
    temperature,
    out: Tensor,
    temperature_rows=None,
    skip=None,
) -> Tensor:
    """SPEC 6's dL/dz of logits (B, T, V) written into `out` (may be `logits`) from the (B, T)
    statistics of `_row_stats` (logp, m, log_s, entropy) and g, h (h None: 0); temperature and
    `skip` as in `_row_stats` (the rows where skip is 0 get a zero gradient, unread: g and h
    are zeroed there first, so an upstream gradient at such a row reaches nothing)."""
    tau = temperature_arg(temperature, temperature_rows)
    if skip is not None:
        counted = skip.reshape(g.shape) > 0
        g = torch.where(counted, g, 0.0)
        h = None if h is None else torch.where(counted, h, 0.0)
    return backend(logits.device).row_grad_(
        logits, tokens, logp, None, entropy, g, h, tau, out, (m, log_s), skip=skip
    )


def _define_grad_op(inplace: bool):
    """fastrl::token_stats_grad -> dL/dz (B, T, V) in the logits' dtype, contiguous, or
    (`inplace`) fastrl::token_stats_grad_, which overwrites `logits` with it: SPEC 6 from the
    row statistics (logp, m, log_s, entropy) and g = grad_logp, h = grad_entropy (None: h = 0),
    all (B, T); temperature_rows (B, T) fp32, when given, is each row's own tau (replacing
    `temperature`); skip (B, T) fp32, when given: rows where it is 0 get a zero gradient,
    unread."""
    name = "fastrl::token_stats_grad" + ("_" if inplace else "")
    logits_arg = "Tensor(a!) logits" if inplace else "Tensor logits"
    args = (
        "Tensor tokens, Tensor logp, Tensor m, Tensor log_s, Tensor entropy, Tensor g, Tensor? h, "
        "float temperature, Tensor? temperature_rows=None, Tensor? skip=None"
    )
    torch.library.define(name, f"({logits_arg}, {args}) -> {'()' if inplace else 'Tensor'}")

    @torch.library.impl(name, "default")
    def impl(
        logits, tokens, logp, m, log_s, entropy, g, h, temperature, temperature_rows=None, skip=None
    ):
        _check_v_contiguous(logits)
        out = logits if inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)
        stats = (logp, m, log_s, entropy, g, h)
        _row_grad_(logits, tokens, *stats, temperature, out, temperature_rows, skip)
        return None if inplace else out

    @torch.library.register_fake(name)
    def fake(logits, *args):
        return None if inplace else torch.empty_like(logits, memory_format=torch.contiguous_format)

    return getattr(torch.ops.fastrl, name.split("::")[1]).default


token_stats_grad = _define_grad_op(inplace=False)
token_stats_grad_ = _define_grad_op(inplace=True)


# --------------------------------------------------------------------------- autograd
@torch.library.custom_op("fastrl::token_logprobs", mutates_args=())
def _token_logprobs_op(
    logits: Tensor,
    tokens: Tensor,
    temperature: float,
    inplace: bool,
    temperature_rows: Tensor | None = None,
    skip: Tensor | None = None,
    with_entropy: bool = True,
    source: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy, m, log_s) fp32 (B, T) of logits (B, T, V) (`_row_stats`: m and log s
    are for the backward); `inplace` is read by the backward
    only (the gradient overwrites the logits). temperature_rows: None, or fp32 (B, T) per-row
    temperatures replacing `temperature` (a constant: no gradient). skip: None, or an fp32 (B, T)
    mask: rows where it is 0 give logp = H = 0 and a zero gradient, and are not read (the CPU:
    long runs of them). with_entropy False: the entropy output is not to be read (the CPU does
    not form it; nor may its gradient be used). source: SOURCE_KEY, unused here (it keys
    torch.compile's caches to this version of the backward: _op_args)."""
    return _row_stats(logits, tokens, temperature, temperature_rows, skip, with_entropy)


@_token_logprobs_op.register_fake
def _(
    logits, tokens, temperature, inplace, temperature_rows=None, skip=None, with_entropy=True,
    source="",
):  # fmt: skip
    B, T, _ = logits.shape
    return tuple(logits.new_empty((B, T), dtype=torch.float32) for _ in range(4))


def _setup_context(ctx, inputs, output):
    logits, tokens, temperature, inplace, temperature_rows, skip, _, _ = inputs
    logp, entropy, m, log_s = output
    ctx.save_for_backward(logits, tokens, logp, m, log_s, entropy, temperature_rows, skip)
    ctx.temperature = temperature
    ctx.inplace = inplace
    ctx.mark_non_differentiable(m, log_s)


def has_autocast(kind: str) -> bool:
    """torch.amp.is_autocast_available(kind) (False on `meta`, where torch.autocast raises),
    asked outside torch.compile only: dynamo in torch 2.11 cannot trace it (a graph break, an
    error under fullgraph=True), and a compiled graph runs on a device that has autocast."""
    if kind == "meta":
        return False
    return torch.compiler.is_compiling() or torch.amp.is_autocast_available(kind)


def refuse_double_backward(op: str) -> None:
    """Raise a clear error when a backward runs with create_graph=True: fastrl's backwards are
    custom kernels with no derivative of their own, so a gradient of the gradient (gradient
    penalties, Hessian-vector products) would be missing or zero, never right."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise RuntimeError(
            f"fastrl.{op}: backward with create_graph=True (a gradient of the gradient) is not "
            "supported: the fused backward has no derivative of its own. Use plain autograd "
            "(e.g. torch.log_softmax and gather on the logits) where second derivatives are needed"
        )


def _backward(ctx, grad_logp, grad_entropy, grad_m, grad_log_s):
    refuse_double_backward("logprobs")
    logits, tokens, logp, m, log_s, entropy, tau_rows, skip = ctx.saved_tensors
    if grad_logp is None:
        grad_logp = torch.zeros_like(logp)
    args = (logits, tokens, logp, m, log_s, entropy, grad_logp, grad_entropy, ctx.temperature,
            tau_rows, skip)  # fmt: skip
    if ctx.inplace:
        version = storage_version(logits)
        token_stats_grad_(*args)
        torch.autograd.graph.increment_version(logits)
        note_overwritten(logits, version, logits)  # (a later fastrl read of them is refused)
        return logits.detach(), None, None, None, None, None, None, None
    return token_stats_grad(*args), None, None, None, None, None, None, None


_token_logprobs_op.register_autograd(_backward, setup_context=_setup_context)


def token_logprobs(
    logits: Tensor,
    tokens: Tensor,
    temperature=1.0,
    inplace: bool = False,
    mask=None,
    entropy: bool = True,
) -> tuple[Tensor, Tensor]:
    """Differentiable per-token (logp, entropy), fp32 (B, T), of logits (B, T, V), tokens (B, T).

    temperature: a float, or a (B, T) (or ()) tensor of per-token temperatures tau_t (detached,
    checked by the caller: finite, > 0); no gradient flows to it (a constant).
    One pass over the logits forward; one pass (reading them again and writing dL/dz) backward.
    A V dimension that is not contiguous is copied first (the only copy this op makes).
    `inplace=True` makes the backward write dL/dz into the logits' storage (see
    fastrl.policy_loss for when that is safe). mask: None, or (B, T) (checked by the caller:
    finite, >= 0): a row whose mask is 0 is not read (the CPU: long runs of them), its logp and
    H are 0 and its gradient is 0, whatever the upstream gradient there. entropy=False: the
    returned H is not to be read (nor differentiated): the CPU then skips forming it."""
    if logits.shape[-1] > 1 and logits.stride(-1) != 1:
        logits = logits.contiguous()
    skip = None if mask is None else mask.detach().reshape(tokens.shape).float().contiguous()
    tau, rows = 1.0, None  # a float tau, or (B, T) per-row temperatures (the float then unused)
    if isinstance(temperature, Tensor):  # (B, T) per token, or () for all
        rows = temperature.detach().float()
        rows = rows.expand(tokens.shape) if rows.dim() == 0 else rows.reshape(tokens.shape)
    else:
        tau = float(temperature)
    logp, ent, *_ = _token_logprobs_op(
        logits, tokens, tau, bool(inplace), rows, skip, bool(entropy), SOURCE_KEY
    )
    return logp, ent


# ======================================================================= gradient in the forward
# When the loss is a function of the per-token (logp, H) only, its gradient w.r.t. the logits is
# known as soon as the forward has seen each row: g_t = dloss/dlogp_t and h_t = dloss/dH_t come
# from O(N) autograd on the per-token terms (`token_grads`), and SPEC 6 turns them into dL/dz.
# The fused losses therefore compute dL/dz in the forward and keep it; their backward only
# multiplies it by the upstream gradient (`scale_grad_`, no pass at all when that is exactly 1).
# The torch path does it chunk by chunk with one exp per logit (`fastrl.chunked`); the Triton
# path runs one program per row for a token-separable loss (g and h written out in the kernel,
# from `terms.TokenGradTerms`), else its stats kernel, the same O(N) autograd and its gradient
# kernel (two reads of the logits).


def token_grads(logp: Tensor, entropy: Tensor, x, weights: Tensor | None = None):
    """g = dloss/dlogp and h = dloss/dH (fp32, like logp; h None without an entropy bonus) by
    autograd on the O(N) per-token terms of SPEC 1-5 (`fastrl.reference`, one implementation).

    weights None: the whole loss (`policy_terms`; any option, sequence-level ones included).
    weights (c_t = dloss/dL_t from `aggregation_weights`): sum_t c_t L_t over the given rows
    only, exact when `is_token_separable(x.config)` (then rows can be processed chunk by chunk)."""
    from .terms import aggregate, token_terms

    if weights is None and x.packing is not None:  # packed rows: the padded sequences' loss
        pack = x.packing
        g, h = token_grads(pack.pad(logp.float()), pack.pad(entropy.float()), pack.padded_inputs(x))
        return pack.unpad(g), None if h is None else pack.unpad(h)
    cfg = x.config
    with_entropy = cfg.entropy_coef != 0

    def loss_fn(lp: Tensor, ent: Tensor) -> Tensor:
        per_token = token_terms(lp, ent, x).per_token_loss
        if weights is None:
            return aggregate(per_token, x.mask, cfg.agg, x.num_tokens, x.num_seqs, cfg.max_len)
        # c_t already carries m_t (it is d loss / d L_t of the masked aggregate): multiplying by
        # the mask again would weight a fractional mask twice (m² for m); the mask here only
        # keeps a NaN at an uncounted token out of the sum.
        return torch.where(x.mask > 0, per_token * weights, 0.0).sum()

    with _autograd_enabled():
        lp = logp.detach().float().requires_grad_()
        ent = entropy.detach().float().requires_grad_(with_entropy)
        loss = loss_fn(lp, ent)
        leaves = (lp, ent) if with_entropy else (lp,)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True) if loss.requires_grad else ()
    g = grads[0] if grads and grads[0] is not None else torch.zeros_like(lp)
    h = grads[1] if len(grads) > 1 and grads[1] is not None else None
    # Uncounted tokens get g = h = 0 exactly (autograd can leave 0 · NaN = NaN there when their
    # logp is NaN), and a backend writes such a row's gradient as zeros. A counted token whose
    # logp is NaN (a NaN / +inf logit in its row) gets g = NaN, so that its row's gradient is NaN
    # on every backend (autograd through a clamp, whose backward is 0 at NaN, could give g = 0).
    counted = x.mask > 0
    g = torch.where(counted, torch.where(torch.isnan(lp.detach()), float("nan"), g.detach()), 0.0)
    return g, None if h is None else torch.where(counted, h.detach(), 0.0)


_AUTOGRAD_KEYS = tuple(
    getattr(torch._C.DispatchKey, k)
    for k in ("AutogradFunctionality", "ADInplaceOrView", "AutogradOther", "AutogradCPU",
              "AutogradCUDA")
    if hasattr(torch._C.DispatchKey, k)
)  # fmt: skip


@contextlib.contextmanager
def _autograd_enabled():
    """Autograd on for O(N) per-token math, also inside a custom op's implementation (which
    torch.library runs below the autograd dispatch keys) and inside compiled graphs."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    include = torch._C._dispatch_tls_local_include_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    with torch._C._ForceDispatchKeyGuard(include, exclude), torch.enable_grad():
        yield


def stats_and_grad_(logits: Tensor, tokens: Tensor, temperature, x, out: Tensor, weights=None):
    """(logp, entropy) fp32 (B, T) of logits (B, T, V), and dL/dz written into `out` (B, T, V)
    (which may be `logits`), where (g, h) = token_grads(logp, entropy, x, weights) (see there).
    temperature: a float, or a (B, T) tensor of per-row temperatures (e.g. x.temperature_rows,
    or its rows of a chunk).
    The backend's `stats_and_grad_` does the passes: one exp per logit on the torch path, in one
    pass over the logits when the loss is token-separable (then it finishes rows chunk by chunk
    with `rows_grads`); on Triton the statistics kernel, (g, h) from one O(N) kernel of
    `row_terms` (token-separable; else from grad_fn, torch) and the gradient kernel, or with
    FASTRL_ONE_PASS=1 the one-pass kernel. A row whose mask is 0 reaches neither the loss nor
    its gradient: the Triton kernels do not read it, and every backend returns logp = H = 0
    there (and a zero gradient row)."""
    from .terms import aggregation_weights, is_token_separable, token_grad_terms

    def grad_fn(lp, ent):  # (g, h) of every row
        return token_grads(lp, ent, x, weights)

    def every_weight():  # c_t = dloss/dL_t of every row
        if weights is not None:
            return weights
        with _autograd_enabled():  # inside a custom op: below autograd
            return aggregation_weights(x)

    rows_grads = row_terms = None
    if is_token_separable(x.config):

        def row_terms():  # the loss as the Triton kernels take it (token_grads, one pass)
            return token_grad_terms(x, every_weight())

        def rows_grads():  # (g, h) of rows r0:r1 alone, from their weights c_t = dloss/dL_t
            flat, w = flat_inputs(x), every_weight().reshape(1, -1)

            def rows_grad_fn(r0, r1, lp, ent):
                rows = select_rows(flat, slice(r0, r1))
                g, h = token_grads(lp[None], ent[None], rows, w[:, r0:r1])
                return g[0], None if h is None else h[0]

            return rows_grad_fn

    kernels = backend(logits.device)
    tau = temperature_arg(temperature)
    return kernels.stats_and_grad_(
        logits, tokens, tau, grad_fn, out, rows_grads, row_terms, skip=x.mask
    )


# --------------------------------------------------------------------------- loss and metrics
def loss_weights(x) -> Tensor | None:
    """The aggregation weights c_t of x's loss when it is token-separable (what its gradient
    and, on the Triton path, its value are formed from), else None: formed once per call by the
    losses and handed to the op and to `policy_output`."""
    from .terms import aggregation_weights, is_token_separable

    return aggregation_weights(x) if is_token_separable(x.config) else None


def policy_output(logp: Tensor, entropy: Tensor, x, weights: Tensor | None = None):
    """`fastrl.terms.policy_output` (the loss, kl, ratio and metrics of SPEC 1-5 from logp and
    H), with the per-token math of a token-separable loss on the Triton backend in one O(N)
    kernel and a handful of reductions (`kernels.policy_terms`) instead of about 50 torch ops,
    each a launch on a GPU. Taken when no gradient flows through it (the fused losses attach
    theirs, computed in the forward; a no-grad call) and not while torch.compile traces (its
    fusion of the torch math is better there); otherwise, and on the torch backend, the torch
    math itself. `weights`: x's aggregation weights when the caller has them (`loss_weights`),
    else they are formed here."""
    from . import terms

    cfg = x.config
    wants_grad = torch.is_grad_enabled() and (logp.requires_grad or entropy.requires_grad)
    # (the kl of a sequence-ratio bias correction couples a sequence's tokens: with kl_coef = 0
    # the loss is still token-separable, its kl output and metric are not)
    seq_kl = cfg.kl_bias_correction and cfg.kl_bias_ratio == "sequence" and x.ref_logp is not None
    if (
        wants_grad
        or seq_kl
        or not terms.is_token_separable(cfg)
        or backend_for(logp.device) != "triton"
        or torch.compiler.is_compiling()
    ):
        return terms.policy_output(logp, entropy, x)
    from .kernels import policy_terms

    N = x.mask.numel()

    def flat(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.detach().reshape(N).float().contiguous()

    zero = torch.zeros((), dtype=torch.float32, device=logp.device)  # (torch.where's 0)
    if weights is None:
        weights = terms.aggregation_weights(x)
    inputs = terms.token_grad_terms(x, weights, logp)
    kl, ratio, totals, top = policy_terms.policy_terms(
        flat(logp), flat(entropy), flat(x.mask), inputs
    )
    # masked means as terms.masked_means forms them: 0 when nothing counts
    any_counted = totals[1] > 0
    means = torch.where(any_counted, totals[2:] / totals[1].clamp(min=1e-20), zero)
    metrics = dict(zip(policy_terms.SUMS[2:], means.unbind(0)))
    metrics["ratio_max"] = torch.where(any_counted, top, zero)
    if cfg.rollout_is is not None:  # token level here (is_token_separable)
        old = logp.detach() if x.old_logp is None else x.old_logp
        is_w = terms.rollout_is_weights(cfg, old, x.rollout_logp, x.mask)
        mask = terms.Masked(x.mask)
        w_mean, over = terms.masked_means([is_w["is_weight"], is_w["is_over_cap"]], mask)
        w_max = terms.masked_max(is_w["is_weight_raw"], mask)
        metrics.update(is_weight_mean=w_mean, is_clipfrac=over, is_weight_max=w_max)
    loss = totals[0]  # Σ_t c_t L_t
    # a caller's tensor count that is not a finite number > 0 makes `aggregate` NaN even where
    # nothing counts (every c_t is 0 there): the same here, never a finite loss from a bad count
    count = None
    if cfg.agg == "token-mean":
        count = x.num_tokens
    elif cfg.agg.startswith("seq-"):
        count = x.num_seqs
    if isinstance(count, Tensor):
        loss = loss + 0.0 * terms._positive_count(count, loss.device)
    shape = x.mask.shape
    return terms.PolicyLossOutput(
        loss=loss,
        logp=x.unflatten(logp.detach()),
        entropy=x.unflatten(entropy.detach()),
        kl=x.unflatten(kl.view(shape)),
        metrics={k: metrics[k] for k in terms.METRICS if k in metrics},
        ratio=x.unflatten(ratio.view(shape)),
    )


# --------------------------------------------------------------------------- the policy-loss ops
def _stats_fake(logits, n: int):
    B, T, _ = logits.shape
    return [logits.new_empty((B, T), dtype=torch.float32) for _ in range(n)]


def _define_policy_op(inplace: bool):
    """fastrl::policy_loss_grad (logits -> (logp, entropy, grad)) or, `inplace`,
    fastrl::policy_loss_grad_ (the gradient overwrites logits; -> (logp, entropy)): (logp,
    entropy) fp32 (B, T) and dloss/dlogits (B, T, V, logits' dtype) of the policy loss of SPEC 1-5,
    all in the forward."""
    name = "fastrl::policy_loss_grad" + ("_" if inplace else "")
    logits_arg = "Tensor(a!) logits" if inplace else "Tensor logits"
    outs = "(Tensor, Tensor)" if inplace else "(Tensor, Tensor, Tensor)"
    torch.library.define(name, f"({logits_arg}, {POLICY_ARGS_SCHEMA}) -> {outs}")

    @torch.library.impl(name, "default")
    def impl(logits, *args):
        _check_v_contiguous(logits)
        x, weights = policy_inputs_from_op(logits, args)
        out = logits if inplace else torch.empty(logits.shape, dtype=logits.dtype,
                                                 device=logits.device)  # fmt: skip
        logp, entropy = stats_and_grad_(logits, x.tokens, x.temperature, x, out, weights)
        return (logp, entropy) if inplace else (logp, entropy, out)

    @torch.library.register_fake(name)
    def fake(logits, *args):
        if inplace:
            return tuple(_stats_fake(logits, 2))
        grad = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        return (*_stats_fake(logits, 2), grad)

    return getattr(torch.ops.fastrl, name.split("::")[1]).default


policy_loss_grad = _define_policy_op(inplace=False)
policy_loss_grad_ = _define_policy_op(inplace=True)


# --------------------------------------------------------------------------- scale and attach
@torch.library.custom_op("fastrl::scale_grad_", mutates_args=("grad",))
def scale_grad_(grad: Tensor, scale: Tensor) -> None:
    """grad *= scale in place; no pass over `grad` when scale is exactly 1 (the usual
    loss.backward()). CPU: the value is read (a CPU tensor: no device sync). Triton: each program
    reads the scale on the device and returns at once when it is 1 (no host sync)."""
    if grad.numel():
        backend(grad.device).scale_(grad, scale)


@scale_grad_.register_fake
def _(grad, scale):
    return None


def _backward_once(ctx) -> None:
    """The checks at the start of a fused loss's backward: no double backward, and one backward
    per forward (a second would scale the gradient computed in the forward again)."""
    refuse_double_backward("policy_loss")
    if not torch.compiler.is_compiling():
        if ctx.done:
            raise RuntimeError(
                "fastrl: backward through this fused loss ran twice (retain_graph=True): its "
                "gradient is computed once in the forward; compute the loss again instead"
            )
        ctx.done = True


class _AttachGrads(torch.autograd.Function):
    """loss (0-dim, computed without autograd) made differentiable w.r.t. `inputs`, whose
    gradients were computed in the forward: backward scales them by dL_total/dloss in place
    and hands them on. Backward can run once per forward (a second would scale again: raises)."""

    @staticmethod
    def forward(ctx, loss, n, *args):
        inputs, grads = args[:n], args[n:]
        ctx.save_for_backward(*grads)
        ctx.n = n
        ctx.done = False
        del inputs
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        _backward_once(ctx)
        grads = ctx.saved_tensors
        with _still_overwritten(ctx):  # (an inplace loss: its rows hold the gradient still)
            for grad in grads:
                scale_grad_(grad, grad_loss)
        return (None, None, *grads, *(None for _ in grads))


class _AttachBaseGrad(torch.autograd.Function):
    """loss made differentiable w.r.t. `base` (B, S, V) when the logits were its rows a:b
    (`base[:, a:b]`, an lm_head output sliced to the completion) and `policy_loss(inplace=True)`
    wrote their gradient over them: the backward hands on the base's own storage, the rows
    outside a:b zeroed there, scaled by dL_total/dloss. Attached to the view instead, autograd's
    slice backward would allocate a zero (B, S, V) tensor and copy the gradient into it.
    `ctx.shared` (set when another inplace loss writes into the same base: its rows must not be
    zeroed, nor handed on twice): a zero (B, S, V) gradient with rows a:b copied in, as the
    slice backward would."""

    @staticmethod
    def forward(ctx, loss, base, S, a, b):
        ctx.grad, ctx.rows, ctx.done, ctx.shared = base.detach(), (S, a, b), False, False
        return loss.detach().clone()

    @staticmethod
    def backward(ctx, grad_loss):
        _backward_once(ctx)
        grad, (S, a, b) = ctx.grad, ctx.rows
        # (after it, the base holds this gradient, its other rows zeroed, unless shared)
        with torch.no_grad(), _still_overwritten(ctx, whole=not ctx.shared):
            rows = grad.view(-1, S, grad.shape[-1])  # (B, S, V), whatever the base's shape
            if ctx.shared:
                full = torch.zeros_like(grad)
                full.view(rows.shape)[:, a:b] = rows[:, a:b]
                grad = full
            else:
                rows[:, :a].zero_()  # the prompt rows (and any after b): no gradient
                rows[:, b:].zero_()
            scale_grad_(grad, grad_loss)
        ctx.grad = None  # a kept loss must not keep the (B, S, V) storage alive
        return None, grad, None, None, None


def _rows_of(view: Tensor, base: Tensor) -> tuple[int, int, int] | None:
    """(S, a, b) when `view` (B, T, V) is rows a:b of every sequence of a contiguous `base`
    holding (B, S, V) values: base (B, S, V), or (B S, V) as F.linear's output with a bias (a
    view of its 2-D addmm result); else None."""
    if view.dim() != 3 or not base.is_contiguous() or base.dim() == 0:
        return None
    B, T, V = view.shape
    if V == 0 or view.stride(2) != 1 or view.stride(1) != V or view.stride(0) % V:
        return None
    S = view.stride(0) // V
    offset = view.storage_offset() - base.storage_offset()
    if base.shape[-1] != V or base.numel() != B * S * V or offset % V:
        return None
    a = offset // V
    return (S, a, a + T) if 0 <= a <= S - T else None


def sliced_rows(view: Tensor) -> tuple[Tensor, int, int, int] | None:
    """(base, S, a, b) when `view` is rows a:b of the sequences of a contiguous base that
    autograd differentiates (not a leaf): base[:, a:b] of a (B, S, V) base, or of the (B S, V)
    base F.linear with a bias returns a view of; else None."""
    base = view._base
    if base is None or base.is_leaf or not base.requires_grad:
        return None
    rows = _rows_of(view, base)
    return None if rows is None else (base, *rows)


def attach_inplace_grad(loss: Tensor, logits: Tensor, node: Tensor, grad: Tensor) -> Tensor:
    """`loss` as a differentiable function of the logits whose storage `grad` (written in place
    by policy_loss(inplace=True)) holds its gradient: of their base when `logits` is a slice
    base[:, a:b] (`sliced_rows`; the base's storage handed on whole, see _AttachBaseGrad) and
    no other inplace loss has written into that base; else of `node` (the logits as the graph
    has them) with `grad`, as `attach_grads`. Each base records the inplace losses on it
    (`_InplaceRecord.losses`): a second one turns the first's backward to the copying form."""
    base = logits._base
    earlier = None if base is None else _record(base).losses
    rows = sliced_rows(logits) if grad.data_ptr() == logits.data_ptr() else None
    if rows is not None and not earlier:
        out = _AttachBaseGrad.apply(loss, *rows)
        earlier.append(out.grad_fn)
    else:
        for node_ in earlier or ():  # their rows a:b only: this loss's gradient is in the base too
            if isinstance(node_, _AttachBaseGrad._backward_cls):
                node_.shared = True
        if earlier is not None:
            earlier.append(None)
        out = attach_grads(loss, [node], [grad])
    if grad.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr():
        out.grad_fn.fastrl_root = logits if base is None else base  # (_still_overwritten)
    return out


class _InplaceRecord:
    """What fastrl's inplace losses wrote into the storage of one root tensor (the base of the
    logits they were given, or those logits), kept on it as `_fastrl_inplace`:
    `losses`, one entry per inplace loss on a view of it (the zero-copy slice backward's node,
    or None: `attach_inplace_grad`); `regions`, the parts of it overwritten with a gradient, and
    `version`, the storage's version counter after the last such write (`note_overwritten`,
    `check_not_overwritten`: a record whose version is not the storage's is stale)."""

    __slots__ = ("losses", "regions", "version")

    def __init__(self):
        self.losses, self.regions, self.version = [], [], None


def _record(root: Tensor) -> _InplaceRecord:
    """`root`'s _InplaceRecord (created empty on first use)."""
    record = getattr(root, "_fastrl_inplace", None)
    if record is None:
        record = root._fastrl_inplace = _InplaceRecord()
    return record


@contextlib.contextmanager
def _still_overwritten(node, whole: bool = False):
    """Around an inplace loss's backward, which writes its storage again (scales the gradient;
    zeroes the base's other rows when `whole`): the record of `note_overwritten` follows that
    write, so that a fastrl read after loss.backward() is refused too (the rows hold the
    gradient, or zeros), unless something else wrote the storage since the forward."""
    root = getattr(node, "fastrl_root", None)
    record = None if root is None else _record(root)
    fresh = record is not None and record.version == root._version
    yield
    if fresh:
        if whole:
            record.regions = [_storage_region(root)[1]]
        record.version = root._version
    if root is not None:
        node.fastrl_root = None  # (the graph keeps no reference to the logits after backward)


def _storage_region(t: Tensor) -> tuple[Tensor, tuple]:
    """(root, region): the tensor whose storage `t` views (its base, or itself) and the part of
    it `t` covers: ("rows", start, sizes, strides) when `t` is made of whole rows of a
    contiguous root (its last dim the root's, stride 1, every other stride and its offset in
    whole rows): the row indices start + sum_k i_k strides_k; else ("span", lo, hi), the storage
    elements between its first and last."""
    root = t if t._base is None else t._base
    lo = t.storage_offset() - root.storage_offset()
    V = root.shape[-1] if root.dim() else 0
    whole_rows = (
        V > 0 and t.dim() > 0 and root.is_contiguous() and t.shape[-1] == V
        and (t.stride(-1) == 1 or V == 1) and lo % V == 0
        and all(st % V == 0 for st in t.stride()[:-1])
    )  # fmt: skip
    if whole_rows:
        strides = tuple(st // V for st in t.stride()[:-1])
        return root, ("rows", lo // V, tuple(t.shape[:-1]), strides, V)
    hi = lo + 1 + sum((n - 1) * abs(st) for n, st in zip(t.shape, t.stride())) if t.numel() else lo
    return root, ("span", lo, hi)


def _row_indices(region: tuple) -> Tensor:
    """The root's row indices a "rows" region covers, int64 (CPU)."""
    _, start, sizes, strides, _ = region
    idx = torch.tensor([start], dtype=torch.int64)
    for n, st in zip(sizes, strides):
        idx = (idx[:, None] + torch.arange(n, dtype=torch.int64) * st).reshape(-1)
    return idx


def _overlap(r1: tuple, r2: tuple) -> bool:
    """Whether two regions of one root share an element: exactly for whole rows, by span
    otherwise."""
    if r1[0] == "rows" and r2[0] == "rows":
        return bool(torch.isin(_row_indices(r1), _row_indices(r2)).any())
    spans = []
    for r in (r1, r2):
        if r[0] == "rows":
            rows, V = _row_indices(r), r[4]
            spans.append((rows * V, rows * V + V) if rows.numel() else None)
        else:
            spans.append((torch.tensor([r[1]]), torch.tensor([r[2]])))
    if spans[0] is None or spans[1] is None:
        return False
    (lo1, hi1), (lo2, hi2) = spans
    return bool(((lo1[:, None] < hi2[None, :]) & (lo2[None, :] < hi1[:, None])).any())


def storage_version(t: Tensor) -> int | None:
    """The version counter `t` shares with every view of its storage (None under
    torch.compile, where the inplace bookkeeping below is off)."""
    return None if torch.compiler.is_compiling() else t._version


def note_overwritten(logits: Tensor, version_before: int | None, grad: Tensor) -> None:
    """Record on the logits' root tensor that policy_loss(inplace=True) overwrote them with the
    gradient `grad` (the storage's version `version_before` before that write; nothing when
    the gradient went to a copy: a strided V): `check_not_overwritten` refuses a later fastrl
    read of those rows while nothing else has written there since."""
    if torch.compiler.is_compiling() or version_before is None:
        return
    if grad.untyped_storage().data_ptr() != logits.untyped_storage().data_ptr():
        return
    root, region = _storage_region(logits)
    record = _record(root)
    if record.version != version_before:  # stale: the storage was written since
        record.regions = []
    record.regions.append(region)
    record.version = root._version


def check_not_overwritten(logits: Tensor, op: str) -> None:
    """A ValueError when `logits` reads rows that an earlier policy_loss(inplace=True) overwrote
    with its gradient (`note_overwritten`) and nothing has written there since: the numbers
    there are no longer logits, and nothing else would tell (a read after the call saves
    nothing autograd's version counter checks, e.g. a second loss on the same slice)."""
    if torch.compiler.is_compiling():
        return
    root = logits if logits._base is None else logits._base
    record = getattr(root, "_fastrl_inplace", None)
    if record is None or not record.regions or record.version != root._version:
        return
    region = _storage_region(logits)[1]
    if any(_overlap(region, r) for r in record.regions):
        raise ValueError(
            f"fastrl.{op}: the logits {tuple(logits.shape)} were overwritten with a gradient by "
            "an earlier fastrl.policy_loss(..., inplace=True) on the same tensor (or an "
            "overlapping slice of it): they hold no logits any more. Compute every other loss "
            "or read of these logits before that call, or pass inplace=False to it"
        )


def attach_grads(loss: Tensor, inputs: list[Tensor], grads: list[Tensor]) -> Tensor:
    """`loss` (a value) as a differentiable function of `inputs` with d loss / d inputs = grads
    (same shapes), so that backward costs no more than scaling the gradients."""
    return _AttachGrads.apply(loss, len(inputs), *inputs, *grads)
