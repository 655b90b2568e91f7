"""PPO's clipped value (critic) loss, SPEC 8. Re-exported by `fastrl.losses` as `value_loss`.

    v_clip = v_old + clamp(v - v_old, -ε_v, ε_v)
    L_V = ½ · agg(max((v - G)², (v_clip - G)²)),  vf_clipfrac = share of counted tokens where
    the clipped term is the larger one.

Elementwise work on (B, T) tensors in PyTorch (there is no vocabulary dimension to fuse over);
no host sync, so it is safe inside a compiled or CUDA-graphed step.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._inputs import check_float, check_mask, describe
from .config import AGGS
from .reference import aggregate, masked_mean


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor | None = None,
    clip: float | None = 0.2,
    agg: str = "token-mean",
    max_len: int | None = None,
    num_tokens: Tensor | float | None = None,
    num_seqs: Tensor | float | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss (SPEC 8). Returns (loss, vf_clipfrac), both 0-dim fp32.

    values (B, T) or (N,), differentiable; old_values, returns like values (detached inputs);
    mask like values, bool or float (None = all count). `clip` = ε_v (None = no clipping).
    `agg` is one of the four SPEC 5 aggregations; the `seq-mean-*` ones need (B, T) inputs.
    `max_len` is the constant of seq-mean-token-sum-norm (default T); `num_tokens` / `num_seqs`
    are the global counts of data-parallel ranks and accumulation steps, as in `policy_loss`
    (default: this batch's)."""
    check_float("values", values, "shape (B, T) or (N,)")
    if values.dim() not in (1, 2):
        raise ValueError(
            f"values must be a float tensor of shape (B, T) or (N,), got {describe(values)}"
        )
    shape = tuple(values.shape)
    for name, x in (("old_values", old_values), ("returns", returns)):
        check_float(name, x, f"shape {shape} (like values)", shape, values.device)
    if mask is not None:
        check_mask("mask", mask, shape, values.device, as_float=False)
    if clip is not None and (
        isinstance(clip, bool)
        or not isinstance(clip, (int, float))
        or not clip >= 0
        or not math.isfinite(clip)
    ):
        raise ValueError(f"clip must be a finite float >= 0 or None, got {clip!r}")
    if agg not in AGGS:
        raise ValueError(f"agg={agg!r}; expected one of {AGGS}")
    if values.dim() == 1 and agg != "token-mean":
        raise ValueError(f"agg={agg!r} needs sequences: pass values of shape (B, T), not {shape}")
    if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be an int >= 1 or None, got {max_len!r}")

    v = values.float() if values.dim() == 2 else values.float().unsqueeze(0)  # (B, T)
    v_old = old_values.float().reshape(v.shape)
    ret = returns.float().reshape(v.shape)
    m = torch.ones_like(v) if mask is None else mask.reshape(v.shape).float()
    if clip is None:
        v_clip = v
    else:
        v_clip = v_old + torch.clamp(v - v_old, -clip, clip)
    loss1 = (v - ret).square()
    loss2 = (v_clip - ret).square()
    loss = 0.5 * aggregate(torch.maximum(loss1, loss2), m, agg, num_tokens, num_seqs, max_len)
    with torch.no_grad():
        vf_clipfrac = masked_mean((loss2 > loss1).float(), m)
    return loss, vf_clipfrac


__all__ = ["value_loss"]
