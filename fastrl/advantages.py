"""Advantage estimators and DAPO reward helpers (SPEC 7 and 9), vectorised.

- `gae`: verl's masked GAE (in `fastrl.gae`, re-exported here).
- `group_advantages`: GRPO / RLOO / REINFORCE++-baseline with contiguous groups or arbitrary
  group ids, via scatter-adds (no Python loop over groups).
- `whiten`, `overlong_penalty`, `dynamic_sampling_filter`.

Everything equals `fastrl.reference` up to floating-point rounding. The NaN / inf checks on
rewards and values read the data: on CUDA tensors that is a device sync (these are host-level
helpers run once per batch); pass `check=False` to skip them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._inputs import check_bool, check_float, check_mask, check_number, describe
from .config import _is_int

WHITEN_EPS = 1e-8  # SPEC 7
_SCALES = ("group", "batch", "none")
_ESTIMATORS = ("grpo", "rloo", "reinforce++")


# --------------------------------------------------------------------------- validation
def _check_finite(name: str, x: Tensor, counted: Tensor | None = None, inf: bool = True) -> None:
    """Raise if x has a NaN, or with `inf=False` a NaN or an infinity (at an entry where
    `counted` is True, when given)."""
    if x.device.type == "meta":
        return
    bad = torch.isnan(x) if inf else ~torch.isfinite(x)
    if counted is not None:
        bad = bad & counted
    if bad.any():
        where = " at a counted token" if counted is not None else ""
        what = "NaN" if inf else "NaN or inf"
        raise ValueError(f"{name} (shape {tuple(x.shape)}) contains {what}{where}")


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
    shift_mean = check_bool("shift_mean", shift_mean)
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
    if not _is_int(group_size) or group_size < 1 or B % group_size:
        raise ValueError(
            f"group_size={group_size!r} must be an int >= 1 that divides the batch size {B} "
            "(or pass group_ids)"
        )
    group_size = int(group_size)
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
    cu_seqlens: Tensor | None = None,
) -> Tensor:
    """Outcome advantages from per-response rewards (B,) grouped by prompt (SPEC 7).

    Groups: contiguous blocks of `group_size`, or equal values of `group_ids` (B,) in any order.
    grpo: (R - μ_g) / (σ_g + eps) (`scale="group"`, σ unbiased), / (σ_batch + eps) (`"batch"`),
    or R - μ_g (`"none"`, Dr.GRPO); `scale=None` means `"group"` for grpo. rloo: n/(n-1)·(R - μ_g),
    SPEC's leave-one-out baseline (`scale=None` means `"none"`; `"group"` / `"batch"` divide as
    for grpo). reinforce++: R - μ_g, whitened over the batch's tokens of `mask` (B, T) when given
    -> (B, T), else over the B responses -> (B,); `scale` must be None (an all-zero `mask` gives
    zeros, see `whiten`). `mask` is read only by reinforce++ (a ValueError for grpo / rloo, which
    would ignore it); `eps` >= 0. Groups of one and groups whose rewards are all equal give
    exactly 0. Computed in float64, scale-safe (σ from values divided by their group's max
    |R - μ_g| before squaring: ±1e200 in fp64 works). Returns fp32. A NaN or ±inf reward is
    a ValueError (it would make its group's mean and σ NaN); `check=False` skips that check (a
    host read on an accelerator) and such a group's advantages are then NaN (every advantage,
    with scale="batch" or reinforce++, whose statistics span the batch).

    Packed sequences: with `cu_seqlens` (B + 1,) (the B responses laid end to end as N rows, see
    fastrl.packing) the result is per row, (N,): each response's advantage repeated over its
    rows. A `mask` (N,) is then accepted by every estimator: it gives N (else read from
    cu_seqlens[-1], a host sync on an accelerator), and reinforce++ whitens over its rows (the
    same numbers as the padded (B, T) call with that mask; pass all ones for SPEC 7's
    whitening over every row). grpo / rloo values do not depend on it, and reinforce++
    without it whitens over the B responses, as the unpacked call without a mask, each value
    then repeated over its response's rows."""
    check = check_bool("check", check)
    if cu_seqlens is not None:
        return _packed_group_advantages(
            rewards, cu_seqlens, mask, group_size=group_size, group_ids=group_ids, scale=scale,
            estimator=estimator, eps=eps, check=check,
        )  # fmt: skip
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
    eps = check_number("eps", eps, "a number >= 0 (added to σ)", lambda e: e >= 0)
    if mask is not None and estimator != "reinforce++":
        raise ValueError(
            f"mask is read only by estimator='reinforce++' (its token whitening); "
            f"estimator={estimator!r} gives one advantage per response (B,) from the rewards "
            "alone: leave mask=None"
        )
    if check:  # an inf reward makes its group's mean and σ NaN: refused as a NaN is
        _check_finite("rewards", rewards, inf=False)
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
        den = std + eps
    else:
        batch = torch.zeros_like(idx)
        den = _unbiased_std(r - r.mean(), batch, r.new_full((1,), B))[0] + eps  # σ = 0 if B = 1
    # σ + eps = 0 only with eps = 0 in an all-equal group (or batch), whose A is 0 (not 0 / 0);
    # a NaN σ (a NaN / inf reward with check=False) stays NaN
    return torch.where(den == 0, 0.0, centered / den).float()


