"""value_loss (SPEC 8) against the reference, by hand, and on bad input."""

import pytest
import torch

import fastrl
from fastrl import reference as ref
from fastrl.value import value_loss

AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
# dtype of the inputs -> tolerance of (loss, grad) against the fp32 reference on the same values
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _inputs(B=4, T=9, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g).to(dtype).requires_grad_()
    old_values = values.detach() + 0.3 * torch.randn(B, T, generator=g).to(dtype)
    returns = torch.randn(B, T, generator=g).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.3
    return values, old_values, returns, mask


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("clip", [0.2, 0.0, None, 5.0])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_value_loss_matches_reference(agg, clip, dtype):
    values, old_values, returns, mask = _inputs(dtype=dtype)
    loss, clipfrac = value_loss(values, old_values, returns, mask, clip, agg)
    values32 = values.detach().float().requires_grad_()
    ref_loss, ref_clipfrac = ref.value_loss(
        values32, old_values.float(), returns.float(), mask, clip, agg
    )
    torch.testing.assert_close(loss, ref_loss, atol=1e-6, rtol=1e-6)  # fp32 math on both sides
    torch.testing.assert_close(clipfrac, ref_clipfrac)
    (grad,) = torch.autograd.grad(loss, values)
    (ref_grad,) = torch.autograd.grad(ref_loss, values32)
    assert grad.dtype == dtype
    torch.testing.assert_close(grad.float(), ref_grad, **TOL[dtype])
    assert loss.dtype == clipfrac.dtype == torch.float32 and not clipfrac.requires_grad
    if clip is None or clip >= 5.0:
        assert clipfrac == 0


def test_value_loss_hand_computed():
    values = torch.tensor([[1.0, 0.0, 2.0]])
    old_values = torch.tensor([[0.0, 0.0, 2.0]])
    returns = torch.tensor([[2.0, 1.0, 2.0]])
    # token 0: v - G = -1 -> 1; v_clip = 0.2, (0.2 - 2)^2 = 3.24 wins (clipped); token 1: 1 each
    # token 2: 0. token-mean: 0.5 * (3.24 + 1 + 0) / 3
    loss, clipfrac = value_loss(values, old_values, returns, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.5 * 4.24 / 3))
    torch.testing.assert_close(clipfrac, torch.tensor(1 / 3))
    loss, _ = value_loss(values, old_values, returns, torch.tensor([[True, False, True]]), 0.2)
    torch.testing.assert_close(loss, torch.tensor(0.5 * 3.24 / 2))
    assert fastrl.value_loss is not None


def test_value_loss_flat_and_empty_mask():
    values, old_values, returns, mask = _inputs()
    flat = [x.reshape(-1) for x in (values, old_values, returns, mask)]
    loss, clipfrac = value_loss(*flat)
    ref_loss, ref_clipfrac = ref.value_loss(*flat)
    torch.testing.assert_close(loss, ref_loss)
    torch.testing.assert_close(clipfrac, ref_clipfrac)
    loss, clipfrac = value_loss(values, old_values, returns, torch.zeros_like(mask))
    assert loss == 0 and clipfrac == 0
    loss.backward()
    assert torch.isfinite(values.grad).all()


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(old_values=torch.zeros(4, 8)), "old_values"),
        (dict(returns=torch.zeros(36)), "returns"),
        (dict(mask=torch.ones(4, 8)), "mask"),
        (dict(mask=torch.ones(4, 9, dtype=torch.long)), "mask"),
        (dict(values=torch.zeros(2, 2, 9)), "values"),
        (dict(clip=-0.1), "clip"),
        (dict(agg="mean"), "agg"),
    ],
)
def test_value_loss_bad_input(kwargs, match):
    values, old_values, returns, mask = _inputs()
    args = dict(values=values, old_values=old_values, returns=returns, mask=mask)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        value_loss(**args)


def test_value_loss_flat_needs_token_mean():
    values, old_values, returns, _ = _inputs()
    with pytest.raises(ValueError, match="agg"):
        value_loss(values.reshape(-1), old_values.reshape(-1), returns.reshape(-1), agg=AGGS[1])


def test_global_token_count():
    # a global count twice the local one halves the token-mean (data-parallel normaliser)
    v, v_old, ret = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    local, _ = value_loss(v, v_old, ret, mask)
    scaled, _ = value_loss(v, v_old, ret, mask, num_tokens=torch.tensor(10.0))
    torch.testing.assert_close(scaled, local / 2)
