"""The trainer fails loudly, never silently (issue 10, items 8-10): non-finite losses stop the run
naming the step, corrupt checkpoints are skipped naming the file, reward failures are shown,
hanging rewards time out, SystemExit / KeyboardInterrupt in a reward stop the run with a
checkpoint, all-zero rewards are called out, `module:function` rewards import from the current
directory, and an existing run is never silently overwritten."""

import json
import os
import shutil
import sys
import threading
import time

import pytest
import tiny_run
import torch
from safetensors.torch import load_file, save_file
from tiny_run import TINY

from fastrl.cli import main
from fastrl.train import checkpoint as ckpt_io
from fastrl.train.config import TrainConfig
from fastrl.train.rewards import MAX_HUNG_CALLS, RewardError, RewardScorer, resolve_reward, score
from fastrl.train.trainer import Trainer, TrainingError, read_metrics


def tiny(out, **kw) -> TrainConfig:
    return tiny_run.tiny(out, **{"eval_every": 100, **kw})


def steps_of(out) -> list[int]:
    return [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]


def ckpt_dirs(out) -> list[str]:
    root = os.path.join(out, "checkpoints")
    return sorted(d for d in os.listdir(root) if d.startswith("step-"))


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """Write a reward module `name` with `source` into tmp_path, which becomes the cwd (the
    module is found there, as with `python -m`); forgotten again afterwards."""
    names = []

    def make(name: str, source: str) -> str:
        (tmp_path / f"{name}.py").write_text(source)
        sys.modules.pop(name, None)
        names.append(name)
        return name

    monkeypatch.chdir(tmp_path)
    yield make
    for name in names:
        mod = sys.modules.pop(name, None)
        if mod is not None and hasattr(mod, "release"):
            mod.release.set()  # let a hung reward thread finish


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A finished 2-step run with checkpoints at steps 1 and 2 (copied by each test)."""
    out = tmp_path_factory.mktemp("pristine") / "run"
    Trainer(tiny(out, steps=2, save_every=1), log=lambda *a: None).train()
    return out


# ----------------------------------------------------------------------- item 8
def test_nonfinite_loss_stops_at_the_step_keeping_the_last_good_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """A NaN that appears in training stops the run at that step (exit 1, message naming the
    step), found in the update's one metrics read; the NaN step is never saved."""
    update = Trainer.update

    def poisoned(self, batch):
        if self.step == 1:  # during RL step 2
            with torch.no_grad():
                next(self.policy.parameters()).fill_(float("nan"))
        return update(self, batch)

    monkeypatch.setattr(Trainer, "update", poisoned)
    out = tmp_path / "run"
    rc = main(["train", "--steps", "3", "--save-every", "1", "--out", str(out), *TINY])
    err = capsys.readouterr().err
    assert rc == 1
    assert "step 2: non-finite loss nan" in err and "policy gradient norm nan" in err
    assert "step-000001" in err  # the last good checkpoint is named
    assert ckpt_dirs(out) == ["step-000001"]
    assert ckpt_io.latest_checkpoint(str(out / "checkpoints")).endswith("step-000001")
    assert steps_of(out) == [0, 1]
    assert (out / "curves.png").is_file()  # the curves of the steps before it, to debug from
    # weights that turn non-finite with a finite loss (e.g. NaN optimizer state) are not saved
    t = Trainer(tiny(tmp_path / "other", steps=1), log=lambda *a: None)
    t.setup()
    with torch.no_grad():
        next(t.policy.parameters())[0] = float("inf")
    with pytest.raises(TrainingError, match="non-finite"):
        t.save()
    assert not os.path.exists(tmp_path / "other" / "checkpoints")


def _nan_weights(path):
    sd = load_file(str(path))
    name = next(iter(sd))
    sd[name] = torch.full_like(sd[name], float("nan"))
    save_file(sd, str(path))


