"""The per-token terms kernel (kernels/policy_terms.py) against the torch math it replaces on the
Triton backend: `ops.policy_output` (loss, kl, ratio and metrics of a token-separable loss from
logp and H in one O(N) launch) must give what `terms.policy_output` gives, option by option, on
odd sizes, fractional / empty masks, NaNs the mask excludes and NaNs it does not."""

from __future__ import annotations

import pytest
import torch
from conftest import INTERPRET
from test_one_pass import CASES

from fastrl import ops, terms
from fastrl._inputs import prepare_policy_inputs

needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")


@pytest.fixture(
    params=[
        pytest.param("cpu", marks=needs_interpreter),
        pytest.param("cuda", marks=pytest.mark.gpu),
    ]
)
def device(request):
    """cpu: the kernel in Triton's interpreter; cuda (`-m gpu`): compiled, where min / max and
    NaNs behave as the hardware's instructions do."""
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return request.param


def _per_token(B, T, seed=0, mask="frac", device="cpu"):
    """logp, H and the per-token inputs of a (B, T) batch whose log-ratios straddle every clip."""
    g = torch.Generator().manual_seed(seed)
    logp = -torch.rand(B, T, generator=g) * 4
    spread = (torch.rand(B, T, generator=g) - 0.5) * 1.4
    m = (torch.rand(B, T, generator=g) > 0.3) * (0.5 + torch.rand(B, T, generator=g))
    if mask == "bool":
        m = m > 0
    elif mask == "empty":
        m = torch.zeros(B, T)
    out = dict(
        logp=logp,
        entropy=torch.rand(B, T, generator=g) * 3,
        advantages=torch.randn(B, generator=g),
        old_logp=logp - spread,
        ref_logp=logp + spread.flip(-1),
        rollout_logp=logp - spread + 0.3 * torch.randn(B, T, generator=g),
        mask=m,
    )
    return {k: v.to(device) for k, v in out.items()}


def _outputs(inp, kw, backend, monkeypatch, **extra):
    """(ops.policy_output on `backend`, terms.policy_output) of the same inputs."""
    monkeypatch.setenv("FASTRL_BACKEND", backend)
    kw = dict(kw)
    config = kw.pop("config", None)
    rest = {k: v for k, v in inp.items() if k not in ("logp", "entropy")}
    if "rollout_is" not in kw:
        rest.pop("rollout_logp")
    rest.update(extra)
    x = prepare_policy_inputs(
        None, None, rest.pop("advantages"), rest.pop("old_logp", None), rest.pop("ref_logp"),
        rest.pop("mask"), rest.pop("rollout_logp", None), config, kw, per_token=inp["logp"],
        **rest,
    )  # fmt: skip
    logp = inp["logp"].reshape(x.mask.shape)
    entropy = inp["entropy"].reshape(x.mask.shape)
    with torch.no_grad():
        return ops.policy_output(logp, entropy, x), terms.policy_output(logp, entropy, x)


def _assert_same(a, b):
    """Equal to fp32 rounding: k3 = e^x - x - 1 keeps an ulp of e^x (atol 2e-6 at |x| ~ 1);
    sums over thousands of tokens in another order, and on a GPU exp2 / division to about 2 ulp
    (rtol 2e-5)."""
    close = lambda u, v, what: torch.testing.assert_close(  # noqa: E731
        u, v, rtol=2e-5, atol=2e-6, equal_nan=True, msg=lambda m: f"{what}: {m}"
    )
    close(a.loss, b.loss, "loss")
    for name in ("logp", "entropy", "kl", "ratio"):
        u, v = getattr(a, name), getattr(b, name)
        assert u.shape == v.shape and u.dtype == v.dtype == torch.float32, name
        close(u, v, name)
    assert list(a.metrics) == list(b.metrics)  # the same names, in the same order
    for k in a.metrics:
        assert a.metrics[k].shape == () and not a.metrics[k].requires_grad, k
        close(a.metrics[k], b.metrics[k], f"metric {k}")


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("B,T", [(3, 8), (5, 517)], ids=["one-program", "three-programs"])
def test_terms_kernel_matches_torch(case, B, T, device, monkeypatch, launched):
    """Every token-separable option of test_one_pass, on one program and on several (N = 2585
    tokens: partial sums added on the device); the kernel ran (not the torch fallback)."""
    inp = _per_token(B, T, device=device)
    fused, torch_math = _outputs(inp, CASES[case], "triton", monkeypatch)
    _assert_same(fused, torch_math)
    assert [name for name, *_ in launched] == ["_policy_terms_fwd_kernel"]
    assert torch.isfinite(fused.loss) and fused.metrics["ratio_max"] > 1


