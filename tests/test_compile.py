"""torch.compile(fullgraph=True) through the fused ops (CPU, Inductor): same loss and gradient.

The fused ops are torch.library custom ops (fastrl::token_logprobs and friends) with fake
implementations and registered autograd, so Dynamo traces policy_loss without a graph break;
the config's numbers are a float[] argument of the ops (new values every call trace once more,
then run as graph inputs), fp32 in every kernel.
"""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import ops
from fastrl import reference as R


def _batch(B=3, T=5, V=23, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T + 1, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp, _ = R.token_logprobs(logits[:, :-1], tokens)
    return dict(
        logits=logits,
        tokens=tokens,
        advantages=torch.randn(B, generator=g),
        old_logp=logp + 0.3 * torch.randn(B, T, generator=g),
        ref_logp=logp + 0.3 * torch.randn(B, T, generator=g),
        mask=torch.rand(B, T, generator=g) > 0.2,
    )


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_compiled_policy_loss_matches_eager(monkeypatch):
    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    cfg = fastrl.LossConfig.grpo(entropy_coef=0.01, temperature=0.9, clip_dual=3.0)
    batch = _batch()

    def step(logits, tokens, advantages, old_logp, ref_logp, mask, num_tokens):
        out = fastrl.policy_loss(
            logits[:, :-1], tokens, advantages, old_logp, ref_logp, mask, config=cfg
        )
        out2 = fastrl.policy_loss(
            logits[:, :-1],
            tokens,
            advantages,
            old_logp,
            ref_logp,
            mask,
            config="dapo",
            num_tokens=num_tokens,
        )
        return out.loss + out2.loss, out.metrics, out.logp

    compiled = torch.compile(step, fullgraph=True)
    num_tokens = torch.tensor(11.0)
    results = []
    for fn in (compiled, step):
        x = batch["logits"].clone().requires_grad_()
        rest = {k: v for k, v in batch.items() if k != "logits"}
        loss, metrics, logp = fn(x, **rest, num_tokens=num_tokens)
        loss.backward()
        results.append((loss.detach(), metrics, logp, x.grad))
    (lc, mc, pc, gc), (le, me, pe, ge) = results
    torch.testing.assert_close(lc, le, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(pc, pe, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-7)
    assert set(mc) == set(me)
    for k in me:
        torch.testing.assert_close(mc[k], me[k], rtol=1e-5, atol=1e-6)
    # and eager matches the reference (so the compiled path is right, not just self-consistent)
    x = batch["logits"].clone().requires_grad_()
    rest = {k: v for k, v in batch.items() if k != "logits"}
    ref = R.policy_loss(x[:, :-1], **rest, config=cfg)
    ref2 = R.policy_loss(x[:, :-1], **rest, config="dapo", num_tokens=num_tokens)
    (ref.loss + ref2.loss).backward()
    torch.testing.assert_close(le, (ref.loss + ref2.loss).detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ge, x.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "config, overrides",
    [("dapo", {}), ("grpo", {"kl_coef": 0.0}), (None, {"clip_high": 0.3, "clip_low": 0.1}),
     ("gspo", {"clip_high": 0.05}), ("cispo", {})],
)  # fmt: skip
def test_compiled_gradient_uses_the_config_resolved_in_the_graph(config, overrides):
    """A preset name or keyword overrides are resolved inside the compiled region: the fused
    gradient must use that config, not LossConfig's defaults (it once got clip_high 0.2 for
    "dapo": a wrong gradient wherever a ratio lay in (1.2, 1.28] with A > 0)."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 4, 6, 11
    logits = torch.randn(B, T, V, generator=g) * 2
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp, _ = R.token_logprobs(logits, tokens)
    # log-ratios spread over [-0.4, 0.4]: every clip range above has tokens on both sides
    old = logp - torch.linspace(-0.4, 0.4, B * T).view(B, T)
    adv = torch.tensor([1.0, -1.0, 0.5, -2.0])

    def loss_fn(z):
        return fastrl.policy_loss(z, tokens, adv, old, config=config, **overrides).loss

    grads = []
    for fn in (loss_fn, torch.compile(loss_fn, fullgraph=True)):
        z = logits.clone().requires_grad_()
        fn(z).backward()
        grads.append(z.grad)
    z = logits.clone().requires_grad_()
    R.policy_loss(z, tokens, adv, old, config=config, **overrides).loss.backward()
    torch.testing.assert_close(grads[0], z.grad, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grads[1], z.grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", ["inductor", "aot_eager"])
def test_compiled_step_takes_new_numbers_every_call(monkeypatch, backend):
    """A compiled step called with other numbers each time (an adaptive kl_coef, a new
    temperature, an int num_tokens, a LossConfig rebuilt every step): torch.compile makes them
    symbolic after the first call, and formatting one into the op's config string failed
    ("BUILD_STRING type error"); they now travel as the op's float[] argument. Loss and
    gradients equal eager's at every call, on both the logits and the LM-head paths."""
    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    b = _batch()
    g = torch.Generator().manual_seed(1)
    H = 6
    hidden = torch.randn(3, 5, H, generator=g)
    weight = torch.randn(23, H, generator=g) / H**0.5
    rest = (b["tokens"], b["advantages"], b["old_logp"], b["ref_logp"], b["mask"])

    def step(logits, hidden, weight, beta, tau, n):
        cfg = fastrl.LossConfig.grpo(kl_coef=beta)  # rebuilt every step
        a = fastrl.policy_loss(logits[:, :-1], *rest, config=cfg, temperature=tau, num_tokens=n)
        c = fastrl.fused_linear_policy_loss(
            hidden,
            weight,
            *rest,
            config=cfg,
            max_len=n,
            temperature=tau,
            agg="seq-mean-token-sum-norm",
        )
        return a.loss + c.loss  # fmt: skip

    compiled = torch.compile(step, fullgraph=True, backend=backend)
    for beta, tau, n in [(0.04, 1.0, 11), (0.1, 0.7, 13), (0.5, 1.3, 17)]:
        results = []
        for fn in (step, compiled):
            leaves = [t.clone().requires_grad_() for t in (b["logits"], hidden, weight)]
            loss = fn(*leaves, beta, tau, n)
            results.append((loss, *torch.autograd.grad(loss, leaves)))
        for got, want in zip(results[1], results[0]):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_config_key_round_trips_every_value():
    cfg = fastrl.LossConfig.gspo(clip_dual=3.0, num_tokens=7.0, max_len=5, rollout_is="token",
                                 rollout_is_cap=1e30, temperature=0.7)  # fmt: skip
    assert ops.config_from_key(*ops.config_key(cfg)) == cfg


def test_compiled_logprobs_no_grad(monkeypatch):
    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    logits = torch.randn(2, 4, 31)
    tokens = torch.randint(0, 31, (2, 4))

    @torch.compile(fullgraph=True)
    def old_logprobs(logits, tokens):
        with torch.no_grad():
            return fastrl.logprobs(logits / 1.0, tokens, temperature=0.8, entropy=True)

    logp, ent = old_logprobs(logits, tokens)
    rlogp, rent = R.logprobs(logits, tokens, temperature=0.8, entropy=True)
    torch.testing.assert_close(logp, rlogp, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(ent, rent, rtol=1e-5, atol=1e-6)

    @torch.compile(fullgraph=True)
    def masked_logprobs(logits, tokens, mask):  # the mask: its rows skipped, 0 there
        return fastrl.logprobs(logits, tokens, mask=mask)

    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 1]], dtype=torch.bool)
    x = logits.clone().requires_grad_()
    logp = masked_logprobs(x, tokens, mask)
    want = torch.where(mask, R.logprobs(logits, tokens), 0.0)
    torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-6)
    logp.sum().backward()
    ref = logits.clone().requires_grad_()
    (R.logprobs(ref, tokens) * mask).sum().backward()
    torch.testing.assert_close(x.grad, ref.grad, rtol=1e-5, atol=1e-6)


