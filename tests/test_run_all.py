"""benchmarks/run_all.py, the one command of the GPU run, in its --quick CPU mode (about 3-4
minutes): every stage runs and is reported, the summary files carry per-stage status, pytest's
counts and the headline ratios read from the results files, the results files carry the machine,
versions and commit, a hidden baseline package is reported as skipped (--skip liger), a stage
past its timeout is reported as failed while the later ones still run (--timeout gae=0), and
--readme rewrites the README's bench block from the run's folder (on a copy of the README), and
--merge joins that run with a later call's (a GPU session's calls, split by --stages)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_run import load_bench

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "run_all.py"
BENCH_STAGES = [
    "policy-loss",
    "kernel-configs",
    "rows-in-flight",
    "fused-linear",
    "logprobs",
    "packed",
    "vocab-parallel",
    "gae",
    "sample",
    "trl-step",
    "profile",
]


def _env() -> dict:
    # conftest sets TRITON_INTERPRET=1 on CPU machines; run_all must cope with it (it drops it
    # for its children), so it is left in
    return dict(os.environ, PYTHONWARNINGS="ignore")


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run_all")
    readme = out.parent / "README.md"
    original = (ROOT / "README.md").read_text()
    readme.write_text(original)
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--skip", "liger"]
    cmd += ["--timeout", "gae=0", "--readme", "--readme-path", str(readme)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    return proc, out, summary, (readme, original)


def test_every_stage_ran_and_is_reported(run):
    proc, out, summary, _ = run
    stages = {s["name"]: s for s in summary["stages"]}
    assert list(stages) == ["pytest-gpu", "compile-check", *BENCH_STAGES, "readme"]
    for name, s in stages.items():
        if name == "kernel-configs":  # CUDA only: skipped, with the reason, and nothing run
            assert s["status"] == "skipped" and "CUDA only" in s["detail"], s
            continue
        assert (out / "logs" / f"{name}.log").exists(), name
        assert s["seconds"] >= 0 and s["command"], name
        assert s["status"] == ("failed" if name == "gae" else "passed"), (name, s, proc.stderr)
    # progress lines per stage, with the elapsed time
    for name in stages:
        assert f"{name}" in proc.stderr
    assert "elapsed]" in proc.stderr


def test_a_failed_stage_fails_the_run_but_not_the_others(run):
    proc, out, summary, _ = run
    gae = next(s for s in summary["stages"] if s["name"] == "gae")
    assert gae["status"] == "failed" and "timed out after 0 s" in gae["detail"]
    assert proc.returncode == 1
    assert not (out / "bench_gae_cpu.json").exists()
    # the stages after it still ran
    assert (out / "bench_sample_cpu.json").exists() and (out / "bench_trl_step_cpu.json").exists()
    md = (out / "summary.md").read_text()
    assert "| gae | failed |" in md and "| sample | passed |" in md


def test_pytest_counts_and_compile_check(run):
    _, out, summary, _ = run
    pt = summary["pytest_gpu"]
    assert pt["tests"] > 0 and pt["failures"] == 0 and pt["errors"] == 0
    assert pt["passed"] + pt["skipped"] == pt["tests"]
    if not summary["cuda"]:
        assert pt["passed"] == 0 and pt["skipped"] == pt["tests"]
        assert "no CUDA device" in pt["note"]
    cc = summary["compile_check"]
    assert cc["ok"] is True and cc["failed"] == 0 and cc["unique_configs"] > 0
    assert json.loads((out / "compile_check.json").read_text())["ok"] is True
    md = (out / "summary.md").read_text()
    assert f"{pt['skipped']} skipped" in md


def test_headline_ratios_are_read_from_the_results(run):
    _, out, summary, _ = run
    heads = summary["headlines"]
    assert {h["bench"] for h in heads} == {
        "policy-loss",
        "fused-linear",
        "packed",
        "vocab-parallel",
        "sample",
        "trl-step",
    }
    for h in heads:
        assert h["this_run"], h
        rows = json.loads((out / h["file"]).read_text())["rows"]
        if h["bench"] == "packed":
            method = h["what"].split(" ")[0]
            assert method in ("fastrl-packed", "fused-linear-packed"), h
            row = next(r for r in rows if r["method"] == method and r["dtype"] == "fp32")
            if "peak memory" in h["what"]:  # quick: RSS of tiny tensors, maybe 0 (then n/a)
                assert h["value"] == row["memory_packed_vs_padded"]
                continue
            assert h["value"] == row["speedup_packed_vs_padded"]
        assert h["value"] is not None and h["value"] > 0
        if h["bench"] == "policy-loss":
            method = h["what"].split(" vs ")[0]
            row = next(r for r in rows if r["method"] == method)
            assert h["value"] == row["speedup_vs_trl_eager"]
            assert h["roofline"] == "n/a (CPU)"
        if h["bench"] == "fused-linear":
            method = h["what"].split(" x ")[0]
            assert h["value"] == next(r for r in rows if r["method"] == method)["x_gemm_floor"]
        if h["bench"] == "vocab-parallel":
            op = h["case"].split(":")[0]
            row = next(r for r in rows if r["method"] == "vocab-parallel" and r["op"] == op)
            assert h["what"].startswith("P=2 ") and row["P"] == 2
            key = (
                "memory_vs_unsharded"
                if "peak memory per rank" in h["what"]
                else "speedup_vs_unsharded_all_threads"
                if "same machine" in h["what"]
                else "speedup_vs_unsharded"
            )
            assert h["value"] == row[key]
            assert row["loss_rel_diff_vs_unsharded"] < 1e-5
        if h["bench"] == "trl-step" and h["what"].startswith("fastrl"):
            fastrl = next(r for r in rows if r["role"] == "fastrl")
            assert h["value"] == fastrl["speedup_step_vs_trl"]
    ops = {h["case"].split(":")[0] for h in heads if h["bench"] == "vocab-parallel"}
    assert ops == {"policy-loss", "logprobs"}
    assert sum(h["bench"] == "vocab-parallel" for h in heads) == 6  # 3 ratios per op
    packed = {h["what"] for h in heads if h["bench"] == "packed"}
    assert "fastrl-packed vs fastrl-padded (fwd+bwd)" in packed
    assert "fastrl-packed / fastrl-padded peak memory" in packed
    md = (out / "summary.md").read_text()
    assert "## Headline ratios" in md and "fastrl vs trl-eager" in md and "x GEMM floor" in md
    assert "fastrl-packed vs fastrl-padded" in md and "P=2 vs unsharded" in md
    # the sampler's row carries its read-once traffic (its roofline is graded on CUDA only)
    sample = json.loads((out / "bench_sample_cpu.json").read_text())["rows"]
    assert all(r["GBs"] > 0 and r["pct_bw"] > 0 for r in sample)


def test_issue_targets_are_in_the_summary(run):
    """A CPU run grades none of issue 22's targets (they are read from *_cuda.json files only)
    and says so; the rows are there for a GPU run's summary."""
    _, out, summary, _ = run
    assert summary["targets"] and {t["verdict"] for t in summary["targets"]} == {"not measured"}
    md = (out / "summary.md").read_text()
    assert "## Issue 22's targets" in md and "nothing to grade" in md


