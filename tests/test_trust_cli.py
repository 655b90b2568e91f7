"""`fastrl train` as users meet it: Ctrl-C / SIGTERM stop after the step with a checkpoint and
say how to resume, the final summary counts the steps this process ran, TRL's option names are
aliases, `--config FILE` sets any option, the `add` task is what the README says, an --out that
holds a run (or cannot be created) is refused before the model loads, `--version`, and bad task
files exit 2 naming the file and line."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import tiny_run
from tiny_run import TINY, TINY_FIELDS

import fastrl
from fastrl.cli import build_parser, config_from_args, main
from fastrl.train import checkpoint as ckpt_io
from fastrl.train.config import TrainConfig
from fastrl.train.tasks import get_task
from fastrl.train.trainer import Trainer, read_metrics

README = os.path.join(os.path.dirname(__file__), os.pardir, "README.md")


def parse(*args: str):
    """The TrainConfig that `fastrl train ARGS` would run (nothing is loaded)."""
    return config_from_args(build_parser().parse_args(["train", *args]))


def steps_of(out) -> list[int]:
    return [r["step"] for r in read_metrics(os.path.join(out, "metrics.jsonl"))]


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """`fastrl train ARGS` in this process: (exit code, stdout, stderr); argparse's own exits
    count as exit codes."""
    try:
        rc = main(["train", *args])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def no_model_load(monkeypatch):
    """Records every model load (the list stays empty when --out is refused up front)."""
    loads = []
    original = Trainer._load_models

    def spy(self):
        loads.append(self.cfg.out)
        return original(self)

    monkeypatch.setattr(Trainer, "_load_models", spy)
    return loads


# ----------------------------------------------------------------------- SIGINT / SIGTERM
def start(args: list[str], cwd) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fastrl.cli", "train", *args]
    return subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(proc: subprocess.Popen, ready, timeout: float = 180.0) -> None:
    """Poll `ready()` until it is true; fail with the process's output if it exits first."""
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"fastrl train exited early ({proc.returncode}):\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("fastrl train did not get there in time")
        time.sleep(0.1)


def logged_a_step(out) -> bool:
    try:
        return any(s >= 1 for s in steps_of(out))
    except (OSError, ValueError, KeyError):  # not there yet, or a line being written
        return False


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_finishes_the_step_saves_it_and_says_how_to_resume(tmp_path, capsys, sig, code):
    out = tmp_path / "run"
    args = ["--out", str(out), "--steps", "1000", "--save-every", "0", "--eval-every", "1000"]
    proc = start([*args, *TINY], tmp_path)
    wait_for(proc, lambda: logged_a_step(out))
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "Traceback" not in err
    name = signal.Signals(sig).name
    assert f"{name} received: finishing the current step" in err
    # --save-every 0 saves nothing periodically: this checkpoint is the interrupt's, of the
    # last step logged
    ckpt = ckpt_io.latest_checkpoint(str(out / "checkpoints"))
    assert ckpt is not None
    step = json.loads(open(os.path.join(ckpt, "state.json")).read())["step"]
    assert step >= 1 and steps_of(out)[-1] == step
    assert f"{name}: stopped after step {step}; checkpoint saved in {ckpt}" in err
    assert f"resume with: fastrl train --resume {out}\n" in err
    if sig != signal.SIGINT:
        return
    # the printed command continues from that checkpoint (here with --steps to end soon)
    assert main(["train", "--resume", str(out), "--steps", str(step + 2)]) == 0
    assert steps_of(out) == list(range(step + 3))
    assert f"for 2 steps (steps {step + 1}-{step + 2})" in capsys.readouterr().out


SLOW_REWARD = """\
import os, time


def slow(completion, answer):
    # the first reward call of step 1 (metrics.jsonl holds the step-0 eval) takes 6 s
    if os.path.exists({metrics!r}) and not os.path.exists({marker!r}):
        open({marker!r}, "w").close()
        time.sleep(6)
    return 0.0
"""


def test_sigterm_to_the_process_group_lets_the_reward_call_finish(tmp_path):
    """GNU timeout, slurm and `kill -- -PGID` send SIGTERM to the whole process group: the
    reward worker process ignored only SIGINT, so it died mid-call, and the step the trainer
    finished (and checkpointed) trained on a failed call's reward of 0 ("1 of 64 reward calls
    failed"). The worker leaves SIGTERM to the trainer now: the call finishes."""
    out, marker = tmp_path / "run", tmp_path / "in-step-1"
    source = SLOW_REWARD.format(metrics=str(out / "metrics.jsonl"), marker=str(marker))
    (tmp_path / "slow_reward.py").write_text(source)
    args = ["--reward", "slow_reward:slow", "--reward-timeout", "60", "--steps", "5"]
    cmd = [sys.executable, "-m", "fastrl.cli", "train", *args, "--save-every", "0",
           "--out", str(out), *TINY]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        wait_for(proc, marker.exists)  # step 1's slow call is under way in the worker
        os.killpg(proc.pid, signal.SIGTERM)
        out_text, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, err
    assert "SIGTERM received: finishing the current step" in err
    assert "SIGTERM: stopped after step 1" in err
    assert "died" not in out_text + err and "failed" not in out_text + err, out_text


