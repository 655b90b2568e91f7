"""Reward functions for verifiable tasks: pure string functions, never `eval()` of model text.

A reward function has the signature `fn(completion: str, answer: str) -> float`. Built-ins are
looked up by name in `REWARDS`; a user function is given as `module:function` and imported
(the current working directory is searched first, as `python -m` would).

`RewardScorer` runs a reward function over a batch. A call that raises, returns something that
is not a number, a non-finite number or one with |r| > `MAX_ABS_REWARD`, or runs longer than
the timeout scores 0 and is counted (by kind), so that one bad completion never stops a run;
the first failure of each kind is reported with its traceback. A user function runs in a worker
process, killed and restarted when a call runs past the timeout, so that even a call holding
the GIL (a pure-Python loop, a catastrophically backtracking regex) is stopped. Two things do
stop the run, with a `RewardError`: user code raising `SystemExit` / `KeyboardInterrupt`, and a
reward that seems to hang on every input (more than `MAX_HUNG_CALLS` timeouts in a row).
"""

from __future__ import annotations

import importlib
import math
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
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from . import _reward_worker
from ._reward_worker import MAX_ABS_REWARD as MAX_ABS_REWARD  # public here (see there)
from ._reward_worker import call_reward, short

RewardFn = Callable[[str, str], float]

MAX_HUNG_CALLS = 4
"""A reward run in a worker process: timeouts in a row (no call finishing in between) before one
more stops the run. In a thread: timed-out calls whose threads are still running; one more
timeout stops the run."""

WORKER_START_TIMEOUT = 120.0
"""Seconds a reward worker process may take to start and import the reward's module (not
counted against the per-call timeout); past it the scorer falls back to a thread."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")
_BRACKETED = re.compile(r"^\[(-?\d+)\]$")


def exact_match(completion: str, answer: str) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer; else 0."""
    return float(completion.strip() == str(answer).strip())


def last_number(completion: str, answer: str) -> float:
    """1.0 when the last number written in the completion equals the answer numerically.

    Numbers are found with a regular expression and parsed with `float`; nothing is evaluated."""
    found = _NUMBER.findall(completion)
    if not found:
        return 0.0
    try:
        return float(math.isclose(float(found[-1]), float(answer), rel_tol=0.0, abs_tol=1e-9))
    except ValueError:
        return 0.0


def bracket_format(completion: str, answer: str) -> float:
    """Format + answer reward: 0.2 for a completion of the exact form `[<integer>]`, plus 0.8
    when that integer is the answer (so 1.0 = right answer in the right format, 0 = no format).
    """
    m = _BRACKETED.match(completion.strip())
    if m is None:
        return 0.0
    return 0.2 + 0.8 * float(m.group(1) == str(answer).strip())


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "last_number": last_number,
    "bracket_format": bracket_format,
}


def resolve_reward(spec: str | RewardFn) -> RewardFn:
    """A reward function from a built-in name (see `REWARDS`), a `module:function` string, or a
    callable (returned as is). Raises ValueError saying what to fix."""
    if callable(spec):
        return spec
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward must be a built-in name {sorted(REWARDS)} or 'module:function'")
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" not in spec:
        raise ValueError(
            f"unknown reward {spec!r}: use a built-in name {sorted(REWARDS)} or "
            "'module:function' (an importable module and a function in it)"
        )
    module_name, _, fn_name = spec.partition(":")
    try:
        module = _import_from_cwd(module_name)
    except ImportError as e:
        raise ValueError(
            f"reward {spec!r}: cannot import module {module_name!r} ({e}); it must be importable "
            f"from the current directory ({os.getcwd()}) or sys.path"
        ) from e
    except Exception as e:  # the module itself raised while importing
        raise ValueError(
            f"reward {spec!r}: importing module {module_name!r} raised {type(e).__name__}: {e}"
        ) from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def _import_from_cwd(module_name: str):
    """Import `module_name` with the current working directory first on sys.path (as
    `python -m` does), for this import only."""
    cwd = os.getcwd()
    added = cwd not in sys.path and "" not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        return importlib.import_module(module_name)
    finally:
        if added and cwd in sys.path:
            sys.path.remove(cwd)


