"""What a run says while it trains: the console (log lines, warnings above the progress bar, the
bar itself), each RL step's metrics record (identical on every rank), and the warnings about a
step's rewards. The files the records go to are fastrl/train/runlog.py's."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from .common import Batch, all_reduce, gather_floats
from .rewards import MAX_ABS_REWARD

if TYPE_CHECKING:
    from .config import TrainConfig
    from .state import Run

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
"""A step's totals summed over ranks (one all-reduce per step), from `collect`'s stats."""


def _silent(*args, **kwargs) -> None:
    pass


class Console:
    """Where a run's lines go. `log`: the log given (rank 0; silent on the other ranks). `warn`:
    a warning line, written above the progress bar while there is one. `report`: a warning of a
    reward failure, which any rank may hit (prefixed with the rank in a distributed run)."""

    def __init__(self, log, rank: int, world: int):
        self.any_rank = log
        self.log = log if rank == 0 else _silent
        self.prefix = f"[rank {rank}] " if world > 1 else ""
        self.bar = None  # the tqdm bar while training
        self.last_eval = None  # the latest eval accuracy, shown on the bar (str)

    def warn(self, text: str, any_rank: bool = False) -> None:
        log = self.any_rank if any_rank else self.log
        if self.bar is not None and log is print:
            self.bar.write(text)
        else:
            log(text)

    def report(self, text: str) -> None:
        self.warn(f"{self.prefix}warning: {text}", any_rank=True)

    def open_bar(self, total: int, initial: int, title: str) -> None:
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=initial, desc=title, dynamic_ncols=True)

    def show(self, rec: dict) -> None:
        """Advance the progress bar (if any) by one step, showing `rec`'s main metrics."""
        if self.bar is None:
            return
        self.bar.update(1)
        if "eval_accuracy" in rec:
            self.last_eval = f"{rec['eval_accuracy']:.2f}"
        # the latest eval first: the bar fits the terminal, and its end is what gets cut
        post = {} if self.last_eval is None else {"eval": self.last_eval}
        post["reward"] = f"{rec['reward_mean']:.3f}"
        if "entropy" in rec:  # absent on a step that trained no token
            post["kl" if "kl" in rec else "approx_kl"] = f"{rec.get('kl', rec['approx_kl']):.4f}"
            post["entropy"] = f"{rec['entropy']:.3f}"
        self.bar.set_postfix(post)

    def close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
        self.bar = None


def step_record(
    run: Run, step: int, stats: dict, metrics: dict, batch: Batch, times: tuple[float, ...]
) -> tuple[dict, dict]:
    """Step `step`'s metrics record (identical on every rank) and its totals summed over ranks.

    Reads `stats` (collect's counts, rewards, generation and reward times), `metrics` (update's),
    `batch` (the advantages of its counted rows) and `times` = (loop start, step start, update
    start) from time.perf_counter(); one all-reduce and two gathers."""
    t_start, t0, t1 = times
    vals = torch.tensor([float(stats[k]) for k in TOTALS], dtype=torch.float64)
    tot = dict(zip(TOTALS, all_reduce(vals.to(run.device)).tolist()))
    n, dt = max(tot["n"], 1.0), time.perf_counter() - t0
    rewards = np.asarray(gather_floats(stats["rewards"]), dtype=np.float64)
    mask = batch.rollout.completion_mask
    adv = batch.advantages
    counted = (mask > 0) if adv.dim() == 2 else (mask.sum(1) > 0)
    advs = np.asarray(gather_floats(adv[counted].float().cpu().tolist()), dtype=np.float64)
    rec = {
        "step": step,
        "reward_mean": tot["reward_sum"] / n,
        "reward_std": float(rewards.std(ddof=1)) if len(rewards) > 1 else 0.0,
        "success_rate": tot["success"] / n,
        "adv_std": float(advs.std(ddof=1)) if len(advs) > 1 else 0.0,
        **metrics,
        "response_len": tot["len_sum"] / n,
        "truncated_frac": tot["truncated"] / n,
        "reward_errors": int(tot["errors"]),
        "reward_timeouts": int(tot["timeouts"]),
        "sampler_logp_gap": stats["sampler_gap"],
        "gen_time_s": stats["gen_time"],
        "reward_time_s": stats["reward_time"],
        "update_time_s": time.perf_counter() - t1,
        "tokens_per_s": tot["tokens"] / dt,
        "step_time_s": dt,
        "elapsed_s": time.perf_counter() - t_start,  # RL wall time of this call so far
    }
    if run.cfg.algo == "dapo":
        rec["gen_batches"] = tot["gen_batches"] / run.world
        rec["kept_groups"] = int(tot["kept_groups"])
        rec["batch_full"] = bool(tot["kept_groups"] >= run.cfg.batch_size)
    return rec, tot


def step_warnings(run: Run, step: int, tot: dict) -> None:
    """Warning lines for step `step`'s reward failures, an all-zero reward batch and a DAPO
    batch that dynamic sampling could not fill (`tot`: the step's totals over ranks)."""
    cfg, warn = run.cfg, run.console.warn
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
                ("timeouts", f"ran past --reward-timeout {cfg.reward_timeout:g}s"),
            )
            if tot[k]
        ]
        warn(
            f"warning: step {step}: {failed} of {n} reward calls failed and scored 0 "
            f"({', '.join(kinds)})"
        )
    if n and not tot["nonzero"]:
        warn(f"warning: step {step}: every reward is 0 ({n} samples)")
    if cfg.algo == "dapo" and tot["kept_groups"] < cfg.batch_size:
        warn(
            f"warning: step {step}: dynamic sampling kept {int(tot['kept_groups'])} of "
            f"{cfg.batch_size} groups after {int(tot['gen_batches'] / run.world)} "
            "generation batches; training on a partially filled batch (groups whose rewards "
            "are all equal carry no signal: raise --max-gen-batches, or check the reward)"
        )


def all_zero_hint(cfg: TrainConfig, sft_steps: int, seen: int, steps: int) -> str:
    """The warning of a run whose every reward was 0 (`seen` samples over `steps` steps), with
    what to try."""
    text = (
        f"warning: every reward of this run was 0 ({seen} samples over {steps} "
        f"step{'s' if steps > 1 else ''}): RL had no learning signal; check --task / "
        "--reward (and the reward errors above, if any)"
    )
    if sft_steps == 0:
        what = (
            "the embedded model is random-init and had no warm-up"
            if cfg.model is None
            else "a model that never produces a right answer (e.g. a random-init one)"
        )
        text += (
            f"; {what}: give it a supervised warm-up on the task first with --sft-steps N "
            "(the embedded default uses 1000)"
        )
    return text


def run_title(cfg: TrainConfig) -> str:
    """What the progress bar and curves.png are titled."""
    return (
        f"{cfg.algo} (loss {cfg.loss or cfg.algo}) on {os.path.basename(cfg.model or 'embedded')}"
    )
