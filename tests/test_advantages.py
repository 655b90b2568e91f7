"""GAE, group advantages, whitening and the DAPO helpers against SPEC 7 / 9 and the reference."""

import math

import pytest
import torch

import fastrl
from fastrl import reference as ref
from fastrl.gae import _gae_torch

# input dtype -> (atol, rtol) of the unwhitened advantages against the fp32 oracles
TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (2e-5, 2e-5)}  # both compare on the same inputs


def spec_gae_loop(rewards, values, mask, gamma, lam):
    """SPEC 7 literally: one sequence at a time, one step at a time, Python floats."""
    B, T = len(rewards), len(rewards[0])
    out = [[0.0] * T for _ in range(B)]
    for b in range(B):
        next_v = last = 0.0
        for t in range(T - 1, -1, -1):
            r, v, m = rewards[b][t], values[b][t], mask[b][t]
            delta = r + gamma * next_v - v
            a = delta + gamma * lam * last
            next_v = m * v + (1 - m) * next_v
            last = m * a + (1 - m) * last
            out[b][t] = last
    return torch.tensor(out, dtype=torch.float64)


def _inputs(B, T, density, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g).to(dtype)
    values = torch.randn(B, T, generator=g).to(dtype)
    mask = torch.rand(B, T, generator=g) < density
    return rewards, values, mask


GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95), (1.0, 0.9), (0.9, 0.5), (0.5, 0.1), (1.0, 0.0), (0.0, 1.0)]


@pytest.mark.parametrize("gamma,lam", GAMMA_LAM)
@pytest.mark.parametrize("T", [1, 7, 300])
@pytest.mark.parametrize("density", [1.0, 0.6, 0.0])
def test_gae_matches_spec_loop(gamma, lam, T, density):
    rewards, values, mask = _inputs(3, T, density, seed=T)
    adv, ret = fastrl.gae(rewards, values, mask, gamma, lam, whiten=False)
    expected = spec_gae_loop(rewards.tolist(), values.tolist(), mask.float().tolist(), gamma, lam)
    scale = 1 + expected.abs().max().item()
    torch.testing.assert_close(adv.double(), expected, atol=2e-6 * scale, rtol=0)
    torch.testing.assert_close(ret.double(), expected + values.double(), atol=2e-6 * scale, rtol=0)


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.7, 0.3)])
def test_gae_long_sequence(gamma, lam):
    """T = 4097 (several scan blocks, odd length) against the loop and the reference."""
    rewards, values, mask = _inputs(2, 4097, 0.8, seed=1)
    adv, ret = fastrl.gae(rewards, values, mask, gamma, lam, whiten=False)
    expected = spec_gae_loop(rewards.tolist(), values.tolist(), mask.float().tolist(), gamma, lam)
    scale = 1 + expected.abs().max().item()
    torch.testing.assert_close(adv.double(), expected, atol=1e-6 * scale, rtol=0)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, gamma, lam, False)
    torch.testing.assert_close(adv, ref_adv, atol=2e-6 * scale, rtol=0)


@pytest.mark.parametrize("gamma", [0.9999, 0.999])
def test_gae_long_horizon_with_large_values_has_no_bias(gamma):
    """Values ~1e3 over T = 8192 at gamma near 1: the CPU scan within the fp32 output's own
    rounding of the float64 loop. It formed delta in fp32, gamma rounded to fp32 there: a
    relative 1e-8 of every V', the same sign at every step, summed over the horizon
    1 / (1 - gamma): 0.093 off at gamma = 0.9999, 0.014 at 0.999 (the fp32 loop: 3e-3)."""
    g = torch.Generator().manual_seed(2)
    rewards = torch.randn(1, 8192, generator=g)
    values = torch.randn(1, 8192, generator=g) * 100 + 1000
    mask = torch.ones(1, 8192, dtype=torch.bool)
    adv, _ = fastrl.gae(rewards, values, mask, gamma, 1.0, whiten=False)
    expected = spec_gae_loop(rewards.tolist(), values.tolist(), mask.float().tolist(), gamma, 1.0)
    ulp = torch.finfo(torch.float32).eps * expected.abs().max().item()
    assert (adv.double() - expected).abs().max() <= ulp


