"""fastrl.logprobs (one-pass per-token log-probs / entropies) against fastrl.reference.logprobs.

Runs on the chunked torch path, the Triton kernels in the interpreter (FASTRL_BACKEND=triton)
and, with `-m gpu`, on CUDA.
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import ops
from fastrl import reference as R

# dtype -> (rtol, atol) of logp / entropy (both paths upcast to fp32 like the reference) and of
# the gradient relative to its largest entry (stored in the logits' dtype).
TOL = {
    torch.float32: ((1e-5, 1e-5), (1e-5, 5e-6)),
    torch.bfloat16: ((1e-4, 1e-4), (1e-2, 8e-3)),
    torch.float16: ((1e-4, 1e-4), (2e-3, 1e-3)),
}


@pytest.fixture
def device(engine):
    return engine[0]


def _check(logits, tokens, temperature=1.0, view=None):
    """Forward values and the gradient of sum(w1 * logp + w2 * H) against the reference."""
    view = view or (lambda x: x)
    dtype = logits.dtype
    (frtol, fatol), (grtol, gatol) = TOL[dtype]
    xf = logits.detach().clone().requires_grad_()
    xr = logits.detach().float().clone().requires_grad_()
    logp, ent = fastrl.logprobs(view(xf), tokens, temperature=temperature, entropy=True)
    rlogp, rent = R.logprobs(view(xr), tokens, temperature=temperature, entropy=True)
    assert logp.dtype == torch.float32 and logp.shape == tokens.shape
    torch.testing.assert_close(logp, rlogp, rtol=frtol, atol=fatol)
    torch.testing.assert_close(ent, rent, rtol=frtol, atol=fatol)
    g = torch.Generator().manual_seed(1)
    w1 = torch.randn(tokens.shape, generator=g).to(logits.device)
    w2 = torch.randn(tokens.shape, generator=g).to(logits.device)
    (logp * w1 + ent * w2).sum().backward()
    (rlogp * w1 + rent * w2).sum().backward()
    assert xf.grad.dtype == dtype
    scale = xr.grad.abs().max().item() or 1.0
    torch.testing.assert_close(xf.grad.float(), xr.grad, rtol=grtol, atol=gatol * scale)
    # logp alone (h = 0 path of the backward)
    xf.grad = xr.grad = None
    fastrl.logprobs(view(xf), tokens, temperature=temperature).mul(w1).sum().backward()
    R.logprobs(view(xr), tokens, temperature=temperature).mul(w1).sum().backward()
    scale = xr.grad.abs().max().item() or 1.0
    torch.testing.assert_close(xf.grad.float(), xr.grad, rtol=grtol, atol=gatol * scale)


@pytest.mark.parametrize(
    "shape,V",
    [((2, 3), 1), ((2, 3), 7), ((4,), 300), ((1, 2), 1000), ((3, 1), 129), ((1,), 70001)],
    ids=["V1", "V7", "flat", "V1000", "T1", "V70001"],
)
def test_logprobs_matches_reference(device, shape, V):
    g = torch.Generator().manual_seed(V)
    logits = (torch.randn(*shape, V, generator=g) * 3).to(device)
    tokens = torch.randint(0, V, shape, generator=g).to(device)
    _check(logits, tokens)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.5])
def test_temperature(device, temperature):
    logits = torch.randn(2, 3, 50, device=device) * 4
    tokens = torch.randint(0, 50, (2, 3), device=device)
    _check(logits, tokens, temperature=temperature)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_half_dtypes(device, dtype):
    logits = (torch.randn(2, 4, 257) * 3).to(dtype).to(device)
    tokens = torch.randint(0, 257, (2, 4), device=device, dtype=torch.int32)
    _check(logits, tokens)


def test_strided_view(device):
    """logits[:, :-1] (the usual causal-LM slice) is read without a copy."""
    logits = torch.randn(2, 6, 40, device=device)
    tokens = torch.randint(0, 40, (2, 5), device=device)
    _check(logits, tokens, view=lambda x: x[:, :-1])


def test_no_grad_fast_path(device):
    logits = torch.randn(3, 4, 30, device=device)
    tokens = torch.randint(0, 30, (3, 4), device=device)
    with torch.no_grad():
        logp = fastrl.logprobs(logits.requires_grad_(), tokens)
    assert not logp.requires_grad
    torch.testing.assert_close(logp, R.logprobs(logits.detach(), tokens), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("flat", [False, True], ids=["BT", "flat"])
def test_mask_skips_rows(device, dtype, flat):
    """`mask=`: a row whose mask is 0 gives logp = H = 0 and a zero gradient whatever the
    upstream gradient there, and is not read (NaN logits in it change nothing: on the Triton
    path every masked row, on the CPU the long run of padding at the end of sequence 0; the
    scattered masked rows the CPU reads anyway are still zeroed). The counted rows equal the
    reference, and the gradient equals the reference's of the masked sum."""
    B, T, V = 3, 9, 3000
    logits = torch.randn(B, T, V, device=device).mul(3).to(dtype)
    tokens = torch.randint(0, V, (B, T), device=device)
    mask = torch.ones(B, T, device=device)
    mask[0, 3:] = 0  # padding: 6 rows
    mask[1, 4] = 0  # a scattered masked row
    mask[2, 0] = 0.5  # a fractional weight still counts
    poisoned = logits.masked_fill((mask == 0)[..., None], float("nan"))
    if flat:
        poisoned, logits, tokens, mask = (t.flatten(0, 1) for t in (poisoned, logits, tokens, mask))
    (frtol, fatol), (grtol, gatol) = TOL[dtype]
    x = poisoned.clone().requires_grad_()
    xr = logits.float().requires_grad_()
    logp, ent = fastrl.logprobs(x, tokens, entropy=True, mask=mask)
    rlogp, rent = R.logprobs(xr, tokens, entropy=True)
    counted = mask > 0
    assert (logp[~counted] == 0).all() and (ent[~counted] == 0).all()
    torch.testing.assert_close(logp[counted], rlogp[counted], rtol=frtol, atol=fatol)
    torch.testing.assert_close(ent[counted], rent[counted], rtol=frtol, atol=fatol)
    w1, w2 = torch.randn(2, *tokens.shape, device=device)
    (logp * w1 + ent * w2).sum().backward()  # (an upstream gradient at masked rows too)
    ((rlogp * w1 + rent * w2) * counted).sum().backward()
    assert x.grad.dtype == dtype and (x.grad[~counted] == 0).all()
    scale = xr.grad.abs().max().item()
    torch.testing.assert_close(x.grad.float(), xr.grad, rtol=grtol, atol=gatol * scale)
    with torch.no_grad():
        assert torch.equal(fastrl.logprobs(poisoned, tokens, mask=mask), logp.detach())


