"""The vocab-parallel LM head: `linear_logprobs(..., group=pg)` and
`fused_linear_policy_loss(..., group=pg)` (issue 20).

Each of the P ranks of `group` holds a contiguous shard of the vocabulary rows, in rank order
(uneven shards, even empty ones, are allowed): weight_r (V_r, H), bias_r (V_r,), the vocabulary
[o_r, o_r + V_r) with o_r = sum of the lower ranks' V_r. hidden (N, H), tokens (global ids in
[0, V)), the mask and every per-token input are replicated: the same on every rank. A weight that
is a DTensor sharded along dim 0 on a 1-D DeviceMesh is the same thing (`resolve`: its local
shard, the mesh's group, its mesh coordinate as the shard index).

Math, per row (z' the row's logits over the whole vocabulary, split in the P shards):
each rank computes, over its own columns only, exactly what the single-device op computes over
all of them, (logp_r, H_r, m_r, log s_r) = (z'_y - lse_r, -sum p^r log p^r, max z'^r,
log sum exp(z'^r - m_r)) with p^r = softmax of the shard's logits and lse_r = m_r + log s_r
(logp_r only means something on the rank that owns y). Then, with M = max_r m_r (over the shards
with mass) and a_r = (m_r - M) + log s_r, the log of shard r's mass relative to e^M,

    log S = logsumexp_r a_r   (lse = M + log S),        pi_r = exp(a_r - log S)
    H     = sum_r pi_r (H_r + log S - a_r)               (mixture entropy: no cancellation)
    logp  = logp_own - (log S - a_own)                   (own: the rank holding y)

Nothing here is a difference of two values rounded at lse's own scale (m_r - M is exact where it
matters, log s_r and log S are O(log V)): such a difference would carry eps |lse| into logp and
from it into the gradient's 1 - p_y in a peaked row (SPEC 6 Numerics). So ONE collective per row
merges them: an all-gather of the four fp32 (logp_r, H_r, m_r, log s_r), 16 B sent per row per
rank, 16 P B received and held (a (P, 4, R) fp32 buffer), merged identically on every rank (same
numbers everywhere, no separate max all-reduce, no overflow for any offset: the merge is in log
space). The backward on this shard's columns is SPEC 6 with p_j = exp((z'_j - m_r) - (lse - m_r)),
lse - m_r = log S + (M - m_r) (exact at any offset of the logits, as on one device):
dz_r = (1/tau)[g (1[j = y] - p_j) - h p_j (log p_j + H)]
(tau: the float, or the row's own tau_t with a per-token temperature, replicated like the other
per-token inputs), where only the owner has the 1[j = y] entry; dW_r = dz_r^T X and db_r stay
local, and dX = sum_r dz_r W_r is one all-reduce (SUM) of N x H values in hidden's dtype.

Collectives per call: one all-gather of 18 int64 per rank (an input-check flag, the shard index,
the shard size, N, the counted rows, the chunk size, the token min and max, 2 for the
temperature's fingerprint, hidden's width H and dtype, whether a gradient is wanted, 2 for the
counted rows' fingerprint, and the logit scale, softcap and loss config's fingerprint: the one
host read of the call) that checks the inputs are replicated (so that every rank takes the same
collectives and merges the same rows) and gives the offsets; then `linear_logprobs`: forward
one all-gather of (4, R) fp32 (R = rows whose mask is not 0), backward one all-reduce of dX
(N, H);
`fused_linear_policy_loss` with a token-separable config: one (4, chunk) all-gather per chunk of
rows (three GEMMs per chunk, the gradient in the forward) and the dX all-reduce; sequence-level
options: one (4, R) all-gather, then the gradient pass (four GEMMs per chunk) and the dX
all-reduce. Memory per rank: the single-device op's on V_r columns (a few (chunk, V_r) buffers)
plus (P, 4, chunk) fp32. The chunk size is the same on every rank (`default_chunk` of the widest
shard, or chunk_size).

This path runs eagerly, outside the custom ops (a process group is no op argument):
torch.compile graph-breaks around it (`fullgraph=True` raises).
"""

