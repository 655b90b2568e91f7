"""fastrl.policy_loss (fused) against fastrl.reference.policy_loss: forward and backward.

Every check runs on both CPU paths (the chunked torch path and the Triton kernels in the
interpreter, FASTRL_BACKEND=triton) and, with `-m gpu`, on CUDA. The reference always runs in
fp32 on an upcast copy of the same logits; the dtype -> tolerance table is TOL.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import fastrl
from fastrl import chunked, ops
from fastrl import reference as R
from fastrl.config import PRESETS, LossConfig

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

# dtype -> (rtol, atol) for the forward values and, separately, for the gradient (relative to
# its largest entry: a bf16 / fp16 gradient is stored in the logits' dtype).
TOL = {
    torch.float32: dict(fwd=(1e-5, 1e-5), grad=(1e-5, 5e-6)),
    torch.bfloat16: dict(fwd=(1e-4, 1e-4), grad=(1e-2, 8e-3)),
    torch.float16: dict(fwd=(1e-4, 1e-4), grad=(2e-3, 1e-3)),
}


def make_batch(
    B, T, V, dtype=torch.float32, device="cpu", seed=0, mask_p=0.25, extra_t=0, rollout=False
):
    """Random logits (B, T + extra_t, V) and per-token inputs whose ratios straddle the clips."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(B, T + extra_t, V, generator=g) * 2.0).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp, _ = R.token_logprobs(logits[:, :T], tokens)
    noise = lambda s: s * torch.randn(B, T, generator=g)  # noqa: E731
    batch = dict(
        logits=logits,
        tokens=tokens,
        advantages=torch.randn(B, generator=g),
        old_logp=logp + noise(0.3),
        ref_logp=logp + noise(0.3),
        mask=torch.rand(B, T, generator=g) > mask_p,
    )
    if rollout:
        batch["rollout_logp"] = batch["old_logp"] + noise(0.5)
    return {k: v.to(device) for k, v in batch.items()}


def run_both(batch, view=None, inplace=False, **kwargs):
    """Fused and reference outputs and d loss / d logits (on the full logits tensor)."""
    view = view or (lambda x: x)
    logits = batch["logits"]
    rest = {k: v for k, v in batch.items() if k != "logits"}
    xf = logits.detach().clone().requires_grad_()
    xr = logits.detach().float().clone().requires_grad_()
    lf = view(xf * 1.0) if inplace else view(xf)  # in-place needs a non-leaf to overwrite
    out_f = fastrl.policy_loss(lf, **rest, inplace=inplace, **kwargs)
    out_f.loss.backward()
    out_r = R.policy_loss(view(xr), **rest, **kwargs)
    out_r.loss.backward()
    return out_f, masked_outputs(out_r, rest.get("mask")), xf.grad, xr.grad


def masked_outputs(out, mask):
    """The reference's output with its per-token logp / entropy / kl set to 0 where `mask` is 0:
    what fastrl's fused losses report there (a masked row is not read). The oracle computes
    every row; the loss, metrics and gradient are compared unchanged."""
    if mask is None:
        return out
    counted = mask.to(out.logp.device) > 0
    for name in ("logp", "entropy", "kl"):
        setattr(out, name, torch.where(counted, getattr(out, name), 0.0))
    return out


def assert_match(out_f, out_r, grad_f, grad_r, dtype=torch.float32, grad_scale=None):
    rtol, atol = TOL[dtype]["fwd"]
    close = lambda a, b, msg: torch.testing.assert_close(  # noqa: E731
        a.float().cpu(), b.float().cpu(), rtol=rtol, atol=atol, equal_nan=True, msg=msg
    )
    close(out_f.loss.detach(), out_r.loss.detach(), lambda m: f"loss: {m}")
    assert out_f.loss.dim() == 0 and out_f.loss.dtype == torch.float32
    for name in ("logp", "entropy", "kl"):
        a, b = getattr(out_f, name), getattr(out_r, name)
        assert a.shape == b.shape and not a.requires_grad, name
        close(a, b, lambda m, n=name: f"{n}: {m}")
    assert set(out_f.metrics) == set(out_r.metrics)
    for k, v in out_f.metrics.items():
        assert v.dim() == 0 and not v.requires_grad, k
        close(v, out_r.metrics[k], lambda m, k=k: f"metric {k}: {m}")
    rtol, atol = TOL[dtype]["grad"]
    assert grad_f.dtype == dtype and grad_f.shape == grad_r.shape
    scale = grad_scale or grad_r.abs().max().item() or 1.0
    torch.testing.assert_close(
        grad_f.float().cpu(), grad_r.cpu(), rtol=rtol, atol=atol * scale, msg=lambda m: f"grad: {m}"
    )


# --------------------------------------------------------------------------- presets and options
@pytest.mark.parametrize("preset", PRESETS)
def test_presets(engine, preset):
    device, _ = engine
    batch = make_batch(3, 6, 37, device=device, seed=hash(preset) % 1000)
    out = run_both(batch, config=preset, entropy_coef=0.01)
    assert_match(*out)
    if preset == "grpo":
        assert out[0].metrics["kl"].abs() > 0


