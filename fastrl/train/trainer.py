"""A minimal PPO / GRPO / DAPO trainer with its own rollout loop, on fastrl's losses.

One RL step (`Trainer._loop`, top to bottom):
1. rollout and scoring (fastrl/train/rollout_phase.py): `batch_size` prompts (split across
   ranks) x `group_size` samples with a KV cache, rewards from the task's reward function
   (`fastrl.train.rewards.RewardScorer`: failures score 0, are counted and shown); dapo adds the
   overlong shaping and keeps generating until dynamic sampling has filled the batch or
   `max_gen_batches` is reached; then pi_old (and pi_ref when the loss has a KL term, or ppo's
   KL shaping) log-probs, one no-grad forward each;
2. advantages (fastrl/train/algos.py, every per-algorithm difference in one place): group
   advantages (grpo, dapo) or GAE with a critic, whitened over all ranks (ppo);
3. update (fastrl/train/update.py): `epochs` x `minibatches` AdamW steps of the fused
   `fastrl.policy_loss` (the `--loss` preset), `grad_accum` micro-batches each;
4. log (metrics.jsonl, TensorBoard), evaluate (greedy, held out), checkpoint (with a Hugging Face
   export) — fastrl/train/runlog.py, fastrl/train/state.py.

Runs under `torchrun --nproc_per_node N` (gloo on CPU, nccl on GPU), with DDP replicas or, with
`--fsdp`, FSDP2 shards. Each rank samples its own prompts (seed + rank); evaluation is greedy on
a fixed eval set and identical on every rank.

Failing loudly: a non-finite loss, value loss or gradient norm raises `TrainingError` naming the
step before that step is saved; `--resume` falls back from a corrupt checkpoint to the newest
intact one; an `--out` that already holds a run (or cannot be created) is refused before the
model loads, unless `force`; SystemExit / KeyboardInterrupt from the reward function stop the run
with a checkpoint and a `RewardError`.

Interrupts: during the RL steps, SIGINT (Ctrl-C) or SIGTERM lets the current step finish, saves a
checkpoint of it and raises `Interrupted` (every rank stops at the same step); a second signal, or
one before the first RL step, aborts at once (`Aborted`, a KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import copy
import os
import random
import shutil
import signal
import threading
import time

import numpy as np
import torch

from . import checkpoint as ckpt_io
from .algos import ValueModel
from .build import BuildMixin
from .common import Batch, TrainingError, all_reduce, gather_floats, rank_world
from .config import TrainConfig
from .rewards import MAX_ABS_REWARD, RewardError, RewardScorer
from .rollout import eos_ids, lm_head_fusable
from .rollout_phase import RolloutMixin
from .runlog import RunLog, plot_curves, read_metrics, tensorboard_writer_class
from .runlog import truncate_metrics as _truncate_metrics
from .state import HF_DIR, StateMixin
from .tasks import get_task
from .update import UpdateMixin

# step totals summed over ranks (one all-reduce per step)
TOTALS = (
    "reward_sum",
    "success",
    "n",
    "errors",
    "tokens",
    "len_sum",
    "truncated",
    "gen_batches",
    "kept_groups",
    "raised",
    "invalid",
    "timeouts",
    "nonzero",
)


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""Signals that stop a run after the current step, with a checkpoint."""

REPEAT_WINDOW_S = 1.0
"""A second stop signal within this many seconds of the first is the same interrupt delivered
twice (the terminal and torchrun both forward Ctrl-C), not a request to abort."""


