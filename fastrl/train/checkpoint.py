"""Atomic checkpoints: `DIR/checkpoints/step-NNNNNN/` holds safetensors weights, the optimizer
state (torch.save) and a JSON state (step, RNG states, config); `DIR/checkpoints/latest` names
the newest complete one.

Every checkpoint is written into a temporary directory, each file fsync'ed, then renamed into
place; only then is `latest` replaced (temp file + fsync + os.replace). A save interrupted at any
point leaves the previous checkpoint and the `latest` pointer intact. Files and directories get
the permissions of the process's umask (as `open` and `save_pretrained` give them), not the
owner-only ones of the temporary files they start as. Each checkpoint lists the SHA-256 of every
file in it in `SHA256SUMS`. The file-level pieces (atomic writes, umask, SHA256SUMS) are in
fastrl/train/integrity.py.

Loading checks what it reads: `load_checkpoint` raises `CorruptCheckpoint` naming the file when
one is missing, truncated, not parseable, holds non-finite weights / optimizer state, or no
longer has the SHA-256 it was saved with (a same-size corruption that parses: zeroed blocks,
flipped bits), and `checkpoint_candidates` lists every checkpoint newest first, so that a resume
can fall back to the newest intact one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable

import numpy as np
import torch

from .integrity import (
    CHECKSUMS,
    CorruptCheckpoint,
    apply_umask,
    current_umask,
    fsync_dir,
    fsync_file,
    read_checksums,
    read_json,
    verify_checksums,
    write_checksums,
    write_json_atomic,
)

LATEST = "latest"


# --------------------------------------------------------------------------- RNG states
def rng_state(extra_generators: dict[str, torch.Generator], pyrngs: dict[str, random.Random]):
    """Every RNG state as a JSON-able dict: torch (CPU and CUDA), python, numpy, and the given
    torch.Generators and random.Random instances."""
    np_state = np.random.get_state()
    state = {
        "torch": torch.get_rng_state().tolist(),
        "python": _py_state(random.getstate()),
        "numpy": [np_state[0], np_state[1].tolist(), *[float(x) for x in np_state[2:]]],
        "generators": {k: g.get_state().tolist() for k, g in extra_generators.items()},
        "generator_devices": {k: g.device.type for k, g in extra_generators.items()},
        "pyrngs": {k: _py_state(r.getstate()) for k, r in pyrngs.items()},
    }
    if torch.cuda.is_available():
        state["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return state


def _py_state(s):
    return [s[0], list(s[1]), s[2]]


def _py_unstate(s):
    return (s[0], tuple(s[1]), s[2])


def set_rng_state(
    state, extra_generators: dict[str, torch.Generator], pyrngs: dict[str, random.Random]
) -> dict[str, str]:
    """Restore what `rng_state` saved. A generator's state holds only on its own device type
    (a CPU generator keeps a Mersenne Twister, a CUDA one a Philox seed and offset): those of
    `extra_generators` saved on another device type are left as they are and returned, name ->
    the device type they were saved on, for the caller to reseed."""
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    random.setstate(_py_unstate(state["python"]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), int(n[2]), int(n[3]), n[4]))
    elsewhere = {}
    for k, g in extra_generators.items():
        saved = state["generators"][k]
        device = state.get("generator_devices", {}).get(k) or _state_device(saved)
        if device != g.device.type:
            elsewhere[k] = device
            continue
        g.set_state(torch.tensor(saved, dtype=torch.uint8))
    for k, r in pyrngs.items():
        r.setstate(_py_unstate(state["pyrngs"][k]))
    if "cuda" in state and torch.cuda.is_available():
        # one state per device of the run that saved it: as many as this process sees (a run
        # resumed with fewer devices visible raised IndexError: "bad RNG state" everywhere)
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(torch.tensor(s, dtype=torch.uint8), i)
    return elsewhere


_CPU_STATE_BYTES = torch.Generator().get_state().numel()  # 5056: the Mersenne Twister's


def _state_device(saved: list) -> str:
    """The device type of a saved generator state from a checkpoint that does not record it
    (an older fastrl's): a CPU generator's state has a fixed size, an accelerator's does not."""
    return "cpu" if len(saved) == _CPU_STATE_BYTES else "cuda"


# --------------------------------------------------------------------------- checksums
# --------------------------------------------------------------------------- save / load
def save_checkpoint(
    root: str,
    step: int,
    models: dict,
    optim_state: dict,
    state: dict,
    rank_states: list[dict] | None = None,
    keep: int | None = 2,
    export=None,
    log: Callable[[str], None] | None = None,
) -> str:
    """Write checkpoint `step` under `root` atomically; return its directory.

    models: name -> nn.Module or a full state dict (weights saved as NAME.safetensors; tensors
    that share memory, i.e. tied weights, are written once per state dict for a module, and
    copied for a state dict); optim_state: anything
    torch.save can write (optimizer + scheduler); state: JSON (step, config, RNG of rank 0);
    rank_states: one JSON RNG state per rank (distributed runs); export: a callable that writes
    more files into the directory it is given (the checkpoint's, before it is complete: the
    Hugging Face export `hf/`), so they are part of the atomic rename. Every file's SHA-256 goes
    into SHA256SUMS, and modes follow the umask (see the module docstring).

    keep: how many checkpoints of this run to keep, the new one included (None or 0: all); older
    ones (lower steps) are deleted after the new one is complete, each named through `log`.
    Directories of higher steps (left by a run that a resume fell back from) are not counted
    and are replaced when the run reaches their step."""
    from safetensors.torch import save_file, save_model

    umask = current_umask()
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{step:06d}")
    tmp = tempfile.mkdtemp(dir=root, prefix=".tmp-step-")
    try:
        for name, model in models.items():
            path = os.path.join(tmp, f"{name}.safetensors")
            if isinstance(model, dict):  # a full state dict (FSDP2): copies of shared tensors
                seen, sd = set(), {}
                for k, v in model.items():
                    key = (v.data_ptr(), v.dtype, tuple(v.shape))
                    sd[k] = v.clone() if key in seen else v.contiguous()
                    seen.add(key)
                save_file(sd, path)
            else:
                save_model(model, path)
            fsync_file(path)
        path = os.path.join(tmp, "optimizer.pt")
        torch.save(optim_state, path)
        fsync_file(path)
        for r, rs in enumerate(rank_states or []):
            path = os.path.join(tmp, f"rng_rank{r}.json")
            with open(path, "w") as f:
                json.dump(rs, f)
            fsync_file(path)
        if export is not None:
            export(tmp)
        path = os.path.join(tmp, "state.json")
        with open(path, "w") as f:
            json.dump({**state, "checksums": CHECKSUMS}, f)
        fsync_file(path)
        write_checksums(tmp)
        apply_umask(tmp, umask)
        fsync_dir(tmp)
        if os.path.exists(final):  # a re-save of the same step: move the old one aside first
            old = final + ".old"
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            os.replace(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, final)
        fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    write_json_atomic(os.path.join(root, LATEST), {"step": step, "dir": os.path.basename(final)})
    if keep:  # prune the oldest complete checkpoints before this one
        older = [d for d in _step_dirs(root) if _step_number(d) < step]
        for d in older[: max(0, len(older) - (keep - 1))]:
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
            if log is not None:
                log(
                    f"removed checkpoint {os.path.join(root, d)} (keeping the newest {keep}: "
                    "--save-total-limit)"
                )
    return final


def _step_number(name: str) -> int:
    """The step of a `step-NNNNNN` directory name (a huge number for any other name, so that
    pruning never picks it)."""
    try:
        return int(name[len("step-") :])
    except ValueError:
        return 2**63


def _step_dirs(root: str) -> list[str]:
    """Names of the finished checkpoint directories under `root`, oldest (lowest step) first."""
    if not os.path.isdir(root):
        return []
    return sorted(
        (
            d
            for d in os.listdir(root)
            if d.startswith("step-") and "." not in d and os.path.isdir(os.path.join(root, d))
        ),
        key=lambda d: (_step_number(d), d),
    )


def checkpoint_candidates(root: str) -> tuple[list[str], list[str]]:
    """Every checkpoint directory under `root`, the one `latest` names first, then newest
    first; and notes on what was wrong with the `latest` pointer (unreadable, dangling)."""
    notes, first = [], None
    pointer = os.path.join(root, LATEST)
    if os.path.isfile(pointer):
        try:
            with open(pointer) as f:
                name = json.load(f)["dir"]
            if not isinstance(name, str) or os.path.basename(name) != name:
                raise ValueError(f"'dir' is {name!r}, not a directory name")
            if os.path.isdir(os.path.join(root, name)):
                first = name
            else:
                notes.append(f"{pointer} names {name!r}, which does not exist; ignored")
        except (OSError, ValueError, KeyError, TypeError) as e:
            notes.append(f"{pointer} is unreadable ({type(e).__name__}: {e}); ignored")
    dirs = _step_dirs(root)[::-1]
    if first is not None:
        dirs = [first] + [d for d in dirs if d != first]
    return [os.path.join(root, d) for d in dirs], notes


def latest_checkpoint(root: str) -> str | None:
    """The newest complete checkpoint directory under `root` (the one `latest` names, else the
    newest with a state.json), or None. Its files are not checked: see `load_checkpoint`."""
    dirs, _ = checkpoint_candidates(root)
    done = [d for d in dirs if os.path.isfile(os.path.join(d, "state.json"))]
    return done[0] if done else None


def _nonfinite(tensors: dict) -> list[str]:
    return [
        k
        for k, t in tensors.items()
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not bool(t.isfinite().all())
    ]


def _optim_tensors(obj, prefix: str = "") -> dict:
    """Every tensor inside a (nested) optimizer / scheduler state, by a dotted path."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj}
    items = (
        obj.items()
        if isinstance(obj, dict)
        else enumerate(obj)
        if isinstance(obj, list | tuple)
        else ()
    )
    out = {}
    for k, v in items:
        out.update(_optim_tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def load_checkpoint(ckpt: str, models: dict, device) -> tuple[dict, dict]:
    """Load weights into `models` (name -> module); return (optimizer state, JSON state).

    Raises CorruptCheckpoint naming the file when one is missing, truncated or malformed, holds
    non-finite weights or optimizer state, or (after those checks, which name the more specific
    problem) a file of the checkpoint's top level, i.e. one that resuming reads, no longer has
    the SHA-256 of its SHA256SUMS; a checkpoint whose state.json says it has a SHA256SUMS but
    that lacks one is corrupt too. Files in subdirectories (the Hugging Face export) are not
    checked here: see `verify_checksums`. The models may then be partly overwritten: load
    another checkpoint into them (every tensor is replaced) or discard them."""
    from safetensors.torch import load_model

    path = os.path.join(ckpt, "state.json")
    state = read_json(path)
    if not isinstance(state, dict) or not isinstance(state.get("step"), int) or "rng" not in state:
        raise CorruptCheckpoint(path, "not a checkpoint state (expected 'step' and 'rng')")
    for name, model in models.items():
        path = os.path.join(ckpt, f"{name}.safetensors")
        if not os.path.isfile(path):
            raise CorruptCheckpoint(path, "missing")
        try:
            load_model(model, path, device=str(device))
        except Exception as e:  # truncated / garbage file, wrong tensors
            raise CorruptCheckpoint(path, f"unreadable ({type(e).__name__}: {e})") from e
        bad = _nonfinite(model.state_dict())
        if bad:
            raise CorruptCheckpoint(path, f"non-finite (NaN / inf) weights in {', '.join(bad[:3])}")
    path = os.path.join(ckpt, "optimizer.pt")
    if not os.path.isfile(path):
        raise CorruptCheckpoint(path, "missing")
    try:
        # on the CPU: load_state_dict moves each state tensor to its parameter's device, except
        # Adam's `step`, which stays where it was loaded (a CUDA step made every optimizer step
        # of a resumed run sync with the host twice per parameter tensor)
        optim_state = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        raise CorruptCheckpoint(path, f"unreadable ({type(e).__name__}: {e})") from e
    if not isinstance(optim_state, dict) or not {"optimizer", "scheduler"} <= optim_state.keys():
        raise CorruptCheckpoint(path, "not an optimizer checkpoint")
    bad = _nonfinite(_optim_tensors(optim_state))
    if bad:
        raise CorruptCheckpoint(path, f"non-finite optimizer state in {', '.join(bad[:3])}")
    sums = read_checksums(ckpt)
    if sums is None and state.get("checksums"):
        raise CorruptCheckpoint(
            os.path.join(ckpt, CHECKSUMS), "missing (state.json says the checkpoint has one)"
        )
    if sums is not None:
        top = [rel for rel in sorted(sums) if "/" not in rel]
        for name in ("state.json", "optimizer.pt", *(f"{n}.safetensors" for n in models)):
            if name not in sums:
                raise CorruptCheckpoint(os.path.join(ckpt, CHECKSUMS), f"does not list {name}")
        bad = verify_checksums(ckpt, sums, top)
        if bad:
            raise bad[0]
    return optim_state, state


def load_rank_rng(ckpt: str, rank: int) -> dict | None:
    path = os.path.join(ckpt, f"rng_rank{rank}.json")
    if not os.path.isfile(path):
        return None
    return read_json(path)