def test_custom_ops_registered_with_fake_impls():
    """opcheck: schema, fake (meta) implementation and autograd registration are consistent."""
    logits = torch.randn(2, 3, 11, requires_grad=True)
    tokens = torch.randint(0, 11, (2, 3))
    torch.library.opcheck(
        torch.ops.fastrl.token_logprobs.default,
        (logits, tokens, 0.7, False),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    skip = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 1.0]])  # with the mask and no entropy
    torch.library.opcheck(
        torch.ops.fastrl.token_logprobs.default,
        (logits, tokens, 0.7, False, None, skip, False),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"),
    )
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fake = torch.empty(4, 5, 100, dtype=torch.bfloat16)
        logp, ent, m, log_s = torch.ops.fastrl.token_logprobs(
            fake, torch.zeros(4, 5, dtype=torch.long), 1.0, False
        )
        assert logp.shape == (4, 5) and logp.dtype == torch.float32


_NEW_BACKWARD = """
import sys, torch, fastrl
from fastrl import _linear_ops, ops
torch.set_num_threads(1)
if sys.argv[1] == "new":  # another fastrl: its backward doubles the gradient, its source differs
    ops.SOURCE_KEY = "another-version"
    for op, setup, backward in ((ops._token_logprobs_op, ops._setup_context, ops._backward),
                                (_linear_ops.linear_token_stats, _linear_ops._setup_context,
                                 _linear_ops._backward)):
        def doubled(ctx, *grads, backward=backward):
            first, *rest = backward(ctx, *grads)
            return (2 * first, *rest)
        op.register_autograd(doubled, setup_context=setup)
g = torch.Generator().manual_seed(0)
x = torch.randn(2, 3, 8, generator=g, requires_grad=True)
w = torch.eye(8)
y = torch.randint(0, 8, (2, 3), generator=g)
for f in (lambda x: fastrl.logprobs(x, y).sum(), lambda x: fastrl.linear_logprobs(x, w, y).sum()):
    torch.compile(f, fullgraph=True)(x).backward()
    compiled, x.grad = x.grad, None
    f(x).backward()
    print((compiled / x.grad).nanmean().item())
    x.grad = None
"""