def test_results_files_carry_device_versions_commit(run):
    _, out, summary, _ = run
    files = {f["file"]: f for f in summary["results_files"]}
    expected = {
        f"bench_{b}_cpu.json"
        for b in ("policy_loss", "fused_linear", "packed", "vocab_parallel", "sample", "profile")
    }
    assert expected | {"bench_trl_step_cpu.json"} <= set(files)
    for name, f in files.items():
        meta = json.loads((out / name).read_text())["meta"]
        for key in ("device", "device_name", "torch", "triton", "git_commit", "time_utc"):
            assert meta.get(key), (name, key)
        assert f["csv"] and f["png"], name
    trl_meta = json.loads((out / "bench_trl_step_cpu.json").read_text())["meta"]
    assert trl_meta["trl"] and trl_meta["config"]["timed_steps"] > 0


def test_a_hidden_baseline_is_reported_as_skipped(run):
    """--skip liger hides Liger; a baseline package that is not installed (verl on a machine
    set up by the README's test command, which installs the test extra only) is reported as
    missing beside it."""
    import importlib.util

    _, out, summary, _ = run
    missing = {"verl": "`verl` not importable"} if importlib.util.find_spec("verl") is None else {}
    assert summary["hidden_or_missing_packages"] == {"liger": "hidden with --skip", **missing}
    base = summary["baselines"]
    assert base["liger-fused-linear (fused-linear)"] == "skipped: hidden with --skip"
    assert base["trl-chunked (fused-linear)"] == "ran"
    assert base["trl-eager (policy-loss)"] == "ran"
    assert base["trl-eager-padded (packed)"] == "ran"
    rows = json.loads((out / "bench_fused_linear_cpu.json").read_text())["rows"]
    assert "liger-fused-linear" not in {r["method"] for r in rows}
    cmd = next(s for s in summary["stages"] if s["name"] == "fused-linear")["command"]
    assert "--no-liger" in cmd
    assert (
        "| liger-fused-linear (fused-linear) | skipped: hidden with --skip |"
        in (out / "summary.md").read_text()
    )


