"""What the GPU will see, computed without one: the compiled resources of every Triton kernel at
its launch configurations, and the byte budget of each op per logits row.

    python benchmarks/kernel_report.py            # writes benchmarks/results/kernels_sm90.{json,md}
    python benchmarks/kernel_report.py --readme   # also rewrites the README block between
                                                  # <!-- kernels_sm90:start --> and :end -->

* Registers, spills, shared memory and warps of each kernel at each launch configuration its
  launcher can choose, for sm_90a (H100 / H200) and sm_80 (A100): `fastrl.kernels.compile_check`
  (triton.compile for the target, ptxas's report), results reused from its cache.
* Bytes read and written per logits row by each pass of `policy_loss` (forward + backward),
  `logprobs`, the sampler and the LM-head (fused-linear) paths, against the floor of each op,
  with the time those bytes take at an H100 SXM's (3.35 TB/s) and an H200's (4.8 TB/s) HBM
  bandwidth for N = 16384 rows of V = 151936 bf16 logits. Those times are bandwidth arithmetic
  (bytes / bandwidth), not measurements: no GPU was used.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
BLOCK = "kernels_sm90"  # README block: <!-- kernels_sm90:start --> ... <!-- kernels_sm90:end -->

N, V, ELEM = 16384, 151936, 2  # rows, vocabulary, bytes per bf16 logit
BANDWIDTH_TBS = {"H100 SXM": 3.35, "H200": 4.8}  # HBM3 / HBM3e peak, vendor data sheets
L2_MB = 50  # H100 SXM and H200
SMS = 132  # H100 SXM and H200

STATS, GRAD, SCALE = "_token_stats_fwd_kernel", "_token_stats_bwd_kernel", "_scale_grad_kernel"
ONE_PASS = "_policy_loss_fwd_kernel"
GEMM = "GEMM (cuBLAS)"

# op -> (passes over a logits row: (what, kernel, rows read, rows written), floor (reads, writes),
# how the floor is reached). Counted: traffic of the (N, V) logits and their gradient only; the
# per-row scalars (tokens, lse, H, g, h: < 50 B a row) and the GEMMs' hidden / weight traffic are
# left out.
OPS = {
    "policy_loss fwd + bwd": (
        [
            ("row statistics (forward)", STATS, 1, 0),
            ("dL/dz (forward: g, h from one O(N) kernel)", GRAD, 1, 1),
            ("x grad_output (backward; skipped when it is 1)", SCALE, 0, 0),
        ],
        (1, 1),
        "a row's second read from L2: an H200 measured the one-pass kernel (FASTRL_ONE_PASS=1, "
        "both sweeps in one program) slower than these two kernels, its second sweep from HBM "
        "too, and its L2-sized persistent grid slower still (DESIGN, step 2); a row held on "
        "chip (a thread-block cluster) is what is left",
    ),
    "policy_loss fwd + bwd, grad_output != 1": (
        [
            ("row statistics (forward)", STATS, 1, 0),
            ("dL/dz (forward)", GRAD, 1, 1),
            ("x grad_output (backward)", SCALE, 1, 1),
        ],
        (1, 1),
        "as above, with the scale folded into the loss (e.g. its num_tokens) so grad_output = 1",
    ),
    "policy_loss fwd + bwd, sequence-level (GSPO, sequence IS)": (
        [
            ("row statistics (forward)", STATS, 1, 0),
            ("dL/dz (forward: g, h from every row, torch)", GRAD, 1, 1),
        ],
        (2, 1),
        "at the floor: g needs every row's statistics first",
    ),
    "logprobs fwd + bwd": (
        [("row statistics (forward)", STATS, 1, 0), ("dL/dz (backward)", GRAD, 1, 1)],
        (2, 1),
        "at the floor: g, h come from the caller's loss after the forward",
    ),
    "logprobs, no grad (pi_old, pi_ref)": (
        [("row statistics", STATS, 1, 0)],
        (1, 0),
        "at the floor",
    ),
    "sample (rollout, one token per row)": (
        [("Gumbel-max sweep", "_sample_fwd_kernel", 1, 0)],
        (1, 0),
        "at the floor",
    ),
    "fused_linear_policy_loss (logits by chunks)": (
        [
            ("logits = h W^T", GEMM, 0, 1),
            ("row statistics", STATS, 1, 0),
            ("dL/dz in place", GRAD, 1, 1),
            ("dX = dz W", GEMM, 1, 0),
            ("dW += dz^T X", GEMM, 1, 0),
        ],
        (3, 2),
        "a row's second read from L2 (as policy_loss); a chunk held in L2 would go below",
    ),
    "linear_logprobs fwd + bwd": (
        [
            ("logits = h W^T (forward)", GEMM, 0, 1),
            ("row statistics (forward)", STATS, 1, 0),
            ("logits again (backward)", GEMM, 0, 1),
            ("dL/dz, in place (backward)", GRAD, 1, 1),
            ("dX = dz W", GEMM, 1, 0),
            ("dW += dz^T X", GEMM, 1, 0),
        ],
        (4, 3),
        "at the floor for a recomputing backward",
    ),
}


def _git_commit() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "kernels"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    except OSError:
        return "?"
    return f"{head} + uncommitted kernels/" if dirty else head


def compile_report() -> dict:
    """The compile check's results (cached ones reused): in this process, or in a subprocess
    when TRITON_INTERPRET=1 (interpreted kernels cannot be compiled)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        from fastrl.kernels import compile_check

        return compile_check.run((80, 90), cache_dir=compile_check.default_cache_dir())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "fastrl.kernels.compile_check", "--json"],
        capture_output=True, text=True, env=env, check=False,
    )  # fmt: skip
    if not proc.stdout.strip():
        raise RuntimeError(proc.stderr[-4000:])
    return json.loads(proc.stdout)


