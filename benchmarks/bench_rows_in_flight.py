"""Benchmark: the one-pass policy-loss kernel's persistent grid, swept (DESIGN, "the road to the
floor", step 2: does a row's second sweep come from L2, and do P programs still saturate HBM?).

    python benchmarks/bench_rows_in_flight.py                 # CUDA: N = 16384 at V = 151936
                                                              # and N = 8192 at V = 262144, bf16
    python benchmarks/bench_rows_in_flight.py --rows auto,0,132 --shapes 128x128x151936
    python benchmarks/bench_rows_in_flight.py --quick         # CPU smoke run (the plumbing only)

For each P of --rows, one child run of bench_policy_loss.py (`--methods fastrl`, the GRPO loss
forward + backward) with FASTRL_ONE_PASS=1 (the one-pass kernel: FASTRL_ROWS_IN_FLIGHT shapes its
grid only) and FASTRL_ROWS_IN_FLIGHT=P in its environment, recorded as `fastrl-one-pass`: `auto`
leaves FASTRL_ROWS_IN_FLIGHT unset (the launcher's own P: one program per row since an H200
measured the L2-sized grid of the first plan, min(SMs, 0.8 L2 / row bytes), slower,
benchmarks/bench_kernel_configs.py), 0 runs one program per row, any other P that many programs,
each looping over rows. Then, on CUDA, one child run of the library's default path, `fastrl`
(FASTRL_ONE_PASS and FASTRL_ROWS_IN_FLIGHT unset: the statistics kernel, one O(N) Triton kernel of
every token's dL/dlogp and dL/dH, the gradient kernel): the A/B. Each child is a fresh process,
so every P is timed the same way (bench_policy_loss.py's timing: triton.testing.do_bench on
CUDA); the Triton cache makes all but the first compile free.

Writes <out>/bench_rows_in_flight_<device>.{json,csv,png}: per shape, dtype and P, median ms
(q20-q80), GB/s and % of the HBM roofline of one read of the logits and one write of the
gradient (bench_policy_loss.py's columns), and the time relative to the default path
(`vs_default`). On the CPU neither variable changes anything (the chunked torch path runs; there
is no default-path row): --quick only checks that the sweep runs and records what it ran.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "bench_policy_loss.py"
CUDA_SHAPES = "128x128x151936,64x128x262144"
QUICK_SHAPES = "2x16x512"
DEFAULT_ROWS = "auto,0,66,132,264"
KEEP = ("N", "V", "dtype", "total_ms", "total_ms_q20", "total_ms_q80", "n_samples", "GBs", "pct_bw")
KEEP += ("peak_MB",)
ONE_PASS = "fastrl-one-pass"  # the swept rows: FASTRL_ONE_PASS=1, FASTRL_ROWS_IN_FLIGHT=P
DEFAULT = "fastrl"  # the A/B (CUDA): the library's default path, both variables unset


def child_rows(method: str, rows_in_flight: str | None, args, device: str, tmp: Path) -> list:
    """The `fastrl` rows of one bench_policy_loss.py child run for `method`: ONE_PASS (the
    one-pass kernel: FASTRL_ONE_PASS=1, FASTRL_ROWS_IN_FLIGHT set to `rows_in_flight` unless
    None) or DEFAULT (both unset: the library's default path); its stderr tail in the error when
    it fails."""
    out = tmp / f"{method}-{rows_in_flight}"
    cmd = [sys.executable, str(SCRIPT), "--device", device, "--methods", "fastrl"]
    cmd += ["--shapes", args.shapes, "--dtype", args.dtype, "--out", str(out), "--no-plot"]
    cmd += ["--no-progress", "--no-compile", "--no-verl", "--no-reference", "--no-liger"]
    if args.quick:
        cmd += ["--warmup", "1", "--rep", "2"]
    elif args.rep is not None:
        cmd += ["--rep", str(args.rep)] + (
            [] if args.warmup is None else ["--warmup", str(args.warmup)]
        )
    env = dict(os.environ)
    env.pop("FASTRL_ROWS_IN_FLIGHT", None)
    env.pop("FASTRL_ONE_PASS", None)
    if method == ONE_PASS:
        env["FASTRL_ONE_PASS"] = "1"
        if rows_in_flight is not None:
            env["FASTRL_ROWS_IN_FLIGHT"] = rows_in_flight
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    data = json.loads((out / f"bench_policy_loss_{device}.json").read_text())
    return [{k: r.get(k) for k in KEEP} for r in data["rows"] if r["method"] == "fastrl"]


def programs(rows_in_flight: str, N: int) -> int:
    """The grid size the one-pass launcher picks for N rows with FASTRL_ROWS_IN_FLIGHT =
    rows_in_flight (auto: unset): what each row of the sweep ran."""
    from fastrl.kernels import policy_loss as k

    old = os.environ.pop("FASTRL_ROWS_IN_FLIGHT", None)
    try:
        if rows_in_flight != "auto":
            os.environ["FASTRL_ROWS_IN_FLIGHT"] = rows_in_flight
        return k._rows_in_flight(N)
    finally:
        os.environ.pop("FASTRL_ROWS_IN_FLIGHT", None)
        if old is not None:
            os.environ["FASTRL_ROWS_IN_FLIGHT"] = old


def main(argv=None) -> None:
    parser = common.bench_parser(
        "bench_rows_in_flight.py",
        __doc__,
        device_help="cpu, cuda or auto (cuda when available); the sweep means something on CUDA",
    )
    parser.add_argument(
        "--rows",
        default=DEFAULT_ROWS,
        help="comma list of FASTRL_ROWS_IN_FLIGHT values: auto (unset: the launcher's choice), 0 "
        f"(one program per row) or a program count (default {DEFAULT_ROWS})",
    )
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"comma list of BxTxV shapes (default CUDA {CUDA_SHAPES}; --quick {QUICK_SHAPES})",
    )
    parser.add_argument("--dtype", default=None, help="logits dtype (default bf16; --quick fp32)")
    parser.add_argument("--rep", type=int, default=None, help="passed to bench_policy_loss.py")
    parser.add_argument("--warmup", type=int, default=None, help="passed to bench_policy_loss.py")
    common.add_run_args(
        parser,
        "bench_rows_in_flight",
        "tiny smoke run on the CPU: shape 2x16x512, fp32, --rows auto,0",
        memory_only=False,
    )
    args, device = common.parse_bench_args(parser, argv)
    cuda = device.type == "cuda"
    if not cuda and not args.quick:
        raise SystemExit("bench_rows_in_flight.py sweeps a Triton kernel's grid: run it on CUDA "
                         "(--device cuda), or --quick for the CPU smoke run")  # fmt: skip
    args.shapes = args.shapes or (QUICK_SHAPES if args.quick else CUDA_SHAPES)
    args.dtype = args.dtype or ("fp32" if args.quick else "bf16")
    rows_list = ["auto", "0"] if args.quick and args.rows == DEFAULT_ROWS else args.rows.split(",")
    bad = [p for p in rows_list if p != "auto" and not p.isdigit()]
    if bad:
        raise SystemExit(f"--rows: {bad} are neither auto nor an int >= 0")
    dev = device.type
    runs = [(ONE_PASS, p) for p in rows_list] + ([(DEFAULT, "auto")] if cuda else [])
    bar = common.progress(len(runs), "bench_rows_in_flight", disable=args.no_progress)
    rows, notes = [], {}
    # a stage timeout keeps the rows of the child runs done
    with common.keep_rows_on_interrupt(notes, rows), tempfile.TemporaryDirectory() as tmp:
        for method, p in runs:
            for r in child_rows(method, None if p == "auto" else p, args, dev, Path(tmp)):
                grid = programs(p, r["N"]) if method == ONE_PASS else None
                rows.append({"method": method, "rows_in_flight": p, "programs": grid, **r})
                bar.write(f"{method:18s} P={p:5s} N={r['N']} V={r['V']} {r['dtype']}: "
                          f"{r['total_ms']:.3f} ms, {r['GBs']:.1f} GB/s")  # fmt: skip
            bar.update()
    bar.close()
    case = lambda r: (r["N"], r["V"], r["dtype"])  # noqa: E731
    default = {case(r): r["total_ms"] for r in rows if r["method"] == DEFAULT}
    for r in rows:  # time relative to the default path at the same shape and dtype
        r["vs_default"] = r["total_ms"] / default[case(r)] if case(r) in default else None
    meta = {
        **common.device_info(device),
        "benchmark": "the one-pass policy-loss kernel's grid: fastrl.policy_loss fwd+bwd (GRPO) "
        "at FASTRL_ONE_PASS=1 and FASTRL_ROWS_IN_FLIGHT = P per child run of bench_policy_loss.py "
        "(rows fastrl-one-pass), against the default path (row fastrl: both unset; CUDA only)",
        "rows_in_flight": "auto: unset (the launcher's choice: one program per row); 0: one "
        "program per row; P: P programs, each looping over rows; `programs`: the grid the "
        "launcher picks for it (its _rows_in_flight), on the fastrl-one-pass rows only",
        "shapes": args.shapes,
        "dtype": args.dtype,
        "vs_default": "total_ms / the fastrl row's (the default path: FASTRL_ONE_PASS unset, the "
        "statistics kernel, the O(N) Triton kernel of dL/dlogp and dL/dH, the gradient kernel) "
        "at the same shape and dtype (CUDA only)",
        "notes": notes,
    }
    for r in rows:  # the bar label of the plot
        one_pass = r["method"] == ONE_PASS
        r["label"] = f"one-pass P={r['rows_in_flight']}" if one_pass else "fastrl (default)"
    panels = [common.TOTAL_MS_PANEL, ("GBs", "GB/s (1 read + 1 write of the logits)")]
    paths = common.save_cases(
        f"bench_rows_in_flight_{dev}",
        rows,
        meta,
        args,
        lambda r: f"N={r['N']} V={r['V']} {r['dtype']}",
        panels,
        "policy_loss fwd+bwd by FASTRL_ROWS_IN_FLIGHT",
        label="label",
    )
    print(paths)


if __name__ == "__main__":
    main()
