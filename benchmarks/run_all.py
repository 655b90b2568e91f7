"""The whole GPU run in one command: the GPU tests, the kernel compile check, every benchmark, one
summary (and the README tables on request).

    python benchmarks/run_all.py --out benchmarks/results --readme   # on a CUDA machine
    python benchmarks/run_all.py --out /tmp/run --quick              # CPU smoke run (~3-4 min)
    python benchmarks/run_all.py --merge A B --out benchmarks/results --readme  # calls A, B as one

On a lent GPU machine (600 s a call) the stages are split over calls with --stages
(benchmarks/gpu_prep.sh here, benchmarks/gpu_run.sh there: README "On a lent GPU machine"), and
--merge joins the calls' folders afterwards.

Stages, in order, each a subprocess with its own timeout (a failed or timed-out stage is reported
and the next one still runs; past its timeout a stage gets SIGINT, then SIGKILL after GRACE_S, so
that pytest-gpu cut short still writes the counts it has); its stdout + stderr go to
<out>/logs/<stage>.log:
  pytest-gpu      python -m pytest -m gpu tests/ (junit XML in <out>/pytest_gpu.xml; on CUDA with
                  up to 8 pytest-xdist workers sharing the device); without a CUDA device every
                  test skips, and the summary says so
  compile-check   python -m fastrl.kernels.compile_check --json (<out>/compile_check.json): every
                  Triton kernel compiled for sm_80 / sm_90a at every launch configuration
  policy-loss     bench_policy_loss.py: CUDA N = 16384 (B = 128, T = 128) at V = 151936 then 32000,
                  bf16
  kernel-configs  bench_kernel_configs.py (CUDA only): the logits kernels' launch configurations
                  (BLOCK_V, warps, stages, grid, fp fusion) timed through their launchers at
                  N = 16384, V = 151936 and 32000, bf16, the HBM copy floor beside them, and a
                  profile of fastrl.policy_loss and fastrl.sample (host vs device time)
  rows-in-flight  bench_rows_in_flight.py: the one-pass kernel's grid swept (FASTRL_ONE_PASS=1,
                  FASTRL_ROWS_IN_FLIGHT = auto, 0, 66, 132, 264) and the default path, CUDA
                  N = 16384 at V = 151936 and N = 8192 at V = 262144, bf16 (--quick: the CPU
                  smoke run, which only checks the plumbing)
  fused-linear    bench_fused_linear.py: CUDA N = 8192, H = 4096, V = 151936, bf16, plus the
                  chunk-size sweep (--chunk-sizes 256 1024 2048 4096 8192, CUDA only: the
                  library's GPU default, 2048 rows, was chosen from it; ten more rows, about
                  a minute on an H200, within the stage's timeout)
  logprobs        bench_logprobs.py: the no-grad log-probs of pi_old / pi_ref from a padded batch,
                  from the logits and from the LM head, against TRL's and verl's (CUDA B = 16,
                  T = 1024, V = 151936, H = 4096, bf16)
  packed          bench_packed.py: packed (cu_seqlens) vs padded batches at ~50 % padding, its
                  defaults (CUDA S = 64, T = 2048, V = 151936, bf16; rows that do not fit are
                  kept as out of memory); --quick: its --quick mode in fp32
  vocab-parallel  bench_vocab_parallel.py: the vocab-parallel LM head over P = 2 processes vs the
                  unsharded op (CPU: gloo processes; CUDA: NCCL, one device per rank, so on a
                  one-GPU machine only the unsharded row runs and the summary says why)
  gae             bench_gae.py: B = 512, T = 8192 (on CUDA with --device cuda)
  sample          bench_sample.py: N = 256, V = 151936 (bf16 on CUDA)
  trl-step        bench_trl_step.py: one optimizer step of fastrl.integrations.trl.GRPOTrainer vs
                  trl.GRPOTrainer on a tiny local Qwen2
  profile         bench_profile.py: torch.profiler's time per kernel of fastrl's policy loss and
                  fused linear loss and of their baselines (CUDA: N = 8192, V = 151936, H = 4096,
                  bf16), to explain a missed target
  readme          (only with --readme) report.py --readme --results <out>
With --quick every benchmark runs its own --quick mode (or small shapes) on the CPU; pytest -m gpu
and the compile check run as they are. Without CUDA and without --quick the benchmarks run at
their CPU default shapes (the README's CPU tables; tens of minutes on a small machine).

Every benchmark writes <out>/<bench>_<device>.{json,csv,png} with the machine, versions and git
commit in its meta. Then <out>/summary.json and <out>/summary.md: per stage passed / failed /
skipped and seconds, pytest's pass / fail / skip counts, the headline ratios read from the
results files (fastrl vs trl-eager for the policy loss, x GEMM floor for the fused linear loss,
packed vs padded time and peak memory, vocab-parallel vs unsharded time and peak memory per
rank, speed-ups for gae, the sampler and the TRL step; % of the HBM roofline where the results
carry it, i.e. the policy loss on CUDA) and which baselines ran or were skipped and why. Nothing
in the summary is computed here beyond reading those files. Exit status 0 when no stage failed
(128 + the signal's number when a SIGTERM / SIGINT stopped the run).

The summary is written before the first stage and after each one, so a run killed from outside
leaves one that --merge reads. A SIGTERM or SIGINT to run_all (an outer `timeout`, Ctrl-C) is
forwarded to the running stage, which runs in its own session, as SIGINT: the benchmarks then
write the rows they measured, pytest its junit XML; what has not ended SIGNAL_GRACE_S (3 s)
later is killed, the summary written and the run stopped. --deadline SECONDS (the time the
whole call may take) cuts each stage's timeout to fit, so run_all's own stage timeouts fire
first; benchmarks/gpu_run.sh passes it.

Baselines whose package is missing (importlib.util.find_spec) are skipped and reported: liger
(liger_kernel: --no-liger to both loss benchmarks), verl (--no-verl to the policy-loss,
fused-linear and gae benchmarks; where only ray is missing, the benchmarks import verl with a
stand-in for it, _baselines.import_verl, and their notes say so); trl is
the baseline of the policy-loss, fused-linear, packed and trl-step stages (and datasets of
trl-step), so without it those stages are skipped. Installs nothing; needs no network. On a lent
GPU machine the stages are split over calls of at most 600 s (README "On a lent GPU machine"
names the calls, their stage timeouts and the stage times recorded in their summaries); the
default stage timeouts (see --timeout) total more than one call.
"""

