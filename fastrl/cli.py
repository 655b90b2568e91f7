"""`fastrl` command line: `fastrl train` (the minimal trainer) and `fastrl bench` (fastrl against
the loss code trainers run, on your shapes, through benchmarks/bench_policy_loss.py).

The options of `fastrl train` (one flag per TrainConfig field, TRL's aliases, `--config FILE`,
`--resume`) and how they become a TrainConfig are in fastrl/train/cli_args.py; this module is
the command: the parser, `main` and what it prints and exits with.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from pathlib import Path

from . import __version__
from .train.cli_args import add_train_args, config_from_args, dashes
from .train.common import resume_command

__all__ = ["build_parser", "config_from_args", "main"]


def train_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    return parser._subparsers._group_actions[0].choices["train"]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fastrl", description="fastrl: fused RL losses for LLM post-training."
    )
    parser.add_argument(
        "--version", action="version", version=f"fastrl {__version__}", help="print the version"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    train = sub.add_parser(
        "train",
        help="train a policy with PPO / GRPO / DAPO (embedded CPU default with no arguments)",
        description=(
            "Train a causal LM with PPO, GRPO or DAPO on a verifiable task. With no arguments: "
            "a tiny random-init Qwen2 (character tokenizer shipped in the package) gets a short "
            "supervised warm-up, then GRPO raises its greedy accuracy on addition of two numbers "
            "from 0 to 49 (47+38=85), on a CPU, in minutes. Writes OUT/config.json, "
            "OUT/metrics.jsonl, OUT/curves.png and "
            "checkpoints under OUT/checkpoints, each with a Hugging Face model directory "
            "(OUT/checkpoints/step-N/hf) that from_pretrained and --model load; an OUT that "
            "already holds a run is refused unless --force (or --resume OUT). Your own model and "
            "task: --model DIR --task FILE.jsonl (no warm-up unless --sft-steps; eval on "
            "--eval-file or a held-out --eval-split). Works under `torchrun --nproc_per_node N` "
            "(DDP, or FSDP2 with --fsdp). Options may also come from --config FILE (YAML / "
            "JSON; flags override it); TRL's names for the same knobs are aliases (shown next to "
            "each flag), and --opt_name is read as --opt-name. "
            "Ctrl-C (SIGINT) or SIGTERM: the current step finishes, a checkpoint of it is "
            "saved and the command to continue (--resume OUT) is printed; a second one aborts "
            "at once. "
            "Fails loudly: a NaN / inf loss or gradient norm stops the run naming the step "
            "(exit 1, the last good checkpoint kept); --resume skips corrupt checkpoints, "
            "saying which file is bad; reward calls that raise, hang past --reward-timeout or "
            "return a non-finite or huge value score 0, are counted and printed; SystemExit / "
            "KeyboardInterrupt from the reward function stop the run with a checkpoint. Exit "
            "codes: 0 done, 1 training stopped, 2 bad input, 130 SIGINT (Ctrl-C) or "
            "KeyboardInterrupt in the reward function, 143 SIGTERM."
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


def _stopped_message(trainer, e: BaseException) -> str:
    """What `fastrl train` says when a signal stopped it (Interrupted or Aborted)."""
    from .train import checkpoint as ckpt_io
    from .train.trainer import Interrupted

    cfg = trainer.cfg
    signum = getattr(e, "signum", None)
    name = signal.Signals(signum).name if signum else "KeyboardInterrupt"
    if isinstance(e, Interrupted):
        head = f"{name}: stopped after step {e.step}; checkpoint saved in {e.checkpoint}"
        ckpt = e.checkpoint
    else:
        ckpt = ckpt_io.latest_checkpoint(os.path.join(cfg.out, "checkpoints"))
        where = getattr(e, "where", "")
        head = f"{name}: aborted at once{' ' + where if where else ''}" + (
            f"; the newest checkpoint is {ckpt}" if ckpt else "; no checkpoint was saved"
        )
    if not ckpt:
        return head
    if cfg.fsdp:  # --fsdp runs do not resume
        return f"{head}\nstart a new run from it with: --model {os.path.join(ckpt, 'hf')}"
    return f"{head}\nresume with: {resume_command(cfg.out, trainer.world)}"


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download anything
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"] and not {"-h", "--help"} & set(argv[1:]):
        return run_bench(argv[1:])  # its options belong to the benchmark script
    parser = build_parser()
    if argv[:1] == ["train"]:
        argv = argv[:1] + dashes(argv[1:], train_parser(parser))
    ns = parser.parse_args(argv)
    if ns.command is None:
        parser.print_help()
        return 0
    if ns.command == "bench":
        return run_bench(ns.script_args)
    try:
        cfg = config_from_args(ns)
        from .train.trainer import Trainer

        trainer = Trainer(cfg)
    except ValueError as e:
        print(f"fastrl train: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fastrl train: interrupted while loading; nothing was written", file=sys.stderr)
        return 130
    from .train.rewards import RewardError
    from .train.trainer import Interrupted, TrainingError

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
    except (Interrupted, KeyboardInterrupt) as e:  # SIGINT / SIGTERM (Aborted: a second one)
        if trainer.rank == 0:
            print(f"fastrl train: {_stopped_message(trainer, e)}", file=sys.stderr)
        return getattr(e, "exit_code", 130)
    finally:
        trainer.close()
    if trainer.rank == 0:
        from .train.trainer import read_metrics

        recs = read_metrics(os.path.join(cfg.out, "metrics.jsonl"))
        evals = [r for r in recs if "eval_accuracy" in r]
        n, first = trainer.steps_run, trainer.first_step
        ran = f"{n} step{'s' if n != 1 else ''}"
        if n:
            ran += f" (step {first + 1})" if n == 1 else f" (steps {first + 1}-{first + n})"
        elif cfg.resume:
            ran += f" (the run had already reached step {trainer.step})"
        print(
            f"done: {cfg.algo}, eval accuracy {evals[0]['eval_accuracy']:.3f} (step "
            f"{evals[0]['step']}) -> {evals[-1]['eval_accuracy']:.3f} (step {evals[-1]['step']}), "
            f"{trainer.wall_time:.0f}s for {ran}; outputs in {cfg.out}"
        )
        if trainer.model_dir:
            print(f"model: {trainer.model_dir} (from_pretrained / --model load it)")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