def test_mask_skips_runs_on_the_cpu(monkeypatch):
    """The CPU backend does not read a long masked run (the padding at a sequence's end:
    chunked._runs_to_read) in the forward nor in the backward, whose rows it zeroes."""
    from fastrl import chunked

    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    B, T, V = 2, 12, 131072  # a masked run is skipped from 4 rows of 131072 logits on
    logits = torch.randn(B, T, V)
    tokens = torch.randint(0, V, (B, T))
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 5:] = False  # skipped
    mask[1, 2] = False  # read
    seen = []
    real = chunked._rows

    def spy(t, r0, r1):
        seen.append((r0, r1))
        return real(t, r0, r1)

    monkeypatch.setattr(chunked, "_rows", spy)
    x = logits.clone().requires_grad_()
    fastrl.logprobs(x, tokens, mask=mask).sum().backward()
    assert seen and all(r1 <= 5 or r0 >= 12 for r0, r1 in seen), seen
    ref = logits.clone().requires_grad_()
    (R.logprobs(ref, tokens) * mask).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_extreme_logits(device):
    """Huge / tiny logits and a row of equal logits: stable (online max), entropy log V."""
    logits = torch.tensor(
        [[[1e4, -1e4, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0], [-50.0, -60.0, -70.0, -80.0]]],
        device=device,
    )
    tokens = torch.tensor([[1, 2, 0]], device=device)
    # fp64 oracle: the fp32 reference itself loses digits to cancellation at |z| = 1e4
    x64 = logits.double().requires_grad_()
    logq = torch.log_softmax(x64, -1)
    e_logp = logq.gather(-1, tokens[..., None]).squeeze(-1)
    e_ent = -(logq.exp() * logq).sum(-1)
    (e_logp + 0.5 * e_ent).sum().backward()
    x = logits.clone().requires_grad_()
    logp, ent = fastrl.logprobs(x, tokens, entropy=True)
    (logp + 0.5 * ent).sum().backward()
    torch.testing.assert_close(logp.double(), e_logp.detach(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(ent.double(), e_ent.detach(), rtol=1e-6, atol=1e-4)
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent[0, 1].cpu(), torch.tensor(4.0).log())


def test_bad_inputs():
    logits, tokens = torch.randn(2, 3, 5), torch.randint(0, 5, (2, 3))
    with pytest.raises(ValueError, match="temperature"):
        fastrl.logprobs(logits, tokens, temperature=0.0)
    with pytest.raises(ValueError, match="temperature"):
        fastrl.logprobs(logits, tokens, temperature=float("inf"))
    with pytest.raises(ValueError, match=r"tokens has shape \(2, 2\)"):
        fastrl.logprobs(logits, tokens[:, :2])
    with pytest.raises(ValueError, match=r"tokens must lie in \[0, V\) = \[0, 5\)"):
        fastrl.logprobs(logits, tokens + 5)
    with pytest.raises(ValueError, match="logits has shape .*float32, bfloat16 or float16"):
        fastrl.logprobs(logits.double(), tokens)
    with pytest.raises(ValueError, match=r"mask must be .* of shape \(2, 3\)"):
        fastrl.logprobs(logits, tokens, mask=torch.ones(2, 4))
    with pytest.raises(ValueError, match="mask must hold finite values >= 0"):
        fastrl.logprobs(logits, tokens, mask=torch.full((2, 3), -1.0))


def test_ops_reject_strided_vocab():
    """The raw op refuses a non-contiguous V (the public functions copy first)."""
    logits = torch.randn(2, 7, 3).transpose(1, 2)  # (2, 3, 7), stride(-1) = 3
    with pytest.raises(ValueError, match="V dimension must be contiguous"):
        torch.ops.fastrl.token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long), 1.0, False)
    logp, _ = ops.token_logprobs(logits, torch.zeros(2, 3, dtype=torch.long))
    torch.testing.assert_close(logp, R.token_logprobs(logits, torch.zeros(2, 3).long())[0])


