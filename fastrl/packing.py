"""Packed (padding-free) batches: S sequences laid end to end as N flat rows, with `cu_seqlens`.

A packed batch is what flash-attn's varlen kernels, TRL's padding-free mode and verl's
remove-padding path hand a loss: logits (N, V) or hidden (N, H), tokens and every per-token
tensor (N,), and `cu_seqlens` (S + 1,) int, the boundaries of the sequences:

    sequence i = rows cu_seqlens[i] : cu_seqlens[i + 1],   cu_seqlens[0] = 0, cu_seqlens[S] = N.

The (N, V) work (log-probs, entropy, the logits gradient) never depends on the layout: each row is
independent, so the fused ops run on the N rows as they are. Only the O(N) per-token math has
sequence-level quantities (seq-mean-* aggregations, GSPO's sequence ratio, sequence IS weights,
the sequence count), and it runs on a padded (S, T_max) copy of the per-token tensors, through
the same code as a padded batch (`fastrl.terms`), so packed and padded agree by construction:
`Packing.pad` scatters (N,) -> (S, T_max) (zeros, mask 0, where a sequence is shorter) and
`Packing.unpad` gathers back; both are differentiable and O(N) in time and memory.

T_max (`max_seqlen`, the longest sequence) sizes the padded copy: pass it (as flash-attn's
varlen API takes it) to avoid reading `cu_seqlens`; otherwise it is read from `cu_seqlens`, a host
sync when `cu_seqlens` lives on an accelerator.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import _is_int


@dataclass
class Packing:
    """S sequences packed into N rows (see the module docstring)."""

    cu_seqlens: Tensor  # (S + 1,) int64 on the rows' device: the boundaries of the sequences
    max_seqlen: int  # T_max, the longest sequence (the padded width)
    seq_ids: Tensor  # (N,) int64: the sequence of each row
    index: Tensor  # (N,) int64: each row's position in the flattened (S, T_max) padded layout

    @property
    def num_seqs(self) -> int:
        return self.cu_seqlens.shape[0] - 1

    def pad(self, t: Tensor, fill: float = 0.0) -> Tensor:
        """(N,) or (1, N) per-row values -> (S, T_max), `fill` where a sequence has no row."""
        S, T = self.num_seqs, self.max_seqlen
        flat = t.reshape(-1)
        out = flat.new_full((S * T,), fill)
        return out.index_put((self.index,), flat).view(S, T)

    def unpad(self, t: Tensor) -> Tensor:
        """(S, T_max) -> (1, N), the rows in packed order."""
        return t.reshape(-1).index_select(0, self.index).view(1, -1)

    def per_row(self, per_seq: Tensor) -> Tensor:
        """(S,) one value per sequence -> (N,), repeated over each sequence's rows."""
        return per_seq.index_select(0, self.seq_ids)

    def padded_inputs(self, x):
        """PolicyInputs of packed rows (every per-token tensor (1, N)) as the padded batch
        (S, T_max) of the same sequences, mask 0 on the padding (no logits, no tokens)."""
        pad = lambda t: None if t is None else self.pad(t)  # noqa: E731
        return dataclasses.replace(
            x, logits=None, tokens=None, advantages=pad(x.advantages), old_logp=pad(x.old_logp),
            ref_logp=pad(x.ref_logp), rollout_logp=pad(x.rollout_logp), mask=pad(x.mask),
            flat=False, packing=None, temperature_rows=None,
        )  # fmt: skip


def check_cu_seqlens_form(cu_seqlens) -> None:
    """`cu_seqlens` must be an int32 / int64 tensor of shape (S + 1,), S >= 1 (its values:
    `check_cu_seqlens`)."""
    if (
        not isinstance(cu_seqlens, Tensor)
        or cu_seqlens.dim() != 1
        or cu_seqlens.shape[0] < 2
        or cu_seqlens.dtype not in (torch.int32, torch.int64)
    ):
        got = (
            f"shape {tuple(cu_seqlens.shape)}, dtype {cu_seqlens.dtype}"
            if isinstance(cu_seqlens, Tensor)
            else type(cu_seqlens).__name__
        )
        raise ValueError(
            f"cu_seqlens must be an int32 / int64 tensor of shape (S + 1,) with S >= 1 (the "
            f"boundaries of S packed sequences), got {got}"
        )


def check_cu_seqlens(cu_seqlens, N: int, max_seqlen: int | None = None) -> None:
    """`cu_seqlens` must be an int tensor (S + 1,), S >= 1. Its values (0 first, N last, never
    decreasing) and `max_seqlen` (None, or an int >= the longest sequence) are checked when it is
    a CPU tensor and outside torch.compile (elsewhere that would be a host sync / graph break)."""
    check_cu_seqlens_form(cu_seqlens)
    if max_seqlen is not None and (not _is_int(max_seqlen) or max_seqlen < 0):
        raise ValueError(f"max_seqlen must be None or an int >= 0, got {max_seqlen!r}")
    if cu_seqlens.device.type != "cpu" or torch.compiler.is_compiling():
        return
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    first, last = int(cu_seqlens[0]), int(cu_seqlens[-1])
    if first != 0 or last != N or bool((lengths < 0).any()):
        shown = cu_seqlens.tolist() if cu_seqlens.numel() <= 16 else "(values elided)"
        raise ValueError(
            f"cu_seqlens must start at 0, end at N = {N} (the number of rows) and never "
            f"decrease, got {shown} (first {first}, last {last})"
        )
    longest = int(lengths.max())
    if max_seqlen is not None and max_seqlen < longest:
        raise ValueError(
            f"max_seqlen={max_seqlen} is shorter than the longest sequence in cu_seqlens "
            f"({longest})"
        )


def make_packing(
    cu_seqlens, N: int, device, max_seqlen: int | None = None, check: bool = True
) -> Packing:
    """Check `cu_seqlens` (S + 1,) against N rows (`check_cu_seqlens`; `check=False`: already
    checked at the public entry, as inside the custom ops) and build the Packing. Without
    `max_seqlen` it is read from cu_seqlens (a host sync on an accelerator)."""
    if check:
        check_cu_seqlens(cu_seqlens, N, max_seqlen)
        if cu_seqlens.device.type not in ("cpu", torch.device(device).type):
            raise ValueError(
                f"cu_seqlens is on {cu_seqlens.device}: expected the CPU or the rows' device "
                f"({device})"
            )
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    if max_seqlen is None:
        max_seqlen = int(lengths.max())
    elif not isinstance(max_seqlen, int):  # numpy's integers (a SymInt stays symbolic)
        max_seqlen = int(max_seqlen)
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lengths = lengths.to(device=device, dtype=torch.int64)
    S = lengths.shape[0]
    seq_ids = torch.repeat_interleave(torch.arange(S, device=device), lengths, output_size=N)
    pos = torch.arange(N, device=device) - cu[:-1].index_select(0, seq_ids)
    return Packing(cu, max_seqlen, seq_ids, seq_ids * max_seqlen + pos)


def packing_for_rows(cu_seqlens, N: int, device) -> Packing:
    """`make_packing` where only `per_row` is needed, with no host read of an accelerator's
    cu_seqlens: its max_seqlen is exact when cu_seqlens is on the CPU (outside torch.compile),
    else the bound N (then `_inputs.packed_per_sequence` refuses an (N,) = (S,) tensor rather
    than guess which it is)."""
    exact = cu_seqlens.device.type == "cpu" and not torch.compiler.is_compiling()
    return make_packing(cu_seqlens, N, device, max_seqlen=None if exact else N)