@pytest.mark.parametrize("gamma,lam,T", [(0.5, 0.5, 6000), (1.0, 1.0, 2000)])
def test_gae_block_chaining_paths(gamma, lam, T):
    """Short blocks (c = 0.25: L = 6, > 1024 blocks chained by shifted adds) and long ones
    (c = 1: L = 256, chained by the matmul)."""
    rewards, values, mask = _inputs(2, T, 0.9, seed=2)
    expected, _ = ref.gae(rewards, values, mask, gamma, lam, False)
    adv, _ = fastrl.gae(rewards, values, mask, gamma, lam, whiten=False)
    scale = 1 + expected.abs().max().item()
    torch.testing.assert_close(adv, expected, atol=2e-6 * scale, rtol=0)


def test_chain_blocks_strategies_agree():
    from fastrl.gae import _chain_blocks

    totals = torch.randn(3, 40, dtype=torch.float64)
    for decay in (1.0, 0.9, 1e-3, 0.0):
        loop = _chain_blocks(totals, decay, None)  # shifted adds when decay < 0.01
        k = torch.arange(40)
        gap = (k[:, None] - k[None, :]).double()
        chain = torch.where(gap >= 0, decay ** gap.clamp(min=0), 0.0)
        torch.testing.assert_close(_chain_blocks(totals, decay, chain), loop)
        expected = torch.zeros_like(totals)
        carry = torch.zeros(3, dtype=torch.float64)
        for b in range(39, -1, -1):
            carry = totals[:, b] + decay * carry
            expected[:, b] = carry
        torch.testing.assert_close(loop, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.9), (0.5, 0.2)])
def test_gae_whitened_matches_reference(dtype, gamma, lam):
    rewards, values, mask = _inputs(5, 130, 0.7, dtype)
    mask[2] = False  # a fully masked row
    adv, ret = fastrl.gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, gamma, lam)
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(adv, ref_adv, atol=10 * atol, rtol=10 * rtol)
    torch.testing.assert_close(ret, ref_ret, atol=atol * 10, rtol=rtol)
    assert adv.dtype == ret.dtype == torch.float32
    counted = adv[mask]
    assert abs(counted.mean().item()) < 1e-5
    assert abs(counted.std().item() - 1) < 1e-4


def test_gae_float_mask_and_chunking():
    """A 0/1 float mask, and every row-chunk size, give the same result."""
    rewards, values, mask = _inputs(7, 50, 0.5)
    expected, _ = ref.gae(rewards, values, mask, 0.99, 0.95, False)
    for rows in (1, 3, 7):
        adv, _ = _gae_torch(rewards, values, mask.float(), 0.99, 0.95, rows_per_chunk=rows)
        torch.testing.assert_close(adv, expected, atol=1e-5, rtol=1e-5)


def test_gae_fractional_mask_matches_reference():
    rewards, values, _ = _inputs(3, 20, 1.0)
    mask = torch.rand(3, 20)
    adv, ret = fastrl.gae(rewards, values, mask, 0.99, 0.95)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=1e-5)


def test_gae_empty_mask_is_finite():
    rewards, values, _ = _inputs(2, 9, 1.0)
    adv, ret = fastrl.gae(rewards, values, torch.zeros(2, 9, dtype=torch.bool))
    assert torch.isfinite(adv).all() and torch.isfinite(ret).all()
    ref_adv, _ = ref.gae(rewards, values, torch.zeros(2, 9))
    torch.testing.assert_close(adv, ref_adv)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(rewards=torch.zeros(2, 3), values=torch.zeros(2, 4)), "values"),
        (dict(rewards=torch.zeros(6), values=torch.zeros(6)), "rewards"),
        (dict(mask=torch.ones(2, 4)), "mask"),
        (dict(rewards=torch.tensor([[0.0, math.nan, 1.0]])), "rewards"),
        (dict(values=torch.tensor([[0.0, math.nan, 1.0]])), "values"),
        (dict(gamma=1.5), "gamma"),
        (dict(lam=-0.1), "lam"),
        (dict(rewards=torch.zeros(1, 3, dtype=torch.int64)), "rewards"),
    ],
)
def test_gae_bad_input(kwargs, match):
    args = dict(rewards=torch.zeros(1, 3), values=torch.zeros(1, 3), mask=torch.ones(1, 3))
    args.update(kwargs)
    if "mask" not in kwargs:
        args["mask"] = torch.ones(args["rewards"].shape[:2] if args["rewards"].dim() > 1 else 1)
    with pytest.raises(ValueError, match=match):
        fastrl.gae(**args)