from __future__ import annotations

import sys
import zlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from . import ops
from ._linear_ops import (
    _active_rows,
    _Buffer,
    _chain_factor,
    _chunks,
    _gather,
    _Grads,
    _logits,
    _to_pre_activation,
    default_chunk,
    local_grads,
    local_stats,
    pick_temperature,
    row_grad_,
    row_stats,
    scatter_rows,
)
from .terms import aggregation_weights, is_token_separable

# hidden's dtype in the plan's exchange: its index here (len(_DTYPES): another)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _dtype_name(code: int) -> str:
    return str(_DTYPES[code]) if code < len(_DTYPES) else "another dtype"


# --------------------------------------------------------------------------- DTensor and the plan
def is_dtensor(t) -> bool:
    """Whether `t` is a DTensor. A DTensor exists only once torch.distributed.tensor has been
    imported, so this never imports it (that costs seconds on a plain single-device call)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _local_shard(name: str, t, mesh=None):
    """The local rows of a DTensor sharded along dim 0 on a 1-D mesh (differentiable: its
    gradient flows back as a DTensor of the same placements), and its mesh."""
    from torch.distributed.tensor import Shard

    placements, dmesh = tuple(t.placements), t.device_mesh
    if dmesh.ndim != 1 or len(placements) != 1 or placements[0] != Shard(0):
        raise ValueError(
            f"{name} is a DTensor with placements {placements} on a {dmesh.ndim}-D DeviceMesh: the "
            "vocab-parallel LM head needs (Shard(0),) on a 1-D mesh (each rank a contiguous shard "
            "of the vocabulary rows)"
        )
    if mesh is not None and dmesh != mesh:
        raise ValueError(f"{name} is a DTensor on another DeviceMesh than weight's")
    return t.to_local(), dmesh


def resolve(weight, bias, group):
    """(weight, bias, group, shard index): a DTensor weight (and bias) as its local shard, the
    mesh's process group and this rank's mesh coordinate; plain tensors as given, the shard
    index being the rank in `group`."""
    if is_dtensor(weight):
        weight, mesh = _local_shard("weight", weight)
        if is_dtensor(bias):
            bias, _ = _local_shard("bias", bias, mesh)
        if group is not None and group != mesh.get_group():
            raise ValueError("group is not the process group of weight's DeviceMesh")
        return weight, bias, mesh.get_group(), mesh.get_local_rank()
    if is_dtensor(bias):
        raise ValueError("bias is a DTensor but weight is not: pass both as DTensors or neither")
    if group is None:
        raise ValueError("the vocab-parallel LM head needs group= or a DTensor weight")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"group must be a torch.distributed ProcessGroup (e.g. dist.new_group(ranks)), got "
            f"{type(group).__name__} {group!r}"
        )
    if not dist.is_initialized():
        raise ValueError("group= is given but torch.distributed is not initialized")
    return weight, bias, group, dist.get_rank(group)


PLAN_INTS = 18  # int64 per rank in the plan's all-gather (`plan`)
MERGE_FLOATS = 4  # fp32 per counted row per rank in a merge's all-gather (`merge`)


@dataclass
class Plan:
    """This rank's place in the vocab-parallel group, for one call."""

    group: object
    rank: int  # in the group
    size: int  # P
    offset: int  # o_r: this shard's first vocabulary id
    width: int  # V_r (may be 0)
    vocab: int  # V, the whole vocabulary
    chunk: int  # rows per GEMM, the same on every rank
    active: Tensor  # (R,) int64 rows whose mask is not 0
    ends: Tensor  # (P,) int64: o_k + V_k of shard k, in shard order
    shard_rank: Tensor  # (P,) int64: the group rank that holds shard k

    def owner(self, y: Tensor) -> Tensor:
        """The group rank that holds token y (global ids in [0, V)), (R,) int64."""
        return self.shard_rank[torch.searchsorted(self.ends, y, right=True)]


