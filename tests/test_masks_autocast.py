"""Fractional masks and torch.autocast on every op and backend.

* A float mask m >= 0 is a per-token weight (README): the loss is sum m L / ..., so its
  gradient w.r.t. token t's logits carries m_t once. A path that applies the mask twice gives
  m_t^2: right loss value, wrong gradient. 0/1 masks cannot see that (1^2 = 1), so every mask
  here has entries strictly between 0 and 1.
* Inside `torch.autocast` (how most trainers run) the LM-head ops behave like `F.linear`: an
  fp32 weight and hidden are used in the autocast dtype, the gradients come back in the leaves'
  fp32, and nothing raises a dtype error. The logits ops take the logits as they are.
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import reference as R
from fastrl.config import PRESETS

FRACTIONAL = torch.tensor([[1.0, 0.5, 1.0, 0.25, 0.0, 0.75, 1.0]])  # (1, 7)


def _batch(B=3, T=7, V=11, H=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, T, generator=g)
    old = R.token_logprobs(logits, tokens)[0] + 0.2 * torch.randn(B, T, generator=g)
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    roll = old + 0.1 * torch.randn(B, T, generator=g)
    mask = FRACTIONAL.expand(B, T).clone()
    mask[1] = torch.tensor([0.3, 1.0, 0.0, 0.9, 0.6, 0.1, 1.0])
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    return logits, tokens, adv, old, ref, roll, mask, hidden, weight


def _overrides(preset):
    level = "sequence" if preset == "gspo" else "token"
    return {"kl_coef": 0.05, "entropy_coef": 0.01, "rollout_is": level}


@pytest.mark.parametrize("preset", sorted(PRESETS))
@pytest.mark.parametrize("inplace", [False, True])
def test_policy_loss_fractional_mask_gradient(engine, preset, inplace):
    device, _ = engine
    logits, tokens, adv, old, ref, roll, mask, *_ = (t.to(device) for t in _batch())
    kw = dict(config=preset, **_overrides(preset))
    leaf = logits.clone().requires_grad_()
    z = leaf * 1.0  # in place needs logits an op produced (like an lm_head's output)
    out = fastrl.policy_loss(z, tokens, adv, old, ref, mask, roll, inplace=inplace, **kw)
    (grad,) = torch.autograd.grad(out.loss, leaf)
    z_ref = logits.clone().requires_grad_()
    expected = R.policy_loss(z_ref, tokens, adv, old, ref, mask, roll, **kw)
    (grad_ref,) = torch.autograd.grad(expected.loss, z_ref)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-4, atol=1e-6)


def test_fractional_mask_reproducer_from_the_issue():
    """The issue's reproducer: row 1 (m = 0.5) of the dapo gradient equals the oracle's."""
    torch.manual_seed(0)
    z = torch.randn(1, 4, 11)
    y = torch.randint(0, 11, (1, 4))
    m = torch.tensor([[1.0, 0.5, 1.0, 1.0]])
    a = torch.randn(1, 4)
    grads = []
    for loss_fn in (fastrl.policy_loss, R.policy_loss):
        zz = z.clone().requires_grad_()
        (gz,) = torch.autograd.grad(loss_fn(zz, y, a, mask=m, config="dapo").loss, zz)
        grads.append(gz)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def _materialised(hidden, weight):
    hf, wf = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    return hf, wf, hf @ wf.T


@pytest.mark.parametrize("preset", ["dapo", "grpo", "gspo", "dr_grpo"])
def test_fused_linear_fractional_mask_gradient(engine, preset):
    device, _ = engine
    _, tokens, adv, old, ref, roll, mask, hidden, weight = (t.to(device) for t in _batch())
    kw = dict(config=preset, **_overrides(preset))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = fastrl.fused_linear_policy_loss(h, w, tokens, adv, old, ref, mask, roll, chunk_size=4,
                                          **kw)  # fmt: skip
    dh, dw = torch.autograd.grad(out.loss, (h, w))
    hf, wf, z = _materialised(hidden, weight)
    expected = R.policy_loss(z, tokens, adv, old, ref, mask, roll, **kw)
    dh_ref, dw_ref = torch.autograd.grad(expected.loss, (hf, wf))
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dh, dh_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(dw, dw_ref, rtol=1e-4, atol=1e-6)


def test_value_loss_fractional_mask_gradient():
    g = torch.Generator().manual_seed(1)
    v, old, ret = (torch.randn(3, 7, generator=g) for _ in range(3))
    mask = FRACTIONAL.expand(3, 7)
    for fn in (fastrl.value_loss, R.value_loss):
        vv = v.clone().requires_grad_()
        loss = fn(vv, old, ret, mask)[0]
        (gv,) = torch.autograd.grad(loss, vv)
        if fn is fastrl.value_loss:
            got = (loss, gv)
        else:
            torch.testing.assert_close(got[0], loss)
            torch.testing.assert_close(got[1], gv)


# --------------------------------------------------------------------------- autocast
AUTOCAST = torch.bfloat16


def _bf16_reference_lm_head(hidden, weight, tokens):
    """What F.linear under autocast computes: the GEMM of bf16-rounded inputs (fp32 math here)."""
    hb = hidden.to(AUTOCAST).float().requires_grad_()
    wb = weight.to(AUTOCAST).float().requires_grad_()
    return hb, wb, hb @ wb.T


def test_linear_logprobs_under_autocast(engine):
    device, _ = engine
    _, tokens, *_, hidden, weight = (t.to(device) for t in _batch())
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast(device, dtype=AUTOCAST):
        logp, ent = fastrl.linear_logprobs(h, w, tokens, entropy=True, chunk_size=4)
        (logp.sum() + 0.1 * ent.sum()).backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    hb, wb, z = _bf16_reference_lm_head(hidden, weight, tokens)
    lp_ref, ent_ref = R.token_logprobs(z, tokens)
    (lp_ref.sum() + 0.1 * ent_ref.sum()).backward()
    torch.testing.assert_close(logp, lp_ref, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(h.grad, hb.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(w.grad, wb.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("preset", ["dapo", "gspo"])
def test_fused_linear_policy_loss_under_autocast(engine, preset):
    device, _ = engine
    _, tokens, adv, old, ref, roll, mask, hidden, weight = (t.to(device) for t in _batch())
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    with torch.autocast(device, dtype=AUTOCAST):
        out = fastrl.fused_linear_policy_loss(h, w, tokens, adv, old, None, mask, config=preset,
                                              chunk_size=4)  # fmt: skip
        out.loss.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    hb, wb, z = _bf16_reference_lm_head(hidden, weight, tokens)
    expected = R.policy_loss(z, tokens, adv, old, None, mask, config=preset)
    expected.loss.backward()
    torch.testing.assert_close(out.loss, expected.loss, rtol=3e-2, atol=3e-2)
    torch.testing.assert_close(h.grad, hb.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(w.grad, wb.grad, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logits_ops_under_autocast(engine, dtype):
    """policy_loss, logprobs, value_loss, sample take their inputs as they are inside
    autocast: same numbers as outside it."""
    device, _ = engine
    logits, tokens, adv, old, ref, roll, mask, *_ = (t.to(device) for t in _batch())
    logits = logits.to(dtype)

    def run():
        z = logits.clone().requires_grad_()
        out = fastrl.policy_loss(z, tokens, adv, old, ref, mask, roll, config="grpo",
                                 rollout_is="token")  # fmt: skip
        (gz,) = torch.autograd.grad(out.loss, z)
        zl = logits.clone().requires_grad_()
        lp, ent = fastrl.logprobs(zl, tokens, entropy=True)
        (gl,) = torch.autograd.grad(lp.sum() + ent.sum(), zl)
        v = adv.clone().requires_grad_()
        vl, _ = fastrl.value_loss(v, old, ref, mask)
        (gv,) = torch.autograd.grad(vl, v)
        gen = torch.Generator(device=device).manual_seed(0)
        sampled = fastrl.sample(logits.reshape(-1, logits.shape[-1]), generator=gen)
        return (out.loss, gz, lp, ent, gl, vl, gv, *sampled)

    plain = run()
    with torch.autocast(device, dtype=AUTOCAST):
        cast = run()
    for a, b in zip(plain, cast):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b)


# --------------------------------------------------------------------------- create_graph
def test_double_backward_is_refused_clearly():
    """create_graph=True needs a derivative of the fused backward, which does not exist: a clear
    error, never a missing (policy_loss: silently zero) second-order term."""
    g = torch.Generator().manual_seed(0)
    h = torch.randn(4, 8, generator=g, requires_grad=True)
    w = torch.randn(11, 8, generator=g, requires_grad=True)
    y = torch.randint(0, 11, (4,), generator=g)
    z = torch.randn(4, 11, generator=g, requires_grad=True)
    losses = {
        "linear_logprobs": lambda: fastrl.linear_logprobs(h, w, y).sum(),
        "fused_linear_policy_loss": lambda: (
            fastrl.fused_linear_policy_loss(h, w, y, torch.randn(4, generator=g)).loss
        ),
        "policy_loss": lambda: fastrl.policy_loss(z * 1, y, torch.randn(4, generator=g)).loss,
        "logprobs": lambda: fastrl.logprobs(z * 1, y).sum(),
    }
    for name, loss_fn in losses.items():
        with pytest.raises(RuntimeError, match="create_graph=True.*not supported"):
            torch.autograd.grad(loss_fn(), [h, w] if "linear" in name else [z], create_graph=True)
        loss_fn().backward()  # a plain backward still works
