"""fastrl.fused_linear_policy_loss and fastrl.linear_logprobs against the reference on the
materialised logits z = softcap(s (hidden @ weight.T + bias)), forward and backward.

Both LM-head paths are run on the chunked torch path and on the Triton kernels (interpreter on
CPU), with tiny shapes. Rows whose mask is 0 are never computed: their logp / entropy are 0 and
their hidden-state gradient is 0; everything that counts must equal the reference.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastrl
from fastrl import _linear_ops as L
from fastrl import reference as R
from fastrl.config import PRESETS

TOL = {torch.float32: (2e-5, 2e-5), torch.bfloat16: (3e-2, 3e-2)}


def make(B=3, T=5, H=8, V=37, dtype=torch.float32, seed=0, bias=True, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(device, dtype).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(device, dtype).requires_grad_()
    b = (0.1 * torch.randn(V, generator=g)).to(device, dtype).requires_grad_() if bias else None
    tokens = torch.randint(0, V, (B, T), generator=g).to(device)
    adv = torch.randn(B, generator=g).to(device)
    with torch.no_grad():
        logits = hidden.float() @ weight.float().T + (0 if b is None else b.float())
        logp = R.token_logprobs(logits, tokens)[0]
    old = logp + 0.3 * torch.randn(B, T, generator=g).to(device)
    ref = logp + 0.3 * torch.randn(B, T, generator=g).to(device)
    mask = (torch.rand(B, T, generator=g) > 0.2).to(device)
    return hidden, weight, b, tokens, adv, old, ref, mask


def materialise(hidden, weight, b, logit_scale=1.0, softcap=None):
    """fp32 leaves and the logits the fused paths never build."""
    hf, wf = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    bf = None if b is None else b.detach().float().requires_grad_()
    z = (hf @ wf.T + (0 if bf is None else bf)) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    return [t for t in (hf, wf, bf) if t is not None], z


def assert_grads(grads, exp_grads, dtype):
    rtol, atol = TOL[dtype]
    for got, want in zip(grads, exp_grads):
        assert got.dtype == dtype
        scale = want.abs().max().clamp(min=1e-6)
        torch.testing.assert_close(got.float() / scale, want / scale, rtol=rtol, atol=atol)


def compare(batch, dtype=torch.float32, chunk_size=4, logit_scale=1.0, softcap=None, **cfg):
    hidden, weight, b, tokens, adv, old, ref, mask = batch
    params = [t for t in (hidden, weight, b) if t is not None]
    out = fastrl.fused_linear_policy_loss(
        hidden, weight, tokens, adv, old, ref, mask, bias=b, chunk_size=chunk_size,
        logit_scale=logit_scale, softcap=softcap, **cfg,
    )  # fmt: skip
    grads = torch.autograd.grad(2.0 * out.loss, params)
    leaves, logits = materialise(hidden, weight, b, logit_scale, softcap)
    expected = R.policy_loss(logits, tokens, adv, old, ref, mask, **cfg)
    exp_grads = torch.autograd.grad(2.0 * expected.loss, leaves)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.loss.float(), expected.loss, rtol=rtol, atol=atol)
    counted = mask.bool()
    for name in ("logp", "entropy", "kl"):
        got, want = getattr(out, name), getattr(expected, name)
        torch.testing.assert_close(got[counted], want[counted], rtol=rtol, atol=atol)
    assert torch.all(out.logp[~counted] == 0) and torch.all(out.entropy[~counted] == 0)
    assert out.metrics.keys() == expected.metrics.keys()
    for k in out.metrics:
        torch.testing.assert_close(out.metrics[k], expected.metrics[k], rtol=rtol, atol=atol)
    assert_grads(grads, exp_grads, dtype)
    assert torch.all(grads[0][~counted] == 0)  # skipped rows: no gradient, no work
    return out


# --------------------------------------------------------------------------- policy loss
@pytest.mark.parametrize("preset", PRESETS)
def test_presets_match_reference(preset):
    compare(make(), config=preset, entropy_coef=0.01)


def test_presets_triton_kernels(engine):
    device, backend = engine
    for preset in ("grpo", "gspo") if backend == "triton" else PRESETS:
        compare(make(B=2, T=3, V=19, device=device), config=preset, entropy_coef=0.01)


@pytest.mark.parametrize("chunk_size", [1, 4, 15, 1000])
def test_chunk_sizes_and_no_bias(chunk_size):
    compare(make(bias=False), chunk_size=chunk_size, config="dapo", temperature=0.7)


@pytest.mark.parametrize(
    "options",
    [
        dict(config="gspo"),  # sequence-level ratio: the two-phase path
        dict(config="grpo", rollout_is="sequence", rollout_is_mode="mask", rollout_is_cap=1.5),
        dict(config="grpo", rollout_is="token", rollout_is_cap=1.2),
        dict(config="dapo", clip_dual=3.0, kl_coef=0.1, kl_estimator="low_var_kl"),
        dict(policy="sapo", agg="seq-mean-token-sum-norm", max_len=7),
        # options added against TRL / verl (issue 9): separable and two-phase ones
        dict(config="dapo", agg="token-sum"),
        dict(config="gspo", seq_ratio_grad="token"),
        dict(config="gspo", kl_coef=0.04, kl_bias_correction=True, kl_bias_ratio="sequence"),
        dict(config="grpo", rollout_is="token", rollout_is_floor=0.8, rollout_is_cap=1.2),
    ],
)
def test_options(options):
    batch = make()
    if "rollout_is" in options:
        options["rollout_logp"] = batch[5] + 0.2 * torch.randn_like(batch[5])
    compare(batch, **options)


@pytest.mark.parametrize("logit_scale, softcap", [(0.5, None), (1.0, 3.0), (2.0, 1.5)])
def test_logit_scale_and_softcap(engine, logit_scale, softcap):
    device, _ = engine
    compare(make(B=2, T=3, V=19, device=device), config="grpo", entropy_coef=0.02,
            logit_scale=logit_scale, softcap=softcap)  # fmt: skip


def test_bf16():
    compare(make(dtype=torch.bfloat16), dtype=torch.bfloat16, config="grpo")


@pytest.mark.parametrize("logit_scale, softcap", [(0.3, None), (1.0, 10.0), (0.3, 10.0)])
def test_bf16_scale_and_softcap_are_applied_in_fp32(engine, logit_scale, softcap):
    """With a bf16 / fp16 GEMM, s a and c tanh(. / c) run on the GEMM's output widened to fp32
    (as TRL's chunked LM head does): in bf16 they were off by up to ~0.1 in logp (a Gemma-2's
    softcap of 30). Small-integer inputs make the bf16 GEMM exact (|a| <= 48), so logp and
    entropy must match fp32 math on the same inputs to fp32 precision."""
    device, _ = engine
    g = torch.Generator().manual_seed(0)
    B, T, H, V = 2, 3, 8, 19
    hidden = torch.randint(-2, 3, (B, T, H), generator=g).to(device, torch.bfloat16)
    weight = torch.randint(-3, 4, (V, H), generator=g).to(device, torch.bfloat16)
    tokens = torch.randint(0, V, (B, T), generator=g).to(device)
    kw = dict(logit_scale=logit_scale, softcap=softcap)
    (hf, wf), z = materialise(hidden, weight, None, **kw)
    want_logp, want_ent = R.token_logprobs(z.detach(), tokens)
    logp, ent = fastrl.linear_logprobs(hidden, weight, tokens, entropy=True, chunk_size=4, **kw)
    torch.testing.assert_close(logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, want_ent, rtol=1e-5, atol=1e-5)
    adv = torch.randn(B, generator=g).to(device)
    old = want_logp.detach() + 0.1
    out = fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, None, None,
                                          config="dapo", chunk_size=4, **kw)  # fmt: skip
    torch.testing.assert_close(out.logp, want_logp, rtol=1e-5, atol=1e-5)
    # the backward: dz is rounded to bf16 for its GEMMs only
    hidden.requires_grad_(), weight.requires_grad_()
    out = fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, None, None,
                                          config="dapo", chunk_size=4, **kw)  # fmt: skip
    grads = torch.autograd.grad(out.loss, (hidden, weight))
    expected = R.policy_loss(z, tokens, adv, old, None, None, config="dapo")
    assert_grads(grads, torch.autograd.grad(expected.loss, (hf, wf)), torch.bfloat16)


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # the CPU's fp32 GEMM on a widened dz; CUDA's half-precision GEMM with an fp32 output
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["linear_logprobs", "fused_linear_policy_loss"])
def test_half_precision_dw_does_not_depend_on_the_chunk(device, dtype, path):
    """dW = sum over chunks of dz^T X: each chunk's product is formed in fp32 and added to the
    fp32 sum, so one row per chunk (256 chunks) and one chunk of every row give the same dW
    up to the last rounding to the weight's dtype. Rounding each chunk's product to bf16 / fp16
    before adding it (the old path) left ~1600 of 16384 entries more than an ulp away."""
    g = torch.Generator().manual_seed(0)
    N, H, V = 256, 32, 512
    hidden = torch.randn(N, H, generator=g).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(device, dtype)
    tokens = torch.randint(0, V, (N,), generator=g).to(device)
    adv = torch.randn(N, generator=g).to(device)

    def dw(chunk_size):
        w = weight.clone().requires_grad_()
        if path == "linear_logprobs":
            logp, ent = fastrl.linear_logprobs(
                hidden, w, tokens, entropy=True, chunk_size=chunk_size
            )
            loss = (logp * adv).sum() + 0.1 * ent.sum()
        else:
            loss = fastrl.fused_linear_policy_loss(
                hidden, w, tokens, adv, chunk_size=chunk_size
            ).loss
        (grad,) = torch.autograd.grad(loss, w)
        assert grad.dtype == dtype
        return grad.float()

    one_by_one, all_at_once = dw(1), dw(N)
    info = torch.finfo(dtype)
    ulp = info.eps  # relative spacing: one rounding of nearly the same fp32 sum
    # below the smallest normal the spacing is absolute: one rounding there is one subnormal
    # step (fp16: 2^-24 = 6e-8; seen on an H200, an entry of 2.5e-5 one step apart)
    subnormal_step = info.smallest_normal * info.eps
    scale = all_at_once.abs().max().item()
    diff, size = (one_by_one - all_at_once).abs(), all_at_once.abs()
    # The two fp32 sums (256 rank-1 updates, one GEMM) differ by the summation order: about
    # 1e-6 of the largest entry here, up to 2e-5 where the BLAS blocks its sums otherwise (an
    # Intel Xeon's MKL: 2 of 16384 fp16 entries beyond one rounding + 1e-6 * scale), so a few
    # entries near a rounding boundary may land one step further. The old path moved thousands
    # (bf16: 3178, fp16: 2321 of 16384 on that Xeon).
    one_rounding = diff > ulp * size + max(1e-6 * scale, subnormal_step)
    assert one_rounding.sum() <= N // 16, int(one_rounding.sum())
    torch.testing.assert_close(one_by_one, all_at_once, rtol=2 * ulp,
                               atol=max(2e-5 * scale, subnormal_step))  # fmt: skip


def test_without_a_mask_every_row_counts_without_reading_one(monkeypatch):
    """No mask given: the fused policy loss takes every row without looking for the counted
    ones (torch.nonzero of the mask, a host sync on a GPU: an H200 run caught it in
    test_no_host_sync), with and without grad; with a mask it still finds its rows."""
    seen = []
    real = L._active_rows
    monkeypatch.setattr(L, "_active_rows", lambda m, *a: seen.append(m) or real(m, *a))
    hidden, weight, b, tokens, adv, old, ref, mask = make()
    fastrl.fused_linear_policy_loss(hidden.requires_grad_(), weight, tokens, adv).loss.backward()
    with torch.no_grad():
        fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv)
    assert seen == [None, None]
    fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, mask=mask).loss.backward()
    assert seen[-1] is not None


@pytest.mark.parametrize("preset", ["grpo", "gspo"])  # one pass; two phases
def test_meta_tensors_give_shapes(preset):
    """On the `meta` device (shape inference, deferred init) the LM-head ops give the right
    shapes forward and backward, as policy_loss / logprobs do; the autocast probe
    (torch.is_autocast_enabled("meta") raises) made them fail."""
    hidden, weight, bias, tokens, adv, old, ref, mask = (
        None if t is None else t.detach().to("meta") for t in make()
    )
    hidden.requires_grad_(), weight.requires_grad_(), bias.requires_grad_()
    logp, ent = fastrl.linear_logprobs(hidden, weight, tokens, bias=bias, entropy=True, mask=mask)
    assert logp.shape == ent.shape == tokens.shape and logp.dtype == torch.float32
    (logp.sum() + ent.sum()).backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    out = fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, ref, mask,
                                          config=preset, bias=bias)  # fmt: skip
    out.loss.backward()
    assert out.loss.shape == () and out.logp.shape == tokens.shape
    assert bias.grad.shape == bias.shape and out.loss.device.type == "meta"


def test_flat_inputs_and_strided_view():
    hidden, weight, b, tokens, adv, old, ref, mask = make(B=1, T=9)
    flat = (hidden[0], weight, b, tokens[0], torch.randn(9), old[0], ref[0], mask[0])
    compare(flat, kl_coef=0.04)
    # a hidden[:, 1:] view (what a trainer slices off the prompt) is read in place
    full = torch.randn(3, 6, 8).requires_grad_()
    _, weight, b, tokens, adv, old, ref, mask = make()
    compare((full[:, 1:], weight, b, tokens, adv, old, ref, mask), config="grpo")


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_row_counted(bias, dtype):
    """No row skipped: the gradient buffers start unfilled and the first chunk writes them."""
    hidden, weight, b, tokens, adv, old, ref, mask = make(bias=bias, dtype=dtype)
    compare((hidden, weight, b, tokens, adv, old, ref, torch.ones_like(mask)), dtype, chunk_size=4,
            config="grpo")  # fmt: skip


def test_t_equals_one_and_all_masked():
    compare(make(T=1), config="grpo")
    hidden, weight, b, tokens, adv, old, ref, mask = make()
    out = fastrl.fused_linear_policy_loss(
        hidden, weight, tokens, adv, old, mask=torch.zeros_like(mask), bias=b, config="dapo"
    )
    grads = torch.autograd.grad(out.loss, (hidden, weight, b))
    assert out.loss.item() == 0.0
    assert all(torch.all(g == 0) for g in grads)


def test_masked_rows_do_no_gemm_work(monkeypatch):
    """A 90 %-masked batch gathers and multiplies only the counted rows."""
    seen = []
    real = L._logits

    def spy(rows, *args):
        seen.append(rows.shape[0])
        return real(rows, *args)

    monkeypatch.setattr(L, "_logits", spy)
    hidden, weight, b, tokens, adv, old, ref, _ = make(B=4, T=10)
    mask = torch.zeros(4, 10, dtype=torch.bool)
    mask[0, :4] = True
    fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, mask=mask, bias=b,
                                    chunk_size=3).loss.backward()  # fmt: skip
    assert sum(seen) == 4 and max(seen) <= 3  # one GEMM pass over the 4 counted rows, no recompute


def test_backward_scale_and_retain_graph():
    hidden, weight, b, tokens, adv, old, ref, mask = make()
    out = fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, mask=mask, bias=b)
    (g1,) = torch.autograd.grad(out.loss, hidden, retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        torch.autograd.grad(out.loss, hidden)
    out = fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, mask=mask, bias=b)
    (g3,) = torch.autograd.grad(-3.0 * out.loss, hidden)
    torch.testing.assert_close(g3, -3.0 * g1)


def test_no_grad():
    hidden, weight, b, tokens, adv, old, ref, mask = make()
    with torch.no_grad():
        out = fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, mask=mask, bias=b)
    _, logits = materialise(hidden, weight, b)
    expected = R.policy_loss(logits, tokens, adv, old, mask=mask)
    assert out.loss.grad_fn is None
    torch.testing.assert_close(out.loss, expected.loss.detach(), rtol=2e-5, atol=2e-5)


def test_no_grad_skips_masked_rows_as_the_gradient_path_does():
    """Under torch.no_grad (a pi_old / eval pass) the fused loss still skips the rows whose mask
    is 0: their logp and entropy are reported as 0, exactly as with gradients, and the counted
    ones equal the reference's on the materialised logits. Computing the masked rows too would
    give them their real log-probs: the two paths would disagree on the same call."""
    hidden, weight, b, tokens, adv, old, ref, mask = make()
    with torch.no_grad():
        out = fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, mask=mask, bias=b)
    _, logits = materialise(hidden, weight, b)
    want_logp, want_ent = R.token_logprobs(logits.detach(), tokens)
    zero = torch.zeros(())
    torch.testing.assert_close(out.logp, torch.where(mask, want_logp, zero), rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(out.entropy, torch.where(mask, want_ent, zero), rtol=2e-5,
                               atol=2e-5)  # fmt: skip
    assert (out.logp[~mask] == 0).all() and (out.entropy[~mask] == 0).all()
    with_grad = fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, mask=mask, bias=b)
    assert torch.equal(with_grad.logp, out.logp) and torch.equal(with_grad.entropy, out.entropy)


def test_bad_inputs():
    hidden, weight, b, tokens, adv, *_ = make()
    cases = [
        (dict(weight=weight[:, :-1]), "hidden .* and weight .* do not fit"),
        (dict(bias=b[:-1]), r"bias must be a \(37,\) tensor"),
        (dict(weight=weight.double()), "weight must be a float32 / bfloat16 / float16 tensor"),
        (dict(hidden=hidden.double()), "hidden must be a float32 / bfloat16 / float16 tensor"),
        (dict(hidden=hidden[..., :0], weight=weight[:, :0]), "H >= 1"),
        (dict(tokens=tokens + weight.shape[0]), r"tokens must lie in \[0, V\)"),
        (dict(tokens=tokens.clamp(max=36).index_fill(1, torch.tensor([2]), 37)), r"\[0, 37\)"),
        (dict(weight=weight[:0], bias=b[:0]), r"weight must be \(V, H\) with V >= 1"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(chunk_size=True), "chunk_size must be an int >= 1 or None, got True"),
        (dict(chunk_size=np.float64(4)), "chunk_size"),
        (dict(softcap=0.0), "softcap"),
        (dict(logit_scale=float("nan")), "logit_scale"),
        (dict(logit_scale=1e39), "logit_scale"),  # inf in fp32
        (dict(softcap=1e300), "softcap"),
    ]
    for change, match in cases:
        kwargs = {**dict(hidden=hidden, weight=weight, tokens=tokens, advantages=adv), **change}
        with pytest.raises(ValueError, match=match):
            fastrl.fused_linear_policy_loss(**kwargs)


def test_linear_logprobs_refuses_the_first_token_id_past_the_vocabulary():
    """tokens must lie in [0, V): the id V itself (one past the last row of the weight) is
    refused with a ValueError naming the range, like every larger one, on both LM-head ops;
    let through, its logp (and the loss) would come out NaN without an error."""
    hidden, weight, b, tokens, adv, *_ = make()
    V = weight.shape[0]
    tokens = tokens.clone()
    tokens[1, 3] = V
    with pytest.raises(ValueError, match=rf"tokens must lie in \[0, V\) = \[0, {V}\), got "):
        fastrl.linear_logprobs(hidden, weight, tokens, bias=b)
    with pytest.raises(ValueError, match=rf"tokens must lie in \[0, V\) = \[0, {V}\)"):
        fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, bias=b)


def test_default_chunk_by_device(monkeypatch):
    """The default rows per chunk: ~64 MB of fp32 logits on the CPU; on a GPU 2048 rows (every
    chunk re-reads the weight and the fp32 dW sum), fewer where a chunk's half-precision logits
    pass 2 GiB. Both LM-head ops ask for the default of their hidden states' device."""
    from fastrl import chunked

    assert (
        L.default_chunk(151936) == L.default_chunk(151936, "cpu") == 2 * chunked.chunk_rows(151936)
    )
    assert L.default_chunk(151936) < 128
    assert (
        L.default_chunk(151936, "cuda") == L.default_chunk(262144, torch.device("cuda:0")) == 2048
    )
    assert L.default_chunk(2**20, "cuda") == 1024
    asked = []
    real = fastrl.linear.default_chunk
    monkeypatch.setattr(fastrl.linear, "default_chunk", lambda V, d: asked.append(d) or real(V, d))
    hidden, weight, b, tokens, adv, old, ref, mask = make()
    fastrl.linear_logprobs(hidden, weight, tokens)
    fastrl.fused_linear_policy_loss(hidden, weight, tokens, adv, old, mask=mask)
    assert [torch.device(d).type for d in asked] == ["cpu", "cpu"]


