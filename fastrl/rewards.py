"""Reward functions for verifiable tasks: pure string functions, never `eval()` of model text.

A reward function has the signature `fn(completion: str, answer: str) -> float`. Built-ins are
looked up by name in `REWARDS`; a user function is given as `module:function` and imported
(the current working directory is searched first, as `python -m` would).

`RewardScorer` runs a reward function over a batch. A call that raises, returns something that
is not a number, a non-finite number or one with |r| > `MAX_ABS_REWARD`, or runs longer than
the timeout scores 0 and is counted (by kind), so that one bad completion never stops a run;
the first failure of each kind is reported with its traceback. Two things do stop the run, with
a `RewardError`: user code raising `SystemExit` / `KeyboardInterrupt`, and more than
`MAX_HUNG_CALLS` timed-out calls still running at once (a reward that hangs on every input).
"""

from __future__ import annotations

import importlib
import math
import os
import re
import sys
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

RewardFn = Callable[[str, str], float]

MAX_ABS_REWARD = 1e6
"""A reward with |r| above this is an error (counted, scored 0), as is a non-finite one: such a
value is a bug in the reward function, and it would swamp (or turn NaN) every advantage of its
group or batch."""

MAX_HUNG_CALLS = 4
"""Timed-out reward calls whose threads are still running; one more timeout stops the run."""

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


def _call(fn: RewardFn, completion: str, answer: str) -> tuple:
    """One reward call: ("ok", r) | ("raised" | "invalid", detail) | ("stop", exception, tb)."""
    try:
        value = fn(completion, answer)
    except Exception as e:
        return "raised", _format(e)
    except BaseException as e:  # SystemExit, KeyboardInterrupt, ... from user code
        return "stop", e, _format(e)
    try:
        r = float(value)
    except Exception:
        return "invalid", f"returned {_short(value)}, not a number"
    if not math.isfinite(r) or abs(r) > MAX_ABS_REWARD:
        return "invalid", f"returned {r!r} (a reward must be finite with |r| <= {MAX_ABS_REWARD:g})"
    return "ok", r


def _format(e: BaseException) -> str:
    """The traceback of `e` from the reward function down (without this module's frame)."""
    tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
    return "".join(traceback.format_exception(type(e), e, tb)).rstrip()


def _short(x, n: int = 120) -> str:
    s = repr(x)
    return s if len(s) <= n else s[: n - 3] + "..."


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
            out = _call(self.fn, *self.items[i])
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

    With `timeout` > 0, each batch runs in a daemon worker thread and the caller waits for each
    call at most `timeout` seconds. A call past it is counted as a timeout and abandoned: a
    thread cannot be killed, so it keeps running in the background (it never blocks the
    process's exit), and the rest of the batch goes to a fresh thread. Threads rather than a
    subprocess pool because they need no pickling, accept any callable (closures, lambdas) and
    cost one thread start per batch, not per call; the price is that a reward that never
    returns keeps its thread, so more than `MAX_HUNG_CALLS` of them still running at once raise
    `RewardError` (a reward that hangs on every input stops the run instead of stalling it).
    Reward functions that time out must tolerate being called again while the abandoned call
    still runs. `timeout` 0 or None: calls run in the calling thread without a time limit (for
    reward functions that need the main thread, e.g. signal-based ones).

    `report(text)` is called with the first failure of each kind (raised, invalid, timeout),
    with its traceback, once per scorer. SystemExit / KeyboardInterrupt (any BaseException that
    is not an Exception) raised by the reward function become `RewardError`.
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

    def __call__(self, completions: Sequence[str], answers: Sequence[str]) -> ScoreResult:
        items = list(zip(completions, answers))
        outcomes: dict[int, tuple] = {}
        if not self.timeout:
            for i, (c, a) in enumerate(items):
                outcomes[i] = _call(self.fn, c, a)
                if outcomes[i][0] == "stop":
                    break
        else:
            start = 0
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
                        f"and are still running (the latest on completion {_short(c)}, answer "
                        f"{_short(a)}): the reward function seems to hang; stopping the run "
                        "(fix it, or raise --reward-timeout)"
                    )
                start = hung + 1
        return self._result(items, outcomes)

    def _result(self, items: list[tuple[str, str]], outcomes: dict[int, tuple]) -> ScoreResult:
        res = ScoreResult(rewards=[])
        for i, (c, a) in enumerate(items):
            out = outcomes[i]
            kind = out[0]
            if kind == "stop":
                e = out[1]
                raise RewardError(
                    f"the reward function raised {type(e).__name__}({str(e)[:120]}) on "
                    f"completion {_short(c)} (answer {_short(a)}); stopping the run\n{out[2]}",
                    exit_code=130 if isinstance(e, KeyboardInterrupt) else 1,
                ) from e
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
                what = {
                    "raised": "raised",
                    "invalid": "returned an invalid reward",
                    "timeout": f"ran past the {self.timeout}s timeout (abandoned)",
                }[kind]
                res.messages.append(
                    f"reward function {what} on completion {_short(c)} (answer {_short(a)}); "
                    f"scored 0 and counted (only the first such failure is shown):\n{out[1]}"
                )
        if self.report is not None:
            for m in res.messages:
                self.report(m)
        return res


def _stack_of(thread: threading.Thread) -> str:
    """Where a hung reward call is stuck (its thread's current stack)."""
    frame = sys._current_frames().get(thread.ident)
    if frame is None:
        return "(the call finished just after the timeout)"
    stack = traceback.extract_stack(frame)
    inner = [i for i, f in enumerate(stack) if f.name == "_call" and f.filename == __file__]
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
    res = RewardScorer(fn, timeout)(completions, answers)
    return res.rewards, res.errors
