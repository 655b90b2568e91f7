"""Triton kernel of the upstream-gradient scale: grad *= dL_total / dloss, in place.

The fused losses compute their gradient in the forward; the backward only multiplies it by the
upstream gradient. `_scale_grad_kernel` reads that one-element scale on the device and returns
at once when it is exactly 1 (the usual `loss.backward()`): no host sync, no pass over the rows.
`scale_` (the launcher) is part of the Triton backend's interface (kernels/policy_loss.py
re-exports it beside row_stats and row_grad_).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import EXACT_PRODUCTS, LaunchConfig, Ptr, cdiv, config

_F32 = torch.float32
_SCALE_BLOCK = 4096  # elements of a gradient row per _scale_grad_kernel program


@triton.jit
def _scale_grad_kernel(
    grad_ptr,  # (R, C) rows of a gradient, any dtype, stride over C is 1; scaled in place
    scale_ptr,  # (1,) the upstream gradient dL_total / dloss (any float dtype)
    R,
    C,
    stride_grad_r,
    BLOCK: tl.constexpr,
):
    # grid (G_r, G_c), at most _SCALE_PROGRAMS programs in all: grad *= scale, program (i, j)
    # taking rows i, i + G_r, ... and their column blocks j, j + G_c, .... A scale of exactly 1
    # (loss.backward()) returns before touching a row: the cost is the launch of a small grid
    # (one program per BLOCK elements, 622k of them at N = 16384, V = 151936, took 0.38 ms on
    # an H200 only to read the scale and return), and the host never reads the scale.
    scale = tl.load(scale_ptr).to(tl.float32)
    if scale != 1.0:
        n_blocks = tl.cdiv(C, BLOCK)
        for row in range(tl.program_id(0).to(tl.int64), R, tl.num_programs(0)):
            for blk in range(tl.program_id(1).to(tl.int64), n_blocks, tl.num_programs(1)):
                offs = blk * BLOCK + tl.arange(0, BLOCK)
                ptrs = grad_ptr + row * stride_grad_r + offs
                x = tl.load(ptrs, mask=offs < C, other=0.0).to(tl.float32)
                tl.store(ptrs, (x * scale).to(grad_ptr.dtype.element_ty), mask=offs < C)


# --------------------------------------------------------------------------- launch
_SCALE_PROGRAMS = 1024  # programs of a _scale_grad_kernel launch at most (8 a multiprocessor)


@functools.lru_cache(maxsize=64)
def scale_configs(
    R: int, C: int, dtype: torch.dtype, scale_dtype: torch.dtype = _F32
) -> tuple[LaunchConfig, ...]:
    """The launch of `scale_` on R rows of C elements of `dtype` (a contiguous (R, C) example)
    scaled by a one-element `scale_dtype` tensor: a grid of at most _SCALE_PROGRAMS programs,
    rows first, column blocks where there are fewer rows."""
    args = {
        "grad_ptr": Ptr(dtype), "scale_ptr": Ptr(scale_dtype), "R": R, "C": C, "stride_grad_r": C,
    }  # fmt: skip
    rows = min(R, _SCALE_PROGRAMS)
    grid = (rows, min(cdiv(C, _SCALE_BLOCK), max(1, _SCALE_PROGRAMS // rows)))
    return (config(_scale_grad_kernel, grid, 4, args, BLOCK=_SCALE_BLOCK, options=EXACT_PRODUCTS),)


def scale_(grad: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """grad *= scale in place, without a host sync and without a pass when scale == 1.

    grad: any shape whose last dim has stride 1 and whose leading dims flatten to rows of equal
    stride (a contiguous tensor, or (B, T, V) logits views with (B, T) flattening), else it is
    processed per leading index. scale: a one-element tensor on grad's device."""
    if grad.numel() == 0:
        return grad
    g = grad if grad.dim() >= 2 else grad.view(1, -1)
    if g.dim() > 2:
        try:
            g = g.view(-1, g.shape[-1])
        except RuntimeError:  # (B, T) do not flatten (a sliced view): one launch per b
            for sub in g.unbind(0):
                scale_(sub, scale)
            return grad
    R, C = g.shape
    assert C == 1 or g.stride(1) == 1
    (cfg,) = scale_configs(R, C, g.dtype, scale.dtype)
    cfg(g, scale.reshape(1), R, C, g.stride(0))
    return grad