def _fingerprint(tau, device) -> Tensor:
    """(2,) int64, equal on two ranks when their `tau` are (a float, or a tensor: the per-row
    temperatures, the counted rows' indices): the float64 bits of tau and 0, or of sum_i tau_i
    and sum_i (i + 1) tau_i (on the device: no host read of its own)."""
    if not isinstance(tau, Tensor):
        return torch.tensor([float(tau), 0.0], dtype=torch.float64, device=device).view(torch.int64)
    t = tau.reshape(-1).double()
    i = torch.arange(1, t.numel() + 1, dtype=torch.float64, device=t.device)
    return torch.stack([t.sum(), (t * i).sum()]).to(device).view(torch.int64)


def call_constants(logit_scale, softcap, config=None) -> tuple[float, float, float]:
    """The floats of a call every rank must share, as `plan`'s check returns them: the logit
    scale, the softcap (0: none) and a fingerprint of the LossConfig (0: none; the CRC-32 of its
    repr, stable across processes, unlike hash())."""
    code = 0.0 if config is None else float(zlib.crc32(repr(config).encode()))
    return float(logit_scale), 0.0 if softcap is None else float(softcap), code


def plan(
    group, shard_index: int, check, weight, tokens, chunk_size, hidden, wants_grad: bool
) -> tuple[object, Plan]:
    """Run `check()` -> (result, mask or None, temperature, `call_constants(...)`) and exchange
    what every rank must agree on: one all-gather of PLAN_INTS int64 per rank and one host read.
    A failed check is raised on every rank (the failing rank's own message on it), so that no
    rank waits in a collective for one that raised; so are inputs that differ across ranks
    (sizes, token range, the temperature, hidden's width and dtype, whether a gradient is
    wanted, which rows count, the logit scale, softcap and loss config: each changes the
    collectives a rank takes or the rows and logits it merges, and a mismatch would hang, abort
    or merge different numbers) and tokens outside [0, V)."""
    P, me = dist.get_world_size(group), dist.get_rank(group)
    device = weight.device if isinstance(weight, Tensor) else torch.device("cpu")
    try:
        result, mask, tau, constants = check()
        N = tokens.numel()
        active = _active_rows(mask, N, device)
        info = [1, shard_index, weight.shape[0], N, active.numel(), chunk_size or 0]
        error = None
    except Exception as e:  # raised below, once every rank has reported
        error, info, result, active = e, [0, shard_index, 0, 0, 0, 0], None, None
    agreed = [0, 0, 0]  # hidden's width, its dtype (index in _DTYPES), a gradient wanted
    if error is None:
        dtype = _DTYPES.index(hidden.dtype) if hidden.dtype in _DTYPES else len(_DTYPES)
        agreed = [hidden.shape[-1], dtype, int(wants_grad)]
    mine = torch.tensor(info + [0, -1, 0, 0] + agreed + [0] * 5, dtype=torch.int64, device=device)
    if error is None and tokens.numel():
        mine[6:8] = torch.stack(torch.aminmax(tokens.reshape(-1))).long()
    if error is None:
        mine[8:10] = _fingerprint(tau, device)
        mine[13:15] = _fingerprint(active.double(), device)  # which rows count
        mine[15:18] = torch.tensor(constants, dtype=torch.float64, device=device).view(torch.int64)
    table = mine.new_empty(P, mine.numel())
    dist.all_gather(list(table.unbind(0)), mine, group=group)
    rows = table.tolist()
    failed = [r for r in range(P) if rows[r][0] == 0]
    where = f"(vocab-parallel LM head, rank {me} of {P})"
    if isinstance(error, ValueError):
        raise ValueError(f"{error} {where}") from error
    if error is not None:
        raise error
    if failed:
        raise ValueError(f"rank(s) {failed} of the group rejected their inputs {where}")
    if sorted(r[1] for r in rows) != list(range(P)):
        raise ValueError(f"the shard indices {[r[1] for r in rows]} are not 0..{P - 1} {where}")
    for col, what in ((3, "tokens.numel()"), (4, "the counted rows"), (5, "chunk_size"),
                      (6, "min(tokens)"), (7, "max(tokens)")):  # fmt: skip
        if len({r[col] for r in rows}) > 1:
            raise ValueError(
                f"{what} differs across ranks ({[r[col] for r in rows]}): hidden, tokens, mask and "
                f"the per-token inputs must be replicated over the group {where}"
            )
    if len({tuple(r[8:10]) for r in rows}) > 1:
        raise ValueError(
            f"temperature differs across ranks: it must be the same float, or the same (N,) "
            f"per-token tensor, on every rank of the group {where}"
        )
    if len({tuple(r[13:15]) for r in rows}) > 1:
        raise ValueError(
            f"the counted rows (mask != 0) differ across ranks: the mask must be the same on "
            f"every rank of the group {where}"
        )
    for col, what in ((15, "logit_scale"), (16, "softcap"), (17, "the loss config")):
        if len({r[col] for r in rows}) > 1:
            raise ValueError(
                f"{what} differs across ranks: every rank must make the same call (the same "
                f"logit_scale, softcap and config / overrides) {where}"
            )
    agreed = ((10, "hidden's width H", int), (11, "hidden's dtype", _dtype_name),
              (12, "whether a gradient is wanted", bool))  # fmt: skip
    for col, what, show in agreed:
        if len({r[col] for r in rows}) > 1:
            raise ValueError(
                f"{what} differs across ranks ([{', '.join(str(show(r[col])) for r in rows)}]): "
                "every rank must make the same call (hidden of one width and dtype; grad mode "
                "and requires_grad of hidden / weight / bias alike), or the collectives would not "
                f"pair up {where}"
            )
    order = sorted(range(P), key=lambda r: rows[r][1])  # group ranks in shard order
    widths = [rows[r][2] for r in order]
    V = sum(widths)
    lo, hi = rows[0][6], rows[0][7]
    if rows[0][3] and (lo < 0 or hi >= V):
        raise ValueError(
            f"tokens must lie in [0, V) = [0, {V}) (the whole vocabulary, shards {widths}), got "
            f"values in [{lo}, {hi}] {where}"
        )
    ends = torch.tensor(widths, dtype=torch.int64).cumsum(0)
    k = order.index(me)
    return result, Plan(
        group, me, P, int(ends[k]) - widths[k], widths[k], V,
        chunk_size or default_chunk(max(widths), device), active, ends.to(device),
        torch.tensor(order, dtype=torch.int64, device=device),
    )  # fmt: skip