def test_a_warm_compile_cache_never_hands_back_another_versions_backward(tmp_path):
    """torch.compile's AOTAutograd cache keys a compiled forward + backward on the traced forward
    graph only, where fastrl::token_logprobs / fastrl::linear_token_stats are one call each: a
    fastrl whose backward changed got the old one back from a warm cache (an upgrade with
    /tmp/torchinductor_$USER kept). The ops take a hash of fastrl's source (ops.SOURCE_KEY) as an
    argument: here a second process with another backward and another key, on the first one's
    cache directory, computes its own gradient (compiled / eager = 1, not 0.5)."""
    import os
    import subprocess
    import sys

    script = tmp_path / "run.py"
    script.write_text(_NEW_BACKWARD)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache")}
    for version in ("old", "new"):
        proc = subprocess.run([sys.executable, str(script), version], env=env, timeout=300,
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        ratios = [float(line) for line in proc.stdout.split()]
        assert ratios == [1.0, 1.0], (version, ratios)
    assert len(ops.SOURCE_KEY) == 16 and ops.SOURCE_KEY != "another-version"


def test_the_lm_head_ops_compile_where_dynamo_cannot_trace_is_autocast_available(monkeypatch):
    """torch 2.11's dynamo cannot trace torch.amp.is_autocast_available (a C builtin it skips:
    a graph break, an error under fullgraph=True; found on an H200). The LM-head ops ask it
    only outside torch.compile; here it is made untraceable, as there, on this torch."""
    monkeypatch.setattr(torch.amp, "is_autocast_available",
                        torch._dynamo.disable(torch.amp.is_autocast_available))  # fmt: skip
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 5, 16, generator=g)
    weight = torch.randn(37, 16, generator=g) * 0.3
    tokens = torch.randint(0, 37, (2, 5), generator=g)
    adv, old = torch.randn(2, generator=g), torch.randn(2, 5, generator=g) - 3.6

    def step(h, w):
        out = fastrl.fused_linear_policy_loss(h, w, tokens, adv, old, config="dapo")
        return out.loss + fastrl.linear_logprobs(h, w, tokens).sum()

    grads = []
    for fn in (torch.compile(step, fullgraph=True), step):
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(h, w)
        loss.backward()
        grads.append((loss.detach(), h.grad, w.grad))
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_fullgraph_with_dynamic_shapes():
    """torch.compile(fullgraph=True, dynamic=True) through every differentiable entry point,
    loss and gradients as eager, on two shapes. The temperature checks formed their message
    with a format spec on every call, which dynamo cannot trace (an error under fullgraph)."""
    b = _batch()
    hidden = torch.randn(3, 5, 8)
    weight = torch.randn(23, 8) * 0.5

    def step(x, h, w, tokens, adv, old):
        out = fastrl.policy_loss(x, tokens, adv, old, config="dapo")
        lp, ent = fastrl.logprobs(x, tokens, temperature=0.9, entropy=True)
        lin = fastrl.fused_linear_policy_loss(h, w, tokens, adv, old, config="grpo", kl_coef=0.0)
        ref = fastrl.policy_loss_from_logprobs(lp, ent, adv, old, config="grpo", kl_coef=0.0)
        return out.loss + lin.loss + ref.loss + fastrl.linear_logprobs(h, w, tokens).sum()

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (5, 3):
        _check_dynamic_shapes(b, compiled, step, hidden, weight, T)


