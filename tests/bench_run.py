"""The benchmark scripts' smoke tests run them as users do: `python benchmarks/SCRIPT ARGS` in a
child process from the repository root, with their stdout / stderr captured."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


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
