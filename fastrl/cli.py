"""`fastrl` command line: `fastrl train` (the minimal trainer) and `fastrl bench` (fastrl against
the loss code trainers run, on your shapes, through benchmarks/bench_policy_loss.py).

Every TrainConfig field is a `fastrl train` flag (`batch_size` -> `--batch-size`); its help text
is the field's docstring in fastrl/config.py, so the two never drift apart.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from . import config as config_module
from .config import TrainConfig

# options that may differ when resuming (everything else comes from the run's config.json)
RESUME_OVERRIDABLE = (
    "steps",
    "device",
    "progress",
    "num_threads",
    "save_every",
    "eval_every",
    "reward_timeout",
    "max_time",
    "report_to",
)


def field_docs(cls) -> dict[str, str]:
    """Attribute docstrings of a dataclass (the string literal after each field)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(config_module)))
    docs = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == cls.__name__:
            body = node.body
            for a, b in zip(body, body[1:]):
                if (
                    isinstance(a, ast.AnnAssign)
                    and isinstance(a.target, ast.Name)
                    and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant)
                    and isinstance(b.value.value, str)
                ):
                    docs[a.target.id] = " ".join(b.value.value.split())
    return docs


def _parse_optional(kind):
    def parse(s: str):
        return None if s.lower() in ("none", "") else kind(s)

    return parse


def _bool(s: str) -> bool:
    if s.lower() in ("1", "true", "yes", "on"):
        return True
    if s.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")


def add_train_args(p: argparse.ArgumentParser) -> None:
    docs = field_docs(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        ann = str(f.type)
        if "bool" in ann:
            kind = _bool
        elif "int" in ann:
            kind = int
        elif "float" in ann:
            kind = float
        else:
            kind = str
        if "None" in ann:
            kind = _parse_optional(kind)
        choices = {
            "algo": config_module.ALGOS,
            "loss": config_module.PRESETS,
            "lr_schedule": config_module.LR_SCHEDULES,
            "dtype": config_module.TRAIN_DTYPES,
            "report_to": config_module.REPORT_TO,
        }
        extra = {"choices": choices[f.name]} if f.name in choices else {}
        if kind is _bool:  # `--force` alone means true; `--progress false` still works
            extra = {"nargs": "?", "const": True}
        p.add_argument(
            flag,
            type=kind,
            default=argparse.SUPPRESS,
            metavar=f.name.upper(),
            help=f"{docs.get(f.name, '')} (default: {default})".replace("%", "%%"),
            **extra,
        )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastrl", description="fastrl: fused RL losses for LLM post-training."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train a policy with PPO / GRPO / DAPO (embedded CPU default with no arguments)",
        description=(
            "Train a causal LM with PPO, GRPO or DAPO on a verifiable task. With no arguments: "
            "a tiny random-init Qwen2 (character tokenizer shipped in the package) gets a short "
            "supervised warm-up, then GRPO raises its greedy accuracy on 2-digit addition, on a "
            "CPU, in minutes. Writes OUT/config.json, OUT/metrics.jsonl, OUT/curves.png and "
            "checkpoints under OUT/checkpoints, each with a Hugging Face model directory "
            "(OUT/checkpoints/step-N/hf) that from_pretrained and --model load; an OUT that "
            "already holds a run is refused unless --force (or --resume OUT). Your own model and "
            "task: --model DIR --task FILE.jsonl (no warm-up unless --sft-steps; eval on "
            "--eval-file or a held-out --eval-split). Works under `torchrun --nproc_per_node N` "
            "(DDP, or FSDP2 with --fsdp). "
            "Fails loudly: a NaN / inf loss or gradient norm stops the run naming the step "
            "(exit 1, the last good checkpoint kept); --resume skips corrupt checkpoints, "
            "saying which file is bad; reward calls that raise, hang past --reward-timeout or "
            "return a non-finite or huge value score 0, are counted and printed; SystemExit / "
            "KeyboardInterrupt from the reward function stop the run with a checkpoint. Exit "
            "codes: 0 done, 1 training stopped, 2 bad input, 130 KeyboardInterrupt in the "
            "reward function."
        ),
    )
    add_train_args(train)
    bench = sub.add_parser(
        "bench",
        help="fastrl vs TRL / verl eager losses and torch.compile on your shapes "
        "(benchmarks/bench_policy_loss.py)",
        description=(
            "Time forward + backward of the GRPO policy loss on logits, fastrl against what "
            "trainers run (TRL's selective_log_softmax + per-token math, verl's "
            "logprobs_from_logits, torch.compile of the TRL-style loss, Liger-Kernel on CUDA; "
            "fastrl's readable reference as a labelled oracle), and peak memory, on "
            "the shapes you give, e.g. `fastrl bench --B 8 --T 512 --V 151936 --dtype bf16`. "
            "All arguments go to benchmarks/bench_policy_loss.py of the source checkout (see "
            "`fastrl bench --help-script` for its options); results (JSON, CSV, PNG) land in "
            "./fastrl-bench/ unless --out says otherwise."
        ),
    )
    bench.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        help="options of benchmarks/bench_policy_loss.py (--device, --B, --T, --V, --dtype, ...)",
    )
    return parser


