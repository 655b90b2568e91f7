"""Verifiable tasks: prompts with a known answer and a reward function that checks a completion.

Built-in tasks are generated on the fly from a seeded `random.Random`, so a run is reproducible
and never downloads anything:

- `add`: addition of two operands in 0..49, `"47+38="` -> `"85"`, exact-answer reward (the
  embedded default). Its supervised warm-up imitates a sloppy teacher whose answer is one too
  high 75% of the time (`warmup_noise`).
- `add_format`: the same sums, but the answer must be written as `"[85]"`; the reward is 0.2
  for the format plus 0.8 for the right number (`rewards.bracket_format`).
- `add_small`: single-digit addition (a fast variant for tests).
- `arith`: addition and subtraction of operands in 0..99, exact-answer reward.

A user task is a JSONL file, one `{"prompt": ..., "answer": ...}` object per line, scored by a
built-in reward name or a `module:function` (see `fastrl.train.rewards`).

`eval_accuracy` counts a completion as correct when its reward is >= 1 (the full reward of every
built-in reward function).
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass

from .rewards import RewardFn, resolve_reward

# eval prompts come from a random stream of their own (the prompts themselves may also be
# drawn for training: a built-in task's eval set measures the skill, it is not held out)
EVAL_SEED_OFFSET = 1_000_003


def prompt_stream(seed: int, rank: int) -> random.Random:
    """Rank `rank`'s stream of training prompts (a built-in task's draws): seeded by a string,
    so it is never the eval stream (seed + EVAL_SEED_OFFSET) or the warm-up's (seed + 17) of
    any seed. Its integer seed seed * 1_000_003 + rank was the eval stream's at seed 1, rank 1:
    rank 1 trained on the eval prompts, in order."""
    return random.Random(f"fastrl-prompts:{seed}:{rank}")


@dataclass(frozen=True)
class Example:
    """One prompt and the answer a reward function checks completions against."""

    prompt: str
    answer: str


class Task:
    """Base class: `sample` draws training examples, `eval_examples` is a fixed eval set,
    `target` is the supervised completion of an example (used by the optional warm-up)."""

    name: str = "task"
    reward_fn: RewardFn

    def sample(self, rng: random.Random, n: int, order: EpochOrder | None = None) -> list[Example]:
        """`n` training examples drawn with `rng`. `order` is the caller's sampler state for a
        task with a finite list of examples (JSONL): where this rank is in the shuffled epochs."""
        raise NotImplementedError

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        return self.sample(random.Random(seed + EVAL_SEED_OFFSET), n)

    def target(self, example: Example) -> str:
        return example.answer

    def warmup_examples(self, rng: random.Random, n: int) -> list[Example]:
        """Examples for the supervised warm-up (by default the training distribution)."""
        return self.sample(rng, n)

    def chars(self) -> str:
        """Every character prompts and targets may contain (checked against the tokenizer)."""
        return ""


class ArithmeticTask(Task):
    """`a+b=` (and `a-b=` when `ops` has `-`) with operands in 0..`hi` (default: every number
    of at most `digits` digits). Subtraction results are kept non-negative."""

    def __init__(
        self,
        name: str = "add",
        digits: int = 2,
        ops: str = "+",
        fmt: bool = False,
        hi: int | None = None,
        warmup_noise: float = 0.0,
    ):
        if digits < 1:
            raise ValueError(f"digits must be >= 1, got {digits}")
        self.name, self.digits, self.ops, self.fmt = name, digits, ops, fmt
        self.hi = 10**digits - 1 if hi is None else hi
        self.warmup_noise = warmup_noise
        if warmup_noise > 0:
            self.warmup_note = (
                f" imitating a sloppy teacher whose answer is one too high "
                f"{warmup_noise:.0%} of the time"
            )
        self.reward_fn = resolve_reward("bracket_format" if fmt else "exact_match")

    def sample(self, rng: random.Random, n: int, order: EpochOrder | None = None) -> list[Example]:
        """`n` fresh pairs from the generated stream (`order` is not used: it has no epochs)."""
        hi = self.hi
        out = []
        for _ in range(n):
            a, b, op = rng.randint(0, hi), rng.randint(0, hi), rng.choice(self.ops)
            if op == "-" and b > a:
                a, b = b, a  # non-negative results
            out.append(Example(f"{a}{op}{b}=", str(a + b if op == "+" else a - b)))
        return out

    def target(self, example: Example) -> str:
        return f"[{example.answer}]" if self.fmt else example.answer

    def warmup_examples(self, rng: random.Random, n: int) -> list[Example]:
        """Training examples whose answer is off by one (too high) with probability
        `warmup_noise`: a sloppy teacher that is right only part of the time, so that imitating
        it teaches the format and most of the skill but leaves greedy accuracy low."""
        out = []
        for ex in self.sample(rng, n):
            if rng.random() < self.warmup_noise:
                ex = Example(ex.prompt, str(int(ex.answer) + 1))
            out.append(ex)
        return out

    def chars(self) -> str:
        return "0123456789=" + self.ops + ("[]" if self.fmt else "")


class EpochOrder:
    """Where one rank is in a finite task's shuffled epochs, the same epochs on every rank.

    The epochs form one stream of line indices: epoch e is a permutation of range(lines) drawn
    from (seed, e) alone, so every rank computes the same one, and rank r of `world` takes the
    stream's positions r, r + world, r + 2 * world, ...  The ranks thus split each epoch
    between them: together they draw every line once before any line again (as TRL's sampler
    splits one shuffled order over its processes), and no two ranks draw the same line of an
    epoch. `drawn` (how many positions this rank has taken) is the whole state a checkpoint
    keeps; the permutation of the current epoch is a cache."""

    def __init__(self, seed: int, rank: int = 0, world: int = 1, drawn: int = 0):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, world={world}), got {rank}")
        self.seed, self.rank, self.world, self.drawn = seed, rank, world, drawn
        self._epoch: tuple[int, int, list[int]] | None = None  # (epoch, lines, permutation)

    def epoch(self, e: int, lines: int) -> list[int]:
        """Epoch `e`'s permutation of range(lines) (the same on every rank)."""
        if self._epoch is None or self._epoch[:2] != (e, lines):
            perm = list(range(lines))
            random.Random(f"fastrl-epoch:{self.seed}:{e}").shuffle(perm)
            self._epoch = (e, lines, perm)
        return self._epoch[2]

    def take(self, n: int, lines: int) -> list[int]:
        """This rank's next `n` line indices (of `lines`), advancing `drawn`."""
        if lines < 1:
            raise ValueError("a task with no lines has nothing to draw")
        out = []
        for _ in range(n):
            e, i = divmod(self.rank + self.world * self.drawn, lines)
            out.append(self.epoch(e, lines)[i])
            self.drawn += 1
        return out


