"""Reward functions for verifiable tasks: pure string functions, never `eval()` of model text.

A reward function has the signature `fn(completion: str, answer: str) -> float`. Built-ins are
looked up by name in `REWARDS`; a user function is given as `module:function` and imported.
`score` runs a reward function over a batch and turns any exception into a reward of 0,
counting it, so that one bad completion (or a buggy user function) never stops a run.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Sequence

RewardFn = Callable[[str, str], float]

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
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"reward {spec!r}: cannot import module {module_name!r} ({e})") from e
    fn = getattr(module, fn_name, None)
    if not callable(fn):
        raise ValueError(f"reward {spec!r}: module {module_name!r} has no function {fn_name!r}")
    return fn


def score(
    fn: RewardFn, completions: Sequence[str], answers: Sequence[str]
) -> tuple[list[float], int]:
    """Rewards of `completions` against `answers` with `fn`, and the number of calls that raised
    or returned something that is not a finite number (those score 0)."""
    rewards, errors = [], 0
    for completion, answer in zip(completions, answers):
        try:
            r = float(fn(completion, answer))
            if not math.isfinite(r):
                raise ValueError(f"non-finite reward {r}")
        except Exception:
            r, errors = 0.0, errors + 1
        rewards.append(r)
    return rewards, errors