def test_gae_numpy_scalars():
    """gamma / lam as numpy scalars give the same result as Python floats."""
    np = pytest.importorskip("numpy")
    rewards, values, mask = _inputs(3, 11, 0.8)
    got = fastrl.gae(rewards, values, mask, gamma=np.float64(0.9), lam=np.float64(0.95))
    want = fastrl.gae(rewards, values, mask, gamma=0.9, lam=0.95)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    with pytest.raises(ValueError, match="gamma"):
        fastrl.gae(rewards, values, mask, gamma=np.float64(1.5))


def test_group_advantages_numpy_group_size():
    np = pytest.importorskip("numpy")
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    got = fastrl.group_advantages(rewards, group_size=np.int64(3))
    torch.testing.assert_close(got, fastrl.group_advantages(rewards, group_size=3), rtol=0, atol=0)
    with pytest.raises(ValueError, match="group_size"):
        fastrl.group_advantages(rewards, group_size=np.float64(3))


# --------------------------------------------------------------------------- Triton GAE kernel
@pytest.mark.parametrize("T,block_t", [(1, 16), (13, 16), (50, 16), (70, 32)])
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95), (0.5, 0.0)])
def test_gae_kernel_interpreter(T, block_t, gamma, lam):
    """The Triton reverse scan (interpreter on CPU), several blocks per row."""
    from fastrl.kernels.gae import gae_scan

    rewards, values, mask = _inputs(3, T, 0.6, seed=T)
    mask[0] = True
    adv = gae_scan(rewards, values, mask.float(), gamma, lam, block_t=block_t)
    expected = spec_gae_loop(rewards.tolist(), values.tolist(), mask.float().tolist(), gamma, lam)
    torch.testing.assert_close(adv.double(), expected, atol=1e-5, rtol=1e-5)


def test_gae_triton_backend_end_to_end(monkeypatch):
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    rewards, values, mask = _inputs(2, 40, 0.7, dtype=torch.bfloat16)
    adv, ret = fastrl.gae(rewards, values, mask, 0.99, 0.95)
    ref_adv, ref_ret = ref.gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv, ref_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret, ref_ret, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 1000, 32768])
def test_gae_cuda(T):
    rewards, values, mask = (x.cuda() for x in _inputs(4, T, 0.8))
    adv, ret = fastrl.gae(rewards, values, mask, 0.99, 0.95)
    ref_adv, ref_ret = ref.gae(rewards.cpu(), values.cpu(), mask.cpu(), 0.99, 0.95)
    torch.testing.assert_close(adv.cpu(), ref_adv, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ret.cpu(), ref_ret, atol=1e-4, rtol=1e-4)


# --------------------------------------------------------------------------- whitening
@pytest.mark.parametrize("n_counted", [0, 1, 2, 17])
def test_whiten_matches_reference(n_counted):
    x = torch.randn(4, 5)
    mask = torch.zeros(20, dtype=torch.bool)
    mask[:n_counted] = True
    mask = mask.view(4, 5)
    out = fastrl.whiten(x, mask)
    torch.testing.assert_close(out, ref.whiten(x, mask))
    torch.testing.assert_close(fastrl.whiten(x), ref.whiten(x))
    torch.testing.assert_close(
        fastrl.whiten(x, mask, shift_mean=False), ref.whiten(x, mask, shift_mean=False)
    )
    assert torch.isfinite(out).all()