OPTIONS = {
    "sapo": dict(policy="sapo"),
    "reinforce": dict(policy="reinforce"),
    "cispo": dict(policy="cispo", clip_low=1.0, clip_high=0.3),
    "dual_clip": dict(clip_dual=1.5, clip_low=0.05),
    "clip_delta": dict(clip_delta=1.3, clip_high=0.1),
    "seq_ratio": dict(ratio_level="sequence", clip_low=0.05, clip_high=0.05),
    "k1": dict(kl_coef=0.1, kl_estimator="k1"),
    "k2": dict(kl_coef=0.1, kl_estimator="k2"),
    "k3": dict(kl_coef=0.1, kl_estimator="k3"),
    "low_var_kl": dict(kl_coef=0.1, kl_estimator="low_var_kl"),
    "abs": dict(kl_coef=0.1, kl_estimator="abs"),
    "kl_bias_corr": dict(kl_coef=0.1, kl_estimator="k3", kl_bias_correction=True),
    "entropy": dict(entropy_coef=0.05),
    "temperature": dict(temperature=0.7, entropy_coef=0.02),
    "is_token_trunc": dict(rollout_is="token", rollout_is_cap=1.5),
    "is_token_mask": dict(rollout_is="token", rollout_is_mode="mask", rollout_is_cap=1.5),
    "is_seq_trunc": dict(rollout_is="sequence", rollout_is_cap=3.0),
    "is_seq_mask": dict(rollout_is="sequence", rollout_is_mode="mask", rollout_is_cap=3.0),
    "agg_tok_mean_num": dict(agg="token-mean", num_tokens=40),
    "agg_seq_mean": dict(agg="seq-mean-token-mean", num_seqs=5),
    "agg_seq_sum": dict(agg="seq-mean-token-sum"),
    "agg_seq_sum_norm": dict(agg="seq-mean-token-sum-norm", max_len=9, num_seqs=4),
    "on_policy": dict(old_logp=None),
    "on_policy_seq": dict(old_logp=None, ratio_level="sequence", agg="seq-mean-token-mean"),
    "everything": dict(
        clip_dual=2.0,
        kl_coef=0.05,
        kl_estimator="low_var_kl",
        kl_bias_correction=True,
        entropy_coef=0.01,
        temperature=1.3,
        rollout_is="token",
        agg="seq-mean-token-mean",
    ),
}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_options(engine, name):
    device, _ = engine
    opts = dict(OPTIONS[name])
    batch = make_batch(
        3, 5, 29, device=device, seed=len(name), rollout=bool(opts.get("rollout_is"))
    )
    if "old_logp" in opts:
        batch["old_logp"] = opts.pop("old_logp")
    out = run_both(batch, **opts)
    assert_match(*out)


def test_k3_bias_correction_far_from_the_reference(engine):
    """k3 * r (token-level bias correction) where ref - logp = x reaches 30: inside the ratio's
    clamp d(k3 r)/dlogp = (1 - e^x) r + (e^x - x - 1) r = -x r, two terms of size e^x r that
    cancel. Summed in fp32 that gradient was off by up to 96 % of the largest entry (on a token
    whose true one is 3e-2, 7.96); formed as -x r it matches float64 autograd of the formula, on
    both backends, the one-pass kernel included, and the reference; also on a token outside the
    clamp (|logp - old| > 20, where it is (1 - e^x) r)."""
    device, _ = engine
    B, T, V = 2, 5, 16
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(B, T, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, T, generator=g)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, tokens[..., None])[..., 0]
    shift = torch.tensor([[25.0, -25.0, 3.0, -3.0, 12.0], [0.5, -0.5, 30.0, -30.0, 28.0]])
    old = (logp + shift / 10).float()
    old[1, 4] = (logp[1, 4] + 24.0).float()  # log r = -24: outside the clamp
    ref = (logp + shift).float()
    cfg = LossConfig(kl_coef=0.1, kl_estimator="k3", kl_bias_correction=True)
    z64 = logits.double().requires_grad_()
    lp = torch.log_softmax(z64, -1).gather(-1, tokens[..., None])[..., 0]
    r = torch.exp(torch.clamp(lp - old.double(), -20, 20))
    pg = torch.maximum(-adv.double() * r, -adv.double() * r.clamp(0.8, 1.2))
    # k3 r = e^x r - (x + 1) r, and inside the clamp e^x r = e^(ref - old), a constant: written
    # so, float64's own autograd has no cancellation either (summed, it keeps ~1e-4 at x = 30)
    x, log_r = ref.double() - lp, lp - old.double()
    inside = log_r.abs() <= 20
    e_x_r = torch.where(inside, torch.exp(ref.double() - old.double()), torch.exp(x) * r)
    ((pg + 0.1 * (e_x_r - (x + 1) * r)).mean()).backward()
    for name, fn in (("fastrl", fastrl.policy_loss), ("reference", R.policy_loss)):
        on = device if name == "fastrl" else "cpu"
        z = logits.clone().to(on).requires_grad_()
        args = (tokens, adv, old, ref)
        fn(z, *(t.to(on) for t in args), config=cfg).loss.backward()
        # each row against its own scale (the rows' gradients span 1e-2 to 30)
        err = (z.grad.double().cpu() - z64.grad).abs().amax(-1) / z64.grad.abs().amax(-1)
        assert err.max() < 1e-5, f"{name}: a row's gradient off by {err.max():.1e} of its size"