@pytest.mark.parametrize("mask", ["bool", "empty"])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_terms_kernel_masks_and_counts(mask, agg, device, monkeypatch):
    """Bool and empty masks (nothing counted: loss 0 and metrics 0, never NaN), each aggregation,
    global counts as tensors; NaN / inf at tokens the mask excludes reach nothing."""
    inp = _per_token(4, 33, seed=1, mask=mask, device=device)
    out = inp["mask"] == 0
    inp["logp"] = inp["logp"].masked_fill(out, float("nan"))
    inp["old_logp"] = inp["old_logp"].masked_fill(out, float("inf"))
    inp["entropy"] = inp["entropy"].masked_fill(out, float("nan"))
    kw = dict(config="grpo", agg=agg, entropy_coef=0.01, clip_dual=2.0)
    kw.update(num_tokens=torch.tensor(50.0, device=device), num_seqs=torch.tensor(3.0))
    fused, torch_math = _outputs(inp, kw, "triton", monkeypatch)
    _assert_same(fused, torch_math)
    assert torch.isfinite(fused.loss)
    assert all(torch.isfinite(v) for v in fused.metrics.values())
    if mask == "empty":
        assert fused.loss == 0 and all(v == 0 for v in fused.metrics.values())
        assert torch.equal(fused.ratio, torch.ones_like(fused.ratio))


@pytest.mark.parametrize("where", ["logp", "old_logp"])
@pytest.mark.parametrize("config", ["grpo", "dapo", "cispo", "sapo"])
def test_terms_kernel_nan_where_it_counts(config, where, device, monkeypatch):
    """A NaN log-prob (or old log-prob) at a counted token makes the loss and the metrics that
    read it NaN (the largest ratio included), as the torch math does: never a finite number
    (the kernel's min / max / clamp keep NaNs, as torch's do)."""
    inp = _per_token(2, 40, seed=2, mask="bool", device=device)
    counted = tuple(inp["mask"].nonzero()[0])
    inp[where][counted] = float("nan")
    kw = dict(config=config) if config != "sapo" else dict(policy="sapo")
    fused, torch_math = _outputs(inp, kw, "triton", monkeypatch)
    _assert_same(fused, torch_math)
    assert fused.loss.isnan() and fused.metrics["ratio_max"].isnan()
    assert fused.ratio[counted].isnan() and fused.metrics["approx_kl"].isnan()


@pytest.mark.parametrize("kw", [dict(config="dapo"), dict(kl_coef=0.1, kl_estimator="k1")])
def test_terms_kernel_minus_inf_logp(kw, device, monkeypatch):
    """A counted token whose log-prob is -inf (its logit -inf: a masked vocabulary entry
    sampled): the ratio's clamp keeps the loss finite in torch, and so here (a 1 formed as
    1 + 0 * logp was NaN there)."""
    inp = _per_token(2, 16, seed=4, mask="bool", device=device)
    counted = tuple(inp["mask"].nonzero()[0])
    inp["logp"][counted] = float("-inf")
    fused, torch_math = _outputs(inp, kw, "triton", monkeypatch)
    _assert_same(fused, torch_math)
    assert torch.isfinite(fused.loss) if "kl_coef" not in kw else fused.loss == float("-inf")


@pytest.mark.parametrize("policy", ["cispo", "sapo", "reinforce"])
def test_terms_kernel_dual_clip_is_ppos(policy, device, monkeypatch):
    """clip_dual is ppo's: with another policy nothing is dual-clipped (dualclip_frac 0)."""
    inp = _per_token(3, 40, seed=5, device=device)
    fused, torch_math = _outputs(inp, dict(policy=policy, clip_dual=1.05), "triton", monkeypatch)
    _assert_same(fused, torch_math)
    assert fused.metrics["dualclip_frac"] == 0


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("count", [0.0, float("nan"), float("inf")])
def test_terms_kernel_bad_count_with_nothing_counted(agg, count, device, monkeypatch):
    """A num_seqs tensor that is not a finite number > 0 makes the loss NaN even when nothing
    counts (aggregate divides by it; every c_t is 0 there): never a finite loss from it."""
    inp = _per_token(3, 8, mask="empty", device=device)
    kw = dict(config="grpo", agg=agg, num_seqs=torch.tensor(count, device=device))
    fused, torch_math = _outputs(inp, kw, "triton", monkeypatch)
    _assert_same(fused, torch_math)
    assert fused.loss.isnan()
    kw["num_seqs"] = torch.tensor(2.0, device=device)
    fused, _ = _outputs(inp, kw, "triton", monkeypatch)
    assert fused.loss == 0


