"""`fastrl` CLI: --help documents every option, bad input fails before training with a message
that says what to fix, a short run writes config.json / metrics.jsonl / curves.png."""

import dataclasses
import json
import os
import sys

import pytest
from tiny_run import TINY

from fastrl.cli import build_parser, main
from fastrl.train.config import TrainConfig


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for f in dataclasses.fields(TrainConfig):
        assert "--" + f.name.replace("_", "-") in text
    for flag in [
        "--algo",
        "--model",
        "--task",
        "--steps",
        "--batch-size",
        "--group-size",
        "--lr",
        "--max-new-tokens",
        "--seed",
        "--out",
        "--resume",
        "--device",
        "--reward-timeout",
        "--force",
    ]:
        assert flag in text
    assert "already holds a run is refused unless --force" in " ".join(text.split())
    # every option has a real help text (its docstring), not just the default
    actions = build_parser()._subparsers._group_actions[0].choices["train"]._actions
    for a in actions:
        if a.dest != "help":
            assert len(a.help) > 25, a.dest


def test_bench_help_names_the_script(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--help"])
    assert exc.value.code == 0
    assert "bench_policy_loss.py" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (["--algo", "trpo"], "invalid choice"),
        (["--task", "chess"], "unknown task 'chess'"),
        (["--algo", "grpo", "--group-size", "1"], "group-size"),
        (["--algo", "dapo", "--group-size", "1"], "group-size"),
        (["--max-new-tokens", "0"], "max-new-tokens"),
        (["--steps", "0"], "--steps"),
        (["--reward-timeout", "-1"], "--reward-timeout"),
        (["--reward-timeout", "nan"], "--reward-timeout"),
        (["--clip-low", "-1"], "--clip-low=-1.0 is invalid"),  # named as the flag, not
        (["--clip-high", "nan"], "--clip-high=nan is invalid"),  # as LossConfig's field
        (["--clip-low", "2"], "--clip-low=2.0 is invalid: expected a finite number in [0, 1]"),
        (["--entropy-coef", "-1"], "--entropy-coef=-1.0 is invalid: expected a finite number"),
        # ppo reads --kl-coef as reward shaping: the grpo preset's in-loss KL would stay
        (["--algo", "ppo", "--loss", "grpo", "--kl-coef", "0"], "--kl-coef=0.0 is invalid"),
        (["--algo", "ppo", "--loss", "grpo", "--beta", "0.1"], "in-loss KL"),
        (["--scale-rewards", "batch"], "invalid choice"),
        (["--algo", "ppo", "--scale-rewards", "none"], "--scale-rewards='none' is invalid"),
        (
            ["--device", "cuda:7"]
            if not __import__("torch").cuda.is_available()
            else ["--device", "nonsense"],
            "--device",
        ),
    ],
)
def test_bad_input_fails_before_training(args, message, tmp_path, capsys):
    out = tmp_path / "run"
    try:
        rc = main(["train", "--out", str(out), *TINY, *args])
    except SystemExit as e:  # argparse's own errors (invalid choice)
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2
    assert message in err
    assert not (out / "metrics.jsonl").exists()