@pytest.mark.parametrize("seq_ratio_grad", ["mean", "token"])
def test_k3_sequence_bias_correction_far_from_the_reference(engine, seq_ratio_grad):
    """k3 * r with the sequence ratio (kl_bias_ratio="sequence"): where log r's gradient in a
    token's own logp is 1 (GSPO-token's sequence ratio, every length; the mean sequence ratio of
    a sequence with one counted token of weight >= 1) the same two e^x r terms cancel as at token
    level. Against float64 autograd of k3 r written as e^(x + log r) - (x + 1) r (no
    cancellation in float64 either: its exponent x_t + log r is written as ref_t + (c_t - 1)
    logp_t + (the rest of log r, without logp_t), c_t = ∂ log r / ∂ logp_t), with advantages 0
    (the KL term alone) and rows of one counted token (weight 2: c = 2 / 2 = 1; weight 0.5:
    c = 0.5 / max(0.5, 1), no cancellation) and of several."""
    device, _ = engine
    B, T, V = 4, 5, 16
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(B, T, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv = torch.zeros(B, T)
    logp = torch.log_softmax(logits.double(), -1).gather(-1, tokens[..., None])[..., 0]
    shift = torch.tensor(
        [[25.0, -25.0, 3.0, -3.0, 12.0], [0.5, -0.5, 30.0, -30.0, 28.0],
         [20.0, 1.0, -2.0, 18.0, 0.3], [-1.0, 26.0, 2.0, -4.0, 9.0]]
    )  # fmt: skip
    mask = torch.ones(B, T)
    mask[0] = torch.tensor([0.0, 0.0, 0.0, 0.0, 2.0])  # x = 12 on its one counted token
    mask[1] = torch.tensor([0.0, 0.0, 0.5, 0.0, 0.0])  # x = 30, weight 0.5
    old = (logp + shift / 10).float()
    ref = (logp + shift).float()
    cfg = LossConfig(ratio_level="sequence", seq_ratio_grad=seq_ratio_grad, kl_coef=0.1,
                     kl_estimator="k3", kl_bias_correction=True, kl_bias_ratio="sequence",
                     agg="token-mean")  # fmt: skip
    z64 = logits.double().requires_grad_()
    lp = torch.log_softmax(z64, -1).gather(-1, tokens[..., None])[..., 0]
    lengths = mask.sum(-1, keepdim=True).clamp(min=1)  # max(|y_i|, 1)
    log_r = (mask * (lp - old.double())).sum(-1, keepdim=True) / lengths
    log_r = log_r.expand(B, T)
    if seq_ratio_grad == "token":
        log_r = log_r.detach() + lp - lp.detach()
        c, rest = torch.ones(B, T), (log_r - lp).detach()
    else:  # rest_t = Σ_{u != t} m_u logp_u / L - Σ m old / L: no path to logp_t
        others = 1 - torch.eye(T, dtype=torch.float64)
        rest = ((mask * lp) @ others - (mask * old.double()).sum(-1, keepdim=True)) / lengths
        c = mask / lengths
    r = torch.exp(torch.clamp(log_r, -20, 20))
    x = ref.double() - lp
    exponent = ref.double() + (c - 1) * lp + rest  # = x + log r
    e_x_r = torch.where(log_r.abs() <= 20, torch.exp(exponent), torch.exp(x) * r)
    ((mask * 0.1 * (e_x_r - (x + 1) * r)).sum() / mask.sum()).backward()
    for name, fn in (("fastrl", fastrl.policy_loss), ("reference", R.policy_loss)):
        on = device if name == "fastrl" else "cpu"
        z = logits.clone().to(on).requires_grad_()
        args = (tokens, adv, old, ref, mask)
        fn(z, *(t.to(on) for t in args), config=cfg).loss.backward()
        err = (z.grad.double().cpu() - z64.grad).abs().amax((-2, -1))
        err = err / z64.grad.abs().amax((-2, -1))
        assert err.max() < 1e-5, f"{name}: a row's gradient off by {err.max():.1e} of its size"


def test_tensor_counts(engine):
    """num_tokens / num_seqs as 0-dim tensors (all-reduced counts) give the same loss."""
    device, _ = engine
    batch = make_batch(2, 4, 19, device=device)
    for agg, key in (("token-mean", "num_tokens"), ("seq-mean-token-mean", "num_seqs")):
        count = torch.tensor(7.0, device=device)
        assert_match(*run_both(batch, agg=agg, **{key: count}))


def test_clip_metrics_fire(engine):
    """The battery's inputs really exercise the clip branches (so the metric checks can fail)."""
    device, _ = engine
    batch = make_batch(4, 8, 23, device=device, mask_p=0.0)
    out_f, *_ = run_both(batch, clip_dual=1.2)
    m = out_f.metrics
    assert 0 < m["clipfrac_low"] < 1 and 0 < m["clipfrac_high"] < 1
    assert m["dualclip_frac"] > 0 and m["ratio_max"] > 1.2


# --------------------------------------------------------------------------- dtypes and shapes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_dtypes(engine, dtype):
    device, _ = engine
    batch = make_batch(2, 5, 300, dtype=dtype, device=device)
    assert_match(*run_both(batch, config="grpo", entropy_coef=0.01), dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    "kw",
    [
        dict(config="gspo", agg="seq-mean-token-sum"),
        dict(config="grpo", rollout_is="sequence", entropy_coef=0.01, temperature=0.7),
        dict(kl_coef=0.1, kl_bias_correction=True, kl_bias_ratio="sequence"),
    ],
    ids=["gspo", "seq-IS-entropy-tau", "seq-kl-bias"],
)
@pytest.mark.parametrize("how", ["plain", "inplace", "inplace-sliced"])
def test_half_precision_sequence_level_gradient_is_rounded_once(engine, dtype, kw, how):
    """Sequence-level losses take the two-pass path. In bf16 / fp16 the gradient is the fp32
    reference's rounded once to the logits' dtype, as token-level losses' is: the torch path
    used to park e = exp(z' - m) in the half-precision gradient buffer between the passes (fp16
    flushed small probabilities to subnormals or 0: half the entries off, by up to 2x)."""
    device, backend = engine
    batch = make_batch(2, 4, 300, dtype=dtype, device=device, mask_p=0.0, rollout=True, extra_t=1)
    batch["logits"] = batch["logits"] * 2  # a wide range of probabilities
    if "rollout_is" not in kw:
        batch.pop("rollout_logp")
    view = (lambda x: x[:, :-1]) if how == "inplace-sliced" else (lambda x: x[:, :4])
    _, _, got, want = run_both(batch, view=view, inplace=how != "plain", **kw)
    want = want.to(dtype).float()
    got = got.float()
    counted = want != 0
    assert not ((got == 0) & counted).any()  # nothing flushed to 0
    # within one rounding of the exact value (an fp32 last bit can round the other way)
    err = (got - want).abs()[counted] / want.abs()[counted]
    assert err.max() <= torch.finfo(dtype).eps, err.max()
    if backend == "torch" or dtype == torch.float16:  # (Triton's interpreter stores bf16
        assert (got != want).float().mean() < 0.02  # by truncation, token-level losses too)


@pytest.mark.parametrize(
    "B,T,V",
    [(2, 3, 1), (2, 4, 7), (2, 3, 1000), (1, 5, 31), (3, 1, 31)],
    ids=["V1", "V7", "V1000", "B1", "T1"],
)
def test_shapes(engine, B, T, V):
    device, _ = engine
    batch = make_batch(B, T, V, device=device, mask_p=0.0)
    assert_match(*run_both(batch, config="grpo", entropy_coef=0.01))


def test_large_vocab(engine):
    """V > 65536: several BLOCK_V steps per row (tiny N: the interpreter is slow)."""
    device, backend = engine
    B, T = (1, 1) if (backend == "triton" and device == "cpu") else (1, 2)
    batch = make_batch(B, T, 70001, device=device, mask_p=0.0)
    assert_match(*run_both(batch, config="grpo", entropy_coef=0.01))


def test_strided_view_not_copied(engine, monkeypatch):
    """logits[:, :-1] is read in place: the op sees the caller's strides, no copy is made."""
    device, _ = engine
    batch = make_batch(2, 5, 33, device=device, extra_t=1)
    seen = []
    real = ops.policy_loss_grad

    def spy(logits, *args):
        seen.append((logits.data_ptr(), logits.stride()))
        return real(logits, *args)

    monkeypatch.setattr(ops, "policy_loss_grad", spy)
    out = run_both(batch, view=lambda x: x[:, :-1], config="grpo", entropy_coef=0.01)
    assert_match(*out)
    assert seen and seen[0][1] == (6 * 33, 33, 1)  # (T+1)*V row stride: the view itself


def test_flat_inputs_int32_float_mask(engine):
    device, _ = engine
    batch = make_batch(1, 12, 41, device=device)
    flat = {k: v[0] for k, v in batch.items()}
    flat["tokens"] = flat["tokens"].int()
    flat["mask"] = flat["mask"].float() * 1.0
    flat["advantages"] = torch.randn(12, device=device)
    out_f, out_r, gf, gr = run_both(flat, kl_coef=0.1, entropy_coef=0.01)
    assert out_f.logp.shape == (12,)
    assert_match(out_f, out_r, gf, gr)


def test_non_contiguous_vocab_is_copied(engine):
    device, _ = engine
    batch = make_batch(2, 3, 17, device=device)
    out = run_both(batch, view=lambda x: x.transpose(1, 2).contiguous().transpose(1, 2))
    assert_match(*out)


def test_masked_rows_and_all_masked(engine):
    device, _ = engine
    batch = make_batch(3, 4, 13, device=device)
    batch["mask"][1] = False  # one empty sequence
    for agg in ("token-mean", "seq-mean-token-mean"):
        out = run_both(batch, agg=agg, kl_coef=0.1, entropy_coef=0.01)
        assert_match(*out)
        assert (out[2][1] == 0).all()  # masked rows get an exact zero gradient
    batch["mask"][:] = False
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        out_f, out_r, gf, gr = run_both(batch, agg=agg, kl_coef=0.1, entropy_coef=0.01)
        assert out_f.loss.item() == 0.0 and torch.isfinite(gf).all() and (gf == 0).all()
        assert all(torch.isfinite(v) for v in out_f.metrics.values())
        assert_match(out_f, out_r, gf, gr)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", ["grpo", "gspo", "seq_kl_bias"])
def test_masked_rows_report_zero_and_are_not_read(engine, dtype, config, monkeypatch):
    """A token with mask 0 reaches neither the loss nor its gradient, so its row is not read:
    its logp, entropy and kl are reported as exactly 0 and its ratio as 1 (as
    fused_linear_policy_loss reports them), on every backend and path (token-separable and
    sequence-level, with and without gradient, fp16's gradient in the backward, the one-pass
    kernel). NaN logits in the masked rows show that nothing of them is read on the Triton
    path (a read would make that row's logp NaN), and the rest equals the same batch with
    ordinary values there."""
    device, backend = engine
    batch = make_batch(3, 5, 37, device=device, dtype=dtype, mask_p=0.3)
    mask = batch["mask"]
    mask[0, 1] = mask[2, 4] = False
    mask[1, 0] = True
    poisoned = {**batch, "logits": batch["logits"].clone()}
    poisoned["logits"][~mask] = float("nan")
    kw = dict(config=config, kl_coef=0.1, entropy_coef=0.01)
    if config == "seq_kl_bias":  # the sequence's ratio couples its tokens' gradients
        kw.update(config="gspo", kl_bias_correction=True, kl_bias_ratio="sequence")
    for one_pass in ("0", "1"):
        monkeypatch.setenv("FASTRL_ONE_PASS", one_pass)
        clean_f, clean_r, clean_g, clean_gr = run_both(batch, **kw)
        assert_match(clean_f, clean_r, clean_g, clean_gr, dtype=dtype)
        out, _, grad, _ = run_both(poisoned, **kw)
        for name in ("logp", "entropy", "kl"):
            assert (getattr(out, name)[~mask] == 0).all(), name
            assert torch.equal(getattr(out, name), getattr(clean_f, name)), name
        assert (out.ratio[~mask] == 1).all()
        assert torch.equal(out.loss, clean_f.loss)
        assert (grad[~mask] == 0).all() and torch.equal(grad, clean_g)
        for k, v in out.metrics.items():
            assert torch.equal(v, clean_f.metrics[k]), k
        with torch.no_grad():
            rest = {k: v for k, v in poisoned.items() if k != "logits"}
            no_grad = fastrl.policy_loss(poisoned["logits"], **rest, **kw)
        assert (no_grad.logp[~mask] == 0).all() and torch.isfinite(no_grad.loss)
        torch.testing.assert_close(no_grad.logp, out.logp, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", ["grpo", "gspo"])
def test_cpu_skips_runs_of_masked_rows(config, dtype, inplace, monkeypatch):
    """The CPU backend does not read a run of masked rows long enough to pay for a chunk of its
    own (chunked._runs_to_read: the padding at a sequence's end); a scattered masked row is read
    anyway. Only the other rows reach the statistics pass, the skipped rows' gradient is 0, and
    everything equals the reference and a call whose masked rows hold NaN."""
    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    B, T, V = 3, 12, 131072  # a masked run is skipped from 4 rows of 131072 logits on
    batch = make_batch(B, T, V, dtype=dtype, mask_p=0.0)
    mask = batch["mask"]
    mask[0, 7:] = False  # 5 rows of padding: skipped
    mask[1, 3] = False  # one scattered row: read
    mask[2, 2:] = False  # 10 rows: skipped
    assert chunked._runs_to_read(mask, B * T, V) == [(0, 7), (12, 26)]
    seen = []
    real = chunked._chunk_stats

    def spy(rows, *args):
        seen.append(rows.shape[0])
        return real(rows, *args)

    monkeypatch.setattr(chunked, "_chunk_stats", spy)
    kw = dict(config=config, kl_coef=0.1, entropy_coef=0.01, inplace=inplace)
    out = run_both(batch, **kw)
    assert sum(seen) == B * T - 15
    assert_match(*out, dtype=dtype)
    assert (out[2][~mask] == 0).all()
    poisoned = {**batch, "logits": batch["logits"].clone()}
    poisoned["logits"][~mask] = float("nan")
    bad = run_both(poisoned, **kw)
    assert torch.equal(bad[0].loss, out[0].loss) and torch.equal(bad[2], out[2])
    for name in ("logp", "entropy", "kl"):
        assert torch.equal(getattr(bad[0], name), getattr(out[0], name)), name


@pytest.mark.skipif(not INTERPRET and not torch.cuda.is_available(), reason="Triton kernels")
@pytest.mark.parametrize("split_chunk", [0, 64])
def test_row_stats_skips_masked_rows(split_chunk):
    """The statistics launcher with `skip` (one program per row, and split-V's two stages): a
    row whose mask is 0 gets logp = H = lse = m = log s = 0 without its logits being read
    (NaN there); every other row's outputs are bit for bit those without `skip`."""
    from fastrl.kernels import policy_loss as PL

    device = "cuda" if torch.cuda.is_available() else "cpu"
    logits = torch.randn(2, 4, 300, device=device).to(torch.bfloat16)
    tokens = torch.randint(0, 300, (2, 4), device=device)
    mask = torch.tensor([[1, 0, 1, 0], [0, 1, 1, 0.5]], device=device)
    poisoned = logits.clone()
    poisoned[mask == 0] = float("nan")
    want = PL.row_stats(logits, tokens, 0.7, split_chunk=split_chunk, shift=True)
    got = PL.row_stats(poisoned, tokens, 0.7, split_chunk=split_chunk, shift=True, skip=mask)
    for a, b in zip((*want[:3], *want[3]), (*got[:3], *got[3])):
        assert (b[mask == 0] == 0).all()
        assert torch.equal(a[mask > 0], b[mask > 0])


def test_inplace_gradient(engine):
    """inplace=True: same gradient, and it is written into the logits' own storage."""
    device, _ = engine
    batch = make_batch(2, 4, 50, device=device)
    out = run_both(batch, inplace=True, config="grpo", entropy_coef=0.01)
    assert_match(*out)
    batch = make_batch(2, 4, 50, device=device, extra_t=1)  # in place through a strided view
    out = run_both(batch, view=lambda x: x[:, :-1], inplace=True, config="grpo")
    assert_match(*out)

    hidden = torch.randn(2, 4, 8, device=device, requires_grad=True)
    weight = torch.randn(8, 50, device=device, requires_grad=True)
    logits = hidden @ weight  # (B, T, V); matmul's backward does not need its output
    ptr = logits.data_ptr()
    rest = {k: v for k, v in batch.items() if k not in ("logits", "rollout_logp")}
    fastrl.policy_loss(logits, **rest, config="grpo", inplace=True).loss.backward()
    h2, w2 = hidden.detach().requires_grad_(), weight.detach().requires_grad_()
    logits2 = h2 @ w2
    logits2.retain_grad()
    R.policy_loss(logits2, **rest, config="grpo").loss.backward()
    assert logits.data_ptr() == ptr
    torch.testing.assert_close(logits.detach(), logits2.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-5, atol=1e-6)


def test_inplace_misuse_detected(engine):
    """Another op that saved the logits for its backward: autograd's version check raises."""
    device, _ = engine
    batch = make_batch(1, 3, 11, device=device)
    x = batch["logits"].clone().requires_grad_()
    logits = x * 1.0
    other = (logits * logits).sum()  # saves `logits`; runs its backward after ours
    rest = {k: v for k, v in batch.items() if k not in ("logits", "rollout_logp")}
    loss = fastrl.policy_loss(logits, **rest, inplace=True).loss
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + other).backward()


# --------------------------------------------------------------------------- non-finite / bad input
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_nan_logits_propagate_and_check_finite(engine):
    device, _ = engine
    batch = make_batch(2, 3, 11, device=device, mask_p=0.0)
    batch["logits"][0, 1, 4] = float("nan")
    rest = {k: v for k, v in batch.items() if k != "logits"}
    out = fastrl.policy_loss(batch["logits"], **rest)
    assert torch.isnan(out.loss) and torch.isnan(out.logp[0, 1])
    assert torch.isfinite(out.logp[1]).all()
    with pytest.raises(ValueError, match="not finite"):
        fastrl.policy_loss(batch["logits"], **rest, check_finite=True)
    batch["logits"][0, 1, 4] = float("inf")  # +inf: that row's logp and H are NaN
    out = fastrl.policy_loss(batch["logits"], **rest)
    assert torch.isnan(out.loss) and torch.isnan(out.logp[0, 1]) and torch.isnan(out.entropy[0, 1])
    with pytest.raises(ValueError, match="not finite"):
        fastrl.policy_loss(batch["logits"], **rest, check_finite=True)
    batch["mask"][0, 1] = False  # masked: what the mask excludes never reaches the loss
    out = fastrl.policy_loss(batch["logits"], **rest)
    ref = R.policy_loss(batch["logits"], **rest)
    assert torch.isfinite(out.loss) and torch.allclose(out.loss, ref.loss, atol=1e-5)
    # ... nor check_finite (README: it turns a non-finite loss into an error; this one is
    # finite, and so is the gradient), also with a gradient and on flat rows
    for z, kw in ((batch["logits"], rest),
                  (batch["logits"].reshape(6, 11), {k: v.reshape(6) for k, v in rest.items()
                                                    if k != "advantages"})):  # fmt: skip
        if "advantages" not in kw:
            kw = dict(kw, advantages=rest["advantages"][:, None].expand(2, 3).reshape(6))
        x = z.clone().requires_grad_()
        out = fastrl.policy_loss(x * 1.0, **kw, check_finite=True)
        out.loss.backward()
        assert torch.isfinite(out.loss) and torch.isfinite(x.grad).all()


def test_check_finite_passes_on_good_input(engine):
    device, _ = engine
    batch = make_batch(2, 3, 11, device=device)
    out = fastrl.policy_loss(**batch, check_finite=True)
    assert torch.isfinite(out.loss)


def test_out_of_range_token_gives_nan_in_op(engine):
    """Below the CPU value check (as on CUDA, where it is skipped): the op yields NaN logp."""
    device, _ = engine
    logits = torch.randn(1, 4, 9, device=device)
    tokens = torch.tensor([[0, 9, -1, 8]], device=device)
    logp, entropy = ops.token_logprobs(logits, tokens)
    assert torch.isnan(logp[0, 1]) and torch.isnan(logp[0, 2])
    assert torch.isfinite(logp[0, [0, 3]]).all() and torch.isfinite(entropy).all()


def test_bad_inputs():
    B, T, V = 2, 3, 7
    logits, tokens, adv = torch.randn(B, T, V), torch.randint(0, V, (B, T)), torch.randn(B)
    cases = [
        (dict(tokens=tokens[:, :2]), r"tokens has shape \(2, 2\).*expected shape \(2, 3\)"),
        (dict(tokens=tokens.float()), "tokens has shape .* dtype torch.float32.*int64 or int32"),
        (dict(tokens=tokens + V), r"tokens must lie in \[0, V\) = \[0, 7\)"),
        (dict(tokens=tokens - 1 - V), r"tokens must lie in \[0, V\)"),
        (dict(logits=logits.long()), "logits has shape .*dtype float32, bfloat16 or float16"),
        (dict(logits=logits[0, 0]), r"logits must be a tensor of shape \(B, T, V\) or \(N, V\)"),
        (dict(advantages=torch.randn(B, T + 1)), r"advantages has shape \(2, 4\)"),
        (dict(old_logp=torch.randn(B, 2)), r"old_logp has shape \(2, 2\).*like tokens"),
        (dict(mask=torch.ones(B, 2)), r"mask must be .*shape \(2, 3\).*got shape \(2, 2\)"),
        (dict(mask=torch.full((B, T), 2)), r"mask must hold integer values 0 or 1"),
        (dict(mask=-torch.ones(B, T)), r"mask must hold finite values >= 0"),
        (dict(mask=torch.full((B, T), float("nan"))), r"must hold finite values >= 0 \(no NaN"),
        (dict(mask=torch.full((B, T), float("inf"))), r"mask must hold finite values >= 0"),
        (dict(mask=torch.full((B, T), 1e39, dtype=torch.float64)), r"mask must hold finite"),
        (dict(num_tokens=torch.ones((), device="meta")), "num_tokens .*not meta"),
        (dict(ref_logp=torch.randn(B, T, device="meta")), r"ref_logp has shape .*device cpu"),
        (dict(temperature=0.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=-1.0), "temperature"),
        (dict(kl_coef=0.1), "needs ref_logp"),
        (dict(config="grpo"), "needs ref_logp"),
        (dict(rollout_is="token"), "needs rollout_logp"),
        (dict(num_tokens=torch.ones(2)), "num_tokens has shape"),
    ]
    for change, match in cases:
        kwargs = {**dict(logits=logits, tokens=tokens, advantages=adv), **change}
        with pytest.raises(ValueError, match=match):
            fastrl.policy_loss(**kwargs)
    flat = dict(logits=logits[0], tokens=tokens[0], advantages=torch.randn(T))
    with pytest.raises(ValueError, match="needs sequences"):
        fastrl.policy_loss(**flat, agg="seq-mean-token-mean")
    # the k3 bias correction by the sequence's ratio: flat rows used to be taken as one sequence
    seq_kl = dict(kl_coef=0.5, kl_bias_correction=True, kl_bias_ratio="sequence")
    ref = torch.randn(T)
    with pytest.raises(ValueError, match="kl_bias_ratio='sequence' needs sequences"):
        fastrl.policy_loss(**flat, ref_logp=ref, **seq_kl)
    with pytest.raises(ValueError, match="kl_bias_ratio='sequence' needs sequences"):
        fastrl.policy_loss_from_logprobs(
            torch.randn(T), None, torch.randn(T), ref_logp=ref, **seq_kl
        )
    fastrl.policy_loss(**flat, ref_logp=ref, **{**seq_kl, "kl_bias_ratio": "token"})  # per token


def test_no_grad_inputs_and_outputs_detached():
    batch = make_batch(2, 3, 11)
    out = fastrl.policy_loss(**batch, config="grpo")
    assert not out.loss.requires_grad
    x = batch.pop("logits").requires_grad_()
    out = fastrl.policy_loss(x, **batch, config="grpo")
    assert out.loss.requires_grad and not out.logp.requires_grad and not out.kl.requires_grad


def test_backend_env_validation(monkeypatch):
    monkeypatch.setenv("FASTRL_BACKEND", "cuda-magic")
    with pytest.raises(ValueError, match="FASTRL_BACKEND"):
        ops.backend_for(torch.device("cpu"))
    monkeypatch.setenv("FASTRL_BACKEND", "auto")
    assert ops.backend_for(torch.device("cpu")) == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("config", ["grpo", "gspo"])  # one pass / two passes over the logits
def test_chunked_torch_path_bounds_chunks(monkeypatch, dtype, inplace, config):
    """Several chunks per call (tiny CHUNK_BYTES), each in several cache-sized blocks (tiny
    SUB_BYTES, not a divisor), give the same numbers as the reference: one-pass (token-level)
    and two-pass (sequence-level) paths, a non-flattenable view, in place, low precision, an
    entropy bonus, a temperature and a -inf logit."""
    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    batch = make_batch(3, 7, 64, dtype=dtype, extra_t=1)
    batch["logits"][0, 3, 5] = float("-inf")
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 64 * 4 * 5)  # 5 rows per chunk
    monkeypatch.setattr(chunked, "SUB_BYTES", 64 * 4 * 2)  # 2 rows per block
    assert (chunked.chunk_rows(64), chunked.sub_rows(64)) == (5, 2)
    kw = dict(config=config, entropy_coef=0.01, temperature=0.8)
    out = run_both(batch, view=lambda x: x[:, 1:], inplace=inplace, **kw)
    assert_match(*out, dtype=dtype)
    assert torch.isfinite(out[2]).all()


