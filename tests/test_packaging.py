"""The wheel ships `kernels/` as `fastrl.kernels` and never as a top-level `kernels` package.

The wheel is built from a copy of the working tree (tracked and untracked, non-ignored files) so
that the build leaves no `build/` or `*.egg-info` behind in the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _source_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-co", "--exclude-standard"],
            cwd=ROOT, check=True, capture_output=True, text=True,
        )  # fmt: skip
        return [f for f in out.stdout.splitlines() if (ROOT / f).is_file()]
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout to know the source files")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    src = tmp_path_factory.mktemp("src")
    for f in _source_files():
        (src / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / f, src / f)
    out = tmp_path_factory.mktemp("wheel")
    cmd = [sys.executable, "-m", "pip", "wheel", str(src), "--no-deps", "--no-build-isolation"]
    proc = subprocess.run([*cmd, "-q", "-w", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (whl,) = out.glob("fastrl-*.whl")
    return whl


def test_wheel_layout(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "fastrl/__init__.py" in names
    assert "fastrl/kernels/__init__.py" in names
    assert "fastrl/reference.py" in names and "fastrl/config.py" in names
    # every kernel module of the source tree is in the wheel under fastrl/kernels/
    for py in (ROOT / "kernels").glob("*.py"):
        assert f"fastrl/kernels/{py.name}" in names, py.name
    top_level = {n.split("/")[0] for n in names}
    assert "kernels" not in top_level, sorted(top_level)
    assert all(t == "fastrl" or t.endswith(".dist-info") for t in top_level), sorted(top_level)


def test_wheel_installs_and_imports(wheel, tmp_path):
    # unpack the wheel as a site directory and import from a directory other than the repo root
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    env = {**os.environ, "PYTHONPATH": str(site)}
    code = (
        "import fastrl, fastrl.kernels, importlib.util, sys; "
        f"assert fastrl.__file__.startswith({str(site)!r}), fastrl.__file__; "
        f"assert fastrl.kernels.__file__.startswith({str(site)!r}), fastrl.kernels.__file__; "
        "assert importlib.util.find_spec('kernels') is None or "
        "not importlib.util.find_spec('kernels').origin.startswith(" + repr(str(site)) + "); "
        "print('ok')"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip().endswith("ok")


def test_installed_package_imports_outside_repo(tmp_path):
    # the editable install of this checkout: `import fastrl.kernels` from elsewhere
    code = "import fastrl.kernels, fastrl; print(fastrl.kernels.__name__)"
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == "fastrl.kernels"


def test_wheel_in_fresh_venv_trains(wheel, tmp_path):
    """A non-editable install (the wheel, into a fresh virtual environment) imports every module
    of the source tree and runs `fastrl train --steps 2` from its console script. The venv sees
    the machine's site-packages (torch, transformers: no downloads), but fastrl only from the
    wheel, and runs from a directory outside the checkout."""
    import venv

    env_dir = tmp_path / "venv"
    venv.EnvBuilder(system_site_packages=True, with_pip=False).create(env_dir)
    py = env_dir / "bin" / "python"
    pip = [str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)]
    proc = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modules = sorted(
        ".".join(("fastrl", *p.relative_to(ROOT / "fastrl").with_suffix("").parts))
        for p in (ROOT / "fastrl").rglob("*.py")
    ) + sorted(f"fastrl.kernels.{p.stem}" for p in (ROOT / "kernels").glob("*.py"))
    modules = [m.removesuffix(".__init__") for m in modules]
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    mod = importlib.import_module(m)\n"
        f"    assert mod.__file__.startswith({str(env_dir)!r}), (m, mod.__file__)\n"
        "print('imported', len(sys.argv))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run = lambda cmd: subprocess.run(  # noqa: E731
        cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    proc = run([str(py), "-c", code])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sys.path.insert(0, str(ROOT / "tests"))
    from tiny_run import TINY

    cli = env_dir / "bin" / "fastrl"
    proc = run([str(cli), "train", "--steps", "2", "--out", str(tmp_path / "run"), *TINY])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "done:" in proc.stdout
