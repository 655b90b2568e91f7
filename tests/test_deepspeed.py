"""The TRL drop-in's LM head under DeepSpeed ZeRO-3, for real: a single-process ZeRO-3 run on
the CPU (tests/zero3_head.py) of TRL's own fused head and of fastrl's, compared. Needs
deepspeed (not in the test extra: an sdist built on install; `.ci/run` installs it, and this
module is skipped where it is missing)."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("deepspeed")
pytest.importorskip("trl")

HERE = os.path.dirname(__file__)


def run_head(head: str, tmp_path, port: int) -> dict:
    out = tmp_path / f"{head}.pt"
    env = dict(os.environ, DS_ACCELERATOR="cpu", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "zero3_head.py"), head, str(out), "3"],
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out)


def test_trl_head_under_zero3_equals_trls_own(tmp_path):
    """ZeRO-3 partitions lm_head.weight to numel 0 outside a gather, and a fused head reads it
    directly: the drop-in head gathers it for the forward and again in its backward, as TRL's
    does (`maybe_gather_lm_head_ctx`). Log-probs, entropies and the gradients of the head and
    the embeddings equal TRL's, at the third step (ZeRO-3 fetches in the order its first step
    traced). DeepSpeed 0.19.8 also gathers a parameter read inside the engine's eager forward,
    so the head without the explicit gather passed this run too (that getter gathers nothing
    under torch.compile; the explicit gather does not depend on it)."""
    ours = run_head("fastrl", tmp_path, 29531)
    stock = run_head("trl", tmp_path, 29532)
    for key in ("log_probs", "entropy", "loss", "d_lm_head", "d_embed"):
        torch.testing.assert_close(ours[key], stock[key], rtol=1e-5, atol=1e-5, msg=key)
    assert ours["d_lm_head"].abs().sum() > 0
