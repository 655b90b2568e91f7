"""Small pieces every stage of the trainer uses: ranks, collectives, the update batch, the error
that stops training."""

from __future__ import annotations

import os
import shlex
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from .checkpoint import latest_checkpoint
from .rollout import Rollout


def resume_command(out: str, world: int) -> str:
    """The command line that continues the run in `out`, saved by `world` processes."""
    launcher = (
        f"torchrun --standalone --nproc_per_node {world} -m fastrl.cli" if world > 1 else "fastrl"
    )
    return f"{launcher} train --resume {shlex.quote(out)}"


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints", "curves.png", "tensorboard")
"""What a run writes under --out (a directory holding any of them holds a run)."""


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, gradient norm or weights); the message names
    the step and the last good checkpoint."""


def last_good(out: str) -> str:
    """The end of a TrainingError's message: the newest checkpoint of the run in `out`."""
    ckpt = latest_checkpoint(os.path.join(out, "checkpoints"))
    if ckpt is None:
        return "no checkpoint had been saved yet"
    return f"the last good checkpoint is {ckpt} (continue with --resume {out})"


@dataclass
class Batch:
    """Everything the update needs, per sequence (N,) or per completion token (N, T)."""

    rollout: Rollout
    advantages: Tensor  # (N,) grpo / dapo, (N, T) ppo
    old_logp: Tensor  # (N, T)
    ref_logp: Tensor | None = None  # (N, T)
    returns: Tensor | None = None  # (N, T) ppo
    old_values: Tensor | None = None  # (N, T) ppo
    trained: Tensor | None = None  # (N,) bool on the host: the rows the update forwards (None: all)


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_reduce(x: Tensor, op=None) -> Tensor:
    """In-place all-reduce (SUM unless `op`) across ranks; a no-op in one process."""
    if rank_world()[1] > 1:
        dist.all_reduce(x, op=op or dist.ReduceOp.SUM)
    return x


def all_ranks(value, op, device, dtype=torch.float64):
    """`value` reduced with `op` (a `dist.ReduceOp`) over the ranks, as a Python number that
    every rank gets alike; `value` itself in one process."""
    if rank_world()[1] == 1:
        return value
    t = torch.tensor([value], dtype=dtype, device=device)
    dist.all_reduce(t, op=op)
    return t.item()


def gather_rows(x: Tensor, fill: float = 0.0) -> tuple[Tensor, slice]:
    """Every rank's `x` (n, T_r) stacked in rank order (T padded right with `fill`), and the
    rows of this rank in it. One process: (x, all rows)."""
    rank, world = rank_world()
    if world == 1:
        return x, slice(0, x.shape[0])
    n = torch.tensor([x.shape[0], x.shape[1]], device=x.device)
    sizes = [torch.zeros_like(n) for _ in range(world)]
    dist.all_gather(sizes, n)
    rows, cols = [int(s[0]) for s in sizes], max(int(s[1]) for s in sizes)
    pad = torch.nn.functional.pad(x, (0, cols - x.shape[1]), value=fill)
    pad = torch.nn.functional.pad(pad, (0, 0, 0, max(rows) - x.shape[0]), value=fill)
    parts = [torch.empty_like(pad) for _ in range(world)]
    dist.all_gather(parts, pad.contiguous())
    out = torch.cat([p[:r] for p, r in zip(parts, rows)])
    start = sum(rows[:rank])
    return out, slice(start, start + x.shape[0])


def gather_floats(values: list[float]) -> list[float]:
    """The concatenation over ranks of each rank's list (metrics only)."""
    if rank_world()[1] == 1:
        return list(values)
    out = [None] * rank_world()[1]
    dist.all_gather_object(out, list(values))
    return [v for part in out for v in part]
