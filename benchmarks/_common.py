"""Shared helpers of the benchmarks: device info, timing, peak memory, results files.

Stable API (other benchmarks import it):
    device_info(device)              -> dict: device name, torch / triton versions, git commit
    time_fn(fn, warmup, rep, device) -> dict(median, q20, q80) in milliseconds
    peak_memory(fn, device)          -> dict(bytes, method): peak extra memory of one call
    write_results(name, rows, meta)  -> paths of <name>.json and <name>.csv in benchmarks/results/
    plot_bars(path, rows, ...)       -> bar charts of time and memory per method (PNG)
    plot_cases(path, rows, ...)      -> one row of horizontal bar charts per case (shape, dtype),
                                        error bars from each row's q20 / q80 (PNG)
    cpu_malloc_env() / ensure_cpu_malloc_env() -> env / re-exec for CPU peak-memory runs
    cpu_rates(numel)                 -> dict: measured copy bandwidth (GB/s) and exp rate (1/s)
    progress(total, desc, disable)   -> a tqdm bar on stderr (a no-op stand-in without tqdm)

Timing: on CUDA triton.testing.do_bench (warmup / rep in ms, quantiles 0.5 / 0.2 / 0.8); on CPU
a time.perf_counter loop of `rep` calls after `warmup` calls.

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
PEAK_BANDWIDTH_GBS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0}  # HBM peak, GB/s


def git_commit() -> str:
    """HEAD, with "-dirty" when the code differs from it (results files do not count)."""
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", ":/", ":(top,exclude)benchmarks/results"],
            capture_output=True,
            text=True,
            timeout=10,
            cwd=Path(__file__).resolve().parent,
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
    peak = next((v for k, v in PEAK_BANDWIDTH_GBS.items() if k in name), None)
    return {
        "device": str(device),
        "device_name": name,
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "git_commit": git_commit(),
        "peak_bandwidth_GBs": peak,
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


def time_fn(fn, warmup: int = 1, rep: int = 5, device: str | torch.device = "cpu") -> dict:
    """Median and 20 / 80 % quantiles of fn()'s wall time in ms.

    CUDA: triton.testing.do_bench(fn, warmup=warmup, rep=rep) (both in ms there).
    CPU: `warmup` calls, then `rep` timed calls."""
    if torch.device(device).type == "cuda":
        from triton.testing import do_bench

        med, q20, q80 = do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5, 0.2, 0.8])
        return {"median": med, "q20": q20, "q80": q80}
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return {
        "median": statistics.median(times),
        "q20": _quantile(times, 0.2),
        "q80": _quantile(times, 0.8),
    }


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
    base = _proc_status("VmRSS:")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
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


def memory_in_child(script: str | Path, argv: list[str]) -> dict:
    """Run `script argv --memory-only` in a child process with `cpu_malloc_env()` and return the
    JSON object its last stdout line holds ({method: peak_memory(...)} by convention)."""
    cmd = [sys.executable, str(script), *argv, "--memory-only"]
    res = subprocess.run(cmd, env=cpu_malloc_env(), capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"memory child failed:\n{res.stderr[-3000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


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


def plot_bars(
    path: Path | str, rows: list[dict], label: str, panels: list[tuple[str, str]], title: str = ""
) -> str:
    """One bar chart per (key, axis label) in `panels`, bars labelled by row[label]. PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4))
    axes = [axes] if len(panels) == 1 else axes
    names = [str(r[label]) for r in rows]
    for ax, (key, ylabel) in zip(axes, panels):
        vals = [r.get(key) or 0 for r in rows]
        bars = ax.bar(names, vals, color=["C0", "C1", "C2", "C3", "C4"][: len(rows)])
        ax.bar_label(bars, fmt="%.0f")
        ax.set_ylabel(ylabel)
        ax.tick_params(axis="x", rotation=15)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return str(path)


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