def test_readme_bench_block_rewritten_from_the_run(run):
    _, out, _, (readme, original) = run
    text = readme.read_text()
    bench = text.split("<!-- bench:start -->")[1].split("<!-- bench:end -->")[0]
    assert "N=32 (B=2, T=16), V=512" in bench  # the quick policy-loss shape
    assert str(out.name) in bench  # "(from `.../run_all0/bench_...json`)"
    for block in ("train", "learning"):  # no such results in the run's folder: left as they were
        mine = text.split(f"<!-- {block}:start -->")[1].split(f"<!-- {block}:end -->")[0]
        theirs = original.split(f"<!-- {block}:start -->")[1].split(f"<!-- {block}:end -->")[0]
        assert mine == theirs, block


def test_merge_joins_the_calls_of_a_split_run(run, tmp_path):
    """A second call runs only the stage that failed in the first (gae), as a GPU session's
    later call would, on a copy of the tree without .git (FASTRL_GIT_COMMIT names the commit);
    --merge of both folders: every stage once, gae from the second call and passed, the
    others and pytest's counts from the first, the results files of both."""
    _, first, first_summary, _ = run
    second, merged = tmp_path / "second", tmp_path / "merged"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(second), "--stages", "gae"]
    env = dict(_env(), FASTRL_GIT_COMMIT="0123abc-lent-gpu")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    gae_meta = json.loads((second / "bench_gae_cpu.json").read_text())["meta"]
    assert gae_meta["git_commit"] == "0123abc-lent-gpu"

    cmd = [sys.executable, str(SCRIPT), "--merge", str(first), str(second), "--out", str(merged)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]  # the failed gae was run again and passed
    summary = json.loads((merged / "summary.json").read_text())
    stages = {s["name"]: s for s in summary["stages"]}
    assert list(stages) == [s["name"] for s in first_summary["stages"]]  # each once, in order
    assert stages["gae"]["status"] == "passed" and stages["gae"]["from"] == str(second)
    assert stages["sample"]["status"] == "passed" and stages["sample"]["from"] == str(first)
    assert summary["pytest_gpu"] == first_summary["pytest_gpu"]
    assert summary["merged_from"] == [str(first), str(second)]
    files = {f["file"] for f in summary["results_files"]}
    assert {"bench_gae_cpu.json", "bench_sample_cpu.json", "bench_trl_step_cpu.json"} <= files
    assert (merged / "logs" / "gae.log").read_text() == (second / "logs" / "gae.log").read_text()
    assert any(h["bench"] == "gae" and h["this_run"] for h in summary["headlines"])
    assert "Merged from the runs in" in (merged / "summary.md").read_text()
    assert len(summary["targets"]) == len(first_summary["targets"])

    bad = subprocess.run([*cmd[:2], "--merge", str(tmp_path), "--out", str(merged)],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert bad.returncode != 0 and "holds a summary.json" in bad.stderr


def test_help_explains_every_option():
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0
    opts = ("--out", "--quick", "--readme", "--readme-path", "--skip", "--stages", "--timeout")
    for opt in (*opts, "--merge"):
        assert opt in proc.stdout, opt
    for stage in ("pytest-gpu", "compile-check", *BENCH_STAGES):
        assert stage in proc.stdout, stage
    assert "summary.md" in proc.stdout and "liger" in proc.stdout


def test_bad_options_are_refused():
    for bad in (["--skip", "numpy"], ["--timeout", "nope=3"], ["--stages", "gpu"]):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), "--out", "/nonexistent/x", *bad],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode != 0, bad
        assert "unknown" in proc.stderr or "expected" in proc.stderr, (bad, proc.stderr)