def byte_budget() -> dict:
    row = V * ELEM
    ops = []
    for op, (passes, (floor_r, floor_w), how) in OPS.items():
        reads = sum(p[2] for p in passes)
        writes = sum(p[3] for p in passes)
        entry = {
            "op": op,
            "passes": [
                {"what": w, "kernel": k, "reads_rows": r, "writes_rows": wr}
                for w, k, r, wr in passes
            ],
            "reads_rows": reads,
            "writes_rows": writes,
            "bytes_per_row": (reads + writes) * row,
            "floor_reads_rows": floor_r,
            "floor_writes_rows": floor_w,
            "floor_bytes_per_row": (floor_r + floor_w) * row,
            "floor_how": how,
        }
        for prefix in ("", "floor_"):
            total = entry[f"{prefix}bytes_per_row"] * N
            entry[f"{prefix}GB"] = total / 1e9
            for gpu, tbs in BANDWIDTH_TBS.items():  # bytes / (TB/s) -> ms: / 1e12 * 1e3
                entry[f"{prefix}predicted_ms_{gpu}"] = total / (tbs * 1e9)
        ops.append(entry)
    return {
        "shape": {"N": N, "V": V, "dtype": "bf16", "row_bytes": row, "logits_GB": N * row / 1e9},
        "bandwidth_TBs": BANDWIDTH_TBS,
        "rows_in_flight_MB": {
            "one program per SM": SMS * row / 1e6,
            "two programs per SM": 2 * SMS * row / 1e6,
            "L2": L2_MB,
        },
        "note": "predicted_ms = bytes / HBM bandwidth: arithmetic, not a measurement",
        "ops": ops,
    }


# The launches whose row sweeps are tabulated: (what, launcher function, arguments; a dict last:
# keyword arguments), at the
# byte budget's shape (N rows of V bf16 logits; the sampler at decode, 256 rows)
SWEEP_LAUNCHES = [
    # (logprobs and the policy loss store m and log s with the statistics, and every gradient
    # kernel forms p_j from them: exact at any offset of the logits)
    (
        "logprobs / policy_loss statistics",
        "row_stats_configs",
        (N, V, "bf16", SMS, {"shift": True}),
    ),
    ("policy_loss, one pass (FASTRL_ONE_PASS=1)", "policy_rows_configs", (N, V, "bf16", False)),
    ("policy_loss, one pass, entropy bonus", "policy_rows_configs", (N, V, "bf16", True)),
    (
        "logprobs backward / policy_loss gradient",
        "row_grad_configs",
        (N, V, "bf16", False, {"has_shift": True}),
    ),
    (
        "logprobs backward / policy_loss gradient, entropy term",
        "row_grad_configs",
        (N, V, "bf16", True, {"has_shift": True}),
    ),
    ("sample (Gumbel-max)", "sample_rows_configs", (N, V, "bf16", False, SMS)),
    # an odd vocabulary (GPT-2's): a row stride that is no multiple of 16, unaligned rows
    ("sample, V = 50257 (unaligned rows)", "sample_rows_configs", (N, 50257, "bf16", False, SMS)),
]