def _packed_group_advantages(rewards, cu_seqlens, mask, **kw) -> Tensor:
    """group_advantages of B packed responses, per row (N,) (see there)."""
    from .packing import check_cu_seqlens_form, make_packing

    check_cu_seqlens_form(cu_seqlens)  # (before reading its last entry)
    if mask is not None and (not isinstance(mask, Tensor) or mask.dim() != 1):
        raise ValueError(
            f"mask must be a row mask of shape (N,) with cu_seqlens, got {describe(mask)}"
        )
    N = mask.shape[0] if mask is not None else int(cu_seqlens[-1])
    try:
        pack = make_packing(cu_seqlens, N, rewards.device, max_seqlen=None)
    except ValueError as e:
        if mask is None:
            raise
        raise ValueError(
            f"{e}; here N is the length of mask {describe(mask)}: mask and cu_seqlens must cover "
            "the same rows"
        ) from None
    if rewards.dim() != 1 or rewards.shape[0] != pack.num_seqs:
        raise ValueError(
            f"rewards must have shape ({pack.num_seqs},) (one per packed sequence of "
            f"cu_seqlens {tuple(cu_seqlens.shape)}: S + 1 boundaries), got {describe(rewards)}"
        )
    if kw["estimator"] != "reinforce++" or mask is None:  # (mask gave N only)
        return pack.per_row(group_advantages(rewards, **kw))
    m = check_mask("mask", mask, (N,), rewards.device)
    padded = group_advantages(rewards, mask=pack.pad(m), **kw)  # (B, T_max)
    return pack.unpad(padded)[0]


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
    L_exp < |y| <= max_len; -factor beyond. factor: a float >= 0. lengths: an integer or float
    tensor (not bool, not complex); a negative one is a ValueError (checked on CPU tensors); a
    non-finite length (a float tensor's NaN or inf) gives NaN, never a finite penalty."""
    ok = isinstance(lengths, Tensor) and lengths.dim() == 1
    if not ok or lengths.dtype == torch.bool or lengths.is_complex():
        raise ValueError(
            f"lengths must be an integer or float tensor of shape (B,), got {describe(lengths)}"
        )
    if lengths.device.type == "cpu" and not torch.compiler.is_compiling():
        if bool((lengths < 0).any()):
            raise ValueError(
                f"lengths must be >= 0 (response lengths), got a minimum of {lengths.min().item()}"
            )
    if not _is_int(max_len) or not _is_int(cache_len):
        raise ValueError(f"max_len={max_len!r} and cache_len={cache_len!r} must be ints")
    if not 0 < cache_len <= max_len:
        raise ValueError(f"cache_len={cache_len} must lie in (0, max_len={max_len}]")
    factor = check_number("factor", factor, "a float >= 0", lambda f: f >= 0)
    expected_len = max_len - cache_len
    y = lengths.double()
    ramp = (expected_len - y) / cache_len * factor
    out = torch.where(y <= expected_len, 0.0, torch.where(y <= max_len, ramp, -factor))
    return torch.where(torch.isfinite(y), out, float("nan")).float()


def dynamic_sampling_filter(rewards: Tensor, group_size: int) -> Tensor:
    """Indices (K,) int64 of the groups whose rewards are not all equal (SPEC 9). rewards (B,),
    B a multiple of `group_size`; a NaN or ±inf reward is a ValueError (no group can be told
    equal or not then)."""
    check_float("rewards", rewards, "shape (B,)")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must have shape (B,), got {tuple(rewards.shape)}")
    _check_finite("rewards", rewards, inf=False)
    _group_index(rewards, group_size, None)  # validates group_size
    r = rewards.view(-1, group_size)
    return torch.nonzero((r != r[:, :1]).any(1)).flatten()


__all__ = ["dynamic_sampling_filter", "group_advantages", "overlong_penalty", "whiten"]


def __getattr__(name: str):
    if name == "gae":  # `fastrl.advantages.gae` stays importable (it lives in fastrl.gae)
        from .gae import gae

        return gae
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
