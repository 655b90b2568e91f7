"""fastrl.fused_linear_policy_loss against the reference on the materialised logits.

The reference builds logits = hidden @ weight.T + bias in fp32 and differentiates the eager
policy loss; the fused linear path never holds more than `chunk_size` rows of logits.
"""

from __future__ import annotations

import os

import pytest
import torch

import fastrl
from fastrl import reference as R
from fastrl.config import PRESETS

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def make(B=3, T=5, H=8, V=37, dtype=torch.float32, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype).requires_grad_()
    b = (0.1 * torch.randn(V, generator=g)).to(dtype).requires_grad_() if bias else None
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    with torch.no_grad():
        logits = hidden.float() @ weight.float().T + (0 if b is None else b.float())
        logp = R.token_logprobs(logits, tokens)[0]
    old = logp + 0.3 * torch.randn(B, T, generator=g)
    ref = logp + 0.3 * torch.randn(B, T, generator=g)
    mask = torch.rand(B, T, generator=g) > 0.2
    return hidden, weight, b, tokens, adv, old, ref, mask


def compare(batch, dtype=torch.float32, chunk_size=4, **cfg):
    hidden, weight, b, tokens, adv, old, ref, mask = batch
    params = [t for t in (hidden, weight, b) if t is not None]
    out = fastrl.fused_linear_policy_loss(
        hidden, weight, tokens, adv, old, ref, mask, bias=b, chunk_size=chunk_size, **cfg
    )
    grads = torch.autograd.grad(2.0 * out.loss, params)
    hf, wf = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    bf = None if b is None else b.detach().float().requires_grad_()
    logits = hf @ wf.T + (0 if bf is None else bf)
    expected = R.policy_loss(logits, tokens, adv, old, ref, mask, **cfg)
    exp_grads = torch.autograd.grad(2.0 * expected.loss, [t for t in (hf, wf, bf) if t is not None])
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.loss.float(), expected.loss, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.logp, expected.logp, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.entropy, expected.entropy, rtol=rtol, atol=atol)
    torch.testing.assert_close(out.kl, expected.kl, rtol=rtol, atol=atol)
    assert out.metrics.keys() == expected.metrics.keys()
    for k in out.metrics:
        torch.testing.assert_close(out.metrics[k], expected.metrics[k], rtol=rtol, atol=atol)
    for got, want in zip(grads, exp_grads):
        assert got.dtype == dtype
        scale = want.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(got.float() / scale, want / scale, rtol=rtol, atol=atol)


@pytest.mark.parametrize("preset", PRESETS)
def test_presets_match_reference(preset):
    compare(make(), config=preset, entropy_coef=0.01)


@pytest.mark.parametrize("chunk_size", [1, 4, 15, 1000])
def test_chunk_sizes_and_no_bias(chunk_size):
    compare(make(bias=False), chunk_size=chunk_size, config="dapo", temperature=0.7)


def test_bf16():
    compare(make(dtype=torch.bfloat16), dtype=torch.bfloat16, config="grpo")


def test_flat_inputs():
    hidden, weight, b, tokens, adv, old, ref, mask = make(B=1, T=9)
    flat = (hidden[0], weight, b, tokens[0], torch.randn(9), old[0], ref[0], mask[0])
    compare(flat, kl_coef=0.04)


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
def test_triton_kernels_in_the_interpreter(monkeypatch):
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    compare(make(B=2, T=3, V=19), config="grpo", entropy_coef=0.01)


def test_no_grad_and_all_masked():
    hidden, weight, b, tokens, adv, old, ref, mask = make()
    with torch.no_grad():
        out = fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, bias=b)
    assert out.loss.grad_fn is None and torch.isfinite(out.loss)
    out = fastrl.fused_linear_policy_loss(
        hidden,
        weight,
        tokens,
        adv,
        old,
        mask=torch.zeros_like(mask),
        bias=b,
        config="grpo",
        kl_coef=0.0,
    )
    grads = torch.autograd.grad(out.loss, (hidden, weight, b))
    assert out.loss.item() == 0.0
    assert all(torch.all(g == 0) for g in grads)


def test_bad_inputs():
    hidden, weight, b, tokens, adv, *_ = make()
    with pytest.raises(ValueError, match="weight"):
        fastrl.fused_linear_policy_loss(hidden, weight[:, :-1], tokens, adv)
    with pytest.raises(ValueError, match="bias"):
        fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, bias=b[:-1])
    with pytest.raises(ValueError, match="weight"):
        fastrl.fused_linear_policy_loss(hidden, weight.double(), tokens, adv)
    with pytest.raises(ValueError, match="tokens"):
        fastrl.fused_linear_policy_loss(hidden, weight, tokens + weight.shape[0], adv)
    with pytest.raises(ValueError, match="chunk_size"):
        fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, chunk_size=0)
