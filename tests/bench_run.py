"""The benchmark scripts' smoke tests run them as users do: `python benchmarks/SCRIPT ARGS` in a
child process from the repository root, with their stdout / stderr captured."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


def load_bench(script: str):
    """benchmarks/`script` imported as a module, for tests that call its functions: once per
    session (registered in sys.modules as bench_<stem>, which its dataclasses need), with
    benchmarks/ on sys.path while it runs its imports (`_common`, `_baselines`)."""
    name = f"bench_{Path(script).stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, BENCH / script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        sys.path.insert(0, str(BENCH))
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        finally:
            sys.path.remove(str(BENCH))
    return sys.modules[name]


def run_bench(
    script: str, *args: str, timeout: int = 600, trace: Path | None = None
) -> subprocess.CompletedProcess:
    """Run benchmarks/`script` with `args`; its completed process (asserting exit status 0,
    with the end of its stderr in the message). With `trace`, the run goes through
    tests/trace_calls.py, which writes there the repository files whose functions it ran."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    runner = [] if trace is None else [str(ROOT / "tests" / "trace_calls.py"), str(trace)]
    res = subprocess.run(
        [sys.executable, *runner, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return res


def assert_measures_cover(key: str, name: str, meta: dict, trace: Path) -> dict[str, list[str]]:
    """Every file of fastrl/ and kernels/ whose functions the traced benchmark run executed
    (`trace`, from run_bench) is one whose change marks the results file `name` (of
    report.MEASURES `key`, recorded with `meta`) stale, or ran only functions that
    report.CALLED_NOT_MEASURED allows; returns the executed {file: functions}. Skips where git
    or the checkout's file list is unavailable."""
    report = load_bench("report.py")
    listed = report._git("ls-files", "--", *report.measured_paths(key, name, meta))
    if not listed:
        pytest.skip("needs a git checkout")
    executed = {
        f: fns for f, fns in json.loads(trace.read_text()).items()
        if f.startswith(("fastrl/", "kernels/"))
    }  # fmt: skip
    assert executed, "the trace recorded no library file: is fastrl imported from this checkout?"
    listed = set(listed.splitlines())
    missing = {
        f: sorted(set(fns) - set(report.CALLED_NOT_MEASURED.get(f, ())))
        for f, fns in executed.items() if f not in listed
    }  # fmt: skip
    missing = {f: fns for f, fns in missing.items() if fns}
    assert not missing, f"{key}: MEASURES misses code the benchmark runs: {missing}"
    return executed