def test_fullgraph_with_dynamic_shapes_per_token_temperature_and_packed_rows():
    """The same with a per-token temperature tensor and packed rows (cu_seqlens, with
    max_seqlen: without it the longest sequence is read from cu_seqlens, a data-dependent size
    fullgraph cannot trace): the messages of their shape checks were concatenated from strings
    holding symbolic sizes on every call (dynamo: "missing sq_concat"); they are formed on an
    error only."""
    b = _batch()
    tau = 0.5 + torch.rand(3, 6, generator=torch.Generator().manual_seed(1))

    def step(x, h, w, tokens, adv, old):
        T = tokens.shape[1]
        out = fastrl.policy_loss(x, tokens, adv, old, config="dapo", temperature=tau[:, :T])
        lp = fastrl.logprobs(x, tokens, temperature=tau[:, :T])
        flat = fastrl.policy_loss(x.reshape(-1, x.shape[-1]), tokens.reshape(-1), adv,
                                  config="dapo", cu_seqlens=cu(T), max_seqlen=T)  # fmt: skip
        return out.loss + flat.loss + lp.sum()

    def cu(T):
        return torch.arange(0, 3 * T + 1, T, dtype=torch.int64)

    compiled = torch.compile(step, fullgraph=True, dynamic=True, backend="aot_eager")
    for T in (5, 3):
        _check_dynamic_shapes(b, compiled, step, None, None, T)


def _check_dynamic_shapes(b, compiled, step, hidden, weight, T):
    """Loss and gradients of `compiled` equal `step`'s on the batch cut to T tokens."""
    hidden = torch.randn(3, 5, 8) if hidden is None else hidden
    weight = torch.randn(23, 8) * 0.5 if weight is None else weight
    results = []
    for fn in (compiled, step):
        x = b["logits"][:, :T].clone().requires_grad_()
        h, w = hidden[:, :T].clone().requires_grad_(), weight.clone().requires_grad_()
        loss = fn(x, h, w, b["tokens"][:, :T], b["advantages"], b["old_logp"][:, :T])
        loss.backward()
        results.append([loss.detach()] + [t.grad for t in (x, h, w) if t.grad is not None])
    for got, want in zip(*results, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_verls_compiled_entropy_with_fastrl_installed():
    """verl's engines wrap `entropy_from_logits` (or its chunking variant) in
    torch.compile(dynamic=True) by default (`use_torch_compile`). With fastrl's verl drop-in
    installed first, that compiles fastrl's op with symbolic shapes: the compiled entropy and
    log-probs equal verl's own functions over changing row counts (verl's remove-padding rows
    are 2-D, its padded batches 3-D), gradients too."""
    pytest.importorskip("verl")
    import verl.utils.torch_functional as verl_F

    import fastrl.integrations.verl as fastrl_verl

    theirs = {n: getattr(verl_F, n) for n in ("entropy_from_logits", "logprobs_from_logits",
                                              "entropy_from_logits_with_chunking")}  # fmt: skip
    fastrl_verl.install(losses=False)
    try:
        for name in ("entropy_from_logits", "entropy_from_logits_with_chunking"):
            assert getattr(verl_F, name) is not theirs[name]  # routed to fastrl
            ours = torch.compile(getattr(verl_F, name), dynamic=True)
            for shape in ((5, 37), (9, 37), (2, 3, 37), (4, 3, 37)):
                if name.endswith("chunking") and len(shape) == 3:
                    continue  # (verl calls it on rows only)
                x = (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape)))
                     * 3).requires_grad_()  # fmt: skip
                x_ref = x.detach().clone().requires_grad_()
                w = torch.rand(shape[:-1])
                got, want = ours(x), theirs[name](x_ref)
                torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
                (got * w).sum().backward()
                (want * w).sum().backward()
                torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
        ours = torch.compile(verl_F.logprobs_from_logits, dynamic=True)
        for n in (5, 11):
            x = torch.randn(n, 37, requires_grad=True)
            y = torch.randint(0, 37, (n,))
            x_ref = x.detach().clone().requires_grad_()
            got, want = ours(x, y), theirs["logprobs_from_logits"](x_ref, y)
            torch.testing.assert_close(got, want.float(), rtol=1e-5, atol=1e-5)
            got.sum().backward()
            want.sum().backward()
            torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-6)
    finally:
        fastrl_verl.uninstall()
    assert verl_F.entropy_from_logits is theirs["entropy_from_logits"]
