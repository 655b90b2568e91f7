"""A minimal PPO / GRPO / DAPO trainer with its own rollout loop, on fastrl's losses.

The state is explicit (fastrl/train/state.py): a `Run`, what the run is built from and never
changes (config, ranks, device, task, eval set, reward scorer, tokenizer, loss config), and a
`TrainState`, what training changes and a checkpoint holds (models, optimizer, schedule, RNGs,
step). Each stage is a function of them that takes what it reads and returns what it produces:

    run, state = build(cfg, ...)             fastrl/train/build.py: checks, model, task, RNGs
    setup(run, state)                        warm-up, reference / critic, optimizer; or resume
    loop (`Trainer._steps`), one RL step:
      batch, stats = collect(run, state)     fastrl/train/rollout_phase.py: `batch_size` prompts
                                             (split across ranks) x `group_size` samples with a
                                             KV cache, rewards (failures score 0, are counted
                                             and shown; dapo: overlong shaping, generating until
                                             dynamic sampling has filled the batch), pi_old /
                                             pi_ref log-probs, advantages (fastrl/train/algos.py)
      metrics = update(run, state, batch)    fastrl/train/update.py: `epochs` x `minibatches`
                                             AdamW steps of the fused `fastrl.policy_loss`
      state.step += 1
      record = step_record(run, ...)         fastrl/train/report.py; metrics.jsonl, TensorBoard
      evaluate(run, state.policy, step)      greedy, on the held-out eval set
      save(run, state)                       fastrl/train/saving.py: a checkpoint + HF export

Runs under `torchrun --nproc_per_node N` (gloo on CPU, nccl on GPU), with DDP replicas or, with
`--fsdp`, FSDP2 shards. Each rank samples its own prompts (seed + rank); evaluation is greedy on
a fixed eval set and identical on every rank.

Failing loudly: a non-finite loss, value loss or gradient norm raises `TrainingError` naming the
step before that step is saved; `--resume` falls back from a corrupt checkpoint to the newest
intact one; an `--out` that already holds a run (or cannot be created) is refused before the
model loads, unless `force`; SystemExit / KeyboardInterrupt from the reward function stop the run
with a checkpoint and a `RewardError`.

Interrupts (fastrl/train/signals.py): during the RL steps, SIGINT (Ctrl-C) or SIGTERM lets the
current step finish, saves a checkpoint of it and raises `Interrupted` (every rank stops at the
same step); a second signal, or one before the first RL step, aborts at once (`Aborted`).
"""

from __future__ import annotations

import os
import time
from typing import NoReturn

import torch

from . import algos, rollout_phase, saving
from . import build as building
from . import update as update_phase
from .algos import ValueModel
from .common import Batch, TrainingError, all_ranks
from .config import TrainConfig
from .report import all_zero_hint, run_title, step_record, step_warnings
from .rewards import RewardError
from .rundir import (
    METRICS,
    TENSORBOARD,
    check_out_dir,
    make_out_dir,
    start_run_files,
    tensorboard_purge_step,
)
from .runlog import RunLog, plot_curves, read_metrics
from .signals import Aborted, Interrupted, StopSignals