# --------------------------------------------------------------------------- group advantages
REWARDS = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5, 2.0, 2.0, 0.3, 0.1, 0.1, 0.1])
IDS = torch.tensor([5, 5, 5, 2, 2, 2, 9, 9, 9, -1, 3, 3])  # ..., a group of one (-1), ...


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_advantages_match_reference(estimator, scale):
    kw = dict(scale=None if estimator == "reinforce++" else scale, estimator=estimator)
    out = fastrl.group_advantages(REWARDS, group_size=3, **kw)
    torch.testing.assert_close(out, ref.group_advantages(REWARDS, group_size=3, **kw))
    assert torch.all(out[:3] == 0) and torch.all(out[9:] == 0)  # all-equal groups: exactly 0
    out_ids = fastrl.group_advantages(REWARDS, group_ids=IDS, **kw)
    torch.testing.assert_close(out_ids, ref.group_advantages(REWARDS, group_ids=IDS, **kw))
    assert out_ids[9] == 0  # a group of one
    perm = torch.randperm(len(REWARDS))  # shuffled order: same advantages, permuted
    shuffled = fastrl.group_advantages(REWARDS[perm], group_ids=IDS[perm], **kw)
    torch.testing.assert_close(shuffled, out_ids[perm])
    torch.testing.assert_close(
        shuffled, ref.group_advantages(REWARDS[perm], group_ids=IDS[perm], **kw)
    )
    assert not torch.isnan(out).any()


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
@pytest.mark.parametrize("scale", ["group", "batch"])
def test_group_advantages_with_eps_0_are_0_for_flat_groups(estimator, scale):
    """eps = 0 is allowed: all-equal groups (0.1 three times: a mean not exactly 0.1) and groups
    of one still get exactly 0, as does an all-equal batch under scale="batch" (0 / 0 was NaN
    in the library and the oracle; SPEC 7: never NaN)."""
    kw = dict(estimator=estimator, scale=scale, eps=0.0)
    for fn in (fastrl.group_advantages, ref.group_advantages):
        out = fn(REWARDS, group_ids=IDS, **kw)
        assert not torch.isnan(out).any(), fn
        assert torch.all(out[:3] == 0) and torch.all(out[9:] == 0), fn
        assert (out[3:9] != 0).sum() == 5, fn  # 0.5 is its group's mean
        torch.testing.assert_close(out, ref.group_advantages(REWARDS, group_ids=IDS, **kw))
        assert torch.equal(fn(torch.full((4,), 0.7), 2, **kw), torch.zeros(4)), fn


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_group_advantages_unchecked_nan_rewards_stay_nan(scale):
    """check=False: a NaN or inf reward makes its group's (scale="group") or the batch's
    ("batch") advantages NaN, never a silent 0 (the eps = 0 guard takes a zero σ only)."""
    for bad in (float("nan"), float("inf")):
        r = torch.tensor([1.0, bad, 0.0, 2.0])
        out = fastrl.group_advantages(r, 2, scale=scale, check=False)
        want = ref.group_advantages(r, 2, scale=scale)
        assert torch.isnan(out[:2]).all() and torch.isnan(want[:2]).all(), (out, want)
        if scale == "batch":
            assert torch.isnan(out).all() and torch.isnan(want).all()
        else:
            torch.testing.assert_close(out[2:], want[2:])


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_checked_rewards_refuse_nan_and_inf(bad):
    """check=True (the default) refused a NaN reward but let an inf one through, and its group
    came out NaN (SPEC 7: never NaN)."""
    r = torch.tensor([1.0, bad, 0.0, 2.0])
    with pytest.raises(ValueError, match="rewards \\(shape \\(4,\\)\\) contains NaN or inf"):
        fastrl.group_advantages(r, 2)
    with pytest.raises(ValueError, match="rewards \\(shape \\(4,\\)\\) contains NaN or inf"):
        fastrl.dynamic_sampling_filter(r, 2)


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_group_advantages_hand_computed(estimator):
    r = torch.tensor([0.0, 1.0, 2.0, 5.0, 7.0, 9.0])  # means 1 and 7, unbiased stds 1 and 2
    factor = 1.5 if estimator == "rloo" else 1.0  # n / (n - 1) for n = 3
    centered = torch.tensor([-1.0, 0.0, 1.0, -2.0, 0.0, 2.0]) * factor
    out = fastrl.group_advantages(r, 3, estimator=estimator, scale="none")
    torch.testing.assert_close(out, centered)
    out = fastrl.group_advantages(r, 3, estimator=estimator, scale="group", eps=0.0)
    torch.testing.assert_close(out, centered / torch.tensor([1.0, 1, 1, 2, 2, 2]))
    out = fastrl.group_advantages(r, 3, estimator=estimator, scale="batch", eps=0.0)
    torch.testing.assert_close(out, centered / r.std())


