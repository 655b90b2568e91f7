"""TRL's `torch_compile=True` (transformers' TrainingArguments: the model is wrapped in
torch.compile) with fastrl's drop-in GRPOTrainer: fastrl's LM-head ops then run inside the
compiled forward (`model(..., fused_lm_head=True)`), and the run trains as stock TRL's."""

import pytest

pytest.importorskip("trl")
pytest.importorskip("datasets")

import trl  # noqa: E402
from test_trl_dropin import (  # noqa: E402, F401
    model_dir,
    relative_update_difference,
    train,
    train_ours,
)


def test_drop_in_under_torch_compile_trains_as_stock_trl(model_dir, tmp_path, monkeypatch):  # noqa: F811
    """Two optimizer steps (GRPO, beta 0.04): stock TRL uncompiled against the drop-in with
    torch_compile=True; measured 2.9e-7 relative update difference on the 2-core CPU (the
    compiled forward rounds a few fp32 sums differently)."""
    cfg = dict(loss_type="grpo", beta=0.04)
    before, stock, stock_logs = train(trl.GRPOTrainer, model_dir, tmp_path / "stock", **cfg)
    # (train_ours: fastrl's head ran, prompt rows masked out, and TRL's never did)
    start, ours, our_logs = train_ours(
        monkeypatch, model_dir, tmp_path / "ours", torch_compile=True, **cfg
    )
    rel = relative_update_difference(before, stock, ours)
    assert rel <= 1e-5, f"relative update difference {rel:.3g}"
    for theirs, mine in zip(stock_logs, our_logs):
        for k in ("loss", "kl", "entropy"):
            if k in theirs:
                assert mine[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), k
