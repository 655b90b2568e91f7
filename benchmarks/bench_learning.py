"""How fast each algorithm learns: eval accuracy against wall time and RL steps, from a warm start.

    python benchmarks/bench_learning.py                      # ppo grpo dapo, 2 seeds, 120 s each
    python benchmarks/bench_learning.py --budget 10 --quick  # smoke test (tiny model, seconds)
    python benchmarks/bench_learning.py --vs-trl             # TRL GRPOTrainer vs fastrl train
    python benchmarks/bench_learning.py --vs-trl --quick     # its smoke test (< 60 s)

`--vs-trl` (benchmarks/_trl_learning.py, whose docstring says how): TRL's stock GRPOTrainer and
`fastrl train` back to back from the same warm-started local model on the same JSONL task,
reward, held-out greedy eval and settings; steps and training seconds to eval accuracy 0.5 / 0.8
/ 0.9 per seed and their mean, in benchmarks/results/learning_vs_trl.json / .png / .md
(`--ablate`: plus fastrl runs with one default changed to TRL's value).

1. Warm start (once): the embedded model of `fastrl train` gets its supervised warm-up on the
   task's sloppy teacher (`--sft-steps`, 1000 by default: the default run's starting point, greedy
   eval accuracy about 0.1-0.2) and is exported as a Hugging Face directory.
2. Each algorithm x seed: `fastrl train --algo ALGO --model WARM --task TASK --max-time BUDGET`
   in a child process (no KL: `--kl-coef 0` for grpo, ppo's default has none; constant lr), with
   a greedy eval on the task's held-out stream every `--eval-every` steps and at the end.
3. benchmarks/results/learning.json (every eval point: step, RL wall seconds, accuracy; the
   machine, versions, commit, command lines), learning.png (accuracy vs wall time and vs
   steps, one line per seed, the mean in bold) and learning.md (a Markdown table for the
   README: mean over seeds of the accuracy reached at a quarter, half and all of the budget).

The RL wall time of a point (`elapsed_s` of metrics.jsonl) counts generation, rewards, updates
and the evaluations before it; the warm-up and process start are not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _trl_learning  # noqa: E402
from _common import RESULTS_DIR, device_info  # noqa: E402

QUICK = ["--model-hidden", "32", "--model-layers", "1", "--batch-size", "4", "--group-size", "4"]


def warm_start(path: Path, task: str, sft_steps: int, quick: bool) -> float:
    """Warm up the embedded model on `task` and export it to `path`; its eval accuracy."""
    from fastrl.train.config import TrainConfig
    from fastrl.train.trainer import Trainer

    kw = dict(model_hidden=32, model_layers=1, sft_batch_size=8) if quick else {}
    cfg = TrainConfig(
        task=task, sft_steps=sft_steps, out=str(path / "run"), eval_size=100, progress=True, **kw
    )
    t = Trainer(cfg)
    t.supervised_warmup()
    acc = t.evaluate()
    t.export_hf(str(path / "model"))
    t.close()
    return acc


def run_one(algo: str, seed: int, args, model: Path, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "fastrl.cli", "train", "--algo", algo, "--seed", str(seed),
        "--model", str(model), "--task", args.task, "--max-time", str(args.budget),
        "--steps", "100000", "--eval-every", str(args.eval_every), "--save-every", "0",
        "--eval-size", str(args.eval_size), "--lr-schedule", "constant", "--progress", "false",
        "--out", str(out),
    ]  # fmt: skip
    if algo == "grpo":
        cmd += ["--kl-coef", "0"]
    cmd += (QUICK if args.quick else []) + shlex.split(args.extra)
    start = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [
        {
            "step": r["step"],
            "elapsed_s": round(r.get("elapsed_s", 0.0), 2),
            "acc": r["eval_accuracy"],
        }
        for r in recs
        if "eval_accuracy" in r
    ]
    return {
        "command": shlex.join(cmd),
        "process_wall_s": round(wall, 1),
        "steps": recs[-1]["step"],
        "evals": evals,
        "final_acc": evals[-1]["acc"],
    }


def plot(summary: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for i, (algo, runs) in enumerate(summary["runs"].items()):
        color = f"C{i}"
        for x_key, ax in (("elapsed_s", axes[0]), ("step", axes[1])):
            grid = np.linspace(0, max(e[x_key] for r in runs.values() for e in r["evals"]), 50)
            curves = []
            for r in runs.values():
                xs = [e[x_key] for e in r["evals"]]
                ys = [e["acc"] for e in r["evals"]]
                ax.plot(xs, ys, color=color, alpha=0.35, lw=1)
                curves.append(np.interp(grid, xs, ys))
            ax.plot(grid, np.mean(curves, 0), color=color, lw=2.2, label=algo)
    for ax, label in zip(axes, ("RL wall time (s)", "RL step")):
        ax.set_xlabel(label)
        ax.set_ylabel("greedy eval accuracy (held out)")
        ax.grid(alpha=0.3)
        ax.legend()
    m = summary["machine"]
    fig.suptitle(
        f"{summary['task']} from a warm start (acc {summary['warm_start_acc']:.2f}), "
        f"{summary['budget_s']:g} s per run, seeds {summary['seeds']} — {m['cpu']}",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def acc_at(evals: list[dict], t: float) -> float:
    """The last eval accuracy measured by RL wall time `t`."""
    return [e["acc"] for e in evals if e["elapsed_s"] <= t + 1e-9][-1]


def table(summary: dict) -> str:
    b = summary["budget_s"]
    m = summary["machine"]
    lines = [
        f"**{summary['task']} from a warm start** (eval accuracy {summary['warm_start_acc']:.2f}"
        f" after {summary['warm_start_sft_steps']} supervised steps), {b:g} s of RL per run, "
        f"mean of seeds {summary['seeds']}, on {m['cpu']} ({m['cores']} cores), torch "
        f"{summary['torch']}, commit {summary['git_commit'][:7]}",
        "",
        f"| algo | RL steps in {b:g} s | acc @ {b / 4:g} s | acc @ {b / 2:g} s | acc @ {b:g} s |",
        "|---|---|---|---|---|",
    ]
    for algo, runs in summary["runs"].items():
        rs = list(runs.values())
        accs = [sum(acc_at(r["evals"], t) for r in rs) / len(rs) for t in (b / 4, b / 2, b * 10)]
        steps = sum(r["steps"] for r in rs) / len(rs)
        lines.append(f"| {algo} | {steps:.0f} | " + " | ".join(f"{a:.3f}" for a in accs) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--algos",
        nargs="+",
        default=["ppo", "grpo", "dapo"],
        help="algorithms (`--algo` of each run)",
    )
    p.add_argument(
        "--seeds", nargs="+", type=int, default=[0, 1], help="one run per algorithm and seed"
    )
    p.add_argument("--budget", type=float, default=120.0, help="RL seconds per run")
    p.add_argument("--task", default="add", help="a built-in task or a .jsonl file")
    p.add_argument("--sft-steps", type=int, default=1000, help="warm-start supervised steps")
    p.add_argument("--eval-every", type=int, default=5, help="RL steps between evaluations")
    p.add_argument("--eval-size", type=int, default=200, help="held-out prompts per evaluation")
    p.add_argument("--extra", default="", help="more `fastrl train` options for every run")
    p.add_argument("--quick", action="store_true", help="tiny model and batch (smoke test)")
    p.add_argument("--out", default=str(RESULTS_DIR), help="where learning.json / .png go")
    _trl_learning.add_args(p)
    args = p.parse_args()
    if args.vs_trl:
        if "--budget" not in sys.argv:
            args.budget = 90.0  # --vs-trl: training seconds per run (a run stops at --stop-at)
        _trl_learning.main(args)
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = device_info("cpu")
    from tqdm.auto import tqdm

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        sft = 20 if args.quick else args.sft_steps
        acc0 = warm_start(tmp, args.task, sft, args.quick)
        print(f"warm start: {sft} supervised steps, eval accuracy {acc0:.3f}")
        summary = {
            "task": args.task,
            "warm_start_sft_steps": sft,
            "warm_start_acc": acc0,
            "budget_s": args.budget,
            "seeds": args.seeds,
            "machine": {"cpu": info.get("device_name"), "cores": info.get("cpu_count")},
            "torch": info.get("torch"),
            "git_commit": info.get("git_commit"),
            "time_utc": info.get("time_utc"),
            "runs": {},
        }
        jobs = [(a, s) for a in args.algos for s in args.seeds]
        for algo, seed in tqdm(jobs, desc="bench_learning", unit="run"):
            res = run_one(algo, seed, args, tmp / "model", tmp / f"{algo}-{seed}")
            summary["runs"].setdefault(algo, {})[str(seed)] = res
            tqdm.write(
                f"{algo} seed {seed}: {res['steps']} steps, eval accuracy "
                f"{res['evals'][0]['acc']:.3f} -> {res['final_acc']:.3f}"
            )
    (out / "learning.json").write_text(json.dumps(summary, indent=1) + "\n")
    plot(summary, out / "learning.png")
    (out / "learning.md").write_text(table(summary))
    print(table(summary))
    print(f"wrote {out / 'learning.json'}, learning.png and learning.md")


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