from __future__ import annotations

import argparse
import calendar
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_targets  # noqa: E402
from gpu_targets import load_json  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
RESULTS_DIR = BENCH / "results"
PY = sys.executable

# optional baselines: name -> (module find_spec looks for, what hiding it does)
BASELINES = {
    "liger": ("liger_kernel", "Liger-Kernel rows of policy-loss (CUDA only) and fused-linear"),
    "verl": ("verl", "the verl rows of policy-loss, fused-linear and gae"),
    "trl": (
        "trl",
        "the baseline of policy-loss, fused-linear, logprobs, packed and trl-step: those stages",
    ),
    "datasets": ("datasets", "trl-step (GRPOTrainer takes a datasets.Dataset)"),
}
STAGES = (
    "pytest-gpu",
    "compile-check",
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
    "readme",
)
GRACE_S = 15  # seconds a stage past its timeout gets to end after SIGINT, before SIGKILL
DEADLINE_MARGIN_S = 5  # --deadline: seconds kept after a stage's end for the summary
# seconds: (full run on CUDA, --quick on CPU)
TIMEOUTS = {
    "pytest-gpu": (420, 300),
    "compile-check": (600, 600),
    "policy-loss": (480, 240),
    "kernel-configs": (300, 60),
    "rows-in-flight": (360, 240),
    "fused-linear": (420, 240),  # CUDA: + 60 s for the chunk-size sweep
    "logprobs": (180, 180),
    "packed": (600, 180),
    "vocab-parallel": (600, 180),
    "gae": (180, 120),
    "sample": (180, 120),
    "trl-step": (300, 180),
    "profile": (240, 180),
    "readme": (120, 120),
}


# rows per chunk the fused-linear stage sweeps on CUDA (bench_fused_linear.py --chunk-sizes), for
# linear_logprobs+grpo and fastrl-fused-linear at N = 8192: from a few weight re-reads per 1000
# rows up to the whole batch in one chunk. A size equal to the library's default stays in: the
# sweep then reads the same whatever that default is (the results' meta records it per case)
CUDA_CHUNK_SIZES = (256, 1024, 2048, 4096, 8192)


@dataclass
class Stage:
    name: str
    cmd: list[str] | None = None  # None: skipped
    why_skipped: str = ""
    stdout_to: Path | None = None  # a file for the child's stdout (the rest goes to the log)
    results: list[str] = field(default_factory=list)  # result stems it must write
    status: str = "skipped"
    seconds: float = 0.0
    rc: int | None = None
    detail: str = ""
    log_tail: str = ""


def available(skip: set[str]) -> dict[str, str | None]:
    """baseline -> None when importable and not hidden, else why it is not."""
    out = {}
    for name, (module, _) in BASELINES.items():
        if name in skip:
            out[name] = "hidden with --skip"
        elif importlib.util.find_spec(module) is None:
            out[name] = f"`{module}` not importable"
        else:
            out[name] = None
    return out


def has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover - torch is required
        return False


def pytest_workers(cuda: bool) -> list[str]:
    """pytest-xdist options for the GPU tests: on CUDA, up to 8 processes share the device (a
    fresh machine JIT-compiles every kernel configuration the tests reach, and a call may run
    600 s at most: the compiles run in parallel); none without CUDA (every test skips) or
    without pytest-xdist."""
    if not cuda or importlib.util.find_spec("xdist") is None:
        return []
    return ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]