def test_group_advantages_random_large():
    r = torch.randn(64).round()
    ids = torch.randint(0, 20, (64,))
    for est in ("grpo", "rloo"):
        torch.testing.assert_close(
            fastrl.group_advantages(r, group_ids=ids, estimator=est),
            ref.group_advantages(r, group_ids=ids, estimator=est),
            atol=1e-5,
            rtol=1e-5,
        )


def test_reinforce_pp_with_token_mask():
    mask = torch.rand(12, 6) > 0.3
    out = fastrl.group_advantages(REWARDS, 3, estimator="reinforce++", mask=mask)
    expected = ref.group_advantages(REWARDS, 3, estimator="reinforce++", mask=mask)
    assert out.shape == (12, 6)
    torch.testing.assert_close(out, expected)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(group_size=5), "group_size"),
        (dict(group_size=0), "group_size"),
        (dict(group_size=None), "group_size"),
        (dict(group_size=3, rewards=torch.tensor([1.0, math.nan, 0.0])), "rewards"),
        (dict(group_size=3, rewards=torch.zeros(3, 2)), "rewards"),
        (dict(group_ids=torch.zeros(4, dtype=torch.long)), "group_ids"),
        (dict(group_ids=torch.zeros(6)), "group_ids"),
        (dict(group_size=3, scale="std"), "scale"),
        (dict(group_size=3, estimator="ppo"), "estimator"),
        (dict(group_size=3, estimator="reinforce++", mask=torch.ones(5, 2)), "mask"),
        (dict(group_size=3, mask=torch.ones(6, 2)), "mask"),  # grpo would ignore it
        (dict(group_size=3, estimator="rloo", mask=torch.ones(7, 3)), "mask"),
        (dict(group_size=3, eps=-1.0), "eps"),  # would flip the advantages' sign
        (dict(group_size=3, eps=math.nan), "eps"),
        (dict(group_size=3, eps=math.inf), "eps"),
        (dict(group_size=3, eps=1e300), "eps"),  # inf in fp32: every advantage would be 0
    ],
)
def test_group_advantages_bad_input(kwargs, match):
    kwargs.setdefault("rewards", torch.arange(6.0))
    with pytest.raises(ValueError, match=match):
        fastrl.group_advantages(**kwargs)


# --------------------------------------------------------------------------- DAPO helpers
def test_overlong_penalty_hand_computed():
    lengths = torch.tensor([0, 6, 7, 8, 10, 11, 50])
    # max_len 10, cache 4 -> L_exp = 6; factor 0.5
    out = fastrl.overlong_penalty(lengths, max_len=10, cache_len=4, factor=0.5)
    expected = torch.tensor([0.0, 0.0, -0.125, -0.25, -0.5, -0.5, -0.5])
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(out, ref.overlong_penalty(lengths, 10, 4, 0.5))
    with pytest.raises(ValueError, match="cache_len"):
        fastrl.overlong_penalty(lengths, max_len=10, cache_len=11)
    with pytest.raises(ValueError, match="lengths"):
        fastrl.overlong_penalty(lengths[None], max_len=10, cache_len=4)
    with pytest.raises(ValueError, match="factor must be a float >= 0"):
        fastrl.overlong_penalty(lengths, max_len=10, cache_len=4, factor=float("nan"))
    with pytest.raises(ValueError, match="factor must be a float >= 0"):
        fastrl.overlong_penalty(lengths, max_len=10, cache_len=4, factor=-1.0)
    # a non-finite length (float lengths) is NaN, never a finite penalty
    odd = fastrl.overlong_penalty(torch.tensor([float("nan"), float("inf"), 8.0]), 10, 4, 0.5)
    assert odd[:2].isnan().all() and odd[2] == -0.25
    # lengths that are no lengths: a negative one read as penalty 0, a bool or complex tensor
    # was taken (True = 1)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        fastrl.overlong_penalty(torch.tensor([3, -2]), 10, 4)
    for bad in (torch.tensor([True, False]), torch.tensor([1 + 0j, 2 + 0j])):
        with pytest.raises(ValueError, match="lengths must be an integer or float tensor"):
            fastrl.overlong_penalty(bad, 10, 4)


