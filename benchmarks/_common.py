"""Shared helpers of the benchmarks: device info, timing, peak memory, results files.

Stable API (other benchmarks import it):
    device_info(device)              -> dict: device name, torch / triton versions, git commit,
                                        the baselines' package versions (`packages`)
    time_fn(fn, warmup, rep, device, prepare=None)
                                     -> dict(median, q20, q80 in ms, n_samples: timed calls)
    quantiles(times)                 -> the same dict of a list of times
    peak_memory(fn, device)          -> dict(bytes, method): peak extra memory of one call
    write_results(name, rows, meta)  -> paths of <name>.json and <name>.csv in benchmarks/results/
    plot_bars(path, rows, ...)       -> bar charts of time and memory per method (PNG)
    plot_cases(path, rows, ...)      -> one row of horizontal bar charts per case (shape, dtype),
                                        error bars from each row's q20 / q80 (PNG)
    cpu_malloc_env() / ensure_cpu_malloc_env() -> env / re-exec for CPU peak-memory runs
    memory_in_child / case_memory   -> {method: peak memory} from a --memory-only child process
    cpu_rates(numel)                 -> dict: measured copy bandwidth (GB/s) and exp rate (1/s)
    progress(total, desc, disable)   -> a tqdm bar on stderr (a no-op stand-in without tqdm)

Command line and results flow (what every bench_*.py script shares):
    bench_parser / add_reps / add_run_args / add_out_arg -> the shared options, same help
    parse_bench_args / fill_reps / parse_dtypes / choose_shapes -> what those options resolve to
    save_results(name, rows, meta, args, plot) -> results files (+ PNG unless --no-plot)
    save_cases(name, rows, meta, args, case_of, panels, title) -> the same with a plot_cases PNG
    measure_peaks / time_rows / save_bars -> the flow of the one-op benchmarks (gae, sample)

Timing: on CUDA `cuda_calls`, triton.testing.do_bench's method (warmup / rep in ms, CUDA events
around each call, the L2 cache flushed before each by zeroing a 256 MB buffer) with at least
MIN_CUDA_CALLS (10) timed calls however long a call takes (do_bench alone times one call of a
row slower than rep), and with an optional untimed `prepare()` before each call (the in-place
rows: a fresh buffer per call), so every row of every benchmark is timed the same way; on CPU a
time.perf_counter loop of `rep` calls after `warmup` calls. Every timing records its number of
timed calls (n_samples): the q20-q80 of a few calls is no spread.

Units: memory in MiB (2**20 bytes; the results' `*_MB` keys hold MiB), traffic and bandwidth in
GB (1e9 bytes).

Peak memory: on CUDA torch.cuda.max_memory_allocated() during the call minus the allocation
before it. On CPU torch has no allocator statistics, so it is the process's resident-set
high-water mark (Linux VmHWM, reset through /proc/self/clear_refs right before the call) minus
the resident set before the call. This is a real measurement of the whole process, not an
estimate; it is exact for big tensors when glibc returns freed blocks to the OS at once, which
`ensure_cpu_malloc_env()` arranges (MALLOC_MMAP_THRESHOLD_=65536: every tensor above 64 KiB is
its own mmap). Small allocations and code pages add a few MB of noise. Measure CPU memory in
a separate process from CPU timing (that malloc setting slows big allocations down).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# HBM peak, GB/s, by the full name torch.cuda.get_device_name reports (the H100 and A100 come in
# variants of different bandwidth: PCIe 2.0 TB/s, NVL 3.9 TB/s, A100 40GB 1.56 TB/s); a name not
# listed gets no peak and so no % of roofline (device_info says why), never a guess
PEAK_BANDWIDTH_GBS = {
    "NVIDIA H200": 4800.0,  # SXM, 141 GB HBM3e
    "NVIDIA H200 NVL": 4800.0,
    "NVIDIA H100 80GB HBM3": 3350.0,  # SXM5
    "NVIDIA H100 PCIe": 2000.0,
    "NVIDIA H100 NVL": 3900.0,
    "NVIDIA A100-SXM4-80GB": 2039.0,
    "NVIDIA A100 80GB PCIe": 1935.0,
    "NVIDIA A100-SXM4-40GB": 1555.0,
    "NVIDIA A100-PCIE-40GB": 1555.0,
}
MIN_CUDA_CALLS = 10  # timed calls per CUDA timing at least (cuda_calls)
# the packages whose versions a results file records (importlib.metadata distribution names):
# the library, the baselines the benchmarks call, and what they run on
PACKAGES = (
    "fastrl", "torch", "triton", "transformers", "trl", "liger-kernel", "verl", "datasets",
)  # fmt: skip


# Paths whose uncommitted edits leave a recording clean: the results files, and prose (Markdown,
# docs/), which no benchmark runs (report.MEASURES names no such path either).
_NOT_CODE = (
    ":(top,exclude)benchmarks/results",
    ":(top,exclude)docs",
    ":(top,glob,exclude)**/*.md",
)


def git_commit(cwd: str | Path | None = None) -> str:
    """HEAD of the checkout at `cwd` (default: this file's), with "-dirty" when the code differs
    from it (edits to results files and prose do not count: _NOT_CODE); where the environment
    sets FASTRL_GIT_COMMIT (a copy of the tree with no .git, e.g. a lent GPU machine:
    benchmarks/gpu_run.sh), that."""
    if os.environ.get("FASTRL_GIT_COMMIT"):
        return os.environ["FASTRL_GIT_COMMIT"]
    cwd = Path(cwd) if cwd is not None else Path(__file__).resolve().parent
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, cwd=cwd
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ":/", *_NOT_CODE],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=cwd,
        )
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:  # pragma: no cover
        return "unknown"


RUN_ENV_VARS = (
    "THP_MEM_ALLOC_ENABLE",
    "OMP_NUM_THREADS",
    "MALLOC_MMAP_THRESHOLD_",
    "FASTRL_BACKEND",
)


def run_env() -> dict:
    """The environment variables that change CPU timings (None = unset), for a results' meta."""
    return {k: os.environ.get(k) for k in RUN_ENV_VARS}


def peak_bandwidth(name: str) -> tuple[float | None, str | None]:
    """(HBM peak GB/s, None) of a device known by its full name (PEAK_BANDWIDTH_GBS), else
    (None, why there is no roofline)."""
    peak = PEAK_BANDWIDTH_GBS.get(name.strip())
    if peak is not None:
        return peak, None
    why = f"no peak bandwidth listed for {name!r} (_common.PEAK_BANDWIDTH_GBS): no % of roofline"
    return None, why


def package_versions(names=PACKAGES) -> dict:
    """{distribution: its installed version, or None where it is not installed}."""
    from importlib import metadata

    out = {}
    for name in names:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def device_info(device: str | torch.device = "cpu") -> dict:
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or platform.machine()
        try:
            for line in open("/proc/cpuinfo"):
                if line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                    break
        except OSError:
            pass
    try:
        import triton

        triton_version = triton.__version__
    except Exception:  # pragma: no cover
        triton_version = None
    peak, no_peak = peak_bandwidth(name) if device.type == "cuda" else (None, None)
    return {
        "device": str(device),
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "peak_bandwidth_GBs": peak,
        **({"peak_bandwidth_note": no_peak} if no_peak else {}),
        "packages": package_versions(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def quantiles(times: list[float]) -> dict:
    """{"median", "q20", "q80"} of a list of times (the form time_fn returns)."""
    return {
        "median": statistics.median(times),
        "q20": _quantile(times, 0.2),
        "q80": _quantile(times, 0.8),
    }


def time_fn(
    fn,
    warmup: int = 1,
    rep: int = 5,
    device: str | torch.device = "cpu",
    prepare=None,
    min_calls: int = MIN_CUDA_CALLS,
) -> dict:
    """Median and 20 / 80 % quantiles of fn()'s time in ms, and n_samples (timed calls).

    With `prepare`, each call is fn(prepare()), prepare() outside the timed region.
    CUDA: cuda_calls(fn, warmup, rep, ...) (both in ms, as for do_bench; at least `min_calls`).
    CPU: `warmup` calls, then `rep` timed calls."""
    if torch.device(device).type == "cuda":
        times = cuda_calls(fn, warmup, rep, CudaClock(device), prepare, min_calls)
    else:
        for _ in range(warmup):
            fn(*_arg(prepare))
        times = []
        for _ in range(rep):
            arg = _arg(prepare)
            t0 = time.perf_counter()
            fn(*arg)
            times.append((time.perf_counter() - t0) * 1e3)
    return {**quantiles(times), "n_samples": len(times)}


def host_profile(fn, calls: int = 20, top: int = 15) -> dict:
    """Where the host's time of fn() goes: cProfile over `calls` calls (after one warm call),
    each function's own (self) time and its cumulative time in microseconds per call, the
    `top` functions by self time, and the host ms per call without and with the profiler (a
    function-call tracer inflates Python-heavy code: read the shares, not the absolute times).
    On a GPU the kernels run asynchronously, so this is the launch path alone: a call whose
    host ms exceed its device ms is bound by what is listed here."""
    import cProfile
    import pstats

    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    plain = (time.perf_counter() - t0) * 1e3 / calls
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    traced = (time.perf_counter() - t0) * 1e3 / calls
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    rows = []
    for (path, line, name), (_, ncalls, self_s, cum_s, _) in stats.items():
        where = name if path == "~" else f"{Path(path).parent.name}/{Path(path).name}:{line}"
        rows.append({"function": name if path == "~" else f"{where} {name}",
                     "calls": ncalls / calls, "self_us": self_s * 1e6 / calls,
                     "cum_us": cum_s * 1e6 / calls})  # fmt: skip
    rows.sort(key=lambda r: -r["self_us"])
    return {"host_ms_per_call": plain, "traced_ms_per_call": traced, "calls": calls,
            "top_self": rows[:top]}  # fmt: skip


def _arg(prepare) -> tuple:
    return () if prepare is None else (prepare(),)


class CudaClock:
    """What cuda_calls times with on CUDA: events on the current stream, a synchronize, and the
    L2 flush of triton.testing.do_bench (zeroing a 256 MB buffer, larger than any L2)."""

    def __init__(self, device):
        self.device = torch.device(device)
        self.cache = torch.empty(int(256e6 // 4), dtype=torch.int, device=self.device)

    def event(self):
        return torch.cuda.Event(enable_timing=True)

    def flush(self) -> None:
        self.cache.zero_()

    def sync(self) -> None:
        torch.cuda.synchronize(self.device)


def cuda_calls(fn, warmup_ms, rep_ms, clock, prepare=None, min_calls=MIN_CUDA_CALLS) -> list:
    """The times (ms) of fn's timed calls, triton.testing.do_bench's method: one call, the
    estimate of a call's time (the mean of up to 5 calls, fewer when they pass rep_ms), then
    max(1, warmup_ms / estimate) untimed calls and max(min_calls, rep_ms / estimate) timed ones,
    each after the L2 flush and between two events, synchronised once at the end. Unlike
    do_bench: at least `min_calls` timed calls (do_bench times a single call of a row slower
    than rep_ms, whose q20 and q80 then equal its median), and with `prepare` each call is
    fn(prepare()), prepare() before the flush and outside the events."""
    fn(*_arg(prepare))
    clock.sync()
    total, n_est = 0.0, 0
    while n_est < 5 and total <= rep_ms:
        arg = _arg(prepare)
        clock.flush()
        start, end = clock.event(), clock.event()
        start.record()
        fn(*arg)
        end.record()
        clock.sync()
        total += start.elapsed_time(end)
        n_est += 1
    estimate = max(total / n_est, 1e-3)
    for _ in range(max(1, int(warmup_ms / estimate))):
        fn(*_arg(prepare))
    events = []
    for _ in range(max(min_calls, int(rep_ms / estimate))):
        arg = _arg(prepare)
        clock.flush()
        start, end = clock.event(), clock.event()
        start.record()
        fn(*arg)
        end.record()
        events.append((start, end))
    clock.sync()
    return [start.elapsed_time(end) for start, end in events]


def _proc_status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{key} not in /proc/self/status")


def peak_memory(fn, device: str | torch.device = "cpu") -> dict:
    """Peak memory of one call of fn() above what was allocated before it, in bytes.

    Returns {"bytes": int, "method": str}; see the module docstring for the methods."""
    device = torch.device(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return {
            "bytes": torch.cuda.max_memory_allocated(device) - base,
            "method": "torch.cuda.max_memory_allocated delta",
        }
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    # read after the reset: VmHWM >= every RSS since, this one included, so the delta is >= 0
    # (read before it, memory freed in between, e.g. by the chunk pool, gave -0.1 MB once)
    base = _proc_status("VmRSS:")
    fn()
    return {
        "bytes": _proc_status("VmHWM:") - base,
        "method": "RSS high-water mark delta (VmHWM after clear_refs; "
        f"MALLOC_MMAP_THRESHOLD_={os.environ.get('MALLOC_MMAP_THRESHOLD_', 'unset')})",
    }


def cpu_malloc_env() -> dict:
    """os.environ plus MALLOC_MMAP_THRESHOLD_=65536: for a child process that measures CPU peak
    memory (freed tensors leave the resident set at once). Not for timing: every big allocation
    then costs fresh page faults."""
    return dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")


def memory_in_child(script: str | Path, argv: list[str], flag: str = "--memory-only") -> dict:
    """Run `script argv flag` in a child process with `cpu_malloc_env()` and return the JSON
    object its last stdout line holds ({method: peak_memory(...)} by convention)."""
    cmd = [sys.executable, str(script), *argv, flag]
    res = subprocess.run(cmd, env=cpu_malloc_env(), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"memory child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def case_memory(bar, label: str, script: str | Path, argv: list[str]) -> dict:
    """memory_in_child(script, argv) for one case of a CPU run: {method: peak memory}, measured
    by a --memory-only child process while the progress bar `bar` says so."""
    bar.set_postfix_str(f"{label}: peak memory (child process)")
    return memory_in_child(Path(script).resolve(), argv)


def ensure_cpu_malloc_env() -> None:
    """Re-exec this process with `cpu_malloc_env()` (Linux) unless MALLOC_MMAP_THRESHOLD_ is set."""
    if sys.platform.startswith("linux") and "MALLOC_MMAP_THRESHOLD_" not in os.environ:
        os.execve(sys.executable, [sys.executable, *sys.argv], cpu_malloc_env())


def write_results(name: str, rows: list[dict], meta: dict, out_dir: Path | None = None) -> dict:
    """Write rows (+ meta) to <out_dir>/<name>.json and <name>.csv. Returns the paths."""
    out_dir = Path(out_dir or RESULTS_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out_dir / f"{name}.json", out_dir / f"{name}.csv"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return {"json": str(json_path), "csv": str(csv_path)}


def _pyplot():
    """matplotlib.pyplot on the non-interactive Agg backend (files only)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_figure(fig, path: Path | str, title: str, dpi: int) -> str:
    """Give `fig` its suptitle (when `title`), save it to `path` as PNG, close it; the path."""
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    _pyplot().close(fig)
    return str(path)


def plot_bars(
    path: Path | str, rows: list[dict], label: str, panels: list[tuple[str, str]], title: str = ""
) -> str:
    """One bar chart per (key, axis label) in `panels`, bars labelled by row[label]. PNG."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    axes = [axes] if len(panels) == 1 else axes
    names = [str(r[label]) for r in rows]
    for ax, (key, ylabel) in zip(axes, panels):
        vals = [r.get(key) or 0 for r in rows]
        bars = ax.bar(names, vals, color=["C0", "C1", "C2", "C3", "C4"][: len(rows)])
        ax.bar_label(bars, fmt="%.0f")
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", rotation=15)
    return _save_figure(fig, path, title, dpi=120)


def _short(v) -> str:
    if v is None:
        return ""
    return f"{v:.0f}" if abs(v) >= 100 else f"{v:.1f}" if abs(v) >= 1 else f"{v:.2g}"


def plot_cases(
    path: Path | str,
    rows: list[dict],
    case_of,
    label: str,
    panels: list[tuple],
    title: str = "",
) -> str:
    """Horizontal bar charts, one figure row per case and one column per panel. PNG.

    case_of(row) -> str groups the rows (e.g. "N=2048 V=32000 fp32"), keeping first-seen order;
    bars are labelled by row[label]. Each panel is (key, axis label) or (key, axis label,
    (lo_key, hi_key)): the latter draws error bars from row[lo_key] to row[hi_key] (e.g. the
    q20 / q80 of a median). Missing values draw no bar."""
    plt = _pyplot()
    cases: dict[str, list[dict]] = {}
    for r in rows:
        cases.setdefault(case_of(r), []).append(r)
    n_methods = max((len(v) for v in cases.values()), default=1)
    height = 0.9 + 0.28 * n_methods
    fig, axes = plt.subplots(
        len(cases),
        len(panels),
        figsize=(5.5 * len(panels), height * len(cases)),
        squeeze=False,
    )
    for i, (case, case_rows) in enumerate(cases.items()):
        names = [str(r[label]) for r in case_rows][::-1]
        for j, panel in enumerate(panels):
            key, axis_label = panel[0], panel[1]
            err_keys = panel[2] if len(panel) > 2 else None
            ax = axes[i][j]
            vals = [r.get(key) for r in case_rows][::-1]
            xs = [v if v is not None else 0.0 for v in vals]
            xerr = None
            if err_keys is not None:
                lo = [r.get(err_keys[0]) for r in case_rows][::-1]
                hi = [r.get(err_keys[1]) for r in case_rows][::-1]
                xerr = [
                    [max(x - (a if a is not None else x), 0.0) for x, a in zip(xs, lo)],
                    [max((b if b is not None else x) - x, 0.0) for x, b in zip(xs, hi)],
                ]
            colors = [f"C{k % 10}" for k in range(len(names))][::-1]
            bars = ax.barh(names, xs, xerr=xerr, color=colors, capsize=3)
            ax.bar_label(bars, labels=[_short(v) for v in vals], padding=3, fontsize=7)
            ax.set_xlabel(axis_label, fontsize=8)
            ax.tick_params(axis="both", labelsize=7)
            ax.set_title(case, fontsize=8)
            ax.margins(x=0.2)
    return _save_figure(fig, path, title, dpi=100)


@contextlib.contextmanager
def busy_processes(k: int):
    """Run the block with `k` other processes each spinning a pure-Python loop (one busy core
    each): the load a shared machine puts on a benchmark. Killed on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(max(0, k))]
    try:
        if procs:
            time.sleep(1.0)  # let them reach their loop
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def cpu_rates(numel: int = 1 << 26, rep: int = 5) -> dict:
    """This CPU's measured floors, with torch's current thread count (medians of `rep` runs):

    copy_GBs      dst.copy_(src) of `numel` fp32 (bytes read + bytes written) / time
    exp_per_s     torch.exp(src, out=dst) on `numel` fp32: elements per second
    The default 2**26 elements (256 MB per tensor) is far larger than the caches."""
    src = torch.randn(numel)
    dst = torch.empty(numel)
    dst.copy_(src)  # page in
    copy = time_fn(lambda: dst.copy_(src), warmup=1, rep=rep)["median"]
    exp = time_fn(lambda: torch.exp(src, out=dst), warmup=1, rep=rep)["median"]
    return {
        "copy_GBs": 2 * numel * 4 / 1e9 / (copy / 1e3),
        "exp_per_s": numel / (exp / 1e3),
        "rates_numel": numel,
        "rates_threads": torch.get_num_threads(),
        "rates_method": "median of perf_counter runs: dst.copy_(src) (2 * 4 bytes / element) "
        "and torch.exp(src, out=dst), fp32",
    }


def add_traffic(rows: list[dict], nbytes: float, peak_GBs: float | None) -> None:
    """Give each row (with median_ms) GBs = nbytes / its median time and pct_bw = GBs against
    `peak_GBs` (the device's peak, or the CPU's measured copy bandwidth; None: no pct_bw)."""
    for row in rows:
        row["GBs"] = round(nbytes / 1e9 / (row["median_ms"] / 1e3), 2)
        row["pct_bw"] = round(100 * row["GBs"] / peak_GBs, 1) if peak_GBs else None


class _NoBar:
    def __init__(self, *a, **k):
        pass

    def update(self, n=1):
        pass

    def set_postfix_str(self, s="", refresh=True):
        pass

    def write(self, s):
        print(s, file=sys.stderr, flush=True)

    def close(self):
        pass


def progress(total: int, desc: str = "", disable: bool = False):
    """A tqdm progress bar on stderr over `total` runs (a silent stand-in without tqdm)."""
    try:
        from tqdm.auto import tqdm
    except ImportError:  # pragma: no cover
        return _NoBar()
    return tqdm(total=total, desc=desc, disable=disable, file=sys.stderr, dynamic_ncols=True)


# ---------------------------------------------------------------------------- command line
# The options and steps every bench_*.py script shares. Each script keeps its own options (shapes,
# methods, ...) and its own help text where the meaning differs; these helpers add the rest.
def bench_parser(
    prog: str, doc: str, device_help: str = "cpu, cuda or auto (cuda when available)"
) -> argparse.ArgumentParser:
    """A parser whose --help shows `doc` (the script's docstring) as written, with --device
    (default auto, see parse_bench_args) as its first option."""
    p = argparse.ArgumentParser(
        prog=prog, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="auto", help=device_help)
    return p


# options that size a benchmark (rows, vocabulary, hidden, repetitions): each must be >= 1
_POSITIVE_OPTIONS = ("B", "T", "V", "N", "H", "S", "rep", "slow_rep", "group_size")


def check_sizes(parser: argparse.ArgumentParser, args) -> None:
    """parser.error (exit 2, naming the option) for a size option below 1, a --warmup below 0
    or a --shapes item that is not positive integers joined by x (0 / -1 would otherwise run
    the default shape or end in a traceback from torch)."""
    for name in _POSITIVE_OPTIONS:
        value = getattr(args, name, None)
        if isinstance(value, int) and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if isinstance(getattr(args, "warmup", None), int) and args.warmup < 0:
        parser.error(f"--warmup must be >= 0, got {args.warmup}")
    for item in (getattr(args, "shapes", None) or "").split(","):
        dims = item.lower().split("x")
        if item and not all(d.isdigit() and int(d) >= 1 for d in dims):
            parser.error(f"--shapes: {item!r} is not sizes >= 1 joined by x (e.g. 16x128x32000)")


def parse_bench_args(parser: argparse.ArgumentParser, argv=None) -> tuple:
    """(the parsed options, the torch.device of --device: "auto" is cuda when available); the
    size options checked (`check_sizes`)."""
    args = parser.parse_args(argv)
    check_sizes(parser, args)
    name = args.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return args, torch.device(name)


def add_reps(p: argparse.ArgumentParser, cpu_warmup: str, cpu_rep: str) -> None:
    """--warmup / --rep, default None (see fill_reps): on the CPU numbers of calls, as the help
    texts `cpu_warmup` / `cpu_rep` say; on CUDA milliseconds for do_bench (25 / 100)."""
    p.add_argument(
        "--warmup", type=int, default=None, help=f"CPU: {cpu_warmup}; CUDA: ms for do_bench (25)"
    )
    p.add_argument(
        "--rep", type=int, default=None, help=f"CPU: {cpu_rep}; CUDA: ms for do_bench (100)"
    )


def fill_reps(args, cuda: bool, cpu_warmup: int, cpu_rep: int) -> None:
    """Set the --warmup / --rep left unset: do_bench's 25 / 100 ms on CUDA, else these calls."""
    if args.warmup is None:
        args.warmup = 25 if cuda else cpu_warmup
    if args.rep is None:
        args.rep = 100 if cuda else cpu_rep


def add_out_arg(p: argparse.ArgumentParser, name: str) -> None:
    """--out: the results folder (default benchmarks/results/), files <name>_<device>.*."""
    p.add_argument(
        "--out",
        default=str(RESULTS_DIR),
        help=f"results folder (default benchmarks/results/); files {name}_<device>.*",
    )


def add_run_args(
    p: argparse.ArgumentParser,
    name: str,
    quick_help: str,
    progress: bool = True,
    memory_only: bool = True,
) -> None:
    """The options that close a benchmark's list: --no-plot, --no-progress (when `progress`),
    --quick (help `quick_help`), --out (add_out_arg) and, when `memory_only`, the hidden
    --memory-only of the child process that measures CPU peak memory (memory_in_child)."""
    p.add_argument("--no-plot", action="store_true", help="write no PNG")
    if progress:
        p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--quick", action="store_true", help=quick_help)
    add_out_arg(p, name)
    if memory_only:
        p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)


def parse_dtypes(text: str) -> list[str]:
    """A --dtype comma list ("fp32,bf16") as names, each checked against DTYPES."""
    dtypes = text.split(",")
    bad = [d for d in dtypes if d not in DTYPES]
    if bad:
        raise SystemExit(f"--dtype: unknown {bad}; choose from {list(DTYPES)}")
    return dtypes


def shapes_text(shapes) -> str:
    """[(16, 128, 32000), (8, 128, 151936)] -> "16x128x32000,8x128x151936" (--shapes syntax)."""
    return ",".join("x".join(map(str, s)) for s in shapes)


def choose_shapes(args, one, cuda: bool, cpu_shapes, cuda_shapes, quick_shapes) -> list[tuple]:
    """The shapes to run: [one] when the single-shape options gave one (else None), else the
    --shapes list ("16x128x32000,..."), else the --quick, CUDA or CPU default list."""
    if one is not None:
        return [one]
    if args.shapes:
        return [tuple(int(x) for x in s.lower().split("x")) for s in args.shapes.split(",") if s]
    return quick_shapes if args.quick else cuda_shapes if cuda else cpu_shapes


# ---------------------------------------------------------------------------- results
TOTAL_MS_PANEL = ("total_ms", "fwd+bwd ms (median, q20-q80)", ("total_ms_q20", "total_ms_q80"))


@contextlib.contextmanager
def keep_rows_on_interrupt(notes: dict, rows: list):
    """Around a benchmark's measuring loop: a KeyboardInterrupt (run_all's stage timeout sends
    SIGINT, then SIGKILL GRACE_S later; a lent GPU call is cut at its limit) ends the loop, not
    the script, so the rows measured so far are still written, with notes["interrupted"] saying
    so. Without this a cut stage lost every row it had timed. Every benchmark run_all stages
    wraps its measuring loop in it (tests/test_benchmarks.py checks them)."""
    try:
        yield
    except KeyboardInterrupt:
        notes["interrupted"] = (
            f"cut short by SIGINT (a stage timeout) after {len(rows)} row(s): the rows missing "
            "from this file were never measured"
        )
        print(notes["interrupted"], file=sys.stderr, flush=True)


def save_results(name: str, rows: list[dict], meta: dict, args, plot=None) -> dict:
    """write_results(name, rows, meta) into --out; then, unless --no-plot or there are no rows,
    plot(<out>/<name>.png) draws the PNG (and returns its path). The paths written."""
    out = Path(args.out)
    paths = write_results(name, rows, meta, out)
    if plot is not None and rows and not args.no_plot:
        paths["png"] = plot(out / f"{name}.png")
    return paths


def save_cases(
    name, rows, meta, args, case_of, panels, title, label="method", plot_rows=None
) -> dict:
    """save_results with a plot_cases PNG of `plot_rows` (default: all rows; none: no PNG): one
    figure row per case_of(row), bars labelled by row[label], titled "<title>; <the machine,
    torch version and commit of meta>" (meta holds device_info's fields)."""
    plot_rows = rows if plot_rows is None else plot_rows
    title = (
        f"{title}; {meta['device_name'][:40]}, torch {meta['torch']}, commit "
        f"{str(meta['git_commit'])[:7]}"
    )
    plot = lambda png: plot_cases(png, plot_rows, case_of, label, panels, title)  # noqa: E731
    return save_results(name, rows, meta, args, plot if plot_rows else None)


# ---------------------------------------------------------------------------- one-op benchmarks
# bench_gae.py and bench_sample.py: a few methods of one call each, timed and measured alike.
def measure_peaks(calls: dict, device, script=None, argv=()) -> tuple[dict, str]:
    """({name: peak extra bytes of one calls[name]()}, how it was measured). On the CPU with a
    `script`: in a child process, `script argv --memory-child` (whose own call, without a
    script, measures inline and prints the dict; see memory_in_child); else inline here."""
    if torch.device(device).type == "cuda":
        how = "CUDA max_memory_allocated delta"
    else:
        how = "RSS high-water mark delta in a child with MALLOC_MMAP_THRESHOLD_=65536"
        if script is not None:
            return memory_in_child(script, list(argv), flag="--memory-child"), how
    return {name: peak_memory(fn, device)["bytes"] for name, fn in calls.items()}, how


def time_rows(
    calls: dict, reps: dict, device, peaks: dict, rows=None, min_calls=None, **shape
) -> list[dict]:
    """One row per call: time_fn with warm-up 25 ms (CUDA) / 1 call (CPU) and reps[name] ms /
    calls (CUDA: at least min_calls.get(name, MIN_CUDA_CALLS) timed calls), then method, the
    `shape` fields, median / q20 / q80 ms (3 decimals), n_samples and peak MiB (key peak_MB) of
    peaks[name] bytes (1 decimal). Each row is appended to `rows` (a list the caller may hold,
    so that keep_rows_on_interrupt keeps the rows done) and printed as it is done."""
    cuda = torch.device(device).type == "cuda"
    rows = [] if rows is None else rows
    for name, fn in calls.items():
        if cuda:
            least = (min_calls or {}).get(name, MIN_CUDA_CALLS)
            t = time_fn(fn, 25, reps[name], "cuda", min_calls=least)
        else:
            t = time_fn(fn, 1, reps[name])
        rows.append(
            {
                "method": name,
                **shape,
                "median_ms": round(t["median"], 3),
                "q20_ms": round(t["q20"], 3),
                "q80_ms": round(t["q80"], 3),
                "n_samples": t["n_samples"],
                "peak_MB": round(peaks[name] / 2**20, 1),
            }
        )
        print(rows[-1], flush=True)
    return rows


def save_bars(name: str, rows: list[dict], meta: dict, out, title: str) -> dict:
    """write_results into `out` and a PNG of median time and peak memory per method; the paths."""
    paths = write_results(name, rows, meta, Path(out))
    panels = [("median_ms", "median time (ms)"), ("peak_MB", "peak memory (MiB)")]
    paths["png"] = plot_bars(Path(out) / f"{name}.png", rows, "method", panels, title=title)
    return paths