def test_gpu_tests_run_in_parallel_only_on_cuda(monkeypatch):
    """On CUDA the GPU tests share the device over pytest-xdist workers (a fresh machine compiles
    every kernel configuration, within a 600 s call); without CUDA they all skip, serially."""
    import importlib.util

    run_all = load_bench("run_all.py")
    args = run_all.build_parser().parse_args(["--out", "/tmp/x"])
    missing = run_all.available(set())
    cpu = run_all.plan(args, False, missing)[0]
    assert cpu.name == "pytest-gpu" and "-n" not in cpu.cmd
    gpu = run_all.plan(args, True, missing)[0]
    assert gpu.cmd[gpu.cmd.index("-n") + 1] in {str(k) for k in range(1, 9)}
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "xdist" else real(name)
    )
    assert "-n" not in run_all.plan(args, True, missing)[0].cmd


def test_chunk_size_sweep_on_cuda_only(tmp_path):
    """The fused-linear stage sweeps chunk sizes on CUDA (bench_fused_linear.py --chunk-sizes
    CUDA_CHUNK_SIZES), never on the CPU (full or --quick); the sweep's rows get their own
    x GEMM floor headlines."""
    run_all = load_bench("run_all.py")
    missing = dict.fromkeys(run_all.BASELINES)  # every baseline importable

    def fused_cmd(argv, cuda):
        args = run_all.build_parser().parse_args(["--out", str(tmp_path), *argv])
        return next(s for s in run_all.plan(args, cuda, missing) if s.name == "fused-linear").cmd

    cmd = fused_cmd([], True)
    at = cmd.index("--chunk-sizes")
    sizes = [int(x) for x in cmd[at + 1 : at + 1 + len(run_all.CUDA_CHUNK_SIZES)]]
    assert sizes == list(run_all.CUDA_CHUNK_SIZES) and len(sizes) >= 3
    assert cmd[cmd.index("--shapes") + 1] == "8192x4096" and "151936" in cmd
    assert all(s >= 1 for s in sizes) and max(sizes) <= 8192  # within the stage's N
    for argv in ([], ["--quick"]):
        assert "--chunk-sizes" not in fused_cmd(argv, False), argv
    rows = [
        {"method": m, "N": 8, "H": 4, "V": 16, "dtype": "bf16", "chunk_size": c, "x_gemm_floor": x}
        for m, c, x in [("fastrl-fused-linear", None, 2.0), ("gemm-floor", None, 1.0),
                        ("fastrl-fused-linear[chunk=256]", 256, 1.25),
                        ("linear_logprobs+grpo[chunk=1024]", 1024, 1.5)]
    ]  # fmt: skip
    (tmp_path / "bench_fused_linear_cuda.json").write_text(json.dumps({"meta": {}, "rows": rows}))
    heads = {h["what"]: h["value"] for h in run_all.headlines(tmp_path, True, 0.0)}
    assert heads == {
        "fastrl-fused-linear x GEMM floor": 2.0,
        "fastrl-fused-linear[chunk=256] x GEMM floor": 1.25,
        "linear_logprobs+grpo[chunk=1024] x GEMM floor": 1.5,
    }