def test_minus_inf_logits(device):
    """A -inf logit (masked vocabulary entry) has p = 0: finite H and gradient (p log p -> 0).

    (The fp32 reference gives NaN entropy here, 0 * -inf; the oracle is a masked fp64 formula.)"""
    V = 4500
    logits = torch.randn(1, 3, V, device=device)
    logits[..., 5:12] = float("-inf")
    logits[0, 0, :4400] = float("-inf")  # a first Triton block (4096 wide) holding only -inf
    tokens = torch.randint(4400, V, (1, 3), device=device)
    logq = torch.log_softmax(logits.double(), -1)
    p = logq.exp()
    plogp = torch.where(p > 0, p * logq, 0.0)
    e_logp = logq.gather(-1, tokens[..., None]).squeeze(-1)
    e_ent = -plogp.sum(-1)
    w = torch.randn(1, 3, device=device, dtype=torch.float64)
    # SPEC 6 in fp64 with g = w, h = 0.3: g (1[j=y] - p) - h (p log p + p H)
    onehot = torch.nn.functional.one_hot(tokens, V).double()
    e_grad = w[..., None] * (onehot - p) - 0.3 * (plogp + p * e_ent[..., None])
    x = logits.clone().requires_grad_()
    logp, ent = fastrl.logprobs(x, tokens, entropy=True)
    (logp * w.float() + 0.3 * ent).sum().backward()
    torch.testing.assert_close(logp.double(), e_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), e_ent, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(x.grad).all() and (x.grad[..., 5:12] == 0).all()
    torch.testing.assert_close(x.grad.double(), e_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inplace", [False, True])
def test_backward_over_several_chunks(monkeypatch, dtype, inplace):
    """The torch path's backward, several chunks of several cache-sized blocks each (tiny
    CHUNK_BYTES / SUB_BYTES, not divisors), through a non-flattenable view, in place, at a
    temperature and with a -inf logit, against the reference."""
    from fastrl import chunked

    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 64 * 4 * 5)  # 5 rows per chunk
    monkeypatch.setattr(chunked, "SUB_BYTES", 64 * 4 * 2)  # 2 rows per block
    g = torch.Generator().manual_seed(0)
    logits = (3 * torch.randn(3, 8, 64, generator=g)).to(dtype)
    logits[1, 2, 7] = float("-inf")
    tokens = torch.randint(0, 64, (3, 7), generator=g)
    tokens[1, 1] = (7 + 1) % 64  # not the -inf entry
    w1, w2 = torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g)
    base = logits.detach().clone().requires_grad_()
    x = base * 1 if inplace else base  # a non-leaf, so inplace may overwrite its storage
    logp, ent = ops.token_logprobs(x[:, 1:], tokens, temperature=0.8, inplace=inplace)
    (logp * w1 + ent * w2).sum().backward()
    xr = logits.detach().float().requires_grad_()
    rlogp, rent = R.logprobs(xr[:, 1:], tokens, temperature=0.8, entropy=True)
    rent = torch.nan_to_num(rent)  # the fp32 reference's 0 * -inf in the -inf row
    _, (grtol, gatol) = TOL[dtype]
    torch.testing.assert_close(logp, rlogp, rtol=1e-4, atol=1e-4)
    (rlogp * w1 + rent * w2).sum().backward()
    want = torch.nan_to_num(xr.grad)
    assert torch.isfinite(base.grad).all() and base.grad[1, 2, 7] == 0
    scale = want.abs().max().item()
    torch.testing.assert_close(base.grad.float(), want, rtol=grtol, atol=gatol * scale)