def run_bench(script_args: list[str]) -> int:
    """Run benchmarks/bench_policy_loss.py (source checkout) with `script_args`."""
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_policy_loss.py"
    if not script.is_file():
        print(
            "fastrl bench runs benchmarks/bench_policy_loss.py from a source checkout "
            "(pip install -e .); this install has no benchmarks/ folder.",
            file=sys.stderr,
        )
        return 2
    args = ["--help" if a == "--help-script" else a for a in script_args]
    if not any(a == "--out" or a.startswith("--out=") for a in args):
        args += ["--out", "fastrl-bench"]  # not the committed benchmarks/results/
    return subprocess.call([sys.executable, str(script), *args])


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    given = {k: v for k, v in vars(ns).items() if k != "command"}
    resume = given.get("resume")
    if resume:
        path = os.path.join(resume, "config.json")
        if not os.path.isfile(path):
            raise ValueError(f"--resume {resume!r}: no config.json in it (not a fastrl run dir)")
        try:
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
        except (OSError, UnicodeDecodeError, ValueError) as e:
            raise ValueError(f"--resume: {path} is not valid JSON ({e})") from e
        if not isinstance(saved, dict):
            raise ValueError(f"--resume: {path} is not a JSON object of TrainConfig options")
        known = {f.name for f in dataclasses.fields(TrainConfig)}
        base = {k: v for k, v in saved.items() if k in known}
        ignored = sorted(
            k
            for k in given
            if k not in RESUME_OVERRIDABLE + ("resume",) and given[k] != base.get(k)
        )
        if ignored:
            print(
                f"--resume: ignoring {', '.join('--' + k.replace('_', '-') for k in ignored)}"
                " (taken from the run's config.json)",
                file=sys.stderr,
            )
        try:  # the saved options alone: an error here is the file's
            TrainConfig(**base).validate()
        except (TypeError, ValueError) as e:
            raise ValueError(f"--resume: {path}: {e}") from e
        base.update({k: v for k, v in given.items() if k in RESUME_OVERRIDABLE})
        base["resume"], base["out"] = resume, resume
        cfg = TrainConfig(**base)
    else:
        cfg = TrainConfig(**given)
    cfg.validate()
    return cfg


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and not {"-h", "--help"} & set(argv[1:]):
        return run_bench(argv[1:])  # its options belong to the benchmark script
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 0
    if ns.command == "bench":
        return run_bench(ns.script_args)
    try:
        cfg = config_from_args(ns)
        from .trainer import Trainer

        trainer = Trainer(cfg)
    except ValueError as e:
        print(f"fastrl train: error: {e}", file=sys.stderr)
        return 2
    from .rewards import RewardError
    from .trainer import TrainingError

    try:
        trainer.train()
    except ValueError as e:  # bad input discovered while loading (e.g. --resume, --out)
        print(f"fastrl train: error: {e}", file=sys.stderr)
        return 2
    except TrainingError as e:  # a non-finite loss / gradient: stopped, last good ckpt kept
        print(f"fastrl train: error: {e}", file=sys.stderr)
        return 1
    except RewardError as e:  # the reward function asked to stop, or hangs
        print(f"fastrl train: error: {e}", file=sys.stderr)
        return e.exit_code
    finally:
        trainer.close()
    if trainer.rank == 0:
        from .trainer import read_metrics

        recs = read_metrics(os.path.join(cfg.out, "metrics.jsonl"))
        evals = [r for r in recs if "eval_accuracy" in r]
        steps_done = max(evals[-1]["step"] - (evals[0]["step"] if cfg.resume else 0), 0)
        print(
            f"done: {cfg.algo}, eval accuracy {evals[0]['eval_accuracy']:.3f} (step "
            f"{evals[0]['step']}) -> {evals[-1]['eval_accuracy']:.3f} (step {evals[-1]['step']}), "
            f"{trainer.wall_time:.0f}s for {steps_done} steps; outputs in {cfg.out}"
        )
        if trainer.model_dir:
            print(f"model: {trainer.model_dir} (from_pretrained / --model load it)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
