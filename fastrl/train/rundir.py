"""The run directory (--out): refused before anything loads when it already holds a run (unless
--force, or --resume names it) or cannot be created; cleared of an earlier run and given this
run's config.json when training starts."""

from __future__ import annotations

import contextlib
import os
import shutil

from .common import RUN_FILES
from .config import TrainConfig
from .integrity import write_json_atomic
from .runlog import truncate_metrics

METRICS = "metrics.jsonl"
CURVES = "curves.png"
TENSORBOARD = "tensorboard"  # --report-to tensorboard's event files


def check_out_creatable(out: str) -> None:
    """ValueError unless `out` is a writable directory or can be created (its nearest existing
    ancestor is a writable directory)."""
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
        raise ValueError(f"--out {out!r} cannot be created: {parent!r} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {out!r} cannot be created: no permission to write in {parent!r}")


def resumes_in_place(cfg: TrainConfig) -> bool:
    """--resume names --out: the run goes on in its own directory."""
    return bool(cfg.resume) and os.path.abspath(cfg.resume) == os.path.abspath(cfg.out)


def check_out_dir(cfg: TrainConfig) -> None:
    """Refuse (ValueError) an --out that already holds a run, unless `force` or `resume` names
    it."""
    out = cfg.out
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out!r} exists and is not a directory")
    if cfg.force or resumes_in_place(cfg):
        return
    found = [f for f in RUN_FILES if os.path.exists(os.path.join(out, f))]
    ckpts = os.path.join(out, "checkpoints")
    if found and not (os.path.isdir(ckpts) and os.listdir(ckpts)):
        raise ValueError(
            f"--out {out!r} already holds a run that stopped before its first checkpoint "
            f"({', '.join(found)}; nothing to --resume); start over there with --force "
            "(deletes those files) or choose another --out"
        )
    if found:
        raise ValueError(
            f"--out {out!r} already holds a run ({', '.join(found)}); not overwriting it. "
            f"Continue it with --resume {out}, start over there with --force (deletes "
            "those files), or choose another --out"
        )


def make_out_dir(out: str) -> None:
    try:
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--out {out!r} cannot be created: {e.strerror}") from e


def start_run_files(cfg: TrainConfig, step: int, log) -> None:
    """Rank 0, once the run is set up at `step`: remove what an earlier run left in --out
    (--force; a resume in place keeps it), write config.json, and drop the metrics records
    after `step` (a resume rewrites what came after its checkpoint, and a resume at step 0 its
    step-0 eval; its TensorBoard events from there are purged when the writer opens:
    `tensorboard_purge_step`)."""
    if not resumes_in_place(cfg):
        shutil.rmtree(os.path.join(cfg.out, "checkpoints"), ignore_errors=True)
        shutil.rmtree(os.path.join(cfg.out, TENSORBOARD), ignore_errors=True)
        for name in (METRICS, CURVES):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(cfg.out, name))
    write_json_atomic(os.path.join(cfg.out, "config.json"), cfg.to_dict())
    if cfg.resume:
        truncate_metrics(os.path.join(cfg.out, METRICS), _last_kept(step), log)


def _last_kept(step: int) -> int:
    """The last step whose records a run resumed at `step` keeps: `step`, except at step 0,
    whose eval every run starting at step 0 makes (and logs) again."""
    return step if step > 0 else -1


def tensorboard_purge_step(cfg: TrainConfig, step: int) -> int | None:
    """The first step whose TensorBoard events a run resumed at `step` rewrites (SummaryWriter's
    purge_step: the earlier run's events from there on are dropped), None for a fresh run."""
    return _last_kept(step) + 1 if cfg.resume else None
