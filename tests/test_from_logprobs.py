"""fastrl.policy_loss_from_logprobs: the policy loss from per-token log-probs someone already has
equals policy_loss on the logits those log-probs came from (value, metrics, per-token outputs and
the gradient through the log-probs), for every preset, flat and (B, T), with fractional masks."""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import reference as R
from fastrl.config import PRESETS


def _batch(B=3, T=6, V=13, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    old = R.token_logprobs(logits, tokens)[0] + 0.2 * torch.randn(B, T, generator=g)
    ref = old + 0.1 * torch.randn(B, T, generator=g)
    mask = torch.tensor([[1.0, 0.5, 1.0, 0.0, 1.0, 0.25]]).expand(B, T).clone()
    return logits, tokens, adv, old, ref, mask


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_equals_policy_loss(preset):
    logits, tokens, adv, old, ref, mask = _batch()
    kw = dict(config=preset, kl_coef=0.05, entropy_coef=0.01)
    z1 = logits.clone().requires_grad_()
    expected = fastrl.policy_loss(z1, tokens, adv, old, ref, mask, **kw)
    (g1,) = torch.autograd.grad(expected.loss, z1)
    z2 = logits.clone().requires_grad_()
    logp, ent = R.token_logprobs(z2, tokens)  # a trainer's own forward
    out = fastrl.policy_loss_from_logprobs(logp, ent, adv, old, ref, mask, **kw)
    (g2,) = torch.autograd.grad(out.loss, z2)
    torch.testing.assert_close(out.loss, expected.loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g2, g1, rtol=1e-4, atol=1e-6)
    for name in ("logp", "entropy", "kl", "ratio"):
        torch.testing.assert_close(getattr(out, name), getattr(expected, name))
    assert out.metrics.keys() == expected.metrics.keys()
    for k in out.metrics:
        torch.testing.assert_close(out.metrics[k], expected.metrics[k], rtol=1e-5, atol=1e-6)


def test_flat_and_without_entropy():
    logits, tokens, adv, old, _, mask = _batch(B=1)
    logp = R.token_logprobs(logits[0], tokens[0])[0].requires_grad_()
    out = fastrl.policy_loss_from_logprobs(logp, None, adv.expand(6), old[0], mask=mask[0],
                                           config="dapo")  # fmt: skip
    expected = fastrl.policy_loss(logits[0], tokens[0], adv.expand(6), old[0], mask=mask[0],
                                  config="dapo")  # fmt: skip
    torch.testing.assert_close(out.loss, expected.loss)
    assert out.logp.shape == (6,) and out.metrics["entropy"] == 0
    out.loss.backward()
    assert logp.grad.shape == (6,)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_the_per_token_ratio_is_spec_1(level):
    # token: r_t = exp(logp_t - old_t); sequence (GSPO): exp of the masked mean log-ratio of the
    # sequence, the same value on each of its tokens
    logits, tokens, adv, old, _, mask = _batch()
    out = fastrl.policy_loss(logits, tokens, adv, old, mask=mask, ratio_level=level)
    log_ratio = out.logp - old
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True)
        log_ratio = log_ratio.expand_as(mask)
    torch.testing.assert_close(out.ratio, torch.where(mask > 0, log_ratio.exp(), 1.0))
    assert not out.ratio.requires_grad


def test_bad_inputs_name_the_argument():
    logp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="logp must be"):
        fastrl.policy_loss_from_logprobs(torch.zeros(2, 3, dtype=torch.long), None, torch.ones(2))
    with pytest.raises(ValueError, match="entropy must be"):
        fastrl.policy_loss_from_logprobs(logp, torch.zeros(3), torch.ones(2))
    with pytest.raises(ValueError, match="entropy_coef=0.1 needs the per-token entropy"):
        fastrl.policy_loss_from_logprobs(logp, None, torch.ones(2), entropy_coef=0.1)
    with pytest.raises(ValueError, match="advantages"):
        fastrl.policy_loss_from_logprobs(logp, None, torch.ones(5))


@pytest.mark.parametrize("bad", [float("nan"), float("-inf"), float("inf")])
@pytest.mark.parametrize(
    "cfg",
    [
        dict(config="grpo", kl_coef=0.1),  # k3: exp(ref - logp)
        dict(config="cispo"),  # the product r * A * logp
        dict(config="ppo", kl_coef=0.1, kl_bias_correction=True),
        dict(config="gspo", kl_coef=0.1, entropy_coef=0.01),
    ],
)
def test_a_masked_non_finite_logp_reaches_neither_loss_nor_gradient(cfg, bad):
    """README: a NaN or inf log-prob (or entropy) at a masked token changes neither the loss nor
    its gradient. A -inf logp at padding (a pad id masked out of the vocabulary) used to give a
    NaN dloss/dlogp there (torch.where's zero gradient times exp's inf), which the caller's
    backward carries into the whole weight gradient. The per-token outputs are the caller's
    values at counted tokens and 0 at masked ones, as the fused losses report them."""
    logits, tokens, adv, old, ref, mask = _batch()
    clean = [t.requires_grad_() for t in R.token_logprobs(logits, tokens)]
    want = fastrl.policy_loss_from_logprobs(*clean, adv, old, ref, mask, **cfg)
    want.loss.backward()
    lp, ent = (t.detach().clone() for t in clean)
    lp[mask == 0] = bad
    ent[mask == 0] = bad
    lp.requires_grad_(), ent.requires_grad_()
    out = fastrl.policy_loss_from_logprobs(lp, ent, adv, old, ref, mask, **cfg)
    out.loss.backward()
    torch.testing.assert_close(out.loss, want.loss)
    torch.testing.assert_close(lp.grad, clean[0].grad)
    assert not lp.grad[mask == 0].any()
    if "entropy_coef" in cfg:
        torch.testing.assert_close(ent.grad, clean[1].grad)
        assert not ent.grad[mask == 0].any()
    counted = mask > 0
    torch.testing.assert_close(out.logp, torch.where(counted, lp.detach(), 0.0))
    torch.testing.assert_close(out.entropy, torch.where(counted, ent.detach(), 0.0))
    torch.testing.assert_close(out.kl, want.kl)
    assert not out.kl[~counted].any()