def sweep_costs(report: dict) -> list[dict]:
    """Per-logit SASS cost of the row sweeps of SWEEP_LAUNCHES on sm_90a: for each launch's
    kernels, each innermost loop of compile_check.sweeps (hot instructions a logit, exponentials
    a logit, barriers a block) and the kernel's registers."""
    import torch
    from fastrl.kernels import policy_loss, sampling

    dtypes = {"bf16": torch.bfloat16}
    funcs = {**{k: getattr(policy_loss, k) for k in ("row_stats_configs", "policy_rows_configs",
                                                      "row_grad_configs")},
             "sample_rows_configs": sampling.sample_rows_configs}  # fmt: skip
    index = {}
    for r in report["results"]:
        if r["arch"] == "sm_90a":
            key = (r["kernel"], json.dumps(r["constexprs"]), r["num_warps"],
                   r["signature"].get("logits_ptr"))  # fmt: skip
            index.setdefault(key, r)
    rows = []
    for what, fn, args in SWEEP_LAUNCHES:
        n, v, dt, *rest = args
        kw = rest.pop() if rest and isinstance(rest[-1], dict) else {}  # keyword arguments
        for cfg in funcs[fn](n, v, dtypes[dt], *rest, **kw):
            r = index.get((cfg.name, json.dumps(dict(cfg.constexprs)), cfg.num_warps, f"*{dt}"))
            if r is None:
                raise RuntimeError(f"{what}: {cfg.name} is not in the compile check's results")
            for loop in r.get("sweeps") or []:
                if loop["kind"] not in ("statistics", "gradient") or not loop["hot_per_logit"]:
                    continue
                per = loop["logits_per_thread"]
                rows.append({
                    "launch": what, "kernel": cfg.name, "num_warps": cfg.num_warps,
                    "BLOCK_V": dict(cfg.constexprs)["BLOCK_V"], "logits_per_thread": per,
                    "sweep": loop["kind"], "hot_per_logit": loop["hot_per_logit"],
                    "mufu_per_logit": round(loop["mufu"] / per, 2),
                    "barriers_per_block": loop["barriers"], "registers": r["registers"],
                })  # fmt: skip
    return rows


def summarize(report: dict) -> list[dict]:
    """One row per kernel: configs compiled, warps, register and shared-memory ranges."""
    out = {}
    for r in report["results"]:
        k = out.setdefault(
            r["kernel"],
            {"kernel": r["kernel"], "configs": 0, "warps": set(), "spill_bytes": 0,
             "registers": {}, "shared": {}},
        )  # fmt: skip
        k["configs"] += r["arch"] == "sm_90a"
        k["warps"].add(r["num_warps"])
        k["spill_bytes"] += (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0)
        k["registers"].setdefault(r["arch"], []).append(r.get("registers"))
        k["shared"].setdefault(r["arch"], []).append(r.get("shared"))
    rows = []
    for k in out.values():
        k["warps"] = sorted(k["warps"])
        for field in ("registers", "shared"):
            k[field] = {a: [min(v), max(v)] for a, v in k[field].items()}
        rows.append(k)
    return rows


def _range(lo_hi) -> str:
    lo, hi = lo_hi
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


def _ms(x: float) -> str:
    return f"{x:.2f}"


