"""Issue 22's targets, graded from the CUDA results files: one row per target and case, each with
what was measured, met / missed / not measured, and the file it was read from.

    python benchmarks/gpu_targets.py                         # benchmarks/results/
    python benchmarks/gpu_targets.py --results /tmp/gpu/run  # a run_all --out folder

run_all.py puts the same table in its summary (and --merge in the merged one), so the GPU
session's note can quote it. Only *_cuda.json files count: a CPU file grades nothing (every
target then reads "not measured"). The targets, as the issue states them:

  1  pytest -m gpu passes                       (run_all's junit counts, summary.json)
  2  policy_loss fwd+bwd >= 85 % of the HBM roofline of 1R + 1W of the logits (pct_bw)
     >= 1.5x Liger's triton_grpo_loss, >= 10x TRL's eager path (speedup_vs_trl_eager)
     extra memory O(N): peak above the inputs minus the (N, V) gradient it returns, per row
     (graded against 1 KiB a row; a bf16 row of logits at V = 151936 is 297 KiB)
  3  fused_linear_policy_loss fwd+bwd <= 1.15x the three bare GEMMs (x_gemm_floor),
     >= 3x Liger's fused-linear GRPO loss at <= its peak memory;
     linear_logprobs + TRL's loss >= 1.3x TRL 1.16's fused LM head (trl-chunked) at <= its memory
  4  fastrl.sample >= 80 % of the read-once roofline (pct_bw); fastrl.gae >= 100x the per-step
     loop (verl's form) at B = 512, T = 8192
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
EXTRA_BYTES_PER_ROW = 1024  # the O(N) grade of target 2's memory: bytes a row beyond the gradient


def load_json(path: Path) -> dict | None:
    """The JSON in `path`, or None when it is missing or not JSON (a stage that did not run or
    was cut while writing). run_all reads its results files with it too."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _rows(out: Path, stem: str) -> tuple[list[dict], str]:
    """The rows of <out>/<stem>_cuda.json (none when it is missing) and its file name."""
    path = out / f"{stem}_cuda.json"
    data = load_json(path)
    return (data or {}).get("rows", []), path.name


def _ratio(num, den):
    return None if not num or not den else num / den


