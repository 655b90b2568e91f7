"""One-pass Gumbel-max sampler (SPEC 10): token, its log-prob and the row's entropy.

For a row z (V,) and z' = z / τ, one sweep over the vocabulary in blocks of BLOCK_V carries the
statistics of the row (per slot: slot r holds every group r + k·BLOCK_V/8, with its own running
max; no step between threads in the sweep), relative to a max m,
    m = max z',  s = Σ e^(z' - m),  w = Σ e^(z' - m)·(z' - m),
and draws the token in two stages of the Gumbel-max trick (exact for softmax(z')):
  1. a group of 8 consecutive columns (group g: columns 8g ... 8g + 7): the first argmax of
     log W_g + G_g, W_g = Σ_{j in g} e^(z'_j) its weight, G_g Gumbel noise from Philox
     stream 1 (_log2_group_exponential). The max of Gumbels shifted by log-weights falls on g
     with probability W_g / Σ W;
  2. a column within the winning group only (read again after the sweep: 8 logits a row): the
     first argmax of z'_j + G_j, G_j from Philox stream 0 at counter row·ceil(V/4) + j//4, word
     j % 4 (tl.randint4x's words); independent of stage 1, so P(y = j) = W_g / Σ W · e^(z'_j) / W_g.
Noise per group, not per logit, is what keeps the sweep cheap: about 17 SASS instructions a
logit on sm_90a at BLOCK_V 4096 (bf16 or fp32, aligned rows or not), where noise for every logit
took 43 (a quarter of a Philox call and two log2 each) and 3 MUFU operations a logit, over the
H200's read floor (DESIGN 2b); now 1.5 (kernel_report.py). A group's 8 columns are read as 8
vectors (one column of every group each) and reduced by the same element-wise ops in a fixed
order, so every number of a group depends on its own 8 columns and on counters keyed by its
index, whatever the layout: the same seed gives the same tokens whatever the launch (one
program per row or split-V at any slice), BLOCK_V, alignment or strides.
At the end
    lse = m + log s,   logp_y = (z'_y - m) - log s,   H = lse - Σ p z' = log s - w / s,
max-shifted, so that H has no cancellation at large logit offsets or low temperature (both of
its terms are >= 0). Entries equal to -inf (a truncated top-k / top-p support) get probability 0
and never win. A row holding a NaN logit gives logp = H = NaN (its token is some value in
[0, V): a group holding a NaN never wins). GREEDY skips the noise: the group of the first
largest max, then its first column equal to it (argmax of z).

Temperature: `inv_temperature` is the fp32 scalar 1 / τ; with the constexpr flag ROW_TEMP each row
reads its own 1 / τ_r from `inv_temp_ptr` (fp32 (N,)) instead (per-row temperature: the row is
sampled from softmax(z / τ_r), and logp / H are under that distribution). With ROW_TEMP off the
pointer is a dummy, never read.

Two launch shapes (softmax._split_config decides, in `sample_rows_configs`; `split_chunk` forces
it):
  * `_sample_fwd_kernel`, grid (N,): one program sweeps its whole row;
  * split-V for few rows and a large V (decode): `_sample_split_fwd_kernel`, grid (N, SPLITS),
    reduces slices of CHUNK columns (a multiple of 32: whole groups) to partials (m, s, w, best
    group key, its token and z') in fp32 / int64 scratch (N, SPLITS), then
    `_sample_merge_fwd_kernel`, grid (N,), merges them (log-sum-exp merge; the best key, the
    earliest slice on ties) and writes the same outputs. A group's key and its column do not
    depend on the split, so both give the same token.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import EXACT_PRODUCTS, LaunchConfig, Ptr, config, next_power_of_2
from .softmax import (
    _INTERPRET,
    _LN2,
    _LOG2E,
    _SPLIT_SM_COUNT,
    _exp2,
    _log2,
    _lse_finish,
    _lse_init,
    _lse_merge_partials,
    _lse_store_partials,
    _merge_config,
    _sm_count,
    _split_config,
)

_GROUP = tl.constexpr(8)  # columns a group: the sampler's unit of noise (_sample_slice)


@triton.jit
def _mulhilo(a, B: tl.constexpr):
    # (hi, lo) 32-bit words of the 64-bit product a * B, a uint32 block, B a uint32 constant.
    # Compiled: one mul.wide.u32 (one IMAD.WIDE.U32), where umulhi + mul take two multiplies.
    # Interpreted: a 64-bit product in numpy (no inline PTX there).
    if _INTERPRET:
        p = a.to(tl.uint64) * B
        return (p >> 32).to(tl.uint32), p.to(tl.uint32)
    else:
        return tl.inline_asm_elementwise(
            "{ .reg .u64 t; mul.wide.u32 t, $2, $3; mov.b64 {$1, $0}, t; }",
            "=r,=r,r,r",
            [a, tl.full(a.shape, B, tl.uint32)],
            dtype=(tl.uint32, tl.uint32),
            is_pure=True,
            pack=1,
        )


@triton.jit
def _philox4x32(seed, offset, STREAM: tl.constexpr = 0):
    # Philox4x32-10 (Salmon et al. 2011) under key `seed` (an int64 scalar: its low and high
    # words) at the counters `offset` (an int64 block: words 0 and 1), word 2 = STREAM, word 3 =
    # 0: for STREAM 0 bit for bit tl.randint4x(seed, offset), with each round's two
    # 32 x 32 -> 64-bit products as one instruction each (_mulhilo; kernel_report's sampler row
    # counts them). Another STREAM is another counter range: independent words.
    seed = seed.to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    c0 = offset.to(tl.uint32)
    c1 = (offset >> 32).to(tl.uint32)
    c2 = c0 * 0 + STREAM
    c3 = c0 * 0
    for _ in tl.static_range(10):
        hi0, lo0 = _mulhilo(c0, 0xD2511F53)
        hi2, lo2 = _mulhilo(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi2 ^ c1 ^ k0, lo2, hi0 ^ c3 ^ k1, lo0
        k0 = tl.add(k0, 0x9E3779B9, sanitize_overflow=False)  # the key schedule
        k1 = tl.add(k1, 0xBB67AE85, sanitize_overflow=False)
    return c0, c1, c2, c3


@triton.jit
def _log2_exponential(seed, offset, STREAM: tl.constexpr):
    # log2(E) of Exp(1) draws E = -log(1 - U), one per word of Philox(seed, offset, STREAM):
    # offset (B,) int64 -> (4 B,), element 4 i + l from word l of counter offset[i].
    # U = (bits + 0.5) 2^-32 in (0, 1]: fp32 rounds the top 128 words to 1.0, so 1 - U is floored
    # at 2^-33, the least it is exactly (E <= 33 ln 2): 1 - U = 0 gave E = inf, a key of -inf, a
    # token that could not be drawn (alone in its row's support, token 0 came out with
    # logp = -inf). Small U by a series (1 - U would lose them).
    r0, r1, r2, r3 = _philox4x32(seed, offset, STREAM)
    bits = tl.interleave(tl.interleave(r0, r2), tl.interleave(r1, r3))  # 4i + l <- r_l[i]
    return _log2_exp1(bits)


@triton.jit
def _log2_exp1(bits):
    # log2(E), E = -log(1 - U) ~ Exp(1), of 32-bit words `bits`: U = (bits + 0.5) 2^-32 ...
    u = (bits.to(tl.float32) + 0.5) * 2.3283064365386963e-10
    one_minus_u = tl.maximum(1.0 - u, 1.1641532182693481e-10)
    return _log2(tl.where(u < 1e-4, u + 0.5 * u * u, -_log2(one_minus_u) * _LN2))


@triton.jit
def _log2_group_exponential(seed, row, V, start, g, SLOTS: tl.constexpr):
    # log2(E_g) of the groups g (SLOTS,) (absolute indices, from `start`): E_g ~ Exp(1) from
    # Philox stream 1, in super-blocks of 512 groups (4096 columns) of 128 counters: group
    # g = 512 b + 128 a + q takes word a of counter row ceil(V / 4096) 128 + 128 b + q.
    # A whole super-block (SLOTS = 512, start a multiple of 4096): one Philox call per 4 groups,
    # arranged as the group vectors (512,) lie at 4 warps (element r in thread r % 128), so no
    # data moves between threads. Otherwise (small blocks) each group runs its counter's Philox.
    base = row * ((V + 4095) // 4096) * 128
    if SLOTS == 512:
        offs = base + start // 4096 * 128 + tl.arange(0, 128)
        r0, r1, r2, r3 = _philox4x32(seed, offs, 1)
        words = tl.join(tl.join(r0, r1), tl.join(r2, r3))  # (128, 2, 2): [q, a % 2, a // 2]
        bits = tl.reshape(tl.permute(words, (2, 1, 0)), (512,))  # 128 a + q
    else:
        r = g % 512
        r0, r1, r2, r3 = _philox4x32(seed, base + g // 512 * 128 + r % 128, 1)
        a = r // 128
        bits = tl.where(a == 0, r0, tl.where(a == 1, r1, tl.where(a == 2, r2, r3)))
    return _log2_exp1(bits)


@triton.jit
def _group_term(z, m_safe, k):
    # (e, e d) of one column of each group: d = z - m_g clamped to the lowest finite fp32 (a -inf
    # logit: e d = 0 * finite; NaN kept), e = 2^(k d).
    d = tl.maximum(z - m_safe, -3.4028234663852886e38, propagate_nan=tl.PropagateNan.ALL)
    e = _exp2(d * k)
    return e, e * d


@triton.jit
def _group_stats(row_ptr, stride_lv, first, hi, k, MASKED: tl.constexpr):
    # (m_g, s_g, w_g) (SLOTS,) of the groups whose first columns are `first` (SLOTS,) int64:
    # m_g = max z, s_g = sum 2^(k (z - m_g)), w_g = sum 2^(k (z - m_g)) (z - m_g), raw units.
    # The 8 columns are 8 vectors (SLOTS,), each reduced by the same element-wise ops in the
    # same order whatever the layout, alignment or stride (a (SLOTS, 8) tile's layout follows
    # the row's alignment: an odd stride spread a group over 8 threads, at 71 instructions a
    # logit with spills); column c is the load at ptr + c stride_lv (an immediate offset for a
    # unit stride). MASKED: columns >= hi load as -inf (the last block only).
    ptr = row_ptr + first * stride_lv
    if MASKED:
        NEG_INF: tl.constexpr = float("-inf")
        z0 = tl.load(ptr, mask=first < hi, other=NEG_INF).to(tl.float32)
        z1 = tl.load(ptr + stride_lv, mask=first + 1 < hi, other=NEG_INF).to(tl.float32)
        z2 = tl.load(ptr + 2 * stride_lv, mask=first + 2 < hi, other=NEG_INF).to(tl.float32)
        z3 = tl.load(ptr + 3 * stride_lv, mask=first + 3 < hi, other=NEG_INF).to(tl.float32)
        z4 = tl.load(ptr + 4 * stride_lv, mask=first + 4 < hi, other=NEG_INF).to(tl.float32)
        z5 = tl.load(ptr + 5 * stride_lv, mask=first + 5 < hi, other=NEG_INF).to(tl.float32)
        z6 = tl.load(ptr + 6 * stride_lv, mask=first + 6 < hi, other=NEG_INF).to(tl.float32)
        z7 = tl.load(ptr + 7 * stride_lv, mask=first + 7 < hi, other=NEG_INF).to(tl.float32)
    else:
        z0 = tl.load(ptr).to(tl.float32)
        z1 = tl.load(ptr + stride_lv).to(tl.float32)
        z2 = tl.load(ptr + 2 * stride_lv).to(tl.float32)
        z3 = tl.load(ptr + 3 * stride_lv).to(tl.float32)
        z4 = tl.load(ptr + 4 * stride_lv).to(tl.float32)
        z5 = tl.load(ptr + 5 * stride_lv).to(tl.float32)
        z6 = tl.load(ptr + 6 * stride_lv).to(tl.float32)
        z7 = tl.load(ptr + 7 * stride_lv).to(tl.float32)
    m_g = tl.maximum(
        tl.maximum(tl.maximum(z0, z1), tl.maximum(z2, z3)),
        tl.maximum(tl.maximum(z4, z5), tl.maximum(z6, z7)),
    )
    m_safe = tl.where(m_g == float("-inf"), 0.0, m_g)
    e0, f0 = _group_term(z0, m_safe, k)
    e1, f1 = _group_term(z1, m_safe, k)
    e2, f2 = _group_term(z2, m_safe, k)
    e3, f3 = _group_term(z3, m_safe, k)
    e4, f4 = _group_term(z4, m_safe, k)
    e5, f5 = _group_term(z5, m_safe, k)
    e6, f6 = _group_term(z6, m_safe, k)
    e7, f7 = _group_term(z7, m_safe, k)
    s_g = ((e0 + e1) + (e2 + e3)) + ((e4 + e5) + (e6 + e7))
    w_g = ((f0 + f1) + (f2 + f3)) + ((f4 + f5) + (f6 + f7))
    return m_g, s_g, w_g


@triton.jit
def _fold_groups(
    row_ptr, stride_lv, seed, row, V, start, hi, inv_temperature, k, state,
    GREEDY: tl.constexpr, SLOTS: tl.constexpr, MASKED: tl.constexpr,
):  # fmt: skip
    # One block: the groups start / 8 + slot (SLOTS,) -> their keys against each slot's best
    # and their statistics into each slot's running (m, s, w). state = (m_acc, s_acc, w_acc,
    # best_key, best_g), (SLOTS,) each.
    m_acc, s_acc, w_acc, best_key, best_g = state
    g = start // 8 + tl.arange(0, SLOTS)  # absolute group index
    m_g, s_g, w_g = _group_stats(row_ptr, stride_lv, g.to(tl.int64) * 8, hi, k, MASKED)
    if GREEDY:
        key = m_g
    else:
        noise = _log2_group_exponential(seed, row, V, start, g, SLOTS)
        # natural units, m_g c first: m_g k overflows for |m_g| / τ in (2.4e38, 3.4e38],
        # where tied inf keys would pick a wrong group with a finite logp
        key = m_g * inv_temperature + (_log2(s_g) - noise) * _LN2
    better = key > best_key  # strict: a slot's earliest group wins a tie
    best_key = tl.where(better, key, best_key)
    best_g = tl.where(better, g.to(tl.int32), best_g)
    # merge the group (m_g, s_g, w_g) into its slot: the one with the smaller max is scaled by
    # a = 2^(k (m_lo - m_hi)) (0 when m_lo = -inf, or far below: its w term is then 0, where
    # 0 * (s d) was NaN for s d = -inf at a spread near 3.4e38; NaN sums stay NaN)
    grew = m_g > m_acc
    m_hi = tl.maximum(m_acc, m_g)
    m_hi_safe = tl.where(m_hi == float("-inf"), 0.0, m_hi)
    d_lo = tl.maximum(tl.minimum(m_acc, m_g) - m_hi_safe, -3.4028234663852886e38)
    a = _exp2(d_lo * k)
    s_lo = tl.where(grew, s_acc, s_g)
    w_lo = tl.where(grew, w_acc, w_g)
    s_acc = tl.where(grew, s_g, s_acc) + a * s_lo
    w_acc = tl.where(grew, w_g, w_acc) + tl.where(a > 0, a * (w_lo + s_lo * d_lo), 0.0)
    return m_hi, s_acc, w_acc, best_key, best_g


@triton.jit
def _sample_slice(
    row_ptr,
    stride_lv,
    seed,
    row,
    V,
    lo,
    hi,
    inv_temperature,
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # Columns lo <= j < hi of one row, BLOCK_V at a time, as BLOCK_V / GROUP groups of GROUP
    # consecutive columns (group g: columns g GROUP ... g GROUP + GROUP - 1; lo and BLOCK_V are
    # multiples of 4 GROUP) -> (m, s, w, n_nan, key, token, z'_token): the statistics of
    # z'_j = c z_j (c = inv_temperature; raw units inside, as softmax._row_block_stats) and the
    # sampled column. Two stages of the Gumbel-max trick, exact for softmax(z'):
    #   1. the group: g* = first argmax_g (log W_g - log E_g), W_g = sum_{j in g} e^(c z_j)
    #      (log W_g = c m_g + ln 2 log2 s_g with m_g = max_{j in g} z_j, s_g = sum 2^(k (z_j -
    #      m_g)), k = c log2 e; c m_g formed first, so a key overflows only where |z| / τ does)
    #      and E_g ~ Exp(1) (_log2_group_exponential):
    #      P(g* = g) = W_g / sum W (the max of Gumbels shifted by log weights);
    #   2. the column, within g* only, after the sweep: first argmax_{j in g*} (c z_j - log E_j),
    #      E_j from stream 0 at counter row ceil(V / 4) + j // 4, word j % 4 (tl.randint4x's
    #      words): P(y = j | g*) = e^(c z_j) / W_g*, independent of stage 1.
    # Each group's numbers depend on its own columns only (_group_stats: element-wise ops in a
    # fixed order), so the token is the same whatever the launch (one program per row, split-V
    # at any slice), BLOCK_V or layout. Whole blocks load without a mask, the rest with one
    # (_fold_groups' MASKED). GREEDY: key_g = m_g, the column is the
    # first with z_j = m_g (the first argmax of z, hence of z').
    # Per column of a block: a max, a subtract, a clamp, a multiply, an exp2, an add and a
    # multiply-add (the group sums); per group: its key (a log2, the noise's two log2, a quarter
    # of a Philox call) and its merge into the slot's statistics (per-slot running max, no
    # cross-thread step in the sweep); at the end the slots merge in raw units (one max, scaled
    # by c once: scaling each slot's max first cost ulp(|z'|) a slot). A -inf logit (masked columns load as -inf) adds 0; a
    # group of -inf has s_g = 0, key -inf, and never wins; a NaN logit makes its group's s_g
    # NaN (key NaN: never wins) and the row's s NaN.
    NEG_INF: tl.constexpr = float("-inf")
    MIN: tl.constexpr = -3.4028234663852886e38
    GROUP: tl.constexpr = _GROUP
    SLOTS: tl.constexpr = BLOCK_V // GROUP
    cols = tl.arange(0, GROUP)  # stage 2's columns
    k = inv_temperature * _LOG2E
    m_acc = tl.full([SLOTS], NEG_INF, tl.float32)  # per slot: raw max so far
    s_acc = tl.zeros([SLOTS], dtype=tl.float32)  # sum 2^(k (z - m_acc))
    w_acc = tl.zeros([SLOTS], dtype=tl.float32)  # sum 2^(k (z - m_acc)) (z - m_acc)
    best_key = tl.full([SLOTS], NEG_INF, tl.float32)
    best_g = (tl.zeros([SLOTS], dtype=tl.int32) + lo // GROUP).to(tl.int32)
    state = (m_acc, s_acc, w_acc, best_key, best_g)
    whole = lo + (hi - lo) // BLOCK_V * BLOCK_V  # whole blocks without a mask, then the rest
    for start in range(lo, whole, BLOCK_V):
        state = _fold_groups(
            row_ptr, stride_lv, seed, row, V, start, hi, inv_temperature, k, state,
            GREEDY, SLOTS, False,
        )  # fmt: skip
    if whole < hi:
        state = _fold_groups(
            row_ptr, stride_lv, seed, row, V, whole, hi, inv_temperature, k, state,
            GREEDY, SLOTS, True,
        )  # fmt: skip
    m_acc, s_acc, w_acc, best_key, best_g = state
    # the slots' statistics merged in raw units (one max, scaled by c once at the end, as
    # softmax._row_stats_finish: scaling each slot's max first cost ulp(|z'|) per slot)
    m_raw = tl.max(m_acc, axis=0)
    m_raw_safe = tl.where(m_raw == NEG_INF, 0.0, m_raw)
    d_slot = tl.maximum(m_acc - m_raw_safe, MIN)
    a_slot = _exp2(d_slot * k)
    s = tl.sum(a_slot * s_acc, axis=0)
    w = tl.sum(tl.where(a_slot > 0, a_slot * (w_acc + s_acc * d_slot), 0.0), axis=0)
    m, s, w, n_nan = m_raw * inv_temperature, s, w * inv_temperature, tl.zeros((), tl.int32)
    key = tl.max(best_key, axis=0)
    g_star = tl.min(tl.where(best_key == key, best_g, 2147483647), axis=0)
    # stage 2: the column within group g_star (read again: one group a row)
    j = g_star.to(tl.int64) * GROUP + cols
    z = tl.load(row_ptr + j * stride_lv, mask=j < hi, other=NEG_INF).to(tl.float32)
    if GREEDY:
        col_key = z
    else:
        offs = row * ((V + 3) // 4) + g_star.to(tl.int64) * (GROUP // 4) + tl.arange(0, GROUP // 4)
        col_key = z * inv_temperature - _log2_exponential(seed, offs, 0) * _LN2
    best = tl.max(col_key, axis=0)
    first = tl.min(tl.where((col_key == best) & (j < hi), j, 2**62), axis=0)
    first = tl.where(first == 2**62, g_star.to(tl.int64) * GROUP, first)  # every key NaN
    z_y = tl.sum(tl.where(j == first, z, 0.0), axis=0)
    return m, s, w, n_nan, key, first, z_y * inv_temperature


@triton.jit
def _sample_store(tokens_ptr, logp_ptr, entropy_ptr, row, m, s, w, n_nan, best_idx, best_z):
    # token = best_idx, logp = (z'_y - m) - log s, H = log s - w / s; logp = H = NaN for a row
    # with a NaN logit, and for one whose z' = z / tau overflowed to +inf (m = inf: |z| / tau
    # past fp32's range), where H would otherwise come out as a finite 0.
    log_s, lse, entropy = _lse_finish(m, s, w, n_nan)
    tl.store(tokens_ptr + row, best_idx.to(tl.int64))
    tl.store(logp_ptr + row, tl.where(n_nan > 0, float("nan"), (best_z - m) - log_s))
    tl.store(entropy_ptr + row, tl.where(m == float("inf"), float("nan"), entropy))


@triton.jit
def _sample_fwd_kernel(
    logits_ptr,  # (N, V) any float
    seed_ptr,  # (1,) int64: Philox key
    tokens_ptr,  # (N,) int64 out
    logp_ptr,  # (N,) fp32 out
    entropy_ptr,  # (N,) fp32 out
    V,
    stride_ln,
    stride_lv,
    inv_temperature,  # fp32 scalar 1 / τ (unused when ROW_TEMP)
    inv_temp_ptr,  # (N,) fp32: 1 / τ_r of each row (read only when ROW_TEMP)
    ROW_TEMP: tl.constexpr,  # per-row temperature: inv_temperature = inv_temp_ptr[row]
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # grid (N,): program `row` sweeps columns [0, V) of its row (_sample_slice), then writes
    # token, logp and H (_sample_store).
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    if ROW_TEMP:  # z' = z / τ_r with this row's own temperature
        inv_temperature = tl.load(inv_temp_ptr + row)
    seed = tl.load(seed_ptr)
    m, s, w, n_nan, best_key, best_idx, best_z = _sample_slice(
        row_ptr, stride_lv, seed, row, V, 0, V, inv_temperature, GREEDY, BLOCK_V
    )
    _sample_store(tokens_ptr, logp_ptr, entropy_ptr, row, m, s, w, n_nan, best_idx, best_z)


@triton.jit
def _sample_split_fwd_kernel(
    logits_ptr,  # (N, V) any float
    seed_ptr,  # (1,) int64: Philox key
    part_m_ptr,  # (N, SPLITS) fp32 out: max z' of the slice
    part_s_ptr,  # (N, SPLITS) fp32 out: Σ e^(z' - m) of the slice; NaN if it holds a NaN logit
    part_w_ptr,  # (N, SPLITS) fp32 out: Σ e^(z' - m)·(z' - m) of the slice
    part_key_ptr,  # (N, SPLITS) fp32 out: max group key over the slice (log W_g + G_g; raw z if GREEDY)
    part_idx_ptr,  # (N, SPLITS) int64 out: its column (first maximum)
    part_z_ptr,  # (N, SPLITS) fp32 out: its z'
    V,
    CHUNK,  # columns per slice (the last one may be shorter)
    SPLITS,
    stride_ln,
    stride_lv,
    inv_temperature,  # fp32 scalar 1 / τ (unused when ROW_TEMP)
    inv_temp_ptr,  # (N,) fp32: 1 / τ_r of each row (read only when ROW_TEMP)
    ROW_TEMP: tl.constexpr,  # per-row temperature: inv_temperature = inv_temp_ptr[row]
    GREEDY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    # split-V stage 1, grid (N, SPLITS): program (row, k) reduces the columns
    # k·CHUNK <= j < min((k + 1)·CHUNK, V) (CHUNK a multiple of 32: whole groups, whole Philox
    # counters) to its partials, with the noise of the one-program kernel (keyed by group and
    # column index, not by launch). The partials are in z' = z / τ_r units, so the merge kernel
    # needs no temperature.
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1).to(tl.int64)
    row_ptr = logits_ptr + row * stride_ln
    if ROW_TEMP:
        inv_temperature = tl.load(inv_temp_ptr + row)
    seed = tl.load(seed_ptr)
    lo = split * CHUNK
    hi = tl.minimum(lo + CHUNK, V)
    m, s, w, n_nan, best_key, best_idx, best_z = _sample_slice(
        row_ptr, stride_lv, seed, row, V, lo, hi, inv_temperature, GREEDY, BLOCK_V
    )
    out = row * SPLITS + split
    _lse_store_partials(part_m_ptr, part_s_ptr, part_w_ptr, out, m, s, w, n_nan)
    tl.store(part_key_ptr + out, best_key)
    tl.store(part_idx_ptr + out, best_idx)
    tl.store(part_z_ptr + out, best_z)


@triton.jit
def _sample_merge_fwd_kernel(
    part_m_ptr,  # (N, SPLITS) fp32: partials of _sample_split_fwd_kernel
    part_s_ptr,  # (N, SPLITS) fp32
    part_w_ptr,  # (N, SPLITS) fp32
    part_key_ptr,  # (N, SPLITS) fp32
    part_idx_ptr,  # (N, SPLITS) int64
    part_z_ptr,  # (N, SPLITS) fp32
    tokens_ptr,  # (N,) int64 out
    logp_ptr,  # (N,) fp32 out
    entropy_ptr,  # (N,) fp32 out
    SPLITS,
    BLOCK_S: tl.constexpr,
):
    # split-V stage 2, grid (N,): merge a row's SPLITS partials, BLOCK_S at a time: (m, s, w) by
    # the log-sum-exp merge (softmax._lse_merge_partials; a NaN s_k marks a NaN logit), the
    # token as the largest key (the earliest slice on ties, as the one-program sweep), then
    # _sample_store.
    NEG_INF: tl.constexpr = float("-inf")
    row = tl.program_id(0).to(tl.int64)
    base = row * SPLITS
    m, s, w, n_nan = _lse_init()
    best_key = tl.full((), NEG_INF, tl.float32)
    best_k = base  # flat index of the winning partial (int64)
    ks = tl.arange(0, BLOCK_S)
    for start in range(0, SPLITS, BLOCK_S):
        k = start + ks
        valid = k < SPLITS
        m, s, w, n_nan = _lse_merge_partials(
            m, s, w, n_nan, part_m_ptr, part_s_ptr, part_w_ptr, base + k, valid
        )
        key = tl.load(part_key_ptr + base + k, mask=valid, other=NEG_INF)
        blk_best = tl.max(key, 0)
        blk_k = tl.argmax(key, 0)  # first maximum: the earliest slice
        better = blk_best > best_key
        best_key = tl.where(better, blk_best, best_key)
        best_k = tl.where(better, base + start + blk_k.to(tl.int64), best_k)
    best_idx = tl.load(part_idx_ptr + best_k)
    best_z = tl.load(part_z_ptr + best_k)
    _sample_store(tokens_ptr, logp_ptr, entropy_ptr, row, m, s, w, n_nan, best_idx, best_z)


# --------------------------------------------------------------------------- launch configurations
_F32 = torch.float32


def _sample_block(V: int) -> int:
    """BLOCK_V of the one-program sweep: 4096 (a whole super-block of the group noise, see
    _log2_group_exponential), or V rounded up to a power of 2 (at least 32: 4 groups a thread)."""
    return min(4096, max(32, next_power_of_2(V)))


def _sample_warps(block_v: int) -> int:
    """num_warps of a sampling sweep: at BLOCK_V 4096, 4 (32 logits a thread: 4 groups, one
    Philox call, laid out so that the group noise moves no data between threads); below, where
    each group runs its own Philox call, BLOCK_V / 256 (8 logits a thread; at least one warp)."""
    return 4 if block_v >= 4096 else max(1, block_v // 256)


def sample_rows_configs(
    N: int,
    V: int,
    dtype: torch.dtype,
    greedy: bool,
    device_sms: int = _SPLIT_SM_COUNT,
    split_chunk: int | None = None,
    *,
    row_temp: bool = False,
) -> tuple[LaunchConfig, ...]:
    """The launches of `sample_rows` for N rows of V logits of `dtype` on a device with
    `device_sms` SMs: (one program per row,) or (split-V stage 1, stage 2) (softmax._split_config;
    `split_chunk` forces it as in sample_rows); `row_temp`: a temperature per row (ROW_TEMP; never
    with `greedy`, which ignores the temperature). Example arguments: logits (N, V) contiguous."""
    block_v = _sample_block(V)
    if split_chunk:  # slices start at multiples of 32: whole groups, 4 to a Philox counter
        split_chunk = -(-split_chunk // 32) * 32
    splits, chunk = _split_config(N, V, block_v, device_sms, split_chunk)  # not cached: tests spy
    row_temp = bool(row_temp) and not greedy
    return _sample_rows_configs(N, V, dtype, bool(greedy), splits, chunk, row_temp)


@functools.lru_cache(maxsize=256)
def _sample_rows_configs(N, V, dtype, greedy, splits, chunk, row_temp) -> tuple[LaunchConfig, ...]:
    block_v = _sample_block(V)
    logits = {"logits_ptr": Ptr(dtype), "seed_ptr": Ptr(torch.int64)}
    outs = {"tokens_ptr": Ptr(torch.int64), "logp_ptr": Ptr(_F32), "entropy_ptr": Ptr(_F32)}
    strides = {"stride_ln": V, "stride_lv": 1, "inv_temperature": 1.0, "inv_temp_ptr": Ptr(_F32)}
    flags = {"ROW_TEMP": row_temp, "GREEDY": greedy}
    if splits == 1:
        args = {**logits, **outs, "V": V, **strides}
        warps = _sample_warps(block_v)
        return (
            config(
                _sample_fwd_kernel,
                (N,),
                warps,
                args,
                **flags,
                BLOCK_V=block_v,
                options=EXACT_PRODUCTS,
            ),
        )
    block_v = min(block_v, chunk & -chunk)  # slices start at multiples of BLOCK_V (>= 32)
    # scratch: fp32 (5, N, splits) for m, s, w, key, z' and int64 (N, splits) for the index
    aligned = (N * splits * 4) % 16 == 0
    parts = {f"part_{k}_ptr": Ptr(_F32, aligned or k == "m") for k in ("m", "s", "w", "key")}
    parts = {**parts, "part_idx_ptr": Ptr(torch.int64), "part_z_ptr": Ptr(_F32, aligned)}
    split_args = {**logits, **parts, "V": V, "CHUNK": chunk, "SPLITS": splits, **strides}
    block_s, warps_s = _merge_config(splits)
    return (
        config(
            _sample_split_fwd_kernel, (N, splits), _sample_warps(block_v), split_args,
            **flags, BLOCK_V=block_v, options=EXACT_PRODUCTS,
        ),
        config(
            _sample_merge_fwd_kernel, (N,), warps_s, {**parts, **outs, "SPLITS": splits},
            BLOCK_S=block_s, options=EXACT_PRODUCTS,
        ),
    )  # fmt: skip


def sample_rows(
    logits: torch.Tensor,
    seed: torch.Tensor,
    temperature,
    greedy: bool,
    *,
    split_chunk: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sample every row. logits (N, V) any float, any strides; seed (1,) int64 on the logits'
    device; temperature a float τ, or a tensor (N,) of per-row temperatures τ_r (ROW_TEMP; not
    with `greedy`, which samples the argmax under τ = 1). Returns tokens (N,) int64, logp (N,)
    fp32, entropy (N,) fp32.

    One program per row, or split-V for few rows and a large V (softmax._split_config;
    `split_chunk` forces it: 0 = one program per row, k > 0 = slices of k columns). Both give
    the same tokens for the same seed, and logp / entropy equal to fp32 rounding."""
    N, V = logits.shape
    dev = logits.device
    tokens = torch.empty(N, dtype=torch.int64, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    entropy = torch.empty(N, dtype=torch.float32, device=dev)
    if N == 0:
        return tokens, logp, entropy
    inv_rows = None
    if greedy:
        inv_temperature = 1.0
    elif isinstance(temperature, torch.Tensor):
        tau = temperature.detach().to(device=dev, dtype=torch.float32).reshape(N)
        inv_temperature, inv_rows = 1.0, torch.reciprocal(tau).contiguous()
    else:
        inv_temperature = 1.0 / temperature
    cfgs = sample_rows_configs(
        N, V, logits.dtype, greedy, _sm_count(dev), split_chunk, row_temp=inv_rows is not None
    )
    # (with a scalar temperature, `logp` stands in for the per-row pointer: never read)
    temp = (inv_temperature, logp if inv_rows is None else inv_rows)
    strides = (logits.stride(0), logits.stride(1), *temp)
    if len(cfgs) == 1:
        cfgs[0](logits, seed, tokens, logp, entropy, V, *strides)
        return tokens, logp, entropy
    split, merge = cfgs
    splits, chunk = split.arg("SPLITS"), split.arg("CHUNK")
    part = torch.empty((5, N, splits), dtype=torch.float32, device=dev)  # m, s, w, key, z'
    part_idx = torch.empty((N, splits), dtype=torch.int64, device=dev)
    parts = (part[0], part[1], part[2], part[3], part_idx, part[4])
    split(logits, seed, *parts, V, chunk, splits, *strides)
    merge(*parts, tokens, logp, entropy, splits)
    return tokens, logp, entropy
