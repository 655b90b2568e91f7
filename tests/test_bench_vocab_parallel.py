"""Smoke test of benchmarks/bench_vocab_parallel.py: its --quick run (2 gloo processes against the
unsharded op, tiny shapes, 3 timed calls) writes a consistent results file: every row's fields,
the bytes communicated per call (the docstring's formula), the ratios, and the vocab-parallel
loss and gradients equal to the unsharded ones. It checks the script, not speed."""

from __future__ import annotations

import csv
import json
import subprocess

import pytest
from bench_run import run_bench

OPS = {"policy-loss", "logprobs"}


def _run(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return run_bench("bench_vocab_parallel.py", *args, timeout=timeout)


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    pytest.importorskip("matplotlib")
    out = tmp_path_factory.mktemp("bench_vocab_parallel")
    _run("--quick", "--device", "cpu", "--no-progress", "--out", str(out))
    return out


def test_help_explains_the_options():
    text = _run("--help").stdout
    for opt in ["--quick", "--out", "--device", "--N", "--H", "--V", "--world", "--threads",
                "--ops", "--config", "--memory", "--rep"]:  # fmt: skip
        assert opt in text, opt
    for word in ["gloo", "speedup_vs_unsharded", "comm_MB", "max over ranks", "loss_rel_diff"]:
        assert word in text, word


def test_quick_rows(quick):
    data = json.loads((quick / "bench_vocab_parallel_cpu.json").read_text())
    meta, rows = data["meta"], data["rows"]
    assert meta["git_commit"] and meta["torch"] and meta["backend"] == "gloo"
    assert meta["worlds"] == [2]
    budget = meta["thread_budget"]
    per_rank = max(1, budget // 2)
    assert meta["threads_per_rank"] == {"2": per_rank}

    # per op: unsharded at the per-rank budget and at the whole budget, and P = 2
    assert {r["op"] for r in rows} == OPS
    for op in OPS:
        mine = [r for r in rows if r["op"] == op]
        unsharded = {r["threads"]: r for r in mine if r["method"] == "unsharded"}
        assert set(unsharded) == {per_rank, budget}
        (vp,) = [r for r in mine if r["method"] == "vocab-parallel"]
        assert vp["P"] == 2 and vp["threads"] == per_rank and vp["total_threads"] == 2 * per_rank

        N, H, V = vp["N"], vp["H"], vp["V"]
        assert (N, H, V, vp["dtype"]) == (128, 64, 4096, "fp32")
        assert sum(vp["V_per_rank"]) == V and len(vp["V_per_rank"]) == 2
        assert len(vp["rank_ms"]) == 2 and len(vp["rank_peak_MB"]) == 2
        assert vp["peak_MB"] == max(vp["rank_peak_MB"])
        # bytes per call: all-gather of 4 fp32 per row per rank, d hidden all-reduce, the plan's
        # 18 int64 per rank
        assert vp["comm_allgather_B"] == 16 * N * 2
        assert vp["comm_allreduce_B"] == N * H * 4
        assert vp["comm_plan_B"] == 18 * 8 * 2
        total = vp["comm_allgather_B"] + vp["comm_allreduce_B"] + vp["comm_plan_B"]
        assert vp["comm_MB"] == pytest.approx(total / 2**20)
        assert vp["allgathers_per_call"] >= 1
        assert 0 < vp["comm_ms_q20"] <= vp["comm_ms"] <= vp["comm_ms_q80"]
        # the vocab-parallel op computes the unsharded one's loss and gradients
        assert vp["loss"] == pytest.approx(unsharded[per_rank]["loss"], rel=1e-5)
        assert vp["loss_rel_diff_vs_unsharded"] < 1e-5
        assert vp["grad_hidden_rel_diff"] < 1e-4 and vp["grad_weight_rel_diff"] < 1e-4
        # the ratios
        one, all_threads = unsharded[per_rank], unsharded[2 * per_rank]
        assert vp["speedup_vs_unsharded"] == pytest.approx(one["total_ms"] / vp["total_ms"])
        assert vp["speedup_vs_unsharded_all_threads"] == pytest.approx(
            all_threads["total_ms"] / vp["total_ms"]
        )
        assert vp["memory_vs_unsharded"] == pytest.approx(vp["peak_MB"] / one["peak_MB"])
        for r in mine:
            assert 0 < r["total_ms_q20"] <= r["total_ms"] <= r["total_ms_q80"], r["label"]
            assert r["peak_MB"] is not None and r["peak_MB"] > 0, r["label"]
            assert r["memory_method"].startswith("RSS high-water mark")
            assert r["TFLOPs"] > 0 and r["rep"] == 3
            assert r["logits_MB"] == pytest.approx(N * V * 4 / 2**20)

    with open(quick / "bench_vocab_parallel_cpu.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (quick / "bench_vocab_parallel_cpu.png").stat().st_size > 0