def test_model_path_that_is_not_a_causal_lm(tmp_path, capsys):
    d = tmp_path / "notamodel"
    d.mkdir()
    assert main(["train", "--model", str(d), "--out", str(tmp_path / "o"), *TINY]) == 2
    assert "not a local Hugging Face model directory" in capsys.readouterr().err
    # a config.json that transformers cannot map to a causal LM
    (d / "config.json").write_text(json.dumps({"model_type": "t5", "d_model": 8}))
    assert main(["train", "--model", str(d), "--out", str(tmp_path / "o"), *TINY]) == 2
    assert "not a causal LM" in capsys.readouterr().err
    # a weights file cut short (a copy that did not finish): safetensors' own error, named
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(vocab_size=64, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    cut = tmp_path / "cut"
    Qwen2ForCausalLM(cfg).save_pretrained(cut)
    weights = cut / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    assert main(["train", "--model", str(cut), "--out", str(tmp_path / "o"), *TINY]) == 2
    assert "not a causal LM that transformers can load" in capsys.readouterr().err


def test_model_with_a_missing_or_too_large_tokenizer(tmp_path, capsys):
    """A model saved without its tokenizer (transformers would build an empty one from
    config.json) and one whose tokenizer has more tokens than its embedding rows: exit 2
    naming the problem, not an IndexError in the first forward."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastrl.train.rollout import default_tokenizer

    d = tmp_path / "small"
    config = Qwen2Config(
        vocab_size=20,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=4,
    )
    Qwen2ForCausalLM(config).save_pretrained(d)
    args = ["train", "--model", str(d), "--out", str(tmp_path / "o"), *TINY]
    assert main(args) == 2
    assert "has no tokenizer files" in capsys.readouterr().err
    default_tokenizer().save_pretrained(d)  # 52 tokens for 20 embedding rows
    assert main(args) == 2
    assert "its tokenizer has 52 tokens but the model's embedding only 20 rows" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def test_malformed_jsonl_names_the_line(tmp_path, capsys):
    f = tmp_path / "task.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2=", "answer": 4\n')
    assert main(["train", "--task", str(f), "--out", str(tmp_path / "o"), *TINY]) == 2
    err = capsys.readouterr().err
    assert "task.jsonl:2" in err and "not valid JSON" in err
    f.write_text('{"prompt": "1+1="}\n')
    assert main(["train", "--task", str(f), "--out", str(tmp_path / "o"), *TINY]) == 2
    assert 'task.jsonl:1: missing "answer"' in capsys.readouterr().err


def test_unknown_reward(tmp_path, capsys):
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    rc = main(["train", "--task", str(f), "--reward", "nope", "--out", str(tmp_path / "o"), *TINY])
    assert rc == 2 and "unknown reward 'nope'" in capsys.readouterr().err


def test_short_run_writes_outputs_and_counts_reward_errors(tmp_path, capsys, monkeypatch):
    # a user task with a user reward given as module:function that raises on some inputs
    mod = tmp_path / "my_rewards.py"
    mod.write_text(
        "def flaky(completion, answer):\n"
        "    if completion.startswith('1'):\n"
        "        raise RuntimeError('boom')\n"
        "    return float(completion.strip() == answer)\n"
        "def always(completion, answer):\n"
        "    raise RuntimeError('boom')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("my_rewards", None)
    task = tmp_path / "sums.jsonl"
    task.write_text(
        "".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(10))
    )
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            "--task",
            str(task),
            "--reward",
            "my_rewards:always",
            "--steps",
            "2",
            "--out",
            str(out),
            "--eval-every",
            "1",
            *TINY,
        ]
    )
    assert rc == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["reward"] == "my_rewards:always" and cfg["steps"] == 2
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[0] == {"step": 0, "eval_accuracy": 0.0}
    steps = [r for r in recs if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for key in [
            "reward_mean",
            "loss",
            "kl",
            "entropy",
            "clipfrac",
            "response_len",
            "tokens_per_s",
            "eval_accuracy",
        ]:
            assert key in r, key
        assert r["reward_errors"] == 8  # every completion's reward raised: counted, scored 0
        assert r["reward_mean"] == 0.0
    assert (out / "curves.png").stat().st_size > 1000
    assert os.path.isdir(out / "checkpoints")
    assert "done: grpo" in capsys.readouterr().out


def test_resume_through_the_cli(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--steps", "2", "--save-every", "1", "--out", str(out), *TINY]) == 0
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert main(["train", "--resume", str(out), "--steps", "3", "--progress", "false"]) == 0
    again = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in again] == [0, 1, 2, 3]
    assert again[:3] == recs
    assert json.loads((out / "config.json").read_text())["steps"] == 3
    # no such run: an error that says so, not a fresh run
    assert main(["train", "--resume", str(tmp_path / "missing")]) == 2
    assert f"--resume '{tmp_path / 'missing'}' does not exist" in capsys.readouterr().err
    # a checkpoint, or its hf/ export (whose config.json is the model's: its `dtype` was read
    # as fastrl's --dtype), named instead of the run: an error that names the run directory
    for inside in ("checkpoints/step-000002", "checkpoints/step-000002/hf"):
        capsys.readouterr()
        assert main(["train", "--resume", str(out / inside)]) == 2
        err = capsys.readouterr().err
        assert (
            "not a fastrl run" in err
            and f"the run directory (the run's --out), here '{out}'" in err
        )
    # runs kept under a folder named checkpoints: no run directory is guessed for a typo
    (tmp_path / "checkpoints" / "partial").mkdir(parents=True)
    for path in ("checkpoints/typo", "checkpoints/partial"):
        capsys.readouterr()
        assert main(["train", "--resume", str(tmp_path / path)]) == 2
        assert "the run directory" not in capsys.readouterr().err


def test_bench_runs_the_benchmark_on_given_shapes(tmp_path):
    out = tmp_path / "bench"
    args = ["--device", "cpu", "--B", "1", "--T", "4", "--V", "50", "--no-compile", "--no-plot"]
    rc = main(["bench", *args, "--warmup", "0", "--rep", "1", "--out", str(out)])
    assert rc == 0
    (result,) = out.glob("*.json")
    rows = json.loads(result.read_text())["rows"]
    assert {r["method"] for r in rows} >= {"fastrl", "trl-eager"}
    assert all(r["V"] == 50 and r["N"] == 4 for r in rows)


def test_a_model_without_a_usable_flash_attention_falls_back_to_sdpa(tmp_path, capsys, monkeypatch):
    """Where flash_attention_2 is chosen (a CUDA run in bf16 / fp16 with flash_attn installed;
    forced here) but the model cannot take it, the run says so and goes on with SDPA."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastrl.train import rollout
    from fastrl.train.rollout import default_tokenizer

    d = tmp_path / "small"
    tok = default_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4,
    )  # fmt: skip
    Qwen2ForCausalLM(config).save_pretrained(d)
    tok.save_pretrained(d)
    monkeypatch.setattr(rollout, "attn_implementation", lambda device, dtype: "flash_attention_2")
    args = ["train", "--model", str(d), "--out", str(tmp_path / "o"), *TINY, "--steps", "1"]
    rc = main(args)
    text, err = capsys.readouterr()
    assert rc == 0, text + err
    assert "flash_attention_2 unavailable" in text + err and "using sdpa" in text + err
