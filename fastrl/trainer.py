"""A minimal PPO / GRPO / DAPO trainer with its own rollout loop, on fastrl's losses.

One RL step:
1. rollout: `batch_size` prompts (split across ranks) x `group_size` samples with a KV cache
   (`fastrl.rollout.generate`); dapo keeps generating until its dynamic-sampling filter has
   filled the batch or `max_gen_batches` is reached;
2. rewards from the task's reward function (`fastrl.rewards.RewardScorer`: a call that raises,
   returns a non-finite / huge value or runs past `reward_timeout` scores 0 and is counted, the
   first of each kind is printed with its traceback, and a step with failures or with every
   reward 0 prints a warning); dapo adds the overlong penalty and masks truncated completions;
3. pi_old (and pi_ref for grpo / ppo with KL shaping) log-probs: one no-grad forward each;
4. advantages: group advantages (grpo, dapo) or GAE on token rewards with a critic (ppo);
5. `epochs` passes over `minibatches` shuffled minibatches, each one AdamW step over
   `grad_accum` micro-batches. The loss is `fastrl.policy_loss` on the completion logits view
   `logits[:, P-1:-1]`, with the token / sequence count of the whole optimizer step summed over
   micro-batches and ranks passed as `num_tokens` / `num_seqs`, so accumulation and data
   parallelism give the gradient of the full batch. Under DDP (which averages gradients) the
   loss is multiplied by the world size to keep that sum.

Runs under `torchrun --nproc_per_node N` (gloo on CPU, nccl on GPU). Each rank samples its own
prompts (seed + rank); evaluation is greedy on a fixed eval set and identical on every rank.

Failing loudly: the loss, value loss and gradient norms of an update are checked for NaN / inf
in the one host read of its metrics (no extra sync), and a non-finite one raises
`TrainingError` naming the step before that step is saved (so the last checkpoint stays the
last good one; `save` also refuses non-finite weights). `--resume` falls back from a corrupt,
truncated or non-finite checkpoint to the newest intact one, saying which file was bad. An
`--out` that already holds a run is refused unless `force` (or `--resume` names it).
SystemExit / KeyboardInterrupt from the reward function stop the run with a checkpoint and a
`RewardError`.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import json
import os
import random
import shutil
import time
from dataclasses import dataclass, fields
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import checkpoint as ckpt_io
from .advantages import dynamic_sampling_filter, gae, group_advantages, overlong_penalty
from .config import LossConfig, TrainConfig
from .losses import logprobs, policy_loss, value_loss
from .rewards import MAX_ABS_REWARD, RewardError, RewardScorer
from .rollout import (
    CHARS,
    Rollout,
    eos_ids,
    forward_completion_logits,
    generate,
    left_pad,
    load_model,
    sequence_logprobs,
)
from .tasks import Example, get_task


# --------------------------------------------------------------------------- critic
class ValueModel(nn.Module):
    """PPO critic: a copy of the policy's backbone with a scalar head on its last hidden state."""

    def __init__(self, policy):
        super().__init__()
        base = getattr(policy, policy.base_model_prefix, None)
        if base is None:  # pragma: no cover - every HF causal LM has one
            raise ValueError("the policy model has no base model to copy for the critic")
        self.backbone = copy.deepcopy(base)
        hidden = policy.config.hidden_size
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, rollout: Rollout, idx: Tensor | None = None) -> Tensor:
        """Values (n, T) of the completion positions: V_t from the state that predicts token t."""
        p_ids, p_mask, c_ids = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids
        if idx is not None:
            p_ids, p_mask, c_ids = p_ids[idx], p_mask[idx], c_ids[idx]
        P = p_ids.shape[1]
        ids = torch.cat([p_ids, c_ids], 1)
        attn = torch.cat([p_mask, torch.ones_like(c_ids)], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        h = self.backbone(input_ids=ids, attention_mask=attn, position_ids=pos).last_hidden_state
        return self.head(h[:, P - 1 : -1]).squeeze(-1).float()


@dataclass
class Batch:
    """Everything the update needs, per sequence (N,) or per completion token (N, T)."""

    rollout: Rollout
    advantages: Tensor  # (N,) grpo / dapo, (N, T) ppo
    old_logp: Tensor  # (N, T)
    ref_logp: Tensor | None = None  # (N, T)
    returns: Tensor | None = None  # (N, T) ppo
    old_values: Tensor | None = None  # (N, T) ppo

    def select(self, idx: Tensor) -> Batch:
        kw = {}
        for f in fields(self):
            v = getattr(self, f.name)
            kw[f.name] = (
                v.select(idx)
                if isinstance(v, Rollout)
                else (v[idx] if isinstance(v, Tensor) else v)
            )
        return Batch(**kw)


def _rank_world():
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _all_reduce(x: Tensor) -> Tensor:
    if _rank_world()[1] > 1:
        dist.all_reduce(x)
    return x


RUN_FILES = ("config.json", "metrics.jsonl", "checkpoints", "curves.png")
"""What a run writes under --out (a directory holding any of them holds a run)."""


class TrainingError(RuntimeError):
    """Training cannot go on (a non-finite loss, gradient norm or weights); the message names
    the step and the last good checkpoint."""


# --------------------------------------------------------------------------- trainer
class Trainer:
    """Build everything from a TrainConfig (validating first), then `train()`."""

    def __init__(self, cfg: TrainConfig, log=print):
        cfg.validate()
        self.cfg, self.log = cfg, log
        self._init_distributed()
        self.rank, self.world = _rank_world()
        if self.rank != 0:
            self.log = lambda *a, **k: None
        self._bar = None  # the tqdm bar while training (warnings are written above it)
        # reward failures are reported on the rank where they happen
        prefix = f"[rank {self.rank}] " if self.world > 1 else ""
        self._report = lambda text: self._warn(f"{prefix}warning: {text}", any_rank=log)
        if cfg.batch_size % self.world:
            raise ValueError(
                f"--batch-size={cfg.batch_size} must be divisible by the number of ranks "
                f"({self.world})"
            )
        self.device = self._pick_device(cfg.device)
        self.task = get_task(cfg.task, cfg.reward)  # raises on unknown task / bad JSONL
        self.scorer = RewardScorer(self.task.reward_fn, cfg.reward_timeout, report=self._report)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        model, tok = load_model(cfg.model, seed=cfg.seed) if cfg.model else self._embedded()
        self.tok = tok
        self.eos = eos_ids(tok, model)
        self.pad_id = tok.pad_token_id
        self.policy = model.to(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.num_threads or self._auto_threads())
        self.loss_cfg = self._loss_config()
        self.use_ref = (cfg.algo == "grpo" and self.loss_cfg.kl_coef > 0) or (
            cfg.algo == "ppo" and bool(cfg.kl_coef)
        )
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if self.device.type == "cuda"
            else contextlib.nullcontext()
        )
        # RNGs that the run consumes (all saved in checkpoints)
        self.task_rng = random.Random(cfg.seed * 1_000_003 + self.rank)
        self.sample_gen = torch.Generator(device=self.device).manual_seed(
            cfg.seed + 7919 * self.rank
        )
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 104729 * (self.rank + 1))
        self.eval_set = self.task.eval_examples(cfg.eval_size, cfg.seed)
        self.ref = self.critic = None
        self.step = 0

    # ------------------------------------------------------------------ setup helpers
    def _init_distributed(self):
        self._owns_pg = False
        if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() and self.cfg.device != "cpu" else "gloo"
            dist.init_process_group(backend=backend)
            self._owns_pg = True

    def close(self):
        """Tear down the process group this trainer created (torchrun runs).

        The DDP wrappers go first: a DDP reducer that outlives its process group can abort the
        process at exit ("terminate called without an active exception")."""
        if getattr(self, "train_policy", None) is not self.policy:
            self.train_policy, self.train_critic = self.policy, self.critic
            gc.collect()
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

    def _embedded(self):
        model, tok = load_model(None, seed=self.cfg.seed)
        if self.cfg.model_hidden != 64 or self.cfg.model_layers != 2:
            from .rollout import default_model

            model = default_model(
                len(tok), self.cfg.seed, self.cfg.model_hidden, self.cfg.model_layers
            )
        # every character of the task must be in the embedded vocabulary
        sample = self.task.eval_examples(50, self.cfg.seed)
        text = "".join(e.prompt + self.task.target(e) for e in sample)
        missing = sorted(set(text) - set(CHARS))
        if missing:
            raise ValueError(
                f"task {self.cfg.task!r} uses characters {missing} that the embedded model's "
                f"tokenizer lacks (it has {CHARS!r}); pass --model with a local HF model"
            )
        return model, tok

    def _loss_config(self) -> LossConfig:
        cfg = self.cfg
        over = {"temperature": cfg.temperature, "entropy_coef": cfg.entropy_coef}
        if cfg.clip_low is not None:
            over["clip_low"] = cfg.clip_low
        if cfg.clip_high is not None:
            over["clip_high"] = cfg.clip_high
        if cfg.algo == "grpo" and cfg.kl_coef is not None:
            over["kl_coef"] = cfg.kl_coef
        return LossConfig.preset(cfg.algo, **over)

    def _build_optim(self):
        cfg = self.cfg
        groups = [
            {"params": [p for p in self.policy.parameters() if p.requires_grad], "lr": cfg.lr}
        ]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "lr": cfg.critic_lr})
        self.opt = torch.optim.AdamW(groups, betas=(0.9, 0.99), weight_decay=cfg.weight_decay)
        w = cfg.warmup_steps
        self.sched = torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda s: min(1.0, (s + 1) / w) if w > 0 else 1.0
        )

    def _wrap_ddp(self):
        self.train_policy, self.train_critic = self.policy, self.critic
        if self.world > 1:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [self.device.index] if self.device.type == "cuda" else None
            self.train_policy = DDP(self.policy, device_ids=ids)
            if self.critic is not None:
                self.train_critic = DDP(self.critic, device_ids=ids)

    def setup(self):
        """Warm-up (fresh runs), reference / critic copies, optimizer, DDP; or resume."""
        cfg = self.cfg
        candidates = []
        if cfg.resume:
            root = os.path.join(cfg.resume, "checkpoints")
            candidates, notes = ckpt_io.checkpoint_candidates(root)
            for note in notes:
                self.log(f"--resume: {note}")
            if not candidates:
                raise ValueError(f"--resume {cfg.resume!r}: no checkpoint in {root}")
        elif cfg.sft_steps > 0:
            self.supervised_warmup()
        if self.use_ref:
            self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        if cfg.algo == "ppo":
            self.critic = ValueModel(self.policy).to(self.device)
        self._build_optim()
        if candidates:
            self._load_newest_intact(candidates)
        self._wrap_ddp()

    def _load_newest_intact(self, candidates: list[str]) -> None:
        """Load the first checkpoint of `candidates` (newest first) whose files are all intact,
        saying which file of each skipped one is bad; raise ValueError if none is."""
        bad = []
        for ckpt in candidates:
            try:
                self._load(ckpt)
            except ckpt_io.CorruptCheckpoint as e:
                bad.append(str(e))
                self.log(f"--resume: skipping checkpoint {ckpt}: {e}")
                continue
            if bad:
                self.log(f"--resume: fell back to {ckpt} (the newest intact checkpoint)")
            return
        raise ckpt_io.CorruptCheckpoint(
            os.path.dirname(candidates[0]),
            "no intact checkpoint to resume from:\n  " + "\n  ".join(bad),
        )

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, examples: list[Example]) -> list[list[int]]:
        return [self.tok(e.prompt).input_ids for e in examples]

    def decode(self, r: Rollout) -> list[str]:
        ids = r.completion_ids.tolist()
        out = []
        for row, n in zip(ids, r.lengths.tolist()):
            row = [t for t in row[:n] if t not in self.eos]
            out.append(self.tok.decode(row, skip_special_tokens=True))
        return out

    # ------------------------------------------------------------------ warm-up and eval
    def supervised_warmup(self):
        """Short supervised fine-tuning on (prompt, target + EOS) pairs of the task's warm-up
        distribution, with its own AdamW (discarded afterwards)."""
        cfg = self.cfg
        rng = random.Random(cfg.seed + 17)
        opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.99))
        self.policy.train()
        for _ in range(cfg.sft_steps):
            ex = self.task.warmup_examples(rng, cfg.sft_batch_size)
            r = self._teacher_forced(ex)
            with self.autocast:
                logits, _ = forward_completion_logits(self.policy, r)
                lp = logprobs(logits, r.completion_ids)
            loss = -(lp * r.completion_mask).sum() / r.completion_mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
            opt.step()
        note = getattr(self.task, "warmup_note", "")
        self.log(
            f"supervised warm-up: {cfg.sft_steps} steps x {cfg.sft_batch_size} examples "
            f"(lr {cfg.sft_lr}){note}, final loss {loss.item():.3f}"
        )

    def _teacher_forced(self, examples: list[Example]) -> Rollout:
        prompts = self.encode(examples)
        targets = [
            self.tok(self.task.target(e), add_special_tokens=False).input_ids + [self.eos[0]]
            for e in examples
        ]
        p_ids, p_mask = left_pad(prompts, self.pad_id, self.device)
        T = max(len(t) for t in targets)
        c_ids = torch.full((len(targets), T), self.pad_id, dtype=torch.long)
        c_mask = torch.zeros((len(targets), T))
        for i, t in enumerate(targets):
            c_ids[i, : len(t)] = torch.tensor(t)
            c_mask[i, : len(t)] = 1
        lengths = c_mask.sum(1).long()
        return Rollout(
            p_ids,
            p_mask,
            c_ids.to(self.device),
            c_mask.to(self.device),
            torch.zeros_like(c_mask).to(self.device),
            lengths.to(self.device),
            torch.zeros(len(targets), dtype=torch.bool, device=self.device),
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Share of the eval prompts whose greedy completion gets reward >= 1."""
        self.policy.eval()
        correct = failed = 0
        for s in range(0, len(self.eval_set), 256):
            ex = self.eval_set[s : s + 256]
            with self.autocast:
                r = generate(
                    self.policy,
                    self.encode(ex),
                    1,
                    self.cfg.max_new_tokens,
                    self.eos,
                    self.pad_id,
                    temperature=0.0,
                )
            res = self.scorer(self.decode(r), [e.answer for e in ex])
            correct += sum(x >= 1.0 - 1e-6 for x in res.rewards)
            failed += res.errors
        self.policy.train()
        if failed:
            self._warn(
                f"warning: eval after step {self.step}: {failed} of {len(self.eval_set)} reward "
                "calls failed (scored 0, counted as wrong)"
            )
        return correct / max(len(self.eval_set), 1)

    # ------------------------------------------------------------------ rollout phase
    @torch.no_grad()
    def collect(self) -> tuple[Batch, dict]:
        """Generate, score and compute advantages for one RL step (this rank's share)."""
        cfg, G = self.cfg, self.cfg.group_size
        n_prompts = cfg.batch_size // self.world
        self.policy.eval()
        parts, part_rewards = [], []
        stats = {
            "reward_sum": 0.0,
            "success": 0.0,
            "n": 0,
            "errors": 0,
            "raised": 0,
            "invalid": 0,
            "timeouts": 0,
            "nonzero": 0,
            "tokens": 0,
            "len_sum": 0.0,
            "truncated": 0.0,
        }
        kept_groups, gen_batches = 0, 0
        for _ in range(cfg.max_gen_batches if cfg.algo == "dapo" else 1):
            gen_batches += 1
            ex = self.task.sample(self.task_rng, n_prompts)
            with self.autocast:
                r = generate(
                    self.policy,
                    self.encode(ex),
                    G,
                    cfg.max_new_tokens,
                    self.eos,
                    self.pad_id,
                    temperature=cfg.temperature,
                    generator=self.sample_gen,
                )
            answers = [e.answer for e in ex for _ in range(G)]
            res = self.scorer(self.decode(r), answers)
            raw = res.rewards
            rewards = torch.tensor(raw, dtype=torch.float32)
            stats["reward_sum"] += sum(raw)
            stats["success"] += sum(x >= 1.0 - 1e-6 for x in raw)
            stats["n"] += len(raw)
            stats["errors"] += res.errors
            stats["raised"] += res.raised
            stats["invalid"] += res.invalid
            stats["timeouts"] += res.timeouts
            stats["nonzero"] += sum(x != 0.0 for x in raw)
            stats["tokens"] += int(r.lengths.sum())
            stats["len_sum"] += float(r.lengths.float().sum())
            stats["truncated"] += float(r.truncated.float().sum())
            if cfg.algo == "dapo":
                if cfg.overlong_cache > 0:
                    rewards = rewards + overlong_penalty(
                        r.lengths.cpu(), cfg.max_new_tokens, cfg.overlong_cache, cfg.overlong_factor
                    )
                keep = dynamic_sampling_filter(rewards, G)[: n_prompts - kept_groups]
                idx = (keep[:, None] * G + torch.arange(G)).flatten()
                if len(idx):
                    parts.append(r.select(idx.to(self.device)))
                    part_rewards.append(rewards[idx])
                kept_groups += len(keep)
                if kept_groups >= n_prompts:
                    break
            else:
                parts.append(r)
                part_rewards.append(rewards)
        if not parts:  # dapo found no informative group: train on a fully masked group
            parts, part_rewards = [r.select(torch.arange(G, device=self.device))], [rewards[:G]]
            parts[0].completion_mask = torch.zeros_like(parts[0].completion_mask)
        rollout = Rollout.cat(parts, self.pad_id) if len(parts) > 1 else parts[0]
        rewards = torch.cat(part_rewards).to(self.device)
        if cfg.algo == "dapo" and cfg.overlong_filter:
            rollout.completion_mask = rollout.completion_mask * (~rollout.truncated)[:, None]
        stats.update(gen_batches=gen_batches, kept_groups=kept_groups)

        chunk = max(1, rollout.completion_ids.shape[0] // cfg.minibatches)
        with self.autocast:
            old_logp = sequence_logprobs(self.policy, rollout, cfg.temperature, chunk)
            ref_logp = (
                sequence_logprobs(self.ref, rollout, cfg.temperature, chunk)
                if self.ref is not None
                else None
            )
        stats["sampler_gap"] = float(
            ((old_logp - rollout.sampler_logp).abs() * rollout.completion_mask).max()
        )
        if cfg.algo == "ppo":
            batch = self._ppo_advantages(rollout, rewards, old_logp, ref_logp)
        else:
            adv = group_advantages(rewards, group_size=G).to(self.device)
            batch = Batch(rollout, adv, old_logp, ref_logp)
        self.policy.train()
        return batch, stats

    @torch.no_grad()
    def _ppo_advantages(self, rollout, rewards, old_logp, ref_logp) -> Batch:
        """Terminal reward on the last counted token (minus kl_coef * (old - ref) per token when
        KL shaping is on), GAE with the critic's values, advantages whitened over all ranks."""
        cfg, mask = self.cfg, rollout.completion_mask
        with self.autocast:
            values = self.critic(rollout).float() * mask
        token_rewards = torch.zeros_like(mask)
        last = (rollout.lengths - 1).clamp(min=0)
        token_rewards[torch.arange(len(last), device=mask.device), last] = rewards
        if ref_logp is not None and cfg.kl_coef:
            token_rewards = token_rewards - cfg.kl_coef * (old_logp - ref_logp) * mask
        adv, returns = gae(token_rewards, values, mask, cfg.gamma, cfg.lam, whiten=False)
        stats = _all_reduce(torch.stack([(adv * mask).sum(), (adv**2 * mask).sum(), mask.sum()]))
        s, s2, n = stats.double()
        mean = s / n.clamp(min=1)
        var = (s2 / n.clamp(min=1) - mean**2) * n / (n - 1).clamp(min=1)
        adv = ((adv - mean) * torch.rsqrt(var.clamp(min=0) + 1e-8)).float() * mask
        return Batch(rollout, adv, old_logp, ref_logp, returns * mask, values)

    # ------------------------------------------------------------------ update phase
    def update(self, batch: Batch) -> dict:
        """`epochs` x `minibatches` optimizer steps on this rank's `batch`; metrics summed /
        averaged over ranks (identical on every rank). Metric sums and gradient norms stay on
        the device and are read once, at the end; a non-finite loss, value loss or gradient
        norm found there raises TrainingError naming the step (the weights are then spoiled:
        the run must stop before they are saved)."""
        cfg = self.cfg
        N = batch.rollout.completion_ids.shape[0]
        # loss, tok, ent, kl, clip, akl, vloss, vclip: summed on the device, read once per update
        sums = torch.zeros(8, dtype=torch.float64, device=self.device)
        grad_norms = []
        for _ in range(cfg.epochs):
            perm = torch.randperm(N, generator=self.shuffle_gen)
            for mb in torch.tensor_split(perm, cfg.minibatches):
                mb = mb.to(self.device)
                mask = batch.rollout.completion_mask
                counts = _all_reduce(
                    torch.stack([mask[mb].sum(), torch.tensor(float(len(mb)), device=mask.device)])
                )
                num_tokens, num_seqs = counts[0], counts[1]
                micros = torch.tensor_split(mb, cfg.grad_accum)
                self.opt.zero_grad(set_to_none=True)
                for i, mi in enumerate(micros):
                    sync = i == len(micros) - 1
                    sums += self._micro_step(batch, mi, num_tokens, num_seqs, sync)
                grad_norms.append(self._clip_and_step())
        n_opt = cfg.epochs * cfg.minibatches
        # the one host read of this update: metric sums and every (policy, critic) grad norm
        host = torch.cat([_all_reduce(sums), torch.stack(grad_norms).double().flatten()]).cpu()
        sums, norms = host[:8], host[8:].view(n_opt, 2)
        self._check_finite(sums, norms)
        tok = max(sums[1].item(), 1.0)
        out = {
            "loss": sums[0].item() / n_opt,
            "entropy": sums[2].item() / tok,
            "kl": sums[3].item() / tok,
            "clipfrac": sums[4].item() / tok,
            "approx_kl": sums[5].item() / tok,
            "grad_norm": norms[:, 0].mean().item(),
            "lr": self.sched.get_last_lr()[0],
        }
        if cfg.algo == "ppo":
            out["value_loss"] = sums[6].item() / n_opt
            out["vf_clipfrac"] = sums[7].item() / tok
        return out

    def _micro_step(
        self, batch: Batch, idx: Tensor, num_tokens: Tensor, num_seqs: Tensor, sync: bool
    ) -> Tensor:
        """Forward + backward of one micro-batch (rows idx); returns its metric sums (8,)."""
        r = batch.rollout
        if len(idx) == 0:  # an empty micro-batch still joins DDP's all-reduce: a masked row
            idx = torch.zeros(1, dtype=torch.long, device=self.device)
            mask = torch.zeros_like(r.completion_mask[idx])
        else:
            mask = r.completion_mask[idx]
        no_sync = contextlib.ExitStack() if sync or self.world == 1 else self._no_sync_all()
        with no_sync:
            with self.autocast:
                logits, _ = forward_completion_logits(self.train_policy, r, idx)  # (n, T, V) view
                out = policy_loss(
                    logits,
                    r.completion_ids[idx],
                    batch.advantages[idx],
                    old_logp=batch.old_logp[idx],
                    ref_logp=batch.ref_logp[idx] if batch.ref_logp is not None else None,
                    mask=mask,
                    config=self.loss_cfg,
                    num_tokens=num_tokens,
                    num_seqs=num_seqs,
                )
                loss = out.loss
                vloss = vclip = torch.zeros((), device=self.device)
                if self.critic is not None:
                    values = self.train_critic(r, idx)
                    vloss, vclip = value_loss(
                        values,
                        batch.old_values[idx],
                        batch.returns[idx],
                        mask,
                        clip=self.cfg.value_clip,
                        agg="token-mean",
                        num_tokens=num_tokens,  # the global count, as for the policy loss
                    )
                    loss = loss + self.cfg.vf_coef * vloss
            (loss * self.world).backward()
        n_tok = mask.sum().double()
        m = out.metrics
        kl = m["kl"] if batch.ref_logp is not None else m["approx_kl"]
        return torch.stack(
            [
                out.loss.detach().double(),
                n_tok,
                m["entropy"].double() * n_tok,
                kl.double() * n_tok,
                m["clipfrac"].double() * n_tok,
                m["approx_kl"].double() * n_tok,
                vloss.detach().double(),
                vclip.double() * n_tok,
            ]
        )

    @contextlib.contextmanager
    def _no_sync_all(self):
        with contextlib.ExitStack() as stack:
            for m in (self.train_policy, self.train_critic):
                if m is not None and hasattr(m, "no_sync"):
                    stack.enter_context(m.no_sync())
            yield

    def _clip_and_step(self) -> Tensor:
        """Clip, step; (policy, critic) gradient norms before clipping, on the device (no sync)."""
        norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.cfg.max_grad_norm)
        cnorm = torch.zeros_like(norm)
        if self.critic is not None:
            cnorm = torch.nn.utils.clip_grad_norm_(
                self.critic.parameters(), self.cfg.max_grad_norm
            ).to(norm)
        self.opt.step()
        self.sched.step()
        return torch.stack([norm, cnorm])

    def _check_finite(self, sums: Tensor, norms: Tensor) -> None:
        """Raise TrainingError when this update's loss, value loss or a gradient norm (host
        copies) is NaN / inf."""
        if bool(torch.isfinite(sums).all()) and bool(torch.isfinite(norms).all()):
            return
        what = []
        if not torch.isfinite(sums[0]):
            what.append(f"loss {sums[0].item()}")
        if not torch.isfinite(sums[6]):
            what.append(f"value loss {sums[6].item()}")
        for col, name in ((0, "policy"), (1, "critic")):
            bad = (~torch.isfinite(norms[:, col])).nonzero().flatten().tolist()
            if bad:
                what.append(
                    f"{name} gradient norm {norms[bad[0], col].item()} at optimizer step "
                    f"{bad[0] + 1} of {len(norms)}"
                )
        if not what:
            what.append("loss metrics (entropy / KL / clip fractions)")
        raise TrainingError(
            f"step {self.step + 1}: non-finite {', '.join(what)}; stopping. The weights are "
            f"spoiled, so this step is not saved; {self._last_good()}"
        )

    def _last_good(self) -> str:
        ckpt = ckpt_io.latest_checkpoint(os.path.join(self.cfg.out, "checkpoints"))
        if ckpt is None:
            return "no checkpoint had been saved yet"
        return f"the last good checkpoint is {ckpt} (continue with --resume {self.cfg.out})"

    def _weights_finite(self) -> bool:
        """Every trained parameter finite (one host read; only when saving)."""
        params = [
            p.detach() for m in (self.policy, self.critic) if m is not None for p in m.parameters()
        ]
        return bool(torch.stack([torch.isfinite(p).all() for p in params]).all())

    # ------------------------------------------------------------------ checkpoints
    def _models(self) -> dict:
        models = {"policy": self.policy}
        if self.ref is not None:
            models["ref"] = self.ref
        if self.critic is not None:
            models["critic"] = self.critic
        return models

    def _rng(self) -> dict:
        return ckpt_io.rng_state(
            {"sample": self.sample_gen, "shuffle": self.shuffle_gen}, {"task": self.task_rng}
        )

    def save(self):
        """Checkpoint the current step (refusing non-finite weights: TrainingError)."""
        if not self._weights_finite():
            raise TrainingError(
                f"step {self.step}: the weights are non-finite (NaN / inf) although the loss and "
                f"gradient norms were finite; not saving them; {self._last_good()}"
            )
        rank_states = [None] * self.world
        if self.world > 1:
            dist.all_gather_object(rank_states, self._rng())
        else:
            rank_states = [self._rng()]
        if self.rank == 0:
            state = {"step": self.step, "config": self.cfg.to_dict(), "rng": rank_states[0]}
            ckpt_io.save_checkpoint(
                os.path.join(self.cfg.out, "checkpoints"),
                self.step,
                self._models(),
                {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()},
                state,
                rank_states if self.world > 1 else None,
            )
        if self.world > 1:
            dist.barrier()

    def _load(self, ckpt: str):
        """Load checkpoint `ckpt` into everything; CorruptCheckpoint names a bad file (the
        state may then be partly overwritten: load another checkpoint or give up)."""
        optim_state, state = ckpt_io.load_checkpoint(ckpt, self._models(), self.device)
        path = os.path.join(ckpt, "optimizer.pt")
        try:
            self.opt.load_state_dict(optim_state["optimizer"])
            self.sched.load_state_dict(optim_state["scheduler"])
        except Exception as e:  # a state of another shape: not this run's
            raise ckpt_io.CorruptCheckpoint(path, f"{type(e).__name__}: {e}") from e
        for r in range(self.world if self.world > 1 else 0):  # every rank decides alike
            ckpt_io.load_rank_rng(ckpt, r)
        rng = ckpt_io.load_rank_rng(ckpt, self.rank)
        path = os.path.join(ckpt, f"rng_rank{self.rank}.json" if rng else "state.json")
        try:
            ckpt_io.set_rng_state(
                rng or state["rng"],
                {"sample": self.sample_gen, "shuffle": self.shuffle_gen},
                {"task": self.task_rng},
            )
        except Exception as e:
            raise ckpt_io.CorruptCheckpoint(path, f"bad RNG state ({type(e).__name__}: {e})") from e
        self.step = state["step"]
        self.log(f"resumed from {ckpt} at step {self.step}")

    # ------------------------------------------------------------------ main loop
    def check_out_dir(self) -> None:
        """Refuse (ValueError) an --out that already holds a run, unless `force` or `resume`
        names it."""
        cfg = self.cfg
        out = cfg.out
        if os.path.exists(out) and not os.path.isdir(out):
            raise ValueError(f"--out {out!r} exists and is not a directory")
        if cfg.force or self._resumes_in_place():
            return
        found = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
        if found:
            raise ValueError(
                f"--out {out!r} already holds a run ({', '.join(found)}); not overwriting it. "
                f"Continue it with --resume {out}, start over there with --force (deletes "
                "those files), or choose another --out"
            )

    def _resumes_in_place(self) -> bool:
        cfg = self.cfg
        return bool(cfg.resume) and os.path.abspath(cfg.resume) == os.path.abspath(cfg.out)

    def _warn(self, text: str, any_rank=None) -> None:
        """A warning line: above the progress bar when there is one, else through the log
        (`any_rank`: the log to use on every rank, not only rank 0)."""
        log = any_rank or self.log
        if self._bar is not None and log is print:
            self._bar.write(text)
        else:
            log(text)

    def _rng_snapshot(self):
        """This process's RNG states, cheaply (a checkpoint taken after an interrupted rollout
        restores them, so that resuming repeats that rollout exactly)."""
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
        return (
            torch.get_rng_state(),
            random.getstate(),
            np.random.get_state(),
            self.sample_gen.get_state(),
            self.shuffle_gen.get_state(),
            self.task_rng.getstate(),
            cuda,
        )

    def _stop_for_reward(self, e: RewardError, where: str, snapshot=None) -> NoReturn:
        """The reward function asked to stop (or hangs) `where`: checkpoint the last finished
        step (single-process runs; with `snapshot`, RNGs as at that step's end) and raise."""
        if self.world > 1:  # the other ranks may not stop here: no collective save
            note = "distributed run: no checkpoint written here, the last periodic one is kept"
        else:
            if snapshot is not None:
                torch_rng, py, npy, sample, shuffle, task, cuda = snapshot
                torch.set_rng_state(torch_rng)
                random.setstate(py)
                np.random.set_state(npy)
                self.sample_gen.set_state(sample)
                self.shuffle_gen.set_state(shuffle)
                self.task_rng.setstate(task)
                if cuda is not None:
                    torch.cuda.set_rng_state_all(cuda)
            self.save()
            note = f"checkpoint of step {self.step} saved; continue with --resume {self.cfg.out}"
        raise RewardError(f"{where}: {e}\n({note})", e.exit_code) from e

    def train(self) -> list[dict]:
        """Run (or continue) the whole training; returns the metric records of this call."""
        cfg = self.cfg
        is_main = self.rank == 0
        self.check_out_dir()
        os.makedirs(cfg.out, exist_ok=True)
        self.setup()
        metrics_path = os.path.join(cfg.out, "metrics.jsonl")
        if is_main:
            if not self._resumes_in_place():  # nothing of an earlier run (--force) remains
                shutil.rmtree(os.path.join(cfg.out, "checkpoints"), ignore_errors=True)
                for name in ("metrics.jsonl", "curves.png"):
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(os.path.join(cfg.out, name))
            ckpt_io.write_json_atomic(os.path.join(cfg.out, "config.json"), cfg.to_dict())
            if cfg.resume:
                _truncate_metrics(metrics_path, self.step, self.log)
        records = []

        def emit(rec):
            records.append(rec)
            if is_main:
                with open(metrics_path, "a") as f:
                    f.write(json.dumps(rec) + "\n")

        if self.step == 0:
            try:
                acc = self.evaluate()
            except RewardError as e:
                self._stop_for_reward(e, "eval at step 0")
            emit({"step": 0, "eval_accuracy": acc})
            self.log(
                f"step 0 (before RL{', after warm-up' if cfg.sft_steps else ''}): "
                f"eval accuracy {acc:.3f}"
            )
        bar = None
        if cfg.progress and is_main:
            from tqdm.auto import tqdm

            bar = tqdm(
                total=cfg.steps, initial=self.step, desc=f"fastrl {cfg.algo}", dynamic_ncols=True
            )
        self._bar = bar
        try:
            self._loop(emit)
        finally:
            self._bar = None
            if bar is not None:
                bar.close()
        if is_main:
            try:
                plot_curves(metrics_path, os.path.join(cfg.out, "curves.png"), cfg.algo)
            except Exception as e:  # a plot never fails a run
                self.log(f"could not write curves.png: {e}")
        return records

    def _loop(self, emit) -> None:
        """The RL steps of `train` (records through `emit`)."""
        cfg, bar = self.cfg, self._bar
        seen = nonzero = steps = 0  # rewards of this call (all ranks), for the final warning
        t_start = time.perf_counter()
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            snapshot = self._rng_snapshot() if self.world == 1 else None
            try:
                batch, st = self.collect()
            except RewardError as e:
                self._stop_for_reward(e, f"step {self.step + 1}", snapshot)
            upd = self.update(batch)  # raises TrainingError on a non-finite loss / grad norm
            self.step += 1
            tot = _all_reduce(
                torch.tensor(
                    [
                        st["reward_sum"],
                        st["success"],
                        st["n"],
                        st["errors"],
                        st["tokens"],
                        st["len_sum"],
                        st["truncated"],
                        st["gen_batches"],
                        st["kept_groups"],
                        st["raised"],
                        st["invalid"],
                        st["timeouts"],
                        st["nonzero"],
                    ],
                    dtype=torch.float64,
                    device=self.device,
                )
            ).tolist()
            n = max(tot[2], 1.0)
            dt = time.perf_counter() - t0
            rec = {
                "step": self.step,
                "reward_mean": tot[0] / n,
                "success_rate": tot[1] / n,
                **upd,
                "response_len": tot[5] / n,
                "truncated_frac": tot[6] / n,
                "reward_errors": int(tot[3]),
                "reward_timeouts": int(tot[11]),
                "sampler_logp_gap": st["sampler_gap"],
                "tokens_per_s": tot[4] / dt,
                "step_time_s": dt,
            }
            if cfg.algo == "dapo":
                rec["gen_batches"] = tot[7] / self.world
                rec["kept_groups"] = int(tot[8])
                rec["batch_full"] = bool(tot[8] >= cfg.batch_size)
            self._step_warnings(tot)
            if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                try:
                    rec["eval_accuracy"] = self.evaluate()
                except RewardError as e:
                    emit(rec)
                    self._stop_for_reward(e, f"eval after step {self.step}")
            emit(rec)
            seen, nonzero, steps = seen + int(tot[2]), nonzero + int(tot[12]), steps + 1
            if bar is not None:
                bar.update(1)
                post = {
                    "reward": f"{rec['reward_mean']:.3f}",
                    "kl": f"{rec['kl']:.4f}",
                    "entropy": f"{rec['entropy']:.3f}",
                }
                if "eval_accuracy" in rec:
                    post["eval"] = f"{rec['eval_accuracy']:.2f}"
                bar.set_postfix(post)
            if (cfg.save_every and self.step % cfg.save_every == 0) or self.step == cfg.steps:
                self.save()
        self.wall_time = time.perf_counter() - t_start
        if seen and not nonzero:
            self._warn(
                f"warning: every reward of this run was 0 ({seen} samples over {steps} "
                f"step{'s' if steps > 1 else ''}): "
                "RL had no learning signal; check --task / --reward (and the reward errors "
                "above, if any)"
            )

    def _step_warnings(self, tot: list[float]) -> None:
        """Warning lines for this step's reward failures and an all-zero reward batch."""
        n, failed = int(tot[2]), int(tot[3])
        if failed:
            kinds = [
                f"{int(tot[i])} {what}"
                for i, what in (
                    (9, "raised"),
                    (10, f"returned a non-number, non-finite or |r| > {MAX_ABS_REWARD:g} value"),
                    (11, f"ran past --reward-timeout {self.cfg.reward_timeout:g}s"),
                )
                if tot[i]
            ]
            self._warn(
                f"warning: step {self.step}: {failed} of {n} reward calls failed and scored 0 "
                f"({', '.join(kinds)})"
            )
        if n and not tot[12]:
            self._warn(f"warning: step {self.step}: every reward is 0 ({n} samples)")


def _truncate_metrics(path: str, step: int, log=print) -> None:
    """Keep the records up to `step` (a resumed run rewrites what came after its checkpoint).
    A line that is not a JSON record with a step (e.g. cut short by a crash) is dropped, saying
    so with its file and line number."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec_step = json.loads(line)["step"]
                if not isinstance(rec_step, int):
                    raise TypeError(f"step {rec_step!r}")
            except (ValueError, KeyError, TypeError) as e:
                log(f"--resume: dropping {path}:{lineno}, not a metrics record ({e})")
                continue
            if rec_step <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_curves(metrics_path: str, png_path: str, title: str = "") -> None:
    """reward, eval accuracy, KL, entropy and response length by step (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    panels = [
        ("reward_mean", "reward"),
        ("eval_accuracy", "eval accuracy"),
        ("kl", "KL"),
        ("entropy", "entropy"),
        ("response_len", "response length"),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.2))
    for ax, (key, label) in zip(axes, panels):
        pts = [(r["step"], r[key]) for r in recs if key in r and r[key] is not None]
        if pts:
            xs, ys = zip(*pts)
            ax.plot(xs, ys, marker="o" if key == "eval_accuracy" else None, ms=3)
        ax.set_title(label)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)


def run(cfg: TrainConfig, log=print) -> Trainer:
    """Train with `cfg`; returns the trainer (its `wall_time`, records in cfg.out)."""
    trainer = Trainer(cfg, log=log)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


__all__ = ["Batch", "Trainer", "ValueModel", "plot_curves", "read_metrics", "run"]