def plan(args, cuda: bool, missing: dict[str, str | None]) -> list[Stage]:
    """The stages with their commands (or the reason they are skipped)."""
    out, quick = Path(args.out), args.quick
    dev = "cuda" if cuda else "cpu"
    common = ["--out", str(out)]
    no_liger = ["--no-liger"] if missing["liger"] else []
    stages = []

    s = Stage("pytest-gpu")
    if importlib.util.find_spec("pytest") is None:
        s.why_skipped = "`pytest` not importable"
    else:
        s.cmd = [PY, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider"]
        s.cmd += ["-o", "junit_family=xunit2", "--junitxml", str(out / "pytest_gpu.xml")]
        s.cmd += pytest_workers(cuda)
        s.cmd += [str(ROOT / "tests")]
    stages.append(s)

    s = Stage("compile-check", stdout_to=out / "compile_check.json")
    s.cmd = [PY, "-m", "fastrl.kernels.compile_check", "--json"]
    stages.append(s)

    def bench(name, script, skip=None, quick_args=(), cuda_args=(), tail=(), bar=True):
        """The stage of benchmarks/<script>: `--out <out> [--no-progress] --device <dev>` (the
        benchmarks with a progress bar, `bar`, get --no-progress), then quick_args (--quick) or
        cuda_args (a full run on CUDA), then `tail`; skipped when `skip` says why."""
        s = Stage(name, results=[f"{Path(script).stem}_{dev}"], why_skipped=skip or "")
        if not skip:
            s.cmd = [PY, str(BENCH / script), *common, *(["--no-progress"] if bar else [])]
            s.cmd += ["--device", dev, *(quick_args if quick else cuda_args if cuda else ())]
            s.cmd += tail
        return s

    no_trl = missing["trl"]
    fp32 = ["--quick", "--dtype", "fp32"]
    do_bench = ["--warmup", "25", "--rep", "100"]
    no_verl = ["--no-verl"] if missing["verl"] else []
    stages.append(
        bench(
            "policy-loss",
            "bench_policy_loss.py",
            no_trl and f"its baseline trl-eager needs trl ({no_trl})",
            fp32,
            ["--shapes", "128x128x151936,128x128x32000", "--dtype", "bf16", *do_bench],
            no_liger + no_verl,
        )
    )
    s = Stage("kernel-configs", results=[f"bench_kernel_configs_{dev}"])
    if not cuda:
        s.why_skipped = "CUDA only (the kernels' launch configurations timed on the device)"
    else:
        s.cmd = [PY, str(BENCH / "bench_kernel_configs.py"), "--out", str(out)]
    stages.append(s)
    stages.append(
        bench(
            "rows-in-flight",
            "bench_rows_in_flight.py",
            no_trl and f"it runs bench_policy_loss.py, which needs trl ({no_trl})",
            ["--quick"],
            ["--rep", "100", "--warmup", "25"],
        )
    )
    sweep = ["--chunk-sizes", *map(str, CUDA_CHUNK_SIZES)]
    stages.append(
        bench(
            "fused-linear",
            "bench_fused_linear.py",
            no_trl and f"its baselines (TRL's loss and chunked head) need trl ({no_trl})",
            fp32,
            ["--shapes", "8192x4096", "--V", "151936", "--dtype", "bf16", *do_bench, *sweep],
            no_liger + no_verl,
        )
    )
    why = no_trl and f"its baselines (TRL's log-prob helpers and chunked head) need trl ({no_trl})"
    quick_lp = ["--B", "2", "--T", "64", "--V", "2048", "--H", "64", "--rep", "3", "--no-compile"]
    stages.append(bench("logprobs", "bench_logprobs.py", why, quick_lp, bar=False))
    why = no_trl and f"its baseline trl-eager-padded needs trl ({no_trl})"
    stages.append(bench("packed", "bench_packed.py", why, fp32))
    stages.append(bench("vocab-parallel", "bench_vocab_parallel.py", quick_args=["--quick"]))
    quick_gae = ["--B", "64", "--T", "1024", "--rep", "5", "--loop-rep", "2"]
    stages.append(bench("gae", "bench_gae.py", None, quick_gae, (), no_verl, bar=False))
    quick_sample = ["--N", "32", "--V", "8192", "--rep", "5"]
    stages.append(bench("sample", "bench_sample.py", quick_args=quick_sample, bar=False))
    lacking = no_trl or missing["datasets"]
    why = lacking and f"needs trl and datasets ({lacking})"
    stages.append(bench("trl-step", "bench_trl_step.py", why, ["--quick"], bar=False))
    why = no_trl and f"its baselines (TRL's loss and chunked head) need trl ({no_trl})"
    stages.append(bench("profile", "bench_profile.py", why, ["--quick"], (), no_liger, bar=False))

    if args.readme:
        stages.append(Stage("readme", cmd=readme_cmd(args)))

    wanted = set(args.stages.split(",")) if args.stages else set(STAGES)
    for s in stages:
        if s.name not in wanted:
            s.cmd, s.why_skipped = None, "not in --stages"
        if s.cmd is None:
            s.detail = f"skipped: {s.why_skipped}"
    return stages


def readme_cmd(args) -> list[str]:
    """report.py --readme on <out>: the bench block, and the train / learning blocks only where
    <out> has their files (the README keeps the others as they are)."""
    out = Path(args.out)
    blocks = ["bench"]
    blocks += ["train"] if (out / "train_summary.json").exists() else []
    blocks += ["learning"] if (out / "learning.json").exists() else []
    cmd = [PY, str(BENCH / "report.py"), "--readme", "--results", str(out)]
    return cmd + ["--blocks", ",".join(blocks), "--readme-path", str(args.readme_path)]


def child_env() -> dict:
    """os.environ without TRITON_INTERPRET (set by the test harness on CPU machines: compiled
    kernels on CUDA, the CPU paths otherwise, and the compile check needs it unset)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONWARNINGS"] = env.get("PYTHONWARNINGS", "ignore")
    return env


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


SIGNAL_GRACE_S = 3  # seconds a stage gets after a forwarded TERM / INT (timeout -k 5 kills at 5)
# the stage process running now, and the TERM / INT run_all received (main's handler fills it)
_RUNNING: dict = {"proc": None, "signal": None, "at": None}


def _forward_signal(signum, frame) -> None:
    """run_all's SIGTERM / SIGINT handler: the stages run in their own sessions (a stage timeout
    ends the whole group), so a signal to run_all's group (the outer `timeout` of a device call,
    Ctrl-C) never reaches them; forward it to the running stage as SIGINT, on which the
    benchmarks write the rows they measured (keep_rows_on_interrupt) and pytest its junit XML.
    main then records the stage as interrupted, writes the summary and stops."""
    _RUNNING["signal"], _RUNNING["at"] = signum, time.monotonic()
    proc = _RUNNING["proc"]
    if proc is not None and proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGINT)
        except OSError:  # pragma: no cover - ended in between
            pass


def _say(text: str) -> None:
    """A progress line on stderr; never fails (after a signal the pipe to `tee` may be gone)."""
    try:
        print(text, file=sys.stderr, flush=True)
    except (OSError, ValueError):
        pass


def _end(proc, grace: float) -> None:
    """SIGINT to the stage's process group, SIGKILL what is left after `grace` seconds."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
    except OSError:
        pass
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except OSError:
            pass
        proc.wait()


