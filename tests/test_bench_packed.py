"""Smoke test of benchmarks/bench_packed.py: its --quick run (tiny shapes, 1-2 repetitions) writes
a consistent results file (every row's fields, the packed / padded ratios, the same loss for
both layouts). It checks the script, not speed."""

from __future__ import annotations

import csv
import json
import math
import subprocess

import pytest
from bench_run import assert_measures_cover, run_bench

METHODS = {"fastrl-padded", "fastrl-packed", "trl-eager-padded", "trl-eager-packed"}


def _run(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return run_bench("bench_packed.py", *args, timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("trl")
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench_packed")
    run_bench("bench_packed.py", "--quick", "--no-progress", "--out", str(out), trace=out / "trace")
    return out


def test_staleness_covers_the_code_it_runs(quick):
    """report.MEASURES names every library file the traced --quick run executes."""
    meta = json.loads((quick / "bench_packed_cpu.json").read_text())["meta"]
    executed = assert_measures_cover("bench_packed", "bench_packed_cpu", meta, quick / "trace")
    assert "fastrl/packing.py" in executed


def test_help_explains_the_options():
    text = _run("--help").stdout
    for opt in ["--quick", "--out", "--device", "--S", "--T", "--V", "--dtype", "--memory"]:
        assert opt in text, opt
    for word in ["cu_seqlens", "trl-eager-padded", "speedup_packed_vs_padded", "useful_GBs"]:
        assert word in text, word


def test_quick_rows(quick):
    data = json.loads((quick / "bench_packed_cpu.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["git_commit"] and meta["torch"] and meta["machine_rates"]["copy_GBs"] > 0
    assert {c["dtype"] for c in meta["cases"]} == {"fp32", "bf16"}
    for case in meta["cases"]:
        assert len(case["lengths"]) == case["S"] and sum(case["lengths"]) == case["N"]
        assert max(case["lengths"]) == case["T"]
        assert 0.3 <= case["pad_frac"] <= 0.7  # ~50 % padding
    fused = [r for r in rows if r["section"] == "fused-linear"]
    if meta["fused_linear"]["supported"]:
        assert {r["method"] for r in fused} == {"fused-linear-padded", "fused-linear-packed"}
    else:  # skipped, and the results say why
        assert not fused and "cu_seqlens" in meta["notes"]["fused-linear"]

    by = {(r["method"], r["dtype"]): r for r in rows}
    for dtype in ("fp32", "bf16"):
        assert METHODS <= {m for m, d in by if d == dtype}
    for r in rows:
        assert not r["oom"]
        assert 0 < r["total_ms_q20"] <= r["total_ms"] <= r["total_ms_q80"]
        assert r["peak_MB"] is not None and r["peak_MB"] > -1  # inline RSS: noise at this size
        assert r["rows"] == (r["S"] * r["T"] if r["layout"] == "padded" else r["N"])
        assert r["N"] < r["S"] * r["T"]
        pad = by[(f"{r['family']}-padded", r["dtype"])]
        assert r["speedup_packed_vs_padded"] == pytest.approx(pad["total_ms"] / r["total_ms"])
        assert r["loss_rel_diff_vs_padded"] == pytest.approx(
            abs(r["loss"] - pad["loss"]) / abs(pad["loss"])
        )
        # packed and padded compute the same seq-mean-token-mean loss
        assert math.isclose(r["loss"], pad["loss"], rel_tol=1e-3 if r["dtype"] == "bf16" else 1e-5)
        if r["section"] == "logits":
            itemsize = 4 if r["dtype"] == "fp32" else 2
            sec = r["total_ms"] / 1e3
            assert r["GBs"] == pytest.approx(2 * r["rows"] * r["V"] * itemsize / 1e9 / sec)
            assert r["useful_GBs"] == pytest.approx(2 * r["N"] * r["V"] * itemsize / 1e9 / sec)
            base = by[("trl-eager-padded", r["dtype"])]
            assert r["speedup_vs_trl_eager_padded"] == pytest.approx(
                base["total_ms"] / r["total_ms"]
            )
        else:
            assert r["TFLOPs"] > 0 and r["useful_TFLOPs"] > 0
    # fastrl and TRL agree on the fp32 loss
    base = by[("trl-eager-padded", "fp32")]["loss"]
    for r in rows:
        if r["dtype"] == "fp32" and r["section"] == "logits":
            assert math.isclose(r["loss"], base, rel_tol=1e-4, abs_tol=1e-5), r["method"]

    with open(quick / "bench_packed_cpu.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (quick / "bench_packed_cpu.png").stat().st_size > 0
