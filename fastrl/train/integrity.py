"""File integrity for checkpoints: atomic writes (a fsync'ed temporary file or directory renamed
into place), modes that follow the process's umask, and the `SHA256SUMS` list of a checkpoint's
files (the format of `sha256sum`: `cd step-N && sha256sum -c SHA256SUMS` checks a copy by hand).

`CorruptCheckpoint` names the file that cannot be used and why; `fastrl.train.checkpoint` (what a
checkpoint holds, saving and loading it) builds on these.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile

CHECKSUMS = "SHA256SUMS"
"""The file in each checkpoint that lists the SHA-256 of every other file in it."""


class CorruptCheckpoint(ValueError):
    """A checkpoint file that cannot be used; `path` is the file, `reason` what is wrong."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"{path}: {reason}")
        self.path, self.reason = path, reason


def fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str) -> None:
    with open(path, "rb+") as f:
        f.flush()
        os.fsync(f.fileno())


def current_umask() -> int:
    """The process's umask, read without changing it where Linux says it (/proc), else by
    setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def apply_umask(path: str, umask: int) -> None:
    """Give `path` (and, for a directory, everything under it) the modes a plain `open` /
    `mkdir` would have: 0o666 & ~umask for files, 0o777 & ~umask for directories. The
    temporary files and directories of an atomic write start owner-only (mkstemp, mkdtemp,
    safetensors), which would make checkpoints unreadable to the group the umask allows."""
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~umask)
    if os.path.isdir(path):
        for parent, dirs, files in os.walk(path):
            for d in dirs:
                os.chmod(os.path.join(parent, d), 0o777 & ~umask)
            for f in files:
                os.chmod(os.path.join(parent, f), 0o666 & ~umask)


def write_json_atomic(path: str, obj) -> None:
    """Write JSON to `path` through a fsync'ed temp file in the same directory + os.replace; the
    file gets the mode the umask gives a new file."""
    d = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(dir=d, prefix=".tmp-", suffix=".json")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f)
            f.flush()
            os.fsync(f.fileno())
        apply_umask(tmp, current_umask())
        os.replace(tmp, path)
        fsync_dir(d)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def read_json(path: str):
    """JSON from `path`; a missing, unreadable or malformed file raises CorruptCheckpoint naming
    it."""
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except FileNotFoundError:
        raise CorruptCheckpoint(path, "missing") from None
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpoint(path, f"not valid JSON ({e})") from e


# --------------------------------------------------------------------------- checksums
def sha256_file(path: str) -> str:
    """The SHA-256 of the file at `path` (hex), read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files_under(ckpt: str) -> list[str]:
    """Every file under `ckpt` except the checksum list, as sorted '/'-separated paths relative
    to it."""
    out = []
    for parent, _, files in os.walk(ckpt):
        for f in files:
            rel = os.path.relpath(os.path.join(parent, f), ckpt).replace(os.sep, "/")
            if rel != CHECKSUMS:
                out.append(rel)
    return sorted(out)


def write_checksums(ckpt: str) -> None:
    """Write `ckpt`/SHA256SUMS: the SHA-256 of every other file under `ckpt`, one
    `<hex>  <relative path>` line each (what `sha256sum` writes and `sha256sum -c` checks)."""
    from concurrent.futures import ThreadPoolExecutor

    files = _files_under(ckpt)
    with ThreadPoolExecutor(max_workers=4) as pool:  # hashlib releases the GIL on large reads
        digests = list(pool.map(lambda rel: sha256_file(os.path.join(ckpt, rel)), files))
    path = os.path.join(ckpt, CHECKSUMS)
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(f"{h}  {rel}\n" for h, rel in zip(digests, files))
    fsync_file(path)


def read_checksums(ckpt: str) -> dict[str, str] | None:
    """relative path -> SHA-256 from `ckpt`/SHA256SUMS, or None when there is no such file (a
    checkpoint of a fastrl that did not write one). A malformed list raises CorruptCheckpoint."""
    path = os.path.join(ckpt, CHECKSUMS)
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise CorruptCheckpoint(path, f"unreadable ({type(e).__name__}: {e})") from e
    sums = {}
    for i, line in enumerate(lines, 1):
        digest, sep, rel = line.partition("  ")
        if not sep or not rel or len(digest) != 64 or set(digest) - set("0123456789abcdef"):
            raise CorruptCheckpoint(path, f"line {i} is not '<sha256 hex>  <file>': {line[:80]!r}")
        sums[rel] = digest
    return sums


def verify_checksums(
    ckpt: str, sums: dict[str, str], files: list[str] | None = None
) -> list[CorruptCheckpoint]:
    """The files of checkpoint `ckpt` (relative paths; None: every one in `sums`) that are
    missing or whose SHA-256 is no longer the one in `sums`, as CorruptCheckpoint errors naming
    them (empty: all intact). A file not in `sums` is not checked."""
    bad = []
    for rel in sorted(sums) if files is None else files:
        if rel not in sums:
            continue
        path = os.path.join(ckpt, *rel.split("/"))
        if not os.path.isfile(path):
            bad.append(CorruptCheckpoint(path, "missing (listed in SHA256SUMS)"))
            continue
        try:
            got = sha256_file(path)
        except OSError as e:
            bad.append(CorruptCheckpoint(path, f"unreadable ({type(e).__name__}: {e})"))
            continue
        if got != sums[rel]:
            bad.append(
                CorruptCheckpoint(
                    path,
                    f"SHA-256 mismatch: the file changed after it was saved (expected "
                    f"{sums[rel][:16]}..., found {got[:16]}...; disk or copy corruption)",
                )
            )
    return bad