def run_stage(s: Stage, timeout: float, logs: Path) -> None:
    log = logs / f"{s.name}.log"
    if s.name == "pytest-gpu":
        (logs.parent / "pytest_gpu.xml").unlink(missing_ok=True)  # no stale counts
    wall_start = time.time()
    start = time.perf_counter()
    with open(log, "w") as logf:
        logf.write("$ " + " ".join(s.cmd) + "\n")
        logf.flush()
        out = open(s.stdout_to, "w") if s.stdout_to else logf
        try:
            proc = subprocess.Popen(
                s.cmd,
                cwd=ROOT,
                env=child_env(),
                stdout=out,
                stderr=logf,
                start_new_session=True,  # its own process group: a timeout ends all of it
                # SIGINT back to its default in the child: a job started in the background by
                # a non-interactive shell (`... &`, nohup) inherits it ignored, and pytest would
                # then never see the timeout's SIGINT
                preexec_fn=_default_sigint,
            )
            _RUNNING["proc"] = proc
            if _RUNNING["signal"] is not None:  # a signal came while it started
                _forward_signal(_RUNNING["signal"], None)
            deadline = time.monotonic() + timeout
            while True:
                try:
                    s.rc = proc.wait(timeout=min(0.25, max(deadline - time.monotonic(), 0)))
                    break
                except subprocess.TimeoutExpired:
                    pass
                if _RUNNING["signal"] is not None:
                    # forwarded already (SIGINT): what has not ended after SIGNAL_GRACE_S is
                    # killed, so that run_all still writes the summary before its own end
                    if time.monotonic() >= _RUNNING["at"] + SIGNAL_GRACE_S:
                        _end(proc, 0)
                        s.rc = None
                        break
                elif time.monotonic() >= deadline:
                    # SIGINT first: pytest then ends its session as on Ctrl-C and still writes
                    # its junit XML, and a benchmark writes the rows it has timed, so a stage
                    # cut at its timeout keeps what it measured; what has not exited after
                    # GRACE_S is killed
                    _end(proc, GRACE_S)
                    s.rc = None
                    s.detail = f"timed out after {timeout:g} s"
                    break
            if _RUNNING["signal"] is not None:
                name = signal.Signals(_RUNNING["signal"]).name
                s.rc = None
                s.detail = f"interrupted: run_all got {name}, forwarded to the stage as SIGINT"
        finally:
            _RUNNING["proc"] = None
            if s.stdout_to:
                out.close()
    s.seconds = time.perf_counter() - start
    if s.rc is not None and s.rc != 0:
        s.detail = f"exit status {s.rc}"
    missing = [r for r in s.results if not _written_since(logs.parent / f"{r}.json", wall_start)]
    if s.rc == 0 and missing:
        s.rc, s.detail = -1, f"wrote no {', '.join(m + '.json' for m in missing)}"
    s.status = "passed" if s.rc == 0 else "failed"
    if s.status == "failed":
        lines = log.read_text(errors="replace").replace("\r", "\n").splitlines()
        s.log_tail = "\n".join([ln for ln in lines if ln.strip()][-15:])


# ---------------------------------------------------------------- reading the results


def _written_since(path: Path, t: float) -> bool:
    try:
        return path.stat().st_mtime >= t - 1.0
    except OSError:
        return False