class Interrupted(Exception):
    """SIGINT / SIGTERM stopped the run after finishing step `step`, which is saved in
    `checkpoint` (None on ranks other than 0). `exit_code` is 128 + the signal number (130 for
    SIGINT, 143 for SIGTERM), what `fastrl train` exits with."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum
        super().__init__(
            f"{signal.Signals(signum).name}: stopped after step {step} (checkpoint {checkpoint})"
        )


class Aborted(KeyboardInterrupt):
    """A stop signal that could not wait for the step to finish: a second one, or one before
    the first RL step (warm-up, setup, step-0 eval). Nothing more is saved; `exit_code` is
    128 + the signal number."""

    def __init__(self, signum: int, where: str):
        self.signum, self.exit_code, self.where = signum, 128 + signum, where
        super().__init__(f"{signal.Signals(signum).name} {where}")


class Trainer(BuildMixin, RolloutMixin, UpdateMixin, StateMixin):
    """Build everything from a TrainConfig (validating first), then `train()`."""

    def __init__(self, cfg: TrainConfig, log=print):
        cfg.validate()
        self.cfg, self.log = cfg, log
        self._init_distributed()
        self.rank, self.world = rank_world()
        if self.rank != 0:
            self.log = lambda *a, **k: None
        self._bar = None  # the tqdm bar while training (warnings are written above it)
        prefix = f"[rank {self.rank}] " if self.world > 1 else ""  # reward failures: any rank
        self._report = lambda text: self._warn(f"{prefix}warning: {text}", any_rank=log)
        if cfg.batch_size % self.world:
            raise ValueError(
                f"--batch-size={cfg.batch_size} must be divisible by the number of ranks "
                f"({self.world})"
            )
        if cfg.fsdp and self.world == 1:
            raise ValueError("--fsdp shards over torchrun ranks: run it under torchrun")
        if cfg.fsdp and cfg.resume:
            raise ValueError(
                "--resume of an --fsdp run is not supported: its checkpoints hold the full "
                "weights and the Hugging Face export, not the sharded optimizer state (start a "
                "new run with --model OUT/checkpoints/step-N/hf)"
            )
        if cfg.report_to == "tensorboard":
            tensorboard_writer_class()  # a clear error now, not after the warm-up
        self._check_out_creatable()  # --out: checked before anything is loaded
        self.check_out_dir()
        self.device = self._pick_device(cfg.device)
        self.compute_dtype = (
            ("bf16" if self.device.type == "cuda" else "fp32") if cfg.dtype == "auto" else cfg.dtype
        )
        self.task = get_task(cfg.task, cfg.reward)  # raises on unknown task / bad JSONL
        self.eval_set = self._eval_examples()  # held-out lines leave the training set here
        self.scorer = RewardScorer(self.task.reward_fn, cfg.reward_timeout, report=self._report)
        random.seed(cfg.seed)
        np.random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        model, self.tok = self._load_models()
        self.eos = eos_ids(self.tok, model)
        self.pad_id = self.tok.pad_token_id
        self.policy = model.to(self.device)
        if self.device.type == "cpu":
            torch.set_num_threads(cfg.num_threads or self._auto_threads())
        self.loss_cfg = self._loss_config()
        self.use_ref = self.loss_cfg.kl_coef > 0 or (cfg.algo == "ppo" and bool(cfg.kl_coef))
        # RNGs that the run consumes (all saved in checkpoints)
        self.task_rng = random.Random(cfg.seed * 1_000_003 + self.rank)
        self.sample_gen = torch.Generator(device=self.device).manual_seed(
            cfg.seed + 7919 * self.rank
        )
        self.shuffle_gen = torch.Generator().manual_seed(cfg.seed + 104729 * (self.rank + 1))
        self.ref = self.critic = self.runlog = None
        self.last_ckpt = None  # the newest checkpoint this run wrote (its export: model_dir)
        self.grad_scale = self.world  # DDP and FSDP2 average gradients; the loss is a sum
        # --fsdp: LM-head log-probs from the last hidden states through fastrl's fused linear
        # path on the (FSDP-gathered) head weight, never the (n, T, V) logits
        self.fused_lm_head = cfg.fsdp and lm_head_fusable(self.policy, cfg.top_k, cfg.top_p)
        self.step = 0
        self.first_step = 0  # the step the RL loop of this call started from (after a resume)
        self.steps_run = 0  # RL steps this call ran
        self.wall_time = 0.0
        self._in_loop = False  # a stop signal then waits for the step to finish
        self._signal = self._signal_time = None  # the first stop signal received

    def _check_out_creatable(self) -> None:
        """ValueError unless --out is a writable directory or can be created (its nearest
        existing ancestor is a writable directory)."""
        out = self.cfg.out
        path = os.path.abspath(out)
        if os.path.exists(path):
            if not os.path.isdir(path):
                raise ValueError(f"--out {out!r} exists and is not a directory")
            if not os.access(path, os.W_OK | os.X_OK):
                raise ValueError(f"--out {out!r} is not writable (no permission to write in it)")
            return
        parent = os.path.dirname(path)
        while not os.path.exists(parent):
            parent = os.path.dirname(parent)
        if not os.path.isdir(parent):
            raise ValueError(
                f"--out {out!r} cannot be created: {parent!r} is a file, not a directory"
            )
        if not os.access(parent, os.W_OK | os.X_OK):
            raise ValueError(
                f"--out {out!r} cannot be created: no permission to write in {parent!r}"
            )

    def setup(self):
        """Warm-up (fresh runs), reference / critic copies, optimizer, DDP / FSDP2; or resume."""
        cfg = self.cfg
        candidates = []
        if cfg.resume:
            root = os.path.join(cfg.resume, "checkpoints")
            candidates, notes = ckpt_io.checkpoint_candidates(root)
            for note in notes:
                self.log(f"--resume: {note}")
            if not candidates:
                raise ValueError(f"--resume {cfg.resume!r}: no checkpoint in {root}")
        elif self.sft_steps > 0:
            self.supervised_warmup()
        if self.use_ref:
            self.ref = copy.deepcopy(self.policy).eval().requires_grad_(False)
        if cfg.algo == "ppo":
            self.critic = ValueModel(self.policy).to(self.device)
        if cfg.gradient_checkpointing:
            for m in (self.policy, self.critic.backbone if self.critic is not None else None):
                if m is not None:
                    kw = {"use_reentrant": False}
                    if hasattr(m, "activation_checkpointing_enable"):  # newer transformers
                        m.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
                    else:
                        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)
        if cfg.fsdp:
            self._shard()
        self._build_optim()
        if candidates:
            self._load_newest_intact(candidates)
        self._wrap()

    # ------------------------------------------------------------------ main loop
    def train(self) -> list[dict]:
        """Run (or continue) the whole training; returns the metric records of this call.
        SIGINT / SIGTERM during the RL steps: the step finishes, is saved, and `Interrupted` is
        raised; see `_stop_signals`."""
        cfg = self.cfg
        self.check_out_dir()
        if self.world > 1:  # every rank has checked --out before rank 0 writes into it
            torch.distributed.barrier()
        try:
            os.makedirs(cfg.out, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--out {cfg.out!r} cannot be created: {e.strerror}") from e
        with self._stop_signals():
            return self._train()

    def _train(self) -> list[dict]:
        cfg = self.cfg
        is_main = self.rank == 0
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
        tb_dir = os.path.join(cfg.out, "tensorboard") if cfg.report_to == "tensorboard" else None
        self.runlog = emit = RunLog(metrics_path, is_main, tb_dir)
        if self.step == 0:
            try:
                acc = self.evaluate()
            except RewardError as e:
                self._stop_for_reward(e, "eval at step 0")
            emit({"step": 0, "eval_accuracy": acc})
            warm = ", after warm-up" if self.sft_steps else ""
            self.log(f"step 0 (before RL{warm}): eval accuracy {acc:.3f}")
        if cfg.progress and is_main:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=cfg.steps, initial=self.step, desc=self._title(), ncols=110)
        try:
            self._loop(emit)
        finally:
            if self._bar is not None:
                self._bar.close()
            self._bar = None
            emit.close()
        if is_main:
            try:
                plot_curves(metrics_path, os.path.join(cfg.out, "curves.png"), self._title())
            except Exception as e:  # a plot never fails a run
                self.log(f"could not write curves.png: {e}")
        if self._stopped:  # SIGINT / SIGTERM: the step is finished and saved
            raise Interrupted(self._stopped, self.step, self.last_ckpt)
        return emit.records

    # ------------------------------------------------------------------ SIGINT / SIGTERM
    @contextlib.contextmanager
    def _stop_signals(self):
        """SIGINT / SIGTERM handlers while `train` runs (main thread only; the previous
        handlers come back afterwards): in the RL loop the first signal asks the loop to stop
        after the current step (`_stop_requested`); a second one, or one outside the loop,
        raises Aborted at once."""
        self._signal = self._signal_time = None
        self._stopped = 0  # the stop signal the loop stopped for (every rank alike)
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, frame):
            now = time.monotonic()
            if self._signal is not None and now - self._signal_time < REPEAT_WINDOW_S:
                return  # the same interrupt, delivered twice
            if self._signal is not None or not self._in_loop:
                where = f"in step {self.step + 1}" if self._in_loop else "before the RL steps"
                raise Aborted(signum, where)
            self._signal, self._signal_time = signum, now
            if self.rank == 0:  # os.write: never re-enters a Python stream being written
                again = "press Ctrl-C again" if signum == signal.SIGINT else "send it again"
                os.write(
                    2,
                    f"\n{signal.Signals(signum).name} received: finishing the current step, "
                    f"then saving a checkpoint and stopping ({again} to abort at once)\n".encode(),
                )

        previous = {s: signal.signal(s, handler) for s in STOP_SIGNALS}
        try:
            yield
        finally:
            for s, h in previous.items():
                if h is not None:  # None: a handler not installed from Python; leave ours
                    signal.signal(s, h)

    def _stop_requested(self) -> int:
        """The stop signal received by any rank (0: none); every rank gets the same answer."""
        sig = self._signal or 0
        if self.world > 1:
            t = torch.tensor([sig], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
            sig = int(t.item())
        return sig

    @property
    def model_dir(self) -> str | None:
        """The Hugging Face export of the newest checkpoint this run wrote (rank 0), or None."""
        return os.path.join(self.last_ckpt, HF_DIR) if self.last_ckpt else None

    def _title(self) -> str:
        return (
            f"{self.cfg.algo} (loss {self.cfg.loss or self.cfg.algo}) on "
            f"{os.path.basename(self.cfg.model or 'embedded')}"
        )

    def _loop(self, emit) -> None:
        """The RL steps of `train` (records through `emit`)."""
        t_start = self._t_start = time.perf_counter()
        self.first_step, self.steps_run = self.step, 0
        self._in_loop = True
        try:
            self._steps(emit, t_start)
        finally:
            self._in_loop = False
            self.wall_time = time.perf_counter() - t_start

    def _steps(self, emit, t_start: float) -> None:
        cfg = self.cfg
        seen = nonzero = steps = 0  # rewards of this call (all ranks), for the final warning
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            snapshot = self._rng_snapshot() if self.world == 1 else None
            try:  # 1-2. rollout, rewards, shaping / filtering, pi_old / pi_ref, advantages
                batch, st = self.collect()
            except RewardError as e:
                self._stop_for_reward(e, f"step {self.step + 1}", snapshot)
            t1 = time.perf_counter()
            upd = self.update(batch)  # 3. raises TrainingError on a non-finite loss / grad norm
            self.step += 1
            rec, tot = self._record(st, upd, batch, t0, t1)  # 4. log, evaluate, save
            self._step_warnings(tot)
            out_of_time = cfg.max_time > 0 and self._elapsed_max(t_start) >= cfg.max_time
            last = self.step == cfg.steps or out_of_time
            if self.step % cfg.eval_every == 0 or last:
                try:
                    rec["eval_accuracy"] = self.evaluate()
                except RewardError as e:
                    emit(rec)
                    self._stop_for_reward(e, f"eval after step {self.step}")
            emit(rec)
            seen, nonzero, steps = seen + int(tot["n"]), nonzero + int(tot["nonzero"]), steps + 1
            self.steps_run = steps
            self._show(rec)
            saved = (cfg.save_every and self.step % cfg.save_every == 0) or last
            if saved:
                self.save()
            stop = 0 if last else self._stop_requested()
            if stop:  # SIGINT / SIGTERM: this step was the last one
                if not saved:
                    self.save()
                self._stopped = stop
                break
            if out_of_time:
                self._warn(f"--max-time {cfg.max_time:g}s reached after step {self.step}")
                break
        if seen and not nonzero:
            self._warn(self._all_zero_hint(seen, steps))

    def _all_zero_hint(self, seen: int, steps: int) -> str:
        """The warning of a run whose every reward was 0, with what to try."""
        text = (
            f"warning: every reward of this run was 0 ({seen} samples over {steps} "
            f"step{'s' if steps > 1 else ''}): RL had no learning signal; check --task / "
            "--reward (and the reward errors above, if any)"
        )
        if self.sft_steps == 0:
            what = (
                "the embedded model is random-init and had no warm-up"
                if self.cfg.model is None
                else "a model that never produces a right answer (e.g. a random-init one)"
            )
            text += (
                f"; {what}: give it a supervised warm-up on the task first with --sft-steps N "
                "(the embedded default uses 1000)"
            )
        return text

    def _elapsed_max(self, t_start: float) -> float:
        """Seconds since `t_start`, the largest over ranks (every rank stops alike)."""
        t = torch.tensor([time.perf_counter() - t_start], dtype=torch.float64, device=self.device)
        if self.world > 1:
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return float(t.item())

    def _record(self, st: dict, upd: dict, batch: Batch, t0: float, t1: float):
        """This step's metrics record (identical on every rank) and its summed totals."""
        vals = torch.tensor([float(st[k]) for k in TOTALS], dtype=torch.float64)
        tot = dict(zip(TOTALS, all_reduce(vals.to(self.device)).tolist()))
        n, dt = max(tot["n"], 1.0), time.perf_counter() - t0
        rewards = np.asarray(gather_floats(st["rewards"]), dtype=np.float64)
        mask = batch.rollout.completion_mask
        adv = batch.advantages
        counted = (mask > 0) if adv.dim() == 2 else (mask.sum(1) > 0)
        advs = np.asarray(gather_floats(adv[counted].float().cpu().tolist()), dtype=np.float64)
        rec = {
            "step": self.step,
            "reward_mean": tot["reward_sum"] / n,
            "reward_std": float(rewards.std(ddof=1)) if len(rewards) > 1 else 0.0,
            "success_rate": tot["success"] / n,
            "adv_std": float(advs.std(ddof=1)) if len(advs) > 1 else 0.0,
            **upd,
            "response_len": tot["len_sum"] / n,
            "truncated_frac": tot["truncated"] / n,
            "reward_errors": int(tot["errors"]),
            "reward_timeouts": int(tot["timeouts"]),
            "sampler_logp_gap": st["sampler_gap"],
            "gen_time_s": st["gen_time"],
            "reward_time_s": st["reward_time"],
            "update_time_s": time.perf_counter() - t1,
            "tokens_per_s": tot["tokens"] / dt,
            "step_time_s": dt,
            "elapsed_s": time.perf_counter() - self._t_start,  # RL wall time of this call so far
        }
        if self.cfg.algo == "dapo":
            rec["gen_batches"] = tot["gen_batches"] / self.world
            rec["kept_groups"] = int(tot["kept_groups"])
            rec["batch_full"] = bool(tot["kept_groups"] >= self.cfg.batch_size)
        return rec, tot

    def _show(self, rec: dict) -> None:
        if self._bar is None:
            return
        self._bar.update(1)
        post = {"reward": f"{rec['reward_mean']:.3f}", "entropy": f"{rec['entropy']:.3f}"}
        post["kl" if "kl" in rec else "approx_kl"] = f"{rec.get('kl', rec['approx_kl']):.4f}"
        if "eval_accuracy" in rec:
            post["eval"] = f"{rec['eval_accuracy']:.2f}"
        self._bar.set_postfix(post)

    def _warn(self, text: str, any_rank=None) -> None:
        """A warning line: above the progress bar when there is one, else through the log
        (`any_rank`: the log to use on every rank, not only rank 0)."""
        log = any_rank or self.log
        if self._bar is not None and log is print:
            self._bar.write(text)
        else:
            log(text)

    def _step_warnings(self, tot: dict) -> None:
        """Warning lines for this step's reward failures, an all-zero reward batch and a DAPO
        batch that dynamic sampling could not fill."""
        n, failed = int(tot["n"]), int(tot["errors"])
        if failed:
            kinds = [
                f"{int(tot[k])} {what}"
                for k, what in (
                    ("raised", "raised"),
                    (
                        "invalid",
                        f"returned a non-number, non-finite or |r| > {MAX_ABS_REWARD:g} value",
                    ),
                    ("timeouts", f"ran past --reward-timeout {self.cfg.reward_timeout:g}s"),
                )
                if tot[k]
            ]
            self._warn(
                f"warning: step {self.step}: {failed} of {n} reward calls failed and scored 0 "
                f"({', '.join(kinds)})"
            )
        if n and not tot["nonzero"]:
            self._warn(f"warning: step {self.step}: every reward is 0 ({n} samples)")
        if self.cfg.algo == "dapo" and tot["kept_groups"] < self.cfg.batch_size:
            self._warn(
                f"warning: step {self.step}: dynamic sampling kept {int(tot['kept_groups'])} of "
                f"{self.cfg.batch_size} groups after {int(tot['gen_batches'] / self.world)} "
                "generation batches; training on a partially filled batch (groups whose rewards "
                "are all equal carry no signal: raise --max-gen-batches, or check the reward)"
            )


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
