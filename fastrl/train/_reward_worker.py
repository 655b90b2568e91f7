"""One reward call, and the worker process that `fastrl.train.rewards.RewardScorer` runs reward
functions in so that a call past the timeout can be stopped (the process is killed), even one
that holds the GIL (a pure-Python loop, a catastrophically backtracking regex).

Standard library only, and never imported through the `fastrl` package in the worker: the worker
runs this file by path (`runpy.run_path`), because importing `fastrl` imports torch (seconds per
worker start). The reward function is imported there by name (`module`, `qualname`), with the
parent's sys.path.

Protocol, over three pipes (the worker's stdin, stdout and stderr stay the user's): the parent
writes pickles to the request pipe: first (module, qualname, sys.path), then one list of
(completion, answer) pairs per batch; the worker answers with length-prefixed pickles on the
response pipe: ("ready", pid) or ("error", traceback) once, then one `call_reward` result per
call, in order (a "stop" result ends the batch). On SIGUSR1 the worker writes the stacks of its
threads (faulthandler, which works while a C call holds the GIL) to the stack pipe, so the parent
can say where a timed-out call was.
"""

from __future__ import annotations

import faulthandler
import importlib
import math
import os
import pickle
import signal
import struct
import sys
import traceback

MAX_ABS_REWARD = 1e6
"""A reward with |r| above this is an error (counted, scored 0), as is a non-finite one: such a
value is a bug in the reward function, and it would swamp (or turn NaN) every advantage of its
group or batch."""

HEADER = struct.Struct(">Q")
"""The length prefix of each message from the worker."""


def call_reward(fn, completion: str, answer: str) -> tuple:
    """One reward call: ("ok", r) | ("raised" | "invalid", detail) | ("stop", exception type
    name, message, is a KeyboardInterrupt, traceback) for a BaseException that is not an
    Exception (SystemExit, KeyboardInterrupt, ...) raised by user code. Only picklable values."""
    try:
        value = fn(completion, answer)
    except Exception as e:
        return "raised", format_exception(e)
    except BaseException as e:
        return (
            "stop",
            type(e).__name__,
            str(e),
            isinstance(e, KeyboardInterrupt),
            format_exception(e),
        )
    try:
        if isinstance(value, (str, bytes, bytearray)):  # float("1") would parse it: not a number
            raise TypeError
        r = float(value)  # a number (a bool is 0 / 1), a numpy / one-element torch scalar
    except Exception:
        return "invalid", f"returned {short(value)}, not a number"
    if not math.isfinite(r) or abs(r) > MAX_ABS_REWARD:
        return "invalid", f"returned {r!r} (a reward must be finite with |r| <= {MAX_ABS_REWARD:g})"
    return "ok", r


def format_exception(e: BaseException) -> str:
    """The traceback of `e` from the reward function down (without `call_reward`'s frame)."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(e), e, tb)).rstrip()


def short(x, n: int = 120) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


def _send(out, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(HEADER.pack(len(data)) + data)
    out.flush()


def _die_with_parent(parent: int) -> None:
    """Linux: have the kernel kill this worker when the trainer's process ends, even while a
    reward call holds the GIL (an idle worker also exits at EOF on its request pipe)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:  # the parent ended before prctl
        os._exit(0)


def main(args: list[str]) -> None:
    """The worker: args are the request, response and stack pipe fds and the parent's pid."""
    req_fd, resp_fd, stack_fd, parent = (int(a) for a in args)
    # Ctrl-C and SIGTERM are the trainer's to handle: sent to the whole process group (a
    # terminal's Ctrl-C, GNU timeout, slurm, `kill -- -PGID`) they reach this worker too, which
    # must finish the call the trainer's current step waits for (the trainer kills the worker
    # with SIGKILL when it must; the kernel does when the trainer ends: _die_with_parent)
    for stop in (signal.SIGINT, signal.SIGTERM):
        signal.signal(stop, signal.SIG_IGN)
    _die_with_parent(parent)
    stack = os.fdopen(stack_fd, "w")
    faulthandler.register(signal.SIGUSR1, file=stack, all_threads=True)
    req, resp = os.fdopen(req_fd, "rb"), os.fdopen(resp_fd, "wb")
    try:
        module, qualname, path = pickle.load(req)
        sys.path[:] = path
        fn = importlib.import_module(module)
        for part in qualname.split("."):
            fn = getattr(fn, part)
    except BaseException as e:  # the parent falls back to a thread, showing this
        _send(resp, ("error", "".join(traceback.format_exception(type(e), e, e.__traceback__))))
        return
    _send(resp, ("ready", os.getpid()))
    while True:
        try:
            items = pickle.load(req)
        except EOFError:  # the scorer closed the pipe: done
            return
        for completion, answer in items:
            out = call_reward(fn, completion, answer)
            _send(resp, out)
            if out[0] == "stop":
                break


if __name__ == "__main__":
    main(sys.argv[1:])