def test_a_second_interrupt_aborts_at_once(tmp_path):
    out, marker = tmp_path / "run", tmp_path / "in-step-1"
    source = SLOW_REWARD.format(metrics=str(out / "metrics.jsonl"), marker=str(marker))
    (tmp_path / "slow_reward.py").write_text(source)
    args = ["--reward", "slow_reward:slow", "--reward-timeout", "60", "--steps", "5"]
    proc = start([*args, "--save-every", "0", "--out", str(out), *TINY], tmp_path)
    wait_for(proc, marker.exists)  # step 1 is under way, for 6 s
    proc.send_signal(signal.SIGINT)
    time.sleep(1.5)  # a second Ctrl-C, not the first one delivered twice
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err
    assert "SIGINT: aborted at once in step 1; no checkpoint was saved" in err
    assert steps_of(out) == [0]  # step 1 never finished
    assert not os.path.isdir(out / "checkpoints")


def test_a_signal_before_the_rl_steps_aborts_at_once(tmp_path):
    out = tmp_path / "run"
    fields = dict(TINY_FIELDS, sft_steps=1_000_000)  # a warm-up that would take hours
    proc = start(["--out", str(out), *tiny_run.cli_args(fields)], tmp_path)
    wait_for(proc, lambda: os.path.isdir(out))  # train() has started: the warm-up is next
    time.sleep(1.0)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    assert "SIGTERM: aborted at once before the RL steps; no checkpoint was saved" in err


def test_a_signal_while_the_curves_are_drawn_lets_the_finished_run_end(tmp_path, monkeypatch,
                                                                      capfd):  # fmt: skip
    """A stop signal after the last step, while curves.png is drawn: the run had finished and
    saved it, so it ends as it would have (exit 0, curves.png written), where it used to say
    "aborted at once before the RL steps" (exit 130, no curves); a second signal aborts then,
    naming where."""
    from fastrl.train import signals
    from fastrl.train import trainer as trainer_mod

    real = trainer_mod.plot_curves

    def signalled_plot(*args):
        os.kill(os.getpid(), signal.SIGINT)  # delivered to the handler before the next bytecode
        return real(*args)

    monkeypatch.setattr(trainer_mod, "plot_curves", signalled_plot)
    out = tmp_path / "run"
    assert main(["train", "--steps", "1", "--out", str(out), *TINY]) == 0
    err = capfd.readouterr().err  # (the handler writes to fd 2)
    assert "SIGINT received: the RL steps are over, writing curves.png" in err
    assert (out / "curves.png").is_file() and steps_of(out) == [0, 1]
    stops = signals.StopSignals(0, lambda: 3)
    stops.finishing = True
    stops._handle(signal.SIGINT, None)  # the first waits
    stops.time -= 2 * signals.REPEAT_WINDOW_S
    with pytest.raises(signals.Aborted, match="after step 3, while writing curves.png"):
        stops._handle(signal.SIGINT, None)


# ----------------------------------------------------------------------- the summary
def test_summary_counts_the_steps_this_process_ran(tmp_path, capsys):
    out = str(tmp_path / "run")
    args = ["--out", out, "--save-every", "0", "--eval-every", "100", *TINY]
    assert main(["train", "--steps", "2", *args]) == 0
    assert "s for 2 steps" in capsys.readouterr().out
    assert main(["train", "--resume", out, "--steps", "3"]) == 0
    done = capsys.readouterr().out
    assert "for 3 steps" not in done  # the whole run's count, not this process's
    assert "s for 1 step (step 3); outputs in" in done, done
    assert "(step 0) ->" in done and "(step 3)," in done  # accuracy: the whole run's
    # nothing left to run: says so instead of claiming steps
    assert main(["train", "--resume", out, "--steps", "3"]) == 0
    assert "for 0 steps (the run had already reached step 3)" in capsys.readouterr().out


