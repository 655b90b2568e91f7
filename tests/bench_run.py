"""The benchmark scripts' smoke tests run them as users do: `python benchmarks/SCRIPT ARGS` in a
child process from the repository root, with their stdout / stderr captured."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

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


def run_bench(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run benchmarks/`script` with `args`; its completed process (asserting exit status 0,
    with the end of its stderr in the message)."""
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    res = subprocess.run(
        [sys.executable, str(BENCH / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return res