def _view(part: str, name: str, doc: str) -> property:
    """A read-only attribute of the trainer that is `self.<part>.<name>`."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class Trainer:
    """Build everything from a TrainConfig (validating first), then `train()`.

    `run` and `state` are the run's explicit state; the stage methods (`setup`, `collect`,
    `update`, `evaluate`, `save`, ...) call the stage functions on them."""

    rank = _view("run", "rank", "This process's rank (0 in one process).")
    world = _view("run", "world", "The number of ranks.")
    device = _view("run", "device", "The torch device the run trains on.")
    task = _view("run", "task", "The task (prompts, answers, reward function).")
    eval_set = _view("run", "eval_set", "The held-out eval examples.")
    tok = _view("run", "tok", "The tokenizer.")
    eos = _view("run", "eos", "Token ids that end a completion.")
    pad_id = _view("run", "pad_id", "The padding token id.")
    sft_steps = _view("run", "sft_steps", "Supervised warm-up steps (resolved).")
    loss_cfg = _view("run", "loss_cfg", "The LossConfig of the policy loss.")
    fused_lm_head = _view("run", "fused_lm_head", "LM-head log-probs by the fused linear path.")
    policy = _view("state", "policy", "The policy model (unwrapped).")
    ref = _view("state", "ref", "The frozen reference model, or None.")
    critic = _view("state", "critic", "PPO's value model, or None.")

    def __init__(self, cfg: TrainConfig, log=print):
        cfg.validate()
        self.cfg = cfg
        self._owns_pg = building.init_distributed(cfg)
        self.run, self.state = building.build(cfg, log, self._load_models)
        self.runlog: RunLog | None = None  # metrics.jsonl (+ TensorBoard) while training
        self.last_ckpt = None  # the newest checkpoint this run wrote (its export: model_dir)
        self.first_step = 0  # the step the RL loop of this call started from (after a resume)
        self.steps_run = 0  # RL steps this call ran
        self.wall_time = 0.0  # seconds of RL steps this call
        self._t_start = 0.0  # time.perf_counter() when the RL steps of this call started
        self._signals = StopSignals(self.run.rank, lambda: self.state.step)

    @property
    def step(self) -> int:
        """RL steps finished (`state.step`)."""
        return self.state.step

    @step.setter
    def step(self, value: int) -> None:
        self.state.step = value

    @property
    def log(self):
        """Where rank 0's lines go (a no-op on the other ranks)."""
        return self.run.console.log

    @property
    def model_dir(self) -> str | None:
        """The Hugging Face export of the newest checkpoint this run wrote (rank 0), or None."""
        return os.path.join(self.last_ckpt, saving.HF_DIR) if self.last_ckpt else None

    # ------------------------------------------------------------------ the stages
    def _load_models(self):
        """(model, tokenizer) of the run."""
        return building.load_models(self.cfg)

    def setup(self) -> None:
        """Warm-up (fresh runs), reference / critic copies, optimizer, DDP / FSDP2; or resume."""
        building.setup(self.run, self.state)

    def supervised_warmup(self) -> None:
        rollout_phase.supervised_warmup(self.run, self.state.policy)

    def collect(self) -> tuple[Batch, dict]:
        """One RL step's Batch and its stats (`rollout_phase.collect`)."""
        return rollout_phase.collect(self.run, self.state)

    def update(self, batch: Batch) -> dict:
        """The optimizer steps on `batch`; its metrics (`update.update`)."""
        return update_phase.update(self.run, self.state, batch)

    def evaluate(self) -> float:
        """Greedy eval accuracy of the policy (`rollout_phase.evaluate`)."""
        return rollout_phase.evaluate(self.run, self.state.policy, self.state.step)

    def save(self) -> None:
        """Checkpoint the current step (`saving.save`; TrainingError for non-finite weights)."""
        ckpt = saving.save(self.run, self.state)
        if ckpt is not None:
            self.last_ckpt = ckpt

    def export_hf(self, path: str, state_dict: dict | None = None) -> None:
        saving.export_hf(self.state.policy, self.run.tok, path, state_dict)

    def encode(self, examples) -> list[list[int]]:
        return rollout_phase.encode(self.run, examples)

    def amp(self):
        return self.run.amp()

    def check_out_dir(self) -> None:
        check_out_dir(self.cfg)

    def _ppo_advantages(self, rollout, rewards, old_logp, ref_logp) -> Batch:
        s = self.state
        return algos.ppo_batch(
            s.critic, self.cfg, rollout, rewards, old_logp, ref_logp, self.run.amp
        )

    # ------------------------------------------------------------------ the loop
    def train(self) -> list[dict]:
        """Run (or continue) the whole training; returns the metric records of this call.
        SIGINT / SIGTERM during the RL steps: the step finishes, is saved, and `Interrupted` is
        raised."""
        check_out_dir(self.cfg)
        if self.run.world > 1:  # every rank has checked --out before rank 0 writes into it
            torch.distributed.barrier()
        make_out_dir(self.cfg.out)
        with self._signals.installed():
            return self._train()

    def _train(self) -> list[dict]:
        run, state, cfg = self.run, self.state, self.cfg
        self.setup()
        if run.rank == 0:
            start_run_files(cfg, state.step, run.console.log)
        metrics_path = os.path.join(cfg.out, METRICS)
        tb_dir = os.path.join(cfg.out, TENSORBOARD) if cfg.report_to == "tensorboard" else None
        purge = tensorboard_purge_step(cfg, state.step)
        self.runlog = RunLog(metrics_path, run.rank == 0, tb_dir, purge)
        if state.step == 0:
            acc = self._evaluate_or_stop("eval at step 0")
            self.runlog({"step": 0, "eval_accuracy": acc})
            warm = ", after warm-up" if run.sft_steps else ""
            run.console.log(f"step 0 (before RL{warm}): eval accuracy {acc:.3f}")
        if cfg.progress and run.rank == 0:
            run.console.open_bar(cfg.steps, state.step, run_title(cfg))
        self._t_start = time.perf_counter()
        self.first_step, self.steps_run = state.step, 0
        self._signals.in_loop = True
        plot = False  # curves.png: after the steps, also when they stopped on an error
        try:
            stopped = self._steps()
            plot = True
        except (TrainingError, RewardError):
            plot = True
            raise
        finally:
            self._signals.in_loop = False
            self._signals.finishing = plot  # (a signal now waits for the plot: _signals)
            self.wall_time = time.perf_counter() - self._t_start
            run.console.close_bar()
            self.runlog.close()
            if plot and run.rank == 0:
                try:
                    plot_curves(metrics_path, os.path.join(cfg.out, "curves.png"), run_title(cfg))
                except Exception as e:  # a plot never fails a run
                    run.console.log(f"could not write curves.png: {e}")
        if stopped:  # SIGINT / SIGTERM: the step is finished and saved
            raise Interrupted(stopped, state.step, self.last_ckpt)
        return self.runlog.records

    def _steps(self) -> int:
        """The RL steps of `train`; returns the stop signal they ended for (0: none)."""
        run, state, cfg, t_start = self.run, self.state, self.cfg, self._t_start
        seen = nonzero = stopped = 0  # rewards of this call (all ranks), for the final warning
        while state.step < cfg.steps:
            t0 = time.perf_counter()
            snapshot = state.rng_state() if run.world == 1 else None
            try:  # 1-2. rollout, rewards, shaping / filtering, pi_old / pi_ref, advantages
                batch, stats = self.collect()
            except RewardError as e:
                self._stop_for_reward(e, f"step {state.step + 1}", snapshot)
            t1 = time.perf_counter()
            metrics = self.update(batch)  # 3. TrainingError on a non-finite loss / grad norm
            state.step += 1
            # 4. log, evaluate, save
            rec, tot = step_record(run, state.step, stats, metrics, batch, (t_start, t0, t1))
            step_warnings(run, state.step, tot)
            out_of_time = cfg.max_time > 0 and self._elapsed() >= cfg.max_time
            last = state.step == cfg.steps or out_of_time
            if state.step % cfg.eval_every == 0 or last:
                rec["eval_accuracy"] = self._evaluate_or_stop(f"eval after step {state.step}", rec)
            self.runlog(rec)
            seen, nonzero = seen + int(tot["n"]), nonzero + int(tot["nonzero"])
            self.steps_run += 1
            run.console.show(rec)
            saved = (cfg.save_every and state.step % cfg.save_every == 0) or last
            if saved:
                self.save()
            stopped = 0 if last else self._signals.requested(run.device)
            if stopped:  # SIGINT / SIGTERM: this step was the last one
                if not saved:
                    self.save()
                break
            if out_of_time:
                run.console.warn(f"--max-time {cfg.max_time:g}s reached after step {state.step}")
                break
        if seen and not nonzero:
            run.console.warn(all_zero_hint(cfg, run.sft_steps, seen, self.steps_run))
        return stopped

    def _elapsed(self) -> float:
        """Seconds of RL steps so far, the largest over ranks (every rank stops alike)."""
        since = time.perf_counter() - self._t_start
        return float(all_ranks(since, torch.distributed.ReduceOp.MAX, self.run.device))

    def _evaluate_or_stop(self, where: str, pending: dict | None = None) -> float:
        """`evaluate()`; a RewardError from it stops the run `where` (`pending`: this step's
        record, written first)."""
        try:
            return self.evaluate()
        except RewardError as e:
            if pending is not None:
                self.runlog(pending)
            self._stop_for_reward(e, where)

    def _stop_for_reward(self, e: RewardError, where: str, snapshot=None) -> NoReturn:
        """The reward function asked to stop (or hangs) `where`: checkpoint the last finished
        step (single-process runs; with `snapshot`, RNGs as at that step's end, so that resuming
        repeats the interrupted rollout exactly) and raise."""
        if self.run.world > 1:  # the other ranks may not stop here: no collective save
            note = "distributed run: no checkpoint written here, the last periodic one is kept"
        else:
            if snapshot is not None:
                self.state.set_rng_state(snapshot)
            self.save()
            note = f"checkpoint of step {self.step} saved; continue with --resume {self.cfg.out}"
        raise RewardError(f"{where}: {e}\n({note})", e.exit_code) from e

    def close(self) -> None:
        """Stop the reward worker process, drop the DDP wrappers (first: a DDP reducer that
        outlives its process group can abort the process at exit), close the TensorBoard
        writer, and tear down the process group this trainer created (torchrun runs)."""
        self.run.scorer.close()
        building.release_wrappers(self.state)
        if self.runlog is not None:
            self.runlog.close()
        building.close_distributed(self._owns_pg)
        self._owns_pg = False


def run(cfg: TrainConfig, log=print) -> Trainer:
    """Train with `cfg`; returns the trainer (its `wall_time`, records in cfg.out)."""
    trainer = Trainer(cfg, log=log)
    try:
        trainer.train()
    finally:
        trainer.close()
    return trainer


__all__ = [
    "Aborted",
    "Batch",
    "Interrupted",
    "Trainer",
    "TrainingError",
    "ValueModel",
    "plot_curves",
    "read_metrics",
    "run",
]
