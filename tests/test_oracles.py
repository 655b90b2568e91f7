"""Independent oracles for the reference: Liger-Kernel's Triton GRPO loss and TRL's log-prob code.

(a) `liger_kernel.transformers.grpo_loss.triton_grpo_loss` (run by Triton's interpreter on CPU,
    so shapes stay tiny). Its conventions, read from liger_kernel/ops/grpo_loss.py:
    - logits are (B, L+1, V): the last position is dropped; advantages are per sequence (B,);
      `old_logp=None` means on-policy; the KL is TRL's k3 on x = ref - logp, unclamped, times beta.
    - loss_type -> our aggregation: grpo (and sapo) -> seq-mean-token-mean; bnpo -> token-mean
      over the local mask; dr_grpo -> seq-mean-token-sum-norm with L_max = max_completion_length
      (or L); dapo (and cispo) -> token-mean over `num_items_in_batch / world_size` (or the
      local mask sum when not given).
    - ppo term: -min(r~ A, clip(r, 1-eps_low, 1+eps_high) A) with r~ = min(r, delta): the same
      as SPEC 2. CISPO: -sg(min(r, eps_high)) A logp with eps_high the raw upper bound, i.e. our
      clip_low = 1, clip_high = eps_high - 1.
    - reduce=True returns (loss, [kl_mean (when beta != 0), clip_ratio]); clip_ratio is our
      `clipfrac` (A > 0 and r > 1+eps_high, or A < 0 and r < 1-eps_low).
    Conventions that legitimately differ, and are therefore not compared here:
    - Liger does not clamp log r at +-20 (SPEC 1 follows verl): only differs where exp overflows.
    - With importance_sampling_level="sequence" and use_bias_correction_kl, Liger multiplies the
      KL by the sequence ratio (TRL's choice); SPEC 4 uses the token ratio r_t.
    - Liger clamps its dapo/bnpo normaliser at >= 1; SPEC 5 divides by any num_tokens > 0 (only
      a num_tokens in (0, 1) would tell them apart; not tested).
    - Liger has no entropy bonus, dual clip, rollout IS truncation (it takes a precomputed
      vllm_is_ratio) or KL estimator other than k3.
(b) TRL's `selective_log_softmax` and `entropy_from_logits` against `reference.logprobs` /
    `reference.token_logprobs`.
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import reference
from fastrl.config import LossConfig

# the same oracle checks the reference and the public (fused) implementation
IMPLS = {"reference": reference, "fastrl": fastrl}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


B, T, V = 2, 4, 9


def make(seed=0, masked=True):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T + 1, V, generator=gen) * 2  # Liger layout: one extra position
    tokens = torch.randint(0, V, (B, T), generator=gen)
    logp = torch.log_softmax(logits[:, :T] / 0.8, -1).gather(-1, tokens[..., None]).squeeze(-1)
    old = (logp + 0.3 * torch.randn(B, T, generator=gen)).contiguous()
    ref = (logp + 0.5 * torch.randn(B, T, generator=gen)).contiguous()
    adv = torch.tensor([1.3, -0.7])
    mask = torch.ones(B, T)
    if masked == "empty_row":
        mask[1] = 0.0
    elif masked:
        mask[1, -1] = 0.0
        mask[0, 1] = 0.0
    return logits, tokens, old, ref, adv, mask


LOSS_TYPES = {  # Liger loss_type -> our aggregation (and extra options)
    "grpo": dict(agg="seq-mean-token-mean"),
    "bnpo": dict(agg="token-mean"),
    "dr_grpo": dict(agg="seq-mean-token-sum-norm"),
    "dapo": dict(agg="token-mean"),
}

CASES = [
    # (loss_type, importance level, beta, eps_low, eps_high, delta, bias corr., extra liger kwargs)
    ("grpo", "token", 0.04, 0.2, 0.28, None, False, {}),
    ("bnpo", "token", 0.04, 0.2, 0.28, None, False, {}),
    ("dr_grpo", "token", 0.1, 0.2, 0.28, None, False, {}),
    ("dr_grpo", "token", 0.1, 0.2, 0.2, None, False, dict(max_completion_length=7)),
    ("dapo", "token", 0.04, 0.2, 0.28, None, False, {}),
    ("dapo", "token", 0.04, 0.2, 0.28, None, False, dict(num_items_in_batch=11)),
    ("dapo", "token", 0.04, 0.1, 0.15, 1.3, True, {}),
    ("grpo", "token", 0.0, 0.2, 0.28, None, False, {}),
    ("grpo", "sequence", 0.04, 0.05, 0.1, None, False, {}),
    ("dapo", "sequence", 0.04, 0.02, 0.03, 1.05, False, {}),
]


def liger_loss(logits, tokens, old, ref, adv, mask, temperature, **kw):
    grpo_loss = pytest.importorskip("liger_kernel.transformers.grpo_loss")
    logits = logits.clone().requires_grad_(True)
    loss, metrics = grpo_loss.triton_grpo_loss(
        logits, old, ref, tokens, adv, mask.contiguous(), temperature=temperature, inplace=False,
        reduce=True, **kw,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logits)
    return loss, metrics, grad


def ours(impl, logits, tokens, old, ref, adv, mask, cfg):
    logits = logits[:, :T].detach().clone().requires_grad_(True)
    out = impl.policy_loss(logits, tokens, adv, old_logp=old, ref_logp=ref, mask=mask, config=cfg)
    (grad,) = torch.autograd.grad(out.loss, logits)
    return out, grad


@pytest.mark.parametrize(
    "loss_type,level,beta,eps_low,eps_high,delta,bias,extra",
    CASES,
    ids=[f"{c[0]}-{c[1]}-b{c[2]}-d{c[5]}-bc{int(c[6])}-{len(c[7])}" for c in CASES],
)
def test_liger_grpo_loss(impl, loss_type, level, beta, eps_low, eps_high, delta, bias, extra):
    logits, tokens, old, ref, adv, mask = make()
    temperature = 0.8
    loss_l, metrics_l, grad_l = liger_loss(
        logits, tokens, old, ref if beta else None, adv, mask, temperature, beta=beta,
        eps_low=eps_low, eps_high=eps_high, loss_type=loss_type, importance_sampling_level=level,
        delta=delta, use_bias_correction_kl=bias, **extra,
    )  # fmt: skip
    cfg = LossConfig(
        clip_low=eps_low, clip_high=eps_high, clip_delta=delta, ratio_level=level, kl_coef=beta,
        kl_estimator="k3", kl_bias_correction=bias, temperature=temperature,
        max_len=extra.get("max_completion_length"), num_tokens=extra.get("num_items_in_batch"),
        **LOSS_TYPES[loss_type],
    )  # fmt: skip
    out, grad = ours(impl, logits, tokens, old, ref if beta else None, adv, mask, cfg)
    assert out.loss.abs() > 1e-3  # not a trivial case
    if delta is not None:
        assert out.metrics["ratio_max"] > delta  # the two-sided bound bites somewhere
    torch.testing.assert_close(out.loss, loss_l.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_l[:, :T], rtol=1e-4, atol=1e-6)
    assert torch.all(grad_l[:, T] == 0)  # Liger drops the last position
    if beta:
        torch.testing.assert_close(out.metrics["kl"], metrics_l[0].float(), rtol=1e-5, atol=1e-6)
    if level == "token":
        torch.testing.assert_close(out.metrics["clipfrac"], metrics_l[-1].float())


def test_liger_on_policy(impl):
    logits, tokens, _, ref, adv, mask = make(seed=1)
    loss_l, _, grad_l = liger_loss(
        logits, tokens, None, ref, adv, mask, 1.0, beta=0.04, eps_low=0.2, eps_high=0.2,
        loss_type="grpo",
    )  # fmt: skip
    out, grad = ours(impl, logits, tokens, None, ref, adv, mask, LossConfig.grpo())
    torch.testing.assert_close(out.loss, loss_l.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_l[:, :T], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_liger_empty_sequence(impl, loss_type):
    # sequence 1 fully masked: it contributes 0 and still counts in B (grpo, dr_grpo)
    logits, tokens, old, ref, adv, mask = make(seed=3, masked="empty_row")
    loss_l, _, grad_l = liger_loss(
        logits, tokens, old, ref, adv, mask, 1.0, beta=0.04, eps_low=0.2, eps_high=0.28,
        loss_type=loss_type,
    )  # fmt: skip
    cfg = LossConfig(clip_high=0.28, kl_coef=0.04, **LOSS_TYPES[loss_type])
    out, grad = ours(impl, logits, tokens, old, ref, adv, mask, cfg)
    torch.testing.assert_close(out.loss, loss_l.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_l[:, :T], rtol=1e-4, atol=1e-6)
    assert torch.all(grad[1] == 0)


@pytest.mark.parametrize("policy", ["cispo", "sapo"])
def test_liger_cispo_sapo(impl, policy):
    logits, tokens, old, _, adv, mask = make(seed=2)
    if policy == "cispo":
        # Liger's eps_high is the raw cap of r: ours is clip(r, 1 - 1, 1 + 1.5)
        kw = dict(eps_low=0.2, eps_high=2.5, loss_type="cispo")
        cfg = LossConfig.cispo(clip_high=1.5, temperature=0.8)
        old = old - 1.2  # push some ratios above the cap
    else:  # SAPO aggregates like grpo
        kw = dict(loss_type="sapo", sapo_temperature_pos=1.5, sapo_temperature_neg=0.8)
        cfg = LossConfig(
            policy="sapo", sapo_tau_pos=1.5, sapo_tau_neg=0.8, temperature=0.8,
            agg="seq-mean-token-mean",
        )  # fmt: skip
    loss_l, _, grad_l = liger_loss(logits, tokens, old, None, adv, mask, 0.8, beta=0.0, **kw)
    out, grad = ours(impl, logits, tokens, old, None, adv, mask, cfg)
    if policy == "cispo":
        assert out.metrics["ratio_max"] > 2.5  # the cap bites somewhere
    torch.testing.assert_close(out.loss, loss_l.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, grad_l[:, :T], rtol=1e-4, atol=1e-6)


# --------------------------------------------------------------------------- TRL log-probs
TOL = {torch.bfloat16: (2e-2, 5e-2), torch.float16: (2e-3, 5e-3)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.6, 1.7])
@pytest.mark.parametrize("vocab", [7, 33, 1001])
def test_trl_logprobs_entropy(impl, dtype, temperature, vocab):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    logits = (torch.randn(3, 5, vocab) * 3).to(dtype)
    tokens = torch.randint(0, vocab, (3, 5))
    logp, ent = impl.logprobs(logits, tokens, temperature=temperature, entropy=True)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    # the reference computes in fp32 from the given values: equal to TRL on the upcast logits
    up = logits.float()
    trl_logp = trl_utils.selective_log_softmax(up, tokens, temperature=temperature)
    trl_ent = trl_utils.entropy_from_logits(up / temperature)
    # fp32 rounding of lse and of H = lse - sum p z' scales with |z'| (H is a difference of two
    # numbers of size |z'|; near-deterministic rows have H ~ 1e-4 and absolute error ~ eps |z'|)
    atol = max(1e-5, 2e-6 * (up / temperature).abs().max().item())
    torch.testing.assert_close(logp, trl_logp, rtol=1e-5, atol=atol)
    torch.testing.assert_close(ent, trl_ent, rtol=1e-5, atol=atol)
    # TRL in the low-precision dtype itself agrees within that dtype's resolution
    if dtype != torch.float32:  # (for fp32 this is the check above)
        rtol, atol_lp = TOL[dtype]
        trl_logp = trl_utils.selective_log_softmax(logits, tokens, temperature=temperature)
        torch.testing.assert_close(logp, trl_logp.float(), rtol=rtol, atol=atol_lp)
    # the reference's token_logprobs (the building block of its loss) is the same function
    logp2, ent2 = reference.token_logprobs(logits, tokens, temperature)
    torch.testing.assert_close(logp2, logp, rtol=1e-5, atol=atol)
    torch.testing.assert_close(ent2, ent, rtol=1e-5, atol=atol)


def test_trl_flat_and_logp_only(impl):
    trl_utils = pytest.importorskip("trl.trainer.utils")
    logits = torch.randn(11, 13)
    tokens = torch.randint(0, 13, (11,))
    logp = impl.logprobs(logits, tokens)
    torch.testing.assert_close(logp, trl_utils.selective_log_softmax(logits, tokens))
    _, ent = reference.token_logprobs(logits, tokens)
    torch.testing.assert_close(ent, trl_utils.entropy_from_logits(logits))