# --------------------------------------------------------------------------- randomized
def softmax_grad_scale(out_r, grad_r, tokens) -> float:
    """The scale a gradient check of few rows needs: a row's entries are (g / tau)(delta_jy - p_j)
    (plus the entropy term), so when every counted row is nearly one-hot (p_y -> 1, which a
    random search over 1-2 rows finds) all entries are small differences, and any fp32
    implementation gets them only to ~eps * |g / tau| (torch's log_softmax backward and fastrl's,
    whose p_y comes from the forward's logp: test_logprobs' nearly one-hot test holds that to
    float64). Compare against g / tau, recovered from the oracle as grad_y / (1 - p_y), or the
    largest entry where that is larger."""
    grad_y = grad_r.double().gather(-1, tokens[..., None]).squeeze(-1).abs()  # (B, T)
    one_minus_p = -torch.expm1(out_r.logp.double())  # (B, T), 0 where V = 1
    coef = torch.where(one_minus_p > 0, grad_y / one_minus_p.clamp_min(1e-300), 0.0)
    return max(coef.max().item(), grad_r.abs().max().item()) or 1.0


CONFIG_SPACE = st.fixed_dictionaries(
    {
        "policy": st.sampled_from(["ppo", "cispo", "sapo", "reinforce"]),
        "ratio_level": st.sampled_from(["token", "sequence"]),
        "kl_estimator": st.sampled_from(["k1", "k2", "k3", "low_var_kl", "abs"]),
        "kl_coef": st.sampled_from([0.0, 0.1]),
        "kl_bias_correction": st.booleans(),
        "entropy_coef": st.sampled_from([0.0, 0.03]),
        "temperature": st.sampled_from([0.6, 1.0, 1.7]),
        "agg": st.sampled_from(
            ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
        ),
        "rollout_is": st.sampled_from([None, "token", "sequence"]),
        "rollout_is_mode": st.sampled_from(["truncate", "mask"]),
        "clip_dual": st.sampled_from([None, 2.0]),
    }
)