def test_terms_kernel_ratio_max_is_over_counted_tokens(device, monkeypatch):
    """ratio_max is the largest ratio of the COUNTED tokens: with every counted ratio below 1,
    neither the lanes past N (N = 35 tokens of a 1024-token program, r = 1 there) nor masked
    tokens with large ratios may raise it to 1 or beyond."""
    inp = _per_token(5, 7, seed=2, device=device)
    g = torch.Generator().manual_seed(2)
    inp["old_logp"] = inp["logp"] + (0.1 + torch.rand(5, 7, generator=g)).to(device)  # r < 0.91
    out = inp["mask"] == 0
    assert out.any() and not out.all()
    # masked old_logp is zeroed on the way in: logp = 2 makes r = e^2 at the masked tokens
    inp["logp"] = inp["logp"].masked_fill(out, 2.0)
    fused, torch_math = _outputs(inp, dict(config="grpo"), "triton", monkeypatch)
    _assert_same(fused, torch_math)
    assert fused.metrics["ratio_max"] < 0.91


def test_terms_kernel_zero_advantages_are_never_clipped(device, monkeypatch):
    """Per-token advantages with exact zeros on tokens whose ratios lie outside the clip range on
    both sides: an A = 0 token counts in neither clipfrac_low nor clipfrac_high (SPEC 2: the
    shares with A < 0 / A > 0), in the kernel as in the torch math."""
    inp = _per_token(3, 40, seed=4, mask="bool", device=device)
    g = torch.Generator().manual_seed(4)
    adv = torch.randn(3, 40, generator=g)
    adv[:, ::2] = 0.0  # every other token: A = 0, with ratios up to e^0.7 and down to e^-0.7
    inp["advantages"] = adv.to(device)
    fused, torch_math = _outputs(inp, dict(config="grpo", clip_dual=3.0), "triton", monkeypatch)
    _assert_same(fused, torch_math)
    r, m, a = fused.ratio, inp["mask"], inp["advantages"]
    assert ((a == 0) & m & ((r > 1.2) | (r < 0.8))).sum() >= 10  # the case is exercised
    want_high = ((a > 0) & m & (r > 1.2)).sum() / m.sum()
    want_low = ((a < 0) & m & (r < 0.8)).sum() / m.sum()
    torch.testing.assert_close(fused.metrics["clipfrac_high"], want_high.float())
    torch.testing.assert_close(fused.metrics["clipfrac_low"], want_low.float())


@needs_interpreter
def test_terms_kernel_flat_and_packed(monkeypatch, launched):
    """Flat (N,) inputs and packed sequences (cu_seqlens, per-sequence advantages): the weights
    c_t carry the sequences, the kernel runs on the flat rows."""
    inp = {k: v.reshape(-1) for k, v in _per_token(1, 30, seed=3).items() if k != "advantages"}
    inp["advantages"] = torch.tensor([0.5, -1.0, 2.0])
    cu = torch.tensor([0, 7, 19, 30])
    kw = dict(config="grpo", entropy_coef=0.02)
    fused, torch_math = _outputs(inp, kw, "triton", monkeypatch, cu_seqlens=cu)
    _assert_same(fused, torch_math)
    assert fused.kl.shape == (30,) and [n for n, *_ in launched] == ["_policy_terms_fwd_kernel"]
    inp["advantages"] = torch.randn(30)
    _assert_same(*_outputs(inp, dict(config="dapo"), "triton", monkeypatch))


@needs_interpreter
def test_torch_math_where_the_kernel_does_not_apply(monkeypatch, launched):
    """Sequence-level options, a gradient wanted through logp (policy_loss_from_logprobs) and the
    torch backend keep the torch math (no launch)."""
    inp = _per_token(3, 8)
    _assert_same(*_outputs(inp, dict(config="gspo"), "triton", monkeypatch))
    kw = dict(config="grpo", rollout_is="sequence", rollout_is_cap=2.0)
    _assert_same(*_outputs(inp, kw, "triton", monkeypatch))
    # a sequence-ratio bias correction of the kl: with kl_coef = 0 the loss is token-separable,
    # but its kl output and metric are not
    kw = dict(kl_coef=0.0, kl_bias_correction=True, kl_bias_ratio="sequence")
    _assert_same(*_outputs(inp, kw, "triton", monkeypatch))
    _assert_same(*_outputs(inp, dict(config="grpo"), "torch", monkeypatch))
    assert launched == []
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    x = prepare_policy_inputs(
        None, None, inp["advantages"], inp["old_logp"], inp["ref_logp"], inp["mask"], None,
        "grpo", {}, per_token=inp["logp"],
    )  # fmt: skip
    logp = inp["logp"].clone().requires_grad_()
    out = ops.policy_output(logp, inp["entropy"], x)
    out.loss.backward()
    assert launched == [] and logp.grad.abs().sum() > 0
