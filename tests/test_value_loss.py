"""value_loss (SPEC 8) against the reference, by hand, and on bad input."""

import math

import pytest
import torch

import fastrl
from fastrl import reference as ref
from fastrl.config import AGGS
from fastrl.value import value_loss

# dtype of the inputs -> tolerance of (loss, grad) against the fp32 reference on the same values
TOL = {torch.float32: dict(atol=1e-6, rtol=1e-6), torch.bfloat16: dict(atol=1e-2, rtol=1e-2)}


def _inputs(B=4, T=9, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    values = torch.randn(B, T, generator=g).to(dtype).requires_grad_()
    old_values = values.detach() + 0.3 * torch.randn(B, T, generator=g).to(dtype)
    returns = torch.randn(B, T, generator=g).to(dtype)
    mask = torch.rand(B, T, generator=g) > 0.3
    return values, old_values, returns, mask


def test_value_loss_numpy_max_len():
    np = pytest.importorskip("numpy")
    values, old_values, returns, mask = _inputs()
    agg = "seq-mean-token-sum-norm"
    got = value_loss(values, old_values, returns, mask, 0.2, agg, max_len=np.int64(12))
    want = value_loss(values, old_values, returns, mask, 0.2, agg, max_len=12)
    torch.testing.assert_close(got, want, rtol=0, atol=0)


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
        (dict(mask=torch.full((4, 9), 2, dtype=torch.long)), "mask"),  # int masks are 0/1
        (dict(mask=torch.full((4, 9), -1.0)), "mask"),  # a negative weight
        (dict(mask=torch.full((4, 9), math.nan)), "mask"),
        (dict(values=torch.zeros(2, 2, 9)), "values"),
        (dict(clip=-0.1), "clip"),
        (dict(clip=1e300), "clip"),  # inf in fp32: the clamp could not convert it
        (dict(num_tokens=1e39), "num_tokens"),
        (dict(agg="mean"), "agg"),
        (dict(agg="seq-mean-token-sum-norm", max_len=2.0), "max_len"),
    ],
)
def test_value_loss_bad_input(kwargs, match):
    values, old_values, returns, mask = _inputs()
    args = dict(values=values, old_values=old_values, returns=returns, mask=mask)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        value_loss(**args)


@pytest.mark.parametrize("agg", AGGS)
def test_value_loss_flat_takes_the_token_aggregations(agg):
    """Flat (N,) values: token-mean and token-sum as on one (1, N) row; the seq-mean-* ones need
    sequences and say so."""
    values, old_values, returns, mask = _inputs()
    flat = [t.detach().reshape(-1) for t in (values, old_values, returns, mask)]
    if agg.startswith("seq-mean"):
        with pytest.raises(ValueError, match=f"agg='{agg}' needs sequences"):
            value_loss(*flat, agg=agg)
        return
    got = value_loss(*flat, agg=agg)
    want = ref.value_loss(*[t[None] for t in flat], 0.2, agg)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-6)


def test_global_token_count():
    # a global count twice the local one halves the token-mean (data-parallel normaliser)
    v, v_old, ret = torch.randn(2, 5), torch.randn(2, 5), torch.randn(2, 5)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32)
    local, _ = value_loss(v, v_old, ret, mask)
    scaled, _ = value_loss(v, v_old, ret, mask, num_tokens=torch.tensor(10.0))
    torch.testing.assert_close(scaled, local / 2)


# --------------------------------------------------------------------------- nothing silently wrong
@pytest.mark.parametrize("name", ["num_tokens", "num_seqs"])
@pytest.mark.parametrize("count", [-6.0, 0, 0.0, -1, math.nan, math.inf, True, "6"])
def test_value_loss_python_count_must_be_a_positive_number(name, count):
    """A Python count <= 0 / NaN / inf (or not a number) raises, naming the argument (it used to
    divide by 1, or flip the loss's sign)."""
    values, old_values, returns, mask = _inputs()
    agg = "token-mean" if name == "num_tokens" else "seq-mean-token-sum"
    with pytest.raises(ValueError, match=name):
        value_loss(values, old_values, returns, mask, agg=agg, **{name: count})


