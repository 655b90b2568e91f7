"""Saving and resuming a run: a checkpoint of the TrainState (with a Hugging Face export `hf/`)
refusing non-finite weights, and --resume's fallback to the newest intact checkpoint. The
checkpoint files themselves (atomic, with SHA256SUMS) are fastrl/train/checkpoint.py's."""

from __future__ import annotations

import hashlib
import os

import torch
import torch.distributed as dist

from . import checkpoint as ckpt_io
from .common import TrainingError, last_good, resume_command
from .config import TrainConfig
from .state import Run, TrainState

HF_DIR = "hf"
"""The Hugging Face model directory inside each checkpoint (save_pretrained of model + tok)."""


def export_hf(policy, tok, path: str, state_dict: dict | None = None) -> None:
    """save_pretrained of `policy` (tied weights kept tied) and its tokenizer into `path`: a
    directory AutoModelForCausalLM.from_pretrained and `fastrl train --model` load
    (`state_dict`: the policy's full weights, for a sharded policy)."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar per checkpoint
    # the configs' dropout rates as loaded (build.disable_dropout zeroed them for the run)
    dropout = getattr(policy, "_fastrl_config_dropout", [])
    try:
        for config, rates in dropout:
            for k, v in rates.items():
                setattr(config, k, v)
        kw = {"state_dict": state_dict} if state_dict is not None else {}
        policy.save_pretrained(path, safe_serialization=True, **kw)
        tok.save_pretrained(path)
    finally:
        for config, rates in dropout:
            for k in rates:
                setattr(config, k, 0.0)
        if bars:
            hf_logging.enable_progress_bar()


# --------------------------------------------------------------------------- save
def save(run: Run, state: TrainState) -> str | None:
    """Checkpoint step `state.step`: the models, optimizer and schedule, every rank's RNGs, and
    the Hugging Face export in its `hf/`. A collective (every rank calls it); rank 0 writes and
    gets the checkpoint's directory, the other ranks None. TrainingError (nothing written) when
    the weights are non-finite."""
    cfg = run.cfg
    if not _weights_finite(cfg, state):
        raise TrainingError(
            f"step {state.step}: the weights are non-finite (NaN / inf) although the loss and "
            f"gradient norms were finite; not saving them; {last_good(cfg.out)}"
        )
    rank_states = [None] * run.world
    if run.world > 1:
        dist.all_gather_object(rank_states, state.rng_state())
    else:
        rank_states = [state.rng_state()]
    models = _full_state_dicts(cfg, state.models())
    policy_sd = models["policy"] if cfg.fsdp else None
    ckpt = None
    if run.rank == 0:
        meta = {"step": state.step, "world": run.world, "config": cfg.to_dict()}
        meta["compute_dtype"] = run.compute_dtype  # what --dtype resolved to (auto: the device)
        meta["data_sha256"] = run.data_sha256  # the task / eval files' contents
        meta["rng"] = rank_states[0]
        ckpt = ckpt_io.save_checkpoint(
            os.path.join(cfg.out, "checkpoints"),
            state.step,
            models,
            _optim_state(cfg, state),
            meta,
            rank_states if run.world > 1 else None,
            keep=cfg.save_total_limit,
            export=lambda d: export_hf(state.policy, run.tok, os.path.join(d, HF_DIR), policy_sd),
            log=run.console.log,
        )
    if run.world > 1:
        dist.barrier()
    return ckpt


def _full_state_dicts(cfg: TrainConfig, models: dict) -> dict:
    """name -> module, or under --fsdp name -> full state dict on the CPU (a collective: every
    rank calls it; rank 0 gets the tensors)."""
    if not cfg.fsdp:
        return models
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return {k: get_model_state_dict(m, options=opts) for k, m in models.items()}


def _optim_state(cfg: TrainConfig, state: TrainState) -> dict:
    if cfg.fsdp:  # sharded optimizer state is not saved: --fsdp runs do not resume
        return {"optimizer": None, "scheduler": state.sched.state_dict(), "fsdp": True}
    return {"optimizer": state.opt.state_dict(), "scheduler": state.sched.state_dict()}


def _weights_finite(cfg: TrainConfig, state: TrainState) -> bool:
    """Every trained parameter finite (one host read; only when saving; every rank's shards
    under --fsdp)."""
    params = [
        getattr(p, "_local_tensor", p).detach()
        for m in (state.policy, state.critic)
        if m is not None
        for p in m.parameters()
    ]
    ok = torch.stack([torch.isfinite(p).all() for p in params]).all().to(torch.int32)
    if cfg.fsdp:
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    return bool(ok)


# --------------------------------------------------------------------------- resume
def resume_candidates(cfg: TrainConfig, log) -> list[str]:
    """The checkpoints of the --resume run, newest first (ValueError when there is none)."""
    root = os.path.join(cfg.resume, "checkpoints")
    candidates, notes = ckpt_io.checkpoint_candidates(root)
    for note in notes:
        log(f"--resume: {note}")
    if not candidates:
        raise ValueError(f"--resume {cfg.resume!r}: no checkpoint in {root}")
    return candidates


def resume(run: Run, state: TrainState, candidates: list[str]) -> None:
    """Load the first checkpoint of `candidates` (newest first) whose files are all intact into
    `state` (models, optimizer, schedule, RNGs, step), saying which file of each skipped one is
    bad; CorruptCheckpoint if none is."""
    log, bad = run.console.log, []
    for ckpt in candidates:
        try:
            _load(run, state, ckpt)
        except ckpt_io.CorruptCheckpoint as e:
            bad.append(str(e))
            log(f"--resume: skipping checkpoint {ckpt}: {e}")
            continue
        if bad:
            log(f"--resume: fell back to {ckpt} (the newest intact checkpoint)")
        return
    raise ckpt_io.CorruptCheckpoint(
        os.path.dirname(candidates[0]),
        "no intact checkpoint to resume from:\n  " + "\n  ".join(bad),
    )


def _load(run: Run, state: TrainState, ckpt: str) -> None:
    """Load checkpoint `ckpt` into `state`; CorruptCheckpoint names a bad file (the state may
    then be partly overwritten: load another checkpoint or give up)."""
    optim_state, meta = ckpt_io.load_checkpoint(ckpt, state.models(), run.device)
    _check_world(run, ckpt, meta)
    _check_data(run, ckpt, meta)
    path = os.path.join(ckpt, "optimizer.pt")
    try:
        state.opt.load_state_dict(optim_state["optimizer"])
        state.sched.load_state_dict(optim_state["scheduler"])
    except Exception as e:  # a state of another shape: not this run's
        raise ckpt_io.CorruptCheckpoint(path, f"{type(e).__name__}: {e}") from e
    # the learning rate of the next step from this run's schedule (its --steps may differ from
    # the checkpoint's: the stored lr is the old schedule's, e.g. 0 at its end)
    sched = state.sched
    for group, base, factor in zip(state.opt.param_groups, sched.base_lrs, sched.lr_lambdas):
        group["lr"] = base * factor(sched.last_epoch)
    sched._last_lr = [group["lr"] for group in state.opt.param_groups]
    for r in range(run.world if run.world > 1 else 0):  # every rank decides alike
        ckpt_io.load_rank_rng(ckpt, r)
    rng = ckpt_io.load_rank_rng(ckpt, run.rank)
    path = os.path.join(ckpt, f"rng_rank{run.rank}.json" if rng else "state.json")
    try:
        elsewhere = state.set_rng_state(rng or meta["rng"])
    except Exception as e:
        raise ckpt_io.CorruptCheckpoint(path, f"bad RNG state ({type(e).__name__}: {e})") from e
    state.step = meta["step"]
    run.console.log(f"resumed from {ckpt} at step {state.step}")
    for name, saved_on in elsewhere.items():
        gen = state.generators()[name]
        gen.manual_seed(_reseed(run.cfg.seed, run.rank, state.step, name))
        run.console.log(
            f"note: the {name} generator of {ckpt} was saved on {saved_on} and this run's is on "
            f"{gen.device.type}; a generator's state does not carry across device types, so it "
            f"starts afresh from a seed of --seed, the rank and the step: the run goes on, but "
            f"draws other samples than one that stayed on {saved_on} would"
        )
    _check_dtype(run, ckpt, meta)
    _check_export(run, ckpt)


def _check_dtype(run: Run, ckpt: str, meta: dict) -> None:
    """Say so when this run computes in another dtype than the run that saved `ckpt` (e.g. a
    bf16 GPU run resumed on the CPU, where --dtype auto is fp32): the run goes on, with other
    rounding; --dtype may be given with --resume to keep the saved one."""
    saved = meta.get("compute_dtype")  # (absent from an older fastrl's checkpoints)
    if saved is None or saved == run.compute_dtype:
        return
    why = f"--dtype auto on {run.device.type}" if run.cfg.dtype == "auto" else "--dtype"
    run.console.log(
        f"note: {ckpt} was trained computing in {saved}; this run computes in "
        f"{run.compute_dtype} ({why}); resume with --dtype {saved} to keep it"
    )


def _reseed(seed: int, rank: int, step: int, name: str) -> int:
    """A 63-bit seed that is a function of its arguments only (two resumes of one checkpoint
    draw alike)."""
    digest = hashlib.sha256(f"fastrl/{name}/{seed}/{rank}/{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _check_world(run: Run, ckpt: str, meta: dict) -> None:
    """ValueError unless `ckpt` was saved by as many processes as this run has: each rank's
    prompts, samples and minibatch order continue from that rank's stored RNGs and its share of
    the task's epochs, which another world size has no way to carry on (its extra ranks would
    all take rank 0's state and draw the same data). Checkpoints without `world` (an older
    fastrl's) hold one rng_rank<r>.json per rank when saved by more than one."""
    saved = meta.get("world")
    if saved is None:
        saved = sum(1 for f in os.listdir(ckpt) if f.startswith("rng_rank")) or 1
    if saved != run.world:
        raise ValueError(
            f"--resume: {ckpt} was saved by a run of {saved} process(es), this one has "
            f"{run.world}; a run resumes only on as many processes as saved it (each rank's "
            f"data and sampling continue from its own state). Continue it with "
            f"`{resume_command(run.cfg.out, saved)}`, or start a new run from its weights with "
            f"--model {os.path.join(ckpt, HF_DIR)}"
        )


