"""The vocab-parallel LM head (`group=` / a DTensor weight) against the unsharded op, over 2 and 3
gloo processes on the CPU: logp, entropy, d hidden, d weight (the rank's rows) and d bias, the
fused policy loss (loss, logp, entropy, kl, metrics, gradients), uneven and empty shards, a
DTensor weight, and bad inputs raised on every rank (no rank left waiting in a collective).

One start per world size runs every case, from a forkserver that has imported torch and fastrl
once (a spawned process would import them again: seconds each on the CPU)."""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import os
import re
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import fastrl

TOL = dict(rtol=1e-5, atol=1e-5)
V, H = 37, 8
SHARDS = {2: [[30, 7]], 3: [[20, 5, 12], [12, 0, 25]]}  # uneven; one rank with no rows


def _batch(B=3, T=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T + 1, H, generator=g)[:, 1:]  # a strided view, as trainers slice
    weight = torch.randn(V, H, generator=g) / H**0.5
    bias = 0.1 * torch.randn(V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    tokens[0, :3] = torch.tensor([0, V - 1, 20])  # the first / last ids, a shard boundary
    mask = torch.rand(B, T, generator=g) > 0.25
    adv = torch.randn(B, generator=g)
    old, ref, up_lp, up_h = (0.3 * torch.randn(B, T, generator=g) for _ in range(4))
    tau = 0.4 + 1.5 * torch.rand(B, T, generator=g)  # a per-token temperature
    with torch.no_grad():
        logp = fastrl.linear_logprobs(hidden, weight, tokens, bias=bias)
    return dict(hidden=hidden, weight=weight, bias=bias, tokens=tokens, mask=mask, adv=adv,
                old=logp + old, ref=logp + ref, up_lp=up_lp, up_h=up_h, tau=tau)  # fmt: skip


def _leaves(b, rows=slice(None)):
    """Fresh leaves: hidden, and weight / bias (rows `rows` of them)."""
    return [t.detach().clone().requires_grad_() for t in (b["hidden"], b["weight"][rows],
                                                         b["bias"][rows])]  # fmt: skip


def _close(got, want):
    torch.testing.assert_close(got, want, **TOL)


def _logprobs_loss(leaves, b, **kw):
    hidden, weight, bias = leaves
    logp, ent = fastrl.linear_logprobs(hidden, weight, b["tokens"], bias=bias, entropy=True,
                                       mask=b["mask"], **kw)  # fmt: skip
    return logp, ent, (logp * b["up_lp"]).sum() + (ent * b["up_h"]).sum()


def _check_logprobs(b, rows, group, **kw):
    """linear_logprobs on this rank's rows against the unsharded op: values and gradients."""
    full = _leaves(b)
    logp, ent, loss = _logprobs_loss(full, b, chunk_size=4, **kw)
    expected = torch.autograd.grad(loss, full)
    mine = _leaves(b, rows)
    logp_s, ent_s, loss_s = _logprobs_loss(mine, b, chunk_size=3, group=group, **kw)
    _close(logp_s, logp)
    _close(ent_s, ent)
    got = torch.autograd.grad(loss_s, mine)
    _close(got[0], expected[0])
    _close(got[1], expected[1][rows])
    _close(got[2], expected[2][rows])


def _policy(leaves, b, **kw):
    hidden, weight, bias = leaves
    return fastrl.fused_linear_policy_loss(hidden, weight, b["tokens"], b["adv"], b["old"],
                                           b["ref"], b["mask"], bias=bias, **kw)  # fmt: skip


def _check_policy(b, rows, group, **kw):
    full = _leaves(b)
    out = _policy(full, b, chunk_size=4, **kw)
    expected = torch.autograd.grad(2.0 * out.loss, full)
    mine = _leaves(b, rows)
    out_s = _policy(mine, b, chunk_size=2, group=group, **kw)
    _close(out_s.loss, out.loss)
    for name in ("logp", "entropy", "kl"):
        _close(getattr(out_s, name), getattr(out, name))
    assert out_s.metrics.keys() == out.metrics.keys()
    for k in out.metrics:
        _close(out_s.metrics[k], out.metrics[k])
    got = torch.autograd.grad(2.0 * out_s.loss, mine)
    _close(got[0], expected[0])
    _close(got[1], expected[1][rows])
    _close(got[2], expected[2][rows])
    with torch.no_grad():
        _close(_policy(mine, b, group=group, **kw).loss, out.loss)


def _check_dtensor(b, world):
    from torch.distributed.tensor import DeviceMesh, Replicate, Shard, distribute_tensor

    mesh = DeviceMesh("cpu", list(range(world)))
    weight = distribute_tensor(b["weight"], mesh, [Shard(0)]).requires_grad_()
    bias = distribute_tensor(b["bias"], mesh, [Shard(0)]).requires_grad_()
    full = _leaves(b)
    out = _policy(full, b, config="grpo", entropy_coef=0.01)
    out.loss.backward()
    hidden = b["hidden"].detach().clone().requires_grad_()
    out_s = _policy([hidden, weight, bias], b, config="grpo", entropy_coef=0.01)  # no group=
    out_s.loss.backward()
    _close(out_s.loss, out.loss)
    _close(hidden.grad, full[0].grad)
    _close(weight.grad.full_tensor(), full[1].grad)
    _close(bias.grad.full_tensor(), full[2].grad)
    logp = fastrl.linear_logprobs(b["hidden"], weight.detach(), b["tokens"], bias=bias.detach())
    _close(logp, fastrl.linear_logprobs(b["hidden"], b["weight"], b["tokens"], bias=b["bias"]))
    replicated = distribute_tensor(b["weight"], mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"weight is a DTensor with placements \(Replicate"):
        fastrl.linear_logprobs(b["hidden"], replicated, b["tokens"])
    # a replicated DTensor of the hidden states: a clear error (was torch's "mixed torch.Tensor
    # and DTensor" from deep inside), on every rank
    hidden_dt = distribute_tensor(b["hidden"].contiguous(), mesh, [Replicate()])
    with pytest.raises(ValueError, match="hidden is a DTensor"):
        fastrl.linear_logprobs(hidden_dt, weight.detach(), b["tokens"], bias=bias.detach())
    with pytest.raises(ValueError, match="hidden is a DTensor"):
        fastrl.fused_linear_policy_loss(hidden_dt, weight.detach(), b["tokens"], b["adv"])


def _check_nearly_one_hot(rows, group):
    """Rows with p_y = 1 - 1e-4 at |lse| ~ 53 (identity weight: the logits are `hidden`), the
    token in the first shard: the sharded op is as exact as the unsharded one (errors against
    float64 within 2.5x of its; fp32's own limit here is log s = log(1 + 1e-4) to eps). The merge
    takes logp and H from differences of the shards' lse, logp_own - log sum_r exp(lse_r -
    lse_own): lse - lse_own as a difference of two rounded lse carried eps |lse| ~ 3e-6 into a
    logp of -1e-4 (7x the unsharded error), and from it into the gradient's target entry, the
    cancellation g (1 - p_y) (SPEC 6), and into H."""
    B, T, Vh = 2, 4, 37
    g = torch.Generator().manual_seed(1)
    z = torch.randn(B, T, Vh, generator=g)
    y = torch.randint(0, 12, (B, T), generator=g)  # held by rank 0 in every split of SHARDS
    z.scatter_(2, y[..., None], 13.0)
    z = z + 40.0
    up_lp, up_h = torch.randn(2, B, T, generator=g)
    x64 = z.double().requires_grad_()
    logq = torch.log_softmax(x64, -1)
    want = logq.gather(-1, y[..., None])[..., 0], -(logq.exp() * logq).sum(-1)
    (want[0] * up_lp + want[1] * up_h).sum().backward()
    one_minus_p = -torch.expm1(want[0].detach())
    assert 5e-5 < one_minus_p.min() and one_minus_p.max() < 1e-3  # the rows are as meant

    def errors(weight, **kw):  # |logp|, |H| and target-entry errors against float64
        x = z.clone().requires_grad_()
        logp, ent = fastrl.linear_logprobs(x, weight, y, chunk_size=3, entropy=True, **kw)
        (logp * up_lp + ent * up_h).sum().backward()
        at_y = lambda t: t.gather(-1, y[..., None])[..., 0].double()  # noqa: E731
        pairs = (logp, want[0]), (ent, want[1]), (at_y(x.grad), at_y(x64.grad))
        return [(got.double() - exp.detach()).abs().max() for got, exp in pairs]

    for name, mine, unsharded in zip(("logp", "entropy", "dz at y"),
                                     errors(torch.eye(Vh)[rows], group=group),
                                     errors(torch.eye(Vh))):  # fmt: skip
        assert mine <= 2.5 * unsharded + 1e-9, (
            f"{name}: off by {mine:.2e}, unsharded {unsharded:.2e}"
        )


def _check_large_offset(rows, group):
    """Logits at an offset of 1e4 (identity weight: the logits are `hidden`): d hidden as close
    to float64's as eager fp32 (relative to each row's largest entry), for linear_logprobs and
    the fused loss (per-chunk merge: grpo; all rows first: gspo). Each shard forms p_j from its
    own max, exp((z'_j - m_r) - (lse - m_r)), with lse - m_r from the gathered (m_r, log s_r);
    from exp(z'_j - lse) the merged lse's rounding at its own scale put 8e-4 of the row's scale
    into every p_j (against eager fp32's 3e-7)."""
    B, T, Vh = 2, 4, 37
    g = torch.Generator().manual_seed(3)
    z = torch.randn(B, T, Vh, generator=g) * 3 + 1e4
    y = torch.randint(0, Vh, (B, T), generator=g)
    adv = torch.randn(B, T, generator=g)
    up_lp, up_h = torch.randn(2, B, T, generator=g)

    def d_hidden(x, f):
        x = x.clone().requires_grad_()
        f(x).backward()
        return x.grad.double()

    def eager(x):
        logq = torch.log_softmax(x, -1)
        logp, ent = logq.gather(-1, y[..., None])[..., 0], -(logq.exp() * logq).sum(-1)
        return (logp * up_lp.to(x.dtype) + ent * up_h.to(x.dtype)).sum()

    def sharded(x):
        logp, ent = fastrl.linear_logprobs(x, torch.eye(Vh)[rows], y, entropy=True, chunk_size=3,
                                           group=group)  # fmt: skip
        return (logp * up_lp + ent * up_h).sum()

    want = d_hidden(z.double(), eager)
    scale = want.abs().amax(-1, keepdim=True)
    bound = 2 * ((d_hidden(z, eager) - want).abs() / scale).max() + 1e-6
    err = ((d_hidden(z, sharded) - want).abs() / scale).max()
    assert err <= bound, f"linear_logprobs: d hidden off by {err:.2e} of its row's scale"
    for config in ("grpo", "gspo"):

        def loss(x, config=config, **kw):
            eye = torch.eye(Vh)
            w = eye[rows] if kw else eye
            return fastrl.fused_linear_policy_loss(x, w, y, adv, config=config, chunk_size=3,
                                                   kl_coef=0.0, entropy_coef=0.01,
                                                   **kw).loss  # fmt: skip

        one = d_hidden(z, loss)
        err = ((d_hidden(z, lambda x: loss(x, group=group)) - one).abs()
               / one.abs().amax(-1, keepdim=True)).max()  # fmt: skip
        assert err <= 1e-6, f"{config}: d hidden off the unsharded op's by {err:.2e}"


def _check_fp16_policy(b, rows, group):
    """fp16 with a loss scale: the vocab-parallel fused loss, like the single-device one, leaves
    its gradient to the backward, where the scale is known. Formed in the forward, dz's entries
    (~1e-8 with a global token count of 1e6) were flushed to fp16's subnormals or 0 before the
    scale reached them: the unscaled gradients against fp32's were off by their whole size."""

    def grads(leaves, scale, **kw):
        out = fastrl.fused_linear_policy_loss(leaves[0], leaves[1], b["tokens"], b["adv"],
                                              b["old"], b["ref"], b["mask"], bias=leaves[2],
                                              config="dapo", num_tokens=1e6, **kw)  # fmt: skip
        return out.loss, [g.float() / scale for g in torch.autograd.grad(scale * out.loss, leaves)]

    def leaves(dtype, r=slice(None)):
        tensors = (b["hidden"], b["weight"][r], b["bias"][r])
        return [t.to(dtype).clone().requires_grad_() for t in tensors]

    loss, want = grads(leaves(torch.float32), 1.0)  # unsharded fp32: the truth
    loss_s, got = grads(leaves(torch.float16, rows), 65536.0, group=group)
    torch.testing.assert_close(loss_s.float(), loss, rtol=1e-3, atol=1e-6)
    for name, g_s, g_true in zip(("d hidden", "d weight", "d bias"), got,
                                 (want[0], want[1][rows], want[2][rows])):  # fmt: skip
        if g_true.numel():  # (a rank with no rows has no dW)
            err = (g_s - g_true).norm() / g_true.norm()
            assert err < 2e-2, f"{name}: off by {err:.2e} of its size (fp16: ~1e-3)"


@contextlib.contextmanager
def _triton_engine():
    """FASTRL_BACKEND=triton for the block: the Triton kernels (the interpreter on the CPU,
    TRITON_INTERPRET=1 from tests/conftest.py, inherited by the workers). A row where a shard has
    no mass (every logit -inf) kept the kernels' m = -inf, and the shard's backward formed
    (z' - m) - (lse - m) = (-inf + inf) - inf = NaN: every rank's d hidden NaN."""
    before = os.environ.get("FASTRL_BACKEND")
    os.environ["FASTRL_BACKEND"] = "triton"
    try:
        yield
    finally:
        if before is None:
            del os.environ["FASTRL_BACKEND"]
        else:
            os.environ["FASTRL_BACKEND"] = before


def _plan_ints_in_the_docs() -> set[int]:
    """The plan all-gather's size as the module docstring and docs/DESIGN.md state it."""
    from fastrl import vocab_parallel as vp

    design = (Path(__file__).resolve().parents[1] / "docs" / "DESIGN.md").read_text()
    found = re.findall(r"all-gather of (\d+) int64", " ".join((vp.__doc__ + design).split()))
    assert len(found) >= 2, found
    return {int(n) for n in found}


def _check_plan_size(b, rows, group):
    """The plan's one all-gather is as many int64 as the docs say (they said 8; it is 10)."""
    seen, real = [], dist.all_gather
    dist.all_gather = lambda out, t, **kw: seen.append((t.dtype, t.numel())) or real(out, t, **kw)
    try:
        fastrl.linear_logprobs(b["hidden"], b["weight"][rows], b["tokens"], group=group)
    finally:
        dist.all_gather = real
    assert seen[0][0] == torch.int64
    assert _plan_ints_in_the_docs() == {seen[0][1]}


def _check_nan_row(b, rows, group):
    """A counted row with a NaN hidden state (every logit NaN): logp and entropy NaN as on one
    device, the loss NaN; the merge made its entropy 0.0 (NaN > 0 is False), and the entropy
    metric finite."""
    hidden = b["hidden"].clone()
    hidden[1, 2] = float("nan")
    mask = b["mask"].clone()
    mask[1, 2] = True
    w, bias = b["weight"][rows], b["bias"][rows]
    logp, ent = fastrl.linear_logprobs(hidden, w, b["tokens"], bias=bias, entropy=True,
                                       mask=mask, group=group)  # fmt: skip
    want_lp, want_h = fastrl.linear_logprobs(hidden, b["weight"], b["tokens"], bias=b["bias"],
                                             entropy=True, mask=mask)  # fmt: skip
    assert torch.isnan(want_h[1, 2]) and torch.isnan(ent[1, 2]) and torch.isnan(logp[1, 2])
    torch.testing.assert_close(ent, want_h, equal_nan=True, **TOL)
    torch.testing.assert_close(logp, want_lp, equal_nan=True, **TOL)
    out = fastrl.fused_linear_policy_loss(hidden, w, b["tokens"], b["adv"], mask=mask, bias=bias,
                                          config="dapo", group=group)  # fmt: skip
    assert torch.isnan(out.entropy[1, 2]) and torch.isnan(out.metrics["entropy"])
    assert torch.isnan(out.loss)


def _check_masked_shard(b, rows, group, masked):
    """Every column of one shard masked by a -inf bias (a vocabulary a rank holds that no token
    may take, e.g. padding ids): that shard adds no mass, as on one device. The torch path gave
    such a row's statistics lse = -inf + log 0 = NaN, and the merge made every row NaN."""
    b = dict(b, bias=b["bias"].clone(), tokens=b["tokens"] % 12)  # tokens outside `masked`
    b["bias"][masked] = float("-inf")
    _check_logprobs(b, rows, group)
    _check_policy(b, rows, group, config="dapo", entropy_coef=0.01)
    _check_policy(b, rows, group, config="gspo")


def _check_token_in_a_masked_shard(b, rows, group, masked):
    """Counted tokens in a shard whose every column a -inf bias masks (its owner has no mass):
    logp = -inf, H and the gradients finite, as on one device (the merge's -inf - -inf made
    logp, H and every rank's dX NaN)."""
    b = dict(b, bias=b["bias"].clone(), tokens=b["tokens"].clone())
    b["bias"][masked] = float("-inf")
    b["tokens"][1, :2] = torch.tensor([masked.start, masked.stop - 1])
    b["mask"] = b["mask"].clone()
    b["mask"][1, :2] = True
    full, mine = _leaves(b), _leaves(b, rows)
    want_lp, want_h = fastrl.linear_logprobs(full[0], full[1], b["tokens"], bias=full[2],
                                             entropy=True, mask=b["mask"])  # fmt: skip
    logp, ent = fastrl.linear_logprobs(mine[0], mine[1], b["tokens"], bias=mine[2], entropy=True,
                                       mask=b["mask"], group=group)  # fmt: skip
    assert torch.equal(want_lp[1, :2], torch.full((2,), float("-inf")))
    assert torch.isfinite(want_h).all()
    _close(logp, want_lp)
    _close(ent, want_h)
    # the gradients of H and of the finite log-probs (the -inf ones too: d logp / dz is finite)
    up = torch.where(torch.isfinite(want_lp), b["up_lp"], 1.0)
    want = torch.autograd.grad((want_lp * up).sum() + (want_h * b["up_h"]).sum(), full)
    got = torch.autograd.grad((logp * up).sum() + (ent * b["up_h"]).sum(), mine)
    assert torch.isfinite(got[0]).all()
    _close(got[0], want[0])
    _close(got[1], want[1][rows])
    _close(got[2], want[2][rows])
    out = fastrl.fused_linear_policy_loss(mine[0], mine[1], b["tokens"], b["adv"], mask=b["mask"],
                                          bias=mine[2], config="dapo", group=group)  # fmt: skip
    want_out = fastrl.fused_linear_policy_loss(
        full[0], full[1], b["tokens"], b["adv"], mask=b["mask"], bias=full[2], config="dapo"
    )
    _close(out.entropy, want_out.entropy)
    _close(out.metrics["entropy"], want_out.metrics["entropy"])
    assert torch.isfinite(out.metrics["entropy"])


def _check_calls_that_differ_across_ranks(b, rows, group, rank):
    """Calls whose collectives would differ between ranks are refused on every rank, not left
    to hang in a collective (or abort on a size mismatch): a gradient wanted on one rank only
    (the fused loss then takes other collectives; linear_logprobs' backward would wait alone),
    hidden in another dtype or width."""
    w, bias = b["weight"][rows], b["bias"][rows]
    hidden = b["hidden"].detach().clone().requires_grad_(rank == 0)
    wanted = r"whether a gradient is wanted differs across ranks \(\[True, False"
    with pytest.raises(ValueError, match=wanted):
        fastrl.fused_linear_policy_loss(hidden, w, b["tokens"], b["adv"], bias=bias, group=group)
    with pytest.raises(ValueError, match=wanted):
        fastrl.linear_logprobs(hidden, w, b["tokens"], bias=bias, group=group)
    dtype = torch.bfloat16 if rank == 1 else torch.float32
    with pytest.raises(ValueError, match=r"hidden's dtype differs across ranks \(\[torch.float32, "
                       r"torch.bfloat16"):  # fmt: skip
        fastrl.linear_logprobs(b["hidden"].to(dtype), w.to(dtype), b["tokens"],
                               bias=bias.to(dtype), group=group)  # fmt: skip
    # with no gradient anywhere (torch.no_grad on every rank) the call is fine
    with torch.no_grad():
        out = fastrl.fused_linear_policy_loss(hidden, w, b["tokens"], b["adv"], bias=bias,
                                              group=group)  # fmt: skip
    assert torch.isfinite(out.loss)


def _check_bad_inputs(b, rows, group, rank):
    w, bias = b["weight"][rows], b["bias"][rows]
    too_big = b["tokens"].clone()
    too_big[1, 1] = V  # in range of no shard: checked against the whole vocabulary
    with pytest.raises(ValueError, match=rf"tokens must lie in \[0, V\) = \[0, {V}\)"):
        fastrl.linear_logprobs(b["hidden"], w, too_big, bias=bias, group=group)
    # one rank's bias does not fit its shard: that rank says why, every rank raises
    bad_bias = bias[:-1] if rank == 1 else bias
    match = r"bias must be a \(\d+,\) tensor" if rank == 1 else r"rank\(s\) \[1\] .* rejected"
    with pytest.raises(ValueError, match=match):
        fastrl.fused_linear_policy_loss(b["hidden"], w, b["tokens"], b["adv"], bias=bad_bias,
                                        group=group)  # fmt: skip
    # inputs that are not replicated
    tokens = b["tokens"].clone()
    tokens[0, 0] = rank
    with pytest.raises(ValueError, match="differs across ranks"):
        fastrl.linear_logprobs(b["hidden"], w, tokens, bias=bias, group=group)
    # a temperature that is not the same on every rank: a float, and one entry of a per-token one
    with pytest.raises(ValueError, match="temperature differs across ranks"):
        fastrl.linear_logprobs(b["hidden"], w, b["tokens"], bias=bias, temperature=1.0 + rank,
                               group=group)  # fmt: skip
    tau = b["tau"].clone()
    tau[2, 3] += 0.25 * rank
    with pytest.raises(ValueError, match="temperature differs across ranks"):
        fastrl.fused_linear_policy_loss(b["hidden"], w, b["tokens"], b["adv"], bias=bias,
                                        temperature=tau, group=group)  # fmt: skip
    # the same per-token temperatures in another order on one rank (the same sum, exact in
    # fp64): the fingerprint's second word, sum_i (i + 1) tau_i, tells them apart
    tau = torch.ones_like(b["tau"])
    tau[0, 0], tau[0, 1] = (2.0, 0.5) if rank == 1 else (0.5, 2.0)
    with pytest.raises(ValueError, match="temperature differs across ranks"):
        fastrl.linear_logprobs(b["hidden"], w, b["tokens"], bias=bias, temperature=tau,
                               group=group)  # fmt: skip
    # a mask that is not replicated (one more counted row on rank 1): refused on every rank
    # before the merge's all-gather of (counted rows, 3), whose sizes would then differ
    mask = b["mask"].clone().reshape(-1)
    mask[(~mask).nonzero()[0]] = rank == 1  # its first masked token counts on rank 1 only
    mask = mask.view_as(b["mask"])
    with pytest.raises(ValueError, match="the counted rows differs across ranks"):
        fastrl.linear_logprobs(b["hidden"], w, b["tokens"], bias=bias, mask=mask, group=group)
    # an audit helper's finds: the same number of counted rows at other positions, a logit
    # scale or softcap of its own merged different numbers silently; another loss config
    # (GSPO's one all-gather against DAPO's one per chunk) aborted in a mismatched collective
    mask = b["mask"].clone().reshape(-1)
    first_on, first_off = mask.nonzero()[0], (~mask).nonzero()[0]
    if rank == 1:  # one counted row moved
        mask[first_on], mask[first_off] = False, True
    with pytest.raises(ValueError, match=r"the counted rows \(mask != 0\) differ across ranks"):
        fastrl.linear_logprobs(b["hidden"], w, b["tokens"], bias=bias,
                               mask=mask.view_as(b["mask"]), group=group)  # fmt: skip
    for name, value in (("logit_scale", 1.0 + rank), ("softcap", 10.0 + rank)):
        with pytest.raises(ValueError, match=f"{name} differs across ranks"):
            fastrl.linear_logprobs(b["hidden"], w, b["tokens"], bias=bias, group=group,
                                   **{name: value})  # fmt: skip
    with pytest.raises(ValueError, match="the loss config differs across ranks"):
        fastrl.fused_linear_policy_loss(b["hidden"], w, b["tokens"], b["adv"], bias=bias,
                                        config="gspo" if rank else "dapo", group=group)  # fmt: skip
    with pytest.raises(ValueError, match="the loss config differs across ranks"):
        fastrl.fused_linear_policy_loss(b["hidden"], w, b["tokens"], b["adv"], bias=bias,
                                        clip_high=0.2 + 0.1 * rank, group=group)  # fmt: skip


def _check_no_mask_reads_no_rows(b, rows, group):
    """No mask: the fused loss takes every row without looking for the counted ones
    (torch.nonzero, a host sync on a GPU), as the unsharded op does; with one it finds them."""
    from fastrl import vocab_parallel as vp

    seen, real = [], vp._active_rows
    vp._active_rows = lambda m, *a: seen.append(m) or real(m, *a)
    try:
        mine = _leaves(b, rows)
        out = fastrl.fused_linear_policy_loss(mine[0], mine[1], b["tokens"], b["adv"],
                                              bias=mine[2], group=group)  # fmt: skip
        full = _leaves(b)
        want = fastrl.fused_linear_policy_loss(full[0], full[1], b["tokens"], b["adv"],
                                               bias=full[2])  # fmt: skip
        _close(out.loss, want.loss)
        got, expected = torch.autograd.grad(out.loss, mine), torch.autograd.grad(want.loss, full)
        _close(got[0], expected[0])
        _close(got[1], expected[1][rows])
        _close(got[2], expected[2][rows])
        assert seen == [None]
        _policy(_leaves(b, rows), b, group=group)
        assert seen[-1] is not None
    finally:
        vp._active_rows = real


def _worker(rank, world, store):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store, world), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=60))  # fmt: skip
    try:
        group = dist.new_group(list(range(world)))
        b = _batch()
        for sizes in SHARDS[world]:
            start = sum(sizes[:rank])
            rows = slice(start, start + sizes[rank])
            _check_logprobs(b, rows, group)
            _check_logprobs(b, rows, group, temperature=0.7, logit_scale=1.5, softcap=2.0)
            _check_policy(b, rows, group, config="grpo", entropy_coef=0.01)  # per-chunk merge
            _check_policy(b, rows, group, config="gspo", entropy_coef=0.01)  # sequence level
            _check_policy(b, rows, group, config="dapo", temperature=0.8, softcap=3.0)
            # a per-token temperature (each chunk's rows of it, on every rank)
            _check_logprobs(b, rows, group, temperature=b["tau"], softcap=2.0)
            _check_policy(b, rows, group, config="grpo", entropy_coef=0.01, temperature=b["tau"])
            _check_policy(b, rows, group, config="gspo", temperature=b["tau"][:, 0])
            _check_nearly_one_hot(rows, group)
            _check_large_offset(rows, group)
            _check_fp16_policy(b, rows, group)
            _check_nan_row(b, rows, group)
            _check_masked_shard(b, rows, group, slice(V - sizes[-1], V))
            _check_token_in_a_masked_shard(b, rows, group, slice(V - sizes[-1], V))
            with _triton_engine():  # the Triton kernels leave a massless row's max at -inf
                _check_masked_shard(b, rows, group, slice(V - sizes[-1], V))
                _check_token_in_a_masked_shard(b, rows, group, slice(V - sizes[-1], V))
            _check_plan_size(b, rows, group)
        _check_no_mask_reads_no_rows(b, rows, group)
        _check_dtensor(b, world)
        start = sum(SHARDS[world][0][:rank])
        _check_bad_inputs(b, slice(start, start + SHARDS[world][0][rank]), group, rank)
        _check_calls_that_differ_across_ranks(b, slice(start, start + SHARDS[world][0][rank]),
                                              group, rank)  # fmt: skip
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_vocab_parallel_matches_unsharded(world, tmp_path):
    preload = ["torch", "torch.distributed.tensor", "fastrl", _worker.__module__]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    mp.start_processes(_worker, args=(world, str(tmp_path / "store")), nprocs=world,
                       start_method="forkserver")  # fmt: skip
