"""Run state on disk: atomic checkpoints (each with a Hugging Face export `hf/`), resume with
fallback to the newest intact checkpoint, the --out guard, and stopping with a checkpoint when
the reward function asks to."""

from __future__ import annotations

import os
import random
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from . import checkpoint as ckpt_io
from .common import RUN_FILES, TrainingError
from .rewards import RewardError

HF_DIR = "hf"
"""The Hugging Face model directory inside each checkpoint (save_pretrained of model + tok)."""


class StateMixin:
    """Trainer methods that write, read and guard the run directory."""

    # ------------------------------------------------------------------ --out
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

    # ------------------------------------------------------------------ save
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

    def _full_state_dicts(self) -> dict:
        """name -> module, or under --fsdp name -> full state dict on the CPU (a collective:
        every rank calls it; rank 0 gets the tensors)."""
        models = self._models()
        if not self.cfg.fsdp:
            return models
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
        )

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return {k: get_model_state_dict(m, options=opts) for k, m in models.items()}

    def export_hf(self, path: str, state_dict: dict | None = None) -> None:
        """save_pretrained of the policy (tied weights kept tied) and its tokenizer into `path`:
        a directory AutoModelForCausalLM.from_pretrained and `fastrl train --model` load
        (`state_dict`: the policy's full weights, for a sharded policy)."""
        from transformers.utils import logging as hf_logging

        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # no "Writing model shards" bar per checkpoint
        try:
            kw = {"state_dict": state_dict} if state_dict is not None else {}
            self.policy.save_pretrained(path, safe_serialization=True, **kw)
            self.tok.save_pretrained(path)
        finally:
            if bars:
                hf_logging.enable_progress_bar()

    def save(self):
        """Checkpoint the current step (refusing non-finite weights: TrainingError), with the
        Hugging Face export in its `hf/`."""
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
        models = self._full_state_dicts()
        policy_sd = models["policy"] if self.cfg.fsdp else None
        if self.rank == 0:
            state = {"step": self.step, "config": self.cfg.to_dict(), "rng": rank_states[0]}
            self.last_ckpt = ckpt_io.save_checkpoint(
                os.path.join(self.cfg.out, "checkpoints"),
                self.step,
                models,
                self._optim_state(),
                state,
                rank_states if self.world > 1 else None,
                keep=self.cfg.save_total_limit,
                export=lambda d: self.export_hf(os.path.join(d, HF_DIR), policy_sd),
                log=self.log,
            )
        if self.world > 1:
            dist.barrier()

    def _optim_state(self) -> dict:
        if self.cfg.fsdp:  # sharded optimizer state is not saved: --fsdp runs do not resume
            return {"optimizer": None, "scheduler": self.sched.state_dict(), "fsdp": True}
        return {"optimizer": self.opt.state_dict(), "scheduler": self.sched.state_dict()}

    def _weights_finite(self) -> bool:
        """Every trained parameter finite (one host read; only when saving; every rank's
        shards under --fsdp)."""
        params = [
            getattr(p, "_local_tensor", p).detach()
            for m in (self.policy, self.critic)
            if m is not None
            for p in m.parameters()
        ]
        ok = torch.stack([torch.isfinite(p).all() for p in params]).all().to(torch.int32)
        if self.cfg.fsdp:
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok)

    def _last_good(self) -> str:
        ckpt = ckpt_io.latest_checkpoint(os.path.join(self.cfg.out, "checkpoints"))
        if ckpt is None:
            return "no checkpoint had been saved yet"
        return f"the last good checkpoint is {ckpt} (continue with --resume {self.cfg.out})"

    # ------------------------------------------------------------------ resume
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
        self._check_export(ckpt)

    def _check_export(self, ckpt: str) -> None:
        """Say what resuming from `ckpt` could not verify: a checkpoint without SHA256SUMS (an
        older fastrl's), or files of its Hugging Face export whose SHA-256 changed (resuming does
        not read them, so the run goes on; the next checkpoint writes a fresh export)."""
        sums = ckpt_io.read_checksums(ckpt)  # parsed fine in load_checkpoint
        if sums is None:
            self.log(f"note: {ckpt} has no {ckpt_io.CHECKSUMS} (an older fastrl's): not verified")
            return
        for e in ckpt_io.verify_checksums(ckpt, sums, [r for r in sorted(sums) if "/" in r]):
            self._warn(f"warning: {e} (an export of the checkpoint resumed from; do not use it)")

    # ------------------------------------------------------------------ stopping for a reward
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
