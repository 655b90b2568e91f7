"""benchmarks/gpu_targets.py: issue 22's targets graded from hand-made *_cuda.json rows (met,
missed, not measured, each at its bound), CPU files grading nothing, and run_all's summary
carrying the table (its --merge builds it from the merged folder)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from bench_run import load_bench

ROOT = Path(__file__).resolve().parents[1]
gpu_targets = load_bench("gpu_targets.py")


def _write(out: Path, stem: str, rows: list[dict]) -> None:
    (out / f"{stem}.json").write_text(json.dumps({"meta": {"device": "cuda"}, "rows": rows}))


def _policy(method, total_ms, **kw):
    base = dict(method=method, N=16384, V=151936, dtype="bf16", total_ms=total_ms)
    return {**base, "peak_MB": 5000.0, "logits_MB": 4748.0, **kw}


def _linear(method, total_ms, peak_MB, **kw):
    base = dict(method=method, N=8192, H=4096, V=151936, dtype="bf16")
    return {**base, "total_ms": total_ms, "peak_MB": peak_MB, **kw}


@pytest.fixture
def cuda_results(tmp_path):
    _write(tmp_path, "bench_policy_loss_cuda", [
        # 85 % exactly (met at the bound), 1.5x Liger exactly, 9.9x TRL (missed), 16 B a row
        _policy("fastrl", 2.0, pct_bw=85.0, speedup_vs_trl_eager=9.9,
                peak_MB=4748.0 + 16 * 16384 / 2**20),
        _policy("liger", 3.0),
        _policy("trl-eager", 19.8),
    ])  # fmt: skip
    _write(tmp_path, "bench_fused_linear_cuda", [
        _linear("fastrl-fused-linear", 50.0, 900.0, x_gemm_floor=1.16),  # missed
        _linear("liger-fused-linear", 200.0, 1000.0),  # 4x: met; memory 0.9x: met
        _linear("linear_logprobs+grpo", 100.0, 1200.0),
        _linear("trl-chunked", 120.0, 1000.0),  # 1.2x: missed; memory 1.2x: missed
    ])  # fmt: skip
    _write(tmp_path, "bench_sample_cuda", [
        dict(method="multinomial+log_softmax", N=256, V=151936, dtype="bf16", pct_bw=20.0),
        dict(method="fastrl.sample", N=256, V=151936, dtype="bf16", pct_bw=81.0),
    ])  # fmt: skip
    _write(tmp_path, "bench_gae_cuda", [
        dict(method="python-loop", B=512, T=8192, speedup_vs_loop=1.0),
        dict(method="fastrl.gae", B=512, T=8192, speedup_vs_loop=250.0),
    ])  # fmt: skip
    return tmp_path


def test_each_target_is_graded_at_its_bound(cuda_results):
    pytest_gpu = {"passed": 120, "failures": 0, "errors": 0, "skipped": 3, "note": "on H100"}
    rows = gpu_targets.grade(cuda_results, pytest_gpu)
    verdicts = {r["target"]: r["verdict"] for r in rows}
    assert verdicts == {
        "pytest -m gpu passes": "met",
        "policy_loss >= 85 % of the HBM roofline (1R + 1W)": "met",
        "policy_loss >= 1.5x Liger triton_grpo_loss": "met",
        "policy_loss >= 10x TRL eager": "missed",
        "policy_loss extra memory O(N): <= 1024 B a row beyond its gradient": "met",
        "fused_linear_policy_loss <= 1.15x the three bare GEMMs": "missed",
        "fused_linear_policy_loss >= 3x Liger fused-linear GRPO": "met",
        "fused_linear_policy_loss peak memory <= Liger's": "met",
        "linear_logprobs + TRL loss >= 1.3x TRL 1.16 fused LM head": "missed",
        "linear_logprobs + TRL loss peak memory <= TRL's": "missed",
        "fastrl.sample >= 80 % of the read-once roofline": "met",
        "fastrl.gae >= 100x verl's per-step loop at B=512 T=8192": "met",
    }
    values = {r["target"]: r["value"] for r in rows}
    assert values["policy_loss >= 1.5x Liger triton_grpo_loss"] == pytest.approx(1.5)
    assert values["fused_linear_policy_loss >= 3x Liger fused-linear GRPO"] == pytest.approx(4)
    extra = "policy_loss extra memory O(N): <= 1024 B a row beyond its gradient"
    assert values[extra] == pytest.approx(16)
    text = "\n".join(gpu_targets.markdown(rows))
    assert "8 met, 4 missed, 0 not measured." in text
    assert "| 2 | policy_loss >= 10x TRL eager | N=16384 V=151936 bf16 | 9.90 x | missed |" in text


def test_missing_rows_and_failures(cuda_results, tmp_path):
    """No Liger row: that ratio is not measured (not met); a failed gpu test misses item 1; a
    gae run at another shape grades nothing; a CPU-only folder (the committed CPU results
    alone) grades nothing at all."""
    rows = json.loads((cuda_results / "bench_policy_loss_cuda.json").read_text())["rows"]
    _write(cuda_results, "bench_policy_loss_cuda", [r for r in rows if r["method"] != "liger"])
    _write(cuda_results, "bench_gae_cuda", [dict(method="fastrl.gae", B=64, T=1024,
                                                 speedup_vs_loop=500.0)])  # fmt: skip
    failed = {"passed": 100, "failures": 2, "errors": 0, "skipped": 0, "note": "on H100"}
    graded = {r["target"]: r for r in gpu_targets.grade(cuda_results, failed)}
    assert graded["pytest -m gpu passes"]["verdict"] == "missed"
    assert graded["policy_loss >= 1.5x Liger triton_grpo_loss"]["verdict"] == "not measured"
    gae = graded["fastrl.gae >= 100x verl's per-step loop at B=512 T=8192"]
    assert gae["verdict"] == "not measured" and gae["case"] == "B=64 T=1024"
    no_cuda = {"passed": 0, "failures": 0, "errors": 0, "skipped": 90, "note": "no CUDA device"}
    cpu_dir = tmp_path / "cpu_only"
    cpu_dir.mkdir()
    for path in (ROOT / "benchmarks" / "results").glob("*_cpu*.json"):
        shutil.copy(path, cpu_dir / path.name)
    assert list(cpu_dir.glob("bench_policy_loss_cpu*.json"))
    cpu_only = gpu_targets.grade(cpu_dir, no_cuda)
    assert {r["verdict"] for r in cpu_only} == {"not measured"}
    assert len(cpu_only) == 5  # one row per item's targets, none graded


def test_cli_reads_the_folder_and_its_summary(cuda_results):
    (cuda_results / "summary.json").write_text(
        json.dumps({"pytest_gpu": {"passed": 5, "failures": 0, "errors": 0, "note": "on H200"}})
    )
    script = ROOT / "benchmarks" / "gpu_targets.py"
    proc = subprocess.run([sys.executable, str(script), "--results", str(cuda_results)],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert "| 1 | pytest -m gpu passes | on H200 | 0 failed | met |" in proc.stdout
    proc = subprocess.run([sys.executable, str(script), "--results", str(cuda_results), "--json"],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert len(json.loads(proc.stdout)) == 12
    help_text = subprocess.run([sys.executable, str(script), "--help"], capture_output=True,
                               text=True, timeout=60).stdout  # fmt: skip
    assert "--results" in help_text and "--json" in help_text and "85 %" in help_text
    missing = cuda_results / "nowhere"
    bad = subprocess.run([sys.executable, str(script), "--results", str(missing)],
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and f"--results {missing}: no such folder" in bad.stderr


def test_the_sampler_kernel_is_graded_at_many_rows_from_the_kernel_sweep(cuda_results):
    """Item 4 also reads bench_kernel_configs' sampler rows chosen by the launcher ("default")
    at more than 256 rows (the sample bench's decode call is bound by its launch): GB/s against
    the file's peak; the swept configurations and the 256-row row grade nothing."""
    rows = [
        dict(kind="sample", V=151936, config="N=256 default", GBs=400.0),
        dict(kind="sample", V=151936, config="N=4096 BLOCK_V=1024 warps=1", GBs=4700.0),
        dict(kind="sample", V=151936, config="N=4096 default", GBs=3900.0),
        dict(kind="sample", V=32000, config="N=4096 default", GBs=2400.0),
        dict(kind="stats", V=151936, config="BLOCK_V=1024 warps=1 stages=default", GBs=4000.0),
    ]
    meta = {"device": "cuda", "peak_bandwidth_GBs": 4800.0}
    path = cuda_results / "bench_kernel_configs_cuda.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}))
    graded = [r for r in gpu_targets.grade(cuda_results) if r["file"] == path.name]
    assert [(r["case"], r["verdict"]) for r in graded] == [
        ("N=4096 V=151936 bf16, the kernel", "met"),
        ("N=4096 V=32000 bf16, the kernel", "missed"),
    ]
    assert [r["value"] for r in graded] == pytest.approx([81.25, 50.0])
