"""Smoke tests of benchmarks/: the --quick runs of bench_policy_loss.py and bench_fused_linear.py
(tiny shapes, 1-2 repetitions) write consistent results, and report.py turns them into the README
tables. They check the scripts, not speed."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_run import assert_measures_cover, load_bench, run_bench

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


_run = run_bench
SWEEP = ["--chunk-sizes", "8", "16"]  # the quick fused-linear run's chunk-size sweep


def _load(path: Path) -> dict:
    return json.loads(path.read_text())


def _report():
    return load_bench("report.py")


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    """Both benchmarks' --quick runs (fp32; no torch.compile / Liger rows: those compile for
    tens of seconds, see the slow test) into one folder; the fused-linear one with a chunk-size
    sweep (8 and 16 rows per chunk; the default at V = 512 is one chunk of all 64 rows)."""
    out = tmp_path_factory.mktemp("bench")
    common = ["--quick", "--dtype", "fp32", "--no-progress", "--out", str(out)]
    _run("bench_policy_loss.py", *common, "--no-compile", trace=out / "bench_policy_loss.trace")
    _run("bench_fused_linear.py", *common, "--no-liger", *SWEEP,
         trace=out / "bench_fused_linear.trace")  # fmt: skip
    return out


@pytest.mark.parametrize("bench", ["bench_policy_loss", "bench_fused_linear"])
def test_staleness_covers_the_code_the_loss_benchmarks_run(quick_results, bench):
    """report.MEASURES names every library file the benchmark executes (traced --quick run), so
    a change to any of them marks its table stale."""
    meta = _load(quick_results / f"{bench}_cpu.json")["meta"]
    executed = assert_measures_cover(bench, f"{bench}_cpu", meta, quick_results / f"{bench}.trace")
    assert {"fastrl/ops.py", "fastrl/terms.py", "fastrl/chunked.py"} <= set(executed)


@pytest.mark.parametrize(
    "script, args",
    [
        ("bench_gae.py", ["--B", "16", "--T", "64", "--rep", "2", "--loop-rep", "1", "--no-verl"]),
        ("bench_sample.py", ["--N", "8", "--V", "64", "--rep", "2"]),
    ],
)
def test_staleness_covers_the_code_gae_and_sample_run(tmp_path, script, args):
    """The same for bench_gae.py and bench_sample.py, on tiny shapes."""
    bench = script.removesuffix(".py")
    _run(script, *args, "--out", str(tmp_path), trace=tmp_path / "trace")
    meta = _load(tmp_path / f"{bench}_cpu.json")["meta"]
    executed = assert_measures_cover(bench, f"{bench}_cpu", meta, tmp_path / "trace")
    assert f"fastrl/{bench.removeprefix('bench_').replace('sample', 'sampling')}.py" in executed


TINY_LOGPROBS = ["--B", "2", "--T", "16", "--V", "300", "--H", "32", "--rep", "2", "--no-compile"]


def test_logprobs_benchmark_writes_both_entries_and_their_errors(tmp_path):
    """bench_logprobs.py on tiny shapes: the rows of both entries against TRL's method of each,
    fastrl's log-probs within fp32 rounding of the exact ones where TRL's bf16 log_softmax is
    not, MEASURES covering the code it runs, and the README table."""
    _run("bench_logprobs.py", *TINY_LOGPROBS, "--out", str(tmp_path), trace=tmp_path / "trace")
    data = _load(tmp_path / "bench_logprobs_cpu.json")
    rows = {r["method"]: r for r in data["rows"]}
    assert_measures_cover("bench_logprobs", "bench_logprobs_cpu", data["meta"], tmp_path / "trace")
    for name in ("logits: trl selective_log_softmax", "hidden: trl-chunked"):
        assert rows[name]["speedup_vs_trl"] == 1.0
    for name in ("logits: fastrl.logprobs", "logits: fastrl.logprobs mask= +H"):
        assert rows[name]["max_abs_err_logp"] < 1e-5 and "GBs" in rows[name]
    assert rows["logits: trl selective_log_softmax"]["max_abs_err_logp"] > 1e-3  # bf16-rounded
    assert rows["hidden: gemm-floor"]["max_abs_err_logp"] is None
    assert rows["hidden: gemm-floor"]["x_gemm_floor"] == 1.0
    assert rows["hidden: fastrl.linear_logprobs mask="]["TFLOPs"] >= 0
    assert 0.5 <= data["meta"]["counted_share"] <= 1.0
    table = _report().tables("bench", tmp_path)
    assert "No-grad log-probs of pi_old / pi_ref" in table
    assert "| logits: fastrl.logprobs mask= |" in table


@pytest.mark.parametrize("script", ["bench_gae.py", "bench_sample.py"])
def test_busy_runs_get_their_own_results_file(tmp_path, script):
    """--busy 1 times the one-op benchmarks with another process spinning, into
    <bench>_cpu_busy1.* (beside the idle file, which it leaves alone), and the table says so."""
    bench = script.removesuffix(".py")
    tiny = ["--N", "8", "--V", "64"] if "sample" in script else ["--B", "4", "--T", "16"]
    tiny += ["--loop-rep", "1", "--no-verl"] if "gae" in script else []
    _run(script, *tiny, "--rep", "2", "--busy", "1", "--out", str(tmp_path))
    assert not (tmp_path / f"{bench}_cpu.json").exists()
    data = _load(tmp_path / f"{bench}_cpu_busy1.json")
    assert data["meta"]["busy_processes"] == 1
    assert "keeping a core busy" in _report().tables("bench", tmp_path)


@pytest.mark.parametrize(
    "script, measure", [("bench_policy_loss.py", "bench_method"), ("bench_fused_linear.py", "run")]
)
def test_a_cut_run_keeps_the_rows_it_measured(tmp_path, monkeypatch, script, measure):
    """run_all's stage timeout sends SIGINT (a KeyboardInterrupt) before it kills a stage: the
    loss benchmarks then write the rows timed so far, with a note, instead of nothing (a lent
    GPU call's stage cut at its timeout used to lose every row)."""
    mod = load_bench(script)
    real, calls = getattr(mod, measure), []

    def third_call_interrupted(*a, **kw):
        calls.append(a[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(mod, measure, third_call_interrupted)
    extra = ["--no-compile"] if script == "bench_policy_loss.py" else ["--no-liger"]
    mod.main(["--quick", "--dtype", "fp32", "--no-progress", "--no-plot", "--out", str(tmp_path),
              *extra])  # fmt: skip
    data = _load(tmp_path / f"{script.removesuffix('.py')}_cpu.json")
    assert [r["method"] for r in data["rows"]] == calls[:2]
    assert "cut short by SIGINT" in data["meta"]["notes"]["interrupted"]
    assert all(math.isfinite(r["total_ms"]) for r in data["rows"])


def test_help_explains_the_options():
    fused = ["--quick", "--shapes", "--dtype", "--slow-ms", "gemm-floor", "--chunk-sizes"]
    for script, options in [
        ("bench_policy_loss.py", ["--quick", "--shapes", "--dtype", "--slow-rep", "trl-eager"]),
        ("bench_fused_linear.py", [*fused, "[chunk=C]"]),
    ]:
        text = _run(script, "--help").stdout
        for opt in options:
            assert opt in text, (script, opt)


def test_policy_loss_quick_rows(quick_results):
    data = _load(quick_results / "bench_policy_loss_cpu.json")
    meta, rows = data["meta"], data["rows"]
    names = [r["method"] for r in rows]
    assert {"fastrl", "fastrl-inplace", "trl-eager", "reference (oracle)"} <= set(names)
    assert "verl-eager" in names or "verl-eager" in meta["notes"]
    assert "trl-eager-compiled" not in names  # --no-compile
    rates = meta["machine_rates"]
    assert rates["copy_GBs"] > 0 and rates["exp_per_s"] > 0
    assert meta["git_commit"] and meta["torch"] and "bwd_note" in meta
    base = next(r for r in rows if r["method"] == "trl-eager")
    assert base["speedup_vs_trl_eager"] == pytest.approx(1.0)
    for r in rows:
        assert r["bwd_ms"] >= 0
        assert r["total_ms_q20"] <= r["total_ms"] <= r["total_ms_q80"]
        assert r["exp_floor_ratio"] == pytest.approx(r["total_ms"] / r["exp_floor_ms"])
        assert r["speedup_vs_trl_eager"] == pytest.approx(base["total_ms"] / r["total_ms"])
        # every method computes the same GRPO loss on the same inputs (fp32)
        assert math.isclose(r["loss"], base["loss"], rel_tol=1e-4, abs_tol=1e-5), r["method"]
    with open(quick_results / "bench_policy_loss_cpu.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (quick_results / "bench_policy_loss_cpu.png").stat().st_size > 0


def test_fused_linear_quick_rows(quick_results):
    data = _load(quick_results / "bench_fused_linear_cpu.json")
    rows = {r["method"]: r for r in data["rows"]}
    assert {
        "linear_logprobs+grpo",
        "fastrl-fused-linear",
        "gemm-floor",
        "matmul+fastrl",
        "matmul+trl-eager",
        "trl-chunked",
        "fastrl-fused-linear (90% masked)",
        "linear_logprobs+grpo (90% masked)",
    } <= set(rows)
    if importlib.util.find_spec("verl") is not None:  # verl's own fused LM head, its GRPO math
        assert "verl-fused-linear" in rows
        assert "CUDA only" in data["meta"]["notes"]["verl-linear-ce"]
    assert rows["gemm-floor"]["x_gemm_floor"] == pytest.approx(1.0)
    assert rows["matmul+trl-eager"]["memory_vs_matmul_trl_eager"] in (None, pytest.approx(1.0))
    ref = rows["matmul+trl-eager"]["loss"]
    for name, r in rows.items():
        assert r["TFLOPs"] > 0 and r["total_ms"] > 0
        if name == "gemm-floor":
            assert r["loss"] is None
        elif r["masked_frac"]:
            unmasked = rows[name.replace(" (90% masked)", "")]
            assert r["vs_unmasked"] == pytest.approx(r["total_ms"] / unmasked["total_ms"])
        else:
            assert math.isclose(r["loss"], ref, rel_tol=1e-4, abs_tol=1e-5), name
    assert (quick_results / "bench_fused_linear_cpu.png").stat().st_size > 0


def test_verl_imports_with_a_stand_in_for_a_missing_ray():
    """The lent GPU image has no ray (its wheel is over what a device call carries): the
    benchmarks import verl with a stand-in `ray` holding only ObjectRef, say so in their notes,
    and verl's functions the benchmarks time run; any other use of ray still fails."""
    pytest.importorskip("verl")
    code = f"""
import sys
sys.path.insert(0, {str(BENCH)!r})
sys.modules["ray"] = None  # as if ray were not installed
import torch, _baselines
note = _baselines.import_verl()
assert note == _baselines.RAY_PLACEHOLDER == _baselines.import_verl(), note
loss, why = _baselines.make_verl_eager_loss()
assert why == note
logits, tokens = torch.randn(2, 3, 7), torch.randint(0, 7, (2, 3))
adv, old, mask = torch.randn(2), torch.randn(2, 3), torch.ones(2, 3)
value = loss(logits, tokens, adv, old, old, mask)[0]
from verl.utils.experimental.torch_functional import FusedLinearForPPO
from verl.trainer.ppo.core_algos import compute_gae_advantage_return
import ray
try:
    ray.init
except AttributeError:
    print("ok", float(value))
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.startswith("ok"), proc.stderr[-3000:]


def test_fused_linear_chunk_sweep_rows(quick_results):
    """--chunk-sizes 8 16: one more row per size of each fastrl LM-head method, timed and
    measured like the others, computing the default row's loss, with its chunk size and its time
    against the default row; the report puts them in their own table, the fastest marked."""
    data = _load(quick_results / "bench_fused_linear_cpu.json")
    assert data["meta"]["chunk_sizes"] == [8, 16]
    (case,) = data["meta"]["cases"]
    default = case["default_chunk"]  # the rows chunk_size=None gives (fastrl.linear)
    assert isinstance(default, int) and default >= 64, f"no longer one chunk: {default}"
    rows = {r["method"]: r for r in data["rows"]}
    swept = [r for r in data["rows"] if r["chunk_size"] is not None]
    expect = [f"{m}[chunk={c}]" for m in ("linear_logprobs+grpo", "fastrl-fused-linear")
              for c in (8, 16)]  # fmt: skip
    assert [r["method"] for r in swept] == expect  # after every other row, by method
    assert [r["method"] for r in data["rows"][-4:]] == expect
    for r in swept:
        base = rows[r["method"].split("[")[0]]
        assert base["chunk_size"] is None and base["vs_default_chunk"] is None
        assert r["chunk_size"] == int(r["method"][:-1].split("=")[1])
        assert r["role"] == "fastrl" and r["masked_frac"] == 0.0 and r["vs_unmasked"] is None
        for key in ("total_ms", "total_ms_q20", "total_ms_q80", "TFLOPs", "x_gemm_floor"):
            assert math.isfinite(r[key]) and r[key] > 0, (r["method"], key)
        assert r["total_ms_q20"] <= r["total_ms"] <= r["total_ms_q80"]
        assert r["peak_MB"] >= 0 and r["rep"] >= 1
        assert r["vs_default_chunk"] == pytest.approx(r["total_ms"] / base["total_ms"])
        assert math.isclose(r["loss"], base["loss"], rel_tol=1e-5, abs_tol=1e-6), r["method"]
    with open(quick_results / "bench_fused_linear_cpu.csv") as f:
        by_method = {r["method"]: r for r in csv.DictReader(f)}
    assert by_method["fastrl-fused-linear[chunk=16]"]["chunk_size"] == "16"
    assert by_method["fastrl-fused-linear"]["chunk_size"] == ""

    md = _report().tables("bench", quick_results)
    main, sweep = md.split("**Chunk-size sweep**")
    assert "[chunk=" not in main and "| fastrl-fused-linear | 64, 32 | fp32 |" in main
    header = "| method | N, H, V | dtype | rows per chunk | median ms (q20-q80) | vs default |"
    assert header in sweep
    lines = [ln for ln in sweep.splitlines() if ln.startswith("| fastrl-fused-linear |")]
    assert [ln.split(" | ")[3] for ln in lines] == [f"default ({default})", "8", "16"]
    # 2 timed calls a row (--quick): too few to rank, so no row is marked the fastest
    assert all(r["n_samples"] == 2 for r in swept)
    assert sum("**fastest**" in ln for ln in lines) == 0
    assert lines[0].split(" | ")[5] == "1.00x"
    assert sum(ln.startswith("| linear_logprobs+grpo |") for ln in sweep.splitlines()) == 3


def test_chunk_sweep_rows_pass_their_chunk_size(monkeypatch):
    """Each [chunk=C] row calls the library with chunk_size=C, its default row with None (the
    same loss either way, so only the call shows it); --chunk-sizes refuses sizes below 1."""
    import torch

    import fastrl

    mod = load_bench("bench_fused_linear.py")
    seen = []
    for name in ("linear_logprobs", "fused_linear_policy_loss"):
        real = getattr(fastrl, name)

        def spy(*a, _real=real, _name=name, **kw):
            seen.append((_name, kw.get("chunk_size")))
            return _real(*a, **kw)

        monkeypatch.setattr(fastrl, name, spy)
    args = mod.build_parser().parse_args(["--chunk-sizes", "4", "8", "--no-liger"])
    assert args.chunk_sizes == [4, 8]
    assert mod.build_parser().parse_args([]).chunk_sizes is None
    hidden, weight, li, full, masked = mod.make_inputs(16, 8, 32, 16, torch.float32, "cpu")
    methods = mod.build_methods(hidden, weight, li, full, masked, args, {})
    calls = {
        "linear_logprobs+grpo": ("linear_logprobs", None),
        "linear_logprobs+grpo[chunk=4]": ("linear_logprobs", 4),
        "linear_logprobs+grpo[chunk=8]": ("linear_logprobs", 8),
        "fastrl-fused-linear": ("fused_linear_policy_loss", None),
        "fastrl-fused-linear[chunk=4]": ("fused_linear_policy_loss", 4),
        "fastrl-fused-linear[chunk=8]": ("fused_linear_policy_loss", 8),
    }
    for name, call in calls.items():
        seen.clear()
        methods[name](*mod.leaves(hidden, weight))
        assert seen == [call], name
    for bad in ("0", "-2", "x"):
        with pytest.raises(SystemExit):
            mod.build_parser().parse_args(["--chunk-sizes", bad])


def test_chunk_sweep_table_marks_the_fastest():
    """The sweep table: per method and case the default row, then the sizes in order; the
    fastest marked only when it is faster beyond the spread (its q80 below every other row's
    q20) with at least MIN_SAMPLES_TO_RANK timed calls a row; and no table when the file has no
    swept rows."""
    report = _report()

    def row(method, ms, chunk=None, default_ms=None, spread=0.5, n=10):
        return {"method": method, "role": "fastrl", "N": 64, "H": 32, "V": 512, "dtype": "bf16",
                "total_ms": ms, "total_ms_q20": ms - spread, "total_ms_q80": ms + spread,
                "n_samples": n, "TFLOPs": 1.0, "x_gemm_floor": ms / 2, "peak_MB": 3.0,
                "chunk_size": chunk,
                "vs_default_chunk": default_ms and ms / default_ms}  # fmt: skip

    def marked(rows):
        body = [ln for ln in report._chunk_sweep(rows) if ln.startswith("| fastrl-fused-linear |")]
        return [ln.endswith("| **fastest** |") for ln in body], body

    rows = [row("fastrl-fused-linear", 10.0), row("fastrl-fused-linear[chunk=64]", 6.0, 64, 10.0),
            row("fastrl-fused-linear[chunk=8]", 8.0, 8, 10.0)]  # fmt: skip
    flags, body = marked(rows)
    assert [ln.split(" | ")[3] for ln in body] == ["default", "8", "64"]
    assert flags == [False, False, True]
    assert body[2].split(" | ")[4:7] == ["6.0 (5.5-6.5)", "0.60x", "3.00x"]
    # within the spread of another row: none is the fastest
    wide = [dict(r, total_ms_q80=r["total_ms"] + 3.0) for r in rows]
    assert marked(wide)[0] == [False, False, False]
    # too few timed calls (do_bench's single call of a slow row), or none recorded: not ranked
    assert marked([dict(r, n_samples=1) for r in rows])[0] == [False, False, False]
    old = [{k: v for k, v in r.items() if k != "n_samples"} for r in rows]
    assert marked(old)[0] == [False, False, False]
    single = dict(rows[1], n_samples=None, total_ms_q20=6.0, total_ms_q80=6.0)
    assert "| 6.0 (no spread recorded) |" in "\n".join(report._chunk_sweep([rows[0], single]))
    assert "| 6.0 (one sample) |" in "\n".join(
        report._chunk_sweep([rows[0], dict(single, n_samples=1)])
    )
    assert report._chunk_sweep(rows[:1]) == []
    meta = {"cases": [{"N": 64, "H": 32, "V": 512, "dtype": "bf16", "default_chunk": 32}]}
    assert "| fastrl-fused-linear | 64, 32, 512 | bf16 | default (32) |" in "\n".join(
        report._chunk_sweep(rows, meta)
    )


def test_report_rewrites_only_the_marked_blocks(quick_results, tmp_path):
    report = _report()
    md = report.tables("bench", quick_results)
    assert "| method | shape | dtype | median ms (q20-q80) | vs trl-eager |" in md
    assert "exp-floor ratio" in md and "x GEMM floor" in md and "TFLOP/s" in md
    assert "| trl-eager | N=32 (B=2, T=16), V=512 | fp32 |" in md
    readme = tmp_path / "README.md"
    readme.write_text(
        "intro\n<!-- train:start -->\nold train\n<!-- train:end -->\nmiddle\n"
        "<!-- learning:start -->\nold learning\n<!-- learning:end -->\nmore\n"
        "<!-- vs_trl:start -->\nold vs_trl\n<!-- vs_trl:end -->\n"
        "<!-- bench:start -->\nold bench\n<!-- bench:end -->\n"
        "<!-- policy_summary:start -->\nold summary\n<!-- policy_summary:end -->\n"
        "<!-- scale:start -->\nold scale\n<!-- scale:end -->\nend\n"
    )
    report.main(["--readme", "--results", str(quick_results), "--readme-path", str(readme)])
    text = readme.read_text()
    assert text.startswith("intro\n") and "\nmiddle\n" in text and text.endswith("end\n")
    assert "\nmore\n" in text
    assert "old bench" not in text and "x GEMM floor" in text
    assert "old train" not in text and "old learning" not in text and "old scale" not in text
    assert "old vs_trl" not in text
    assert "old summary" not in text and "- `bench_policy_loss_cpu.json` (" in text
    # a README without one of the blocks is an error naming it, not a silent skip
    readme.write_text("intro\n<!-- bench:start -->\nold\n<!-- bench:end -->\n")
    with pytest.raises(SystemExit, match="train:start"):
        report.main(["--readme", "--results", str(quick_results), "--readme-path", str(readme)])
    # the committed results (whatever their format) still render
    assert "(from `benchmarks/results/" in report.tables("bench")
    scale = report.tables("scale")
    assert "| method | layout | dtype | H | median ms (q20-q80) | packed / padded time |" in scale
    assert "| op | method | median ms (q20-q80) | peak MiB per rank |" in scale


@pytest.mark.slow
def test_quick_runs_with_compile_and_liger(tmp_path):
    """The full --quick runs: trl-eager-compiled and liger-fused-linear rows, fp32 and bf16."""
    _run("bench_policy_loss.py", "--quick", "--no-progress", "--out", str(tmp_path))
    _run("bench_fused_linear.py", "--quick", "--no-progress", "--out", str(tmp_path))
    pl = _load(tmp_path / "bench_policy_loss_cpu.json")["rows"]
    assert {r["dtype"] for r in pl} == {"fp32", "bf16"}
    assert "trl-eager-compiled" in {r["method"] for r in pl}
    fl = _load(tmp_path / "bench_fused_linear_cpu.json")
    names = {r["method"] for r in fl["rows"]}
    assert "liger-fused-linear" in names or "liger-fused-linear" in fl["meta"]["notes"]


def test_report_marks_a_table_older_than_its_code():
    """A results file recorded before the last change to the code it measures is marked stale;
    one recorded at HEAD is not; an unknown commit is flagged too."""

    git = lambda *a: subprocess.run(  # noqa: E731
        ["git", *a], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    head = git("rev-parse", "HEAD")
    if not head or git("rev-parse", "--is-shallow-repository") == "true":
        pytest.skip("needs a full git checkout")
    report = _report()
    changed = git("log", "--format=%H", "-2", "--", "fastrl/ops.py").splitlines()
    if len(changed) < 2:
        pytest.skip("needs two commits that changed fastrl/ops.py")
    assert report.staleness("bench_policy_loss_cpu", {"git_commit": changed[1]}).startswith(
        "**Stale:**"
    )
    assert report.staleness("bench_policy_loss_cpu", {"git_commit": head}) is None
    dirty = report.staleness("bench_policy_loss_cpu", {"git_commit": head + "-dirty"})
    assert dirty.startswith("(recorded at commit") and "uncommitted" in dirty
    unknown = report.staleness("bench_gae_cpu", {"git_commit": "0" * 40})
    assert unknown.startswith("**Stale?**")
    # a change to the Triton kernels alone leaves a CPU recording (torch path) current, not a
    # CUDA one
    kernel_only = [
        c for c in git("log", "--format=%H", "-40", "--", "kernels/policy_loss.py").splitlines()
        if not git("diff", "--name-only", f"{c}^", c, "--", "fastrl", "benchmarks/bench_*.py")
    ]  # fmt: skip
    if kernel_only:
        before = git("rev-parse", f"{kernel_only[0]}^")
        later = git("rev-list", f"{kernel_only[0]}..HEAD", "--", "fastrl", "benchmarks")
        if not later:
            assert report.staleness("bench_policy_loss_cpu", {"git_commit": before}) is None
        cuda = report.staleness("bench_policy_loss_cuda", {"git_commit": before, "device": "cuda"})
        assert cuda.startswith("**Stale:**")
    # a change to the vocab-parallel module alone marks that benchmark only (the others run
    # one process with a plain weight, and never take its path)
    code = ("fastrl", "kernels", "benchmarks/bench_*.py")
    vp_only = [
        c for c in git("log", "--format=%H", "-40", "--", "fastrl/vocab_parallel.py").splitlines()
        if git("diff", "--name-only", f"{c}^", c, "--", *code) == "fastrl/vocab_parallel.py"
    ]  # fmt: skip
    if vp_only:
        before = {"git_commit": git("rev-parse", f"{vp_only[0]}^")}
        assert report.staleness("bench_vocab_parallel_cpu", before).startswith("**Stale:**")
        if not git("rev-list", f"{vp_only[0]}..HEAD", "--", "fastrl", "kernels", "benchmarks"):
            for name in ("bench_policy_loss_cpu", "bench_fused_linear_cpu", "train_summary"):
                assert report.staleness(name, before) is None, name


def test_git_commit_is_dirty_for_code_edits_only(tmp_path, monkeypatch):
    """A recording's commit gets "-dirty" for an uncommitted edit to code (tracked or new), not
    for one to a results file or to prose (a README, docs/)."""
    monkeypatch.delenv("FASTRL_GIT_COMMIT", raising=False)
    git = lambda *a: subprocess.run(  # noqa: E731
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *a],
        cwd=tmp_path, capture_output=True, text=True, check=True,
    ).stdout.strip()  # fmt: skip
    files = ["README.md", "docs/DESIGN.md", "benchmarks/results/x.json", "fastrl/ops.py"]
    for name in files:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("0\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "0")
    head = git("rev-parse", "HEAD")
    common = load_bench("_common.py")
    assert common.git_commit(tmp_path / "benchmarks") == head
    for name in files[:3]:
        (tmp_path / name).write_text("1\n")
    (tmp_path / "docs" / "new.md").write_text("new\n")
    assert common.git_commit(tmp_path / "benchmarks") == head
    (tmp_path / "fastrl" / "ops.py").write_text("1\n")
    assert common.git_commit(tmp_path) == head + "-dirty"
    git("checkout", "--", "fastrl/ops.py")
    (tmp_path / "fastrl" / "new.py").write_text("new\n")
    assert common.git_commit(tmp_path) == head + "-dirty"


def test_learning_vs_trl_quick(tmp_path):
    """bench_learning.py --vs-trl --quick: TRL's GRPOTrainer and `fastrl train` from the same
    warm start (tiny steps), and the results file holds every field the README table needs."""
    pytest.importorskip("trl")
    pytest.importorskip("matplotlib")
    _run("bench_learning.py", "--vs-trl", "--quick", "--out", str(tmp_path), timeout=300)
    data = _load(tmp_path / "learning_vs_trl.json")
    assert data["thresholds"] == [0.5, 0.8, 0.9]
    assert set(data["runs"]) == {"trl", "fastrl"} == set(data["summary"])
    assert data["versions"]["trl"] and data["git_commit"] and data["machine"]["cpu"]
    # the file says how it was made: the command as run, also in its table
    command = f"python benchmarks/bench_learning.py --vs-trl --quick --out {tmp_path}"
    assert data["command"] == command
    assert f"`{data['command']}`" in (tmp_path / "learning_vs_trl.md").read_text()
    s = data["settings"]
    assert s["completions_per_step"] == s["group_size"] * s["batch_prompts"]
    assert 0.0 <= data["warm_start_acc"] <= 1.0 and data["model"]["params"] > 0
    seeds = [str(x) for x in data["seeds"]]
    for name, by_seed in data["runs"].items():
        assert list(by_seed) == seeds
        for r in by_seed.values():
            assert r["steps"] >= 1 and r["command"]
            evals = r["evals"]
            assert evals[0]["step"] == 0 and evals[0]["acc"] == pytest.approx(
                data["warm_start_acc"]
            )  # both trainers start from the same model and evaluate alike
            assert [e["step"] for e in evals] == sorted(e["step"] for e in evals)
            assert all(0.0 <= e["acc"] <= 1.0 and e["train_s"] >= 0 for e in evals)
            assert set(r["reached"]) == {"0.5", "0.8", "0.9"}
        for thr in ("0.5", "0.8", "0.9"):
            agg = data["summary"][name][thr]
            assert set(agg["per_seed"]) == set(seeds)
            if all(agg["per_seed"].values()):
                steps = [p["step"] for p in agg["per_seed"].values()]
                assert agg["steps_mean"] == pytest.approx(sum(steps) / len(steps))
            else:
                assert agg["steps_mean"] is None
    assert all(r["command"].startswith("fastrl train ") for r in data["runs"]["fastrl"].values())
    assert all("trl.GRPOTrainer" in r["command"] for r in data["runs"]["trl"].values())
    assert (
        "| trainer | seed | to 0.5 | to 0.8 | to 0.9 |"
        in (tmp_path / "learning_vs_trl.md").read_text()
    )
    assert (tmp_path / "learning_vs_trl.png").stat().st_size > 0


def test_train_table_shows_the_spread_over_seeds():
    """bench_train.py --seeds: seed 0's run as written, and every seed's last accuracy as mean
    [min, max]; a file without seeds (written before --seeds) keeps the old columns."""
    report = _report()
    run = {"wall_s_total": 40.0, "rl_steps_per_s": 8.0, "eval_accuracy_step0": 0.265,
           "eval_accuracy_final": 0.79, "peak_rss_mb": 560}  # fmt: skip
    data = {"machine": {"cpu": "cpu", "cores": 2}, "torch": "2", "git_commit": "abcdef0" * 6,
            "command": "fastrl train --algo ALGO", "runs": {"grpo": dict(run)}}  # fmt: skip
    old = report._training(data)
    assert "| grpo | 40 s | 8.0 | 0.265 -> 0.790 | 560 |" in old and "seeds" not in old[2]
    data["seeds"] = [0, 1, 2]
    data["runs"]["grpo"]["by_seed"] = {
        "1": {"eval_accuracy_step0": 0.04, "eval_accuracy_final": 0.965},
        "2": {"eval_accuracy_step0": 0.12, "eval_accuracy_final": 0.945},
    }
    new = report._training(data)
    assert "last eval accuracy, seeds 0, 1, 2: mean [min, max]" in new[2]
    assert "| grpo | 40 s | 8.0 | 0.265 -> 0.790 | 0.900 [0.790, 0.965] | 560 |" in new


def test_policy_summary_ranges_come_from_the_rows():
    """The prose over the policy-loss tables: ranges over the cases of each fastrl row's
    speed-up over trl-eager and over the case's fastest baseline (oracle excluded), its memory
    ratio, and every case where a baseline was faster, named."""
    report = _report()

    def row(method, role, N, dtype, ms, mem):
        return {"method": method, "role": role, "N": N, "V": 100, "dtype": dtype, "total_ms": ms,
                "speedup_vs_trl_eager": None, "memory_vs_trl_eager": mem}  # fmt: skip

    rows = []
    cases = [(8, "fp32", 40.0, 20.0, 10.0), (16, "bf16", 30.0, 12.0, 15.0)]
    for N, dtype, trl, verl, ours in cases:
        rows += [row("trl-eager", "baseline", N, dtype, trl, 1.0),
                 row("verl-eager", "other", N, dtype, verl, 1.0),
                 row("reference (oracle)", "oracle", N, dtype, 1.0, 3.0),  # never the fastest
                 row("fastrl", "fastrl", N, dtype, ours, 0.5 if N == 8 else 0.75)]  # fmt: skip
    for r in rows:
        trl = next(x for x in rows if x["method"] == "trl-eager" and x["N"] == r["N"])
        r["speedup_vs_trl_eager"] = trl["total_ms"] / r["total_ms"]
    meta = {"device_name": "cpu", "busy_processes": 1, "git_commit": "abcdef0123", "cases": []}
    (line,) = report._policy_summary("bench_policy_loss_cpu_busy1", {"meta": meta, "rows": rows})
    assert "1 other process(es) keeping a core busy, commit abcdef0; 2 cases" in line
    assert "`fastrl` 2.0-4.0x over `trl-eager` and 0.8-2.0x over the fastest baseline" in line
    assert "at 0.5-0.75x of `trl-eager`'s peak memory" in line
    assert "Slower than it: `fastrl` at N=16, V=100 bf16 (`verl-eager`)." in line


def test_rows_in_flight_sweep_records_the_grid_each_value_gives(monkeypatch):
    """bench_rows_in_flight.py: each --rows value's grid as the one-pass launcher computes it
    (auto: a program per row, the launcher's default since the H200 sweep; 0: the same; P: P
    programs), the caller's FASTRL_ROWS_IN_FLIGHT left as it was; bad values refused."""
    mod = load_bench("bench_rows_in_flight.py")
    monkeypatch.setenv("FASTRL_ROWS_IN_FLIGHT", "7")
    assert mod.programs("auto", 16384) == 16384
    assert mod.programs("auto", 8192) == 8192
    assert mod.programs("0", 16384) == 16384
    assert mod.programs("66", 16384) == 66
    assert mod.programs("264", 100) == 100  # never more than N
    assert os.environ["FASTRL_ROWS_IN_FLIGHT"] == "7"
    with pytest.raises(SystemExit, match="neither auto nor an int"):
        mod.main(["--quick", "--rows", "auto,-1", "--device", "cpu"])
    with pytest.raises(SystemExit, match="run it on CUDA"):
        mod.main(["--device", "cpu"])


def test_rows_in_flight_children_run_the_one_pass_kernel_then_the_default(tmp_path, monkeypatch):
    """bench_rows_in_flight.py's child runs: the sweep's rows (`fastrl-one-pass`) with
    FASTRL_ONE_PASS=1 (FASTRL_ROWS_IN_FLIGHT shapes the one-pass kernel's grid only) and
    FASTRL_ROWS_IN_FLIGHT=P; the A/B row (`fastrl`, the default path) with both unset, whatever
    the caller's environment held; each child times bench_policy_loss.py's `fastrl` method."""
    mod = load_bench("bench_rows_in_flight.py")
    assert (mod.ONE_PASS, mod.DEFAULT) == ("fastrl-one-pass", "fastrl")
    monkeypatch.setenv("FASTRL_ONE_PASS", "0")
    monkeypatch.setenv("FASTRL_ROWS_IN_FLIGHT", "7")
    seen = []

    def fake_run(cmd, env, **kw):
        seen.append((cmd, env))
        out = Path(cmd[cmd.index("--out") + 1])
        out.mkdir(parents=True)
        row = {"method": "fastrl", "N": 32, "V": 512, "dtype": "fp32", "total_ms": 1.0}
        (out / "bench_policy_loss_cpu.json").write_text(json.dumps({"rows": [row]}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(mod.subprocess, "run", fake_run)
    args = type("A", (), {"shapes": "2x16x512", "dtype": "fp32", "quick": True, "rep": None})()
    assert mod.child_rows(mod.ONE_PASS, "66", args, "cpu", tmp_path)[0]["total_ms"] == 1.0
    assert mod.child_rows(mod.DEFAULT, None, args, "cpu", tmp_path)[0]["N"] == 32
    (one_cmd, one_env), (default_cmd, default_env) = seen
    for cmd in (one_cmd, default_cmd):
        assert cmd[cmd.index("--methods") + 1] == "fastrl"
    assert one_env["FASTRL_ONE_PASS"] == "1" and one_env["FASTRL_ROWS_IN_FLIGHT"] == "66"
    assert "FASTRL_ONE_PASS" not in default_env and "FASTRL_ROWS_IN_FLIGHT" not in default_env
    assert os.environ["FASTRL_ONE_PASS"] == "0" and os.environ["FASTRL_ROWS_IN_FLIGHT"] == "7"


def test_policy_loss_one_pass_method_sets_the_variable_for_its_call_only(monkeypatch):
    """bench_policy_loss.py's `fastrl-one-pass` (CUDA only; a device that says "cuda" here) calls
    fastrl.policy_loss with FASTRL_ONE_PASS=1 and restores the caller's value after; `fastrl`
    leaves the variable as it is (the library's default path)."""
    pytest.importorskip("trl")
    import types

    import torch

    mod = load_bench("bench_policy_loss.py")
    assert "fastrl-one-pass" in mod.METHODS and "fastrl-two-kernel" not in mod.METHODS
    seen = []
    real = mod.fastrl.policy_loss

    def spy(*a, **kw):
        seen.append(os.environ.get("FASTRL_ONE_PASS"))
        return real(*a, **kw)

    inp = mod.make_inputs(2, 4, 16, torch.float32, torch.device("cpu"))
    args = types.SimpleNamespace(slice=False, methods="fastrl,fastrl-one-pass", no_compile=True,
                                 no_verl=True, no_reference=True, no_liger=True)  # fmt: skip
    monkeypatch.setattr(mod.fastrl, "policy_loss", spy)
    for caller in (None, "0"):
        if caller is None:
            monkeypatch.delenv("FASTRL_ONE_PASS", raising=False)
        else:
            monkeypatch.setenv("FASTRL_ONE_PASS", caller)
        methods = mod.build_methods(inp, args, types.SimpleNamespace(type="cuda"), {})
        assert set(methods) == {"fastrl", "fastrl-one-pass"}
        seen.clear()
        for name in ("fastrl", "fastrl-one-pass"):
            forward = methods[name][0]
            forward(inp["logits"][:, :4].contiguous())
        assert seen == [caller, "1"]
        assert os.environ.get("FASTRL_ONE_PASS") == caller
    cpu = mod.build_methods(inp, args, torch.device("cpu"), {})
    assert set(cpu) == {"fastrl"}  # the A/B is CUDA only


def test_profile_quick(tmp_path):
    """bench_profile.py --quick: every method of both workloads profiled, its rows' times add up to
    its step time (the top kernels longest first, then "(other)"), shares sum to 1, the floor of
    the fused-linear workload is the gemm-floor method's step; JSON, CSV, PNG and Markdown."""
    pytest.importorskip("trl")
    _run("bench_profile.py", "--quick", "--no-liger", "--top", "3", "--out", str(tmp_path),
         timeout=300)  # fmt: skip
    data = _load(tmp_path / "bench_profile_cpu.json")
    rows = data["rows"]
    methods = {(r["workload"], r["method"]) for r in rows}
    assert methods == {("policy-loss", "fastrl"), ("policy-loss", "trl-eager"),
                       ("fused-linear", "fastrl-fused-linear"),
                       ("fused-linear", "linear_logprobs+grpo"),
                       ("fused-linear", "gemm-floor"), ("fused-linear", "trl-chunked")}  # fmt: skip
    steps = {}
    for workload, method in methods:
        mine = [r for r in rows if (r["workload"], r["method"]) == (workload, method)]
        assert 1 <= len(mine) <= 4  # --top 3 and "(other)"
        named = [r["ms_per_step"] for r in mine if r["kernel"] != "(other)"]
        assert named == sorted(named, reverse=True)
        assert sum(r["ms_per_step"] for r in mine) == pytest.approx(mine[0]["step_ms"], abs=1e-3)
        assert sum(r["share"] for r in mine) == pytest.approx(1.0, abs=1e-3)
        steps[workload, method] = mine[0]
    fastrl = steps["policy-loss", "fastrl"]
    assert fastrl["floor_ms"] is None  # a bytes floor needs a known peak bandwidth (CUDA)
    floor = steps["fused-linear", "gemm-floor"]["step_ms"]
    fused = steps["fused-linear", "fastrl-fused-linear"]
    assert fused["floor_ms"] == pytest.approx(floor, abs=2e-4)  # both rounded to 4 decimals
    md = (tmp_path / "bench_profile_cpu.md").read_text()
    assert "## fused-linear: fastrl-fused-linear (N=64, H=32, V=512, dtype=fp32)" in md
    assert (tmp_path / "bench_profile_cpu.csv").exists()
    assert (tmp_path / "bench_profile_cpu.png").stat().st_size > 0


@pytest.mark.parametrize(
    "args,message",
    [
        (["--calls", "0"], "--calls must be >= 1, got 0"),
        (["--top", "0"], "--top must be >= 1, got 0"),
        (["--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["--workloads", "policy-loss,gae"], "--workloads: unknown ['gae']"),
    ],
)
def test_profile_bad_options(args, message):
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_profile.py"), *args],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 2 and message in res.stderr, res.stderr[-500:]


# ---------------------------------------------------------------------------- the audit's fixes
def _common_mod():
    load_bench("report.py")  # any script: puts _common in sys.modules
    load_bench("bench_gae.py")
    return sys.modules["_common"]


class _FakeClock:
    """cuda_calls' clock on the CPU: perf_counter "events"; flushes and event records are
    appended to `log` in the order they happen."""

    def __init__(self, log=None):
        self.log = [] if log is None else log

    def event(self):
        import time

        log = self.log

        class Event:
            def record(self):
                log.append("record")
                self.t = time.perf_counter()

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3

        return Event()

    def flush(self):
        self.log.append("flush")

    def sync(self):
        pass


def test_cuda_timing_takes_enough_calls_flushes_and_prepares_outside():
    """The CUDA timing (do_bench's method): at least MIN_CUDA_CALLS timed calls even when one
    call takes longer than rep (do_bench took one, its q20 = q80 = median), the L2 flushed before
    every timed call, and prepare() (the in-place rows' fresh buffer) outside the timed region."""
    import time

    common = _common_mod()
    log: list[str] = []
    clock = _FakeClock(log)

    def fn(arg):
        log.append(arg)
        time.sleep(0.002)

    times = common.cuda_calls(fn, 1.0, 1.0, clock, prepare=lambda: log.append("prepare") or "x")
    assert len(times) == common.MIN_CUDA_CALLS == 10  # each call > rep = 1 ms
    timed = "prepare flush record x record"  # prepare, then the flush, then the timed call
    text = " ".join(log)
    # the first call, one estimate call (it passes rep alone), one warm-up, ten timed calls
    assert text == " ".join(["prepare x", timed, "prepare x", *[timed] * 10])
    fast = common.cuda_calls(lambda: None, 0.1, 5.0, _FakeClock())
    assert len(fast) >= 10
    # time_fn on the CPU records its number of timed calls too
    t = common.time_fn(lambda x: x, warmup=0, rep=3, prepare=lambda: 1)
    assert t["n_samples"] == 3 and t["q20"] <= t["median"] <= t["q80"]


def test_peak_bandwidth_needs_the_full_device_name():
    """No roofline from a substring: the H100 PCIe (2.0 TB/s) and NVL (3.9 TB/s) and the A100
    40GB (1.56 TB/s) are not the SXM parts; an unknown name gets none, with the reason."""
    common = _common_mod()
    assert common.peak_bandwidth("NVIDIA H200") == (4800.0, None)
    assert common.peak_bandwidth("NVIDIA H100 80GB HBM3")[0] == 3350.0
    assert common.peak_bandwidth("NVIDIA H100 PCIe")[0] == 2000.0
    assert common.peak_bandwidth("NVIDIA H100 NVL")[0] == 3900.0
    assert common.peak_bandwidth("NVIDIA A100-SXM4-40GB")[0] == 1555.0
    peak, why = common.peak_bandwidth("NVIDIA H100 Experimental")
    assert peak is None and "no % of roofline" in why
    meta = {"device": "cuda", "device_name": "X", "peak_bandwidth_note": why}
    assert why in _report()._machine(meta)


def test_results_record_the_baselines_versions(quick_results):
    """Every results file's meta holds the installed versions of the library and the baselines
    (importlib.metadata), and the tables show those of the baselines."""
    from importlib import metadata

    meta = _load(quick_results / "bench_policy_loss_cpu.json")["meta"]
    assert meta["packages"]["trl"] == metadata.version("trl")
    assert meta["packages"]["torch"] == metadata.version("torch")
    assert set(meta["packages"]) >= {"transformers", "liger-kernel", "verl", "fastrl"}
    report = _report()
    assert f"trl {metadata.version('trl')}" in report._machine(meta)
    assert "baseline versions not recorded" in report._machine({"device": "cpu"})


def test_masked_rows_are_charged_the_flops_of_their_valid_positions(quick_results):
    """A 90 %-masked row does the GEMMs of its valid positions only: its flops (and TFLOP/s)
    count those; a file that charged it all N positions shows "n/a (masked)" (its rates were
    above the hardware's peak), not the number."""
    data = _load(quick_results / "bench_fused_linear_cpu.json")
    for r in data["rows"]:
        B, T = r["B"], r["T"]
        valid = B * max(1, T // 10) if r["masked_frac"] else r["N"]
        assert r["valid_tokens"] == valid, r["method"]
        assert r["flops"] == 6 * valid * r["H"] * r["V"]
        assert r["TFLOPs"] == pytest.approx(r["flops"] / 1e12 / (r["total_ms"] / 1e3))
    report = _report()
    masked = next(r for r in data["rows"] if r["masked_frac"])
    assert report._tflops(masked) == f"{masked['TFLOPs']:.3f}"
    legacy = {k: v for k, v in masked.items() if k not in ("valid_tokens", "flops")}
    assert report._tflops(dict(legacy, masked_frac=0.9)) == "n/a (masked)"


def test_trl_rows_are_labelled_by_what_they_run_on_each_device():
    """The `trl-eager` key runs TRL's logits helpers: eager torch loops on the CPU, TRL's Triton
    kernel on CUDA; the tables name the CUDA rows `trl-triton` and say which TRL path its
    GRPOTrainer takes (the fused LM head: `trl-chunked`)."""
    report = _report()

    def row(method, ms):
        return {"method": method, "role": "baseline" if method == "trl-eager" else "fastrl",
                "B": 2, "T": 4, "N": 8, "V": 16, "dtype": "bf16", "total_ms": ms,
                "total_ms_q20": ms, "total_ms_q80": ms + 1, "n_samples": 10,
                "speedup_vs_trl_eager": 2.0 / ms, "memory_vs_trl_eager": 1.0,
                "peak_MB": 1.0}  # fmt: skip

    rows = [row("fastrl", 1.0), row("trl-eager", 2.0), row("trl-eager-compiled", 3.0)]
    cuda = "\n".join(report._policy_loss({"meta": {"device": "cuda", "cases": []}, "rows": rows}))
    assert "| trl-triton | N=8" in cuda and "| trl-triton-compiled |" in cuda
    assert "vs trl-triton" in cuda and "Triton kernel" in cuda and "trl-eager |" not in cuda
    assert "`trl-chunked`" in cuda and "add_fused_lm_head" in cuda
    cpu = "\n".join(report._policy_loss({"meta": {"device": "cpu", "cases": []}, "rows": rows}))
    assert "| trl-eager | N=8" in cpu and "eager torch loops" in cpu and "trl-triton" not in cpu
    (line,) = report._policy_summary("bench_policy_loss_cuda", {"meta": {"device": "cuda"},
                                                                 "rows": rows})  # fmt: skip
    assert "over `trl-triton`" in line


def test_packed_table_per_dtype():
    """bench_packed holds fp32 and bf16 rows: one table per dtype, titled with it, each row with
    its dtype and (fused-linear) H."""
    report = _report()

    def row(family, layout, dtype, **kw):
        return {"family": family, "method": f"{family}-{layout}", "layout": layout,
                "dtype": dtype, "S": 4, "T": 8, "V": 32, "N": 20, "pad_frac": 0.4,
                "total_ms": 1.0, "total_ms_q20": 0.9, "total_ms_q80": 1.1, "peak_MB": 2.0,
                "speedup_packed_vs_padded": 2.0, "memory_packed_vs_padded": 0.5, **kw}  # fmt: skip

    rows = [row("fastrl", "padded", "fp32"), row("fastrl", "packed", "fp32"),
            row("fused-linear", "packed", "fp32", H=16),
            row("fastrl", "padded", "bf16")]  # fmt: skip
    text = "\n".join(report._packed({"meta": {"device": "cpu"}, "rows": rows}))
    assert text.count("**Packed vs padded, ") == 2
    fp32, bf16 = text.split("**Packed vs padded, bf16**")
    assert "**Packed vs padded, fp32** (S = 4, T = 8, V = 32, H = 16 for fused-linear" in fp32
    assert "| fused-linear | packed | fp32 | 16 |" in fp32 and "| bf16 |" not in fp32
    assert "| fastrl | padded | bf16 |  |" in bf16 and "| fp32 |" not in bf16


def test_verl_baseline_calls_verls_own_functions(monkeypatch):
    """verl-eager runs verl's own compute_policy_loss_vanilla / kl_penalty / agg_loss (not a
    copy), and that equals TRL's GRPO loss where no clamp is hit."""
    pytest.importorskip("verl")
    import torch
    from verl.trainer.ppo import core_algos

    load_bench("bench_policy_loss.py")
    baselines = sys.modules["_baselines"]
    called = []
    for name in ("compute_policy_loss_vanilla", "kl_penalty", "agg_loss"):
        real = getattr(core_algos, name)
        spy = lambda *a, _r=real, _n=name, **k: called.append(_n) or _r(*a, **k)  # noqa: E731
        monkeypatch.setattr(core_algos, name, spy)
    g = torch.Generator().manual_seed(0)
    B, T = 4, 9
    logp = -3 * torch.rand(B, T, generator=g)
    old = logp + 0.05 * torch.randn(B, T, generator=g)
    ref = logp + 0.05 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    mask = torch.arange(T)[None] < torch.tensor([9, 5, 7, 2])[:, None]
    got = baselines.make_verl_grpo_math()(logp, old, ref, adv, mask)
    want = baselines.trl_grpo_math(logp, old, ref, adv, mask)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    assert {"compute_policy_loss_vanilla", "kl_penalty", "agg_loss"} <= set(called)


def test_staleness_counts_the_shared_harness():
    """_common.py (timing, memory) and _baselines.py (the baselines' code) are measuring code:
    a change to them marks the timed tables stale (the trainers' files use neither's timing)."""
    report = _report()
    timed = ["bench_policy_loss", "bench_fused_linear", "bench_gae", "bench_sample",
             "bench_packed", "bench_vocab_parallel", "bench_kernel_configs",
             "bench_logprobs"]  # fmt: skip
    for key in timed:
        assert "benchmarks/_common.py" in report.MEASURES[key], key
    for key in ("bench_policy_loss", "bench_fused_linear", "bench_packed", "bench_logprobs"):
        assert "benchmarks/_baselines.py" in report.MEASURES[key], key
    assert "benchmarks/_common.py" not in report.MEASURES["train_summary"]


def test_every_staged_benchmark_keeps_its_rows_when_cut():
    """run_all's stage timeout sends SIGINT: every benchmark it stages wraps its measuring loop
    in keep_rows_on_interrupt (the behaviour is tested below and above for some of them)."""
    run_all = load_bench("run_all.py")
    scripts = {Path(s.cmd[1]).name for s in run_all.plan(
        type("A", (), {"out": "/tmp/x", "quick": True, "readme": False, "stages": ""})(),
        False, dict.fromkeys(run_all.BASELINES)) if s.cmd and s.cmd[1].endswith(".py")}  # fmt: skip
    scripts.add("bench_kernel_configs.py")  # CUDA only: not in the CPU plan
    assert len(scripts) >= 10, scripts
    for script in scripts:
        assert "keep_rows_on_interrupt(" in (BENCH / script).read_text(), script


@pytest.mark.parametrize(
    "script, argv, cut_at, kept",
    [
        ("bench_gae.py", ["--B", "8", "--T", "32", "--rep", "2", "--loop-rep", "1",
                          "--no-verl"], 2, 1),
        ("bench_sample.py", ["--N", "4", "--V", "64", "--rep", "2"], 2, 1),
        ("bench_logprobs.py", TINY_LOGPROBS, 2, 1),
        # (its first two timings are cpu_rates', before the rows)
        ("bench_packed.py", ["--quick", "--dtype", "fp32", "--no-progress", "--no-plot",
                             "--memory", "none"], 5, 2),
    ],
)  # fmt: skip
def test_more_cut_runs_keep_their_rows(tmp_path, monkeypatch, script, argv, cut_at, kept):
    """A SIGINT (KeyboardInterrupt) during a timing of gae, sample or packed: the rows timed
    before it are written, with the note, instead of nothing."""
    mod = load_bench(script)
    common = sys.modules["_common"]
    real, seen = common.time_fn, []

    def cut(*a, **kw):
        seen.append(1)
        if len(seen) == cut_at:
            raise KeyboardInterrupt
        return real(*a, **kw)

    monkeypatch.setattr(common, "time_fn", cut)
    argv = [*argv, "--out", str(tmp_path)]
    if script == "bench_packed.py":
        mod.main(argv)
    else:
        monkeypatch.setattr(sys, "argv", [script, *argv])
        mod.main()
    data = _load(tmp_path / f"{script.removesuffix('.py')}_cpu.json")
    assert len(data["rows"]) == kept
    assert "cut short by SIGINT" in data["meta"]["notes"]["interrupted"]


@pytest.mark.parametrize(
    "script, argv, message",
    [
        ("bench_policy_loss.py", ["--B", "0"], "--B must be >= 1, got 0"),
        ("bench_policy_loss.py", ["--B", "-1", "--T", "2", "--V", "10"], "--B must be >= 1"),
        ("bench_policy_loss.py", ["--shapes", "4x0x10"], "--shapes: '4x0x10' is not sizes"),
        ("bench_policy_loss.py", ["--rep", "0"], "--rep must be >= 1"),
        ("bench_policy_loss.py", ["--warmup", "-1"], "--warmup must be >= 0"),
        ("bench_fused_linear.py", ["--N", "-3"], "--N must be >= 1"),
        ("bench_gae.py", ["--T", "0"], "--T must be >= 1"),
    ],
)
def test_sizes_below_one_are_refused(script, argv, message, capsys, monkeypatch):
    """A size of 0 used to run the default shape (`args.B or DEFAULT_B`: minutes of the full
    benchmark) and -1 ended in a torch traceback: now exit 2, naming the option."""
    bench = load_bench(script)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as e:
        bench.main()
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_host_profile_names_where_the_host_time_goes():
    """_common.host_profile (bench_kernel_configs' `host V=...` notes: the host side of a
    policy-loss call on a GPU): per-call self and cumulative microseconds of the functions a
    call runs, the slowest first; a function that sleeps 2 ms a call leads the table."""
    import time

    common = load_bench("_common.py")

    def slow_part():
        time.sleep(0.002)

    def call():
        slow_part()
        sum(range(100))

    out = common.host_profile(call, calls=4, top=5)
    assert out["calls"] == 4 and out["host_ms_per_call"] >= 2.0
    assert out["traced_ms_per_call"] >= 2.0 and len(out["top_self"]) <= 5
    first = out["top_self"][0]
    assert "sleep" in first["function"] and first["calls"] == 1.0 and first["self_us"] >= 2000
    mine = next(r for r in out["top_self"] if r["function"].endswith(" slow_part"))
    assert "tests/test_benchmarks.py:" in mine["function"] and mine["cum_us"] >= 2000
    selfs = [r["self_us"] for r in out["top_self"]]
    assert selfs == sorted(selfs, reverse=True)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs TRITON_INTERPRET=1")
def test_launch_overhead_times_each_way_of_launching():
    """bench_kernel_configs.launch_overhead (the GPU run's `launch_us` note): host microseconds
    per launch of a Triton kernel through its launcher, its LaunchConfig, bare, and of a torch
    op; every way really launches (here in the interpreter, on CPU tensors)."""
    bench = load_bench("bench_kernel_configs.py")
    out = bench.launch_overhead("cpu", calls=3)
    assert set(out) == {"triton_via_launcher", "triton_launch_config", "triton_bare", "torch_add"}
    assert all(math.isfinite(v) and v > 0 for v in out.values())
