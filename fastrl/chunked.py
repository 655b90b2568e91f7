"""The chunked torch backend of the per-token ops (CPU, or any device with FASTRL_BACKEND=torch).

It works on `chunk_rows(V)` rows of the (B, T, V) logits at a time (about CHUNK_BYTES of fp32 per
temporary), its element-wise passes on cache-sized blocks of `sub_rows(V)` rows (SUB_BYTES), so
its transient memory is bounded and independent of N (about CHUNK_BYTES + 2 SUB_BYTES of work
buffers per worker thread: `_threads`) and it never makes an fp32 copy of all the logits.
`fastrl.ops` dispatches here; the Triton backend is `fastrl.kernels`.

The backend interface (the same names as the Triton launchers in fastrl/kernels/policy_loss.py;
`fastrl.ops.backend(device)` picks one of the two modules):
  row_stats(logits, tokens, tau, shift=False, skip=None, entropy=True) -> fp32 logp, H, lse
                                              (one exp per logit; tau: a float, or a (B, T)
                                              per-row tensor; with `shift`, also (m, log s):
                                              lse = m + log s; logp = H = 0 where the mask
                                              `skip` is 0, rows the Triton kernels do not read;
                                              `entropy` False: H may be left 0, here not formed)
  row_grad_(logits, tokens, logp, lse, H, g, h, tau, out, shifted, skip=None)
                                              SPEC 6's dL/dz into `out`, p_j from `shifted` =
                                              (m, log s), exactly at any offset (lse unread);
                                              with row_stats' `skip` (g = h = 0 there) the rows
                                              it did not read are zeroed, not read
  scale_(grad, scale)                         grad *= scale in place (nothing when scale is 1)
  stats_and_grad_(logits, tokens, tau, grad_fn, out, rows_grads, row_terms, skip)
                                              statistics, then (g, h), then dL/dz into `out`: here
                                              with one exp per logit, in ONE pass for a
                                              token-separable loss (`one_pass_`, g and h per
                                              chunk), else two (`stats_e`, then `finish_`;
                                              bf16 / fp16: e formed again in the second); logp
                                              and H are 0 where the mask `skip` is 0 (the
                                              Triton kernels do not read those rows)

Gradient in the forward, with ONE exp per logit: pass 1 writes e = exp(z' - m) (z' = z / tau,
m = max z') while it reduces the row (s = sum e, sum e (z' - m), z'_y); pass 2 turns e into dL/dz
in place, reading only that buffer:
    dL/dz_j = p_j a log p_j + p_j c (+ g/tau at j = y),  p = e / s,
    a = -h / tau,  c = -(g + h H) / tau
(with h = 0, the usual case, pass 2 is one multiply per element). The entry j = y is then
overwritten by its exact fp32 value (tau^-1 [g (1 - p_y) - h p_y (logp_y + H)]), so a buffer in
bf16 / fp16 never loses g (1 - p_y) to cancellation. For a token-separable loss the two passes
run back to back on each chunk while it is hot (`one_pass_`); sequence-level options need every
row's statistics first, so e goes to the gradient buffer and `finish_` is a second pass. Only
an fp32 buffer holds e exactly (`keeps_e`): with bf16 / fp16 logits pass 1 writes nothing and
pass 2 forms e again from the logits (a second exp per logit, into the chunk's fp32 work
buffer), so that the gradient is rounded once to the logits' dtype, as the one-pass path's.

Temperature (`tau` above): a Python float, or a tensor of per-row temperatures tau_t with one
value per row ((B, T), or anything with B * T elements), the per-token temperature of fastrl.ops:
z'_tj = z_tj / tau_t, and every formula above with the row's own tau_t. Each chunk then divides
by an fp32 (R, 1) column of its rows' tau (the same division as by the float: a constant tensor
gives bitwise the float's results). The values are the caller's to check (finite, > 0).
"""

from __future__ import annotations

import contextlib
import os
import threading
from concurrent.futures import ThreadPoolExecutor, wait

import torch
from torch import Tensor

from ._inputs import inv_tau, zero_uncounted

CHUNK_BYTES = 32 << 20  # fp32 bytes per temporary of the chunked torch path (a few exist at once)
SUB_BYTES = 4 << 20  # fp32 bytes per cache-sized scratch buffer of its element-wise passes