def pytest_counts(xml_path: Path) -> dict | None:
    try:
        root = ET.parse(xml_path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    total = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors")}
    total["skipped"] = sum(int(s.get("skipped", 0)) for s in suites)
    total["passed"] = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return total


def _f(v, fmt="{:.2f}x") -> str:
    return "n/a" if v is None else fmt.format(v)


def headlines(out: Path, cuda: bool, since: float) -> list[dict]:
    """The headline ratios, each read from a results file (benchmark, case, what, value, % HBM
    roofline, file, this_run: False when the file is older than this run, i.e. its stage did
    not rewrite it)."""
    dev = "cuda" if cuda else "cpu"
    rows: list[dict] = []

    def add(bench, case, what, value, roofline, file):
        fresh = _written_since(out / file, since)
        rows.append(
            dict(
                bench=bench,
                case=case,
                what=what,
                value=value,
                roofline=roofline,
                file=file,
                this_run=fresh,
            )
        )

    path = out / f"bench_policy_loss_{dev}.json"
    data = load_json(path)
    for r in (data or {}).get("rows", []):
        if r["method"] in ("fastrl", "fastrl-inplace", "liger"):
            case = f"N={r['N']} V={r['V']} {r['dtype']}"
            roof = r.get("pct_bw") if cuda else None
            roof_text = (
                "n/a (CPU)"
                if not cuda
                else "n/a (unknown peak bandwidth)"
                if roof is None
                else f"{roof:.1f}%"
            )
            add(
                "policy-loss",
                case,
                f"{r['method']} vs trl-eager (fwd+bwd)",
                r.get("speedup_vs_trl_eager"),
                roof_text,
                path.name,
            )
    path = out / f"bench_rows_in_flight_{dev}.json"
    data = load_json(path)
    for r in (data or {}).get("rows", []):
        # CUDA only; older files: the rows of "fastrl" against the two-kernel path
        old = r["method"] == "fastrl" and r.get("vs_two_kernel") is not None
        if (r["method"] == "fastrl-one-pass" and r.get("vs_default") is not None) or old:
            case = f"N={r['N']} V={r['V']} {r['dtype']}"
            roof = f"{r['pct_bw']:.1f}%" if cuda and r.get("pct_bw") is not None else "n/a"
            what = "two-kernel" if old else "default-path"
            add("rows-in-flight", case, f"P={r['rows_in_flight']}: ms / {what} ms",
                r.get("vs_two_kernel" if old else "vs_default"), roof, path.name)  # fmt: skip
    path = out / f"bench_fused_linear_{dev}.json"
    data = load_json(path)
    for r in (data or {}).get("rows", []):
        method = r["method"].removesuffix(f"[chunk={r.get('chunk_size')}]")  # the sweep's too
        if method in ("fastrl-fused-linear", "linear_logprobs+grpo", "liger-fused-linear"):
            case = f"N={r['N']} H={r['H']} V={r['V']} {r['dtype']}"
            add("fused-linear", case, f"{r['method']} x GEMM floor", r.get("x_gemm_floor"), "n/a",
                path.name)  # fmt: skip
    path = out / f"bench_packed_{dev}.json"
    data = load_json(path)
    packed_rows = (data or {}).get("rows", [])
    oom = {(r["method"], r["dtype"]) for r in packed_rows if r.get("oom")}
    for r in packed_rows:
        if r["layout"] == "packed" and r["family"] in ("fastrl", "fused-linear"):
            padded = f"{r['family']}-padded"
            case = (
                f"S={r['S']} T={r['T']} N={r['N']} ({100 * r['pad_frac']:.0f}% pad) V={r['V']}"
                + (f" H={r['H']}" if "H" in r else "")
                + f" {r['dtype']}"
            )
            why = "".join(
                f" ({m.split('-')[-1]}: out of memory)"
                for m in (r["method"], padded)
                if (m, r["dtype"]) in oom
            )
            add("packed", case, f"{r['method']} vs {padded} (fwd+bwd){why}",
                r.get("speedup_packed_vs_padded"), "n/a", path.name)  # fmt: skip
            add("packed", case, f"{r['method']} / {padded} peak memory{why}",
                r.get("memory_packed_vs_padded"), "n/a", path.name)  # fmt: skip
    path = out / f"bench_vocab_parallel_{dev}.json"
    data = load_json(path)
    parallel = [r for r in (data or {}).get("rows", []) if r["method"] == "vocab-parallel"]
    for r in parallel:
        case = f"{r['op']}: N={r['N']} H={r['H']} V={r['V']} {r['dtype']}"
        threads = "" if cuda else f", {r['threads']} thread(s) each"
        add("vocab-parallel", case, f"P={r['P']} vs unsharded (fwd+bwd{threads})",
            r.get("speedup_vs_unsharded"), "n/a", path.name)  # fmt: skip
        if not cuda:
            add("vocab-parallel", case, f"P={r['P']} vs unsharded on all {r['total_threads']} "
                "threads (the same machine)", r.get("speedup_vs_unsharded_all_threads"), "n/a",
                path.name)  # fmt: skip
        add("vocab-parallel", case, f"P={r['P']} peak memory per rank / unsharded",
            r.get("memory_vs_unsharded"), "n/a", path.name)  # fmt: skip
    if data and not parallel:  # e.g. one CUDA device: the notes say why
        shape = data["meta"].get("shape", {})
        case = ", ".join(f"{k}={v}" for k, v in shape.items())
        notes = data["meta"].get("notes") or {"vocab-parallel": "no vocab-parallel row"}
        for why in notes.values():
            add("vocab-parallel", case, why, None, "n/a", path.name)
    for bench, stem, method, key in [
        ("gae", "bench_gae", "fastrl.gae", "speedup_vs_loop"),
        ("sample", "bench_sample", "fastrl.sample", "speedup_vs_baseline"),
    ]:
        path = out / f"{stem}_{dev}.json"
        data = load_json(path)
        for r in (data or {}).get("rows", []):
            if r["method"] == method:
                case = ", ".join(f"{k}={r[k]}" for k in ("B", "T", "N", "V", "dtype") if k in r)
                base = "the per-step loop" if bench == "gae" else "multinomial+log_softmax"
                pct = r.get("pct_bw") if cuda else None  # of its floor traffic (read once)
                roof = f"{pct:.1f}%" if pct is not None else "n/a"
                add(bench, case, f"{method} vs {base}", r.get(key), roof, path.name)
    path = out / f"bench_trl_step_{dev}.json"
    data = load_json(path)
    for r in (data or {}).get("rows", []):
        if r.get("role") == "fastrl":
            cfg = data["meta"].get("config", {})
            case = (
                f"batch {cfg.get('per_device_train_batch_size')}, "
                f"{cfg.get('max_completion_length')} tokens, {cfg.get('dtype')}"
            )
            add("trl-step", case, "fastrl GRPOTrainer step vs trl", r.get("speedup_step_vs_trl"),
                "n/a", path.name)  # fmt: skip
            add("trl-step", case, "step minus generation vs trl", r.get("speedup_train_vs_trl"),
                "n/a", path.name)  # fmt: skip
    return rows


def baseline_report(out: Path, cuda: bool, missing: dict[str, str | None]) -> dict[str, str]:
    """Which optional baselines ran (a row in the results) or were skipped, and why."""
    dev = "cuda" if cuda else "cpu"
    pl = load_json(out / f"bench_policy_loss_{dev}.json") or {}
    fl = load_json(out / f"bench_fused_linear_{dev}.json") or {}
    pk = load_json(out / f"bench_packed_{dev}.json") or {}
    pl_rows = {r["method"] for r in pl.get("rows", [])}
    fl_rows = {r["method"] for r in fl.get("rows", [])}
    pk_rows = {r["method"] for r in pk.get("rows", [])}
    notes = {**(pl.get("meta", {}).get("notes") or {}), **(fl.get("meta", {}).get("notes") or {})}

    def status(row, rows, present, why_missing, extra=""):
        if row in rows:
            return "ran"
        if why_missing:
            return f"skipped: {why_missing}"
        if row in notes:
            return notes[row]
        if not present:
            return "not run (no results file)"
        return f"not run{extra}"

    return {
        "trl-eager (policy-loss)": status("trl-eager", pl_rows, bool(pl), missing["trl"]),
        "trl-eager-compiled (policy-loss)": status("trl-eager-compiled", pl_rows, bool(pl), None),
        "verl-eager (policy-loss)": status("verl-eager", pl_rows, bool(pl), missing["verl"]),
        "liger (policy-loss)": status(
            "liger", pl_rows, bool(pl), missing["liger"], "" if cuda else " (CUDA only)"
        ),
        "matmul+trl-eager (fused-linear)": status(
            "matmul+trl-eager", fl_rows, bool(fl), missing["trl"]
        ),
        "trl-chunked (fused-linear)": status("trl-chunked", fl_rows, bool(fl), missing["trl"]),
        "verl-fused-linear (fused-linear)": status(
            "verl-fused-linear", fl_rows, bool(fl), missing["verl"]
        ),
        "verl-linear-ce (fused-linear)": status(
            "verl-linear-ce", fl_rows, bool(fl), missing["verl"], "" if cuda else " (CUDA only)"
        ),
        "liger-fused-linear (fused-linear)": status(
            "liger-fused-linear", fl_rows, bool(fl), missing["liger"]
        ),
        "trl-eager-padded (packed)": status("trl-eager-padded", pk_rows, bool(pk), missing["trl"]),
    }


def results_files(out: Path) -> list[dict]:
    files = []
    for path in sorted(out.glob("bench_*.json")):
        data = load_json(path)
        if not isinstance(data, dict) or "meta" not in data:
            continue
        meta = data["meta"]
        stem = path.with_suffix("")
        files.append(
            {
                "file": path.name,
                "csv": stem.with_suffix(".csv").exists(),
                "png": stem.with_suffix(".png").exists(),
                "device": meta.get("device"),
                "device_name": meta.get("device_name"),
                "torch": meta.get("torch"),
                "triton": meta.get("triton"),
                "git_commit": meta.get("git_commit"),
                "time_utc": meta.get("time_utc"),
            }
        )
    return files


def summarize(args, stages, cuda, gpu, missing, started, since, total_s) -> dict:
    out = Path(args.out)
    summary = {
        "command": " ".join([Path(PY).name, *sys.argv]),
        "mode": "quick (CPU, small shapes)"
        if args.quick
        else "full (CUDA shapes)"
        if cuda
        else "full without CUDA (CPU default shapes)",
        "cuda": gpu,
        "benchmark_device": "cuda" if cuda else "cpu",
        "started_utc": started,
        "total_s": round(total_s, 1),
        "stages": [
            {
                "name": s.name,
                "status": s.status,
                "seconds": round(s.seconds, 1),
                "detail": s.detail,
                "log": f"logs/{s.name}.log" if s.cmd else None,
                "command": " ".join(s.cmd) if s.cmd else None,
                **({"log_tail": s.log_tail} if s.log_tail else {}),
            }
            for s in stages
        ],
        "pytest_gpu": None,
        "compile_check": None,
        "headlines": headlines(out, cuda, since),
        "baselines": baseline_report(out, cuda, missing),
        "hidden_or_missing_packages": {k: v for k, v in missing.items() if v},
        "results_files": results_files(out),
    }
    by_name = {s["name"]: s for s in summary["stages"]}
    counts = pytest_counts(out / "pytest_gpu.xml")
    if counts is not None and by_name["pytest-gpu"]["status"] != "skipped":
        counts["note"] = (
            "no CUDA device: every gpu test skips" if not gpu else "on " + str(_gpu_name())
        )
        if by_name["pytest-gpu"]["detail"].startswith("timed out"):
            counts["note"] += " (cut at the stage's timeout: the counts so far)"
        summary["pytest_gpu"] = counts
        by_name["pytest-gpu"]["detail"] = "; ".join(
            filter(
                None,
                [
                    by_name["pytest-gpu"]["detail"],
                    f"{counts['passed']} passed, {counts['failures'] + counts['errors']} failed, "
                    f"{counts['skipped']} skipped" + ("" if gpu else " (no CUDA device)"),
                ],
            )
        )
    cc = load_json(out / "compile_check.json")
    if isinstance(cc, dict) and "ok" in cc and by_name["compile-check"]["status"] != "skipped":
        summary["compile_check"] = {
            k: cc.get(k)
            for k in ("ok", "unique_configs", "compiles", "cached", "failed", "launcher_calls")
        }
        if not by_name["compile-check"]["detail"]:
            by_name["compile-check"]["detail"] = (
                f"{cc.get('unique_configs')} launch configurations, {cc.get('failed')} failed"
            )
    summary["targets"] = gpu_targets.grade(out, summary["pytest_gpu"])
    return summary


def _commit(c) -> str:
    c = str(c)
    return c[:12] + ("-dirty" if c.endswith("-dirty") else "")


def _gpu_name() -> str | None:
    try:
        import torch

        return torch.cuda.get_device_name(0)
    except Exception:  # pragma: no cover
        return None


def markdown(summary: dict) -> str:
    lines = [
        "# run_all summary",
        "",
        f"`{summary['command']}`: {summary['mode']}, started {summary['started_utc']}, "
        f"{summary['total_s']:.0f} s in all.",
        "",
        *(
            [f"Merged from the runs in {', '.join(summary['merged_from'])}.", ""]
            if summary.get("merged_from")
            else []
        ),
        *(
            [f"Skipped (no summary.json): {', '.join(summary['merge_skipped'])}.", ""]
            if summary.get("merge_skipped")
            else []
        ),
        "| stage | status | seconds | detail |",
        "|---|---|---|---|",
    ]
    for s in summary["stages"]:
        lines.append(f"| {s['name']} | {s['status']} | {s['seconds']:.1f} | {s['detail']} |")
    pt = summary["pytest_gpu"]
    lines += ["", "## pytest -m gpu", ""]
    lines.append(
        "no junit XML (the stage did not run or failed before writing it)"
        if pt is None
        else f"{pt['passed']} passed, {pt['failures']} failed, {pt['errors']} errors, "
        f"{pt['skipped']} skipped ({pt['note']})."
    )
    cc = summary["compile_check"]
    lines += ["", "## Kernel compile check (sm_80, sm_90a)", ""]
    lines.append(
        "no result"
        if cc is None
        else f"{'ok' if cc['ok'] else 'FAILED'}: {cc['unique_configs']} launch configurations "
        f"from {cc['launcher_calls']} launcher calls, {cc['compiles']} compiles "
        f"({cc['cached']} from the cache), {cc['failed']} failed."
    )
    lines += [
        "",
        "## Headline ratios (read from the results files)",
        "",
        *(
            [
                "Quick mode: tiny shapes on the CPU, where per-call overhead dominates; these "
                "ratios check the plumbing, not the speed.",
                "",
            ]
            if summary["mode"].startswith("quick")
            else []
        ),
        "| benchmark | case | ratio | value | % of HBM roofline | from |",
        "|---|---|---|---|---|---|",
    ]
    for h in summary["headlines"]:
        old = "" if h["this_run"] else " (an earlier run: its stage did not rewrite it)"
        lines.append(
            f"| {h['bench']} | {h['case']} | {h['what']} | {_f(h['value'])} | {h['roofline']} | "
            f"{h['file']}{old} |"
        )
    if not summary["headlines"]:
        lines.append("| (no results files) | | | | | |")
    graded = summary.get("targets") or []
    lines += ["", "## Issue 22's targets (graded from the *_cuda.json files)", ""]
    if any(t["verdict"] != "not measured" for t in graded):
        lines += gpu_targets.markdown(graded)
    else:
        lines.append("No CUDA results (or no pytest -m gpu on a GPU): nothing to grade.")
    lines += ["", "## Baselines", "", "| baseline | status |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in summary["baselines"].items()]
    lines += [
        "",
        "## Results files",
        "",
        "| file | CSV | PNG | device | torch | triton | commit | time (UTC) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for f in summary["results_files"]:
        lines.append(
            f"| {f['file']} | {'yes' if f['csv'] else 'no'} | {'yes' if f['png'] else 'no'} | "
            f"{f['device_name']} ({f['device']}) | {f['torch']} | {f['triton']} | "
            f"{_commit(f['git_commit'])} | {f['time_utc']} |"
        )
    failed = [s for s in summary["stages"] if s.get("log_tail")]
    if failed:
        lines += ["", "## Failed stages: last lines of their logs"]
        for s in failed:
            lines += ["", f"`{s['log']}`:", "", "```", s["log_tail"], "```"]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="run_all.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        required=True,
        help="folder for every results file, the logs (<out>/logs/), pytest_gpu.xml, "
        "compile_check.json, summary.json and summary.md (passed as --out to each benchmark; "
        "use benchmarks/results to refresh the committed results)",
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke run: the benchmarks' --quick modes / small shapes, fp32, a tiny TRL "
        "step; pytest -m gpu and the compile check as they are (about 3 minutes on 2 cores)",
    )
    p.add_argument(
        "--readme",
        action="store_true",
        help="last stage: rewrite the README's benchmark tables from <out> (report.py --readme "
        "--results <out>; the train / learning blocks only where <out> has their files). The "
        "bench block then shows only <out>'s results files, so use --out benchmarks/results",
    )
    p.add_argument(
        "--readme-path",
        default=str(ROOT / "README.md"),
        help="the README --readme rewrites (default the repository's README.md)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        metavar="PKG",
        help="hide an optional package as if it were not installed (repeat or comma list): "
        + "; ".join(f"{k}: {v[1]}" for k, v in BASELINES.items())
        + ". A package importlib.util.find_spec cannot find is skipped the same way",
    )
    p.add_argument(
        "--stages",
        default="",
        help="comma list of the stages to run (default all): " + ",".join(STAGES),
    )
    p.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the whole run's time (e.g. a device call's limit, less what ran before): each "
        f"stage's timeout is cut so that it ends, its {GRACE_S} s SIGINT grace included, "
        f"{DEADLINE_MARGIN_S} s before the deadline, and a stage with no time left is not "
        "started, so the run's own stage timeouts (which keep the rows measured) fire before "
        "an outer `timeout` kills it. Default: none. A SIGTERM / SIGINT to run_all is "
        "forwarded to the running stage as SIGINT either way (the stage keeps its rows), then "
        "the summary is written",
    )
    p.add_argument(
        "--merge",
        nargs="+",
        default=None,
        metavar="DIR",
        help="run nothing: merge the --out folders of earlier run_all calls (a GPU session's "
        "calls, split by --stages to fit the time of one call) into --out: their results "
        "files, pytest_gpu.xml, compile_check.json and logs are copied, and one summary.json / "
        "summary.md covers the stages of all of them (a stage that ran in a later DIR "
        "replaces the same stage of an earlier one); with --readme the README tables are then "
        "rebuilt from --out",
    )
    p.add_argument(
        "--timeout",
        action="append",
        default=[],
        metavar="STAGE=SECONDS",
        help="override a stage's timeout (repeatable); defaults, full / quick: "
        + ", ".join(f"{k} {a} / {b} s" for k, (a, b) in TIMEOUTS.items())
        + ". A stage past its timeout is killed and reported as failed; 0 fails it at once",
    )
    return p