def test_dynamic_sampling_filter_hand_computed():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.5, 0.5, 0.2])
    out = fastrl.dynamic_sampling_filter(r, 3)
    assert out.tolist() == [1, 3]  # groups (0, 1, 1) and (0.5, 0.5, 0.2) vary
    assert out.tolist() == ref.dynamic_sampling_filter(r, 3).tolist()
    assert out.dtype == torch.int64
    assert fastrl.dynamic_sampling_filter(torch.ones(4), 2).tolist() == []
    with pytest.raises(ValueError, match="group_size"):
        fastrl.dynamic_sampling_filter(r, 5)


@pytest.mark.parametrize("total", [0.5, 1.5, 3.7])
def test_whiten_fractional_mask_matches_reference(total):
    x = torch.randn(10)
    mask = torch.zeros(10)
    mask[:4] = total / 4
    torch.testing.assert_close(fastrl.whiten(x, mask), ref.whiten(x, mask))


def test_reinforce_pp_rejects_a_scale():
    with pytest.raises(ValueError, match="scale"):
        fastrl.group_advantages(REWARDS, 3, scale="group", estimator="reinforce++")


def test_gae_accepts_values_that_require_grad():
    rewards, values = torch.randn(3, 7), torch.randn(3, 7, requires_grad=True)
    adv, ret = fastrl.gae(rewards, values, torch.ones(3, 7), 0.9, 0.8)
    expected = ref.gae(rewards, values.detach(), torch.ones(3, 7), 0.9, 0.8)
    torch.testing.assert_close(adv, expected[0])
    assert not adv.requires_grad and not ret.requires_grad


# --------------------------------------------------------------------------- nothing silently wrong
def test_whiten_is_scale_safe():
    """Squares of 1e20 overflow fp32 (the result used to be all zeros); tiny inputs still get
    the eps of SPEC 7."""
    huge = torch.tensor([1e20, -1e20, 3e20])  # mean 1e20, centred 0, -2e20, 2e20: std 2e20
    torch.testing.assert_close(fastrl.whiten(huge), torch.tensor([0.0, -1.0, 1.0]))
    torch.testing.assert_close(ref.whiten(huge), torch.tensor([0.0, -1.0, 1.0]))
    tiny = torch.tensor([1e-30, -1e-30, 3e-30], dtype=torch.float64)  # var 4e-60 << eps
    expected = torch.tensor([0.0, -2e-30, 2e-30], dtype=torch.float64) / math.sqrt(4e-60 + 1e-8)
    torch.testing.assert_close(fastrl.whiten(tiny).double(), expected, rtol=1e-6, atol=1e-40)
    torch.testing.assert_close(ref.whiten(tiny).double(), expected, rtol=1e-6, atol=1e-40)
    offset = 1e7 + torch.tensor([0.0, 1.0, 2.0, 3.0])  # exact in fp32; mean 1e7 + 1.5
    expected = (torch.tensor([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(5 / 3 + 1e-8)).float()
    torch.testing.assert_close(fastrl.whiten(offset), expected)


@pytest.mark.parametrize("shift_mean", [True, False])
def test_whiten_empty_mask_gives_zeros(shift_mean):
    """Nothing counted: zeros (it used to give 1e4 * x), whatever the masked entries hold."""
    x = torch.tensor([1.0, 2.0, math.nan, -math.inf, 3.0])
    for mask in (torch.zeros(5, dtype=torch.bool), torch.zeros(5)):
        out = fastrl.whiten(x, mask, shift_mean=shift_mean)
        assert torch.equal(out, torch.zeros(5))
        assert torch.equal(ref.whiten(x, mask, shift_mean=shift_mean), torch.zeros(5))


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 1e30])
def test_whiten_masked_entries_do_not_reach_the_statistics(bad):
    """A NaN / inf / huge value at a masked entry stays at that entry (it used to make the whole
    output NaN)."""
    x = torch.tensor([1.0, bad, 3.0, 4.0])
    mask = torch.tensor([True, False, True, True])
    out = fastrl.whiten(x, mask)
    expected = fastrl.whiten(torch.tensor([1.0, 0.0, 3.0, 4.0]), mask)
    counted = mask.clone()
    torch.testing.assert_close(out[counted], expected[counted])
    torch.testing.assert_close(ref.whiten(x, mask)[counted], expected[counted])
    assert torch.isfinite(out[counted]).all()