def _check_data(run: Run, ckpt: str, meta: dict) -> None:
    """ValueError when a data file the run reads (a .jsonl --task, --eval-file) is not the one
    `ckpt`'s run read: the run would split, shuffle and hold out other lines (held-out lines
    could be trained on, and the evals before and after the resume would score other sets), so
    it could not go on as if uninterrupted. Checkpoints without the record (an older fastrl's)
    are not checked."""
    saved = meta.get("data_sha256")
    if not saved:
        return
    changed = [o for o in saved if run.data_sha256.get(o) != saved[o]]
    if changed:
        cfg = run.cfg
        files = ", ".join(f"{o} {cfg.task if o == '--task' else cfg.eval_file}" for o in changed)
        raise ValueError(
            f"--resume: {files} changed since {ckpt} was saved (SHA-256 of its contents); the run "
            "would split, shuffle and hold out other lines than it trained and evaluated on. "
            "Restore the file to resume, or start a new run from its weights with "
            f"--model {os.path.join(ckpt, HF_DIR)}"
        )


def _check_export(run: Run, ckpt: str) -> None:
    """Say what resuming from `ckpt` could not verify: a checkpoint without SHA256SUMS (an
    older fastrl's), or files of its Hugging Face export whose SHA-256 changed (resuming does
    not read them, so the run goes on; the next checkpoint writes a fresh export)."""
    sums = ckpt_io.read_checksums(ckpt)  # parsed fine in load_checkpoint
    if sums is None:
        older = f"no {ckpt_io.CHECKSUMS} (an older fastrl's)"
        run.console.log(f"note: {ckpt} has {older}: not verified")
        return
    for e in ckpt_io.verify_checksums(ckpt, sums, [r for r in sorted(sums) if "/" in r]):
        run.console.warn(f"warning: {e} (an export of the checkpoint resumed from; do not use it)")