def test_numpy_chunk_size_is_an_int():
    """chunk_size as numpy's integer chunks exactly as Python's int, in both LM-head ops."""
    hidden, weight, b, tokens, adv, old, ref, mask = make()
    for chunk in (5, np.int64(5), np.int32(5)):
        out = fastrl.fused_linear_policy_loss(
            hidden, weight, tokens, adv, old, mask=mask, bias=b, chunk_size=chunk
        )
        logp = fastrl.linear_logprobs(hidden, weight, tokens, bias=b, chunk_size=chunk)
        if isinstance(chunk, int):
            expected, expected_logp = out.loss, logp
        torch.testing.assert_close(out.loss, expected, rtol=0, atol=0)
        torch.testing.assert_close(logp, expected_logp, rtol=0, atol=0)
    with pytest.raises(ValueError, match="chunk_size must be an int >= 1 or None, got False"):
        fastrl.linear_logprobs(hidden, weight, tokens, chunk_size=False)


# --------------------------------------------------------------------------- linear_logprobs
def logprobs_case(engine_device, dtype=torch.float32, mask=True, strided=False, **kw):
    hidden, weight, b, tokens, *_, m = make(B=2, T=4, V=23, dtype=dtype, device=engine_device)
    if strided:
        full = torch.randn(2, 6, 8, device=engine_device).to(dtype).requires_grad_()
        hidden = full[:, 1:-1]
    m = m if mask else None
    params = [t for t in (hidden, weight, b) if t is not None]
    logp, ent = fastrl.linear_logprobs(hidden, weight, tokens, bias=b, entropy=True, mask=m,
                                       chunk_size=3, **kw)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    up_lp, up_h = (torch.randn(2, 4, generator=g).to(engine_device) for _ in range(2))
    grads = torch.autograd.grad((logp * up_lp).sum() + (ent * up_h).sum(), params)
    leaves, logits = materialise(hidden, weight, b, kw.get("logit_scale", 1.0),
                                 kw.get("softcap"))  # fmt: skip
    rlogp, rent = R.token_logprobs(logits, tokens, kw.get("temperature", 1.0))
    keep = torch.ones_like(tokens, dtype=torch.bool) if m is None else m.bool()
    rlogp, rent = torch.where(keep, rlogp, 0.0), torch.where(keep, rent, 0.0)
    exp_grads = torch.autograd.grad((rlogp * up_lp).sum() + (rent * up_h).sum(), leaves)
    rtol, atol = TOL[dtype]
    assert logp.dtype == torch.float32 and logp.shape == tokens.shape
    torch.testing.assert_close(logp, rlogp, rtol=rtol, atol=atol)
    torch.testing.assert_close(ent, rent, rtol=rtol, atol=atol)
    assert_grads(grads, exp_grads, dtype)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(mask=False),
        dict(temperature=0.6),
        dict(softcap=2.0, logit_scale=1.5),
        dict(strided=True),
    ],  # fmt: skip
)
def test_linear_logprobs_matches_reference(engine, kw):
    device, _ = engine
    logprobs_case(device, **kw)