def test_group_advantages_are_scale_safe_in_float64():
    """±1e200 in fp64: σ_g² overflows when formed directly (the result used to be 0)."""
    r = torch.tensor([1e200, -1e200, 3e200, -3e200], dtype=torch.float64)
    a = 1 / math.sqrt(2)  # (R - μ) / σ for a pair {x, -x}
    out = fastrl.group_advantages(r, 2, eps=0.0)
    torch.testing.assert_close(out, torch.tensor([a, -a, a, -a]))
    torch.testing.assert_close(ref.group_advantages(r, 2, eps=0.0), out)
    rloo = fastrl.group_advantages(r, 2, estimator="rloo", scale="group", eps=0.0)
    torch.testing.assert_close(rloo, 2 * out)
    batch_sd = math.sqrt(20 / 3)  # of {1, -1, 3, -3} (units of 1e200), mean 0
    expected = torch.tensor([1.0, -1, 3, -3]) / batch_sd
    batch = fastrl.group_advantages(r, 2, scale="batch", eps=0.0)
    torch.testing.assert_close(batch, expected)
    torch.testing.assert_close(ref.group_advantages(r, 2, scale="batch", eps=0.0), expected)
    # reinforce++: centred R = R here (pairs {x, -x}), whitened over the batch: not inf / 0
    pp = fastrl.group_advantages(r, 2, estimator="reinforce++")
    torch.testing.assert_close(pp, expected)
    torch.testing.assert_close(ref.group_advantages(r, 2, estimator="reinforce++"), expected)
    equal = torch.full((4,), 2e200, dtype=torch.float64)  # all-equal groups: exactly 0
    assert torch.equal(fastrl.group_advantages(equal, 2), torch.zeros(4))


def test_reinforce_pp_with_an_all_zero_mask_gives_zeros():
    """It used to give ±5000 (= centred R / sqrt(1e-8)) on every token."""
    r = torch.tensor([1.0, 0.0, 1.0, 2.0])
    for mask in (torch.zeros(4, 3), torch.zeros(4, 3, dtype=torch.bool)):
        out = fastrl.group_advantages(r, 2, estimator="reinforce++", mask=mask)
        assert torch.equal(out, torch.zeros(4, 3))
        expected = ref.group_advantages(r, 2, estimator="reinforce++", mask=mask)
        assert torch.equal(expected, torch.zeros(4, 3))


def test_group_ids_on_meta_is_a_clear_error():
    ids = torch.zeros(4, dtype=torch.long, device="meta")
    with pytest.raises(ValueError, match="group_ids.*meta.*cpu"):
        fastrl.group_advantages(torch.randn(4), group_ids=ids)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_gae_masked_nonfinite_never_reaches_counted_tokens(engine, bad):
    """A NaN / inf reward or value at a masked token (e.g. a tool-output token) changes nothing
    at the counted tokens nor the whitening, on every backend (the Triton scan used to turn the
    whole row NaN: 0 * NaN). `check` only looks at counted tokens."""
    device, _ = engine
    rewards, values, mask = (x.to(device) for x in _inputs(3, 37, 0.6, seed=3))
    mask[1] = False  # a fully masked row
    expected, _ = ref.gae(rewards.cpu(), values.cpu(), mask.cpu(), 0.99, 0.95)
    poisoned_r, poisoned_v = rewards.clone(), values.clone()
    poisoned_r[~mask] = bad
    poisoned_v[~mask] = bad
    for whiten in (True, False):
        adv, ret = fastrl.gae(poisoned_r, poisoned_v, mask, 0.99, 0.95, whiten=whiten)
        clean, clean_ret = fastrl.gae(rewards, values, mask, 0.99, 0.95, whiten=whiten)
        torch.testing.assert_close(adv, clean, atol=1e-6, rtol=1e-6)  # every token
        torch.testing.assert_close(ret[mask], clean_ret[mask], atol=1e-6, rtol=1e-6)
    adv, _ = fastrl.gae(poisoned_r, poisoned_v, mask, 0.99, 0.95)
    torch.testing.assert_close(adv.cpu(), expected, atol=1e-5, rtol=1e-5)
    ref_adv, _ = ref.gae(poisoned_r.cpu(), poisoned_v.cpu(), mask.cpu(), 0.99, 0.95)
    torch.testing.assert_close(ref_adv, expected)
    with pytest.raises(ValueError, match="rewards.*counted"):
        bad_counted = rewards.clone()
        bad_counted[0, mask[0].nonzero()[0, 0]] = math.nan
        fastrl.gae(bad_counted, values, mask)


