"""PPO's clipped value (critic) loss, SPEC 8. Re-exported by `fastrl.losses` as `value_loss`.

    v_clip = clamp(v, v_old - ε_v, v_old + ε_v)   (= v_old + clamp(v - v_old, ±ε_v), but exactly v
                                                   where it is not clipped, as verl and TRL form it)
    L_V = ½ · agg(max((v - G)², (v_clip - G)²)),  vf_clipfrac = share of counted tokens where
    the clipped term is the larger one.

Elementwise work on (B, T) tensors in PyTorch (there is no vocabulary dimension to fuse over);
no host sync, so it is safe inside a compiled or CUDA-graphed step.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._inputs import check_float, check_int, check_mask, check_number, describe
from .config import AGGS, _is_real
from .terms import _positive_count, aggregate, masked_mean


def _check_count(name: str, count, values: Tensor) -> Tensor | float | None:
    """A caller's global count (`num_tokens` / `num_seqs`). A Python number must be finite and
    > 0 (else a ValueError naming it). A one-element tensor is read without a host sync: it
    becomes a 0-dim fp32 tensor on the values' device that is NaN wherever it is not a finite
    number > 0, so a bad tensor count gives a NaN loss, never a finite wrong one."""
    if count is None:
        return None
    if isinstance(count, Tensor):
        if count.numel() != 1 or count.is_complex() or count.dtype == torch.bool:
            raise ValueError(
                f"{name} must be None, a finite number > 0 or a one-element real tensor, got "
                f"{describe(count)}"
            )
        if count.device.type == "meta" and values.device.type != "meta":
            raise ValueError(
                f"{name} is on device meta (a tensor without data); expected it on the values' "
                f"device {values.device} or the CPU"
            )
        return _positive_count(count.detach(), values.device)
    if not _is_real(count):
        raise ValueError(
            f"{name} must be None, a finite number > 0 or a one-element real tensor, got "
            f"{type(count).__name__}"
        )
    return check_number(name, count, "a number > 0 (a token / sequence count)", lambda c: c > 0)


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
    `agg` is one of the SPEC 5 aggregations (AGGS); the `seq-mean-*` ones need (B, T) inputs.
    `max_len` is the constant of seq-mean-token-sum-norm (default T); `num_tokens` / `num_seqs`
    are the global counts of data-parallel ranks and accumulation steps, as in `policy_loss`
    (default: this batch's): a Python number must be finite and > 0 (ValueError otherwise); a
    tensor count that is not gives a NaN loss (no host sync).

    What the mask excludes never reaches the loss, the clip fraction or the gradient: values,
    old_values and returns at tokens with m = 0 are replaced by 0 (torch.where), so a NaN / inf
    there changes nothing and the gradient there is exactly 0. A float mask must hold values
    >= 0 (no NaN): checked, with a ValueError naming `mask`, on CPU tensors. The mask is a
    constant: no gradient reaches it, even where it requires one."""
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
    if clip is not None:
        check_number("clip", clip, "None or a float >= 0", lambda c: c >= 0)
    if agg not in AGGS:
        raise ValueError(f"agg={agg!r}; expected one of {AGGS}")
    if values.dim() == 1 and agg.startswith("seq-mean"):
        raise ValueError(f"agg={agg!r} needs sequences: pass values of shape (B, T), not {shape}")
    max_len = check_int("max_len", max_len, optional=True)
    num_tokens = _check_count("num_tokens", num_tokens, values)
    num_seqs = _check_count("num_seqs", num_seqs, values)

    v = values.float() if values.dim() == 2 else values.float().unsqueeze(0)  # (B, T)
    v_old = old_values.detach().float().reshape(v.shape)
    ret = returns.detach().float().reshape(v.shape)
    if mask is None:
        m = torch.ones_like(v)
    else:
        m = mask.detach().reshape(v.shape).float()  # a constant, as in every policy loss
        counted = m > 0  # entries with m = 0 never reach the result (not even a NaN there)
        v = torch.where(counted, v, 0.0)
        v_old = torch.where(counted, v_old, 0.0)
        ret = torch.where(counted, ret, 0.0)
    if clip is None:
        v_clip = v
    else:
        v_clip = torch.clamp(v, v_old - clip, v_old + clip)  # exactly v where not clipped
    loss1 = (v - ret).square()
    loss2 = (v_clip - ret).square()
    loss = 0.5 * aggregate(torch.maximum(loss1, loss2), m, agg, num_tokens, num_seqs, max_len)
    with torch.no_grad():
        vf_clipfrac = masked_mean((loss2 > loss1).float(), m)
    return loss, vf_clipfrac


__all__ = ["value_loss"]
