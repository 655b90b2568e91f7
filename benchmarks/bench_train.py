"""Run the embedded default of `fastrl train` for each algorithm and record what it achieved.

    python benchmarks/bench_train.py                 # ppo, grpo, dapo with all defaults
    python benchmarks/bench_train.py --algos grpo --extra "--steps 50"

For each algorithm: `fastrl train --algo ALGO --out <tmp>` in a child process; then
benchmarks/results/train_<algo>.png (the run's curves), train_<algo>.metrics.jsonl (its per-step
records) and one train_summary.json: wall time (warm-up and evaluations included), RL steps/s
(from the per-step times), greedy eval accuracy at step 0 and at the end, peak RSS of the child
(wait4's rusage),
with the machine, versions and git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import RESULTS_DIR, device_info  # noqa: E402


def run_one(algo: str, extra: list[str], workdir: Path) -> dict:
    out = workdir / algo
    cmd = ["fastrl", "train", "--algo", algo, "--out", str(out), "--progress", "false", *extra]
    start = time.perf_counter()
    child = subprocess.Popen(cmd)
    _, status, usage = os.wait4(child.pid, 0)  # this child's own resource usage
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{shlex.join(cmd)} failed with status {status}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [(r["step"], r["eval_accuracy"]) for r in records if "eval_accuracy" in r]
    steps = [r for r in records if "step_time_s" in r]
    rl_wall = sum(r["step_time_s"] for r in steps)
    shutil.copy(out / "curves.png", RESULTS_DIR / f"train_{algo}.png")
    shutil.copy(out / "metrics.jsonl", RESULTS_DIR / f"train_{algo}.metrics.jsonl")
    return {
        "wall_s_total": round(wall, 2),
        "rl_wall_s": round(rl_wall, 2),
        "rl_steps": len(steps),
        "rl_steps_per_s": round(len(steps) / max(rl_wall, 1e-9), 2),
        "eval_accuracy_step0": evals[0][1],
        "eval_accuracy_final": evals[-1][1],
        "eval_accuracy_by_step": evals,
        "peak_rss_mb": round(usage.ru_maxrss / 1024),  # Linux: ru_maxrss in KiB
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--algos", nargs="+", default=["ppo", "grpo", "dapo"], help="algorithms to run"
    )
    parser.add_argument(
        "--extra", default="", help="extra `fastrl train` options for every run (one string)"
    )
    args = parser.parse_args()
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    info = device_info("cpu")
    summary = {
        "machine": {"cpu": info.get("device_name"), "cores": info.get("cpu_count")},
        "torch": info.get("torch"),
        "triton": info.get("triton"),
        "git_commit": info.get("git_commit"),
        "time_utc": info.get("time_utc"),
        "command": "fastrl train --algo ALGO " + (args.extra or "(all other options default)"),
        "runs": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for algo in args.algos:
            summary["runs"][algo] = run_one(algo, shlex.split(args.extra), Path(tmp))
            print(
                algo,
                json.dumps(
                    {k: v for k, v in summary["runs"][algo].items() if k != "eval_accuracy_by_step"}
                ),
            )
    (RESULTS_DIR / "train_summary.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
