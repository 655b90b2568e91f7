"""Nothing silently wrong (issue 10, the loss side): one test per class of silent failure.

Each test feeds what a hostile or careless caller would and checks for a clear error, a NaN, or
the right number — never a finite wrong answer. The float64 property test at the end sweeps
large logit offsets, extreme temperatures and masked non-finite entries.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastrl
from fastrl import reference as R


def batch(B=2, T=4, V=11, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    logits = (2 * torch.randn(B, T, V, generator=g)).to(device)
    tokens = torch.randint(0, V, (B, T), generator=g).to(device)
    logp = R.token_logprobs(logits, tokens)[0]
    return dict(
        logits=logits,
        tokens=tokens,
        advantages=torch.randn(B, generator=g).to(device),
        old_logp=logp + 0.2 * torch.randn(B, T, generator=g).to(device),
        ref_logp=logp + 0.2 * torch.randn(B, T, generator=g).to(device),
        mask=(torch.rand(B, T, generator=g) > 0.25).to(device),
    )


def grad_of(fn, logits, **kw):
    x = logits.detach().clone().requires_grad_()
    out = fn(x * 1.0, **kw)  # a non-leaf, like an lm_head output
    out.loss.backward()
    return out, x.grad


# ---------------------------------------------------------------------- 1. constants of the loss
def test_inputs_that_require_grad_are_constants(engine):
    device, _ = engine
    b = batch(device=device)
    cfg = fastrl.LossConfig.grpo(entropy_coef=0.01)
    logits = b.pop("logits")
    _, want = grad_of(fastrl.policy_loss, logits, **b, config=cfg)
    live = {k: v.clone().requires_grad_() if v.is_floating_point() else v for k, v in b.items()}
    out, got = grad_of(fastrl.policy_loss, logits, **live, config=cfg)
    torch.testing.assert_close(got, want)
    for k in ("advantages", "old_logp", "ref_logp"):
        assert live[k].grad is None, k
    # old_logp computed with grad enabled (outside no_grad), as a careless trainer would
    x = logits.clone().requires_grad_()
    old = fastrl.logprobs(x * 1.0, b["tokens"])
    assert old.requires_grad
    out = fastrl.policy_loss(x * 1.0, b["tokens"], b["advantages"], old, config="dapo")
    out.loss.backward()
    ref = R.policy_loss(logits.clone().requires_grad_(), b["tokens"], b["advantages"],
                        old.detach(), config="dapo")  # fmt: skip
    torch.testing.assert_close(out.loss, ref.loss.detach())
    assert x.grad.abs().sum() > 0  # an on-policy gradient, not silently zero


def test_a_mask_that_requires_grad_is_a_constant():
    """A float mask that requires grad gets no gradient from any loss (value_loss too) or LM-head
    op, and the fused ops see a detached one (no autograd warning "an autograd kernel was not
    registered", which used to drop the mask's gradient silently while
    policy_loss_from_logprobs differentiated through it)."""
    b = batch()
    logits, tokens, adv = b["logits"], b["tokens"], b["advantages"]
    mask = torch.rand(tokens.shape).requires_grad_()
    B, T = tokens.shape
    hidden = torch.randn(B, T, 5, requires_grad=True)
    weight = torch.randn(logits.shape[-1], 5, requires_grad=True)
    lp = R.token_logprobs(logits, tokens)[0].requires_grad_()
    calls = [
        lambda m: fastrl.policy_loss(logits.clone().requires_grad_() * 1.0, tokens, adv,
                                     b["old_logp"], mask=m, config="dapo").loss,
        lambda m: fastrl.policy_loss(logits.clone().requires_grad_() * 1.0, tokens, adv,
                                     b["old_logp"], mask=m, config="gspo").loss,
        lambda m: fastrl.policy_loss_from_logprobs(lp, None, adv, b["old_logp"], mask=m).loss,
        lambda m: fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, mask=m).loss,
        lambda m: fastrl.linear_logprobs(hidden, weight, tokens, mask=m).sum(),
        lambda m: fastrl.value_loss(lp * 1.0, b["old_logp"], b["old_logp"] + 0.3, mask=m)[0],
    ]  # fmt: skip
    for call in calls:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # autograd's "not registered" warning included
            loss = call(mask)
            loss.backward()
        assert mask.grad is None
        torch.testing.assert_close(loss.detach(), call(mask.detach()).detach())


@pytest.mark.parametrize("inplace", [False, True])
def test_a_scaled_loss_scales_the_half_precision_gradient_in_fp32(engine, inplace):
    """(loss * s).backward(), e.g. loss / grad_accum_steps: the gradient computed in the forward
    is multiplied by the fp32 s and rounded once to the logits' dtype on every engine (the CPU
    path rounded s to bf16 first: every entry off by bf16(s) / s = 1.0019 at s = 1 / 3)."""
    device, backend = engine
    if device == "cpu" and backend == "triton":
        pytest.skip("triton's interpreter rounds fp32 -> bf16 toward zero (a GPU to nearest)")
    b = batch(B=2, T=8, V=64, device=device)
    logits = b.pop("logits").bfloat16()
    s = 1 / 3
    grads = []
    for scale in (1.0, s):
        x = logits.clone().requires_grad_()
        out = fastrl.policy_loss(x * 1, **b, config="grpo", inplace=inplace)
        (out.loss * scale).backward()
        grads.append(x.grad)
    want = (grads[0].float() * torch.tensor(s, dtype=torch.float32)).bfloat16()
    assert torch.equal(grads[1], want)
    assert grads[1].abs().sum() > 0


def test_the_fp32_chunk_scaling_of_a_half_precision_gradient(monkeypatch):
    """chunked._scale_in_fp32_, what scale_ runs for a bf16 / fp16 gradient off the CPU (a
    0-dim GPU tensor is cast to the gradient's dtype by mul_): the single-rounded product, on a
    sliced (B, T, V) view that does not flatten and over several row chunks."""
    from fastrl import chunked

    monkeypatch.setattr(chunked, "chunk_rows", lambda V: 3)
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        base = torch.randn(2, 9, 50, generator=g).to(dtype)
        view = base[:, 2:8]
        s = torch.tensor(1 / 3)
        want = (view.float() * s).to(dtype)
        before = base.clone()
        chunked._scale_in_fp32_(view, s)
        assert torch.equal(view, want)
        assert torch.equal(base[:, :2], before[:, :2]) and torch.equal(base[:, 8:], before[:, 8:])


def test_a_scaled_fused_linear_loss_scales_its_half_precision_gradients_in_fp32():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 8, 16, generator=g).bfloat16()
    weight = (0.3 * torch.randn(64, 16, generator=g)).bfloat16()
    b = batch(B=2, T=8, V=64)
    b.pop("logits")
    s = 1 / 3
    grads = []
    for scale in (1.0, s):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        out = fastrl.fused_linear_policy_loss(h, w, **b, config="grpo")
        (out.loss * scale).backward()
        grads.append((h.grad, w.grad))
    for one, scaled in zip(*grads):
        want = (one.float() * torch.tensor(s, dtype=torch.float32)).to(one.dtype)
        assert torch.equal(scaled, want)


# ---------------------------------------------------------------------- 2. entropy precision
def _f64_entropy(z: torch.Tensor, tau: float) -> torch.Tensor:
    z = z.double() / tau
    p = torch.softmax(z, -1)
    return -(p * torch.log_softmax(z, -1)).nan_to_num().sum(-1)


@pytest.mark.parametrize(
    "z, tau",
    [
        (torch.tensor([[6e4, 6e4, -6e4, 0.0]], dtype=torch.float16), 1.0),
        (torch.linspace(-4, 4, 64)[None] + 1000.0, 1.0),
        (torch.linspace(-2, 2, 64)[None], 0.1),
        # dyadic logits and temperature: z / tau is exact in fp32, so only cancellation shows
        (torch.arange(-128, 128)[None] / 64.0 - 5000.0, 0.0625),
    ],
)
def test_entropy_at_large_offsets_and_low_temperature(engine, z, tau):
    device, _ = engine
    z = z.to(device)
    tokens = torch.zeros(z.shape[0], dtype=torch.long, device=device)
    _, ent = fastrl.logprobs(z, tokens, temperature=tau, entropy=True)
    want = _f64_entropy(z.cpu(), tau).float()
    torch.testing.assert_close(ent.cpu(), want, rtol=1e-4, atol=2e-5)
    out = fastrl.policy_loss(z[None].float().requires_grad_() * 1.0, tokens[None],
                             torch.ones(1, device=device), temperature=tau)  # fmt: skip
    torch.testing.assert_close(out.entropy.cpu()[0], want, rtol=1e-4, atol=2e-5)


def _f64_grad(z: torch.Tensor, loss_fn) -> torch.Tensor:
    z64 = z.detach().double().requires_grad_()
    loss_fn(z64).backward()
    return z64.grad


def _f64_entropy_bonus(z64, tokens, tau, coef):
    """-(log p_y) - coef H, meaned, in float64: -inf logits have p = 0 and p log p = 0."""
    ls = torch.log_softmax(z64 / tau, -1)
    lss = torch.where(torch.isfinite(ls), ls, torch.zeros_like(ls))
    entropy = -(lss.exp() * lss).sum(-1)
    return (-ls.gather(-1, tokens[..., None])[..., 0] - coef * entropy).mean()


def test_sampled_token_at_minus_inf_has_a_finite_gradient(engine):
    """A vocabulary-masked logit (-inf: constrained decoding, a masked bias) at the sampled token:
    p_y (log p_y + H) -> 0, so the entry at y is finite (float64's value), and a row the mask
    excludes or the loss weights 0 gets no gradient at all. It was NaN (0 * -inf) on the CPU
    path, a NaN in the gradient beside a finite loss, in the LM-head path a whole NaN row of dX
    and of dW."""
    device, _ = engine
    g = torch.Generator().manual_seed(0)
    z = torch.randn(1, 2, 8, generator=g).to(device)
    z[0, 0, 3] = float("-inf")
    tokens = torch.tensor([[3, 1]], device=device)
    # a row outside the loss: logprobs of row 1 only
    x = z.clone().requires_grad_()
    fastrl.logprobs(x, tokens)[0, 1].backward()
    assert torch.all(x.grad[0, 0] == 0) and torch.isfinite(x.grad).all()
    # a masked row, and a counted one, with the entropy term (reinforce: no ratio clamp)
    for mask in ([0.0, 1.0], [1.0, 1.0]):
        x = z.clone().requires_grad_()
        m = torch.tensor([mask], device=device)
        out = fastrl.policy_loss(x * 1.0, tokens, torch.ones(1, device=device), mask=m,
                                 policy="reinforce", entropy_coef=0.1)  # fmt: skip
        out.loss.backward()
        keep = torch.tensor(mask, dtype=torch.bool)
        kept = tokens.cpu()[:, keep]
        want = _f64_grad(z.cpu()[:, keep], lambda w, y=kept: _f64_entropy_bonus(w, y, 1.0, 0.1))
        assert torch.isfinite(x.grad).all(), mask
        assert torch.all(x.grad[:, ~keep.to(device)] == 0)
        got = x.grad[:, keep.to(device)].cpu().double()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    # the LM head, the vocabulary masked through its bias; row 0 (token 0) weighs 0 in the loss
    h = torch.randn(3, 4, generator=g).to(device).requires_grad_()
    w = torch.randn(6, 4, generator=g).to(device).requires_grad_()
    bias = torch.zeros(6, device=device)
    bias[0] = float("-inf")
    logp = fastrl.linear_logprobs(h, w, torch.tensor([0, 2, 3], device=device), bias=bias)
    (logp * torch.tensor([0.0, 1.0, 1.0], device=device)).sum().backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    assert torch.all(h.grad[0] == 0)


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_policy_loss_gradient_at_a_large_logit_offset(engine, offset):
    """policy_loss's gradient forms p_j from max-shifted logits, (z'_j - m) - log s, on every
    path (the CPU's one pass, the Triton one-pass kernel), so a common offset of the logits
    changes nothing: float64's gradient to fp32 precision. The kernel used z'_j - lse, with lse
    rounded at |lse|'s scale: 1.1e-4 off at 1e4, 6.7e-3 at 1e6 (entries of size ~0.1)."""
    device, _ = engine
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2, 3, 7, generator=g)
    z = base + offset  # fp32 logits; float64 differentiates the same values
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    adv = torch.tensor([1.0, -0.5])
    x = z.to(device).requires_grad_()
    out = fastrl.policy_loss(x * 1.0, tokens.to(device), adv.to(device), policy="reinforce",
                             entropy_coef=0.1)  # fmt: skip
    out.loss.backward()

    def loss(w):
        ls = torch.log_softmax(w, -1)
        logp = ls.gather(-1, tokens[..., None])[..., 0]
        entropy = -(ls.exp() * ls).sum(-1)
        return (-logp * adv[:, None] - 0.1 * entropy).mean()

    want = _f64_grad(z, loss)
    torch.testing.assert_close(x.grad.cpu().double(), want, rtol=0, atol=2e-6)


@pytest.mark.parametrize("offset", [1e4, 1e6])
def test_sequence_level_gradient_at_a_large_logit_offset(engine, offset):
    """A sequence-level loss (GSPO: its statistics kernel, O(N) torch math, its gradient kernel)
    forms p_j from max-shifted logits too, so a common offset of the logits changes nothing: the
    gradient is the reference's at offset 0, to fp32 precision. The Triton path used z'_j - lse
    there: 6.3e-5 off at 1e4 (entries ~0.3)."""
    from fastrl import reference

    device, _ = engine
    g = torch.Generator().manual_seed(1)
    base = torch.randn(2, 3, 7, generator=g)
    tokens = torch.randint(0, 7, (2, 3), generator=g)
    adv = torch.tensor([1.0, -0.5])
    old = torch.log_softmax(base, -1).gather(-1, tokens[..., None])[..., 0] + 0.05
    kw = dict(config="gspo", entropy_coef=0.1)
    z = base + offset  # fp32: z - offset is exact (Sterbenz), the same logits shifted
    x = z.to(device).requires_grad_()
    out = fastrl.policy_loss(x * 1.0, tokens.to(device), adv.to(device), old.to(device), **kw)
    out.loss.backward()
    w = (z.detach() - offset).requires_grad_()
    reference.policy_loss(w, tokens, adv, old, **kw).loss.backward()
    torch.testing.assert_close(x.grad.cpu(), w.grad, rtol=0, atol=2e-6)


def test_tiny_temperature_with_entropy_has_a_finite_gradient(engine):
    """tau = 1e-37 is accepted (finite, > 0): the entropy term's slope h / tau ~ 1e36 times
    log p_j at p_j = 0 overflowed on the CPU path, and 0 * inf made NaN entries where float64
    has exactly 0. Loss and gradient equal float64's (to fp32 rounding of z / tau)."""
    device, _ = engine
    z = 2 * torch.randn(1, 2, 11, generator=torch.Generator().manual_seed(0))
    tokens = torch.tensor([[3, 4]])
    for tau in (1e-30, 1e-37):
        x = z.to(device).requires_grad_()
        out = fastrl.policy_loss(x * 1.0, tokens.to(device), torch.ones(1, device=device),
                                 policy="reinforce", entropy_coef=0.1, temperature=tau)  # fmt: skip
        out.loss.backward()
        want = _f64_grad(z, lambda w, tau=tau: _f64_entropy_bonus(w, tokens, tau, 0.1))
        assert torch.isfinite(x.grad).all(), tau
        scale = want.abs().max()
        torch.testing.assert_close(
            x.grad.cpu().double() / scale, want / scale, rtol=1e-4, atol=1e-5
        )


# ---------------------------------------------------------------------- 3. inplace misuse
def test_inplace_refuses_storage_it_must_not_overwrite():
    b = batch()
    logits = b.pop("logits")
    leaf = logits.clone().requires_grad_()
    with pytest.raises(ValueError, match="leaf"):
        fastrl.policy_loss(leaf, **b, inplace=True)
    wide = torch.randn(2, 5, 11, requires_grad=True)
    with pytest.raises(ValueError, match="leaf"):
        fastrl.policy_loss(wide[:, :-1], **b, inplace=True)  # a view of a leaf
    # a leaf made from a view of the caller's own tensor (which needs no grad): its storage is
    # the caller's, and a view of such a leaf too
    cached = torch.randn(2, 5, 11)
    keep = cached.clone()
    for made in (lambda: cached[:, :-1].requires_grad_(),
                 lambda: cached[:, :-1].requires_grad_()[:, :]):  # fmt: skip
        with pytest.raises(ValueError, match="leaf"):
            fastrl.policy_loss(made(), **b, inplace=True)
    assert torch.equal(cached, keep)
    base = torch.randn(1, 4, 11, requires_grad=True)
    expanded = (base * 1.0).expand(2, 4, 11)
    with pytest.raises(ValueError, match="expanded"):
        fastrl.policy_loss(expanded, **b, inplace=True)
    # the supported case equals the out-of-place gradient
    x1 = logits.clone().requires_grad_()
    fastrl.policy_loss(x1 * 1.0, **b, config="grpo", inplace=True).loss.backward()
    x2 = logits.clone().requires_grad_()
    fastrl.policy_loss(x2 * 1.0, **b, config="grpo").loss.backward()
    torch.testing.assert_close(x1.grad, x2.grad)


def test_inplace_then_reading_the_logits_is_caught_by_autograd():
    b = batch()
    x = b.pop("logits").clone().requires_grad_()
    z = x * 1.0
    other = z**2  # pow saves z for its backward
    out = fastrl.policy_loss(z, **b, inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.loss + other.sum()).backward()


def test_inplace_then_a_later_reader_gets_the_gradient_as_the_readme_says():
    """Only a reader that saved the logits before the call is caught (above): one after the
    call reads the gradient, and nothing raises. The README says so (it used to promise an
    error at backward for a later reader too)."""
    b = batch()
    x = b.pop("logits").clone().requires_grad_()
    z = x * 1.0
    out = fastrl.policy_loss(z, **b, inplace=True)
    later = torch.logsumexp(z, -1).sum()  # saves z (now the gradient) for its backward
    (out.loss + later).backward()
    assert not torch.isclose(later, torch.logsumexp(x.detach(), -1).sum())
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    text = " ".join(readme.split())
    assert "a later reader that autograd tracks raises" not in text
    assert "other reader after the call silently gets the gradient in place of the logits" in text


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("sl", [slice(3, -1), slice(0, None), slice(2, 6)])
def test_inplace_on_a_sliced_lm_head_output_makes_no_full_buffer(sl, bias):
    """logits = (h W^T)[:, P-1:-1], passed as is (README): with inplace=True the gradient is
    written over those rows and the backward hands the base's own storage on, its other rows
    zeroed. Attached to the slice, autograd's slice backward allocated a zero (B, S, V) tensor
    and copied the gradient into it. Gradients equal inplace=False's; backward scaling works.
    With a bias, F.linear returns a (B, S, V) view of its 2-D (B S, V) result: that base is
    handed on too (it took the copying path, and a second inplace slice raised)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    g = torch.Generator().manual_seed(0)
    B, S, H, V = 2, 9, 4, 50  # dW (V, H) smaller than any slice's logits
    hidden = torch.randn(B, S, H, generator=g)
    weight = torch.randn(V, H, generator=g) / H**0.5
    T = len(range(S)[sl])
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv, old = torch.randn(B, generator=g), torch.randn(B, T, generator=g) * 0.1 - 3.0

    class BigAllocations(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.big = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            flat = [*args, *(kwargs or {}).values()]
            seen = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
            for t in out if isinstance(out, (tuple, list)) else [out]:
                new = isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen
                if new and t.numel() >= B * T * V:  # a new buffer the size of the logits
                    self.big.append(func._schema.name)
            return out

    b0 = torch.randn(V, generator=g) if bias else None
    grads = {}
    for inplace in (False, True):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        logits = torch.nn.functional.linear(h, w, b0)[:, sl]
        out = fastrl.policy_loss(logits, tokens, adv, old, config="dapo", inplace=inplace)
        with BigAllocations() as mode:
            (2.0 * out.loss).backward()
        if inplace:
            assert mode.big == [], mode.big  # no (B, T, V) or (B, S, V) buffer in the backward
            assert out.loss.grad_fn.grad is None  # a kept loss keeps no (B, S, V) storage
        grads[inplace] = (h.grad, w.grad)
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("second_inplace", [True, False])
def test_inplace_on_two_slices_of_one_output(second_inplace, bias):
    """Two losses on two slices of one lm_head output (a completion split in two), the first
    with inplace=True: the second's gradient is not zeroed by the first's backward nor handed
    on twice (an inplace second slice turns the first to the copying backward). The first
    version of the zero-copy base gradient zeroed the other slice: dW off by its whole size."""
    g = torch.Generator().manual_seed(1)
    B, S, H, V = 2, 12, 4, 30
    hidden, weight = torch.randn(B, S, H, generator=g), torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V, (B, S), generator=g)
    adv = torch.randn(B, generator=g)
    b0 = torch.randn(V, generator=g) if bias else None
    grads = {}
    for inplace in (True, False):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        base = torch.nn.functional.linear(h, w, b0)  # (with a bias: a view of a 2-D result)
        parts = [(slice(1, 6), inplace), (slice(6, 11), inplace and second_inplace)]
        loss = sum(
            fastrl.policy_loss(base[:, sl], tokens[:, sl], adv, config="dapo", inplace=ip).loss
            for sl, ip in parts
        )
        loss.backward()
        grads[inplace] = (h.grad, w.grad)
    for a, b in zip(grads[True], grads[False]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("second", [(slice(1, 6), True), (slice(4, 9), True),
                                    (slice(4, 9), False), ("logprobs", False)])  # fmt: skip
def test_reading_overwritten_rows_again_is_refused(second):
    """policy_loss(inplace=True) on base[:, 1:6], then another fastrl read of those rows (a
    second loss on the same or an overlapping slice, inplace or not, or logprobs): the rows hold
    the first loss's gradient, and the zero-copy slice backward saves nothing autograd's version
    counter checks, so the second loss silently came out of the gradient (d hidden off by 0.17).
    Now a ValueError at the second call. Rows no fastrl write reached stay readable, through
    any view (a per-sequence slice was once refused: it was compared by storage span)."""
    g = torch.Generator().manual_seed(1)
    B, S, H, V = 2, 12, 4, 30
    hidden, weight = torch.randn(B, S, H, generator=g), torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V, (B, S), generator=g)
    adv = torch.randn(B, generator=g)
    base = hidden.requires_grad_() @ weight.T
    fastrl.policy_loss(base[:, 1:6], tokens[:, 1:6], adv, config="dapo", inplace=True)
    sl, inplace = second
    with pytest.raises(ValueError, match="overwritten with a gradient"):
        if sl == "logprobs":
            fastrl.logprobs(base, tokens)
        else:
            fastrl.policy_loss(base[:, sl], tokens[:, sl], adv, config="dapo", inplace=inplace)
    fastrl.logprobs(base[:, 6:], tokens[:, 6:])  # untouched rows, in any view of them
    fastrl.logprobs(base[1, :1], tokens[1, :1])
    fastrl.policy_loss(base[1:2, 6:], tokens[1:2, 6:], adv[1:], config="dapo")
    fastrl.logprobs(base.reshape(B * S, V)[S + 7 :], tokens.reshape(-1)[S + 7 :])
    with pytest.raises(ValueError, match="overwritten with a gradient"):
        fastrl.logprobs(base[1::2, 2:4], tokens[1::2, 2:4])  # (2:4 in sequence 1)
    with torch.no_grad():  # written since (a new forward into the same buffer): readable
        base[:, 1:6] = 0.0
    fastrl.logprobs(base, tokens)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("logits_of", ["slice", "whole", "two slices"])
def test_reading_the_logits_after_the_backward_is_refused(logits_of, dtype):
    """After loss.backward() the storage an inplace loss wrote holds the scaled gradient (and,
    for a slice handed on whole, zeros in the base's other rows); the backward's write bumped
    the version counter, so the forward's record went stale and a fastrl read then went
    through. The record follows the backward's own write now. In fp16 the gradient is written
    in the backward only (after the loss scale): that write is recorded too (it was not). A new
    forward is readable."""
    g = torch.Generator().manual_seed(1)
    B, S, H, V = 2, 12, 4, 30
    hidden, weight = torch.randn(B, S, H, generator=g), torch.randn(V, H, generator=g)
    tokens = torch.randint(0, V, (B, S), generator=g)
    adv = torch.randn(B, generator=g)

    def forward():
        return (hidden.clone().requires_grad_() @ weight.T).to(dtype)

    base = forward()
    parts = {
        "slice": [slice(4, 9)],
        "whole": [slice(None)],
        "two slices": [slice(1, 5), slice(6, 10)],
    }
    loss = sum(
        fastrl.policy_loss(base if sl == slice(None) else base[:, sl], tokens[:, sl], adv,
                           config="dapo", inplace=True).loss
        for sl in parts[logits_of]
    )  # fmt: skip
    if dtype == torch.float16 and logits_of == "two slices":  # (documented: use inplace=False)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()  # the second's backward writes the base before the first reads it
        h = hidden.clone().requires_grad_()  # documented: inplace=True for the first-made only
        base = (h @ weight.T).half()
        loss = sum(
            fastrl.policy_loss(
                base[:, sl], tokens[:, sl], adv, config="dapo", inplace=sl.start == 1
            ).loss
            for sl in parts[logits_of]
        )
        loss.backward()
        with pytest.raises(ValueError, match="overwritten with a gradient"):
            fastrl.logprobs(base[:, 1:5], tokens[:, 1:5])
        fastrl.logprobs(base[:, 6:10], tokens[:, 6:10])  # (the other's: never written)
        return
    (2.0 * loss).backward()  # (a scale: the backward writes the storage)
    if dtype == torch.float16 and logits_of == "slice":  # fp16: the gradient fills 4:9 only
        fastrl.logprobs(base[:, :4], tokens[:, :4])
    read = base[:, :4] if logits_of == "slice" and dtype != torch.float16 else base[:, 4:9]
    with pytest.raises(ValueError, match="overwritten with a gradient"):
        fastrl.logprobs(read, tokens[:, : read.shape[1]])
    fastrl.logprobs(forward(), tokens)


def test_inplace_on_a_slice_compiles():
    """torch.compile(fullgraph=True) of a step with policy_loss(inplace=True) on a slice of the
    lm_head output: the compiled graph takes the slice's own path (the zero-copy base gradient
    read the view's storage offset, which Dynamo cannot trace); gradients equal eager's."""
    g = torch.Generator().manual_seed(2)
    hidden, weight = torch.randn(2, 7, 4, generator=g), torch.randn(20, 4, generator=g)
    tokens, adv = torch.randint(0, 20, (2, 5), generator=g), torch.randn(2, generator=g)

    def step(h, w):
        logits = (h @ w.T)[:, 1:-1]
        return fastrl.policy_loss(logits, tokens, adv, config="dapo", inplace=True).loss

    results = []
    for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        fn(h, w).backward()
        results.append((h.grad, w.grad))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------- 4. counts and masks
@pytest.mark.parametrize("bad", [0.0, -6.0, float("nan"), float("inf")])
def test_tensor_counts_never_give_a_finite_wrong_loss(bad):
    """A tensor count that is not a finite number > 0 gives a NaN loss: an inf count too (x / inf
    would be a finite wrong 0, with a zero gradient); a Python one raises."""
    b = batch()
    for key, agg in (("num_tokens", "token-mean"), ("num_seqs", "seq-mean-token-mean")):
        out = fastrl.policy_loss(**b, agg=agg, **{key: torch.tensor(bad)})
        assert torch.isnan(out.loss), (key, bad)
        value, _ = fastrl.value_loss(b["old_logp"], b["ref_logp"], b["ref_logp"], b["mask"],
                                     agg=agg, **{key: torch.tensor(bad)})  # fmt: skip
        assert torch.isnan(value), (key, bad)
        with pytest.raises(ValueError, match=key):
            fastrl.policy_loss(**b, agg=agg, **{key: bad})


@pytest.mark.parametrize("bad", [0.0, -6.0, float("nan"), float("inf")])
@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_a_bad_tensor_count_gives_nan_also_with_an_empty_mask(engine, agg, bad):
    """A rank whose mask is empty with a bad all-reduced count: NaN under token-mean as under
    seq-mean (token-mean gave 0), on the logits path (both backends), from log-probs and from
    the LM head; the gradient stays 0 (nothing counts)."""
    device, _ = engine
    b = batch(device=device)
    b["mask"] = torch.zeros_like(b["mask"])
    key = "num_tokens" if agg == "token-mean" else "num_seqs"
    kw = {"agg": agg, key: torch.tensor(bad, device=device)}
    out, grad = grad_of(fastrl.policy_loss, b.pop("logits"), **b, **kw)
    assert torch.isnan(out.loss) and not grad.any()
    with torch.no_grad():
        nograd = dict(batch(device=device), mask=b["mask"])
        assert torch.isnan(fastrl.policy_loss(**nograd, **kw).loss)
    lp = torch.zeros(b["tokens"].shape, device=device, requires_grad=True)
    out = fastrl.policy_loss_from_logprobs(lp, None, b["advantages"], b["old_logp"], **kw,
                                           mask=b["mask"])  # fmt: skip
    out.loss.backward()
    assert torch.isnan(out.loss) and not lp.grad.any()
    hidden = torch.randn(*b["tokens"].shape, 5, device=device, requires_grad=True)
    weight = torch.randn(11, 5, device=device, requires_grad=True)
    out = fastrl.fused_linear_policy_loss(hidden, weight, b["tokens"], b["advantages"],
                                          b["old_logp"], mask=b["mask"], **kw)  # fmt: skip
    out.loss.backward()
    assert torch.isnan(out.loss) and not weight.grad.any()


@pytest.mark.parametrize("agg", fastrl.config.AGGS)
def test_empty_batch_gives_zero_under_every_aggregation(agg):
    """B = 0 (e.g. a micro-batch that dynamic sampling emptied): loss 0, never 0 / 0."""
    b = {k: v[:0] for k, v in batch().items()}
    out, grad = grad_of(fastrl.policy_loss, b.pop("logits"), **b, agg=agg)
    assert out.loss == 0 and grad.shape == (0, 4, 11)
    for k, v in out.metrics.items():
        assert torch.isfinite(v), k
    v = torch.zeros(0, 4, requires_grad=True)
    loss, _ = fastrl.value_loss(v, v.detach(), v.detach(), torch.ones(0, 4), agg=agg)
    loss.backward()
    assert loss == 0 and v.grad.shape == (0, 4)


def test_masks_with_negative_or_nan_weights_raise():
    b = batch()
    for bad in (-b["mask"].float(), torch.full(b["mask"].shape, float("nan"))):
        with pytest.raises(ValueError, match="mask"):
            fastrl.policy_loss(**{**b, "mask": bad})
    ints = b["mask"].long()  # TRL's int64 completion_mask
    torch.testing.assert_close(
        fastrl.policy_loss(**{**b, "mask": ints}).loss, fastrl.policy_loss(**b).loss
    )


# ---------------------------------------------------------------------- 6. masked NaN
@pytest.mark.parametrize("preset", ["grpo", "gspo", "dapo"])
def test_masked_nan_never_reaches_loss_or_gradient(engine, preset):
    device, _ = engine
    b = batch(B=3, device=device)
    b["mask"][1] = False  # a fully masked sequence with garbage everywhere
    dirty = dict(b)
    dirty["advantages"] = b["advantages"].clone()
    dirty["advantages"][1] = float("nan")
    for k in ("old_logp", "ref_logp"):
        dirty[k] = b[k].clone()
        dirty[k][1] = float("nan")
        dirty[k][0, ~b["mask"][0]] = float("inf")
    logits = b.pop("logits")
    dirty.pop("logits")
    out, got = grad_of(fastrl.policy_loss, logits, **dirty, config=preset)
    want_out, want = grad_of(fastrl.policy_loss, logits, **b, config=preset)
    assert torch.isfinite(out.loss) and torch.isfinite(got).all()
    torch.testing.assert_close(out.loss, want_out.loss)
    torch.testing.assert_close(got, want)
    for k, v in out.metrics.items():
        assert torch.isfinite(v), k


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize(
    "which, config",
    [
        ("old_logp", "grpo"),
        ("old_logp", "gspo"),
        ("old_logp", "dapo"),
        ("ref_logp", dict(config="grpo", kl_coef=0.04, kl_estimator="low_var_kl")),
        ("ref_logp", dict(config="grpo", kl_coef=0.04, kl_estimator="k3")),
        ("rollout_logp", dict(config="grpo", rollout_is="token")),
        ("rollout_logp", dict(config="grpo", rollout_is="sequence", rollout_is_mode="mask")),
    ],
)
@pytest.mark.parametrize("bad", [float("-inf"), float("inf")])
def test_an_infinite_log_prob_input_gives_nan_not_the_clamps_bound(engine, which, config, bad):
    """old_logp = -inf (say) makes log r = +inf, which the ±20 clamp of SPEC 1 / 3 / 4 would
    turn into the finite e^20 (a loss of ~1e8 for A < 0, a wrong number): a ±inf old, reference
    or rollout log-prob at a counted token makes the loss NaN instead, on every backend. At a
    masked token it reaches nothing."""
    device, _ = engine
    b = batch(B=3, device=device)
    if which == "rollout_logp":
        b["rollout_logp"] = b["old_logp"] - 0.1
    kw = dict(config=config) if isinstance(config, str) else dict(config)
    b["mask"][0, 1] = True
    dirty = {k: v.clone() for k, v in b.items()}
    dirty[which][0, 1] = bad
    logits = b.pop("logits")
    dirty.pop("logits")
    out, _ = grad_of(fastrl.policy_loss, logits, **dirty, **kw)
    assert out.loss.isnan(), out.loss
    b["mask"][0, 1] = dirty["mask"][0, 1] = False  # the same token masked: no effect
    out, got = grad_of(fastrl.policy_loss, logits, **dirty, **kw)
    want_out, want = grad_of(fastrl.policy_loss, logits, **b, **kw)
    torch.testing.assert_close(out.loss, want_out.loss)
    torch.testing.assert_close(got, want)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("preset", ["grpo", "gspo", "dapo"])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_nan_logits_reach_the_gradient_of_counted_rows_only(engine, preset, poison):
    """A NaN / +inf logit in a masked row leaves the loss and the whole gradient as without it
    (that row's gradient 0, on every backend); in a counted row it makes the loss and that row's
    gradient NaN (also where the clip zeroes dloss/dlogp: the Triton kernel used to write the
    row as zeros)."""
    device, _ = engine
    b = batch(B=3, device=device)
    logits = b.pop("logits")
    b["mask"][:, 0] = True
    b["mask"][:, 1] = False
    dirty = logits.clone()
    dirty[:, 1, 3] = poison  # masked rows
    kw = dict(config=preset, entropy_coef=0.0 if preset == "dapo" else 0.01)
    out, got = grad_of(fastrl.policy_loss, dirty, **b, **kw)
    want_out, want = grad_of(fastrl.policy_loss, logits, **b, **kw)
    assert torch.isfinite(got).all() and not got[:, 1].any()
    torch.testing.assert_close(out.loss, want_out.loss)
    torch.testing.assert_close(got, want)
    empty = dict(b, mask=torch.zeros_like(b["mask"]))
    out, got = grad_of(fastrl.policy_loss, dirty, **empty, **kw)
    assert out.loss == 0 and not got.any()
    # a counted row (without an entropy term, the old Triton kernel's clamp gave g = h = 0)
    dirty[0, 0, 2] = poison
    out, got = grad_of(fastrl.policy_loss, dirty, **b, **kw)
    assert torch.isnan(out.loss)
    assert torch.isnan(got[0, 0]).all()


# ---------------------------------------------------------------------- 7. clear errors
def test_fused_linear_errors_and_compile():
    hidden = torch.randn(2, 3, 8, requires_grad=True)
    weight = torch.randn(13, 8, requires_grad=True)
    tokens, adv = torch.randint(0, 13, (2, 3)), torch.randn(2)
    with pytest.raises(ValueError, match="hidden must be a float32"):
        fastrl.fused_linear_policy_loss(hidden.double(), weight.double(), tokens, adv)
    with pytest.raises(ValueError, match="num_tokens .*meta"):
        fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv,
                                        num_tokens=torch.ones((), device="meta"))  # fmt: skip
    torch._dynamo.reset()

    def step(hidden, weight, tokens, adv):
        return fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, config="dapo").loss

    loss_c = torch.compile(step, fullgraph=True)(hidden, weight, tokens, adv)
    (gc,) = torch.autograd.grad(loss_c, hidden)
    loss_e = step(hidden, weight, tokens, adv)
    (ge,) = torch.autograd.grad(loss_e, hidden)
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(gc, ge)
    torch._dynamo.reset()


# ---------------------------------------------------------------------- property test
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    offset=st.sampled_from([0.0, 50.0, -300.0, 1000.0]),
    scale=st.sampled_from([0.5, 3.0, 30.0]),
    tau=st.sampled_from([0.05, 0.3, 1.0, 4.0]),
    preset=st.sampled_from(["grpo", "dapo", "gspo", "cispo"]),
    poison=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_never_finite_and_wrong(offset, scale, tau, preset, poison, seed):
    """The fused loss / logp / entropy / gradient are NaN or within tolerance of float64."""
    b = batch(B=2, T=3, V=9, seed=seed)
    logits = b.pop("logits") * scale + offset
    if poison:  # non-finite inputs where the mask excludes them
        b["mask"][0, 0] = False
        b["advantages"] = b["advantages"].clone()
        b["old_logp"][0, 0] = float("nan")
        b["ref_logp"][0, 0] = float("-inf")
    x = logits.clone().requires_grad_()
    cfg = dict(config=preset, temperature=tau, entropy_coef=0.01)
    out = fastrl.policy_loss(x * 1.0, **b, **cfg)
    out.loss.backward()
    x64 = logits.double().requires_grad_()
    b64 = {k: v.double() if v.is_floating_point() else v for k, v in b.items()}
    # float64 oracle: the reference's per-token math on float64 log-probs
    z = x64 / tau
    lp64 = torch.log_softmax(z, -1).gather(-1, b["tokens"][..., None]).squeeze(-1)
    p64 = torch.softmax(z, -1)
    ent64 = -(p64 * torch.log_softmax(z, -1)).sum(-1)
    counted = b["mask"].bool()
    # masked tokens reach no loss term: detached, as in the reference (autograd's 0 * inf at
    # an overflowing masked term is no gradient of the loss)
    lp64, ent64 = (torch.where(counted, t, t.detach()) for t in (lp64, ent64))
    xin = R.prepare_policy_inputs(logits, b64["tokens"], b64["advantages"], b64["old_logp"],
                                  b64["ref_logp"], b64["mask"], None, preset,
                                  {"temperature": tau, "entropy_coef": 0.01})  # fmt: skip
    xin.advantages, xin.old_logp, xin.ref_logp = (
        None if t is None else t.double() for t in (xin.advantages, xin.old_logp, xin.ref_logp)
    )
    xin.mask = xin.mask.double()
    loss64, _, _ = R.policy_terms(lp64, ent64, xin)
    if not abs(float(loss64)) < torch.finfo(torch.float32).max / 2:
        # past fp32's range (k3 at ref - logp > 89, reachable at a low temperature): the fp32
        # loss must not be a finite number then
        assert not math.isfinite(float(out.loss.detach())), (float(loss64), preset, tau)
        return
    loss64.backward()
    # fp32 rounding of z' = z / tau is the dtype's own error: it scales with max |z'|
    zmax = float((logits / tau).abs().max())
    checks = [(out.loss, loss64), (out.logp[counted], lp64[counted]),
              (out.entropy[counted], ent64[counted]), (x.grad, x64.grad)]  # fmt: skip
    for got, want in checks:
        got, want = got.detach().double(), want.detach()
        finite = torch.isfinite(got)
        err = (got - want).abs()[finite]
        slack = 16 * torch.finfo(torch.float32).eps * zmax * (1 + float(want.abs().max()))
        tol = 2e-4 * (1 + want.abs()[finite]) + slack
        assert torch.all(err <= tol), (float(err.max()), preset, offset, scale, tau)
    assert math.isfinite(float(out.loss.detach())), (float(loss64), preset, offset, tau)


def test_flat_inputs_with_token_sum():
    """token-sum needs no sequences: flat (N, V) inputs are accepted and match (1, N, V)."""
    b = batch(B=1, T=6)
    flat = {k: v[0] for k, v in b.items()}
    flat["advantages"] = torch.randn(6)
    out = fastrl.policy_loss(**flat, agg="token-sum")
    seq = fastrl.policy_loss(**{k: v[None] for k, v in flat.items()}, agg="token-sum")
    torch.testing.assert_close(out.loss, seq.loss)