@pytest.mark.parametrize(
    "bad_file, corrupt, reason",
    [
        ("policy.safetensors", _nan_weights, "non-finite (NaN / inf) weights"),
        ("policy.safetensors", lambda p: p.write_bytes(p.read_bytes()[:100]), "unreadable"),
        ("ref.safetensors", lambda p: p.unlink(), "missing"),
        ("optimizer.pt", lambda p: p.write_bytes(p.read_bytes()[:1000]), "unreadable"),
        ("state.json", lambda p: p.write_text('{"step": 2, "rng'), "not valid JSON"),
        ("state.json", lambda p: p.write_text("[1, 2]"), "not a checkpoint state"),
    ],
)
def test_resume_falls_back_to_the_newest_intact_checkpoint(
    two_step_run, tmp_path, capsys, bad_file, corrupt, reason
):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    corrupt(out / "checkpoints" / "step-000002" / bad_file)
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "rew')  # a record cut short by a crash: dropped, with a note
    rc = main(["train", "--resume", str(out), "--steps", "3", "--progress", "false"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert f"step-000002/{bad_file}: {reason}" in text
    assert "fell back to" in text and "resumed from" in text and "step-000001 at step 1" in text
    assert "metrics.jsonl:4" in text
    assert steps_of(out) == [0, 1, 2, 3]  # steps 2 and 3 trained again from step 1
    assert ckpt_io.latest_checkpoint(str(out / "checkpoints")).endswith("step-000003")


def test_resume_with_no_intact_checkpoint_and_garbage_run_files(two_step_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    for step in ("step-000001", "step-000002"):
        _nan_weights(out / "checkpoints" / step / "policy.safetensors")
    (out / "checkpoints" / "latest").write_text("garbage")
    rc = main(["train", "--resume", str(out), "--steps", "3", "--progress", "false"])
    captured = capsys.readouterr()
    assert rc == 2
    assert "checkpoints/latest is unreadable" in captured.out
    assert "no intact checkpoint to resume from" in captured.err
    assert captured.err.count("non-finite (NaN / inf) weights") == 2
    assert steps_of(out) == [0, 1, 2]  # nothing was touched
    # a garbage config.json / one with an impossible value: errors that name the file
    (out / "config.json").write_text("{not json")
    assert main(["train", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'config.json'} is not valid JSON" in err
    (out / "config.json").write_text(json.dumps({"steps": "many"}))
    assert main(["train", "--resume", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'config.json'}: --steps='many' is invalid" in err


# ----------------------------------------------------------------------- item 9
FLAKY = """
calls = [0]

def flaky(completion, answer):
    calls[0] += 1
    k = calls[0] % 5
    if k == 1:
        raise RuntimeError("boom in the user's reward")
    if k == 2:
        return float("inf")
    if k == 3:
        return 2e6
    if k == 4:
        return None
    return 1.0
"""


@pytest.mark.parametrize("sft_steps", [1, 3])
def test_a_nonfinite_supervised_warm_up_stops_before_any_eval(tmp_path, capsys, sft_steps):
    """A warm-up whose learning rate blows the weights up stops right after it, naming
    --sft-lr / --sft-steps: no eval of the broken model is logged and RL step 1 is not blamed.
    With one step the loss printed was the one before the update (finite): the weights it left
    are checked too."""
    out = tmp_path / "run"
    args = ["train", "--out", str(out), *TINY, "--sft-steps", str(sft_steps), "--sft-lr", "1e30"]
    rc = main(args)
    err = capsys.readouterr().err
    assert rc == 1
    assert "supervised warm-up" in err and "--sft-lr" in err and "non-finite" in err
    assert "step 1: non-finite" not in err
    metrics = out / "metrics.jsonl"
    assert not metrics.exists() or steps_of(out) == []


def test_reward_failures_are_shown_counted_and_never_reach_the_loss(reward_module, tmp_path):
    name = reward_module("rw_flaky", FLAKY)
    lines = []
    t = Trainer(tiny(tmp_path / "run", reward=f"{name}:flaky", steps=2), log=lines.append)
    t.train()
    text = "\n".join(lines)
    # the first failure of each kind, once, with its traceback / value
    assert text.count("Traceback") == 1 and "RuntimeError: boom in the user's reward" in text
    assert text.count("returned an invalid reward") == 1 and "returned inf" in text
    # a warning line per step, with the failures by kind
    for step in (1, 2):
        assert any(
            line.startswith(f"warning: step {step}: ") and "reward calls failed" in line
            for line in lines
        ), text
    assert "raised" in text and "non-finite or |r| > 1e+06" in text
    recs = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["step"] > 0]
    for r in recs:
        assert r["reward_errors"] >= 6  # 8 calls a step, 4 of every 5 fail
        assert all(torch.isfinite(torch.tensor(v)) for k, v in r.items() if k != "batch_full")
    # the scorer: inf, NaN, |r| > MAX_ABS_REWARD, a non-number all score 0 and are counted
    res = RewardScorer(lambda c, a: {"i": float("-inf"), "n": float("nan"), "h": -1e7}.get(c, c))(
        ["i", "n", "h", "x", 0.5], ["", "", "", "", ""]
    )
    assert res.rewards == [0.0, 0.0, 0.0, 0.0, 0.5] and res.invalid == 4 and res.raised == 0
    # a numeric string is not a number (float("1") would parse it); a bool is 0 / 1
    res = RewardScorer(lambda c, a: {"s": "1", "b": b"1", "t": True}[c])(["s", "b", "t"], [""] * 3)
    assert res.rewards == [0.0, 0.0, 1.0] and res.invalid == 2


HANGING = """
import threading
release = threading.Event()
calls = [0]

def first_call_hangs(completion, answer):
    calls[0] += 1
    if calls[0] == 9:  # the first call of RL step 1 (8 eval calls come first)
        release.wait(60)
    return 0.5
"""


def test_a_hanging_reward_call_times_out(reward_module, tmp_path):
    name = reward_module("rw_hang", HANGING)
    lines = []
    cfg = tiny(tmp_path / "run", reward=f"{name}:first_call_hangs", reward_timeout=0.3, steps=1)
    t0 = time.perf_counter()
    Trainer(cfg, log=lines.append).train()
    assert time.perf_counter() - t0 < 30
    text = "\n".join(lines)
    assert "ran past the 0.3s timeout" in text and "release.wait(60)" in text  # where it hangs
    assert "1 ran past --reward-timeout 0.3s" in text
    (rec,) = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if r["step"]]
    assert rec["reward_timeouts"] == 1 and rec["reward_errors"] == 1
    assert rec["reward_mean"] == pytest.approx(0.5 * 7 / 8)
    # a reward that hangs on every call: after MAX_HUNG_CALLS abandoned calls the run stops
    release = threading.Event()
    scorer = RewardScorer(lambda c, a: release.wait(60), timeout=0.05)
    try:
        with pytest.raises(RewardError, match="seems to hang"):
            scorer(["x"] * 10, ["y"] * 10)
        assert len(scorer._hung) == MAX_HUNG_CALLS + 1
    finally:
        release.set()
    # timeout 0: in the calling thread, no limit
    assert score(lambda c, a: threading.current_thread().name == "MainThread", ["a"], ["b"], 0) == (
        [1.0],
        0,
    )


EXITING = """
from fastrl.train.rewards import exact_match
calls = [0]

def exits(completion, answer):
    calls[0] += 1
    if calls[0] > 16:  # 8 eval calls, 8 in RL step 1, then RL step 2
        raise SystemExit(3)
    return exact_match(completion, answer)

def interrupts(completion, answer):
    calls[0] += 1
    if calls[0] > 16:
        raise KeyboardInterrupt
    return exact_match(completion, answer)
"""


@pytest.mark.parametrize("fn, exc, code", [("exits", "SystemExit", 1), ("interrupts", "Key", 130)])
def test_systemexit_in_the_reward_stops_the_run_with_a_checkpoint(
    reward_module, tmp_path, capsys, fn, exc, code
):
    name = reward_module(f"rw_exit_{fn}", EXITING)
    out = tmp_path / "run"
    args = ["--steps", "3", "--save-every", "0", "--eval-every", "100", *TINY]
    rc = main(["train", "--reward", f"{name}:{fn}", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert rc == code
    assert f"step 2: the reward function raised {exc}" in err
    assert "checkpoint of step 1 saved" in err and f"--resume {out}" in err
    assert ckpt_dirs(out) == ["step-000001"] and steps_of(out) == [0, 1]
    # that checkpoint is the one an uninterrupted run writes at step 1 (exact resume)
    ref = tmp_path / "ref"
    assert main(["train", "--out", str(ref), "--steps", "2", "--save-every", "1", *args[4:]]) == 0
    a, b = out / "checkpoints" / "step-000001", ref / "checkpoints" / "step-000001"
    sa, sb = (json.loads((d / "state.json").read_text()) for d in (a, b))
    assert sa["rng"] == sb["rng"] and sa["step"] == sb["step"] == 1
    for f in ("policy.safetensors", "ref.safetensors"):
        assert (a / f).read_bytes() == (b / f).read_bytes()


EXITS_IN_STEP_1 = """
import os
from fastrl.train.rewards import exact_match
calls = [0]

def exits(completion, answer):
    calls[0] += 1
    if calls[0] > 8 and os.path.exists("exit-flag"):  # 8 eval calls at step 0, then RL step 1
        raise SystemExit(3)
    return exact_match(completion, answer)
"""


def test_resuming_from_a_step_0_checkpoint_logs_step_0_once(reward_module, tmp_path, capsys):
    """A reward that stops the run in step 1 leaves a checkpoint of step 0; its resume kept the
    step-0 eval record and evaluated step 0 again: metrics.jsonl held step 0 twice (an audit
    helper's find). The resume now rewrites it, as it rewrites what came after a checkpoint."""
    name = reward_module("rw_exits_in_step_1", EXITS_IN_STEP_1)
    (tmp_path / "exit-flag").write_text("")
    out = tmp_path / "run"
    args = ["--steps", "2", "--save-every", "0", "--eval-every", "100", *TINY]
    assert main(["train", "--reward", f"{name}:exits", "--out", str(out), *args]) == 1
    assert "checkpoint of step 0 saved" in capsys.readouterr().err
    assert ckpt_dirs(out) == ["step-000000"] and steps_of(out) == [0]
    (tmp_path / "exit-flag").unlink()
    assert main(["train", "--resume", str(out)]) == 0
    assert steps_of(out) == [0, 1, 2]


def test_all_zero_rewards_are_called_out(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "never"}\n')
    lines = []
    Trainer(tiny(tmp_path / "run", task=str(f), steps=2), log=lines.append).train()
    assert "warning: step 1: every reward is 0 (8 samples)" in lines
    assert "warning: step 2: every reward is 0 (8 samples)" in lines
    assert lines[-1].startswith("warning: every reward of this run was 0 (16 samples over 2")


# ----------------------------------------------------------------------- item 10
def test_reward_module_found_in_the_current_directory(reward_module, tmp_path, capsys):
    name = reward_module("rw_in_cwd", "def half(completion, answer):\n    return 0.5\n")
    path_before = list(sys.path)
    assert resolve_reward(f"{name}:half")("x", "y") == 0.5
    assert sys.path == path_before  # the cwd was on sys.path for that import only
    sys.modules.pop(name)
    out = tmp_path / "run"
    rc = main(["train", "--reward", f"{name}:half", "--steps", "1", "--out", str(out), *TINY])
    assert rc == 0, capsys.readouterr().err
    assert read_metrics(str(out / "metrics.jsonl"))[-1]["reward_mean"] == 0.5
    with pytest.raises(ValueError, match="importable from the current directory"):
        resolve_reward("rw_no_such_module:f")


def test_out_of_an_existing_run_is_refused_unless_forced(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--save-every", "1", "--out", str(out), *TINY]
    assert main(["train", "--steps", "2", *args]) == 0
    before = (out / "metrics.jsonl").read_text()
    capsys.readouterr()
    assert main(["train", "--steps", "1", *args]) == 2
    err = capsys.readouterr().err
    assert f"--out '{out}' already holds a run" in err and "--force" in err
    assert (out / "metrics.jsonl").read_text() == before  # untouched
    assert ckpt_dirs(out) == ["step-000001", "step-000002"]
    # --force (a bare flag) starts over: nothing of the old run is left
    assert main(["train", "--steps", "1", "--force", *args]) == 0
    assert steps_of(out) == [0, 1] and ckpt_dirs(out) == ["step-000001"]
    assert json.loads((out / "config.json").read_text())["steps"] == 1
    # a directory without a run's files is fine
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    assert main(["train", "--steps", "1", "--out", str(other), *TINY]) == 0
    assert (other / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(
    "flags, named",
    [(["--sft-steps", "0", "--max-new-tokens", "6"], "--max-new-tokens 6"),
     (["--sft-steps", "1", "--max-new-tokens", "1"], "--sft-steps 1")],
)  # fmt: skip
def test_too_few_learned_positions_is_a_bad_option(tmp_path, capsys, flags, named):
    """A model with learned absolute positions (GPT-2's wpe, 8 of them) asked for more: exit 2
    naming the option, not an IndexError from deep inside its embedding (exit 1). Generation
    and the warm-up's prompt + target are both checked; rotary models are not (they
    extrapolate)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from fastrl.train.rollout import default_tokenizer, position_limit

    tok = default_tokenizer()
    config = GPT2Config(vocab_size=len(tok), n_positions=8, n_embd=16, n_layer=1, n_head=2,
                        eos_token_id=1, pad_token_id=0, bos_token_id=None)  # fmt: skip
    model = GPT2LMHeadModel(config)
    assert position_limit(model) == 8
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    args = ["train", "--model", str(tmp_path / "m"), "--steps", "1", "--batch-size", "2",
            "--group-size", "2", "--eval-size", "4", "--progress", "false", "--num-threads", "1",
            "--out", str(tmp_path / "o"), *flags]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert named in err and "8 learned positions" in err, err
    from fastrl.train.rollout import default_model

    assert position_limit(default_model(len(tok), 0, 16, 1)) is None  # rotary: no limit
