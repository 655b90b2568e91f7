"""What only hardware shows, for the GPU run (`pytest -m gpu`): every dtype at the largest
vocabularies, more rows than a CUDA grid's y / z limit (65535), no host sync around any op's
forward and backward, and torch.compile(fullgraph=True) through the ops on CUDA.

Each check is written once, over a device: on CUDA at the hardware shapes (marked `gpu`), and,
where it has one, on the CPU at small shapes, so that CI runs the test code itself before a GPU
does (a GPU session has 15 device-minutes in all; a broken test would spend them).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_fused_linear import TOL as LINEAR_TOL
from test_fused_linear import compare as compare_linear
from test_fused_linear import make as make_linear
from test_policy_loss import assert_match, make_batch, run_both

import fastrl
from fastrl import reference as R

CUDA = pytest.param("cuda", marks=pytest.mark.gpu)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

# rows per device for the many-rows checks: more than 65535 (a grid's y / z limit) on CUDA
MANY_ROWS = {"cpu": 1029, "cuda": 65536 + 7}


@pytest.fixture
def on(request, monkeypatch):
    """The device of the test; on the CPU the chunked torch path (the interpreter would take
    minutes at these shapes), on CUDA the Triton kernels."""
    device = request.param
    monkeypatch.setenv("FASTRL_BACKEND", "torch" if device == "cpu" else "triton")
    torch._dynamo.reset()
    yield device
    torch._dynamo.reset()


def on_devices(*devices):
    return pytest.mark.parametrize("on", devices, indirect=True)


# --------------------------------------------------------------------------- large vocabularies
@pytest.mark.gpu
@pytest.mark.parametrize("V", [151936, 262144])
@pytest.mark.parametrize("dtype", list(DTYPES))
def test_policy_loss_and_logprobs_large_vocab(V, dtype):
    """The logits path at Qwen2's and Gemma 3's vocabularies, every dtype, fwd + bwd."""
    dt = DTYPES[dtype]
    batch = make_batch(2, 8, V, dtype=dt, device="cuda", rollout=True)
    rollout_logp = batch.pop("rollout_logp")
    assert_match(*run_both(batch, config="grpo", entropy_coef=0.01), dtype=dt)
    gspo = dict(config="gspo", rollout_is="sequence", rollout_logp=rollout_logp)
    assert_match(*run_both(batch, **gspo), dtype=dt)
    x = batch["logits"].detach().clone().requires_grad_()
    logp, ent = fastrl.logprobs(x, batch["tokens"], temperature=0.7, entropy=True)
    (logp.sum() + 0.1 * ent.sum()).backward()
    xr = batch["logits"].detach().float().requires_grad_()
    ref_logp, ref_ent = R.logprobs(xr, batch["tokens"], temperature=0.7, entropy=True)
    (ref_logp.sum() + 0.1 * ref_ent.sum()).backward()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-4, atol=1e-4)
    scale = xr.grad.abs().max()
    torch.testing.assert_close(x.grad.float() / scale, xr.grad / scale, rtol=1e-2, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("V", [151936, 262144])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_linear_large_vocab(V, dtype):
    """The LM-head path at the largest vocabularies: several chunks of rows, bf16 GEMMs."""
    dt = DTYPES[dtype]
    batch = make_linear(B=2, T=24, H=64, V=V, dtype=dt, device="cuda")
    compare_linear(batch, dtype=dt, chunk_size=16, config="grpo", entropy_coef=0.01)
    compare_linear(batch, dtype=dt, chunk_size=16, config="gspo")


# --------------------------------------------------------------------------- many rows
@on_devices("cpu", CUDA)
def test_many_rows_every_op(on):
    """N > 65535 rows (on CUDA): rows must ride the grid's x axis (limit 2^31 - 1). Every op
    that launches one program per row, against the reference on all rows."""
    N, V = MANY_ROWS[on], 256
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(N, V, generator=g) * 2).to(on)
    tokens = torch.randint(0, V, (N,), generator=g).to(on)
    adv = torch.randn(N, generator=g).to(on)
    old = R.token_logprobs(logits, tokens)[0] + 0.2 * torch.randn(N, generator=g).to(on)
    batch = dict(logits=logits, tokens=tokens, advantages=adv, old_logp=old)
    assert_match(*run_both(batch, config="dapo"))

    x = logits.clone().requires_grad_()
    logp, ent = fastrl.logprobs(x, tokens, entropy=True)
    (logp - ent).sum().backward()
    xr = logits.clone().requires_grad_()
    ref_logp, ref_ent = R.logprobs(xr, tokens, entropy=True)
    (ref_logp - ref_ent).sum().backward()
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, ref_ent, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.grad, xr.grad, rtol=1e-4, atol=1e-6)

    sampled, s_logp, s_ent = fastrl.sample(logits, temperature=0.9)
    assert sampled.shape == (N,) and ((sampled >= 0) & (sampled < V)).all()
    want_logp, want_ent = R.token_logprobs(logits, sampled, 0.9)
    torch.testing.assert_close(s_logp, want_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s_ent, want_ent, rtol=1e-5, atol=1e-5)
    # the last rows are where a grid y / z overflow or an int32 row index would show
    assert sampled[-3:].ne(sampled[:3]).any() or V == 1

    compare_linear(make_linear(B=1, T=N, H=16, V=V, device=on), chunk_size=8192, config="grpo")

    rewards, values = torch.randn(N, 4, generator=g), torch.randn(N, 4, generator=g)
    mask = torch.rand(N, 4, generator=g) > 0.2
    adv_gae, ret = fastrl.gae(rewards.to(on), values.to(on), mask.to(on), 0.99, 0.95)
    ref_adv, ref_ret = R.gae(rewards, values, mask, 0.99, 0.95)
    torch.testing.assert_close(adv_gae.cpu(), ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret.cpu(), ref_ret, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- no host sync
def _no_sync_cases(device):
    """name -> a function running one op's forward + backward on `device` inputs made
    beforehand (making them copies host -> device, which the sync check would flag)."""
    batch = make_batch(2, 8, 1000, device=device)
    logits = batch.pop("logits")
    tokens, old, ref = batch["tokens"], batch["old_logp"], batch["ref_logp"]
    rollout_logp = old + 0.1
    hidden, weight, b, l_tokens, l_adv, l_old, l_ref, _ = make_linear(
        B=2, T=8, H=16, V=1000, device=device
    )
    N = 16
    flat = {k: v.reshape(N) for k, v in batch.items() if k != "advantages"}
    cu = torch.tensor([0, 5, 11, 16], device=device)
    seq_adv = torch.randn(3, device=device)
    num_tokens = torch.tensor(12.0, device=device)
    tau = torch.full((2, 8), 0.8, device=device)
    values = torch.randn(2, 8, device=device, requires_grad=True)
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731

    def grpo():
        fastrl.policy_loss(leaf(logits), **batch, config="grpo").loss.backward()

    def gspo_sequence_is_upstream_2():
        out = fastrl.policy_loss(leaf(logits), **batch, rollout_logp=rollout_logp,
                                 config="gspo", rollout_is="sequence")  # fmt: skip
        (2 * out.loss).backward()

    def dapo_tensor_num_tokens_and_temperature():
        out = fastrl.policy_loss(leaf(logits), **batch, config="dapo", num_tokens=num_tokens,
                                 temperature=tau)  # fmt: skip
        out.loss.backward()

    def packed_with_max_seqlen():
        out = fastrl.policy_loss(leaf(logits).reshape(N, -1), **flat, advantages=seq_adv,
                                 cu_seqlens=cu, max_seqlen=6, config="grpo")  # fmt: skip
        out.loss.backward()

    def logprobs_no_grad():
        with torch.no_grad():
            fastrl.logprobs(logits, tokens, entropy=True)

    def logprobs_grad():
        logp, ent = fastrl.logprobs(leaf(logits), tokens, temperature=0.9, entropy=True)
        (logp.sum() + ent.sum()).backward()

    def linear_logprobs_no_mask():
        fastrl.linear_logprobs(leaf(hidden), leaf(weight), l_tokens, bias=leaf(b)).sum().backward()

    def fused_linear_no_mask():
        out = fastrl.fused_linear_policy_loss(leaf(hidden), leaf(weight), l_tokens, l_adv, l_old,
                                              l_ref, bias=leaf(b), config="grpo")  # fmt: skip
        out.loss.backward()

    def from_logprobs():
        out = fastrl.policy_loss_from_logprobs(leaf(old), None, batch["advantages"], old, ref,
                                               batch["mask"], config="grpo")  # fmt: skip
        out.loss.backward()

    def value_loss():
        fastrl.value_loss(values, values.detach(), values.detach() + 1)[0].backward()

    def sample():
        fastrl.sample(logits.reshape(N, -1), temperature=0.8)

    cases = (grpo, gspo_sequence_is_upstream_2, dapo_tensor_num_tokens_and_temperature,
             packed_with_max_seqlen, logprobs_no_grad, logprobs_grad, linear_logprobs_no_mask,
             fused_linear_no_mask, from_logprobs, value_loss, sample)  # fmt: skip
    return {fn.__name__: fn for fn in cases}


NO_SYNC_CASES = list(_no_sync_cases("cpu"))


@pytest.mark.parametrize("case", NO_SYNC_CASES)
@on_devices("cpu", CUDA)
def test_no_host_sync(on, case):
    """torch.cuda.set_sync_debug_mode("error") around each op's forward + backward: a `.item()`,
    a boolean index or a blocking copy between host and device raises. (The LM-head paths with
    a mask read its row count once, by design, and the packed path without max_seqlen reads
    that: both documented, so both left out here.) On the CPU the same calls just run."""
    fn = _no_sync_cases(on)[case]
    guard = contextlib.nullcontext()
    if on == "cuda":
        torch.cuda.synchronize()
        guard = _sync_debug_error()
    with guard:
        fn()


@contextlib.contextmanager
def _sync_debug_error():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


# --------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize(
    "on, dtype",
    [("cpu", "fp32"), pytest.param("cuda", "fp32", marks=pytest.mark.gpu),
     pytest.param("cuda", "bf16", marks=pytest.mark.gpu)],
    indirect=["on"],
)  # fmt: skip
def test_compiled_step_matches_eager(on, dtype):
    """torch.compile(fullgraph=True) of a step with the logits path, the LM-head path and
    no-grad log-probs (Inductor generates Triton around fastrl's own kernels on CUDA): the same
    loss and gradients as eager, and eager matches the reference."""
    dt = DTYPES[dtype]
    hidden, weight, b, tokens, adv, old, ref, mask = make_linear(
        B=2, T=6, H=32, V=4099, dtype=dt, device=on
    )

    def step(hidden, weight, tokens, adv, old, ref, mask):
        logits = hidden @ weight.T
        with torch.no_grad():
            pi_ref = fastrl.logprobs(logits, tokens, temperature=0.9)
        out = fastrl.policy_loss(logits, tokens, adv, old, ref, mask, config="grpo")
        out2 = fastrl.fused_linear_policy_loss(
            hidden, weight, tokens, adv, old, pi_ref, config="dapo", temperature=0.9, kl_coef=0.1
        )
        return out.loss + out2.loss, out.metrics["clipfrac"], pi_ref

    results = []
    for fn in (torch.compile(step, fullgraph=True), step):
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        loss, clipfrac, pi_ref = fn(h, w, tokens, adv, old, ref, mask)
        loss.backward()
        results.append((loss.detach(), clipfrac, pi_ref, h.grad, w.grad))
    rtol, atol = LINEAR_TOL[dt]
    for got, want in zip(*results):
        scale = want.float().abs().max().clamp(min=1.0)
        torch.testing.assert_close(got.float() / scale, want.float() / scale, rtol=rtol, atol=atol)
    # eager against the reference on the fp32 logits
    hf, wf = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    z = hf @ wf.T
    pi_ref = R.logprobs(z.detach(), tokens, temperature=0.9)
    dapo = dict(config="dapo", temperature=0.9, kl_coef=0.1)
    want = R.policy_loss(z, tokens, adv, old, ref, mask, config="grpo").loss
    want = want + R.policy_loss(z, tokens, adv, old, pi_ref, **dapo).loss
    torch.testing.assert_close(results[1][0].float(), want.detach(), rtol=rtol, atol=atol)