@settings(max_examples=20, deadline=None)
@given(
    cfg=CONFIG_SPACE,
    B=st.integers(1, 3),
    T=st.integers(1, 5),
    V=st.integers(1, 70),
    seed=st.integers(0, 10_000),
    backend=st.sampled_from(["torch", "triton"] if INTERPRET else ["torch"]),
)
def test_randomized(cfg, B, T, V, seed, backend):
    previous = os.environ.get("FASTRL_BACKEND")
    os.environ["FASTRL_BACKEND"] = backend  # (hypothesis and function-scoped monkeypatch clash)
    try:
        batch = make_batch(B, T, V, seed=seed, rollout=cfg["rollout_is"] is not None)
        config = LossConfig(**cfg)
        out = run_both(batch, config=config)
        assert_match(*out, grad_scale=softmax_grad_scale(out[1], out[3], batch["tokens"]))
    finally:
        if previous is None:
            os.environ.pop("FASTRL_BACKEND", None)
        else:
            os.environ["FASTRL_BACKEND"] = previous


# --------------------------------------------------------------------------- GPU only
@pytest.mark.gpu
def test_gpu_bf16_qwen_vocab():
    """bf16 at V = 151936 (Qwen2) on CUDA against the fp32 reference."""
    batch = make_batch(2, 16, 151936, dtype=torch.bfloat16, device="cuda")
    assert_match(*run_both(batch, config="grpo", entropy_coef=0.01), dtype=torch.bfloat16)