class JsonlTask(Task):
    """A user task: `{"prompt": str, "answer": str}` per line; prompts drawn in shuffled epochs
    (every line once before any line again, as TRL's sampler does; `sample`)."""

    def __init__(self, path: str, reward: str | RewardFn = "exact_match"):
        self.name = os.path.basename(path)
        self.path = path
        self.reward_fn = resolve_reward(reward)
        self.examples = load_jsonl(path)

    def sample(self, rng: random.Random, n: int, order: EpochOrder | None = None) -> list[Example]:
        """`n` examples in shuffled epochs: this rank's next `n` lines of `order` (advanced in
        place; `rng` is not used). Without `order`: n independent uniform draws of `rng`."""
        if order is None:
            return [rng.choice(self.examples) for _ in range(n)]
        return [self.examples[i] for i in order.take(n, len(self.examples))]

    def eval_examples(self, n: int, seed: int) -> list[Example]:
        return self.examples[:n]

    def hold_out(self, fraction: float, max_n: int, seed: int) -> list[Example]:
        """Remove round(fraction * lines) lines (at least 1, at most max_n; a seeded shuffle)
        from the training lines and return them as a held-out eval set; none when fraction is
        0 or the file has fewer than 2 lines (nothing would be left to train on)."""
        n = len(self.examples)
        if fraction <= 0 or n < 2:
            return []
        k = min(max_n, max(1, round(fraction * n)), n - 1)
        order = list(range(n))
        random.Random(seed + EVAL_SEED_OFFSET).shuffle(order)
        held = set(order[:k])
        out = [self.examples[i] for i in sorted(held)]
        self.examples = [e for i, e in enumerate(self.examples) if i not in held]
        return out


def load_jsonl(path: str, what: str = "--task file") -> list[Example]:
    """Examples from a JSONL file (UTF-8); a malformed line (not UTF-8, not JSON, no prompt or an
    empty one, no answer) raises ValueError naming the file and the line number. `what`: the
    file's name in the errors about the whole file (the option it came from)."""
    if not os.path.exists(path):
        raise ValueError(f"{what} {path!r} does not exist")
    if not os.path.isfile(path):
        raise ValueError(f"{what} {path!r} is not a file")
    examples = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{what} {path!r} cannot be read: {e.strerror}") from e
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # a BOM is fine
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not UTF-8 text (byte {raw[e.start : e.start + 1]!r} at "
                    f"column {e.start + 1}); save the file as UTF-8"
                ) from e
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from e
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise ValueError(
                    f'{path}:{lineno}: expected an object {{"prompt": str, "answer": ...}}'
                )
            if not obj["prompt"]:
                raise ValueError(f'{path}:{lineno}: empty "prompt" (expected a non-empty string)')
            if "answer" not in obj or obj["answer"] is None:
                raise ValueError(f'{path}:{lineno}: missing "answer"')
            examples.append(Example(obj["prompt"], str(obj["answer"])))
    if not examples:
        raise ValueError(f"{what} {path!r} has no examples")
    return examples


BUILTIN_TASKS = {
    "add": lambda: ArithmeticTask("add", digits=2, ops="+", hi=49, warmup_noise=0.75),
    "add_format": lambda: ArithmeticTask(
        "add_format", digits=2, ops="+", fmt=True, hi=49, warmup_noise=0.75
    ),
    "arith": lambda: ArithmeticTask("arith", digits=2, ops="+-"),
    "add_small": lambda: ArithmeticTask("add_small", digits=1, ops="+", warmup_noise=0.75),
}


def get_task(spec: str, reward: str | RewardFn | None = None) -> Task:
    """A built-in task by name, or a JSONL task from a path ending in .jsonl."""
    if spec in BUILTIN_TASKS:
        task = BUILTIN_TASKS[spec]()
        if reward is not None:
            task.reward_fn = resolve_reward(reward)
        return task
    if spec.endswith(".jsonl") or os.path.isfile(spec):
        return JsonlTask(spec, reward or "exact_match")
    raise ValueError(
        f"unknown task {spec!r}: use a built-in task {sorted(BUILTIN_TASKS)} or a path to a "
        '.jsonl file with one {"prompt": ..., "answer": ...} object per line'
    )
