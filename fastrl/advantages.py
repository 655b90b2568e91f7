"""Advantage estimators and DAPO reward helpers (SPEC 7 and 9), vectorised.

- `gae`: verl's masked GAE. CUDA tensors (or FASTRL_BACKEND=triton) use the Triton reverse scan of
  `fastrl.kernels.gae`; CPU tensors use a blocked closed-form scan in float64 (no per-step
  Python loop, no host sync on the tensors' values).
- `group_advantages`: GRPO / RLOO / REINFORCE++-baseline with contiguous groups or arbitrary
  group ids, via scatter-adds (no Python loop over groups).
- `whiten`, `overlong_penalty`, `dynamic_sampling_filter`.

Everything equals `fastrl.reference` up to floating-point rounding. The NaN checks on rewards and
values read the data: on CUDA tensors that is a device sync (these are host-level helpers run
once per batch); pass `check=False` to skip them.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import Tensor

from ._inputs import check_float, check_mask
from .ops import backend_for

WHITEN_EPS = 1e-8  # SPEC 7
_SCALES = ("group", "batch", "none")
_ESTIMATORS = ("grpo", "rloo", "reinforce++")


# --------------------------------------------------------------------------- validation
def _check_finite(name: str, x: Tensor, counted: Tensor | None = None) -> None:
    """Raise if x has a NaN (at an entry where `counted` is True, when given)."""
    if x.device.type == "meta":
        return
    nan = torch.isnan(x)
    if counted is not None:
        nan = nan & counted
    if nan.any():
        where = " at a counted token" if counted is not None else ""
        raise ValueError(f"{name} (shape {tuple(x.shape)}) contains NaN{where}")


# --------------------------------------------------------------------------- whitening
def _sqrt_var_plus_eps(var_unit: Tensor, s: Tensor, eps: float) -> Tensor:
    """sqrt(var + eps) for var = s²·var_unit (s >= 0 the scale of the centred values), formed
    without s²: s·sqrt(var_unit + eps/s²) when s > 1 (no overflow for huge s), else
    sqrt(s²·var_unit + eps) (s² can only underflow where it is negligible next to eps)."""
    big = s > 1
    s_big = torch.where(big, s, 1.0)
    s_small = torch.where(big, 0.0, s)
    return torch.where(
        big,
        s_big * torch.sqrt(var_unit + eps / s_big.square()),
        torch.sqrt(s_small.square() * var_unit + eps),
    )


def whiten(x: Tensor, mask: Tensor | None = None, shift_mean: bool = True) -> Tensor:
    """(x - mean) / sqrt(var + 1e-8) over the counted entries (SPEC 7), var unbiased.

    x any shape and float dtype, mask like x (bool, 0/1 integer or float weights >= 0; None = all
    count). mean = Σ m·x / Σ m and var = Σ m·(x - mean)² / (Σ m - 1) (no Bessel correction
    when Σ m <= 1). Every entry is transformed; only the counted ones (m > 0) reach the
    statistics, so a NaN / inf at an entry with m = 0 stays at that entry. Nothing counted
    (Σ m = 0): the result is all zeros. `shift_mean=False` adds the mean back.

    Scale-safe: computed in float64, centred first, and var + eps is formed as
    s²·(var(c/s) + eps/s²) with s = max |x - mean| over counted entries, so neither huge inputs
    (1e20 in fp32, 1e200 in fp64) overflow nor tiny ones lose the eps. No host sync. Returns fp32
    (same shape as x)."""
    x = check_float("x", x, "any shape")
    if mask is None:
        mask = torch.ones(x.shape, dtype=torch.float32, device=x.device)
    else:
        mask = check_mask("mask", mask, x.shape, x.device)
    if x.numel() == 0:
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    counted = mask > 0
    w = torch.where(counted, mask, 0.0).double()  # weights; NaN masks are refused on CPU
    xd = x.double()
    count = w.sum()
    x_counted = torch.where(counted, xd, 0.0)  # masked entries never reach the statistics
    mean = (x_counted * w).sum() / torch.where(count > 0, count, 1.0)
    centered = torch.where(counted, x_counted - mean, 0.0)
    dof = torch.where(count > 1, count - 1, torch.where(count > 0, count, 1.0))
    if x.dtype == torch.float64:  # squares of float64 values can overflow: scale them first
        s = centered.abs().amax()  # the scale of the counted, centred values
        centered = centered / torch.where(s > 0, s, 1.0)  # |.| <= 1
        std = _sqrt_var_plus_eps((centered.square_() * w).sum() / dof, s, WHITEN_EPS)
    else:  # fp32 / bf16 / fp16 values squared cannot overflow nor underflow in float64
        std = torch.sqrt((centered.square_() * w).sum() / dof + WHITEN_EPS)
    out = (xd - mean).div_(std)
    if not shift_mean:
        out = out + mean
    return torch.where(count > 0, out, 0.0).float()


_whiten = whiten  # `gae` has an argument named `whiten`


# --------------------------------------------------------------------------- GAE
def _gae_block_len(c: float, T: int) -> int:
    """Block length L of the closed-form scan: c^-L <= 1e4 bounds the float64 cancellation."""
    if c >= 1.0 or c < 0.2:  # (c < 0.2 is not scanned blockwise: see the truncated sum)
        L = 256
    else:
        L = int(max(1, min(256, math.floor(math.log(1e4) / -math.log(c)))))
    return min(L, T + 1)


def _chain_blocks(totals: Tensor, decay: float, chain: Tensor | None) -> Tensor:
    """S_b = Σ_{b' >= b} decay^(b' - b) · totals_b' for totals (n, nb): A at each block's start.

    One matmul with the (nb, nb) triangular `chain` when given; else, when decay^k dies out
    fast, a few shifted adds (terms below 1e-18 relative dropped); else a loop over blocks."""
    if chain is not None:
        return totals @ chain
    nb = totals.shape[1]
    if decay < 0.01:
        starts = totals.clone()
        K = min(nb - 1, math.ceil(math.log(1e-18) / math.log(decay))) if decay > 0 else 0
        for k in range(1, K + 1):
            starts[:, :-k].add_(totals[:, k:], alpha=decay**k)
        return starts
    starts = torch.empty_like(totals)
    carry = torch.zeros_like(totals[:, 0])
    for b in range(nb - 1, -1, -1):
        carry = totals[:, b] + decay * carry
        starts[:, b] = carry
    return starts


def _gae_torch(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float,
    lam: float,
    whiten: bool = False,
    rows_per_chunk: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Masked GAE (B, T) by a blocked closed-form reverse scan: no loop over steps.

    rewards, values (B, T) any float; mask (B, T) bool or 0/1 float. For a binary mask, tokens
    with m = 0 take A from the next counted token, and the counted tokens of a row, compacted to
    a sequence with δ_j = (r - V)_j + γ·V_{j+1} (V = 0 after the last), obey the constant-
    coefficient recurrence A_j = δ_j + c·A_{j+1}, c = γλ. So, per chunk of rows:
      1. scatter each row's counted (r - V) and V to the front of a zeroed row of W = nb·L >= T+1
         entries (every row ends with zeros: its sentinel A = 0) and form δ (n, W);
      2. per block of L entries, x_i = c^i δ_i and P_i its inclusive cumsum give
         A_i = c^-i (S - P_i + x_i), S = A at the block's first entry; S is chained across the
         nb blocks by one small matmul (`_chain_blocks`). When c < 0.2, instead
         A_j = Σ_{i <= J} c^i δ_{j+i} with c^J < 1e-18 (a few shifted adds);
      3. gather back: A_t = A_compact[b, #counted before t].
    The scan runs in float64 and L is chosen so that c^-L <= 1e4 (cancellation error ~1e-12 of
    the block's |δ|). Chunks keep the temporaries small; the whitening statistics are collected
    per chunk in float64 (count, mean and Σ (A - mean)² over the compact rows, merged across
    chunks with Chan's formula). Uncounted tokens go to a shadow copy that is never read, so a
    NaN there reaches neither A nor the whitening. No host sync.
    Returns (advantages, returns) fp32 (B, T): advantages whitened over counted tokens (`whiten`,
    SPEC 7) when `whiten`, returns = unwhitened A + V."""
    B, T = rewards.shape
    dev = rewards.device
    c = gamma * lam
    L = _gae_block_len(c, T)
    nb = -(-(T + 1) // L)
    W = nb * L
    if rows_per_chunk is None:
        rows_per_chunk = max(1, (1 << 17) // W)
    pw = c ** torch.arange(L, dtype=torch.float64, device=dev)  # (L,) c^i
    inv_pw = 1.0 / pw
    decay = c**L
    chain = None  # (nb, nb): chain[b', b] = decay^(b' - b) for b' >= b, else 0
    if c >= 0.2 and nb <= 1024:
        k = torch.arange(nb, device=dev)
        gap = (k[:, None] - k[None, :]).double()
        chain = torch.where(gap >= 0, decay ** gap.clamp(min=0), 0.0)
    J = math.ceil(math.log(1e-18) / math.log(c)) if 0 < c < 0.2 else 0
    out = torch.empty(B, T, dtype=torch.float32, device=dev)
    returns = torch.empty(B, T, dtype=torch.float32, device=dev)
    count = torch.zeros((), dtype=torch.float64, device=dev)
    mean = torch.zeros((), dtype=torch.float64, device=dev)
    m2 = torch.zeros((), dtype=torch.float64, device=dev)
    slots = torch.arange(W, device=dev)
    for s in range(0, B, rows_per_chunk):
        e = min(B, s + rows_per_chunk)
        n = e - s
        mc = mask[s:e] if mask.dtype == torch.bool else mask[s:e] != 0  # (n, T)
        # 1. compact each row's counted tokens to the front of its row of W entries
        idx = torch.nn.functional.pad(mc[:, :-1], (1, 0)).cumsum(1)  # (n, T) #counted before t
        idx += (torch.arange(n, device=dev) * W)[:, None]
        dst = idx.add(~mc, alpha=n * W).view(-1)  # uncounted tokens go to a shadow copy
        delta = torch.empty(2 * n * W, dtype=torch.float32, device=dev)
        v_compact = torch.empty(2 * n * W, dtype=torch.float32, device=dev)
        delta[: n * W].zero_()
        v_compact[: n * W].zero_()
        r, v = rewards[s:e].float(), values[s:e].float()
        delta.scatter_(0, dst, (r - v).reshape(-1))
        v_compact.scatter_(0, dst, v.reshape(-1))
        delta = delta[: n * W].view(n, W)
        delta[:, :-1].add_(v_compact[: n * W].view(n, W)[:, 1:], alpha=gamma)  # δ_j (n, W)
        if c < 0.2:
            adv = delta.double()
            for i in range(1, min(J, W - 1) + 1):
                adv[:, :-i].add_(delta[:, i:], alpha=c**i)
        else:
            # 2. blockwise closed form
            x = delta.view(n, nb, L) * pw  # (n, nb, L) f64
            prefix = x.cumsum(2)
            starts = _chain_blocks(prefix[:, :, -1], decay, chain)  # (n, nb)
            adv = (starts[:, :, None] - prefix).add_(x).mul_(inv_pw)
        # 3. gather back (the zero sentinel when no counted token is left in the row)
        a = torch.take(adv.view(-1).float(), idx, out=out[s:e])
        torch.add(a, v, out=returns[s:e])
        if whiten:
            # this chunk's count / mean / M2 over counted tokens, from the compact rows (entry j
            # of row b is counted token j), merged into the running total (Chan et al.). M2 is
            # summed from centred values: no Σa² - n·mean² cancellation at large offsets.
            per_row = mc.sum(1, dtype=torch.float64)  # (n,)
            n_c = per_row.sum()
            mean_c = adv.sum() / n_c.clamp(min=1)  # the compact rows are 0 past their tokens
            centred = torch.where(slots < per_row[:, None], adv.view(n, W) - mean_c, 0.0)
            m2_c = torch.dot(centred.view(-1), centred.view(-1))
            total = count + n_c
            d = mean_c - mean
            mean = mean + d * n_c / total.clamp(min=1)
            m2 = m2 + m2_c + d.square() * count * n_c / total.clamp(min=1)
            count = total
    if whiten:  # SPEC 7: (A - mean) / sqrt(var + 1e-8), var unbiased; nothing counted: zeros
        var = m2 / torch.where(count > 1, count - 1, count.clamp(min=1))
        inv_std = torch.where(count > 0, torch.rsqrt(var + WHITEN_EPS), 0.0)
        out.sub_(mean.float()).mul_(inv_std.float())
    return out, returns


def gae(
    rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
    check: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation, verl's masked form (SPEC 7).

    rewards, values (B, T) fp32/bf16/fp16; mask (B, T) bool or 0/1 float (tokens with m = 0 are
    skipped: value and advantage carry through them). Scanning t = T-1 .. 0 from zero:
    δ = r_t + γ·next_v - V_t; a = δ + γλ·last; next_v <- m·V_t + (1-m)·next_v;
    last <- m·a + (1-m)·last; A_t = last. Returns (advantages, returns) fp32 (B, T) with
    returns = A + V (before whitening) and, when `whiten`, A whitened over counted tokens.
    What the mask excludes never reaches a counted token's result nor the whitening: a NaN / inf
    reward or value at a token with m = 0 only shows in `returns` at that same token (G_t = A_t
    + V_t there). `check=True` raises on NaN rewards / values at counted tokens (a device sync on
    CUDA). Advantages and returns are constants to the losses that use them: the inputs are
    detached (no gradient flows)."""
    expected = "shape (B, T)"
    check_float("rewards", rewards, expected)
    check_float("values", values, expected)
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape (B, T), got {tuple(rewards.shape)}")
    if tuple(values.shape) != tuple(rewards.shape) or values.device != rewards.device:
        raise ValueError(
            f"values has shape {tuple(values.shape)} on {values.device}; expected "
            f"{tuple(rewards.shape)} (like rewards) on {rewards.device}"
        )
    rewards, values = rewards.detach(), values.detach()
    mask = check_mask("mask", mask, rewards.shape, rewards.device, as_float=False)
    for name, val in (("gamma", gamma), ("lam", lam)):
        if isinstance(val, bool) or not isinstance(val, (int, float)) or not 0 <= val <= 1:
            raise ValueError(f"{name} must be a float in [0, 1], got {val!r}")
    gamma, lam = float(gamma), float(lam)
    if check:
        counted = mask if mask.dtype == torch.bool else mask != 0
        _check_finite("rewards", rewards, counted)
        _check_finite("values", values, counted)
    if rewards.numel() == 0:
        adv = torch.zeros(rewards.shape, dtype=torch.float32, device=rewards.device)
        return adv, adv + values.float()
    if backend_for(rewards.device) == "triton":
        from .kernels.gae import gae_scan

        adv = gae_scan(rewards, values, mask.float(), gamma, lam)
    elif mask.dtype != torch.bool and ((mask != 0) & (mask != 1)).any():
        adv = _gae_fractional_mask(rewards, values, mask.float(), gamma, lam)
    else:
        return _gae_torch(rewards, values, mask, gamma, lam, whiten)
    returns = adv + values.float()
    if whiten:
        adv = _whiten(adv, mask)
    return adv, returns


def _gae_fractional_mask(rewards, values, mask, gamma, lam):
    """Masks with values other than 0/1 (outside SPEC's use): the plain recurrence, step by step.
    A token with m = 0 leaves next_v and last as they are (a NaN there never reaches them)."""
    r, v, m = rewards.float(), values.float(), mask.float()
    B, T = r.shape
    next_v = r.new_zeros(B)
    last = r.new_zeros(B)
    out = torch.empty_like(r)
    for t in range(T - 1, -1, -1):
        a = r[:, t] + gamma * next_v - v[:, t] + gamma * lam * last
        mt = m[:, t]
        next_v = torch.where(mt > 0, mt * v[:, t] + (1 - mt) * next_v, next_v)
        last = torch.where(mt > 0, mt * a + (1 - mt) * last, last)
        out[:, t] = last
    return out


# --------------------------------------------------------------------------- group advantages
def _group_index(rewards: Tensor, group_size, group_ids) -> tuple[Tensor, int]:
    """Dense group index (B,) in [0, G) and an upper bound G on the number of groups."""
    B = rewards.shape[0]
    if group_ids is not None:
        if group_size is not None:
            raise ValueError("pass either group_size or group_ids, not both")
        if not isinstance(group_ids, Tensor) or tuple(group_ids.shape) != (B,):
            got = tuple(group_ids.shape) if isinstance(group_ids, Tensor) else type(group_ids)
            raise ValueError(f"group_ids must be an integer tensor of shape ({B},), got {got}")
        if group_ids.is_floating_point() or group_ids.is_complex():
            raise ValueError(f"group_ids must have an integer dtype, got {group_ids.dtype}")
        if group_ids.device.type == "meta" and rewards.device.type != "meta":
            raise ValueError(
                f"group_ids is on device meta (a tensor without data); expected it on the rewards' "
                f"device {rewards.device} or the CPU"
            )
        ids = group_ids.to(rewards.device).long()
        # compact arbitrary ids to 0..G-1 with a sort (no torch.unique: no host sync)
        sorted_ids, order = torch.sort(ids, stable=True)
        new = torch.ones_like(sorted_ids)
        new[1:] = (sorted_ids[1:] != sorted_ids[:-1]).long()
        dense = torch.empty_like(ids)
        dense[order] = new.cumsum(0) - 1
        return dense, B
    if (
        isinstance(group_size, bool)
        or not isinstance(group_size, int)
        or group_size < 1
        or B % group_size
    ):
        raise ValueError(
            f"group_size={group_size!r} must be an int >= 1 that divides the batch size {B} "
            "(or pass group_ids)"
        )
    return torch.arange(B, device=rewards.device) // group_size, B // group_size


def group_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    group_ids: Tensor | None = None,
    scale: str | None = None,
    estimator: str = "grpo",
    eps: float = 1e-6,
    mask: Tensor | None = None,
    check: bool = True,
) -> Tensor:
    """Outcome advantages from per-response rewards (B,) grouped by prompt (SPEC 7).

    Groups: contiguous blocks of `group_size`, or equal values of `group_ids` (B,) in any order.
    grpo: (R - μ_g) / (σ_g + eps) (`scale="group"`, σ unbiased), / (σ_batch + eps) (`"batch"`),
    or R - μ_g (`"none"`, Dr.GRPO); `scale=None` means `"group"` for grpo. rloo: n/(n-1)·(R - μ_g),
    SPEC's leave-one-out baseline (`scale=None` means `"none"`; `"group"` / `"batch"` divide as
    for grpo). reinforce++: R - μ_g, whitened over the batch's tokens of `mask` (B, T) when given
    -> (B, T), else over the B responses -> (B,); `scale` must be None (an all-zero `mask` gives
    zeros, see `whiten`). Groups of one and groups whose rewards are all equal give exactly 0.
    Computed in float64, scale-safe (σ from values divided by their group's max |R - μ_g| before
    squaring: ±1e200 in fp64 works). Returns fp32."""
    check_float("rewards", rewards, "shape (B,)")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    if estimator not in _ESTIMATORS:
        raise ValueError(f"estimator={estimator!r}; expected one of {_ESTIMATORS}")
    if scale is None:
        scale = {"grpo": "group", "rloo": "none", "reinforce++": None}[estimator]
    elif estimator == "reinforce++":
        raise ValueError(
            f"scale={scale!r} does not apply to estimator='reinforce++' (it whitens over the "
            "batch); leave scale=None"
        )
    elif scale not in _SCALES:
        raise ValueError(f"scale={scale!r}; expected one of {_SCALES}")
    if check:
        _check_finite("rewards", rewards)
    idx, G = _group_index(rewards, group_size, group_ids)
    r = rewards.double()
    B = r.shape[0]
    zeros = torch.zeros(G, dtype=torch.float64, device=r.device)
    n = zeros.index_add(0, idx, torch.ones_like(r))  # (G,) group sizes
    mean = zeros.index_add(0, idx, r) / n.clamp(min=1)
    centered = r - mean[idx]  # (B,)
    lo = torch.full_like(zeros, math.inf).scatter_reduce(0, idx, r, "amin")
    hi = torch.full_like(zeros, -math.inf).scatter_reduce(0, idx, r, "amax")
    n_i = n[idx]
    flat = (lo == hi)[idx] | (n_i < 2)  # all-equal groups and groups of one: exactly 0
    centered = torch.where(flat, 0.0, centered)
    std = _unbiased_std(centered, idx, n)[idx] if scale == "group" else None  # (B,) σ_g
    if estimator == "rloo":
        centered = centered * n_i / (n_i - 1).clamp(min=1)
    if estimator == "reinforce++":  # whitened in float64 (scale-safe), returned as fp32
        if mask is None:
            return whiten(centered)
        if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != B:
            got = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
            raise ValueError(f"mask must be a token mask of shape ({B}, T), got {got}")
        m = check_mask("mask", mask, tuple(mask.shape), r.device)
        return whiten(centered[:, None].expand(m.shape), m)
    if scale == "none":
        return centered.float()
    if scale == "group":
        return (centered / (std + eps)).float()
    batch = torch.zeros_like(idx)
    batch_std = _unbiased_std(r - r.mean(), batch, r.new_full((1,), B))[0]  # 0 when B = 1
    return (centered / (batch_std + eps)).float()


def _unbiased_std(centered: Tensor, idx: Tensor, n: Tensor) -> Tensor:
    """Per-group unbiased std (G,) from centred values (B,) in groups idx (B,) of sizes n (G,)
    (0 for groups of one). Scale-safe: each group's values are divided by their largest
    magnitude s_g before squaring, σ_g = s_g·sqrt(Σ (c/s_g)² / (n - 1))."""
    zeros = torch.zeros_like(n)
    s = zeros.scatter_reduce(0, idx, centered.abs(), "amax")  # (G,)
    scaled = centered / torch.where(s > 0, s, 1.0)[idx]
    sq = zeros.index_add(0, idx, scaled.square())
    return torch.where(n > 1, s * torch.sqrt(sq / (n - 1).clamp(min=1)), 0.0)


# --------------------------------------------------------------------------- DAPO
def overlong_penalty(lengths: Tensor, max_len: int, cache_len: int, factor: float = 1.0) -> Tensor:
    """DAPO's soft overlong punishment (SPEC 9), to add to the reward. lengths (B,) -> (B,) fp32.

    With L_exp = max_len - cache_len: 0 if |y| <= L_exp; (L_exp - |y|) / cache_len * factor if
    L_exp < |y| <= max_len; -factor beyond."""
    if not isinstance(lengths, Tensor) or lengths.dim() != 1:
        got = tuple(lengths.shape) if isinstance(lengths, Tensor) else type(lengths).__name__
        raise ValueError(f"lengths must be a tensor of shape (B,), got {got}")
    if not isinstance(max_len, numbers.Integral) or not isinstance(cache_len, numbers.Integral):
        raise ValueError(f"max_len={max_len!r} and cache_len={cache_len!r} must be ints")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len={cache_len} must lie in (0, max_len={max_len}]")
    expected_len = max_len - cache_len
    y = lengths.double()
    ramp = (expected_len - y) / cache_len * factor
    out = torch.where(y <= expected_len, 0.0, torch.where(y <= max_len, ramp, -float(factor)))
    return out.float()


def dynamic_sampling_filter(rewards: Tensor, group_size: int) -> Tensor:
    """Indices (K,) int64 of the groups whose rewards are not all equal (SPEC 9). rewards (B,)."""
    check_float("rewards", rewards, "shape (B,)")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    _check_finite("rewards", rewards)
    _group_index(rewards, group_size, None)  # validates group_size
    r = rewards.view(-1, group_size)
    return torch.nonzero((r != r[:, :1]).any(1)).flatten()


__all__ = ["dynamic_sampling_filter", "gae", "group_advantages", "overlong_penalty", "whiten"]