# ----------------------------------------------------------------------- TRL's names
def test_trl_names_are_aliases_of_the_fastrl_flags():
    cfg = parse(
        "--num-generations", "4",
        "--beta", "0.1",
        "--epsilon", "0.1",
        "--epsilon-high", "0.3",
        "--max-completion-length", "5",
        "--save-steps", "7",
        "--eval-steps", "3",
        "--learning-rate", "0.01",
        "--lr-scheduler-type", "cosine",
        "--gradient-accumulation-steps", "2",
        "--num-iterations", "3",
        "--output-dir", "somewhere",
        "--model-name-or-path", "some/model",
    )  # fmt: skip
    assert (cfg.group_size, cfg.kl_coef, cfg.clip_low, cfg.clip_high) == (4, 0.1, 0.1, 0.3)
    assert (cfg.max_new_tokens, cfg.save_every, cfg.eval_every) == (5, 7, 3)
    assert (cfg.lr, cfg.lr_schedule, cfg.grad_accum, cfg.epochs) == (0.01, "cosine", 2, 3)
    assert (cfg.out, cfg.model) == ("somewhere", "some/model")
    # TRL: epsilon_high defaults to epsilon; fastrl's own --clip-low sets the lower bound only
    assert (parse("--epsilon", "0.1").clip_high, parse("--clip-low", "0.1").clip_high) == (
        0.1,
        None,
    )
    assert parse("--epsilon", "0.1", "--clip-high", "0.28").clip_high == 0.28


