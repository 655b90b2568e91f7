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
