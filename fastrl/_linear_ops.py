"""The LM-head custom ops behind `fastrl.linear`: logits by row chunks, never (N, V).

Per chunk of R rows (the rows whose mask is not 0, gathered from hidden (N, H) or (B, T, H)):

    a = h W^T (+ b)                (R, V) one GEMM, in the hidden states' dtype, into one reused
                                   (chunk, V) buffer
    z = s a, or c tanh(s a / c)    logit_scale s, Gemma-style softcap c (exact gradients)
    z' = z / tau                   then the fused row statistics of fastrl.ops (logp, H, and
                                   m = max z', log s = lse - m for an exact backward)

and, for a gradient, dL/dz in place of z (SPEC 6), dL/da = dz * dz/da, then dX[rows] = da W and
dW += da^T X (dW and db accumulated across chunks in fp32, each chunk's product formed in fp32
as well, cast once at the end).

Registered ops (namespace "fastrl"; fake implementations included, so torch.compile traces them):
  fastrl::linear_token_stats(hidden, weight, bias, tokens, mask, tau, s, c, chunk,
      temperature_rows=None) -> (logp, entropy, m, log_s), fp32 (N,) each; 0 where mask == 0
  fastrl::linear_token_stats_backward(..., logp, m, log_s, entropy, g, h, ...,
      temperature_rows=None)
      -> (dX, dW, db or (0,))
  fastrl::linear_policy_grad(hidden, weight, bias, <ops.POLICY_ARGS_SCHEMA>, s, c, chunk,
      all_rows)
      -> (logp, entropy, dX, dW, db or (0,)): the policy loss's gradient in its forward

The plain functions `local_stats` and `local_grads` are the same loops over a given set of rows;
`fastrl.vocab_parallel` runs them on one rank's shard of the vocabulary.

Per-token temperature: `temperature_rows` (fp32 (N,), one tau_t per flat row, detached; the
ops' `float temperature` is then ignored) or, in fastrl::linear_policy_grad, POLICY_ARGS_SCHEMA's
`temperature_rows` (B, T). Each chunk takes its rows of it like the tokens (`index_select` of
the active rows) and hands the backends the (1, R) tensor; without it the float path is as is.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from . import chunked, ops
from .terms import aggregation_weights, is_token_separable

# --------------------------------------------------------------------------- chunk helpers
GPU_CHUNK_ROWS = 2048  # rows per chunk on a GPU: measured on an H200 (default_chunk)
GPU_CHUNK_BYTES = 2 << 30  # at most this many bytes of one chunk's bf16 / fp16 logits


def default_chunk(V: int, device: torch.device | str | None = None) -> int:
    """Rows per chunk of the LM-head paths on `device` (None: the CPU's).

    CPU: about 64 MB of fp32 logits (a few such temporaries exist at once).
    GPU: GPU_CHUNK_ROWS, fewer where a chunk's half-precision logits would pass GPU_CHUNK_BYTES.
    Every chunk re-reads the (V, H) weight in its logits and dX GEMMs and reads and writes the
    fp32 dW sum (8 V H bytes), whatever its rows: at the CPU's ~110 rows (V = 151936) a batch of
    N = 8192 rows at H = 4096 would move ~373 GB for dW alone, against ~7.5 GB a chunk of
    thousands. Measured on an H200 (bench_fused_linear_cuda, commit c0e7779, N = 8192, H = 4096,
    V = 151936 bf16, fused_linear_policy_loss forward + backward): 51.8 ms / 3931 MiB peak at
    1024 rows, 49.2 / 4236 at 2048, 47.5 / 4846 at 4096, 46.7 / 6065 at 8192 (the three bare
    GEMMs: 43.8 ms; Liger's fused linear loss: 4818 MiB). 2048 keeps within 1.15x the GEMMs at
    less memory than Liger's; pass chunk_size=4096 for 3.5 % less time at 610 MiB more (and
    linear_logprobs: 62.9 ms against 64.9). The cap counts 2-byte logits:
    with a logit scale or softcap a chunk's logits are fp32 and the softcap's slope another fp32
    chunk (~6 GB at V = 151936, ~11 GB at 262144): pass a smaller chunk_size where that is
    too much."""
    if torch.device(device or "cpu").type == "cpu":
        return 2 * chunked.chunk_rows(V)
    return max(1, min(GPU_CHUNK_ROWS, GPU_CHUNK_BYTES // (2 * max(V, 1))))


def _active_rows(mask: Tensor | None, N: int, device) -> Tensor:
    """Flat indices (R,) int64 of the rows that count: all of them, or where mask != 0."""
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
    chunk would cost page faults on every chunk (large CPU allocations are mmapped). `f32`: an
    fp32 one beside a bf16 / fp16 GEMM's, made on first use (the logit scale and the softcap)."""

    def __init__(self, chunk: int, weight: Tensor):
        self.data = torch.empty(chunk, weight.shape[0], dtype=weight.dtype, device=weight.device)
        self._f32 = None

    def rows(self, R: int) -> Tensor:
        return self.data[:R]

    def f32(self, R: int) -> Tensor:
        if self._f32 is None:
            self._f32 = torch.empty_like(self.data, dtype=torch.float32)
        return self._f32[:R]


def _logits(rows: Tensor, weight: Tensor, bias, logit_scale: float, softcap, buf: _Buffer):
    """z (R, V) (in `buf`): s (h W^T + b), then c tanh(. / c) with a softcap. The GEMM's output
    is in the rows' dtype; the scale and the softcap are applied in fp32 (a bf16 / fp16 GEMM's
    output is widened first, as TRL's chunked LM head does: in bf16 they cost up to ~0.1 in
    logp at softcap 30), so z is fp32 whenever either is set, else the GEMM's output."""
    z = buf.rows(rows.shape[0])
    if bias is None:
        torch.mm(rows, weight.t(), out=z)
    else:
        torch.addmm(bias, rows, weight.t(), out=z)
    if logit_scale == 1.0 and softcap is None:
        return z
    if z.dtype != torch.float32:
        z = buf.f32(rows.shape[0]).copy_(z)
    if logit_scale != 1.0:
        z.mul_(logit_scale)
    if softcap is not None:
        z.div_(softcap).tanh_().mul_(softcap)
    return z


def _chain_factor(z: Tensor, logit_scale: float, softcap):
    """dz/da (R, V) fp32 for a softcap (s (1 - (z / c)^2), from _logits' fp32 z); else None
    (the factor is s)."""
    if softcap is None:
        return None
    t = z / softcap  # a new tensor
    return t.mul_(t).neg_().add_(1.0).mul_(logit_scale)


def _to_pre_activation(dz: Tensor, factor, logit_scale: float) -> Tensor:
    """dL/da from dL/dz, in place."""
    if factor is not None:
        return dz.mul_(factor)  # fp32 factor: computed in fp32, cast on store
    if logit_scale != 1.0:
        dz.mul_(logit_scale)
    return dz


# `torch.addmm(acc, a, b, out_dtype=torch.float32)` from bf16 / fp16 inputs (CUDA; torch >= 2.8)
_MM_OUT_DTYPE = hasattr(torch.ops.aten.addmm, "dtype_out")


def _add_product_fp32(acc: Tensor, dz: Tensor, dz_rows: Tensor, rows: Tensor, first: bool,
                      buf: _Buffer) -> None:  # fmt: skip
    """acc = dz^T X (first) or acc += dz^T X: acc fp32 (V, H), dz (R, V) (fp32 after a logit scale
    or softcap, else the GEMM's dtype), dz_rows = dz in the rows' dtype, rows X (R, H). The
    product is formed and added in fp32, never rounded to a bf16 / fp16 GEMM's dtype first
    (rounding each chunk's product before the sum adds an error per chunk: with many chunks dW
    drifts by many ulps from the same sum taken once; test_fused_linear's dW-independent-of-
    chunk test). CUDA: the rows' half-precision GEMM with an fp32 output (an fp32 dz is rounded
    to the rows' dtype for it, as for dX); elsewhere an fp32 GEMM on dz in fp32 (widened into
    the buffer's fp32 scratch when it is not) and the rows widened."""
    beta = 0.0 if first else 1.0  # beta = 0 on the first chunk: no zero fill, no read
    if rows.dtype != torch.float32 and _MM_OUT_DTYPE and acc.device.type == "cuda":
        if first:
            torch.mm(dz_rows.t(), rows, out_dtype=torch.float32, out=acc)
        else:
            torch.addmm(acc, dz_rows.t(), rows, out_dtype=torch.float32, out=acc)
        return
    if dz.dtype != torch.float32:
        dz = buf.f32(dz.shape[0]).copy_(dz)
    acc.addmm_(dz.t(), rows.float(), beta=beta)


class _Grads:
    """grad_hidden (N, H) in hidden's dtype; grad_weight (V, H) and grad_bias (V,) in fp32,
    accumulated across chunks in fp32 (each chunk's product too: `_add_product_fp32`) and
    returned in fp32 (the caller casts: `linear_logprobs`' autograd to the weight's dtype, the
    TRL head's fp32 master weights keep the full sum).

    Nothing is zero-filled that the chunks overwrite anyway: the first chunk writes dW (and db)
    directly, and grad_hidden is zeroed only when some rows are skipped (`n_active` < N)."""

    def __init__(self, N: int, n_active: int, weight: Tensor, bias, hidden_dtype, buf: _Buffer):
        V, H = weight.shape
        dev = weight.device
        alloc = torch.empty if n_active == N else torch.zeros
        self.hidden = alloc(N, H, dtype=hidden_dtype, device=dev)
        self.weight = torch.empty(V, H, dtype=torch.float32, device=dev)
        self.bias = None if bias is None else torch.empty(V, dtype=torch.float32, device=dev)
        self.buf = buf
        self.started = False

    def add(self, idx: Tensor, rows: Tensor, dz: Tensor, weight: Tensor) -> None:
        """dX[idx] = dz W; dW += dz^T X; db += sum_rows dz (dz (R, V): fp32 after a logit
        scale or softcap, else in the GEMM dtype; the dX GEMM runs in the rows' dtype)."""
        first, self.started = not self.started, True
        dz_rows = dz.to(rows.dtype)  # dz itself unless a scale / softcap made it fp32
        _add_product_fp32(self.weight, dz, dz_rows, rows, first, self.buf)
        if self.bias is not None:
            db = dz.sum(0, dtype=torch.float32)
            if first:
                self.bias.copy_(db)
            else:
                self.bias.add_(db)
        self.hidden.index_copy_(0, idx, dz_rows @ weight)

    def result(self, bias):
        """(dX in hidden's dtype, dW fp32, db in the bias' dtype or None)."""
        if not self.started:  # every row masked: the gradients are zero
            self.weight.zero_()
            if self.bias is not None:
                self.bias.zero_()
        db = None if self.bias is None else self.bias.to(bias.dtype)
        return self.hidden, self.weight, db


def _bias_or_empty(bias, weight):
    return weight.new_empty(0) if bias is None else bias


def row_stats(z: Tensor, y: Tensor, temperature):
    """(logp, entropy, m, log_s) fp32 (1, R) of a chunk's logits z (1, R, V), tokens y (1, R),
    on the device's backend (`ops._row_stats`: m = max z', log s = lse - m); temperature a float
    or the chunk's (1, R) per-row tau."""
    return ops._row_stats(z, y, temperature)


def row_grad_(z: Tensor, y, logp, m, log_s, entropy, g, h, temperature) -> Tensor:
    """SPEC 6's dL/dz written over the chunk's logits z (1, R, V) (each row is read before it is
    written) from its (1, R) statistics (logp, m, log_s, entropy) and g, h (h None: 0), with
    p_j = exp((z'_j - m) - log s), exact at any offset; temperature as in `row_stats`."""
    return ops._row_grad_(z, y, logp, m, log_s, entropy, g, h, temperature, z)


def pick_temperature(temperature, idx: Tensor):
    """The temperature of the rows `idx` (flat indices): a float as is, or the (1, R) rows of a
    per-row tensor (N elements, e.g. (N,) or (B, T))."""
    if not isinstance(temperature, Tensor):
        return temperature
    return temperature.reshape(-1).index_select(0, idx)[None]


def _chunks(active: Tensor, chunk: int) -> list[Tensor]:
    return [active[s : s + chunk] for s in range(0, active.numel(), chunk)]


def scatter_rows(values: Tensor, active: Tensor, N: int) -> list[Tensor]:
    """(k, R) values of the rows `active` as k separate fp32 (N,) tensors, 0 elsewhere."""
    out = [torch.zeros(N, dtype=torch.float32, device=values.device) for _ in values]
    for dst, val in zip(out, values):
        dst.index_copy_(0, active, val)
    return out


# --------------------------------------------------------------------------- the two loops
def local_stats(hidden, weight, bias, y, active, temperature, logit_scale, softcap, chunk):
    """fp32 (4, R) (logp, entropy, m, log_s) of the rows `active` (R,) of hidden, tokens y (N,)
    (flat, in [0, V)), z = softcap(s (hidden W^T + b)) / tau; `chunk` rows per GEMM.
    temperature: a float, or a tensor of per-row tau (N elements)."""
    out = torch.empty(4, active.numel(), dtype=torch.float32, device=hidden.device)
    buf = _Buffer(min(chunk, max(active.numel(), 1)), weight)
    for s, idx in zip(range(0, active.numel(), chunk), _chunks(active, chunk)):
        z = _logits(_gather(hidden, idx), weight, bias, logit_scale, softcap, buf)
        tau = pick_temperature(temperature, idx)
        stats = row_stats(z[None], y.index_select(0, idx)[None], tau)
        out[:, s : s + idx.numel()] = torch.cat(stats)  # each (1, R)
        del z
    return out


def local_grads(hidden, weight, bias, y, active, logp, m, log_s, entropy, g, h, temperature,
                logit_scale, softcap, chunk):  # fmt: skip
    """(dX (N, H), dW (V, H) fp32, db or None) from g = dL/dlogp and h = dL/dH (fp32 (N,), h
    may be None) and the rows' logp, m, log s and H (N,) (`local_stats`; a vocab-parallel shard
    passes the whole row's lse - m as log s): per chunk of `active` the logits again,
    SPEC 6's dz in place, then dX = dz W, dW += dz^T X. A token y outside [0, V) gets no entry
    at y (its row's dz is -p (g + h (log p + H)) / tau: the vocab-parallel shards that do not
    own it).
    temperature: a float, or a tensor of per-row tau (N elements)."""
    buf = _Buffer(min(chunk, max(active.numel(), 1)), weight)
    grads = _Grads(y.numel(), active.numel(), weight, bias, hidden.dtype, buf)
    for idx in _chunks(active, chunk):
        rows = _gather(hidden, idx)
        z = _logits(rows, weight, bias, logit_scale, softcap, buf)
        factor = _chain_factor(z, logit_scale, softcap)
        pick = lambda t, idx=idx: None if t is None else t.index_select(0, idx)[None]  # noqa: E731
        tau = pick_temperature(temperature, idx)
        stats = (pick(t) for t in (y, logp, m, log_s, entropy, g, h))
        row_grad_(z[None], *stats, tau)
        grads.add(idx, rows, _to_pre_activation(z, factor, logit_scale), weight)
        del z, factor
    return grads.result(bias)


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
    temperature_rows: Tensor | None = None,
    source: str = "",
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy, m, log_s), each fp32 (N,), of z = softcap(s (hidden W^T + b)) / tau for
    the rows of hidden (N', .., H) flattened to N (m = max z', log s = lse - m: for the
    backward); 0 where mask == 0 (never computed).
    temperature_rows: None, or fp32 (N,) per-row tau replacing `temperature` (no gradient).
    source: ops.SOURCE_KEY, unused here (it keys torch.compile's caches: fastrl._op_args)."""
    N = tokens.numel()
    active = _active_rows(mask, N, hidden.device)
    tau = temperature if temperature_rows is None else temperature_rows
    local = local_stats(hidden, weight, bias, tokens.reshape(-1), active, tau,
                        logit_scale, softcap, chunk)  # fmt: skip
    return tuple(scatter_rows(local, active, N))


@linear_token_stats.register_fake
def _(hidden, weight, bias, tokens, mask, temperature, logit_scale, softcap, chunk,
      temperature_rows=None, source=""):  # fmt: skip
    N = tokens.numel()
    return tuple(hidden.new_empty(N, dtype=torch.float32) for _ in range(4))


@torch.library.custom_op("fastrl::linear_token_stats_backward", mutates_args=())
def linear_token_stats_backward(
    hidden: Tensor,
    weight: Tensor,
    bias: Tensor | None,
    tokens: Tensor,
    mask: Tensor | None,
    logp: Tensor,
    m: Tensor,
    log_s: Tensor,
    entropy: Tensor,
    grad_logp: Tensor,
    grad_entropy: Tensor | None,
    temperature: float,
    logit_scale: float,
    softcap: float | None,
    chunk: int,
    temperature_rows: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_hidden (N, H), grad_weight (V, H) fp32, grad_bias (V,) or (0,)) from g = dL/dlogp
    and h = dL/dH (N,): per chunk the logits again, SPEC 6's dz, then dX = dz W, dW += dz^T X.
    dW stays fp32 (the autograd formula casts it to the weight's dtype; fp32 master weights
    cast to bf16 for the GEMMs keep the whole sum). temperature_rows: as in linear_token_stats."""
    active = _active_rows(mask, tokens.numel(), hidden.device)
    h = None if grad_entropy is None else grad_entropy.reshape(-1).float()
    tau = temperature if temperature_rows is None else temperature_rows
    dh, dw, db = local_grads(
        hidden, weight, bias, tokens.reshape(-1), active, logp, m, log_s, entropy,
        grad_logp.reshape(-1).float(), h, tau, logit_scale, softcap, chunk,
    )  # fmt: skip
    return dh, dw, _bias_or_empty(db, weight)


@linear_token_stats_backward.register_fake
def _(hidden, weight, bias, tokens, mask, logp, m, log_s, entropy, grad_logp, grad_entropy,
      temperature, logit_scale, softcap, chunk, temperature_rows=None):  # fmt: skip
    N, H = tokens.numel(), weight.shape[1]
    V = weight.shape[0] if bias is not None else 0
    dw = torch.empty_like(weight, dtype=torch.float32)
    return hidden.new_empty(N, H), dw, weight.new_empty(V)


def _setup_context(ctx, inputs, output):
    hidden, weight, bias, tokens, mask, temperature, logit_scale, softcap, chunk, tau_rows, _ = (
        inputs
    )
    logp, entropy, m, log_s = output
    ctx.save_for_backward(hidden, weight, bias, tokens, mask, logp, m, log_s, entropy, tau_rows)
    ctx.args = (temperature, logit_scale, softcap, chunk)
    ctx.has_bias = bias is not None
    ctx.hidden_shape = hidden.shape
    ctx.mark_non_differentiable(m, log_s)


def _backward(ctx, grad_logp, grad_entropy, grad_m, grad_log_s):
    ops.refuse_double_backward("linear_logprobs")
    hidden, weight, bias, tokens, mask, logp, m, log_s, entropy, tau_rows = ctx.saved_tensors
    if grad_logp is None:
        grad_logp = torch.zeros_like(logp)
    kind = hidden.device.type  # (no autocast on `meta`: torch.autocast("meta") raises)
    off = torch.autocast(kind, enabled=False) if ops.has_autocast(kind) else None
    with off or contextlib.nullcontext():  # the forward's dtype, as is
        dh, dw, db = linear_token_stats_backward(
            hidden,
            weight,
            bias,
            tokens,
            mask,
            logp,
            m,
            log_s,
            entropy,
            grad_logp,
            grad_entropy,
            *ctx.args,
            tau_rows,
        )
    return (dh.view(ctx.hidden_shape), dw.to(weight.dtype), db if ctx.has_bias else None, None,
            None, None, None, None, None, None, None)  # fmt: skip


linear_token_stats.register_autograd(_backward, setup_context=_setup_context)


# --------------------------------------------------------------------------- the fused policy loss
torch.library.define(
    "fastrl::linear_policy_grad",
    f"(Tensor hidden, Tensor weight, Tensor? bias, {ops.POLICY_ARGS_SCHEMA}, float logit_scale, "
    "float? softcap, int chunk, bool all_rows) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)


@torch.library.impl("fastrl::linear_policy_grad", "default")
def _linear_policy_grad(hidden, weight, bias, *args):
    """(logp, entropy) fp32 (B, T) and the gradients (hidden (N, H), weight, bias or (0,)) of
    the policy loss of SPEC 1-5 on z = softcap(s (hidden W^T + b)), all in the forward.
    `args`: the per-token inputs (ops.POLICY_ARGS_SCHEMA, (B, T)), then logit_scale, softcap,
    chunk and all_rows (the caller gave no mask: every row counts, and finding the counted rows
    needs no host sync); hidden's rows flatten to N = B T."""
    x, weights = ops.policy_inputs_from_op(None, args[:-4])
    logit_scale, softcap, chunk, all_rows = args[-4:]
    tokens, mask = x.tokens, x.mask
    tau = x.temperature  # the float, or the (B, T) per-row tensor
    B, T = tokens.shape
    N = B * T
    active = _active_rows(None if all_rows else mask, N, hidden.device)
    if not is_token_separable(x.config):  # statistics of every row first (four GEMMs per chunk)
        y = tokens.reshape(-1)
        local = local_stats(hidden, weight, bias, y, active, tau, logit_scale, softcap, chunk)
        logp, entropy, m, log_s = scatter_rows(local, active, N)
        g, h = ops.token_grads(logp.view(B, T), entropy.view(B, T), x)
        dh, dw, db = local_grads(
            hidden, weight, bias, y, active, logp, m, log_s, entropy, g.reshape(-1).float(),
            None if h is None else h.reshape(-1).float(), tau, logit_scale, softcap, chunk,
        )  # fmt: skip
        dw, db = dw.to(weight.dtype), _bias_or_empty(db, weight)
        return logp.view(B, T), entropy.view(B, T), dh, dw, db
    logp, entropy = (torch.zeros(N, dtype=torch.float32, device=hidden.device) for _ in range(2))
    buf = _Buffer(min(chunk, max(active.numel(), 1)), weight)
    grads = _Grads(N, active.numel(), weight, bias, hidden.dtype, buf)
    flat = ops.flat_inputs(x)
    if weights is None:  # (the public entry forms them: ops.loss_weights)
        with ops._autograd_enabled():  # we run inside a custom op: below autograd
            weights = aggregation_weights(x)
    weights = weights.reshape(1, N)
    for idx in _chunks(active, chunk):  # three GEMMs per chunk
        rows = _gather(hidden, idx)
        z = _logits(rows, weight, bias, logit_scale, softcap, buf)
        factor = _chain_factor(z, logit_scale, softcap)
        x_rows = ops.select_rows(flat, idx)
        w_rows = weights.index_select(1, idx)
        lp, ent = ops.stats_and_grad_(
            z[None], x_rows.tokens, x_rows.temperature, x_rows, z[None], w_rows
        )
        logp.index_copy_(0, idx, lp[0])
        entropy.index_copy_(0, idx, ent[0])
        grads.add(idx, rows, _to_pre_activation(z, factor, logit_scale), weight)
        del z, factor
    dh, dw, db = grads.result(bias)
    return logp.view(B, T), entropy.view(B, T), dh, dw.to(weight.dtype), _bias_or_empty(db, weight)


@torch.library.register_fake("fastrl::linear_policy_grad")
def _(hidden, weight, bias, *args):
    B, T = args[0].shape  # tokens
    V = weight.shape[0] if bias is not None else 0
    stats = [hidden.new_empty((B, T), dtype=torch.float32) for _ in range(2)]
    return (*stats, hidden.new_empty(B * T, weight.shape[1]), torch.empty_like(weight),
            weight.new_empty(V))  # fmt: skip


linear_policy_grad = torch.ops.fastrl.linear_policy_grad.default
