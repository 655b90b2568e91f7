"""SPEC 6: the gradient with respect to the logits, written out, against autograd of the reference.

    dloss/dz_tj = (1/tau) [ g_t (1[j = y_t] - p_j) - h_t p_j (log p_j + H_t) ]

with g_t = dloss/dlogp_t and h_t = dloss/dH_t. g and h are obtained by autograd on per-token leaf
tensors: `reference.token_logprobs` is swapped for one that returns float64 leaves (logp, H), so
that the rest of `reference.policy_loss` (SPEC 1-5) builds the loss on top of them. The formula is
then evaluated in float64 and compared with autograd of the unmodified reference through its
float32 logits (and of the public `fastrl.policy_loss`, whose fused backward writes this formula).
`_inputs.py` accepts fp32/bf16/fp16 logits only and the reference computes in
fp32, so the comparison is at fp32 tolerance (rtol 1e-4, atol 1e-6 on gradients of size ~1e-2).
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import reference
from fastrl.config import PRESETS, LossConfig

B, T, V = 3, 5, 7


def make_inputs(flat: bool = False, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen) * 2
    tokens = torch.randint(0, V, (B, T), generator=gen)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, tokens[..., None]).squeeze(-1)
    # ratios spread around 1 so that some tokens are clipped and some are not
    old = (logp - 0.4 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    ref = (logp + 0.5 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    roll = (old.double() + 0.6 * torch.randn(B, T, generator=gen, dtype=torch.float64)).float()
    adv = torch.randn(B, T, generator=gen)
    mask = (torch.rand(B, T, generator=gen) > 0.25).float()
    mask[0, 0] = 1.0
    x = dict(
        logits=logits, tokens=tokens, advantages=adv, old_logp=old, ref_logp=ref, mask=mask,
        rollout_logp=roll,
    )  # fmt: skip
    if flat:
        x = {k: v.reshape(B * T, V) if k == "logits" else v.reshape(B * T) for k, v in x.items()}
    return x


def spec6_gradient(logits, tokens, config, inputs, monkeypatch):
    """The SPEC 6 formula in float64, with g and h from autograd on per-token leaves."""
    tau = config.temperature
    leaves = {}

    def leaf_token_logprobs(lg, tk, temperature=1.0):
        z = lg.detach().double() / temperature
        log_probs = torch.log_softmax(z, -1)
        logp = log_probs.gather(-1, tk.long()[..., None]).squeeze(-1)
        ent = torch.logsumexp(z, -1) - (log_probs.exp() * z).sum(-1)
        leaves["logp"] = logp.requires_grad_(True)
        leaves["H"] = ent.requires_grad_(True)
        return leaves["logp"], leaves["H"]

    with monkeypatch.context() as m:
        m.setattr(reference, "token_logprobs", leaf_token_logprobs)
        out = reference.policy_loss(**inputs, config=config)
    g, h = torch.autograd.grad(out.loss, [leaves["logp"], leaves["H"]], allow_unused=True)
    g = torch.zeros_like(leaves["logp"]) if g is None else g
    h = torch.zeros_like(leaves["H"]) if h is None else h
    g, h = g.reshape(tokens.shape), h.reshape(tokens.shape)

    z = logits.double() / tau
    log_p = torch.log_softmax(z, -1)  # (..., V)
    p = log_p.exp()
    H = -(p * log_p).sum(-1, keepdim=True)
    onehot = torch.nn.functional.one_hot(tokens.long(), V).double()
    return (g[..., None] * (onehot - p) - h[..., None] * p * (log_p + H)) / tau, out.loss


def autograd_gradient(inputs, config, impl=reference):
    logits = inputs["logits"].clone().requires_grad_(True)
    out = impl.policy_loss(**{**inputs, "logits": logits}, config=config)
    (grad,) = torch.autograd.grad(out.loss, logits)
    return grad, out.loss


def check(config: LossConfig, monkeypatch, flat: bool = False, seed: int = 0):
    inputs = make_inputs(flat, seed)
    if config.rollout_is is None:
        inputs.pop("rollout_logp")
    if config.kl_coef == 0:
        inputs.pop("ref_logp")
    expected, loss64 = spec6_gradient(
        inputs["logits"], inputs["tokens"], config, inputs, monkeypatch
    )
    actual, loss32 = autograd_gradient(inputs, config)
    torch.testing.assert_close(loss32.double(), loss64.double(), rtol=1e-4, atol=1e-6)
    assert expected.abs().max() > 1e-4, "degenerate case: the gradient is ~0"
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-6)
    # masked tokens get no gradient at all
    mask = inputs["mask"].reshape(actual.shape[:-1]) == 0
    assert torch.all(actual[mask] == 0)
    # the public (fused) policy_loss implements the same formula in its backward
    fused, loss_fused = autograd_gradient(inputs, config, fastrl)
    torch.testing.assert_close(loss_fused.double(), loss64.double(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(fused.double(), expected, rtol=1e-4, atol=1e-6)


EXTRA = dict(temperature=0.7, entropy_coef=0.01)


@pytest.mark.parametrize("name", PRESETS)
@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
def test_presets(name, temperature, monkeypatch):
    needs_ref = name == "grpo"
    cfg = LossConfig.preset(name, temperature=temperature, entropy_coef=0.02)
    assert (cfg.kl_coef > 0) == needs_ref
    check(cfg, monkeypatch)


OPTIONS = {
    "dual": dict(clip_dual=2.0),
    "delta": dict(clip_delta=1.5),
    "clip_higher": dict(clip_high=0.28),
    "sapo": dict(policy="sapo", sapo_tau_pos=1.5, sapo_tau_neg=0.8),
    "reinforce": dict(policy="reinforce"),
    "cispo_narrow": dict(policy="cispo"),
    "k1": dict(kl_coef=0.1, kl_estimator="k1"),
    "k2": dict(kl_coef=0.1, kl_estimator="k2"),
    "abs": dict(kl_coef=0.1, kl_estimator="abs"),
    "low_var_kl": dict(kl_coef=0.1, kl_estimator="low_var_kl"),
    "k3_bias": dict(kl_coef=0.1, kl_estimator="k3", kl_bias_correction=True),
    "seq_bias": dict(kl_coef=0.1, ratio_level="sequence", kl_bias_correction=True),
    "is_token": dict(rollout_is="token"),
    "is_seq_mask": dict(rollout_is="sequence", rollout_is_mode="mask", rollout_is_cap=3.0),
    "seq_ratio": dict(ratio_level="sequence", clip_low=0.1, clip_high=0.1),
    "num_tokens": dict(num_tokens=40.0),
    "sum": dict(agg="seq-mean-token-sum", num_seqs=4),
    "sum_norm": dict(agg="seq-mean-token-sum-norm", max_len=9),
    "everything": dict(
        clip_dual=3.0,
        clip_delta=2.0,
        kl_coef=0.05,
        kl_estimator="low_var_kl",
        kl_bias_correction=True,
        rollout_is="token",
        rollout_is_mode="mask",
        agg="seq-mean-token-mean",
    ),  # fmt: skip
}


@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_options(name, monkeypatch):
    check(LossConfig(**{**EXTRA, **OPTIONS[name]}), monkeypatch)


@pytest.mark.parametrize("opts", [dict(), dict(kl_coef=0.1, rollout_is="token")])
def test_flat_inputs(opts, monkeypatch):
    check(LossConfig(**{**EXTRA, **opts}), monkeypatch, flat=True)


def test_entropy_only(monkeypatch):
    # A = 0: only the entropy bonus moves the logits; g = 0, h = -c_H / N
    cfg = LossConfig(entropy_coef=0.5, temperature=1.3)
    inputs = make_inputs()
    inputs.pop("rollout_logp"), inputs.pop("ref_logp")
    inputs["advantages"] = torch.zeros(B, T)
    expected, _ = spec6_gradient(inputs["logits"], inputs["tokens"], cfg, inputs, monkeypatch)
    actual, _ = autograd_gradient(inputs, cfg)
    torch.testing.assert_close(actual.double(), expected, rtol=1e-4, atol=1e-6)
    # and the formula's h part is really non-zero here
    assert expected.abs().max() > 1e-3


def test_the_oracles_gradient_at_a_masked_token_is_zero_where_its_term_overflows():
    # k3's exp(ref - logp) overflows at a masked token whose logp is -100: the term is multiplied
    # by m = 0, so the exact gradient of its row is 0, the oracle's (once 0 * inf = NaN) and
    # fastrl's alike; the counted row's gradient and the loss agree
    logits = torch.tensor([[[0.0, 0.0], [100.0, 0.0]]])  # (1, 2, 2): row 1's token has logp -100
    x = dict(
        tokens=torch.tensor([[0, 1]]),
        advantages=torch.tensor([1.0]),
        ref_logp=torch.tensor([[-0.7, -0.5]]),
        mask=torch.tensor([[1.0, 0.0]]),
        config=LossConfig(kl_coef=0.1, kl_estimator="k3"),
    )
    grads, losses = [], []
    for fn in (reference.policy_loss, fastrl.policy_loss):
        z = logits.clone().requires_grad_(True)
        out = fn(z, **x)
        out.loss.backward()
        grads.append(z.grad)
        losses.append(out.loss.detach())
    assert torch.equal(grads[0][0, 1], torch.zeros(2))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(losses[0], losses[1], rtol=1e-6, atol=0.0)
