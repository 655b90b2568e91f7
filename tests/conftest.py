"""Test harness: Triton's interpreter on machines without CUDA, a `gpu` marker, seeded RNGs.

TRITON_INTERPRET must be set before triton is first imported, so it is set here at import time.
"""

import os
import random

try:  # decide without importing torch first: torch may import triton
    import ctypes.util

    _has_cuda_driver = ctypes.util.find_library("cuda") is not None
except Exception:  # pragma: no cover
    _has_cuda_driver = False
if not _has_cuda_driver:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# the devices a test that calls a kernel directly runs on: the interpreter on CPU, CUDA under
# `-m gpu` (a skipif on "interpreter or CUDA" instead kept such tests out of `pytest -m gpu`)
KERNEL_DEVICES = [
    pytest.param(
        "cpu",
        marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1"),
        id="cpu-triton",
    ),
    pytest.param("cuda", marks=pytest.mark.gpu, id="cuda-triton"),
]

# (device, backend) pairs every kernel test runs on: the chunked torch path and the Triton
# kernels in the interpreter on CPU; both on CUDA with `-m gpu`.
ENGINES = [
    pytest.param(("cpu", "torch"), id="cpu-torch"),
    pytest.param(
        ("cpu", "triton"),
        id="cpu-triton",
        marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1"),
    ),
    pytest.param(("cuda", "triton"), id="cuda-triton", marks=pytest.mark.gpu),
    pytest.param(("cuda", "torch"), id="cuda-torch", marks=pytest.mark.gpu),
]


@pytest.fixture(params=ENGINES)
def engine(request, monkeypatch):
    """(device, backend), with FASTRL_BACKEND set for the test."""
    device, backend = request.param
    monkeypatch.setenv("FASTRL_BACKEND", backend)
    return device, backend


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed_everything():
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield


@pytest.fixture
def launched(monkeypatch):
    """Every Triton LaunchConfig launched while the test runs, as (kernel name, grid,
    constexprs, num_warps): what the launchers really ran, against their `*_configs`."""
    from fastrl.kernels import launch

    calls = []
    original = launch.LaunchConfig.__call__

    def spy(self, *args):
        calls.append((self.name, self.grid, self.constexprs, self.num_warps))
        return original(self, *args)

    monkeypatch.setattr(launch.LaunchConfig, "__call__", spy)
    return calls