@pytest.mark.parametrize("name", ["rewards", "values"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf])
def test_gae_refuses_infinity_at_a_counted_token(name, bad):
    """An infinite reward or value at a counted token makes every earlier advantage infinite and
    any whitening NaN; on the CPU the blocked scan also gave NaN at the later tokens of its row
    (inf - inf), where the math has finite values. check=True names it; check=False runs."""
    rewards, values, mask = _inputs(2, 40, 1.0, seed=1)
    x = {"rewards": rewards, "values": values}
    x[name][0, 10] = bad
    with pytest.raises(
        ValueError, match=f"{name} \\(shape \\(2, 40\\)\\) contains NaN or inf at a"
    ):
        fastrl.gae(x["rewards"], x["values"], mask, whiten=False)
    mask[0, 10] = False  # the same value where the mask excludes it: no error, nothing reached
    adv, _ = fastrl.gae(x["rewards"], x["values"], mask, whiten=False)
    assert torch.isfinite(adv).all()
    fastrl.gae(x["rewards"], x["values"], mask | True, whiten=False, check=False)


def test_gae_fractional_mask_masked_nan():
    rewards, values, _ = _inputs(2, 12, 1.0)
    mask = torch.rand(2, 12)
    mask[:, ::3] = 0.0
    clean, _ = fastrl.gae(rewards, values, mask, 0.9, 0.8)
    rewards[:, ::3] = math.nan
    values[:, ::3] = math.nan
    adv, _ = fastrl.gae(rewards, values, mask, 0.9, 0.8)
    torch.testing.assert_close(adv, clean)
    torch.testing.assert_close(ref.gae(rewards, values, mask, 0.9, 0.8)[0], clean)


def test_gae_kernel_masked_nan_across_blocks():
    """The Triton scan's block carry (next_v from a block's first step) with a NaN there."""
    from fastrl.kernels.gae import gae_scan

    rewards, values, mask = _inputs(2, 48, 0.7, seed=5)
    mask[:, 16] = False  # the first step of the second block of 16
    mask[:, 32] = False
    expected = spec_gae_loop(rewards.tolist(), values.tolist(), mask.float().tolist(), 0.9, 0.7)
    rewards[~mask] = math.nan
    values[~mask] = math.nan
    adv = gae_scan(rewards, values, mask.float(), 0.9, 0.7, block_t=16)
    torch.testing.assert_close(adv.double(), expected, atol=1e-5, rtol=1e-5)


def test_flags_must_be_bools_and_packed_boundaries_are_checked_first():
    """A string flag read as True ("False" whitened, shift_mean="False" subtracted the mean);
    group_advantages with a cu_seqlens that is no (S + 1,) int tensor read its last entry first
    (a raw IndexError / "only one element tensors" from torch)."""
    x = torch.tensor([11.0, 12.0, 13.0])
    r, v, m = torch.randn(2, 4), torch.randn(2, 4), torch.ones(2, 4, dtype=torch.bool)
    for call, name in (
        (lambda: fastrl.whiten(x, shift_mean="False"), "shift_mean"),
        (lambda: fastrl.gae(r, v, m, whiten="no"), "whiten"),
        (lambda: fastrl.gae(r, v, m, check=1), "check"),
        (lambda: fastrl.group_advantages(x, group_size=3, check="no"), "check"),
    ):
        with pytest.raises(ValueError, match=f"{name} must be a bool"):
            call()
    import numpy as np  # numpy's bools are bools

    torch.testing.assert_close(fastrl.whiten(x, shift_mean=np.bool_(False)),
                               fastrl.whiten(x, shift_mean=False))  # fmt: skip
    for bad in (torch.tensor(3), torch.tensor([], dtype=torch.long), torch.tensor([[0, 1, 3]])):
        with pytest.raises(ValueError, match=r"cu_seqlens must be an int32 / int64 tensor"):
            fastrl.group_advantages(torch.tensor([1.0, 0.0]), group_size=2, cu_seqlens=bad)
