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
reward that seems to hang on every input (more than `MAX_HUNG_CALLS` timeouts in a row). The
thread and the worker process a call runs in are fastrl/train/reward_runners.py's.
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ._reward_worker import MAX_ABS_REWARD as MAX_ABS_REWARD  # public here (see there)
from ._reward_worker import call_reward, short
from .reward_runners import WORKER_START_TIMEOUT as WORKER_START_TIMEOUT  # public here
from .reward_runners import (
    ThreadJob,
    WorkerDied,
    WorkerProcess,
    close_slot,
    process_target,
    thread_stack,
)

RewardFn = Callable[[str, str], float]

MAX_HUNG_CALLS = 4
"""A reward run in a worker process: timeouts in a row (no call finishing in between) before one
more stops the run. In a thread: timed-out calls whose threads are still running; one more
timeout stops the run."""

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
        self._slot: list[WorkerProcess | None] = [None]  # the worker; a list, for the finalizer
        weakref.finalize(self, close_slot, self._slot)  # at garbage collection or exit
        self._target = None  # (module, qualname, sys.path) for a worker process
        if timeout:
            self._target = None if _builtin(fn) else process_target(fn)
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
    def _worker(self) -> WorkerProcess | None:
        return self._slot[0]

    @_worker.setter
    def _worker(self, w: WorkerProcess | None) -> None:
        self._slot[0] = w

    @property
    def pid(self) -> int | None:
        """The id of the worker process calls run in now (None: they run in this process)."""
        w = self._worker
        return w.proc.pid if w is not None else None

    def close(self) -> None:
        """Stop the worker process (if any); a later batch starts a new one."""
        close_slot(self._slot)

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
            self._worker = WorkerProcess(*self._target)
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

    def _ready_worker(self) -> WorkerProcess | None:
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
            except WorkerDied as e:
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
            except WorkerDied as e:
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
                except WorkerDied as e:  # the call crashed the process (os._exit, a segfault)
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
            job = ThreadJob(self.fn, items, start)
            hung = job.wait(self.timeout)
            with job.lock:
                outcomes.update(job.results)
            if hung is None:
                break
            outcomes[hung] = ("timeout", thread_stack(job.thread))
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


def _builtin(fn) -> bool:
    """A built-in reward of this module (linear-time string functions: a thread is enough)."""
    return getattr(fn, "__module__", None) == __name__ and fn in REWARDS.values()


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