def test_readme_gpu_calls_name_real_stages_and_fit_a_call():
    """The README's lent-GPU plan: each `gpu_run.sh --stages ...` call names only run_all's
    stages, gives each a timeout, and the timeouts fit one 600 s call with a margin for the
    start; together the calls cover every benchmark stage."""
    import re

    mod = load_bench("run_all.py")
    readme = (ROOT / "README.md").read_text()
    calls = re.findall(r"`bash benchmarks/gpu_run.sh (--stages [^`]+)`", readme)
    assert len(calls) >= 2
    covered = set()
    for call in calls:
        stages = re.search(r"--stages (\S+)", call).group(1).split(",")
        timeouts = dict(t.split("=") for t in re.findall(r"--timeout (\S+)", call))
        assert set(stages) <= set(mod.STAGES), call
        assert set(timeouts) == set(stages), call
        assert sum(int(v) for v in timeouts.values()) <= 570, call
        covered |= set(stages)
    assert set(BENCH_STAGES) | {"pytest-gpu"} <= covered


def test_a_stage_cut_at_its_timeout_keeps_pytests_counts(tmp_path):
    """run_stage ends a stage past its timeout with SIGINT first: pytest then ends its session as
    on Ctrl-C and writes its junit XML, so the counts so far survive (one test passed before
    the slow one was cut); the stage is failed, "timed out"."""
    mod = load_bench("run_all.py")
    tests = tmp_path / "test_slow.py"
    tests.write_text("import time\n\ndef test_fast():\n    pass\n\n"
                     "def test_slow():\n    time.sleep(120)\n")  # fmt: skip
    (tmp_path / "logs").mkdir()
    xml = tmp_path / "pytest_gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o",
           "junit_family=xunit2", "--junitxml", str(xml), str(tests)]  # fmt: skip
    stage = mod.Stage("pytest-gpu", cmd=cmd)
    mod.run_stage(stage, 15, tmp_path / "logs")
    assert stage.status == "failed" and stage.detail == "timed out after 15 s"
    assert stage.seconds < 15 + mod.GRACE_S
    counts = mod.pytest_counts(xml)
    assert counts is not None and counts["passed"] == 1, counts


def test_a_run_killed_from_outside_leaves_a_summary_to_merge(tmp_path):
    """The summary is written after every stage: a run killed mid-way (a device call's own time
    limit) leaves summary.json with the stages done and the rest "not reached", and --merge
    takes it."""
    import signal
    import time

    out = tmp_path / "killed"
    cmd = [sys.executable, str(SCRIPT), "--quick", "--out", str(out), "--stages", "gae,sample"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=_env(), cwd=ROOT, start_new_session=True)  # fmt: skip

    def gae_done() -> bool:
        try:
            summary = json.loads((out / "summary.json").read_text())
        except (OSError, ValueError):  # not written yet, or being written
            return False
        return any(s["name"] == "gae" and s["status"] == "passed" for s in summary["stages"])

    deadline = time.time() + 240
    while not gae_done() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    running = proc.poll() is None  # a summary before the run's end: written after gae
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert running, "summary.json appeared only when the run had ended"
    summary = json.loads((out / "summary.json").read_text())
    stages = {s["name"]: s for s in summary["stages"]}
    assert stages["gae"]["status"] == "passed"
    assert stages["sample"]["status"] == "skipped"  # sample takes seconds: killed during it
    assert stages["sample"]["detail"].startswith("not reached")
    merged = tmp_path / "merged"
    cmd = [sys.executable, str(SCRIPT), "--merge", str(out), "--out", str(merged)]
    res = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    merged_stages = {
        s["name"]: s for s in json.loads((merged / "summary.json").read_text())["stages"]
    }
    assert merged_stages["gae"]["status"] == "passed"


# a stage that sleeps until SIGINT, then writes its "rows" (what keep_rows_on_interrupt does)
FAKE_STAGE = """
import pathlib, sys, time
out = pathlib.Path(sys.argv[1])
(out / (sys.argv[2] + ".started")).write_text(str((out / "summary.json").exists()))
try:
    time.sleep(60)
except KeyboardInterrupt:
    (out / (sys.argv[2] + ".rows")).write_text("the rows measured before the SIGINT")
"""
# run_all.main with its stages replaced by fake ones (gae, sample), and short graces
DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import run_all
out, fake = sys.argv[2], sys.argv[3]
run_all.GRACE_S, run_all.DEADLINE_MARGIN_S = 1, 0.5

