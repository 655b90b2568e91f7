"""fastrl's advantages and value loss against verl's own (verl 0.9.1 `core_algos`, installed with
--no-deps; skipped without it): GAE, GRPO (and Dr.GRPO), RLOO, the REINFORCE++ baseline, the
clipped value loss (SPEC 8) in each of its aggregations, with its gradient and clip fraction, and
every KL loss type verl names, through the integration's config mapping.

SPEC 7 follows verl's formulas; where the two differ on purpose (groups of one, groups whose
rewards are all equal) the tests below pin both sides, so that docs/integrations.md's table of
differences stays true. verl takes token-level rewards (B, T) and sums them per response, and a
group index per response (any hashable ids: its trainer uses uid strings); fastrl takes the
per-response rewards (B,) and `group_ids` (B,)."""

import numpy as np
import pytest
import torch

pytest.importorskip("verl.trainer.ppo.core_algos", exc_type=ImportError)

from verl.trainer.ppo import core_algos  # noqa: E402

import fastrl  # noqa: E402
from fastrl import reference  # noqa: E402

# fastrl computes group statistics in fp64 and returns fp32; verl's are fp32 throughout
ATOL = RTOL = 2e-5


def _responses(B: int, T: int, seed: int):
    """A response mask (B, T) with random lengths (trailing padding, every response at least one
    token) and ~15% masked tokens inside (tool output), and rewards (B,) placed on each
    response's last counted token of a (B, T) token-level reward tensor, as verl's reward
    managers do."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T + 1, (B,), generator=g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    mask &= (torch.rand(B, T, generator=g) > 0.15) | (torch.arange(T)[None, :] == 0)
    last = (mask.long() * torch.arange(T)[None, :]).argmax(dim=1)
    return mask, last, g


def _token_level(rewards: torch.Tensor, last: torch.Tensor, T: int) -> torch.Tensor:
    out = torch.zeros(rewards.shape[0], T)
    out[torch.arange(rewards.shape[0]), last] = rewards
    return out


def _shuffled_groups(n_groups: int, size: int, g: torch.Generator):
    """verl's uid strings for `n_groups` groups of `size`, in a shuffled order (a trainer's batch
    need not keep a group's responses together), and fastrl's group_ids for the same."""
    order = torch.randperm(n_groups * size, generator=g)
    ids = torch.arange(n_groups).repeat_interleave(size)[order]
    uids = np.array([f"uid-{i}" for i in ids.tolist()], dtype=object)
    return uids, ids


# --------------------------------------------------------------------------- GAE
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (1.0, 0.95), (0.7, 0.3)])
@pytest.mark.parametrize("B,T", [(2, 1), (5, 17), (8, 300)])
def test_gae_equals_verl(gamma, lam, B, T):
    """fastrl.gae == verl's compute_gae_advantage_return: the masked scan (tool-output tokens
    carry the value and the advantage through), returns = A + V, the whitening over counted
    tokens, and the values verl leaves at masked tokens too (every response has a counted first
    token: verl's unbiased whitening needs two counted tokens in the batch)."""
    mask, _, g = _responses(B, T, seed=B * T)
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    want_adv, want_ret = core_algos.compute_gae_advantage_return(
        rewards, values, mask.float(), torch.tensor(gamma), torch.tensor(lam)
    )
    adv, ret = fastrl.gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, want_adv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ret, want_ret, atol=ATOL, rtol=RTOL)


def test_gae_triton_backend_equals_verl(monkeypatch):
    """The Triton reverse scan (interpreter on the CPU) against verl, bf16 rewards / values."""
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    mask, _, g = _responses(3, 40, seed=3)
    rewards = torch.randn(3, 40, generator=g).bfloat16()
    values = torch.randn(3, 40, generator=g).bfloat16()
    want_adv, want_ret = core_algos.compute_gae_advantage_return(
        rewards.float(), values.float(), mask.float(), torch.tensor(0.99), torch.tensor(0.95)
    )
    adv, ret = fastrl.gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, want_adv, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ret, want_ret, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- outcome estimators
def _outcome_case(n_groups: int, size: int, seed: int, T: int = 6):
    """Rewards with continuous groups, one 0/1 group and one all-equal 0/1 group (both exact in
    fp32), shuffled group order; mask, last-token positions and the two group-id forms."""
    mask, last, g = _responses(n_groups * size, T, seed)
    rewards = torch.randn(n_groups * size, generator=g)
    uids, ids = _shuffled_groups(n_groups, size, g)
    binary = ids == 0
    rewards[binary] = (torch.rand(int(binary.sum()), generator=g) > 0.5).float()
    rewards[binary.nonzero()[0]] = 1.0  # group 0 is not all equal
    rewards[binary.nonzero()[1]] = 0.0
    rewards[ids == 1] = 1.0  # group 1: every response right
    return rewards, mask, last, uids, ids