def test_trl_aliases_in_help_and_with_underscores(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for real, alias in [
        ("--group-size GROUP_SIZE", "--num-generations GROUP_SIZE"),
        ("--kl-coef KL_COEF", "--beta KL_COEF"),
        ("--clip-low CLIP_LOW", "--epsilon CLIP_LOW"),
        ("--clip-high CLIP_HIGH", "--epsilon-high CLIP_HIGH"),
        ("--max-new-tokens MAX_NEW_TOKENS", "--max-completion-length MAX_NEW_TOKENS"),
        ("--save-every SAVE_EVERY", "--save-steps SAVE_EVERY"),
        ("--lr LR", "--learning-rate LR"),
    ]:
        assert f"{real}, {alias}" in text, alias
    assert "--per-device-train-batch-size" in text and "--config FILE" in text
    # TRL's spelling with underscores reaches the same option (here: a value it refuses)
    rc, _, err = run_cli(capsys, "--learning_rate", "0", "--out", str(tmp_path / "o"), *TINY)
    assert rc == 2 and "--lr=0.0 is invalid" in err


def test_trl_per_device_batch_size_is_refused_saying_why(capsys):
    # TRL counts completions per device, fastrl's --batch-size prompts per step: not mapped
    rc, _, err = run_cli(capsys, "--per-device-train-batch-size", "8", *TINY)
    assert rc == 2
    assert "completions per device" in err and "--batch-size" in err


# ----------------------------------------------------------------------- --config FILE
def test_optional_choices_take_none_and_errors_name_the_flag_given(tmp_path, capsys):
    """--loss none is its default (the help says None: the preset named like --algo; it was an
    "invalid choice"), in a config file too; a --grad-accum too large for the batch is named as
    such, not as "--minibatches=None" (which the user never set and which is valid)."""
    assert parse("--loss", "none").loss is None and parse("--loss", "gspo").loss == "gspo"
    f = tmp_path / "c.yaml"
    f.write_text("loss: null\n")
    assert parse("--config", str(f)).loss is None
    rc, _, err = run_cli(capsys, "--batch-size", "2", "--group-size", "2", "--grad-accum", "8",
                         "--out", str(tmp_path / "o"))  # fmt: skip
    assert rc == 2 and "--grad-accum=8 is invalid" in err and "8 > 2 * 2" in err, err
    rc, _, err = run_cli(capsys, "--batch-size", "2", "--group-size", "2", "--minibatches", "8",
                         "--out", str(tmp_path / "o"))  # fmt: skip
    assert rc == 2 and "--minibatches=8 is invalid" in err, err


def test_config_file_sets_options_and_flags_override_it(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text(
        "algo: dapo\n"
        "batch_size: 4\n"
        "num-generations: 4  # TRL's name, dashed\n"
        "lr: 3e-4            # a string in YAML: read as the flag reads it\n"
        "max_new_tokens: 5\n"
        "top_p: null\n"
        "progress: false\n"
        "clip_high: 0.3\n"
    )
    cfg = parse("--config", str(f), "--max-new-tokens", "6")
    assert (cfg.algo, cfg.batch_size, cfg.group_size, cfg.lr) == ("dapo", 4, 4, 3e-4)
    assert (cfg.max_new_tokens, cfg.top_p, cfg.progress, cfg.clip_high) == (6, None, False, 0.3)
    j = tmp_path / "run.json"
    j.write_text(json.dumps({"steps": 7, "eval_split": 0.2, "force": True}))
    cfg = parse("--config", str(j), "--steps", "9")
    assert (cfg.steps, cfg.eval_split, cfg.force) == (9, 0.2, True)


def test_config_file_runs_a_training(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    out = tmp_path / "run"
    f.write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in TINY_FIELDS.items()))
    f.write_text(f.read_text() + f"steps: 2\nout: {json.dumps(str(out))}\n")
    rc, stdout, err = run_cli(capsys, "--config", str(f), "--steps", "1")
    assert rc == 0, err
    saved = json.loads((out / "config.json").read_text())
    assert saved["steps"] == 1 and saved["model_hidden"] == 32 and saved["batch_size"] == 4
    assert steps_of(out) == [0, 1]


@pytest.mark.parametrize(
    "text, message",
    [
        ("batch_size: 4\nbogus_option: 1\n", "unknown key 'bogus_option'"),
        ("max_steps: 10\n", "key 'max_steps': TRL's max_steps counts optimizer steps"),
        ("per-device-train-batch-size: 8\n", "use --batch-size (prompts) instead"),
        ("steps: many\n", "'steps': 'many' is invalid: expected an integer"),
        ("steps: 2.5\n", "'steps': 2.5 is invalid: expected an integer"),
        ("algo: trpo\n", "'algo': 'trpo' is invalid: expected one of ppo, grpo, dapo"),
        ("lr: 0.1\nlearning_rate: 0.2\n", "keys 'lr' and 'learning_rate' both set --lr"),
        ("- batch_size\n", "expected a mapping"),
        ("batch_size: [4\n", "not valid YAML"),
    ],
)
def test_bad_config_file_exits_2_naming_file_and_key(tmp_path, capsys, text, message):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    rc, _, err = run_cli(capsys, "--config", str(f), "--out", str(tmp_path / "o"), *TINY)
    assert rc == 2
    assert f"--config {f}: " in err and message in err, err
    assert not (tmp_path / "o").exists()


def test_missing_config_file(tmp_path, capsys):
    rc, _, err = run_cli(capsys, "--config", str(tmp_path / "none.yaml"))
    assert rc == 2 and f"--config {tmp_path / 'none.yaml'}: no such file" in err


def test_config_given_twice_exits_2_naming_both(tmp_path, capsys):
    """Two --config files: an error naming both (argparse kept the last one alone, silently
    dropping the first file's options)."""
    a, b = tmp_path / "a.json", tmp_path / "b.yaml"
    a.write_text('{"eval_size": 4}')
    b.write_text("steps: 1\n")
    rc, _, err = run_cli(capsys, "--config", str(a), "--config", str(b), "--out",
                         str(tmp_path / "o"), *TINY)  # fmt: skip
    assert rc == 2 and f"--config given twice ({a}, {b})" in err, err
    assert not (tmp_path / "o").exists()


# ----------------------------------------------------------------------- the add task, hints
def test_readme_and_help_say_what_the_add_task_is(capsys):
    import random

    ex = get_task("add").sample(random.Random(0), 3000)
    operands = [int(x) for e in ex for x in e.prompt.rstrip("=").split("+")]
    assert (min(operands), max(operands)) == (0, 49)  # deliberately: sums stay 2-digit
    text = open(README, encoding="utf-8").read()
    section = text[text.index("## The embedded default") :]
    section = " ".join(section[: section.index("\n## ")].split())
    assert "two numbers from 0 to 49 (`47+38=` → `85`" in section
    assert "2-digit addition" not in text
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "addition of two numbers from 0 to 49" in " ".join(capsys.readouterr().out.split())


def test_all_zero_rewards_hint_at_a_warm_up_for_a_random_model(tmp_path):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "never"}\n')
    lines = []
    Trainer(tiny_run.tiny(tmp_path / "run", task=str(f), steps=1), log=lines.append).train()
    assert lines[-1].startswith("warning: every reward of this run was 0")
    assert "random-init" in lines[-1] and "--sft-steps N" in lines[-1]


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"fastrl {fastrl.__version__}"