def chunk_rows(V: int) -> int:
    """Rows per chunk of the torch path: chunk_rows * V * 4 bytes <= CHUNK_BYTES (at least 1)."""
    return max(1, CHUNK_BYTES // (4 * max(V, 1)))


def sub_rows(V: int) -> int:
    """Rows per cache-sized block of the element-wise passes: sub_rows * V * 4 <= SUB_BYTES."""
    return max(1, SUB_BYTES // (4 * max(V, 1)))


# --------------------------------------------------------------------------- chunk scheduling
# A chunk's work is a few dozen element-wise ops and reductions. Run with intra-op parallelism,
# each op is a barrier across torch's threads: when another process holds one core, every op
# waits for the thread that shares it, and the whole call runs at the speed of the slowest core
# (measured: 1.7x slower than an eager loss on a 2-core VM at load 3-5). Instead, whole chunks go
# to worker threads that each run their ops single-threaded and take the next chunk when done
# (no barrier per op; a thread on a busy core simply takes fewer chunks). The results do not
# depend on which thread ran a chunk: every chunk is computed the same way (batch-invariant).
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_CHUNKS_PER_THREAD = 4  # at least this many chunks per thread when rows allow (load balance)


_SINGLE = threading.local()  # .done: this pool thread already runs its torch ops on one thread


def _threads(device: torch.device) -> int:
    """Worker threads for the chunk loop on `device`: torch's intra-op thread count on the CPU
    (FASTRL_CPU_THREADS, an int >= 1, overrides; 1 runs the chunks in the calling thread), 1
    elsewhere."""
    if device.type != "cpu":
        return 1
    env = os.environ.get("FASTRL_CPU_THREADS", "").strip()
    if not env:
        return max(1, torch.get_num_threads())
    if not (env.isascii() and env.isdigit()) or int(env) < 1:
        raise ValueError(f"FASTRL_CPU_THREADS must be an int >= 1 (or unset), got {env!r}")
    return int(env)


def _pool(n: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL._max_workers < n:
            _POOL = ThreadPoolExecutor(max_workers=n, thread_name_prefix="fastrl-chunk")
        return _POOL


def _forget_pool_after_fork() -> None:
    """In a forked child the pool's threads do not exist (its chunks would wait forever): a new
    pool and lock are made on first use there."""
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_after_fork)


def chunk_step(N: int, V: int, device: torch.device) -> int:
    """Rows per chunk: `chunk_rows(V)`, smaller when that leaves fewer than _CHUNKS_PER_THREAD
    chunks per worker thread (never below `sub_rows(V)`, the cache block)."""
    threads = _threads(device)
    step = chunk_rows(V)
    if threads > 1:
        step = min(step, max(sub_rows(V), -(-N // (threads * _CHUNKS_PER_THREAD))))
    return step


def for_chunks(N: int, V: int, device: torch.device, body, runs=None) -> None:
    """body(r0, r1, work) for the row chunks [r0, r1) of 0..N of (N, V) logits, `chunk_step`
    rows each, each with a `_Work` of its thread (see `run_chunks`). `runs`: None (every row),
    or the [a, b) row ranges to cover (`_runs_to_read`), each cut into chunks of its own."""
    if runs is None:
        step = chunk_step(N, V, device)
        run_chunks(N, step, device, body, lambda: _Work(min(step, N), V, device))
        return
    step = chunk_step(sum(b - a for a, b in runs), V, device)
    ranges = [(r0, min(b, r0 + step)) for a, b in runs for r0 in range(a, b, step)]
    run_chunks(N, step, device, body, lambda: _Work(min(step, N), V, device), ranges)


def run_chunks(
    N: int, step: int, device: torch.device, body, make_work=lambda: None, ranges=None
) -> None:
    """body(r0, r1, work) for the chunks [r0, r1) of 0..N, `step` rows each (or the given
    `ranges`, a list of (r0, r1)), `work` = make_work() once per thread: in the calling thread,
    or spread over worker threads that run their torch ops single-threaded and pull chunks from a
    shared queue (see the note above). Chunks run in any order and at once: a body writes only
    its own rows. Exceptions propagate."""
    if ranges is None:
        ranges = [(r0, min(N, r0 + step)) for r0 in range(0, N, step)]
    threads = min(_threads(device), len(ranges))
    if threads <= 1 or getattr(_SINGLE, "done", False):  # (a call from a chunk runs inline)
        work = make_work()
        for r0, r1 in ranges:
            body(r0, r1, work)
        return
    queue, lock, stop = iter(ranges), threading.Lock(), threading.Event()
    # the caller's thread-local dispatch state (a custom op's implementation runs below
    # autograd), grad mode and inference mode, which a new thread would not inherit
    include = torch._C._dispatch_tls_local_include_set()
    exclude = torch._C._dispatch_tls_local_exclude_set()
    grad_mode, inference = torch.is_grad_enabled(), torch.is_inference_mode_enabled()

    def worker():
        if not getattr(_SINGLE, "done", False):
            # this thread's ops: no intra-op barriers. torch.set_num_threads also sets the count
            # that threads new to torch start with: set once per pool thread, inside a call (the
            # caller restores it below), so later calls leave the process's setting alone
            torch.set_num_threads(1)
            torch.get_num_threads()  # this thread's lazy intra-op init now, while the count is 1
            _SINGLE.done = True
        work = make_work()
        # inference mode first: its guard edits the dispatch keys, which the caller's then replace
        mode = torch.inference_mode() if inference else contextlib.nullcontext()
        guards = torch._C._ForceDispatchKeyGuard(include, exclude)
        with mode, guards, torch.set_grad_enabled(grad_mode):
            while not stop.is_set():  # a failed chunk, or the caller's own exception, stops it
                with lock:
                    chunk = next(queue, None)
                if chunk is None:
                    return
                try:
                    body(*chunk, work)
                except BaseException:
                    stop.set()  # no other worker takes a new chunk
                    raise

    intra, futures = torch.get_num_threads(), []
    try:
        futures = [_pool(threads).submit(worker) for _ in range(threads)]
        for f in futures:
            f.result()
    finally:
        # nothing this call started runs on once it returns or raises (a chunk's exception, or
        # one raised in the caller, e.g. by a signal handler): the chunks in progress end, no
        # new one starts, and the caller's memory is its own again
        stop.set()
        wait(futures)
        torch.set_num_threads(intra)  # the caller's setting, whatever a new worker did


def _view_rows(x: Tensor, r0: int, r1: int) -> Tensor | None:
    """Rows r0:r1 of a (B, T, V) tensor as an (R, V) view, or None when (B, T) do not flatten."""
    B, T, V = x.shape
    if x.stride(0) == T * x.stride(1):
        return x.reshape(B * T, V)[r0:r1]
    return x[0, r0:r1] if B == 1 else None


def _rows(x: Tensor, r0: int, r1: int) -> Tensor:
    """Rows r0:r1 of a (B, T, V) tensor as (R, V): a view when (B, T) flatten, else a gather."""
    view = _view_rows(x, r0, r1)
    if view is not None:
        return view
    T = x.shape[1]
    idx = torch.arange(r0, r1, device=x.device)
    return x[idx // T, idx % T]  # (R, V) copy in x's dtype: chunk-sized


def row_stats(
    logits: Tensor,
    tokens: Tensor,
    temperature,
    *,
    shift: bool = False,
    skip: Tensor | None = None,
    entropy: bool = True,
):
    """logp, entropy, lse (fp32 (B, T)) of logits (B, T, V), `chunk_rows(V)` rows at a time
    (one exp per logit; H from max-shifted values); temperature a float or a (B, T) tensor of
    per-row temperatures. Out-of-range tokens give logp = NaN (no device-side assert); a NaN or
    +inf logit makes its row's logp, H and lse NaN. With `shift`, returns (logp, entropy, lse,
    (m, log s)): m = max_j z'_j and log s = log sum_j exp(z'_j - m), fp32 (B, T) each, for
    `row_grad_`'s exact p_j (as kernels/policy_loss.py's row_stats). `skip`: None, or a mask
    (B * T elements): logp and H are 0 where it is 0, and runs of such rows long enough to pay
    (`_runs_to_read`) are not read (their lse, m and log s are 0 too; `row_grad_` given the
    same `skip` does not read them either). `entropy` False: H is not formed (returned as 0:
    on the CPU two of the five element-wise passes over each block are H's)."""
    runs = _runs_to_read(skip, logits.shape[0] * logits.shape[1], logits.shape[2])
    logp, ent, log_s, lse, m = stats_e(
        logits, tokens, temperature, None, with_max=True, runs=runs, entropy=entropy
    )
    logp, ent = _zero_skipped(logp, ent, skip)
    return (logp, ent, lse, (m, log_s)) if shift else (logp, ent, lse)


def row_temperature(temperature, N: int):
    """The temperature of N rows as the chunk functions take it: a float as is, or a tensor of
    per-row temperatures (N elements, e.g. (B, T)) as a detached fp32 (N,) tensor."""
    if isinstance(temperature, Tensor):
        return temperature.detach().to(torch.float32).reshape(N)
    return float(temperature)


def _chunk_tau(tau, r0: int, r1: int):
    """tau of the rows r0:r1: the float, or an fp32 (R, 1) column of the (N,) per-row tensor."""
    return tau if isinstance(tau, float) else tau[r0:r1, None]


def _is_one(tau) -> bool:
    """tau is the float 1.0 (then z' = z: nothing to divide)."""
    return isinstance(tau, float) and tau == 1.0


def _scaled(rows: Tensor, temperature) -> Tensor:
    """z' = z * (1 / tau) as fp32 (R, V) (tau a float or an (R, 1) column of per-row
    temperatures: `inv_tau`); no copy for fp32 rows at tau = 1."""
    if _is_one(temperature) and rows.dtype == torch.float32:
        return rows
    if _is_one(temperature):
        return rows.float()
    return rows.float() * inv_tau(temperature)


def row_grad_(logits, tokens, logp, lse, entropy, g, h, temperature, out, shifted=None, skip=None):
    """SPEC 6's gradient into `out` (B, T, V), chunk by chunk, from the (B, T) statistics of
    `row_stats(shift=True)` (logp, entropy, and `shifted` = (m, log s)) and g, h; `out` may be
    `logits` itself; temperature a float or a (B, T) tensor of per-row temperatures (those of
    the statistics). `lse` is not read (the Triton launcher's signature, where it may stand in
    for `shifted`; here `shifted` is required).

    p_j = exp(z'_j - m) / s, with the row max formed again from the logits exactly as the
    statistics formed it, so p_j is exact at any offset of the logits (exp(z'_j - lse) would
    carry lse's rounding at its own scale, eps |lse|, into every p_j). log s may also be any
    log-mass relative to the row's own max (the vocab-parallel shards pass the whole row's
    lse - m_r). The pass is `finish_` with the logits: per chunk e = exp(z' - m) in cache-sized
    blocks, then dL/dz = p (a log p + c) with a = -h / tau, c = -(g + h H) / tau, and the exact
    entry at y, tau^-1 [g (1 - p_y) - h p_y (logp_y + H)], from the statistics' logp_y =
    (z'_y - m) - log s (`_chunk_finish_`, one implementation of the gradient).
    `skip`: None, or the mask given to `row_stats` (where it is 0, g and h must be 0): the
    runs of rows that row_stats did not read are not read here either, their rows zeroed."""
    if shifted is None:
        raise ValueError("chunked.row_grad_ needs `shifted` = row_stats(shift=True)'s (m, log s)")
    h = None if h is None else h.float()
    runs = _runs_to_read(skip, out.shape[0] * out.shape[1], out.shape[2])
    if runs is not None:
        _zero_rows_(out, _gaps(runs, out.shape[0] * out.shape[1]))
    return finish_(out, tokens, logp, entropy, shifted[1], g.float(), h, temperature, logits, runs)


def scale_(grad: Tensor, scale: Tensor) -> Tensor:
    """grad *= scale in place; no pass over `grad` when scale is exactly 1 (the usual
    loss.backward()). A CPU scale is read (no device sync); on another device the multiply runs
    unconditionally (reading it would sync). The product is formed with the fp32 scale and
    rounded once to grad's dtype, as the Triton kernel does (a scale first rounded to a bf16 /
    fp16 grad's dtype moved every entry by bf16(s) / s: 1.0019 for loss / 3). On the CPU the
    multiply reads a CPU scalar in its own precision; a 0-dim tensor on a GPU is cast to grad's
    dtype by it, so a half-precision grad there is multiplied in fp32 copies of row chunks."""
    if grad.numel() == 0 or (scale.device.type == "cpu" and float(scale) == 1.0):
        return grad
    scale = scale.to(torch.float32)
    if grad.device.type == "cpu" or grad.dtype in (torch.float32, torch.float64):
        return grad.mul_(scale)
    return _scale_in_fp32_(grad, scale)


def _scale_in_fp32_(grad: Tensor, scale: Tensor) -> Tensor:
    """grad *= scale (fp32, 0-dim) for a half-precision grad, each product formed in fp32 and
    rounded once: on fp32 copies of chunk_rows(V) rows at a time (bounded memory)."""
    for rows in _row_blocks(grad):  # (R, V) views of grad
        step = chunk_rows(rows.shape[1])
        for r0 in range(0, rows.shape[0], step):
            part = rows[r0 : r0 + step]
            part.copy_(part.float().mul_(scale))
    return grad


def _row_blocks(t: Tensor) -> list[Tensor]:
    """2-D (R, last dim) views covering t: one when its leading dims flatten, else one per
    leading index (a sliced (B, T, V) view)."""
    if t.dim() <= 1:
        return [t.view(1, -1)]
    try:
        return [t.view(-1, t.shape[-1])]
    except RuntimeError:
        return [block for sub in t.unbind(0) for block in _row_blocks(sub)]


def _store_rows(out: Tensor, r0: int, r1: int, src: Tensor) -> None:
    """out's flattened rows r0:r1 (out (B, T, V)) = src (R, V), cast to out's dtype."""
    dst = _view_rows(out, r0, r1)
    if dst is None:
        T = out.shape[1]
        idx = torch.arange(r0, r1, device=out.device)
        out[idx // T, idx % T] = src.to(out.dtype)
    elif dst.data_ptr() != src.data_ptr():
        dst.copy_(src)


class _Work:
    """fp32 buffers reused across the chunks of one call (a fresh chunk-sized CPU allocation per
    chunk costs page faults every time): `e(R)` holds a chunk's exp values until its per-token
    gradients are known; `u(S)` / `es(S)` are the cache-sized (`sub_rows(V)` rows) scratch of
    the element-wise passes."""

    def __init__(self, R: int, V: int, device):
        self.R, self.S, self.V, self.device = R, min(R, sub_rows(V)), V, device
        self._bufs: dict[str, Tensor] = {}

    def _get(self, name: str, rows: int, n: int) -> Tensor:
        if name not in self._bufs:
            self._bufs[name] = torch.empty(rows, self.V, dtype=torch.float32, device=self.device)
        return self._bufs[name][:n]

    def e(self, n: int) -> Tensor:
        return self._get("e", self.R, n)

    def u(self, n: int) -> Tensor:
        return self._get("u", self.S, n)

    def es(self, n: int) -> Tensor:
        return self._get("es", self.S, n)

    def target(self, out: Tensor, r0: int, r1: int) -> tuple[Tensor | None, Tensor]:
        """(view, e) for the rows r0:r1 of `out` (B, T, V): view is their (R, V) view (None when
        they do not flatten); e, where the chunk's fp32 values are built, is that view itself
        when it is fp32, else the reused `e` buffer (then copied to `out` afterwards)."""
        view = _view_rows(out, r0, r1)
        direct = view is not None and view.dtype == torch.float32
        return view, view if direct else self.e(r1 - r0)


def _sub_tau(tau, a: int, b: int):
    """tau of the rows a:b of a chunk: the float, or those rows of its (R, 1) column."""
    return tau if isinstance(tau, float) else tau[a:b]


def _row_max(x: Tensor) -> Tensor:
    """m (S, 1) fp32: the max of each row of x (S, V), 0 for a row whose every logit is -inf.
    Such a row then has u = -inf, e = 0, s = 0 and lse = m + log s = -inf (no mass), as in the
    Triton kernels, not -inf - (-inf) = NaN everywhere: a vocab-parallel shard whose columns a
    -inf bias masks whole adds nothing to the merge, where a NaN made every row NaN."""
    m = x.amax(-1, keepdim=True).float()
    return m.masked_fill_(m == float("-inf"), 0.0)


def _chunk_stats(rows: Tensor, y: Tensor, temperature, work: _Work, e_out, entropy: bool = True):
    """One exp per logit over a chunk: rows (R, V) logits (any dtype), y (R,) tokens,
    temperature a float or an fp32 (R, 1) column of the rows' own temperatures. `entropy`
    False: H is not formed (returned as 0; two passes fewer over each block).

    Returns fp32 (R,) logp = u_y - log s, H = log s - sum e u / s (u = z' - m, e = exp(u),
    s = sum e: no cancellation at large offsets or low temperature), log s and the row max m of
    z' (lse = m + log s). With `e_out` (R, V) fp32, e is written there. The element-wise work runs
    `work.S` rows at a time in cache-sized buffers: e is written once, the logits read once."""
    R, V = rows.shape
    with_h = entropy
    logp, entropy, log_s, m_all = (
        torch.empty(R, dtype=torch.float32, device=rows.device) for _ in range(4)
    )
    if not with_h:
        entropy.zero_()
    for a in range(0, R, work.S):
        b = min(R, a + work.S)
        x, yb = rows[a:b], y[a:b]
        u = work.u(b - a)  # (S, V) fp32: z' - m <= 0 (NaN for a NaN / +inf row)
        m = _row_max(x)  # (S, 1), exact in the logits' dtype
        if x.dtype == torch.float32:
            torch.sub(x, m, out=u)
        else:  # (a mixed-dtype sub is slower than the cast and an in-place sub)
            u.copy_(x).sub_(m)
        if not _is_one(temperature):  # (z - max z) / tau = z' - max z' (tau > 0, per row)
            inv = inv_tau(_sub_tau(temperature, a, b))  # float or (S, 1)
            u.mul_(inv)
            m = m * inv
        e = torch.exp(u, out=work.es(b - a) if e_out is None else e_out[a:b])
        y_ok = (yb >= 0) & (yb < V)
        u_y = u.gather(1, torch.where(y_ok, yb, 0)[:, None]).squeeze(1)
        s = e.sum(-1)  # (S,)
        ls = torch.log(s)
        logp[a:b] = torch.where(y_ok, u_y - ls, float("nan"))
        log_s[a:b] = ls
        m_all[a:b] = m.view(-1)
        if not with_h:
            continue
        # sum_j e_j u_j, in u's memory. A -inf logit has e = 0 and must add 0, not
        # 0 * -inf = NaN: such rows are redone on the CPU (a plain read); elsewhere u is clamped
        # first (no host sync). NaN rows stay NaN.
        if u.device.type == "cpu":
            sum_eu = u.mul_(e).sum(-1)
            bad = torch.isnan(sum_eu)
            if bool(bad.any()):
                idx = bad.nonzero().view(-1)
                sum_eu[idx] = torch.where(e[idx] == 0, 0.0, u[idx]).sum(-1)
        else:
            sum_eu = u.clamp_(min=torch.finfo(torch.float32).min).mul_(e).sum(-1)
        entropy[a:b] = ls - sum_eu / s
    return logp, entropy, log_s, m_all


def _chunk_finish_(e: Tensor, y, logp, entropy, log_s, g, h, temperature, work: _Work, dst):
    """e (R, V) fp32 = exp(z' - m) of a chunk, overwritten with dL/dz = p (a log p + c) (+ the
    exact entry at y), p = e / s, a = -h / tau, c = -(g + h H) / tau, from (R,) fp32 statistics
    (tau a float or an (R, 1) column of per-row temperatures: then 1 / tau is an (R,) vector);
    `work.S` rows at a time, each copied to `dst` (R, V) (any dtype; None: none) while in cache."""
    R, V = e.shape
    if isinstance(temperature, float):
        inv_temp = 1.0 / temperature
    else:
        inv_temp = torch.reciprocal(temperature.reshape(R))  # (R,) fp32
    inv_s = torch.exp(-log_s)  # (R,)
    if h is None:
        k1, k0 = None, g * (-inv_temp) * inv_s
    else:
        # p (a log p + c) = e/s (a log e + a (-log s) + c) = e * (a/s log e + (c - a log s)/s)
        a_ = h * -inv_temp
        c_ = (g + h * entropy) * -inv_temp
        k1, k0 = a_ * inv_s, (c_ - a_ * log_s) * inv_s
    # the exact entry at the sampled token (fp32, no cancellation in g (1 - p_y))
    y_ok = (y >= 0) & (y < V)
    y_safe = torch.where(y_ok, y, 0)
    p_y = torch.exp(logp)
    d_y = g * (1 - p_y)
    if h is not None:  # p_y (log p_y + H) -> 0 as p_y -> 0: 0, not 0 * -inf = NaN, at a -inf logit
        d_y = d_y - h * torch.where(p_y > 0, p_y * (logp + entropy), 0.0)
    d_y = d_y * inv_temp
    # rows with g = h = 0 (uncounted tokens) have a zero gradient, even when their logits hold a
    # NaN / inf (e = NaN there, and 0 * NaN = NaN); found with one host sync on the CPU, masked
    # on every sub-block elsewhere (no sync)
    zero = (g == 0) & torch.isnan(log_s)
    if h is not None:
        zero &= h == 0
    if e.device.type == "cpu" and not bool(zero.any()):
        zero = None
    for a in range(0, R, work.S):
        b = min(R, a + work.S)
        eb = e[a:b]
        if k1 is None:
            eb.mul_(k0[a:b, None])
        else:  # e k0 + (e log e) k1: e log e lies in [-1/e, 0] (0 at e = 0, log e clamped), so
            # nothing overflows where e = 0 even when k1 ~ h / tau does (tau -> 0): no 0 * inf
            t = torch.log(eb, out=work.u(b - a)).clamp_(min=-1e4).mul_(eb)
            eb.mul_(k0[a:b, None]).addcmul_(t, k1[a:b, None])
        at = (torch.arange(b - a, device=e.device), y_safe[a:b])
        # an out-of-range token (its logp is NaN) has no entry at y: its row stays p (a log p + c)
        eb[at] = torch.where(y_ok[a:b], d_y[a:b], eb[at])
        if zero is not None:
            eb.masked_fill_(zero[a:b, None], 0.0)
        if dst is not None and dst.data_ptr() != e.data_ptr():
            dst[a:b].copy_(eb)
    return e


def stats_e(
    logits: Tensor,
    tokens: Tensor,
    temperature,
    out: Tensor | None,
    with_max=False,
    runs=None,
    entropy: bool = True,
):
    """Row statistics of logits (B, T, V) with one exp per logit, `chunk_rows(V)` rows at a
    time: fp32 (B, T) logp, H, log s and lse (see `_chunk_stats`), and with `with_max` the row
    max m of z' (lse = m + log s); temperature a float or a (B, T) tensor of per-row
    temperatures. With `out` (B, T, V), e is also written there (`out` may be the logits' own
    storage: each chunk is read first). Only an fp32 `out` keeps e exactly: `keeps_e(out)`; the
    caller passes no other. `runs`: None, or the row ranges to read (`_runs_to_read`); the
    statistics of the other rows are 0 (and `out` is not written there). `entropy` False: H is
    not formed (0)."""
    B, T, V = logits.shape
    N = B * T
    new = torch.empty if runs is None else torch.zeros
    stats = [new(N, dtype=torch.float32, device=logits.device) for _ in range(5)]
    y_all = tokens.reshape(-1).long()
    tau_all = row_temperature(temperature, N)

    def body(r0, r1, work):
        e = None if out is None else work.target(out, r0, r1)[1]
        logp, ent, log_s, m = _chunk_stats(
            _rows(logits, r0, r1), y_all[r0:r1], _chunk_tau(tau_all, r0, r1), work, e, entropy
        )
        for dst, val in zip(stats, (logp, ent, log_s, m + log_s, m)):
            dst[r0:r1] = val
        if out is not None:
            _store_rows(out, r0, r1, e)

    for_chunks(N, V, logits.device, body, runs)
    return tuple(s.view(B, T) for s in stats[: 5 if with_max else 4])


def keeps_e(out: Tensor) -> bool:
    """Whether pass 1 of the two-pass path parks e = exp(z' - m) in `out` between the passes:
    only an fp32 one holds it exactly. In bf16 / fp16 the small probabilities would lose their
    precision (fp16: flushed to subnormals or 0) before pass 2 multiplies them by g / (tau s),
    so there pass 2 forms e again from the logits instead (as the Triton gradient kernel does)."""
    return out.dtype == torch.float32


def _recompute_e_(e: Tensor, rows: Tensor, temperature, work: _Work) -> Tensor:
    """e (R, V) fp32 = exp(z' - m) of the logits `rows` (R, V), formed as `_chunk_stats` forms
    it (the same ops on the same values: the same e), `work.S` rows at a time; temperature a
    float or the rows' (R, 1) fp32 column."""
    for a in range(0, rows.shape[0], work.S):
        b = min(rows.shape[0], a + work.S)
        x, u = rows[a:b], e[a:b]
        m = _row_max(x)
        if x.dtype == torch.float32:
            torch.sub(x, m, out=u)
        else:
            u.copy_(x).sub_(m)
        if not _is_one(temperature):
            u.mul_(inv_tau(_sub_tau(temperature, a, b)))
        u.exp_()
    return e


def finish_(out, tokens, logp, entropy, log_s, g, h, temperature, logits=None, runs=None):
    """Pass 2 of the two-pass path: overwrite `out` (B, T, V) with dL/dz chunk by chunk in fp32
    (`_chunk_finish_`), from e = exp(z' - m) that `out` holds (`keeps_e(out)`), or, given
    `logits` (B, T, V) (which may be `out` itself: each chunk is read before it is written),
    from e formed again from them into the chunk's fp32 work buffer (a bf16 / fp16 `out`).
    `runs`: None, or the row ranges to finish (`_runs_to_read`; the caller zeroes the rest)."""
    B, T, V = out.shape
    N = B * T
    flat = lambda t: None if t is None else t.reshape(N)  # noqa: E731
    y_all, logp, entropy, log_s, g, h = map(flat, (tokens.long(), logp, entropy, log_s, g, h))
    tau_all = row_temperature(temperature, N)

    def body(r0, r1, work):
        view, e = work.target(out, r0, r1)
        if logits is not None:
            if e is view:  # (an fp32 `out`: e is built in its rows, each read first)
                e = work.e(r1 - r0)
            _recompute_e_(e, _rows(logits, r0, r1), _chunk_tau(tau_all, r0, r1), work)
        elif e is not view:
            e.copy_(_rows(out, r0, r1))
        part = [None if t is None else t[r0:r1] for t in (y_all, logp, entropy, log_s, g, h)]
        _chunk_finish_(e, *part, _chunk_tau(tau_all, r0, r1), work, view)
        if view is None:
            _store_rows(out, r0, r1, e)

    for_chunks(N, V, out.device, body, runs)
    return out


def stats_and_grad_(
    logits, tokens, temperature, grad_fn, out, rows_grads=None, row_terms=None, skip=None
):
    """fp32 (B, T) logp and H of logits (B, T, V), and dL/dz written into `out` (B, T, V, may be
    `logits`) from (g, h) = grad_fn(logp, H) (all rows at once). `rows_grads`: None, or (for a
    token-separable loss) a function returning rows_grad_fn(r0, r1, logp, H) -> (g, h) of rows
    r0:r1 alone: then each chunk is finished in the pass that reduces it (`one_pass_`).
    temperature: a float, or a (B, T) tensor of per-row temperatures. `skip`: None, or the
    loss's mask (B * T elements): logp and H are returned as 0 where it is 0, as the Triton
    kernels give them (which do not read those rows), and the gradient there is 0 (g = h = 0);
    on the CPU, runs of such rows long enough to pay (`_runs_to_read`: padding at the end of a
    sequence) are not read either, their gradient rows zeroed. `row_terms` (the Triton
    one-pass kernel's loss description) is not used here: the interface is the kernels'."""
    B, T, V = logits.shape
    runs = _runs_to_read(skip, B * T, V)
    if runs is not None:
        _zero_rows_(out, _gaps(runs, B * T))  # (the rows not read: a zero gradient)
    if rows_grads is not None:  # (token-separable: a masked row's values reach no other row)
        logp, entropy = one_pass_(logits, tokens, temperature, rows_grads(), out, runs)
        return _zero_skipped(logp, entropy, skip)
    park = keeps_e(out)  # else pass 2 forms e again from the logits (bf16 / fp16: exact then)
    logp, entropy, log_s, _ = stats_e(logits, tokens, temperature, out if park else None,
                                      runs=runs)  # fmt: skip
    # zeroed before grad_fn: a sequence-level loss couples a sequence's tokens, and a NaN logp
    # of a masked row (NaN logits there) would give its counted tokens a NaN g (0 * NaN in the
    # backward of a sequence's KL-bias ratio), as it would give them on the Triton path
    logp, entropy = _zero_skipped(logp, entropy, skip)
    g, h = grad_fn(logp, entropy)
    finish_(out, tokens, logp, entropy, log_s, g.float(), h, temperature,
            None if park else logits, runs)  # fmt: skip
    return logp, entropy


# A masked run is skipped when it holds at least this many logits. Skipping splits the counted
# rows around it into one more chunk, whose fixed cost (a few dozen torch ops, and on the
# one-pass path the per-token loss math of `token_grads`) measured 0.3-0.5 ms on the 2-core CPU
# VM, about what 250k logits take there; below that, scattered masked rows at V = 70000 made a
# GRPO call 1.4-2x slower than reading every row (audit, 2026-11-28).
_SKIP_MIN_LOGITS = 1 << 19


def _runs_to_read(skip: Tensor | None, N: int, V: int) -> list[tuple[int, int]] | None:
    """The [a, b) row ranges of 0..N that must be read when rows whose mask `skip` (N elements,
    or None) is 0 need not be: every run of counted rows, a run of masked rows included when
    it is shorter than _SKIP_MIN_LOGITS / V rows (each range becomes chunks of its own, and a
    chunk's fixed cost is about what 250k logits take: a scattered masked row is computed
    anyway, the padding at a sequence's end is skipped). None: read
    every row (no mask, a tensor off the CPU, whose read would be a device sync, or no masked
    run that long)."""
    if skip is None or skip.device.type != "cpu" or N == 0:
        return None
    counted = skip.reshape(N) > 0
    if bool(counted.all()):
        return None
    change = torch.nonzero(counted[1:] != counted[:-1]).flatten().add_(1)
    starts = torch.cat([change.new_zeros(1), change])
    bounds = [*starts.tolist(), N]
    min_gap = -(-_SKIP_MIN_LOGITS // max(V, 1))
    runs: list[tuple[int, int]] = []
    for a, b, read in zip(bounds[:-1], bounds[1:], counted[starts].tolist()):
        if not (read or b - a < min_gap):
            continue  # a masked run worth skipping
        if runs and runs[-1][1] == a:
            runs[-1] = (runs[-1][0], b)
        else:
            runs.append((a, b))
    return None if runs == [(0, N)] else runs


def _gaps(runs: list[tuple[int, int]], N: int) -> list[tuple[int, int]]:
    """The [a, b) ranges of 0..N outside `runs` (sorted, disjoint)."""
    gaps, start = [], 0
    for a, b in runs:
        if a > start:
            gaps.append((start, a))
        start = b
    return gaps + ([(start, N)] if start < N else [])


def _zero_rows_(out: Tensor, ranges: list[tuple[int, int]]) -> None:
    """Zero the flattened rows [a, b) of `out` (B, T, V) for each range."""
    for a, b in ranges:
        _store_rows(out, a, b, out.new_zeros(()).expand(b - a, out.shape[-1]))


def _zero_skipped(logp: Tensor, entropy: Tensor, skip: Tensor | None) -> tuple[Tensor, Tensor]:
    """logp and H (B, T) with 0 where the mask `skip` is 0 (None: unchanged)."""
    return (
        (logp, entropy) if skip is None else zero_uncounted(skip.reshape(logp.shape), logp, entropy)
    )


def one_pass_(logits, tokens, temperature, rows_grad_fn, out, runs=None):
    """Statistics and dL/dz in ONE pass over the logits for a token-separable loss: per chunk
    the statistics, then (g, h) = rows_grad_fn(r0, r1, logp, H) of those rows, then the
    gradient from e, stored once into `out` (may be `logits`). `runs`: None, or the row ranges
    to read (`_runs_to_read`): logp and H are 0 elsewhere, where `out` is not written."""
    B, T, V = logits.shape
    N = B * T
    new = torch.empty if runs is None else torch.zeros
    logp_all, ent_all = (new(N, dtype=torch.float32, device=logits.device) for _ in "lh")
    y_all = tokens.reshape(-1).long()
    tau_all = row_temperature(temperature, N)

    def body(r0, r1, work):
        y = y_all[r0:r1]
        tau = _chunk_tau(tau_all, r0, r1)
        view, e = work.target(out, r0, r1)
        logp, ent, log_s, _ = _chunk_stats(_rows(logits, r0, r1), y, tau, work, e)
        g, h = rows_grad_fn(r0, r1, logp, ent)
        _chunk_finish_(e, y, logp, ent, log_s, g.float(), h, tau, work, view)
        if view is None:
            _store_rows(out, r0, r1, e)
        logp_all[r0:r1], ent_all[r0:r1] = logp, ent

    for_chunks(N, V, logits.device, body, runs)
    return logp_all.view(B, T), ent_all.view(B, T)
