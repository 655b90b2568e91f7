"""--reward-timeout stops any reward call: a `module:function` reward runs in a persistent worker
process that is killed and restarted when a call runs past the timeout, so a call that holds the
GIL (a catastrophically backtracking regex, a pure-Python loop) no longer stalls the run or keeps
running in the background. Callables no other process can import fall back to a thread, saying
that a GIL-holding call cannot be stopped there."""

import gc
import os
import subprocess
import sys
import time

import pytest
from tiny_run import TINY

from fastrl.train.rewards import MAX_HUNG_CALLS, RewardError, RewardScorer, exact_match
from fastrl.train.trainer import read_metrics

REWARDS = '''
import os
import re
import time

calls = [0]


def regex_bomb(completion, answer):
    """Call 9 of a worker (the first of RL step 1: 8 eval calls come first) backtracks inside
    re for hours, holding the GIL all along; every other call scores 0.5."""
    calls[0] += 1
    if calls[0] == 9:
        re.match(r"(a+)+$", "a" * 40 + "b")
    return 0.5


def spin(completion, answer):
    """'spin' loops in pure Python (for 20 s at most), appending a tick to the file named by
    the answer every 20 ms; anything else scores 1."""
    if completion != "spin":
        return 1.0
    end, last = time.monotonic() + 20, 0.0
    while time.monotonic() < end:
        if time.monotonic() - last > 0.02:
            last = time.monotonic()
            with open(answer, "a") as f:
                f.write(".")
    return 1.0


def always_spins(completion, answer):
    end = time.monotonic() + 20
    while time.monotonic() < end:
        pass
    return 1.0


def pid(completion, answer):
    return float(os.getpid() % 100_000)
'''


@pytest.fixture
def rw(tmp_path, monkeypatch):
    """The module above as `rw_trust` in tmp_path (the cwd), imported; forgotten afterwards."""
    (tmp_path / "rw_trust.py").write_text(REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("rw_trust", None)
    import rw_trust

    yield rw_trust
    sys.modules.pop("rw_trust", None)


def test_a_backtracking_regex_is_stopped_and_the_run_goes_on(rw, tmp_path):
    """In a thread, this call held the GIL for hours: the timeout never fired and the run
    stalled (the subprocess limit below fails the test)."""
    out = tmp_path / "run"
    args = ["--reward", "rw_trust:regex_bomb", "--reward-timeout", "1", "--steps", "1"]
    cmd = [sys.executable, "-m", "fastrl.cli", "train", *args, "--eval-every", "100"]
    try:
        proc = subprocess.run(
            [*cmd, "--out", str(out), *TINY],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the run stalled on a reward call that holds the GIL")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = proc.stdout
    assert "ran past the 1.0s timeout (stopped)" in text, text
    assert 're.match(r"(a+)+$", "a" * 40 + "b")' in text  # where the call was stopped
    assert "1 ran past --reward-timeout 1s" in text
    (rec,) = [r for r in read_metrics(str(out / "metrics.jsonl")) if r["step"]]
    assert rec["reward_timeouts"] == 1
    assert rec["reward_mean"] == pytest.approx(0.5 * 7 / 8)


def test_a_pure_python_loop_is_stopped_not_left_running(rw, tmp_path):
    ticks = tmp_path / "ticks"
    scorer = RewardScorer(rw.spin, timeout=0.5)
    t0 = time.monotonic()
    res = scorer(["a", "spin", "b"], ["x", str(ticks), "y"])
    assert time.monotonic() - t0 < 15
    assert res.rewards == [1.0, 0.0, 1.0] and res.timeouts == 1 and res.errors == 1
    assert ticks.stat().st_size > 0  # it did run
    time.sleep(0.3)
    size = ticks.stat().st_size
    time.sleep(0.5)
    assert ticks.stat().st_size == size  # and runs no more (a thread would still tick)
    scorer.close()


def test_a_reward_that_hangs_on_every_input_stops_the_run(rw):
    scorer = RewardScorer(rw.always_spins, timeout=0.2)
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=f"{MAX_HUNG_CALLS + 1} reward calls in a row"):
        scorer(["x"] * 10, ["y"] * 10)
    assert time.monotonic() - t0 < 15
    scorer.close()


def test_one_persistent_worker_restarted_only_after_a_timeout(rw, tmp_path):
    notes = []
    scorer = RewardScorer(rw.pid, timeout=5, report=notes.append)
    first = scorer.pid
    assert first is not None and first != os.getpid()
    t0 = time.monotonic()
    for _ in range(3):  # no process per call or per batch
        res = scorer(["c"] * 300, ["a"] * 300)
        assert res.rewards == [float(first % 100_000)] * 300 and scorer.pid == first
    assert time.monotonic() - t0 < 5
    assert notes == []
    # after a timeout the rest of the batch runs in a new worker
    spin = RewardScorer(rw.spin, timeout=0.3)
    before = spin.pid
    res = spin(["spin", "a"], [str(tmp_path / "t"), "b"])
    assert res.rewards == [0.0, 1.0] and spin.pid not in (None, before)
    # close() and garbage collection end the worker
    spin.close()
    assert spin.pid is None
    pid, scorer = scorer.pid, None
    gc.collect()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_callables_a_process_cannot_import_run_in_a_thread_and_say_so(rw, tmp_path):
    notes = []
    lam = RewardScorer(lambda c, a: 0.25, timeout=1, report=notes.append)
    assert lam.pid is None and lam(["x"], ["y"]).rewards == [0.25]
    assert len(notes) == 1 and "cannot stop a call of it that holds the GIL" in notes[0]
    assert "lambda" in notes[0] and "module:function" in notes[0]
    builtin = RewardScorer(exact_match, timeout=1, report=notes.append)  # linear time
    assert builtin.pid is None and builtin(["1"], ["1"]).rewards == [1.0] and len(notes) == 1
    # a module the worker cannot import: the scorer falls back to a thread, saying why
    (tmp_path / "rw_parent_only.py").write_text(
        "import os\nif os.getpid() != int(os.environ['RW_PARENT']):\n"
        "    raise ImportError('only in the parent')\n"
        "def half(completion, answer):\n    return 0.5\n"
    )
    os.environ["RW_PARENT"] = str(os.getpid())
    try:
        import rw_parent_only

        scorer = RewardScorer(rw_parent_only.half, timeout=1, report=notes.append)
        assert scorer(["x", "y"], ["a", "b"]).rewards == [0.5, 0.5]
    finally:
        del os.environ["RW_PARENT"]
        sys.modules.pop("rw_parent_only", None)
    assert scorer.pid is None
    assert "could not import it" in notes[-1] and "ImportError: only in the parent" in notes[-1]


def test_the_cli_help_says_what_the_timeout_can_stop(capsys):
    from fastrl.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "runs in a worker process" in help_text and "holds the GIL" in help_text
    assert "cannot be stopped" in help_text
