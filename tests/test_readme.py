"""The README's promises: its usage example runs, and CI runs the README's test command."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_usage_example_runs(tmp_path):
    (code,) = _blocks("python")
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    loss = float(proc.stdout.split()[0])
    assert loss == loss  # a number, not NaN


def test_ci_runs_the_readme_test_command():
    train_cmd, test_cmd = (b.strip() for b in _blocks("bash")[:2])
    assert train_cmd.endswith("fastrl train")
    ci = (ROOT / ".ci" / "run").read_text()
    pytest_cmd = test_cmd.split("&&")[-1].strip()
    assert pytest_cmd.startswith("pytest")
    assert pytest_cmd in ci.splitlines(), f"{pytest_cmd!r} is not a line of .ci/run"
    for step in test_cmd.split("&&")[:-1]:
        assert step.strip() in ci, f"{step.strip()!r} missing from .ci/run"
