"""Masked GAE (SPEC 7) as a chunked reverse scan: one program per sequence, no loop over steps.

verl's masked recurrence, scanning t = T-1 .. 0 from next_v = last = 0 (c = γλ):
    next_v_out = (1 - m_t)·next_v + m_t·V_t                              (an affine map of next_v)
    last_out   = (m_t·c + 1 - m_t)·last + m_t·(r_t + γ·next_v - V_t)     (an affine map of last)
    A_t = last_out
Each step is an affine map x -> a·x + b, and the composition of maps is associative, so a block
of BLOCK_T steps is scanned with `tl.associative_scan` (reverse) and the block's result is carried
into the previous block. The next_v used at step t is the one produced by steps t+1 .. T-1: it is
the reverse scan of the maps of step t+1 (loaded one element to the right) applied to the carry.
A step with m_t = 0 is the identity map whatever r_t and V_t hold (the m·x terms are formed with
tl.where, so a NaN / inf reward or value at a masked token never reaches the result).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .launch import EXACT_PRODUCTS, LaunchConfig, Ptr, config, next_power_of_2


@triton.jit
def _affine_combine(a_later, b_later, a_earlier, b_earlier):
    """Compose two affine maps: apply the later-step map first, then the earlier-step one."""
    return a_earlier * a_later, a_earlier * b_later + b_earlier


@triton.jit
def _gae_fwd_kernel(
    rewards_ptr,  # (B, T) any float
    values_ptr,  # (B, T) any float
    mask_ptr,  # (B, T) fp32
    adv_ptr,  # (B, T) fp32 out: unwhitened advantages
    T,
    stride_rb,
    stride_rt,
    stride_vb,
    stride_vt,
    stride_mb,
    stride_mt,
    stride_ab,
    stride_at,
    gamma,
    lam,
    BLOCK_T: tl.constexpr,
):
    # one program per sequence (grid (B,)): blocks of BLOCK_T steps from the last to the first,
    # each a reverse associative scan of the affine maps above, carrying (next_v, last) in.
    row = tl.program_id(0).to(tl.int64)
    r_row = rewards_ptr + row * stride_rb
    v_row = values_ptr + row * stride_vb
    m_row = mask_ptr + row * stride_mb
    a_row = adv_ptr + row * stride_ab
    c = gamma * lam
    next_v = tl.zeros((), dtype=tl.float32)  # value carried in from the later blocks
    last = tl.zeros((), dtype=tl.float32)  # advantage carried in from the later blocks
    num_blocks = tl.cdiv(T, BLOCK_T)
    for i in range(0, num_blocks):
        start = (num_blocks - 1 - i) * BLOCK_T
        offs = start + tl.arange(0, BLOCK_T)  # (BLOCK_T,)
        inside = offs < T
        r = tl.load(r_row + offs * stride_rt, mask=inside, other=0.0).to(tl.float32)
        v = tl.load(v_row + offs * stride_vt, mask=inside, other=0.0).to(tl.float32)
        m = tl.load(m_row + offs * stride_mt, mask=inside, other=0.0).to(tl.float32)
        # the next_v maps of steps t+1 (shifted by one; identity past this block or past T)
        nxt = offs + 1
        shifted_in = (nxt < T) & (nxt < start + BLOCK_T)
        v1 = tl.load(v_row + nxt * stride_vt, mask=shifted_in, other=0.0).to(tl.float32)
        m1 = tl.load(m_row + nxt * stride_mt, mask=shifted_in, other=0.0).to(tl.float32)
        # (tl.where, not m·x: a NaN / inf at a token with m = 0 must not reach the result)
        b_nv = tl.where(m1 != 0, m1 * v1, 0.0)
        a_nv, b_nv = tl.associative_scan((1.0 - m1, b_nv), 0, _affine_combine, reverse=True)
        next_v_t = a_nv * next_v + b_nv  # (BLOCK_T,) next_v seen by step t
        # the last maps of steps t
        a_l = m * c + 1.0 - m
        b_l = tl.where(m != 0, m * (r + gamma * next_v_t - v), 0.0)
        a_l, b_l = tl.associative_scan((a_l, b_l), 0, _affine_combine, reverse=True)
        adv = a_l * last + b_l  # (BLOCK_T,)
        tl.store(a_row + offs * stride_at, adv, mask=inside)
        # carries into the previous block: the state after this block's first step
        first = offs == start
        m0 = tl.sum(tl.where(first, m, 0.0))
        v0 = tl.sum(tl.where(first, v, 0.0))
        nv0 = tl.sum(tl.where(first, next_v_t, 0.0))
        next_v = tl.where(m0 != 0, m0 * v0, 0.0) + (1.0 - m0) * nv0
        last = tl.sum(tl.where(first, adv, 0.0))


@functools.lru_cache(maxsize=64)
def gae_scan_configs(
    B: int,
    T: int,
    dtype: torch.dtype = torch.float32,
    block_t: int | None = None,
    *,
    values_dtype: torch.dtype | None = None,
) -> tuple[LaunchConfig, ...]:
    """The launch of `gae_scan` on B sequences of T steps, rewards of `dtype` and values of
    `values_dtype` (default: `dtype`); `block_t` as in gae_scan. Example arguments: every
    (B, T) tensor contiguous."""
    block = block_t or min(1024, max(16, next_power_of_2(T)))
    ptrs = {
        "rewards_ptr": Ptr(dtype), "values_ptr": Ptr(values_dtype or dtype),
        "mask_ptr": Ptr(torch.float32), "adv_ptr": Ptr(torch.float32),
    }  # fmt: skip
    strides = {f"stride_{t}{d}": T if d == "b" else 1 for t in "rvma" for d in "bt"}
    args = {**ptrs, "T": T, **strides, "gamma": 1.0, "lam": 1.0}
    return (config(_gae_fwd_kernel, (B,), 4, args, BLOCK_T=block, options=EXACT_PRODUCTS),)


def gae_scan(
    rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float,
    lam: float,
    block_t: int | None = None,
) -> torch.Tensor:
    """Unwhitened masked GAE advantages. rewards, values (B, T) any float; mask (B, T) fp32.

    Returns fp32 (B, T). One program per row; BLOCK_T steps per scan (`block_t`, a power of two,
    overrides the default min(1024, next_power_of_2(T)))."""
    B, T = rewards.shape
    mask = mask.float()
    adv = torch.empty(B, T, dtype=torch.float32, device=rewards.device)
    if B == 0 or T == 0:
        return adv
    (cfg,) = gae_scan_configs(B, T, rewards.dtype, block_t, values_dtype=values.dtype)
    cfg(
        rewards, values, mask, adv, T,
        rewards.stride(0), rewards.stride(1),
        values.stride(0), values.stride(1),
        mask.stride(0), mask.stride(1),
        adv.stride(0), adv.stride(1),
        float(gamma), float(lam),
    )  # fmt: skip
    return adv