@pytest.mark.parametrize("size", [2, 3, 8])
@pytest.mark.parametrize("scale,norm_by_std", [("group", True), ("none", False)])
def test_grpo_equals_verl(size, scale, norm_by_std):
    """group_advantages(estimator="grpo") == verl's GRPO estimator (norm_adv_by_std_in_grpo
    True: GRPO, False: Dr.GRPO), per response and broadcast over the response mask."""
    rewards, mask, last, uids, ids = _outcome_case(5, size, seed=size)
    want, _ = core_algos.compute_grpo_outcome_advantage(
        _token_level(rewards, last, mask.shape[1]), mask.float(), uids,
        norm_adv_by_std_in_grpo=norm_by_std,
    )  # fmt: skip
    adv = fastrl.group_advantages(rewards, group_ids=ids, scale=scale)
    torch.testing.assert_close(adv[:, None] * mask, want, atol=ATOL, rtol=RTOL)
    assert adv[ids == 1].eq(0).all()  # the all-right group: no signal (verl: 0 too, exactly)


@pytest.mark.parametrize("size", [2, 3, 8])
def test_rloo_equals_verl(size):
    rewards, mask, last, uids, ids = _outcome_case(5, size, seed=10 + size)
    want, _ = core_algos.compute_rloo_outcome_advantage(
        _token_level(rewards, last, mask.shape[1]), mask.float(), uids
    )
    adv = fastrl.group_advantages(rewards, group_ids=ids, estimator="rloo")
    torch.testing.assert_close(adv[:, None] * mask, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("size", [2, 4])
def test_reinforce_pp_baseline_equals_verl(size):
    """estimator="reinforce++" with the token mask: R - μ_g broadcast over the tokens, whitened
    over the counted ones (verl then multiplies by the mask: compared on counted tokens, and
    fastrl's value at a masked token is checked to be the whitening's too)."""
    rewards, mask, last, uids, ids = _outcome_case(6, size, seed=20 + size)
    want, _ = core_algos.compute_reinforce_plus_plus_baseline_outcome_advantage(
        _token_level(rewards, last, mask.shape[1]), mask.float(), uids
    )
    adv = fastrl.group_advantages(rewards, group_ids=ids, estimator="reinforce++", mask=mask)
    assert adv.shape == mask.shape
    torch.testing.assert_close(adv * mask, want, atol=ATOL, rtol=RTOL)


# --------------------------------------------------------------------------- value loss
@pytest.mark.parametrize(
    "agg",
    [
        "token-mean",
        "token-sum",
        "seq-mean-token-mean",
        "seq-mean-token-sum",
        "seq-mean-token-sum-norm",
    ],  # fmt: skip
)
@pytest.mark.parametrize("clip", [0.2, 0.5])
def test_value_loss_equals_verl(agg, clip):
    """fastrl.value_loss(values, old_values, returns, mask, clip, agg) == verl's
    compute_value_loss(vpreds, returns, values, response_mask, cliprange_value, loss_agg_mode):
    the loss, its gradient with respect to the predicted values, and vf_clipfrac."""
    mask, _, g = _responses(6, 11, seed=7)
    vpreds = torch.randn(6, 11, generator=g, requires_grad=True)
    old, returns = torch.randn(6, 11, generator=g), torch.randn(6, 11, generator=g)
    want, want_clipfrac = core_algos.compute_value_loss(
        vpreds, returns, old, mask.float(), clip, loss_agg_mode=agg
    )
    (want_grad,) = torch.autograd.grad(want, vpreds)
    loss, clipfrac = fastrl.value_loss(vpreds, old, returns, mask, clip=clip, agg=agg)
    (grad,) = torch.autograd.grad(loss, vpreds)
    torch.testing.assert_close(loss, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(grad, want_grad, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(clipfrac, torch.as_tensor(want_clipfrac).float())
    assert 0 < clipfrac < 1  # both sides of the clip are exercised


@pytest.mark.parametrize("clip", [10.0, 0.2])
def test_vf_clipfrac_counts_only_clipped_tokens(clip):
    """v_old + (v - v_old) is often not exactly v in fp32: forming v_clip that way made the
    'clipped' loss larger at about 10 % of tokens that were never clipped (vf_clipfrac 0.10
    where verl's is 0). Both fastrl and the oracle clamp v into [v_old - ε, v_old + ε] now, as
    verl and TRL do."""
    g = torch.Generator().manual_seed(0)
    v, old, returns = (torch.randn(1, 1000, generator=g) for _ in range(3))
    mask = torch.ones(1, 1000)
    _, want = core_algos.compute_value_loss(v, returns, old, mask, clip, loss_agg_mode="token-mean")
    _, got = fastrl.value_loss(v, old, returns, mask, clip=clip)
    _, oracle = reference.value_loss(v, old, returns, mask, clip=clip)
    assert got == oracle == float(want)
    if clip == 10.0:  # |v - v_old| < 10 everywhere: nothing is clipped
        assert (v - old).abs().max() < clip and got == 0


# --------------------------------------------------------------------------- KL penalties
@pytest.mark.parametrize("kl_type", ["kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3"])
def test_kl_loss_types_equal_verl(kl_type):
    """Each verl `kl_loss_type` through `loss_config_from_verl`: fastrl.policy_loss with zero
    advantages (the clipped surrogate and its gradient are then 0) equals kl_loss_coef times the
    token mean of verl's own kl_penalty on the same log-probs, in value and in the gradient with
    respect to the logits; log-ratios from -30 to 30 reach the clamps of low_var_kl (at +-20 on
    the log-ratio, at 10 on the estimate)."""
    from fastrl.integrations.verl import loss_config_from_verl

    mask, _, g = _responses(4, 16, seed=11)
    logits = torch.randn(4, 16, 50, generator=g, requires_grad=True)
    tokens = torch.randint(0, 50, (4, 16), generator=g)
    logp_now = torch.log_softmax(logits.detach(), -1).gather(-1, tokens[..., None])[..., 0]
    ref = logp_now + torch.empty(4, 16).uniform_(-30, 30, generator=g)
    actor = {"use_kl_loss": True, "kl_loss_type": kl_type, "kl_loss_coef": 0.1,
             "loss_agg_mode": "token-mean"}  # fmt: skip
    cfg = loss_config_from_verl(actor)
    zeros = torch.zeros(4)
    out = fastrl.policy_loss(logits, tokens, zeros, logp_now, ref, mask, config=cfg)
    (grad,) = torch.autograd.grad(out.loss, logits)
    logp = torch.log_softmax(logits, -1).gather(-1, tokens[..., None])[..., 0]
    kl = core_algos.kl_penalty(logp, ref, kl_type)
    want = 0.1 * (kl * mask).sum() / mask.sum()
    (want_grad,) = torch.autograd.grad(want, logits)
    torch.testing.assert_close(out.loss, want, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(grad, want_grad, atol=ATOL, rtol=RTOL)
    if kl_type in ("low_var_kl", "k3"):  # both clamps were reached
        assert (ref - logp_now).abs().max() > 20 and kl.detach().max() == 10


# --------------------------------------------------------------------------- where they differ
def test_groups_of_one_differ_as_documented():
    """docs/integrations.md: for a group of one verl's GRPO uses μ = 0, σ = 1 (A = R / (1 + eps)),
    its RLOO keeps the raw reward (A = R); fastrl gives A = 0 for both (no baseline, no signal).
    The responses in larger groups of the same batch agree."""
    rewards = torch.tensor([0.3, -1.2, 0.5, 2.0, 0.7])
    uids = np.array(["a", "b", "b", "c", "c"], dtype=object)  # "a" is a group of one
    ids = torch.tensor([0, 1, 1, 2, 2])
    tok = rewards[:, None]  # T = 1
    ones = torch.ones(5, 1)
    grpo, _ = core_algos.compute_grpo_outcome_advantage(tok.clone(), ones, uids)
    rloo, _ = core_algos.compute_rloo_outcome_advantage(tok.clone(), ones, uids)
    ours_grpo = fastrl.group_advantages(rewards, group_ids=ids)
    ours_rloo = fastrl.group_advantages(rewards, group_ids=ids, estimator="rloo")
    torch.testing.assert_close(grpo[0, 0], rewards[0] / (1 + 1e-6))
    torch.testing.assert_close(rloo[0, 0], rewards[0])
    assert ours_grpo[0] == 0 and ours_rloo[0] == 0
    torch.testing.assert_close(ours_grpo[1:], grpo[1:, 0], atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(ours_rloo[1:], rloo[1:, 0], atol=ATOL, rtol=RTOL)


def test_all_equal_groups_are_exactly_zero_where_verl_amplifies_rounding():
    """A group whose rewards are all equal carries no signal. verl's GRPO forms its mean in fp32:
    for a reward that the mean does not reproduce exactly (e.g. 0.3 in a group of 7), R - μ_g is
    an ulp and σ_g about as small, so (R - μ_g) / (σ_g + 1e-6) is rounding noise of order 0.01-0.1
    (docs/integrations.md). fastrl's group_advantages gives exactly 0 (SPEC 7)."""
    g = torch.Generator().manual_seed(0)
    size = 7
    rewards = torch.rand(64, generator=g).repeat_interleave(size)  # 64 all-equal groups of 7
    uids = np.arange(64 * size) // size
    tok = rewards[:, None]
    verl_adv, _ = core_algos.compute_grpo_outcome_advantage(tok.clone(), torch.ones_like(tok), uids)
    # verl: the noise the docs describe (if this fails, verl changed: update them)
    assert verl_adv.abs().max() > 1e-3
    ours = fastrl.group_advantages(rewards, group_size=size)
    assert ours.eq(0).all()
