"""The explicit state of a training run, in two parts that the stage functions take as arguments
(and `Trainer` holds as `run` and `state`):

- `Run`: what the run is built from and never changes while it trains: the config, rank and
  device, the task with its eval set and reward scorer, the tokenizer, the loss config. Built
  once, by `fastrl.train.build.build`.
- `TrainState`: what training changes, which is what a checkpoint saves and --resume restores:
  the models (policy, reference, critic, and the DDP wrappers that train them), the optimizer and
  learning-rate schedule, the run's own RNGs, and the step.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import checkpoint as ckpt_io
from .tasks import EpochOrder

if TYPE_CHECKING:
    from ..config import LossConfig
    from .config import TrainConfig
    from .report import Console
    from .rewards import RewardScorer
    from .tasks import Example, Task


@dataclass
class Run:
    """What a run is built from; the stages read it and never change it."""

    cfg: TrainConfig
    rank: int
    world: int
    device: torch.device
    compute_dtype: str
    """"bf16" or "fp32" (--dtype, with auto resolved for the device)."""
    console: Console
    """Where lines go: `log` (rank 0), `warn` (above the progress bar), `report` (any rank)."""
    task: Task
    eval_set: list[Example]
    """The held-out eval examples (--eval-file, a held-out split, or the task's eval stream)."""
    scorer: RewardScorer
    """The task's reward function with its timeout (a worker process for user functions)."""
    tok: Any
    """The tokenizer (Hugging Face)."""
    eos: list[int]
    """Token ids that end a completion."""
    pad_id: int
    sft_steps: int
    """Supervised warm-up steps (--sft-steps, resolved: 1000 for the embedded default)."""
    loss_cfg: LossConfig
    """The --loss preset with the run's overrides: what `fastrl.policy_loss` gets."""
    use_ref: bool
    """A frozen reference model is kept (a KL term in the loss, or ppo's KL shaping)."""
    fused_lm_head: bool
    """--fsdp: LM-head log-probs through the fused linear path, never the (n, T, V) logits."""
    grad_scale: int
    """The world size: DDP / FSDP2 average gradients over the ranks, so the loss is this times
    the rank's share; folded into the loss normalisers (num_tokens / grad_scale), so backward
    starts from 1."""
    data_sha256: dict[str, str]
    """SHA-256 of each data file the run reads, by option ("--task" for a .jsonl task,
    "--eval-file"), taken when it read them: a checkpoint records it, and a resume whose files
    changed is refused (it would split, shuffle and hold out other lines)."""

    def amp(self):
        """A fresh autocast context: bf16 under --dtype bf16 (auto: on CUDA), else none."""
        if self.compute_dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()


@dataclass
class TrainState:
    """What training changes and a checkpoint holds. `build.build` makes it with the policy and
    the RNGs; `build.setup` adds the reference, critic, optimizer, schedule and wrappers (or
    loads all of it from a checkpoint); `update` steps it and the loop counts `step`."""

    policy: nn.Module
    task_rng: random.Random
    """Draws the training prompts."""
    sample_gen: torch.Generator
    """The sampler's generator (on the device)."""
    shuffle_gen: torch.Generator
    """Shuffles the minibatches of the update."""
    ref: nn.Module | None = None
    """The frozen reference policy (when `Run.use_ref`)."""
    critic: nn.Module | None = None
    """PPO's value model (`algos.ValueModel`)."""
    opt: torch.optim.Optimizer | None = None
    sched: torch.optim.lr_scheduler.LRScheduler | None = None
    train_policy: nn.Module | None = None
    """What the update runs forward / backward through: the DDP wrapper, or the policy itself."""
    train_critic: nn.Module | None = None
    step: int = 0
    """RL steps finished."""
    task_order: EpochOrder = field(default_factory=lambda: EpochOrder(0))
    """Where this rank is in a JSONL task's shuffled epochs (`Task.sample`'s `order`), the
    epochs shared by all ranks."""

    def models(self) -> dict[str, nn.Module]:
        """The models a checkpoint holds, by file name."""
        models = {"policy": self.policy}
        if self.ref is not None:
            models["ref"] = self.ref
        if self.critic is not None:
            models["critic"] = self.critic
        return models

    def rng_state(self) -> dict:
        """Every RNG state of this process (global torch / CUDA, python, numpy, and the run's
        own), JSON-able: what a checkpoint saves, and a snapshot `set_rng_state` restores."""
        return {**ckpt_io.rng_state(*self._rngs()), "task_drawn": self.task_order.drawn}

    def set_rng_state(self, state: dict) -> dict[str, str]:
        """Restore `state`; return the generators (name -> the device type their state was
        saved on) it could not restore because they now live on another device type."""
        elsewhere = ckpt_io.set_rng_state(state, *self._rngs())
        self.task_order.drawn = int(state.get("task_drawn", 0))  # absent: an older checkpoint
        return elsewhere

    def generators(self) -> dict[str, torch.Generator]:
        """The run's torch generators by the name a checkpoint stores them under."""
        return {"sample": self.sample_gen, "shuffle": self.shuffle_gen}

    def _rngs(self) -> tuple[dict, dict]:
        return self.generators(), {"task": self.task_rng}
