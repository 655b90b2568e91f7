"""Turn the benchmark results (benchmarks/results/*.json) into the Markdown table the README shows.

    python benchmarks/report.py            # print the tables
    python benchmarks/report.py --readme   # rewrite the README blocks between its markers

Every number comes from a results file; each table names the machine, versions and commit that
produced it. Nothing is extrapolated: a device with no results file has no row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCKS = ("train", "bench")  # README blocks: <!-- NAME:start --> ... <!-- NAME:end -->


def _fmt(x, digits=1):
    return "" if x is None else f"{x:.{digits}f}"


def _machine(meta: dict) -> str:
    commit = str(meta.get("git_commit", "?"))[:7]
    return (
        f"{meta.get('device_name', meta.get('device'))} ({meta.get('device')}), torch "
        f"{meta.get('torch')}, triton {meta.get('triton')}, commit {commit}, {meta.get('time_utc')}"
    )


def _policy_loss(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    shape = meta["shape"]
    lines = [
        f"**Policy loss, forward + backward** (GRPO preset; N = {shape['B'] * shape['T']}, "
        f"V = {shape['V']}, {shape['dtype']}); {_machine(meta)}",
        "",
        "| method | median ms (q20 - q80) | vs eager | peak MB | memory vs eager | GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {_fmt(r['total_ms'])} ({_fmt(r['total_ms_q20'])} - "
            f"{_fmt(r['total_ms_q80'])}) | {_fmt(r.get('speedup_vs_eager'), 2)}x | "
            f"{_fmt(r.get('peak_MB'), 0)} | {_fmt(r.get('memory_vs_eager'), 2)} | "
            f"{_fmt(r.get('GBs'), 1)} |"
        )
    return lines


def _fused_linear(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    shape = meta["shape"]
    eager = next((r for r in rows if r["method"] == "linear+eager"), None)
    lines = [
        f"**Fused linear policy loss, forward + backward** (GRPO with token-mean; N = "
        f"{shape['N']}, H = {shape['H']}, V = {shape['V']}, {shape['dtype']}); {_machine(meta)}",
        "",
        "| method | median ms (q20 - q80) | TFLOP/s (6NHV) | peak MB | memory vs eager |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        rel = r["peak_MB"] / eager["peak_MB"] if eager and eager["peak_MB"] else None
        lines.append(
            f"| {r['method']} | {_fmt(r['total_ms'])} ({_fmt(r['total_ms_q20'])} - "
            f"{_fmt(r['total_ms_q80'])}) | {_fmt(r['TFLOPs'], 3)} | {_fmt(r['peak_MB'], 0)} | "
            f"{_fmt(rel, 2)} |"
        )
    return lines


def _generic(data: dict, title: str, speed_key: str) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    lines = [
        f"**{title}**; {_machine(meta)}",
        "",
        "| method | shape | median ms (q20 - q80) | speed-up | peak MB |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        shape = ", ".join(f"{k}={r[k]}" for k in ("B", "T", "N", "V", "dtype") if k in r)
        lines.append(
            f"| {r['method']} | {shape} | {_fmt(r['median_ms'])} ({_fmt(r['q20_ms'])} - "
            f"{_fmt(r['q80_ms'])}) | {_fmt(r.get(speed_key), 2)}x | {_fmt(r.get('peak_MB'), 0)} |"
        )
    return lines


def _training(data: dict) -> list[str]:
    m = data["machine"]
    lines = [
        f"**`{data['command']}`** on {m['cpu']} ({m['cores']} cores), torch {data['torch']}, "
        f"commit {data['git_commit'][:7]}",
        "",
        "| algo | wall (warm-up + RL) | RL steps/s | eval accuracy, step 0 -> last | peak RSS MB |",
        "|---|---|---|---|---|",
    ]
    for algo, r in data["runs"].items():
        lines.append(
            f"| {algo} | {r['wall_s_total']:.0f} s | {r['rl_steps_per_s']:.1f} | "
            f"{r['eval_accuracy_step0']:.3f} -> {r['eval_accuracy_final']:.3f} | "
            f"{r['peak_rss_mb']} |"
        )
    return lines


def tables(block: str) -> str:
    """The Markdown of one README block: "train" (train_summary.json) or "bench" (the rest)."""
    out: list[str] = []
    summary = RESULTS / "train_summary.json"
    if block == "train":
        if summary.exists():
            out += _training(json.loads(summary.read_text()))
            out += ["", f"(from `benchmarks/results/{summary.name}`)", ""]
        return "\n".join(out).rstrip() + "\n"
    for path in sorted(RESULTS.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "rows" not in data:
            continue
        name = path.stem
        if name.startswith("bench_policy_loss"):
            lines = _policy_loss(data)
        elif name.startswith("bench_fused_linear"):
            lines = _fused_linear(data)
        elif name.startswith("bench_gae"):
            lines = _generic(data, "GAE vs the per-step loop", "speedup_vs_loop")
        elif name.startswith("bench_sample"):
            lines = _generic(
                data, "Sampler vs multinomial + log_softmax gather", "speedup_vs_baseline"
            )
        else:
            continue
        out += lines + ["", f"(from `benchmarks/results/{path.name}`)", ""]
    return "\n".join(out).rstrip() + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--readme",
        action="store_true",
        help="replace the text between <!-- NAME:start --> and <!-- NAME:end --> in README.md, "
        f"for NAME in {BLOCKS}, with the tables",
    )
    args = parser.parse_args()
    if not args.readme:
        for block in BLOCKS:
            print(tables(block))
        return
    readme = ROOT / "README.md"
    body = readme.read_text()
    for block in BLOCKS:
        start, end = f"<!-- {block}:start -->", f"<!-- {block}:end -->"
        if start not in body or end not in body:
            raise SystemExit(f"README.md has no {start} ... {end} block")
        head, rest = body.split(start, 1)
        _, tail = rest.split(end, 1)
        body = f"{head}{start}\n{tables(block)}{end}{tail}"
    readme.write_text(body)
    print("README.md updated")


if __name__ == "__main__":
    main()
