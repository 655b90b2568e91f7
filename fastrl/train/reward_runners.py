"""Where `fastrl.train.rewards.RewardScorer` runs reward calls so that a call past its timeout can
be given up on: a daemon thread (`ThreadJob`: the call is abandoned, it cannot be killed) or a
worker process (`WorkerProcess`: the process is killed, which stops even a call that holds the
GIL). The worker's own side is fastrl/train/_reward_worker.py; when to use which, the failure
accounting and the errors that stop a run are the scorer's (fastrl/train/rewards.py).
"""

from __future__ import annotations

import os
import pickle
import re
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable

from . import _reward_worker
from ._reward_worker import call_reward

WORKER_START_TIMEOUT = 120.0
"""Seconds a reward worker process may take to start and import the reward's module (not
counted against the per-call timeout); past it the scorer falls back to a thread."""


def process_target(fn) -> tuple[str, str, list[str]] | str:
    """How a worker process imports `fn`: (module, qualname, sys.path with the module's root
    directory first); or a string saying why it cannot."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if os.name != "posix":
        return "worker processes need POSIX pipes"
    if not isinstance(module, str) or not isinstance(qualname, str):
        return f"{fn!r} is not a plain function (no module and name to import it by)"
    if module == "__main__":
        return "it is defined in __main__"
    if "<" in qualname:  # <lambda>, <locals>
        return f"{qualname} is a lambda or a function defined inside another one"
    mod = sys.modules.get(module)
    obj = mod
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if obj is not fn or getattr(mod, "__file__", None) is None:
        return f"{module}.{qualname} does not name it"
    path = os.path.abspath(mod.__file__)
    depth = module.count(".") + (os.path.basename(path) == "__init__.py")
    root = path
    for _ in range(depth + 1):
        root = os.path.dirname(root)
    paths = [p for p in sys.path if isinstance(p, str)]
    return module, qualname, [root, *(p for p in paths if p != root)]


# --------------------------------------------------------------------------- threads
class ThreadJob:
    """Calls of items[start:] in one daemon thread; `wait` abandons it at the first call that
    runs past the timeout. Results and the start time of the current call change together,
    under the lock, so a late result of an abandoned call is never used."""

    def __init__(self, fn: Callable[[str, str], float], items: list[tuple[str, str]], start: int):
        self.fn, self.items = fn, items
        self.results: dict[int, tuple] = {}
        self.lock = threading.Lock()
        self.current = (start, time.monotonic())  # (index of the running call, its start)
        self.cancelled = False
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="fastrl-reward")
        self.thread.start()

    def _run(self) -> None:
        i = self.current[0]
        while i < len(self.items):
            out = call_reward(self.fn, *self.items[i])
            with self.lock:
                if self.cancelled:
                    return
                self.results[i] = out
                i += 1
                self.current = (i, time.monotonic())
            if out[0] == "stop":
                break
        self.done.set()

    def wait(self, timeout: float) -> int | None:
        """None when every call finished (or one asked to stop); else the index of the call
        that ran past `timeout` (the job is then cancelled)."""
        while True:
            with self.lock:
                current = self.current
            left = current[1] + timeout - time.monotonic()
            if self.done.wait(max(left, 0.0)):
                return None
            with self.lock:
                if self.current == current and not self.done.is_set():
                    self.cancelled = True
                    return current[0]


def thread_stack(thread: threading.Thread) -> str:
    """Where a hung reward call is stuck (its thread's current stack)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(the call finished just after the timeout)"
    stack = traceback.extract_stack(frame)
    inner = [i for i, f in enumerate(stack) if f.name == "call_reward"]
    if inner:  # from the reward function down (not the thread machinery)
        stack = traceback.StackSummary.from_list(stack[inner[-1] + 1 :])
    return "where the hung call is:\n" + "".join(stack.format()).rstrip()


# --------------------------------------------------------------------------- worker process
class WorkerDied(RuntimeError):
    """The worker process ended (or its pipe broke); the message says how."""


class WorkerProcess:
    """A reward worker process (see fastrl/train/_reward_worker.py) and this end of its pipes."""

    def __init__(self, module: str, qualname: str, path: list[str]):
        req_r, req_w = os.pipe()
        resp_r, resp_w = os.pipe()
        stack_r, stack_w = os.pipe()
        boot = "import runpy, sys; runpy.run_path(sys.argv[1], run_name='fastrl_reward_worker')"
        try:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-u",
                    "-c",
                    boot + "['main'](sys.argv[2:])",
                    _reward_worker.__file__,
                    *(str(fd) for fd in (req_r, resp_w, stack_w, os.getpid())),
                ],
                pass_fds=(req_r, resp_w, stack_w),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            for fd in (req_r, req_w, resp_r, resp_w, stack_r, stack_w):
                os.close(fd)
            raise
        for fd in (req_r, resp_w, stack_w):
            os.close(fd)
        self.req = os.fdopen(req_w, "wb")
        self.resp, self.stack_fd = resp_r, stack_r
        self.buf = bytearray()
        self.ready = False
        self.send((module, qualname, path))

    def send(self, obj) -> None:
        try:
            pickle.dump(obj, self.req, protocol=pickle.HIGHEST_PROTOCOL)
            self.req.flush()
        except (BrokenPipeError, OSError, ValueError) as e:
            raise WorkerDied(self._ended(f"its pipe broke ({type(e).__name__})")) from e

    def wait_ready(self) -> bool | str:
        """True once the worker has imported the reward function; else why it could not."""
        if self.ready:
            return True
        out = self.recv(time.monotonic() + WORKER_START_TIMEOUT)
        if out is None:
            return f"the worker process did not start within {WORKER_START_TIMEOUT:g}s"
        if out[0] != "ready":
            return f"the worker process could not import it:\n{out[1]}"
        self.ready = True
        return True

    def recv(self, deadline: float) -> tuple | None:
        """The next message, or None at `deadline`; WorkerDied when the process ended."""
        n = _reward_worker.HEADER.size
        while True:
            if len(self.buf) >= n:
                (size,) = _reward_worker.HEADER.unpack_from(self.buf)
                if len(self.buf) >= n + size:
                    data = bytes(self.buf[n : n + size])
                    del self.buf[: n + size]
                    return pickle.loads(data)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            if not select.select([self.resp], [], [], left)[0]:
                continue
            chunk = os.read(self.resp, 1 << 16)
            if not chunk:
                raise WorkerDied(self._ended("it exited"))
            self.buf += chunk

    def _ended(self, what: str) -> str:
        try:
            code = self.proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            return what
        if code < 0:
            try:
                return f"{what}: killed by {signal.Signals(-code).name}"
            except ValueError:
                return f"{what}: killed by signal {-code}"
        return f"{what} with exit code {code}"

    def stack(self) -> str:
        """Where the worker's running call is (its stack, from the reward function down)."""
        try:
            os.kill(self.proc.pid, signal.SIGUSR1)
        except OSError:
            return "(the worker process had ended)"
        text, deadline, quiet = b"", time.monotonic() + 2.0, 0.5
        while time.monotonic() < deadline:  # read until the dump stops coming
            if not select.select([self.stack_fd], [], [], quiet)[0]:
                if text:
                    break
                continue
            chunk = os.read(self.stack_fd, 1 << 16)
            if not chunk:
                break
            text, quiet = text + chunk, 0.1
        return _stack_from_dump(text.decode(errors="replace"))

    def close(self) -> None:
        """Kill the process (reward calls are stateless) and close the pipes."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process SIGKILL cannot end
            pass
        for f in (self.req,):
            try:
                f.close()
            except OSError:
                pass
        for fd in (self.resp, self.stack_fd):
            try:
                os.close(fd)
            except OSError:
                pass


def close_slot(slot: list) -> None:
    """Stop the worker in `slot` (a scorer's), if any, and empty the slot."""
    w, slot[0] = slot[0], None
    if w is not None:
        w.close()


_DUMP_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.*)$')


def _stack_from_dump(text: str) -> str:
    """faulthandler's dump of the worker's threads as a traceback of the reward call: the
    thread running `call_reward`, from the reward function down, with source lines."""
    for block in re.split(r"\n\s*\n|\n(?=(?:Current thread|Thread) 0x)", text):
        frames = [m.groups() for line in block.splitlines() if (m := _DUMP_FRAME.match(line))]
        frames.reverse()  # faulthandler lists the most recent call first
        inner = [i for i, f in enumerate(frames) if f[2] == "call_reward"]
        if inner:
            summary = traceback.StackSummary.from_list(
                [(f, int(line), name, None) for f, line, name in frames[inner[-1] + 1 :]]
            )
            return "where the call was stopped:\n" + "".join(summary.format()).rstrip()
    return "where the call was stopped: (no stack)\n" + text.strip()