@pytest.mark.parametrize("name", ["num_tokens", "num_seqs"])
@pytest.mark.parametrize("count", [-6.0, 0.0, math.nan, math.inf, -math.inf])
def test_value_loss_bad_tensor_count_gives_nan(name, count):
    """A tensor count is not read on the host: one that is not a finite number > 0 gives a NaN
    loss, never a finite wrong one (an inf count used to give a finite 0)."""
    values, old_values, returns, mask = _inputs()
    agg = "token-mean" if name == "num_tokens" else "seq-mean-token-mean"
    loss, _ = value_loss(values, old_values, returns, mask, agg=agg, **{name: torch.tensor(count)})
    assert torch.isnan(loss)
    good, _ = value_loss(values, old_values, returns, mask, agg=agg, **{name: torch.tensor(6.0)})
    assert torch.isfinite(good)


@pytest.mark.parametrize("name", ["num_tokens", "num_seqs"])
def test_value_loss_count_on_meta_is_a_clear_error(name):
    values, old_values, returns, mask = _inputs()
    count = torch.tensor(3.0, device="meta")
    with pytest.raises(ValueError, match=f"{name}.*meta"):
        value_loss(values, old_values, returns, mask, **{name: count})
    with pytest.raises(ValueError, match=name):
        value_loss(values, old_values, returns, mask, **{name: torch.ones(2)})


@pytest.mark.parametrize("agg", AGGS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_value_loss_masked_nonfinite_never_reaches_loss_or_grad(agg, bad):
    """NaN / inf at masked tokens of values, old_values or returns change neither the loss, the
    clip fraction nor the gradient (which is exactly 0 there); x * mask would give NaN."""
    values, old_values, returns, mask = _inputs()
    expected, expected_frac = value_loss(values, old_values, returns, mask, agg=agg)
    (expected_grad,) = torch.autograd.grad(expected, values)
    poisoned = [x.detach().clone() for x in (values, old_values, returns)]
    for x in poisoned:
        x[~mask] = bad
    v = poisoned[0].requires_grad_()
    loss, frac = value_loss(v, poisoned[1], poisoned[2], mask, agg=agg)
    torch.testing.assert_close(loss, expected)
    torch.testing.assert_close(frac, expected_frac)
    (grad,) = torch.autograd.grad(loss, v)
    torch.testing.assert_close(grad, expected_grad)
    assert torch.all(grad[~mask] == 0)


def test_old_values_and_returns_are_constants():
    """SPEC 8 differentiates L_V w.r.t. v only: v_old and G are constants (detached), also when
    they require grad (old values kept from the critic's own graph, returns formed from it).
    Hand-computed: token 0 is clipped (v_clip = v_old + 0.2 = 0.2, (0.2 - 2)^2 = 3.24 wins), so
    its gradient w.r.t. v is 0; token 1 is not, d/dv 0.5 * (v - G)^2 / 2 = (0 - 1) / 2. A
    gradient through the clamp would reach v_old at token 0 ((0.2 - 2) / 2 = -0.9)."""
    values = torch.tensor([[1.0, 0.0]], requires_grad=True)
    old_values = torch.tensor([[0.0, 0.0]], requires_grad=True)
    returns = torch.tensor([[2.0, 1.0]], requires_grad=True)
    loss, _ = value_loss(values, old_values, returns, clip=0.2)
    torch.testing.assert_close(loss, torch.tensor(0.5 * (3.24 + 1.0) / 2))
    loss.backward()
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, -0.5]]))
    assert old_values.grad is None and returns.grad is None


def test_an_infinite_mask_weight_is_refused_everywhere():
    """A mask weight of +inf (or past fp32's range) made every result NaN: value_loss, whiten,
    gae and reinforce++'s token whitening took it as a weight >= 0. Now a ValueError naming the
    mask, as for a NaN or negative weight."""
    v = torch.randn(2, 3)
    for bad in (float("inf"), 1e39):
        m = torch.ones(2, 3, dtype=torch.float64)
        m[0, 1] = bad
        with pytest.raises(ValueError, match="mask must hold finite values"):
            fastrl.value_loss(v, v + 0.1, v + 1, m.float() if bad == float("inf") else m)
        with pytest.raises(ValueError, match="mask must hold finite values"):
            fastrl.whiten(v, m)
        with pytest.raises(ValueError, match="mask must hold finite values"):
            fastrl.gae(v, v, m, 0.9, 0.9)
        with pytest.raises(ValueError, match="mask must hold finite values"):
            fastrl.group_advantages(torch.tensor([1.0, 0.0]), group_size=2,
                                    estimator="reinforce++", mask=m)  # fmt: skip
