"""Generalized advantage estimation (SPEC 7): verl's masked GAE, vectorised.

CUDA tensors (or FASTRL_BACKEND=triton) use the Triton reverse scan of `fastrl.kernels.gae`; CPU
tensors use a blocked closed-form scan in float64 (no per-step Python loop, no host sync on the
tensors' values), chunks of rows on single-threaded workers (`fastrl.chunked.run_chunks`).
Equals `fastrl.reference.gae` up to floating-point rounding.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._inputs import check_bool, check_float, check_mask, check_number
from .advantages import WHITEN_EPS, _check_finite
from .advantages import whiten as _whiten  # `gae` has an argument named `whiten`
from .chunked import run_chunks
from .ops import backend_for


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
    The scan, δ included, runs in float64 and L is chosen so that c^-L <= 1e4 (cancellation
    error ~1e-12 of the block's |δ|). Chunks keep the temporaries small and run on single-
    threaded workers (the CPU's threads; any order, bitwise the same result); the whitening
    statistics are collected per chunk in float64 (count, mean and Σ (A - mean)² over the
    compact rows, merged in chunk order with Chan's formula). Uncounted tokens go to a shadow
    copy that is never read, so a NaN there reaches neither A nor the whitening. No host sync.
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
    slots = torch.arange(W, device=dev)
    stats: list = [None] * -(-B // rows_per_chunk)  # per chunk: (count, mean, M2) of its A

    def chunk(s: int, e: int, _work) -> None:
        n = e - s
        mc = mask[s:e] if mask.dtype == torch.bool else mask[s:e] != 0  # (n, T)
        # 1. compact each row's counted tokens to the front of its row of W entries
        idx = torch.nn.functional.pad(mc[:, :-1], (1, 0)).cumsum(1)  # (n, T) #counted before t
        idx += (torch.arange(n, device=dev) * W)[:, None]
        dst = idx.add(~mc, alpha=n * W).view(-1)  # uncounted tokens go to a shadow copy
        # in float64, δ too: γ rounded to fp32 in an fp32 δ = (r - V) + γ V' is a relative 1e-8 of
        # every V', the same sign at each step, summed over the horizon 1 / (1 - γλ) (0.09 at
        # γ = 0.9999, V ~ 1e3, where the fp32 loop's own rounding is 3e-3)
        delta = torch.empty(2 * n * W, dtype=torch.float64, device=dev)
        v_compact = torch.empty(2 * n * W, dtype=torch.float64, device=dev)
        delta[: n * W].zero_()
        v_compact[: n * W].zero_()
        r, v = rewards[s:e].float(), values[s:e].float()
        delta.scatter_(0, dst, (r.double() - v.double()).reshape(-1))
        v_compact.scatter_(0, dst, v.double().reshape(-1))
        delta = delta[: n * W].view(n, W)
        delta[:, :-1].add_(v_compact[: n * W].view(n, W)[:, 1:], alpha=gamma)  # δ_j (n, W)
        if c < 0.2:
            adv = delta.clone()
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
            # of row b is counted token j). M2 is summed from centred values: no Σa² - n·mean²
            # cancellation at large offsets.
            per_row = mc.sum(1, dtype=torch.float64)  # (n,)
            n_c = per_row.sum()
            mean_c = adv.sum() / n_c.clamp(min=1)  # the compact rows are 0 past their tokens
            centred = torch.where(slots < per_row[:, None], adv.view(n, W) - mean_c, 0.0)
            stats[s // rows_per_chunk] = (
                n_c,
                mean_c,
                torch.dot(centred.view(-1), centred.view(-1)),
            )

    # whole chunks on single-threaded workers (chunked.run_chunks: no intra-op barrier per op);
    # each row's result does not depend on the thread or on the other rows of its chunk
    run_chunks(B, rows_per_chunk, dev, chunk)
    if whiten:  # the chunks' statistics merged in chunk order (Chan et al.): thread-independent
        count = torch.zeros((), dtype=torch.float64, device=dev)
        mean = torch.zeros((), dtype=torch.float64, device=dev)
        m2 = torch.zeros((), dtype=torch.float64, device=dev)
        for n_c, mean_c, m2_c in stats:
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
    + V_t there). `check=True` raises on NaN or ±inf rewards / values at counted tokens (a device
    sync on CUDA): an infinite one makes every earlier advantage infinite and any whitening NaN;
    with `check=False` the CPU's blocked scan also gives NaN (inf - inf) at the later tokens of
    its row, where the Triton scan and SPEC 7's loop give their finite values. Advantages and
    returns are constants to the losses that use them: the inputs are detached (no gradient
    flows)."""
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
    whiten, check = check_bool("whiten", whiten), check_bool("check", check)
    mask = check_mask("mask", mask, rewards.shape, rewards.device, as_float=False)
    gamma, lam = (
        check_number(name, val, "a float in [0, 1]", lambda v: 0 <= v <= 1)
        for name, val in (("gamma", gamma), ("lam", lam))
    )  # Python floats, numpy's scalars included
    if check:
        counted = mask if mask.dtype == torch.bool else mask != 0
        _check_finite("rewards", rewards, counted, inf=False)
        _check_finite("values", values, counted, inf=False)
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