def test_masked_out_of_range_token_has_a_finite_gradient(device):
    """A padding token outside [0, V) has logp = NaN in the op; masked out with torch.where, its
    row's gradient is the entropy term alone (no entry at y), finite, on every backend."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 11, generator=g).to(device)
    tokens = torch.randint(0, 11, (2, 3), generator=g).to(device)
    tokens[1, 2] = -100
    valid = tokens >= 0
    x = logits.clone().requires_grad_()
    logp, ent = ops.token_logprobs(x, tokens)  # (below fastrl.logprobs' CPU value check)
    assert torch.isnan(logp[1, 2])
    (torch.where(valid, logp, 0.0).sum() + 0.5 * ent.sum()).backward()
    xr = logits.clone().requires_grad_()
    rlogp, rent = R.logprobs(xr, tokens.clamp(min=0), entropy=True)
    (torch.where(valid, rlogp, 0.0).sum() + 0.5 * rent.sum()).backward()
    assert torch.isfinite(x.grad).all()
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-5, atol=1e-6)


def test_extreme_finite_logits(device):
    """Finite logits near -+3.4e38: z - max z overflows to -inf for the far ones, whose p = 0
    must add 0 to the entropy (not 0 * -inf = NaN). Log-probs, entropies and gradients are
    finite and equal to the float64 values, on every backend and in the sampler."""
    big = 3e38
    logits = torch.tensor([[[big, -big, 0.0, 1.0], [-big, big, big, 2.0]]], device=device)
    tokens = torch.tensor([[0, 1]], device=device)
    z = logits.clone().requires_grad_()
    logp, ent = fastrl.logprobs(z * 1, tokens, entropy=True)
    (logp.sum() + ent.sum()).backward()
    logq = torch.log_softmax(logits.double().cpu(), -1)
    p = logq.exp()
    want_ent = -torch.where(p > 0, p * logq, 0.0).sum(-1).float()
    torch.testing.assert_close(ent.cpu(), want_ent)
    torch.testing.assert_close(logp.cpu(), logq.gather(-1, tokens.cpu()[..., None])[..., 0].float())
    assert torch.isfinite(z.grad).all(), z.grad
    gen = torch.Generator(device=device).manual_seed(0)
    _, s_logp, s_ent = fastrl.sample(logits[0], generator=gen)
    assert torch.isfinite(s_logp).all() and torch.isfinite(s_ent).all()
    torch.testing.assert_close(s_ent.cpu(), want_ent[0])


@pytest.mark.parametrize("entry", ["logprobs", "policy_loss", "linear_logprobs"])
def test_nearly_one_hot_rows_keep_the_target_gradient(device, entry):
    """Rows with p_y = 1 - 1e-4 at an LLM-like logit offset (|lse| ~ 53). The target entry of
    the gradient, g (1 - p_y) - h p_y (log p_y + H), is a cancellation: formed from p_y =
    exp(z'_y - lse) it inherits lse's rounding at lse's own scale, eps |lse| / (1 - p_y) (what
    fastrl's backward did before: 0.11-0.39 % of the entry's size here, 1 % in a row that CI's
    randomized test drew). From the forward's max-shifted logp it is as exact as torch's own fp32
    log_softmax backward (here <= 0.025 %). Checked against float64 on every path that forms
    the gradient: the backward (`logprobs`), the one-pass loss (`policy_loss`) and the LM-head
    path (`linear_logprobs`, identity weight so that the logits are `hidden`)."""
    B, T, V = 2, 6, 64
    g = torch.Generator().manual_seed(0)
    z = torch.randn(B, T, V, generator=g)
    y = torch.randint(0, V, (B, T), generator=g)
    z.scatter_(2, y[..., None], 13.0)
    z = (z + 40.0).to(device)
    y = y.to(device)
    w1, w2 = (torch.randn(B, T, generator=g).to(device) for _ in "12")
    adv = torch.randn(B, T, generator=g).to(device)

    def loss(logp, ent):  # float64 for the truth, fp32 for fastrl: the same formula
        if entry == "policy_loss":  # reinforce, token-mean: -A logp - c_H H per token
            return (-adv.to(logp.dtype) * logp - 0.1 * ent).sum() / (B * T)
        return (w1.to(logp.dtype) * logp + w2.to(logp.dtype) * ent).sum()

    x64 = z.double().requires_grad_()
    logq = torch.log_softmax(x64, -1)
    want = loss(logq.gather(-1, y[..., None])[..., 0], -(logq.exp() * logq).sum(-1))
    want.backward()
    x = z.clone().requires_grad_()
    if entry == "logprobs":
        loss(*fastrl.logprobs(x, y, entropy=True)).backward()
    elif entry == "policy_loss":
        cfg = fastrl.LossConfig(policy="reinforce", entropy_coef=0.1)
        out = fastrl.policy_loss(x, y, adv, config=cfg)
        torch.testing.assert_close(out.loss.double(), want.detach(), rtol=1e-4, atol=1e-7)
        out.loss.backward()
    else:
        eye = torch.eye(V, device=device)
        loss(*fastrl.linear_logprobs(x, eye, y, entropy=True)).backward()
    at_y = lambda t: t.gather(-1, y[..., None])[..., 0].double()  # noqa: E731
    logp_y, ent = at_y(logq).detach(), -(logq.exp() * logq).sum(-1).detach()
    one_minus_p = -torch.expm1(logp_y)
    assert 5e-5 < one_minus_p.min() and one_minus_p.max() < 1e-3  # the rows are as meant
    # the entry's own scale: its two terms' sizes (they may cancel each other: SPEC 6)
    gt, ht = (-adv / (B * T), -0.1 / (B * T)) if entry == "policy_loss" else (w1, w2)
    size = (gt * one_minus_p).abs() + (ht * (1 - one_minus_p) * (logp_y + ent)).abs()
    rel = (at_y(x.grad) - at_y(x64.grad)).abs() / size
    assert rel.max() < 4e-4, f"target entries off by up to {rel.max():.2e} of their size"
    # the other entries, p_j (g + h (log p_j + H)): no cancellation but where log p_j + H does
    others = x.grad.double().scatter(-1, y[..., None], at_y(x64.grad)[..., None])
    scale = x64.grad.abs().max().item()
    torch.testing.assert_close(others, x64.grad, rtol=1e-4, atol=1e-5 * scale)


@pytest.mark.parametrize("entry", ["logprobs", "linear_logprobs", "temperature"])
@pytest.mark.parametrize("offset", [1e3, 1e4])
def test_gradient_is_exact_at_a_large_logit_offset(device, entry, offset):
    """Logits at an offset of 1e3 / 1e4 (|lse| that large): the gradient as close to float64's as
    torch's own fp32 log_softmax backward (relative to each row's largest entry). From p_j =
    exp(z'_j - lse) the stored lse's rounding at its own scale, eps |lse|, landed in every p_j:
    3e-5 of the row's scale at 1e3 and 8e-4 at 1e4, against eager fp32's 3e-7 (the backward of
    `logprobs` and `linear_logprobs` did so before). From the row max m and log s,
    exp((z'_j - m) - log s) is exact at any offset. With a temperature, z' = z / tau rounds at
    its own scale before the shift on the Triton path, as in eager fp32 log_softmax(z / tau)
    (the chunked torch path shifts first: exact)."""
    B, T, V = 3, 5, 200
    g = torch.Generator().manual_seed(2)
    z = (torch.randn(B, T, V, generator=g) * 3 + offset).to(device)
    y = torch.randint(0, V, (B, T), generator=g).to(device)
    w1, w2 = (torch.randn(B, T, generator=g).to(device) for _ in "12")
    tau = 0.7 if entry == "temperature" else 1.0

    def grad(x, f):  # d/dx of sum(w1 logp + w2 H), (logp, H) = f(x)
        x = x.clone().requires_grad_()
        logp, ent = f(x)
        (w1.to(x.dtype) * logp + w2.to(x.dtype) * ent).sum().backward()
        return x.grad.double()

    def eager(x):
        logq = torch.log_softmax(x / tau, -1)
        return logq.gather(-1, y[..., None])[..., 0], -(logq.exp() * logq).sum(-1)

    def mine(x):
        if entry == "linear_logprobs":  # identity weight: the logits are `hidden`, exactly
            eye = torch.eye(V, device=device)
            return fastrl.linear_logprobs(x, eye, y, entropy=True, chunk_size=4)
        return fastrl.logprobs(x, y, temperature=tau, entropy=True)

    want = grad(z.double(), eager)
    scale = want.abs().amax(-1, keepdim=True)
    eager_err = ((grad(z, eager) - want).abs() / scale).max()
    err = ((grad(z, mine) - want).abs() / scale).max()
    assert err <= 2 * eager_err + 1e-6, (
        f"gradient off by {err:.2e} of its row's largest entry, eager fp32 {eager_err:.2e}"
    )