def plan(args, cuda, missing):
    return [run_all.Stage(n, cmd=[sys.executable, fake, out, n]) for n in ("gae", "sample")]

run_all.plan = plan
sys.exit(run_all.main(["--out", out, *sys.argv[4:]]))
"""


def _driver(tmp_path, *args, term_group_when_started=False):
    """Run DRIVER; with term_group_when_started, once the first fake stage has started send
    SIGTERM to the driver's process group, as the device call's outer `timeout -k 5 572` does
    (it signals its own group; run_all's stages run in sessions of their own)."""
    import signal
    import time

    out = tmp_path / "run"
    out.mkdir()
    (tmp_path / "fake_stage.py").write_text(FAKE_STAGE)
    (tmp_path / "driver.py").write_text(DRIVER)
    cmd = [sys.executable, str(tmp_path / "driver.py"), str(ROOT / "benchmarks"), str(out),
           str(tmp_path / "fake_stage.py"), *args]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=_env(), start_new_session=True)  # fmt: skip
    if term_group_when_started:
        deadline = time.time() + 60
        while not (out / "gae.started").exists() and time.time() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(cmd, proc.returncode, "", err), out


def test_an_outer_timeout_is_forwarded_to_the_running_stage(tmp_path):
    """A SIGTERM to run_all's process group (the outer `timeout`) never reaches the stage, which
    runs in its own session: run_all forwards it to the running stage as SIGINT (which keeps its
    rows), records it, writes the summary and stops (no later stage, exit 128 + 15); the summary
    was there before the first stage began."""
    proc, out = _driver(tmp_path, term_group_when_started=True)
    assert proc.returncode == 128 + 15, proc.stderr[-2000:]
    assert (out / "gae.started").read_text() == "True"  # summary.json before the first stage
    assert (out / "gae.rows").exists(), "the stage never got the forwarded signal"
    assert not (out / "sample.started").exists()
    stages = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["stages"]}
    assert stages["gae"]["status"] == "failed"
    assert stages["gae"]["detail"].startswith("interrupted: run_all got SIGTERM")
    assert stages["sample"]["status"] == "skipped"
    assert stages["sample"]["detail"].startswith("not reached")


def test_a_deadline_makes_the_stage_timeouts_fire_first(tmp_path):
    """--deadline: the running stage's timeout is cut to end (its SIGINT grace included) before
    the deadline, so it keeps its rows; a stage with no time left is not started."""
    proc, out = _driver(tmp_path, "--deadline", "4")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert (out / "gae.rows").exists()
    stages = {s["name"]: s for s in json.loads((out / "summary.json").read_text())["stages"]}
    assert stages["gae"]["status"] == "failed"
    # at most 4 - grace 1 - margin 0.5 s, less the run's start
    detail = stages["gae"]["detail"]
    assert detail.startswith("timed out after ") and 0 < float(detail.split()[3]) <= 2.5, detail
    assert stages["sample"]["status"] == "skipped" and "--deadline" in stages["sample"]["detail"]
    assert not (out / "sample.started").exists()


def test_merge_skips_a_folder_without_a_summary(tmp_path):
    """A call killed before run_all wrote anything leaves no summary.json: --merge warns, skips
    that folder and merges the others."""
    _, out = _driver(tmp_path, "--deadline", "4")
    empty, merged = tmp_path / "empty", tmp_path / "merged"
    empty.mkdir()
    cmd = [sys.executable, str(SCRIPT), "--merge", str(out), str(empty), "--out", str(merged)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=120)
    assert "warning" in proc.stderr and str(empty) in proc.stderr
    summary = json.loads((merged / "summary.json").read_text())
    assert summary["merged_from"] == [str(out.resolve())]
    assert summary["merge_skipped"] == [str(empty)]
    assert {s["name"] for s in summary["stages"]} == {"gae", "sample"}
    assert "Skipped (no summary.json)" in (merged / "summary.md").read_text()