# --------------------------------------------------------------------------- scoring
class RewardError(RuntimeError):
    """A reward failure that stops the run: user code raised SystemExit / KeyboardInterrupt, or
    too many calls hang. `exit_code` is what `fastrl train` exits with."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


@dataclass
class ScoreResult:
    """Rewards of one batch (failed calls score 0) and the failures by kind."""

    rewards: list[float]
    raised: int = 0
    """Calls that raised an exception."""
    invalid: int = 0
    """Calls that returned a non-number, a non-finite number or one with |r| > MAX_ABS_REWARD."""
    timeouts: int = 0
    """Calls still running after the timeout (abandoned)."""
    messages: list[str] = field(default_factory=list)
    """Reports of the first failure of each kind in this scorer's lifetime (with traceback)."""

    @property
    def errors(self) -> int:
        return self.raised + self.invalid + self.timeouts


class _Job:
    """Calls of items[start:] in one daemon thread; `wait` abandons it at the first call that
    runs past the timeout. Results and the start time of the current call change together,
    under the lock, so a late result of an abandoned call is never used."""

    def __init__(self, fn: RewardFn, items: list[tuple[str, str]], start: int):
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


class RewardScorer:
    """Score batches with a reward function, turning every failure into a counted reward of 0.

    Where a call runs, with `timeout` > 0:

    - A function a fresh process can import by name (a top-level function of a module, e.g.
      from `module:function`) runs in a persistent worker process (one per scorer, started
      here; the batch goes over a pipe and the rewards come back one by one, tens of
      microseconds a call). A call past the timeout is counted as a timeout and stopped: the
      worker is killed (after saying where the call was) and a new one runs the rest of the
      batch. That stops any call, also one that holds the GIL (a pure-Python loop, a
      catastrophically backtracking regex), which no thread can. The module is imported again
      in the worker: what the function reads must be set at import time (state changed at run
      time in this process is not seen, and module state restarts with each new worker).
      More than `MAX_HUNG_CALLS` timeouts in a row (a reward that hangs on every input) raise
      `RewardError` instead of stalling the run. A worker that cannot start (the module does
      not import there, or takes more than `WORKER_START_TIMEOUT` s) makes the scorer fall
      back to a thread, saying why.
    - The built-in rewards (linear-time string functions) and callables no other process can
      import by name (lambdas, closures, functions of `__main__`, bound methods, partials; only
      possible from Python, or on a platform without POSIX pipes) run in a daemon worker
      thread, and the caller waits for each call at most `timeout` seconds. A call past it is
      counted as a timeout and abandoned: a thread cannot be killed, so it keeps running in
      the background (it never blocks the process's exit), and the rest of the batch goes to
      a fresh thread. A call that holds the GIL cannot be timed out there at all: the scorer
      says so (through `report`) when it falls back to a thread for a user function. More than
      `MAX_HUNG_CALLS` abandoned calls still running at once raise `RewardError`, and a
      function that times out must tolerate being called again while the abandoned call runs.

    `timeout` 0 or None: calls run in the calling thread without a time limit (for reward
    functions that need the main thread, e.g. signal-based ones).

    `report(text)` is called with the first failure of each kind (raised, invalid, timeout),
    with its traceback, once per scorer, and with the reason for a fallback to a thread.
    SystemExit / KeyboardInterrupt (any BaseException that is not an Exception) raised by the
    reward function become `RewardError`. `close()` stops the worker process (also done when
    the scorer is garbage-collected and at exit).
    """

    def __init__(
        self,
        fn: RewardFn,
        timeout: float | None = 5.0,
        report: Callable[[str], None] | None = None,
    ):
        self.fn, self.timeout, self.report = fn, timeout, report
        self._reported: set[str] = set()
        self._hung: list[threading.Thread] = []
        self._timeouts_in_a_row = 0
        self._slot: list[_Worker | None] = [None]  # the worker; a list, for the finalizer
        weakref.finalize(self, _close_slot, self._slot)  # at garbage collection or exit
        self._target = None  # (module, qualname, sys.path) for a worker process
        if timeout:
            self._target = _process_target(fn)
            if isinstance(self._target, str):  # why it cannot run in a process
                self._note(
                    f"the reward function {_name(fn)} runs in a thread, not in a worker "
                    f"process: {self._target}. --reward-timeout cannot stop a call of it that "
                    "holds the GIL (a pure-Python loop, a catastrophically backtracking regex): "
                    "such a call would stall the run. Define it at the top level of a module "
                    "and pass it as module:function to run it where it can be stopped."
                )
                self._target = None
            elif self._target is not None:
                self._start_worker()

    @property
    def _worker(self) -> _Worker | None:
        return self._slot[0]

    @_worker.setter
    def _worker(self, w: _Worker | None) -> None:
        self._slot[0] = w

    @property
    def pid(self) -> int | None:
        """The id of the worker process calls run in now (None: they run in this process)."""
        w = self._worker
        return w.proc.pid if w is not None else None

    def close(self) -> None:
        """Stop the worker process (if any); a later batch starts a new one."""
        _close_slot(self._slot)

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> ScoreResult:
        items = list(zip(completions, answers))
        outcomes: dict[int, tuple] = {}
        if not self.timeout:
            for i, (c, a) in enumerate(items):
                outcomes[i] = call_reward(self.fn, c, a)
                if outcomes[i][0] == "stop":
                    break
        else:
            start = self._score_in_process(items, outcomes) if self._target else 0
            if start < len(items):
                self._score_in_threads(items, outcomes, start)
        return self._result(items, outcomes)

    # ------------------------------------------------------------------ worker process
    def _note(self, text: str) -> None:
        if self.report is not None:
            self.report(text)

    def _start_worker(self) -> None:
        try:
            self._worker = _Worker(*self._target)
        except OSError as e:  # no process could be started (fds, memory)
            self._fall_back(f"starting a worker process failed ({type(e).__name__}: {e})")

    def _fall_back(self, why: str) -> None:
        """From now on, run calls in threads (saying why, and what that costs)."""
        self.close()
        self._target = None
        self._note(
            f"the reward function {_name(self.fn)} runs in a thread from now on: {why}. "
            "--reward-timeout cannot stop a call of it that holds the GIL (a pure-Python loop, "
            "a catastrophically backtracking regex)."
        )

    def _ready_worker(self) -> _Worker | None:
        """The worker, started and ready (its module imported); None after a fall-back."""
        last = ""
        for _ in range(2):  # a worker that died while idle is replaced once
            if self._worker is None:
                self._start_worker()
                if self._worker is None:
                    return None
            w = self._worker
            try:
                ok = w.wait_ready()
            except _WorkerDied as e:
                self.close()
                if self._target is None:
                    return None
                last = str(e)
                continue
            if ok is True:
                return w
            self._fall_back(ok)
            return None
        self._fall_back(f"the worker process keeps dying ({last})")
        return None

    def _score_in_process(self, items: list[tuple[str, str]], outcomes: dict[int, tuple]) -> int:
        """Score items in the worker process, restarting it after a timeout or a crash; return
        how many items were scored (fewer than all after a fall-back to threads)."""
        start, broken = 0, 0
        while start < len(items):
            w = self._ready_worker()
            if w is None:
                return start
            try:
                w.send(items[start:])
            except _WorkerDied as e:
                broken += 1
                if broken > 2:
                    self._fall_back(f"the worker process keeps dying ({e})")
                    return start
                self.close()
                continue
            i, deadline = start, time.monotonic() + self.timeout
            while i < len(items):
                try:
                    out = w.recv(deadline)
                except _WorkerDied as e:  # the call crashed the process (os._exit, a segfault)
                    outcomes[i] = ("raised", f"the worker process died during the call: {e}")
                    self.close()
                    i += 1
                    break
                if out is None:  # past the timeout: say where it is, then stop it
                    outcomes[i] = ("timeout", w.stack())
                    self.close()
                    self._timeouts_in_a_row += 1
                    if self._timeouts_in_a_row > MAX_HUNG_CALLS:
                        c, a = items[i]
                        raise RewardError(
                            f"{self._timeouts_in_a_row} reward calls in a row ran past the "
                            f"{self.timeout:g}s timeout (each was stopped; the latest on "
                            f"completion {short(c)}, answer {short(a)}): the reward function "
                            "seems to hang; stopping the run (fix it, or raise --reward-timeout)"
                        )
                    i += 1
                    break
                outcomes[i] = out
                self._timeouts_in_a_row = 0
                i += 1
                if out[0] == "stop":
                    return len(items)  # _result raises at it; the rest is never scored
                deadline = time.monotonic() + self.timeout
            start = i
        if self._worker is None and self._target is not None:
            self._start_worker()  # the next batch's worker starts now, not when it is needed
        return start

    # ------------------------------------------------------------------ threads
    def _score_in_threads(
        self, items: list[tuple[str, str]], outcomes: dict[int, tuple], start: int
    ) -> None:
        while start < len(items):
            job = _Job(self.fn, items, start)
            hung = job.wait(self.timeout)
            with job.lock:
                outcomes.update(job.results)
            if hung is None:
                break
            outcomes[hung] = ("timeout", _stack_of(job.thread))
            self._hung = [t for t in self._hung if t.is_alive()] + [job.thread]
            if len(self._hung) > MAX_HUNG_CALLS:
                c, a = items[hung]
                raise RewardError(
                    f"{len(self._hung)} reward calls ran past the {self.timeout:g}s timeout "
                    f"and are still running (the latest on completion {short(c)}, answer "
                    f"{short(a)}): the reward function seems to hang; stopping the run "
                    "(fix it, or raise --reward-timeout)"
                )
            start = hung + 1

    # ------------------------------------------------------------------ results
    def _result(self, items: list[tuple[str, str]], outcomes: dict[int, tuple]) -> ScoreResult:
        res = ScoreResult(rewards=[])
        for i, (c, a) in enumerate(items):
            out = outcomes[i]
            kind = out[0]
            if kind == "stop":
                _, name, text, interrupt, tb = out
                raise RewardError(
                    f"the reward function raised {name}({text[:120]}) on completion "
                    f"{short(c)} (answer {short(a)}); stopping the run\n{tb}",
                    exit_code=130 if interrupt else 1,
                )
            if kind == "ok":
                res.rewards.append(out[1])
                continue
            res.rewards.append(0.0)
            if kind == "raised":
                res.raised += 1
            elif kind == "invalid":
                res.invalid += 1
            else:
                res.timeouts += 1
            if kind not in self._reported:
                self._reported.add(kind)
                stopped = "stopped" if self._target else "abandoned"
                what = {
                    "raised": "raised",
                    "invalid": "returned an invalid reward",
                    "timeout": f"ran past the {self.timeout}s timeout ({stopped})",
                }[kind]
                res.messages.append(
                    f"reward function {what} on completion {short(c)} (answer {short(a)}); "
                    f"scored 0 and counted (only the first such failure is shown):\n{out[1]}"
                )
        if self.report is not None:
            for m in res.messages:
                self.report(m)
        return res