def test_linear_logprobs_bf16_gemms_stay_bf16(monkeypatch):
    seen = []
    for name in ("mm", "addmm"):
        real = getattr(torch, name)

        def spy(*args, _real=real, **kw):
            seen.append(tuple(a.dtype for a in args if isinstance(a, torch.Tensor)))
            return _real(*args, **kw)

        monkeypatch.setattr(torch, name, spy)
    logprobs_case("cpu", dtype=torch.bfloat16)
    assert seen and all(set(d) == {torch.bfloat16} for d in seen)


def test_linear_logprobs_logp_only_and_flat():
    hidden, weight, b, tokens, *_ = make(B=1, T=6)
    logp = fastrl.linear_logprobs(hidden[0], weight, tokens[0], bias=b)
    _, logits = materialise(hidden, weight, b)
    torch.testing.assert_close(logp, R.token_logprobs(logits[0], tokens[0])[0], rtol=2e-5,
                               atol=2e-5)  # fmt: skip
    logp.sum().backward()
    assert hidden.grad is not None and weight.grad is not None and b.grad is not None


def test_linear_logprobs_opcheck_and_compile():
    hidden, weight, b, tokens, *_ = make(B=2, T=3, V=13)
    torch.library.opcheck(
        torch.ops.fastrl.linear_token_stats.default,
        (hidden, weight, b, tokens, None, 0.9, 1.0, None, 2),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    torch._dynamo.reset()

    def f(hidden, weight, b, tokens):
        logp, ent = fastrl.linear_logprobs(hidden, weight, tokens, bias=b, entropy=True,
                                           temperature=0.9, chunk_size=2)  # fmt: skip
        return (logp + 0.1 * ent).sum()

    compiled = torch.compile(f, fullgraph=True)
    loss_c = compiled(hidden, weight, b, tokens)
    gc = torch.autograd.grad(loss_c, (hidden, weight))
    loss_e = f(hidden, weight, b, tokens)
    ge = torch.autograd.grad(loss_e, (hidden, weight))
    torch.testing.assert_close(loss_c, loss_e)
    for a, e in zip(gc, ge):
        torch.testing.assert_close(a, e)
    torch._dynamo.reset()


def test_linear_logprobs_bad_inputs():
    hidden, weight, b, tokens, *_ = make()
    with pytest.raises(ValueError, match="tokens must have shape"):
        fastrl.linear_logprobs(hidden, weight, tokens[:, :-1])
    with pytest.raises(ValueError, match="mask"):
        fastrl.linear_logprobs(hidden, weight, tokens, mask=torch.ones(3, 4))
    with pytest.raises(ValueError, match="temperature"):
        fastrl.linear_logprobs(hidden, weight, tokens, temperature=0.0)