# --------------------------------------------------------------------------- merge
def _empty_shard_stats(R: int, device) -> Tensor:
    """(logp, H, m, log s) of a shard with no columns: log s = -inf (no mass), H = m = 0."""
    out = torch.zeros(4, R, dtype=torch.float32, device=device)
    out[3] = float("-inf")
    return out


def merge(local: Tensor, y: Tensor, plan: Plan) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The whole row's (logp, H), fp32 (R,) each, and this rank's (m_r, lse - m_r) for its
    backward (`local_grads`' m and log s: p_j = exp((z'_j - m_r) - (lse - m_r)), exact at any
    offset), from this shard's (4, R) (logp_r, H_r, m_r, log s_r): one all-gather (16 B per row
    per rank), then the log-space merge of the module docstring, the same on every rank."""
    parts = local.new_empty(plan.size, *local.shape)
    dist.all_gather(list(parts.unbind(0)), local.contiguous(), group=plan.group)
    lp_r, h_r, m_r, ls_r = parts.unbind(1)  # (P, R) each
    # a_r = log of shard r's mass relative to e^M, M the largest max among the shards with
    # mass: (m_r - M) is exact where it matters (the shards near the max), log s_r is O(log V).
    # A shard with no mass (every logit -inf, or no columns) has a_r = -inf; a NaN logit (NaN
    # m_r or log s_r) makes the row NaN, as on one device
    m_mass = torch.where(ls_r == float("-inf"), float("-inf"), m_r)
    top = m_mass.amax(0, keepdim=True)  # (1, R)
    top = torch.where(top == float("-inf"), 0.0, top)  # (no mass at all: NaN, as on one device)
    a = (m_mass - top) + ls_r  # (P, R)
    log_mass = torch.logsumexp(a, 0)  # log S: lse = M + log S
    pi = torch.exp(a - log_mass)
    # a shard with no mass adds 0 (not 0 * inf); a NaN row (NaN pi) stays NaN
    entropy = torch.where(pi == 0, 0.0, pi * (h_r + (log_mass - a))).sum(0)
    own = plan.owner(y)[None]
    a_own = a.gather(0, own)[0]
    # logp = (z'_y - M) - log S = logp_own - (log S - a_own); an owner with no mass while others
    # have some: -inf, as on one device (its logp_own is -inf - -inf there)
    no_mass = (a_own == float("-inf")) & (log_mass > float("-inf"))
    logp = torch.where(no_mass, float("-inf"), lp_r.gather(0, own)[0] - (log_mass - a_own))
    # this rank's m_r: log s for its backward is lse - m_r = log S + (M - m_r). A row where this
    # shard has no mass: m = 0 there (the Triton kernels leave it -inf, and (z' - m) - log s was
    # (-inf + inf) - inf = NaN), so p_j = exp(-inf - finite) = 0, as the CPU path's row max has it
    m_me = torch.where(local[3] == float("-inf"), 0.0, local[2])
    return logp, entropy, m_me, log_mass + (top[0] - m_me)


def _stats(hidden, weight, bias, y, tau, scale, cap, plan: Plan):
    """The merged (logp, H) and this rank's (m, log s) of the counted rows, fp32 (R,) each (one
    all-gather: `merge`)."""
    active = plan.active
    if active.numel() == 0:
        return _empty_shard_stats(0, hidden.device).unbind(0)
    if plan.width == 0:
        local = _empty_shard_stats(active.numel(), hidden.device)
    else:  # a token this shard does not hold reads column 0 (its logp_r is not used)
        y_loc = (y - plan.offset).clamp_(0, plan.width - 1)
        local = local_stats(hidden, weight, bias, y_loc, active, tau, scale, cap, plan.chunk)
    return merge(local, y.index_select(0, active), plan)


def _grads(hidden, weight, bias, y, logp, m, log_s, entropy, g, h, tau, scale, cap, plan: Plan):
    """(dX (N, H) summed over the group, dW_r, db_r) from the merged logp, H, this rank's m and
    log s (`merge`) and g, h (N,)."""
    if plan.width == 0:
        dh = torch.zeros(y.numel(), weight.shape[1], dtype=hidden.dtype, device=hidden.device)
        dw, db = torch.zeros_like(weight), None if bias is None else torch.zeros_like(bias)
    else:  # y - o_r outside [0, V_r) on the ranks that do not hold y: no entry at y there
        dh, dw, db = local_grads(hidden, weight, bias, y - plan.offset, plan.active, logp, m,
                                 log_s, entropy, g, h, tau, scale, cap, plan.chunk)  # fmt: skip
        dw = dw.to(weight.dtype)
    dist.all_reduce(dh, group=plan.group)
    return dh, dw, db


# --------------------------------------------------------------------------- linear_logprobs
class _LinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, args, plan):
        y = tokens.reshape(-1).long()
        local = torch.stack(_stats(hidden, weight, bias, y, *args, plan))
        logp, entropy, m, log_s = scatter_rows(local, plan.active, y.numel())
        ctx.save_for_backward(hidden, weight, bias, y, logp, m, log_s, entropy)
        ctx.args, ctx.plan = args, plan
        return logp.view(tokens.shape), entropy.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        ops.refuse_double_backward("linear_logprobs")
        hidden, weight, bias, y, logp, m, log_s, entropy = ctx.saved_tensors
        g = torch.zeros_like(logp) if grad_logp is None else grad_logp.reshape(-1).float()
        h = None if grad_entropy is None else grad_entropy.reshape(-1).float()
        with torch.autocast(hidden.device.type, enabled=False):
            dh, dw, db = _grads(
                hidden, weight, bias, y, logp, m, log_s, entropy, g, h, *ctx.args, ctx.plan
            )
        return dh.view(hidden.shape), dw, db, None, None, None


def linear_logprobs(hidden, weight, bias, tokens, temperature, logit_scale, softcap, plan):
    """(logp, H) fp32 shaped like tokens, differentiable w.r.t. hidden, weight_r and bias_r.
    temperature: a float, or fp32 (N,) per-row tau (a constant: no gradient)."""
    args = (temperature, logit_scale, softcap)
    return _LinearLogprobs.apply(hidden, weight, bias, tokens, args, plan)


# --------------------------------------------------------------------------- the policy loss
def row_temperature(x):
    """The temperature of the policy inputs `x` as the shards take it: the float, or the per-row
    tau as fp32 (N,) (a per-token temperature)."""
    return x.config.temperature if x.temperature_rows is None else x.temperature_rows.reshape(-1)


def policy_grads(hidden, weight, bias, x, scale, cap, plan: Plan, wants_grad: bool):
    """(logp, H) fp32 (B, T) of the policy inputs `x` and, with `wants_grad`, the gradients
    (dX (N, H) summed over the group, dW_r, db_r or None), all in the forward."""
    B, T = x.tokens.shape
    N = B * T
    tau = row_temperature(x)  # (each chunk takes its rows, like the tokens)
    y = x.tokens.reshape(-1).long()
    if not wants_grad or not is_token_separable(x.config):  # one all-gather of (4, R)
        local = torch.stack(_stats(hidden, weight, bias, y, tau, scale, cap, plan))
        logp, entropy, m, log_s = scatter_rows(local, plan.active, N)
        if not wants_grad:
            return logp.view(B, T), entropy.view(B, T), None
        g, h = ops.token_grads(logp.view(B, T), entropy.view(B, T), x)
        h = None if h is None else h.reshape(-1).float()
        grads = _grads(hidden, weight, bias, y, logp, m, log_s, entropy, g.reshape(-1).float(), h,
                       tau, scale, cap, plan)  # fmt: skip
        return logp.view(B, T), entropy.view(B, T), grads
    logp, entropy = (torch.zeros(N, dtype=torch.float32, device=hidden.device) for _ in "lh")
    n_written = plan.active.numel() if plan.width else -1  # an empty shard: dX zero-filled
    buf = _Buffer(min(plan.chunk, max(plan.active.numel(), 1)), weight)
    grads = _Grads(N, n_written, weight, bias, hidden.dtype, buf)
    flat = ops.flat_inputs(x)
    with ops._autograd_enabled():
        weights = aggregation_weights(x).reshape(1, N)
    for idx in _chunks(plan.active, plan.chunk):  # per chunk: one all-gather, three GEMMs
        y_loc = y.index_select(0, idx) - plan.offset
        if plan.width:
            rows = _gather(hidden, idx)
            z = _logits(rows, weight, bias, scale, cap, buf)
            factor = _chain_factor(z, scale, cap)
            yc = y_loc.clamp(0, plan.width - 1)[None]
            tau_rows = pick_temperature(tau, idx)
            local = torch.cat(row_stats(z[None], yc, tau_rows))
        else:
            local = _empty_shard_stats(idx.numel(), hidden.device)
        lp, ent, m, log_s = merge(local, y.index_select(0, idx), plan)
        g, h = ops.token_grads(lp[None], ent[None], ops.select_rows(flat, idx),
                               weights.index_select(1, idx))  # fmt: skip
        logp.index_copy_(0, idx, lp)
        entropy.index_copy_(0, idx, ent)
        if plan.width:
            stats = (t[None] for t in (y_loc, lp, m, log_s, ent))
            row_grad_(z[None], *stats, g, h, tau_rows)
            grads.add(idx, rows, _to_pre_activation(z, factor, scale), weight)
            del z, factor
    dh, dw, db = grads.result(bias)
    dist.all_reduce(dh, group=plan.group)
    return logp.view(B, T), entropy.view(B, T), (dh, dw.to(weight.dtype), db)