def _name(fn) -> str:
    return getattr(fn, "__qualname__", None) or repr(fn)


def _process_target(fn) -> tuple[str, str, list[str]] | str | None:
    """How a worker process imports `fn`: (module, qualname, sys.path with the module's root
    directory first); a string saying why it cannot; None for a built-in reward of this
    module (linear-time: a thread is enough)."""
    module, qualname = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if module == __name__ and fn in REWARDS.values():
        return None
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


class _WorkerDied(RuntimeError):
    """The worker process ended (or its pipe broke); the message says how."""


class _Worker:
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
            raise _WorkerDied(self._ended(f"its pipe broke ({type(e).__name__})")) from e

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
        """The next message, or None at `deadline`; _WorkerDied when the process ended."""
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
                raise _WorkerDied(self._ended("it exited"))
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


def _close_slot(slot: list) -> None:
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


def _stack_of(thread: threading.Thread) -> str:
    """Where a hung reward call is stuck (its thread's current stack)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(the call finished just after the timeout)"
    stack = traceback.extract_stack(frame)
    inner = [i for i, f in enumerate(stack) if f.name == "call_reward"]
    if inner:  # from the reward function down (not the thread machinery)
        stack = traceback.StackSummary.from_list(stack[inner[-1] + 1 :])
    return "where the hung call is:\n" + "".join(stack.format()).rstrip()


def score(
    fn: RewardFn,
    completions: Sequence[str],
    answers: Sequence[str],
    timeout: float | None = None,
) -> tuple[list[float], int]:
    """Rewards of `completions` against `answers` with `fn`, and the number of failed calls
    (raised, returned a non-number / non-finite / |r| > MAX_ABS_REWARD value, or ran past
    `timeout` seconds); those score 0. See `RewardScorer`."""
    scorer = RewardScorer(fn, timeout)
    try:
        res = scorer(completions, answers)
    finally:
        scorer.close()
    return res.rewards, res.errors