def merge(args) -> int:
    """--merge DIR...: the runs of several calls as one (see --help); exit status 0 when no
    merged stage failed."""
    out = Path(args.out).resolve()
    args.out = str(out)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    parts, skipped = [], []
    for d in map(Path, args.merge):
        summary = load_json(d / "summary.json")
        if not isinstance(summary, dict) or "stages" not in summary:
            # (run_all writes one before its first stage: a folder without one never ran it)
            print(f"--merge: warning: {d} holds no summary.json of run_all; skipped",
                  file=sys.stderr)  # fmt: skip
            skipped.append(str(d))
            continue
        parts.append((d.resolve(), summary))
    if not parts:
        raise SystemExit(f"--merge: none of {args.merge} holds a summary.json of run_all")
    stages: dict[str, dict] = {}
    merged = {"pytest_gpu": None, "compile_check": None}
    hidden: dict[str, str | None] = dict.fromkeys(BASELINES)
    for d, summary in parts:
        if d != out:  # copy2 keeps the mtimes: a file counts as written by the run it came from
            for f in [*d.iterdir(), *(d / "logs").glob("*.log")]:
                if f.is_file() and f.name not in ("summary.json", "summary.md"):
                    shutil.copy2(f, out / f.relative_to(d))
        ran = {st["name"] for st in summary["stages"] if st["status"] != "skipped"}
        for st in summary["stages"]:
            if st["name"] in ran or st["name"] not in stages:
                stages[st["name"]] = {**st, "from": str(d)}
        for key, stage in (("pytest_gpu", "pytest-gpu"), ("compile_check", "compile-check")):
            if stage in ran:  # its counts come with the stage
                merged[key] = summary.get(key)
        hidden.update(summary.get("hidden_or_missing_packages") or {})
    if args.readme:
        readme = Stage("readme", cmd=readme_cmd(args))
        run_stage(readme, TIMEOUTS["readme"][0], out / "logs")
        stages["readme"] = dict(
            name="readme",
            status=readme.status,
            detail=readme.detail,
            seconds=round(readme.seconds, 1),
            log="logs/readme.log",
        )
    cuda = any(summary.get("benchmark_device") == "cuda" for _, summary in parts)
    starts = [summary["started_utc"] for _, summary in parts]
    since = min(calendar.timegm(time.strptime(t, "%Y-%m-%dT%H:%M:%SZ")) for t in starts)
    summary = {
        "command": " ".join([Path(PY).name, *sys.argv]),
        "mode": " + ".join(dict.fromkeys(summary["mode"] for _, summary in parts)),
        "cuda": next((summary["cuda"] for _, summary in parts if summary.get("cuda")), False),
        "benchmark_device": "cuda" if cuda else "cpu",
        "started_utc": min(starts),
        "total_s": round(sum(summary["total_s"] for _, summary in parts), 1),
        "merged_from": [str(d) for d, _ in parts],
        **({"merge_skipped": skipped} if skipped else {}),
        "stages": sorted(stages.values(), key=lambda st: STAGES.index(st["name"])),
        **merged,
        "headlines": headlines(out, cuda, since),
        "baselines": baseline_report(out, cuda, hidden),
        "hidden_or_missing_packages": {k: v for k, v in hidden.items() if v},
        "results_files": results_files(out),
    }
    summary["targets"] = gpu_targets.grade(out, summary["pytest_gpu"])
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    (out / "summary.md").write_text(markdown(summary))
    failed = [st["name"] for st in summary["stages"] if st["status"] == "failed"]
    which = ": " + ", ".join(failed) if failed else ""
    print(
        f"run_all --merge: {len(parts)} runs, {len(failed)} failed stage(s){which}; "
        f"{out / 'summary.md'}",
        file=sys.stderr,
    )
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.merge:
        return merge(args)
    skip = {x for item in args.skip for x in item.split(",") if x}
    unknown = skip - set(BASELINES)
    if unknown:
        raise SystemExit(f"--skip: unknown {sorted(unknown)}; choose from {list(BASELINES)}")
    timeouts = {k: float(v[1] if args.quick else v[0]) for k, v in TIMEOUTS.items()}
    for item in args.timeout:
        name, _, secs = item.partition("=")
        if name not in TIMEOUTS or not secs:
            raise SystemExit(f"--timeout: expected STAGE=SECONDS with STAGE in {list(STAGES)}")
        timeouts[name] = float(secs)
    bad = set(filter(None, args.stages.split(","))) - set(STAGES)
    if bad:
        raise SystemExit(f"--stages: unknown {sorted(bad)}; choose from {list(STAGES)}")

    out = Path(args.out).resolve()
    args.out = str(out)
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    gpu = has_cuda()
    cuda = gpu and not args.quick  # --quick runs the benchmarks on the CPU even with a GPU
    missing = available(skip)
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    t0, wall0 = time.perf_counter(), time.time()
    _say(
        f"run_all: {'quick (CPU)' if args.quick else 'full, CUDA' if cuda else 'full, no CUDA'}"
        f" -> {out}"
    )
    for name, why in missing.items():
        if why:
            _say(f"  {name}: {why}; skipping {BASELINES[name][1]}")
    stages = plan(args, cuda, missing)
    n = len(stages)

    def write_summary() -> dict:
        """summary.json / .md of the stages so far: written after every stage, so that a run
        killed from outside (a device call's own time limit) leaves one that --merge reads."""
        total = time.perf_counter() - t0
        summary = summarize(args, stages, cuda, gpu, missing, started, wall0, total)
        (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        (out / "summary.md").write_text(markdown(summary))
        return summary

    for s in stages:
        if s.cmd is not None:  # until it runs: skipped, for --merge and the summary
            s.detail = "not reached: the run stopped before this stage"
    # a summary before the first stage: a call killed inside it still leaves one for --merge
    write_summary()
    _RUNNING.update(proc=None, signal=None, at=None)
    handlers = {sig: signal.signal(sig, _forward_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for i, s in enumerate(stages, 1):
            tag = f"[{i}/{n}] {s.name:14s}"
            if _RUNNING["signal"] is not None:
                break
            if s.cmd is None:
                _say(f"{tag} skipped ({s.why_skipped})")
                continue
            timeout = timeouts[s.name]
            if args.deadline is not None:  # the run's own stage timeouts fire before its end
                left = args.deadline - (time.perf_counter() - t0) - GRACE_S - DEADLINE_MARGIN_S
                if left < 1:
                    s.detail = f"not reached: --deadline {args.deadline:g} s left no time for it"
                    _say(f"{tag} {s.detail}")
                    continue
                timeout = min(timeout, int(left * 10) / 10)  # (whole tenths: the log)
            if s.name == "readme":  # its blocks depend on what the run wrote
                s.cmd = readme_cmd(args)
            _say(f"{tag} running (timeout {timeout:g} s, log {logs / s.name}.log) ...")
            s.detail = ""
            run_stage(s, timeout, logs)
            _say(
                f"{tag} {s.status} in {s.seconds:.1f} s{': ' + s.detail if s.detail else ''}"
                f"  [{time.perf_counter() - t0:.0f} s elapsed]"
            )
            write_summary()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    summary = write_summary()
    failed = [s.name for s in stages if s.status == "failed"]
    _say(
        f"run_all: {len(failed)} failed stage(s){': ' + ', '.join(failed) if failed else ''}; "
        f"{out / 'summary.md'} ({summary['total_s']:.0f} s)"
    )
    if _RUNNING["signal"] is not None:
        return 128 + int(_RUNNING["signal"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
