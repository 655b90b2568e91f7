"""fp16 and a loss scale (torch.amp.GradScaler): the fused losses' gradients as eager fp16 code's.

In fp16 the small entries of dL/dz (p_j g / tau with a global token count: ~1e-8 and below) lie
under fp16's smallest subnormal (6e-8) unless the loss is scaled first. A gradient formed in the
forward and stored in fp16 was flushed to 0 before any scale reached it (91 % of the entries
here, the scale changing nothing); the fused losses now leave the fp16 gradient to the backward,
where the upstream gradient carries the scale. Checked on both CPU engines (the chunked torch
path and the Triton kernels in the interpreter) and on the LM-head loss, in fp16 and under
torch.autocast(float16) over fp32 weights.
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import reference as R

SCALE = 65536.0
CFG = dict(config="ppo", entropy_coef=0.01, num_tokens=16384)  # a global count: tiny g


@pytest.fixture
def device(engine):
    return engine[0]


def _unscaled_grads(loss_fn, leaves, scale):
    """d(scale * loss)/d leaves, divided by the scale, in fp32."""
    leaves = [t.clone().requires_grad_() for t in leaves]
    (loss_fn(*leaves) * scale).backward()
    return [t.grad.float() / scale for t in leaves]


def _errors(got, want):
    return [float((a - b).norm() / b.norm()) for a, b in zip(got, want)]


def test_policy_loss_gradient_takes_the_loss_scale(device):
    B, T, V = 2, 8, 512
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(B, T, V, generator=g) * 2).to(device)
    y = torch.randint(0, V, (B, T), generator=g).to(device)
    adv = torch.randn(B, generator=g).to(device)

    def loss(f):  # (on-policy: old_logp = logp, so that no ratio sits at a clip bound)
        return lambda x: f(x, y, adv, **CFG).loss

    (want,) = _unscaled_grads(loss(R.policy_loss), [z], 1.0)  # fp32: the truth
    (eager,) = _unscaled_grads(loss(R.policy_loss), [z.half()], SCALE)
    (mine,) = _unscaled_grads(loss(fastrl.policy_loss), [z.half()], SCALE)
    (unscaled,) = _unscaled_grads(loss(fastrl.policy_loss), [z.half()], 1.0)
    (e_eager,), (e_mine,), (e_unscaled,) = (_errors([t], [want]) for t in (eager, mine, unscaled))
    assert e_eager < 1e-3  # what the scale buys eager fp16 code
    assert e_mine <= 1.5 * e_eager, f"fastrl {e_mine:.2e} against eager fp16's {e_eager:.2e}"
    assert e_unscaled > 10 * e_mine  # (the case is one where the scale matters)
    assert (mine == 0).float().mean() <= (eager == 0).float().mean() + 0.01


@pytest.mark.parametrize("autocast", [False, True], ids=["fp16", "autocast"])
def test_fused_linear_gradients_take_the_loss_scale(autocast):
    B, T, H, V = 2, 16, 32, 1024
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.3
    y = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)

    def eager(h, w, **kw):
        return R.policy_loss(h @ w.T, y, adv, **kw)

    def loss(f, cast):
        def run(h, w):
            if cast:
                with torch.autocast("cpu", dtype=torch.float16):
                    return f(h, w, **CFG).loss
            return f(h, w, **CFG).loss

        return run

    leaves16 = [hidden, weight] if autocast else [hidden.half(), weight.half()]
    want = _unscaled_grads(loss(eager, False), [hidden, weight], 1.0)
    fused = lambda h, w, **kw: fastrl.fused_linear_policy_loss(h, w, y, adv, **kw)  # noqa: E731
    eager16 = _unscaled_grads(loss(eager, autocast), [hidden.half(), weight.half()], SCALE)
    mine = _unscaled_grads(loss(fused, autocast), leaves16, SCALE)
    unscaled = _unscaled_grads(loss(fused, autocast), leaves16, 1.0)
    for name, e_mine, e_eager, e_unscaled in zip(
        ("d hidden", "d weight"), _errors(mine, want), _errors(eager16, want),
        _errors(unscaled, want),
    ):  # fmt: skip
        assert e_mine <= 1.5 * e_eager + 1e-4, f"{name}: {e_mine:.2e}, eager fp16 {e_eager:.2e}"
        assert e_unscaled > 5 * e_mine, f"{name}: the scale changed nothing"
