"""The README's promises: its code blocks run as written (the usage example, "Use it in TRL",
"Use it in verl", the torchrun lines), and CI runs the README's test command."""

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _section(title: str) -> str:
    """The README text from the `## title` heading to the next `## ` heading."""
    start = README.index(f"## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : None if end < 0 else end]


def _python_block(section: str) -> str:
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    return code


def _run(cmd, tmp_path, timeout=600, env=None):
    proc = subprocess.run(
        cmd, cwd=tmp_path, capture_output=True, text=True, timeout=timeout, env=env
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def test_usage_example_runs(tmp_path):
    proc = _run([sys.executable, "-c", _python_block(_section("Usage"))], tmp_path, timeout=300)
    loss = float(proc.stdout.split()[0])
    assert loss == loss  # a number, not NaN


def test_packed_section_runs(tmp_path):
    proc = _run([sys.executable, "-c", _python_block(_section("Packed (padding-free) batches"))],
                tmp_path, timeout=300)  # fmt: skip
    loss = float(proc.stdout.split()[0])
    assert loss == loss


def test_trl_section_runs(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    code = _python_block(_section("Use it in TRL"))
    assert "from fastrl.integrations.trl import GRPOTrainer" in code
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    _run([sys.executable, "-c", code], tmp_path, env=env)
    assert (tmp_path / "tiny-qwen2" / "config.json").exists()  # the example's own local model


@pytest.mark.skipif(
    importlib.util.find_spec("verl") is None, reason="verl not installed (optional)"
)
def test_verl_section_runs(tmp_path):
    code = _python_block(_section("Use it in verl"))
    assert "fastrl_verl.install()" in code
    proc = _run([sys.executable, "-c", code], tmp_path, timeout=300)
    assert "actor/pg_clipfrac" in proc.stdout


def test_verl_install_line_is_what_ci_runs():
    """The README's verl install line is a line of .ci/run (so CI installs verl as documented)."""
    section = _section("Use it in verl")
    (install,) = [ln for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S)
                  for ln in b.splitlines() if ln.startswith("pip install")]  # fmt: skip
    assert "--no-deps verl==" in install
    assert install in (ROOT / ".ci" / "run").read_text().splitlines()


@pytest.mark.skipif(
    importlib.util.find_spec("verl") is None or importlib.util.find_spec("hydra") is None,
    reason="verl / hydra-core not installed (the verl extra)",
)
def test_verl_main_ppo_line_composes(tmp_path):
    """The README's main_ppo line, with `--cfg job` (compose verl's config, print it, exit): the
    verl extra's install is enough for main_ppo to start, and fastrl's loss mode is accepted."""
    section = _section("Use it in verl")
    line = next(b for b in re.findall(r"```bash\n(.*?)```", section, flags=re.S) if "main_ppo" in b)
    words = line.replace("\\\n", " ").split()
    env_kv, cmd = words[0], [w for w in words[1:] if w != "..."]
    assert env_kv == "VERL_USE_EXTERNAL_MODULES=fastrl.integrations.verl" and cmd[0] == "python"
    key, value = env_kv.split("=", 1)
    env = {**os.environ, key: value}
    proc = _run([sys.executable, *cmd[1:], "--cfg", "job"], tmp_path, timeout=300, env=env)
    assert "loss_mode: fastrl" in proc.stdout


def test_torchrun_lines_run(tmp_path):
    """The README's torchrun lines as written, with a smaller run appended (argparse: the last
    value wins): data parallel on the embedded default, then FSDP2 on its export and a task
    file."""
    lines = [ln for b in _blocks("bash") for ln in b.splitlines() if ln.startswith("torchrun")]
    assert len(lines) == 2 and "--fsdp" in lines[1]
    small = ["--steps", "2", "--sft-steps", "0", "--batch-size", "4", "--group-size", "4",
             "--eval-size", "8", "--max-new-tokens", "4", "--model-hidden", "32",
             "--num-threads", "1", "--progress", "false", "--max-gen-batches", "2"]  # fmt: skip
    (tmp_path / "my_task.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{a}+{a}=", "answer": str(2 * a)}) + "\n" for a in range(20))
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    runner = [sys.executable, "-m", "torch.distributed.run"]
    for line in lines:
        args = line.split()[1:]
        args = [a.replace("step-000100", "step-000002") for a in args]  # --steps 2 above
        proc = _run([*runner, *args, *small], tmp_path, env=env)
        assert "done:" in proc.stdout
    assert (tmp_path / "runs" / "fsdp" / "checkpoints" / "step-000002" / "hf").is_dir()


def test_ci_runs_the_readme_test_command():
    train_cmd, test_cmd = (b.strip() for b in _blocks("bash")[:2])
    assert train_cmd.endswith("fastrl train")
    ci = (ROOT / ".ci" / "run").read_text()
    pytest_cmd = test_cmd.split("&&")[-1].strip()
    assert pytest_cmd.startswith("pytest")
    assert pytest_cmd in ci.splitlines(), f"{pytest_cmd!r} is not a line of .ci/run"
    for step in test_cmd.split("&&")[:-1]:
        assert step.strip() in ci, f"{step.strip()!r} missing from .ci/run"