def markdown(data: dict, full: bool = True, root: str = "") -> str:
    """The Markdown tables: the kernel summary and the byte budget, and with `full` every launch
    configuration. `root`: the repository root relative to where the text goes (for links)."""
    meta, budget = data["meta"], data["byte_budget"]
    lines = [
        f"**Kernels compiled ahead of time for sm_90a (H100 / H200) and sm_80 (A100), no GPU** "
        f"(`python -m fastrl.kernels.compile_check`; triton {meta['triton']}, commit "
        f"{meta['git_commit']}, {meta['time_utc']}): {meta['launcher_calls']} launcher calls "
        f"(V from 1000 to 262144, 1 to 16384 rows, fp32 / bf16 / fp16, every flag) choose "
        f"{meta['unique_configs']} launch configurations; each compiles for both targets with "
        f"{'no register spills' if meta['spill_bytes'] == 0 else 'SPILLS'} and shared memory "
        f"within the limit per block (227 KB sm_90a, 163 KB sm_80). Registers per thread:",
        "",
        "| kernel | configs | warps | registers sm_90a | registers sm_80 | spills (B) | "
        "shared (B, max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for k in data["kernel_summary"]:
        lines.append(
            f"| `{k['kernel']}` | {k['configs']} | {', '.join(map(str, k['warps']))} | "
            f"{_range(k['registers']['sm_90a'])} | {_range(k['registers']['sm_80'])} | "
            f"{k['spill_bytes']} | {max(k['shared']['sm_90a'][1], k['shared']['sm_80'][1])} |"
        )
    if data.get("sweeps"):
        lines += [
            "",
            "**SASS instructions per logit in the row sweeps** (sm_90a, bf16, V = "
            f"{budget['shape']['V']}; the innermost loops of each kernel from triton's bundled "
            "cuobjdump, `compile_check.sweeps`): `hot` counts the instructions a block runs every "
            "time (the loop body less the bodies of uniform `if`s: the rescale when the row max "
            "grows, the block holding column y) over the logits a thread handles per block. "
            "Counts of compiled code, not measurements; an H200 issues about 132 x 4 x 32 "
            "instructions a clock (1.98 GHz), so 1 instruction per logit over N x V logits is "
            f"about {N * V / (132 * 4 * 32 * 1.98e9) * 1e3:.2f} ms of issue time.",
            "",
            "| launch | kernel | warps | logits a thread | sweep | instructions per logit | "
            "MUFU (exp2 / log2) per logit | barriers per block | registers |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in data["sweeps"]:
            lines.append(
                f"| {r['launch']} | `{r['kernel']}` | {r['num_warps']} | "
                f"{r['logits_per_thread']:g} | {r['sweep']} | {r['hot_per_logit']:.1f} | "
                f"{r['mufu_per_logit']:.2f} | {r['barriers_per_block']} | {r['registers']} |"
            )
    shape = budget["shape"]
    gpus = list(budget["bandwidth_TBs"])
    bw = ", ".join(f"{g} {t} TB/s" for g, t in budget["bandwidth_TBs"].items())
    lines += [
        "",
        f"**Byte budget per logits row** (bf16, V = {shape['V']}: a row is "
        f"{shape['row_bytes']:,} B; N = {shape['N']} rows hold {shape['logits_GB']:.2f} GB). "
        f"R / W: passes reading / writing a whole row. Times are **bandwidth arithmetic, not "
        f"measurements**: bytes for N rows / HBM bandwidth ({bw}); only the logits and their "
        "gradient are counted (per-row scalars < 50 B; GEMM FLOPs and weight traffic not "
        "included).",
        "",
        "| op | passes today | today R + W | GB | "
        + " | ".join(f"ms @ {g}" for g in gpus)
        + " | floor R + W | "
        + " | ".join(f"floor ms @ {g}" for g in gpus)
        + " | how the floor is reached |",
        "|---|---|---|---|" + "---|" * len(gpus) + "---|" + "---|" * len(gpus) + "---|",
    ]
    for op in budget["ops"]:
        passes = "; ".join(
            f"{p['what']}: `{p['kernel']}`" if p["kernel"] != GEMM else f"{p['what']}: GEMM"
            for p in op["passes"]
            if p["reads_rows"] or p["writes_rows"]
        )
        lines.append(
            f"| {op['op']} | {passes} | {op['reads_rows']}R + {op['writes_rows']}W | "
            f"{op['GB']:.1f} | "
            + " | ".join(_ms(op[f"predicted_ms_{g}"]) for g in gpus)
            + f" | {op['floor_reads_rows']}R + {op['floor_writes_rows']}W | "
            + " | ".join(_ms(op[f"floor_predicted_ms_{g}"]) for g in gpus)
            + f" | {op['floor_how']} |"
        )
    flight = budget["rows_in_flight_MB"]
    lines += [
        "",
        f"Rows in flight with one program per SM: {SMS} x {shape['row_bytes']:,} B = "
        f"{flight['one program per SM']:.0f} MB, under the {flight['L2']} MB L2 "
        f"({flight['two programs per SM']:.0f} MB at two per SM would not fit): the first plan; "
        "measured on an H200 such a grid starved HBM (8.5 ms against 4.9 ms for a program per "
        "row), see "
        f"[docs/DESIGN.md]({root}docs/DESIGN.md#on-the-gpu-the-byte-budget-and-the-road-to-the-floor).",
    ]
    if full:
        lines += [
            "",
            "Every launch configuration (`example launch`: the first launcher call that chose "
            "it, of `launches` in all):",
            "",
            "| kernel | constexprs | warps | pointers | regs sm_90a | regs sm_80 | spills | "
            "shared sm_90a / sm_80 (B) | launches | example launch |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        by_config: dict[str, dict] = {}
        for r in data["kernels"]:
            key = json.dumps([r["kernel"], r["constexprs"], r["num_warps"], r["signature"]])
            by_config.setdefault(key, {})[r["arch"]] = r
        for pair in by_config.values():
            a, b = pair["sm_90a"], pair["sm_80"]
            const = ", ".join(f"{k}={v}" for k, v in a["constexprs"].items())
            ptrs = sorted({v[1:] for v in a["signature"].values() if v.startswith("*")})
            spills = sum((r.get("spill_stores") or 0) + (r.get("spill_loads") or 0) for r in (a, b))
            lines.append(
                f"| `{a['kernel']}` | {const} | {a['num_warps']} | {', '.join(ptrs)} | "
                f"{a['registers']} | {b['registers']} | {spills} | {a['shared']} / {b['shared']} "
                f"| {a['launches']} | {a['example_launch']} |"
            )
    return "\n".join(lines) + "\n"


def build() -> dict:
    report = compile_report()
    keep = ("kernel", "arch", "constexprs", "num_warps", "signature", "specialized", "registers",
            "spill_stores", "spill_loads", "stack", "shared", "shared_limit", "ok", "error",
            "launches", "example_launch", "sweeps")  # fmt: skip
    kernels = [{k: r.get(k) for k in keep} for r in report["results"]]
    meta = {
        "triton": report["triton"],
        "torch": report["torch"],
        "git_commit": _git_commit(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "archs": report["archs"],
        "launcher_calls": report["launcher_calls"],
        "unique_configs": report["unique_configs"],
        "all_ok": report["ok"],
        "spill_bytes": sum(
            (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0) for r in kernels
        ),
        "device": "none: compiled for the targets by name, ptxas bundled with triton",
    }
    return {
        "meta": meta,
        "kernel_summary": summarize(report),
        "sweeps": sweep_costs(report),
        "byte_budget": byte_budget(),
        "kernels": kernels,
    }


def readme_block(data: dict, md_path: Path) -> str:
    """The README block: the summary tables, and where every configuration is listed."""
    rel = md_path.resolve()
    rel = rel.relative_to(ROOT) if rel.is_relative_to(ROOT) else rel
    return markdown(data, full=False) + f"\n(from `{rel}`; every configuration there)\n"


def rewrite_readme(readme: Path, block_text: str) -> None:
    body = readme.read_text()
    start, end = f"<!-- {BLOCK}:start -->", f"<!-- {BLOCK}:end -->"
    if start not in body or end not in body:
        raise SystemExit(f"{readme} has no {start} ... {end} block")
    head, rest = body.split(start, 1)
    _, tail = rest.split(end, 1)
    readme.write_text(f"{head}{start}\n{block_text}{end}{tail}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", default=str(RESULTS), help="where the JSON / md go")
    parser.add_argument(
        "--readme",
        action="store_true",
        help=f"also replace the README text between <!-- {BLOCK}:start --> and :end -->",
    )
    parser.add_argument("--readme-path", default=str(ROOT / "README.md"))
    args = parser.parse_args(argv)
    data = build()
    out = Path(args.results)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{BLOCK}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{BLOCK}.md").write_text(markdown(data, root="../../"))
    print(f"wrote {out / BLOCK}.json and .md")
    if args.readme:
        rewrite_readme(Path(args.readme_path), readme_block(data, out / f"{BLOCK}.md"))
        print(f"{args.readme_path} updated")
    if not data["meta"]["all_ok"]:
        sys.exit("some kernel configuration failed the compile check: see the JSON")


if __name__ == "__main__":
    main()