@pytest.mark.gpu
def test_gpu_int64_offsets():
    """N * V > 2^31 elements: row offsets must be int64. Checks the last rows only (cheap)."""
    V = 151936
    N = (2**31) // V + 64  # N * V > 2^31
    logits = torch.randn(N, V, device="cuda", dtype=torch.bfloat16)
    tokens = torch.randint(0, V, (N,), device="cuda")
    x = logits.requires_grad_()
    out = fastrl.policy_loss(x, tokens, torch.randn(N, device="cuda"))
    out.loss.backward()
    tail = slice(N - 4, N)
    ref_logp, ref_ent = R.token_logprobs(logits[tail].detach(), tokens[tail])
    torch.testing.assert_close(out.logp[tail], ref_logp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out.entropy[tail], ref_ent, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(x.grad[tail].float()).all() and x.grad[tail].abs().sum() > 0
    # the gradient rows sum to 0 (softmax Jacobian): a misplaced write would break this
    assert x.grad[tail].float().sum(-1).abs().max() < 1e-3


@pytest.mark.gpu
def test_gpu_no_host_sync():
    batch = make_batch(2, 8, 1000, device="cuda")
    x = batch.pop("logits").requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = fastrl.policy_loss(x, **batch, config="grpo")
        out.loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_per_token_math_dispatches_few_ops():
    """The O(N) math around the kernel (loss terms, aggregation, weights, metrics) runs once per
    call, each op a launch on a GPU: an H200 profile found 168 launches in one GRPO forward +
    backward and the call host-bound at V = 32000 (5.9 ms of host time for 2.0 ms of device
    time). The mask's count, its `> 0`, |y_i| and torch.where's zero are formed once per call
    (terms.Masked): policy_output dispatched 156 ops before, 95 then, and 63 since its seven
    token means became one stacked reduction (terms.masked_means); aggregation_weights 25, 20,
    and 11 in closed form (no autograd engine call). A bound a little above today's, so that a
    change that multiplies them fails here."""
    from fastrl import terms
    from fastrl._inputs import prepare_policy_inputs

    B, T = 4, 8
    g = torch.Generator().manual_seed(0)
    logp = (torch.randn(B, T, generator=g) - 3).requires_grad_()
    entropy = torch.rand(B, T, generator=g)
    old, ref = logp.detach() - 0.1, logp.detach() + 0.1
    tokens = torch.zeros(B, T, dtype=torch.long)
    x = prepare_policy_inputs(
        None, tokens, torch.randn(B, T, generator=g), old, ref, None, None, "grpo", {}
    )
    with CountOps() as counted:
        terms.policy_output(logp, entropy, x)
    assert counted.n <= 70, counted.n
    with CountOps() as counted:
        terms.aggregation_weights(x)
    assert counted.n <= 13, counted.n


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched while active (`n`), and among them (`launches`) those
    that make a kernel launch on a GPU (not a view, a detach or an allocation; not a fastrl
    custom op, whose body's ops are its own). Nothing is counted while `paused` (the Triton
    interpreter's own copies of a kernel's arguments)."""

    VIEWS = {
        "detach",
        "view",
        "_unsafe_view",
        "select",
        "unbind",
        "expand",
        "unsqueeze",
        "slice",
        "alias",
        "squeeze",
        "as_strided",
        "empty",
        "_local_scalar_dense",
        "reshape",
        "to",
    }
    paused = False

    def __init__(self):
        super().__init__()
        self.n = self.launches = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not CountOps.paused:
            self.n += 1
            own = func.namespace == "fastrl"
            self.launches += not own and func.__name__.split(".")[0] not in self.VIEWS
        return func(*args, **(kwargs or {}))


@pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1 (no CUDA)")
def test_a_grpo_call_on_the_triton_path_makes_few_launches(monkeypatch, launched):
    """A whole GRPO forward + backward on the Triton backend (what runs on a GPU): 168 launches
    on an H200 (profiled), 80 before the per-token terms and metrics became one kernel
    (kernels/policy_terms.py, ops.policy_output) and the aggregation weights a closed form, 38
    then, 29 since the weights are formed once per call (ops.loss_weights: the op and the loss's
    value share them), 30 since the statistics kernel, token_grads and the gradient kernel
    replaced the one-pass kernel by default (faster on an H200: kernels/policy_loss.py,
    one_pass_enabled). Counted here: torch ops that launch, also inside the custom op, and the
    Triton kernels. The bound is a little above."""
    from fastrl.kernels import launch

    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    batch = make_batch(4, 8, 64)
    x = batch.pop("logits").requires_grad_()
    fastrl.policy_loss(x, **batch, config="grpo").loss.backward()  # warm
    x.grad = None
    inner = []
    real_op, real_launch = ops.stats_and_grad_, launch.LaunchConfig.__call__

    def counted_inside(*args, **kw):  # the custom op's body runs below the outer mode
        with CountOps() as c:
            out = real_op(*args, **kw)
        inner.append(c.launches)
        return out

    def paused(self, *args):
        CountOps.paused = True
        try:
            return real_launch(self, *args)
        finally:
            CountOps.paused = False

    monkeypatch.setattr(ops, "stats_and_grad_", counted_inside)
    monkeypatch.setattr(launch.LaunchConfig, "__call__", paused)
    launched.clear()
    with CountOps() as outer:
        fastrl.policy_loss(x, **batch, config="grpo").loss.backward()
    # the CPU-only check of the tokens' range (a min and a max) does not run on a GPU
    on_gpu = outer.launches - 2 + sum(inner) + len(launched)
    assert len(launched) == 5 and on_gpu <= 32, (outer.launches, inner, launched)


@pytest.mark.parametrize("mask_kind", ["weights", "empty", "all"])
def test_stacked_masked_means_equal_one_at_a_time(mask_kind):
    """terms.masked_means (the metrics' one reduction) gives each masked_mean exactly on the
    CPU: a NaN / inf where the mask is 0 reaches none, and nothing counted gives 0."""
    from fastrl import terms

    g = torch.Generator().manual_seed(1)
    B, T = 5, 37
    xs = [torch.randn(B, T, generator=g) * 10**k for k in range(-3, 4)]
    mask = (torch.rand(B, T, generator=g) > 0.4) * torch.rand(B, T, generator=g) * 2
    if mask_kind == "empty":
        mask = torch.zeros(B, T)
    elif mask_kind == "all":
        mask = torch.ones(B, T)
    masked = (mask == 0).nonzero()
    for x in xs:
        x[mask == 0] = float("nan")
        if len(masked):  # an inf at one uncounted entry too
            x[tuple(masked[0])] = float("inf")
    got = terms.masked_means(xs, terms.Masked(mask))
    want = [terms.masked_mean(x, mask) for x in xs]
    assert len(got) == len(xs)
    for a, b in zip(got, want):
        assert a.shape == () and torch.equal(a, b), (a, b)
    if mask_kind == "empty":
        assert all(a == 0 for a in got)
    else:
        assert all(torch.isfinite(a) for a in got)
