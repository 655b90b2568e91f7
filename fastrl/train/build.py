"""Building a run from its TrainConfig: process group, device, model and tokenizer, eval set,
loss config, optimizer and learning-rate schedule, data-parallel wrappers."""

from __future__ import annotations

import contextlib
import gc
import math
import os

import torch
import torch.distributed as dist

from ..config import LossConfig
from .rollout import CHARS, load_model
from .tasks import BUILTIN_TASKS, JsonlTask, load_jsonl

DEFAULT_SFT_STEPS = 1000
"""Supervised warm-up steps of the embedded default (built-in task, no --model)."""


class BuildMixin:
    """Trainer methods that set a run up (and tear its process group down)."""

    # ------------------------------------------------------------------ processes, devices
    def _init_distributed(self):
        self._owns_pg = False
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and self.cfg.device != "cpu" else "gloo"
            dist.init_process_group(backend=backend)
            self._owns_pg = True

    def close(self):
        """Stop the reward worker process, and tear down the process group this trainer created
        (torchrun runs).

        The DDP wrappers go first: a DDP reducer that outlives its process group can abort the
        process at exit ("terminate called without an active exception")."""
        if getattr(self, "scorer", None) is not None:
            self.scorer.close()
        if getattr(self, "train_policy", None) is not self.policy:
            self.train_policy, self.train_critic = self.policy, self.critic
            gc.collect()
        if getattr(self, "runlog", None) is not None:
            self.runlog.close()
        if self._owns_pg and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
            self._owns_pg = False

    def _pick_device(self, name: str) -> torch.device:
        if name == "auto":
            name = "cuda" if torch.cuda.is_available() else "cpu"
        if name == "cuda" and self.world > 1:
            name = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        try:
            dev = torch.device(name)
        except RuntimeError as e:
            raise ValueError(f"--device={name!r} is not a torch device: {e}") from e
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"--device={name!r} but CUDA is not available; use --device cpu")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        return dev

    def _auto_threads(self) -> int:
        """1 thread for tiny models (thread hand-offs cost more than the matmuls, and badly so
        on a shared machine), else this rank's share of the cores."""
        if sum(p.numel() for p in self.policy.parameters()) < 10_000_000:
            return 1
        return max(1, (os.cpu_count() or 1) // self.world)

    def amp(self):
        """A fresh autocast context: bf16 under --dtype bf16 (auto: on CUDA), else none."""
        if self.compute_dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    # ------------------------------------------------------------------ model, data, loss
    def _load_models(self):
        """(model, tokenizer), and the resolved warm-up length."""
        cfg = self.cfg
        embedded = cfg.model is None
        self.sft_steps = (
            cfg.sft_steps
            if cfg.sft_steps is not None
            else (DEFAULT_SFT_STEPS if embedded and cfg.task in BUILTIN_TASKS else 0)
        )
        return self._embedded() if embedded else load_model(cfg.model, seed=cfg.seed)

    def _embedded(self):
        from . import rollout

        model, tok = load_model(None, seed=self.cfg.seed)
        if self.cfg.model_hidden != 64 or self.cfg.model_layers != 2:
            model = rollout.default_model(
                len(tok), self.cfg.seed, self.cfg.model_hidden, self.cfg.model_layers
            )
        # every character of the task must be in the embedded vocabulary: the tokenizer drops
        # any other (it has no unknown token, as AutoTokenizer reloads it from an export), so
        # every line of a .jsonl task and of the eval set is checked, not a sample
        task, cfg = self.task, self.cfg
        lines = task.examples if isinstance(task, JsonlTask) else task.eval_examples(50, cfg.seed)
        text = "".join(e.prompt + task.target(e) for e in [*lines, *self.eval_set])
        missing = sorted(set(text) - set(CHARS))
        if missing:
            raise ValueError(
                f"task {self.cfg.task!r} uses characters {missing} that the embedded model's "
                f"tokenizer lacks (it has {CHARS!r}; it would drop them); pass --model with a "
                "local HF model"
            )
        return model, tok

    def _eval_examples(self):
        """The eval set: --eval-file, else a held-out split of a .jsonl task (removed from its
        training lines), else the built-in task's disjoint eval stream."""
        cfg, task = self.cfg, self.task
        if cfg.eval_file:
            return load_jsonl(cfg.eval_file)[: cfg.eval_size]
        if isinstance(task, JsonlTask):
            held = task.hold_out(cfg.eval_split, cfg.eval_size, cfg.seed)
            if held:
                self.log(
                    f"eval: {len(held)} lines of {cfg.task} held out (--eval-split "
                    f"{cfg.eval_split}), training on the other {len(task.examples)}"
                )
                return held
            self.log(
                f"eval: on the first {min(cfg.eval_size, len(task.examples))} training lines of "
                f"{cfg.task} (no held-out data: pass --eval-file or --eval-split > 0)"
            )
        return task.eval_examples(cfg.eval_size, cfg.seed)

    def _loss_config(self) -> LossConfig:
        cfg = self.cfg
        over = {"temperature": cfg.temperature, "entropy_coef": cfg.entropy_coef}
        if cfg.clip_low is not None:
            over["clip_low"] = cfg.clip_low
        if cfg.clip_high is not None:
            over["clip_high"] = cfg.clip_high
        if cfg.algo != "ppo" and cfg.kl_coef is not None:  # ppo: kl_coef shapes the reward
            over["kl_coef"] = cfg.kl_coef
        preset = cfg.loss or cfg.algo
        if preset == "dr_grpo":  # its normaliser is the budget, not the batch's longest
            over["max_len"] = cfg.max_new_tokens
        return LossConfig.preset(preset, **over)

    # ------------------------------------------------------------------ optimizer, wrappers
    def _build_optim(self):
        cfg = self.cfg
        groups = [
            {"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": cfg.lr}
        ]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "lr": cfg.critic_lr})
        self.opt = torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
        total = cfg.steps * cfg.epochs * cfg.minibatches
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: lr_factor(s, cfg.warmup_steps, total, cfg.lr_schedule)
        )

    def _wrap(self):
        """DDP replicas (several ranks, not --fsdp); the models themselves otherwise."""
        self.train_policy, self.train_critic = self.policy, self.critic
        if self.world > 1 and not self.cfg.fsdp:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_policy = DDP(self.policy, device_ids=ids)
            if self.critic is not None:
                self.train_critic = DDP(self.critic, device_ids=ids)

    def _shard(self):
        """--fsdp: FSDP2 `fully_shard` on each decoder layer and then each whole model (policy,
        critic, reference), in place; parameters become DTensors sharded over the ranks."""
        from torch.distributed.fsdp import fully_shard

        for model in (self.policy, self.critic, self.ref):
            if model is None:
                continue
            for m in model.modules():
                if type(m).__name__.endswith("DecoderLayer"):
                    fully_shard(m)
            fully_shard(model)


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """The learning-rate multiplier at optimizer step `step` (0-based): linear warm-up over
    `warmup` steps, then constant, or linear / cosine decay to 0 at step `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))