# ----------------------------------------------------------------------- --out up front
def test_out_holding_a_run_is_refused_before_the_model_loads(tmp_path, capsys, no_model_load):
    out = tmp_path / "run"
    out.mkdir()
    (out / "metrics.jsonl").write_text('{"step": 0, "eval_accuracy": 0.0}\n')
    rc, _, err = run_cli(capsys, "--out", str(out), "--steps", "1", *TINY)
    assert rc == 2
    # no checkpoint: nothing to resume, so --resume is not what the message suggests
    assert f"--out '{out}' already holds a run that stopped before its first checkpoint" in err
    assert "--force" in err and "--resume " not in err
    (out / "checkpoints" / "step-000001").mkdir(parents=True)
    rc, _, err = run_cli(capsys, "--out", str(out), "--steps", "1", *TINY)
    assert rc == 2
    assert f"--out '{out}' already holds a run (metrics.jsonl" in err and "--resume" in err
    assert no_model_load == []  # refused before anything was loaded
    assert (out / "metrics.jsonl").read_text() == '{"step": 0, "eval_accuracy": 0.0}\n'


def test_out_holding_only_tensorboard_events_is_refused(tmp_path, capsys, no_model_load):
    """A run starting over deletes OUT/tensorboard whole, so an --out holding only that folder
    is a run's too: it was let through without --force and the events were deleted."""
    out = tmp_path / "run"
    (out / "tensorboard").mkdir(parents=True)
    (out / "tensorboard" / "events").write_text("keep")
    rc, _, err = run_cli(capsys, "--out", str(out), "--steps", "1", *TINY)
    assert rc == 2 and f"--out '{out}' already holds a run" in err and "tensorboard" in err
    assert no_model_load == [] and (out / "tensorboard" / "events").read_text() == "keep"


def test_out_that_cannot_be_created_is_refused_up_front(tmp_path, capsys, no_model_load):
    (tmp_path / "a_file").write_text("not a directory")
    for out in (tmp_path / "a_file" / "run", tmp_path / "a_file" / "deeper" / "run"):
        rc, _, err = run_cli(capsys, "--out", str(out), "--steps", "1", *TINY)
        assert rc == 2, err
        assert f"--out '{out}' cannot be created: '{tmp_path / 'a_file'}' is a file" in err
    assert no_model_load == []


# ----------------------------------------------------------------------- bad task files
def test_empty_prompt_exits_2_naming_file_and_line(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "", "answer": "2"}\n')
    rc, _, err = run_cli(capsys, "--task", str(f), "--out", str(tmp_path / "o"), *TINY)
    assert rc == 2
    assert f'{f}:2: empty "prompt"' in err


@pytest.mark.parametrize("flag", ["--task", "--eval-file"])
def test_a_missing_task_or_eval_file_is_named_by_its_option(tmp_path, capsys, flag):
    """A missing --eval-file was reported as "task file ... does not exist"."""
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    task = ["--task", str(good)] if flag == "--eval-file" else []
    missing = str(tmp_path / "missing.jsonl")
    rc, _, err = run_cli(capsys, flag, missing, *task, "--out", str(tmp_path / "o"), *TINY)
    assert rc == 2
    assert f"{flag} {missing!r} does not exist" in err or f"{flag} file {missing!r}" in err


@pytest.mark.parametrize("flag", ["--task", "--eval-file"])
def test_non_utf8_task_file_names_file_and_line(tmp_path, capsys, flag):
    good = tmp_path / "good.jsonl"
    good.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    f = tmp_path / "latin1.jsonl"
    f.write_bytes(b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "caf\xe9", "answer": "2"}\n')
    task = ["--task", str(good)] if flag == "--eval-file" else []
    rc, _, err = run_cli(capsys, flag, str(f), *task, "--out", str(tmp_path / "o"), *TINY)
    assert rc == 2
    assert f"{f}:2: not UTF-8 text" in err


def test_a_run_from_before_scale_rewards_resumes_as_it_ran(tmp_path):
    """--scale-rewards auto means none for --loss dr_grpo; runs saved before the option trained
    dr_grpo on group-scaled advantages, and a resume of one keeps them (config.json has no
    scale_rewards)."""
    out = tmp_path / "run"
    out.mkdir()
    saved = TrainConfig(loss="dr_grpo", out=str(out)).to_dict()
    del saved["scale_rewards"]
    (out / "config.json").write_text(json.dumps(saved))
    cfg = parse("--resume", str(out))
    assert cfg.scale_rewards == "group" and cfg.advantage_scale == "group"
    assert TrainConfig(loss="dr_grpo").advantage_scale == "none"
    # a ppo run (group was refused there: the resume exited 2; the validation helper's find)
    for algo, loss in (("ppo", None), ("ppo", "dr_grpo"), ("grpo", None)):
        saved = TrainConfig(algo=algo, loss=loss, out=str(out)).to_dict()
        del saved["scale_rewards"]
        (out / "config.json").write_text(json.dumps(saved))
        assert parse("--resume", str(out)).scale_rewards == "auto"