def grade(out: Path, pytest_gpu: dict | None = None) -> list[dict]:
    """One dict per target and case: item, target, case, value (a number or None), unit, verdict
    (met / missed / not measured), file. A target with no CUDA row gets one "not measured" row."""
    out = Path(out)
    rows: list[dict] = []

    def add(where: tuple, target: str, value, unit: str, op: str, bound: float, verdict=None):
        """where = (item, case, file); met when value `op` (">=" / "<=") bound."""
        if verdict is None:
            met = value is not None and (value >= bound if op == ">=" else value <= bound)
            verdict = "not measured" if value is None else "met" if met else "missed"
        item, case, file = where
        rows.append(dict(item=item, target=target, case=case, value=value, unit=unit,
                         verdict=verdict, file=file))  # fmt: skip

    # 1. hardware correctness (run_all's junit counts)
    where = ("1", "", "pytest_gpu.xml")
    if pytest_gpu and pytest_gpu.get("passed") is not None:
        bad = pytest_gpu.get("failures", 0) + pytest_gpu.get("errors", 0)
        note = str(pytest_gpu.get("note", ""))
        whole = "no CUDA" not in note and "cut at" not in note  # on a GPU, every test run
        verdict = "missed" if bad else "met" if whole and pytest_gpu["passed"] else "not measured"
        where = ("1", note, "pytest_gpu.xml")
        add(where, "pytest -m gpu passes", bad, "failed", "<=", 0, verdict)
    else:
        add(where, "pytest -m gpu passes", None, "failed", "<=", 0)

    # 2. the logits path: every (N, V, dtype) case of bench_policy_loss
    pl, name = _rows(out, "bench_policy_loss")
    cases: dict[tuple, dict] = {}
    for r in pl:
        cases.setdefault((r["N"], r["V"], r["dtype"]), {})[r["method"]] = r
    for (N, V, dtype), by in cases.items():
        f, liger = by.get("fastrl"), by.get("liger")
        if f is None:
            continue
        where = ("2", f"N={N} V={V} {dtype}", name)
        add(where, "policy_loss >= 85 % of the HBM roofline (1R + 1W)", f.get("pct_bw"),
            "% of peak", ">=", 85)  # fmt: skip
        add(where, "policy_loss >= 1.5x Liger triton_grpo_loss",
            _ratio(liger and liger["total_ms"], f["total_ms"]), "x", ">=", 1.5)  # fmt: skip
        add(where, "policy_loss >= 10x TRL eager", f.get("speedup_vs_trl_eager"), "x", ">=", 10)
        extra = (f["peak_MB"] - f["logits_MB"]) * 2**20 / N if f.get("peak_MB") else None
        add(where, f"policy_loss extra memory O(N): <= {EXTRA_BYTES_PER_ROW} B a row beyond "
            "its gradient", extra, "B / row", "<=", EXTRA_BYTES_PER_ROW)  # fmt: skip
    if not cases:
        add(("2", "", name), "policy_loss: roofline, Liger, TRL eager, memory", None, "", ">=", 0)

    # 3. the LM-head path: every (N, H, V, dtype) case of bench_fused_linear
    fl, name = _rows(out, "bench_fused_linear")
    cases = {}
    for r in fl:
        cases.setdefault((r["N"], r["H"], r["V"], r["dtype"]), {})[r["method"]] = r
    for (N, H, V, dtype), by in cases.items():
        f, lp = by.get("fastrl-fused-linear"), by.get("linear_logprobs+grpo")
        liger, trl = by.get("liger-fused-linear"), by.get("trl-chunked")
        where = ("3", f"N={N} H={H} V={V} {dtype}", name)
        if f is not None:
            add(where, "fused_linear_policy_loss <= 1.15x the three bare GEMMs",
                f.get("x_gemm_floor"), "x GEMMs", "<=", 1.15)  # fmt: skip
            add(where, "fused_linear_policy_loss >= 3x Liger fused-linear GRPO",
                _ratio(liger and liger["total_ms"], f["total_ms"]), "x", ">=", 3)  # fmt: skip
            add(where, "fused_linear_policy_loss peak memory <= Liger's",
                _ratio(f["peak_MB"], liger and liger["peak_MB"]), "x Liger's", "<=", 1)  # fmt: skip
        if lp is not None:
            add(where, "linear_logprobs + TRL loss >= 1.3x TRL 1.16 fused LM head",
                _ratio(trl and trl["total_ms"], lp["total_ms"]), "x", ">=", 1.3)  # fmt: skip
            add(where, "linear_logprobs + TRL loss peak memory <= TRL's",
                _ratio(lp["peak_MB"], trl and trl["peak_MB"]), "x TRL's", "<=", 1)  # fmt: skip
    if not cases:
        add(("3", "", name), "fused linear: GEMM floor, Liger, TRL", None, "", ">=", 0)

    # 4. sampler and gae
    rows_, name = _rows(out, "bench_sample")
    target = "fastrl.sample >= 80 % of the read-once roofline"
    hits = [r for r in rows_ if r["method"] == "fastrl.sample"]
    for r in hits:
        where = ("4", f"N={r['N']} V={r['V']} {r['dtype']}", name)
        add(where, target, r.get("pct_bw"), "% of peak", ">=", 80)
    if not hits:
        add(("4", "", name), target, None, "", ">=", 80)
    # the sampler kernel at many rows (bench_kernel_configs: its launcher's own choice), where
    # the bench's decode call of 256 rows is bound by the launch, not by the read
    path = out / "bench_kernel_configs_cuda.json"
    data = load_json(path) or {}
    peak = (data.get("meta") or {}).get("peak_bandwidth_GBs")
    for r in data.get("rows", []):
        if r.get("kind") == "sample" and r.get("config", "").endswith(" default"):
            n = r["config"].split()[0]  # "N=4096"
            if n != "N=256" and peak and r.get("GBs"):
                where = ("4", f"{n} V={r['V']} bf16, the kernel", path.name)
                add(where, target, 100 * r["GBs"] / peak, "% of peak", ">=", 80)
    rows_, name = _rows(out, "bench_gae")
    target = "fastrl.gae >= 100x verl's per-step loop at B=512 T=8192"
    hits = [r for r in rows_ if r["method"] == "fastrl.gae"]
    for r in hits:
        at = (r["B"], r["T"]) == (512, 8192)  # another shape grades nothing
        where = ("4", f"B={r['B']} T={r['T']}", name)
        add(where, target, r.get("speedup_vs_loop") if at else None, "x", ">=", 100)
    if not hits:
        add(("4", "", name), target, None, "", ">=", 100)
    return rows


def _value(r: dict) -> str:
    v = r["value"]
    if v is None:
        return "-"
    if isinstance(v, int):  # a count
        return f"{v} {r['unit']}"
    return f"{v:.0f} {r['unit']}" if abs(v) >= 100 else f"{v:.2f} {r['unit']}"


def markdown(rows: list[dict]) -> list[str]:
    """The table's lines (Markdown)."""
    lines = ["| item | target | case | measured | verdict | from |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['item']} | {r['target']} | {r['case'] or '-'} | {_value(r)} | "
            f"{r['verdict']} | {r['file']} |"
        )
    met = sum(r["verdict"] == "met" for r in rows)
    missed = sum(r["verdict"] == "missed" for r in rows)
    lines += ["", f"{met} met, {missed} missed, {len(rows) - met - missed} not measured."]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--results",
        type=Path,
        default=RESULTS,
        help="folder of the *_cuda.json results files (and run_all's summary.json, whose "
        "pytest counts grade item 1); default benchmarks/results/",
    )
    p.add_argument("--json", action="store_true", help="print the rows as JSON instead")
    args = p.parse_args(argv)
    if not args.results.is_dir():
        p.error(f"--results {args.results}: no such folder")
    summary = load_json(args.results / "summary.json") or {}
    rows = grade(args.results, summary.get("pytest_gpu"))
    print(json.dumps(rows, indent=1) if args.json else "\n".join(markdown(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
