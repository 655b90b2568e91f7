"""Every row of SPEC.md's tables against numbers worked out by hand.

The expectations below are literals or one-line closed forms written from SPEC.md; nothing here
calls an implementation to produce an expected value. Each test runs against the reference
(`fastrl.reference`) and, parametrized, the public `fastrl` functions, so that the fused /
vectorised rewrites are held to the same hand-computed numbers.

Trick used throughout: with all-zero logits over V = 4 classes, logp_t = -log 4 and H_t = log 4
exactly, and log p_j + H_t = 0, so SPEC 6 reduces to dloss/dz_ty = g_t (1 - 1/V) with
g_t = dloss/dlogp_t. A wanted ratio r_t is obtained by passing old_t = -log 4 - log r_t.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import ENGINES

import fastrl
from fastrl import reference
from fastrl.config import LossConfig

V = 4
LOGV = math.log(V)
IMPLS = {"reference": reference, "fastrl": fastrl}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


@pytest.fixture(params=[p for p in ENGINES if p.id.startswith("cpu-")])
def backend(request, monkeypatch):
    """FASTRL_BACKEND for `fastrl`: the chunked torch path, and the Triton kernels in the
    interpreter (the tables' inputs are CPU tensors; exact ties need the CPU's exp)."""
    monkeypatch.setenv("FASTRL_BACKEND", request.param[1])
    return request.param[1]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def close(actual, expected, rtol=1e-5, atol=1e-6):
    actual = torch.as_tensor(actual).detach().double().cpu()
    expected = torch.as_tensor(expected, dtype=torch.float64)
    torch.testing.assert_close(actual, expected.expand_as(actual), rtol=rtol, atol=atol)


def run(
    impl,
    log_r,
    A,
    mask=None,
    ref_x=None,
    roll_logw=None,
    on_policy=False,
    **cfg,
):
    """Call impl.policy_loss on all-zero logits (B, T, V) with the given per-token log-ratios.

    log_r (B, T): wanted log r_t (via old_logp); A: (B,) or (B, T); ref_x: x_t = ref_t - logp_t;
    roll_logw: log w_t = old_t - roll_t. Returns (out, g) with g = dloss/dlogp_t (B, T)."""
    log_r = torch.as_tensor(log_r, dtype=torch.float64)
    if log_r.dim() == 1:
        log_r = log_r[None]
    B, T = log_r.shape
    logits = torch.zeros(B, T, V, requires_grad=True)
    tokens = (torch.arange(B * T).reshape(B, T) * 3 + 1) % V
    logp = -LOGV
    old = None if on_policy else (logp - log_r).float()
    kwargs = {}
    if ref_x is not None:
        kwargs["ref_logp"] = (logp + torch.as_tensor(ref_x, dtype=torch.float64)).reshape(B, T)
        kwargs["ref_logp"] = kwargs["ref_logp"].float()
    if roll_logw is not None:
        old_for_roll = (logp - log_r) if old is not None else torch.full((B, T), logp)
        roll = old_for_roll - torch.as_tensor(roll_logw, dtype=torch.float64).reshape(B, T)
        kwargs["rollout_logp"] = roll.float()
    if mask is not None:
        kwargs["mask"] = torch.as_tensor(mask, dtype=torch.float32).reshape(B, T)
    A = torch.as_tensor(A, dtype=torch.float32)
    out = impl.policy_loss(logits, tokens, A, old_logp=old, **kwargs, **cfg)
    if out.loss.requires_grad:
        (grad,) = torch.autograd.grad(out.loss, logits)
    else:
        grad = torch.zeros_like(logits)
    g = grad.gather(-1, tokens[..., None]).squeeze(-1).double() / (1 - 1 / V)
    # the other V-1 entries of the row carry -g/V (SPEC 6 with uniform p): check it on the way
    others = grad.double().sum(-1) - grad.gather(-1, tokens[..., None]).squeeze(-1).double()
    close(others, -g * (V - 1) / V, atol=1e-7)
    return out, g


def rows_case(impl, rows, **cfg):
    """rows: list of (A, r, expected l_t, expected dl_t/dlogp_t); one token each, token-mean."""
    A = [row[0] for row in rows]
    log_r = [math.log(row[1]) for row in rows]
    out, g = run(impl, [log_r], [A], **cfg)
    n = len(rows)
    close(out.loss, sum(row[2] for row in rows) / n)
    close(g[0] * n, [row[3] for row in rows])
    return out


def exact_log_r(r: float) -> tuple[float, float]:
    """(log_r for `run`, r_t): the ratio of the token run() makes from log_r is r_t EXACTLY, in
    torch and in the interpreter's numpy alike. The fp32 old_t nearest -log 4 - log r is stepped
    by ulps until both exp(logp_t - old_t) agree; r_t is within a few ulps of r. For exact ties
    at a clip end (the same value on both sides of a clamp / max / min / threshold)."""
    import numpy as np

    logp = torch.tensor(-LOGV, dtype=torch.float32)
    start = (logp.double() - math.log(r)).float()
    up = down = start
    for _ in range(200):
        for old in (up, down):
            x = logp - old
            r_t = torch.exp(x)
            if float(np.exp(x.numpy())) == r_t.item():
                return -LOGV - old.item(), r_t.item()
        up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
    raise AssertionError(f"no fp32 old_t gives an exact ratio near {r}")


# --------------------------------------------------------------------------- SPEC 1: ratio
def test_ratio_token_level_and_on_policy(impl):
    out, g = run(impl, [[0.0, 0.0]], [[2.0, -3.0]], on_policy=True)
    # old = sg(logp): r = 1, l = -A r, gradient A * dlogp / N
    close(out.metrics["ratio_mean"], 1.0)
    close(out.metrics["ratio_max"], 1.0)
    close(out.metrics["approx_kl"], 0.0)
    close(out.metrics["clipfrac"], 0.0)
    close(out.loss, (-2.0 + 3.0) / 2)
    close(g, [[-2.0 / 2, 3.0 / 2]])
    close(out.logp, -LOGV)
    close(out.entropy, LOGV)


def test_ratio_clamp_at_20(impl):
    # log r = +25 is clamped to 20: r = e^20 (the A<0 unclipped branch wins), and no gradient
    out, g = run(impl, [[25.0]], [[-1.0]], policy="ppo")
    close(out.metrics["ratio_max"], math.exp(20.0), rtol=1e-5)
    close(out.loss, math.exp(20.0), rtol=1e-5)
    close(g, [[0.0]])
    # log r = -25 -> r = e^-20 (unclamped it would be e^-25)
    out, g = run(impl, [[-25.0]], [[1.0]])
    close(out.metrics["ratio_mean"], math.exp(-20.0), rtol=1e-4, atol=0)
    close(g, [[0.0]], atol=1e-12)


def test_ratio_sequence_level(impl):
    # seq 0: token log-ratios 0.1, 0.3 and a masked 5.0 -> log r = (0.1 + 0.3) / 2 = 0.2
    # seq 1: log-ratios -0.4, 0.0, 0.1 -> log r = -0.1
    log_r = [[0.1, 0.3, 5.0], [-0.4, 0.0, 0.1]]
    mask = [[1, 1, 0], [1, 1, 1]]
    cfg = dict(ratio_level="sequence", clip_low=0.9, clip_high=9.0, agg="seq-mean-token-mean")
    out, g = run(impl, log_r, [1.0, 2.0], mask=mask, **cfg)
    r0, r1 = math.exp(0.2), math.exp(-0.1)
    # l_t = -A r_i for every token; seq-mean-token-mean = (1/2)(-r0 + -2 r1)
    close(out.loss, (-r0 - 2 * r1) / 2)
    close(out.metrics["ratio_mean"], (2 * r0 + 3 * r1) / 5)
    # gradient flows through the mean: dloss/dlogp_t = (1/B) * (-A r_i) * (1/|y_i|)
    close(g, [[-r0 / 2 / 2, -r0 / 2 / 2, 0.0], [-2 * r1 / 3 / 2] * 3])
    # clamp at 20 also applies to the sequence log-ratio
    out, _ = run(impl, [[25.0, 25.0]], [1.0], ratio_level="sequence", clip_high=9.0)
    close(out.metrics["ratio_max"], math.exp(20.0))


# --------------------------------------------------------------------------- SPEC 2: policy terms
def test_ppo_rows(impl):
    rows = [  # (A, r, l = max(-A r, -A clip(r, 0.8, 1.2)), dl/dlogp)
        (1.0, 1.5, -1.2, 0.0),
        (1.0, 0.5, -0.5, -0.5),
        (1.0, 1.1, -1.1, -1.1),
        (-1.0, 1.5, 1.5, 1.5),
        (-1.0, 0.5, 0.8, 0.0),
        (-1.0, 0.9, 0.9, 0.9),
        (0.0, 1.7, 0.0, 0.0),
        (2.0, 0.7, -1.4, -1.4),
    ]
    rows_case(impl, rows, policy="ppo")


def test_ppo_clip_higher(impl):
    rows = [(1.0, 1.25, -1.25, -1.25), (1.0, 1.4, -1.28, 0.0), (-1.0, 0.75, 0.8, 0.0)]
    rows_case(impl, rows, clip_low=0.2, clip_high=0.28)


def test_ppo_clip_ends_keep_the_gradient(backend):
    """At r exactly 1 + eps_high (A > 0) or 1 - eps_low (A < 0) the two sides of the max tie and
    the clamp sits at its end: autograd's clamp passes the gradient at both ends (inclusive), so
    dl_t/dlogp_t = -A r (half through each side of the max; / 2 here for the token-mean), not
    -A r / 2. A kernel that excluded the ends halved it. The clip ends are set to the exact fp32
    ratios; nothing counts as clipped."""
    log_hi, r_hi = exact_log_r(1.2)
    log_lo, r_lo = exact_log_r(0.8)
    cfg = dict(policy="ppo", clip_high=r_hi - 1.0, clip_low=1.0 - r_lo)
    assert 1.0 + cfg["clip_high"] == r_hi and 1.0 - cfg["clip_low"] == r_lo
    for impl in (reference, fastrl):
        out, g = run(impl, [[log_hi, log_lo]], [[1.0, -1.0]], **cfg)
        assert torch.equal(out.logp, torch.full_like(out.logp, -LOGV))  # so r is r_hi / r_lo
        close(out.loss, (-r_hi + r_lo) / 2)
        close(g, [[-r_hi / 2, r_lo / 2]], rtol=1e-6, atol=1e-7)
        close(out.metrics["clipfrac"], 0.0)


def test_ppo_clip_delta(impl):
    with_delta = [  # r~ = min(r, 2)
        (-1.0, 3.0, 2.0, 0.0),
        (-1.0, 1.5, 1.5, 1.5),
        (1.0, 3.0, -1.2, 0.0),
        (-1.0, 0.5, 0.8, 0.0),
    ]
    rows_case(impl, with_delta, clip_delta=2.0)
    rows_case(impl, [(-1.0, 3.0, 3.0, 3.0)])  # same token without delta


def test_dual_clip(impl):
    rows = [  # c = 3: for A < 0, l = min(l, -A c)
        (-1.0, 5.0, 3.0, 0.0),
        (-1.0, 2.0, 2.0, 2.0),
        (1.0, 5.0, -1.2, 0.0),
        (-1.0, 0.5, 0.8, 0.0),
        (-2.0, 4.0, 6.0, 0.0),
    ]
    out = rows_case(impl, rows, clip_dual=3.0)
    close(out.metrics["dualclip_frac"], 2 / 5)


def test_dual_clip_tie_is_not_dual_clipped(backend):
    """SPEC 2: dualclip_frac is the share of tokens where the dual clip bites, -A c < l: at
    r = c exactly (A < 0) the two sides of the min are equal and the token does not count (the
    gradient is half the unclipped one there: each side of the tied min takes half)."""
    log_c, c = exact_log_r(3.0)
    rows = [(-1.0, c, c, c / 2), (-1.0, 2.0, 2.0, 2.0), (-1.0, 5.0, c, 0.0)]
    log_r = [log_c, math.log(2.0), math.log(5.0)]
    for impl in (reference, fastrl):
        out, g = run(impl, [log_r], [[row[0] for row in rows]], policy="ppo", clip_dual=c)
        assert torch.equal(out.logp, torch.full_like(out.logp, -LOGV))  # so r_0 is c exactly
        close(out.loss, sum(row[2] for row in rows) / 3)
        close(g[0] * 3, [row[3] for row in rows])
        close(out.metrics["dualclip_frac"], 1 / 3)


def test_cispo(impl):
    # preset: clip(r, 0, 5); l = -sg(clip) A logp = clip * A * log 4; dl/dlogp = -clip * A
    rows = [
        (1.0, 6.0, 5.0 * LOGV, -5.0),
        (1.0, 0.5, 0.5 * LOGV, -0.5),
        (-1.0, 2.0, -2.0 * LOGV, 2.0),
        (-1.0, 7.0, -5.0 * LOGV, 5.0),
    ]
    rows_case(impl, rows, config=LossConfig.cispo())
    # narrow clip: clip(r, 0.8, 1.2); the stop-gradient means no r * logp term in dl/dlogp
    rows = [
        (1.0, 1.5, 1.2 * LOGV, -1.2),
        (-1.0, 0.5, -0.8 * LOGV, 0.8),
        (2.0, 1.1, 2.2 * LOGV, -2.2),
    ]
    rows_case(impl, rows, policy="cispo")


@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (2.0, 0.5)])
def test_sapo(impl, tau_pos, tau_neg):
    def row(A, r):
        tau = tau_pos if A > 0 else tau_neg
        s = sigmoid(tau * (r - 1))
        # l = -s (4 / tau) A; dl/dlogp = -(4/tau) A s (1 - s) tau r
        return (A, r, -s * 4 / tau * A, -4 * A * s * (1 - s) * r)

    rows = [row(1.0, 1.5), row(1.0, 0.6), row(-1.0, 0.8), row(-2.0, 1.3), row(0.0, 1.2)]
    rows_case(impl, rows, policy="sapo", sapo_tau_pos=tau_pos, sapo_tau_neg=tau_neg)


def test_reinforce(impl):
    rows = [(1.0, 1.5, LOGV, -1.0), (-2.0, 0.3, -2.0 * LOGV, 2.0), (0.5, 9.0, 0.5 * LOGV, -0.5)]
    rows_case(impl, rows, policy="reinforce")


def test_clip_metrics(impl):
    # (A, r): high-clipped, none, low-clipped, none, none, low-clipped, masked high-clipped
    A = [1.0, 1.0, -1.0, -1.0, 1.0, -1.0, 1.0]
    r = [1.5, 0.5, 0.5, 1.5, 1.1, 0.7, 1.5]
    mask = [1, 1, 1, 1, 1, 1, 0]
    out, _ = run(impl, [[math.log(x) for x in r]], [A], mask=mask)
    close(out.metrics["clipfrac_high"], 1 / 6)
    close(out.metrics["clipfrac_low"], 2 / 6)
    close(out.metrics["clipfrac"], 3 / 6)
    close(out.metrics["dualclip_frac"], 0.0)
    # approx_kl = mean(old - logp) = mean(-log r) over counted tokens
    close(out.metrics["approx_kl"], -sum(math.log(x) for x in r[:6]) / 6)
    close(out.metrics["ratio_max"], 1.5)
    for v in out.metrics.values():
        assert not v.requires_grad
    # clip-higher moves the upper threshold: 1.5 > 1.28 still, 1.25 is not clipped at 0.28
    out, _ = run(impl, [[math.log(1.25), math.log(1.5)]], [[1.0, 1.0]], clip_high=0.28)
    close(out.metrics["clipfrac_high"], 1 / 2)


def test_clip_metrics_zero_advantage(backend):
    """A token with A = 0 counts in neither clip fraction, whatever its ratio (SPEC 2: the share
    with A > 0 and r > 1 + eps_high, with A < 0 and r < 1 - eps_low): tokens (0, 1.5) and
    (0, 0.5) next to one clipped token of each side. On the torch path and in the kernel."""
    A = [0.0, 0.0, 1.0, -1.0, 0.0]
    r = [1.5, 0.5, 1.5, 0.5, 3.0]
    for impl in (reference, fastrl):
        out, _ = run(impl, [[math.log(x) for x in r]], [A], policy="ppo")
        close(out.metrics["clipfrac_high"], 1 / 5)
        close(out.metrics["clipfrac_low"], 1 / 5)
        close(out.metrics["clipfrac"], 2 / 5)
        close(out.loss, (-1.2 + 0.8) / 5)


# --------------------------------------------------------------------------- SPEC 3: rollout IS
@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_is_token(impl, mode):
    # r = 1 (old = logp), A = 1: l = -1 and dl/dlogp = -1 before the weight
    logw = [math.log(0.5), math.log(1.5), math.log(3.0), math.log(5.0)]
    mask = [1, 1, 1, 0]
    w = [0.5, 1.5, 2.0 if mode == "truncate" else 0.0]
    out, g = run(
        impl, [[0.0] * 4], [1.0], mask=mask, roll_logw=[logw], rollout_is="token",
        rollout_is_mode=mode, rollout_is_cap=2.0,
    )  # fmt: skip
    close(out.loss, -sum(w) / 3)
    close(g, [[-w[0] / 3, -w[1] / 3, -w[2] / 3, 0.0]])
    close(out.metrics["is_weight_mean"], sum(w) / 3)
    close(out.metrics["is_weight_max"], 3.0)
    close(out.metrics["is_clipfrac"], 1 / 3)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_rollout_is_sequence(impl, mode):
    # seq 0: log w = 0.2 + 0.3 = 0.5 (w < 2); seq 1: log 3 (+ a masked log 5): w = 3 > cap 2
    logw = [[0.2, 0.3], [math.log(3.0), math.log(5.0)]]
    mask = [[1, 1], [1, 0]]
    w0, w1 = math.exp(0.5), (2.0 if mode == "truncate" else 0.0)
    out, g = run(
        impl, [[0.0, 0.0], [0.0, 0.0]], [1.0, -1.0], mask=mask, roll_logw=logw,
        rollout_is="sequence", rollout_is_mode=mode,
    )  # fmt: skip
    # l = -A (r = 1); token-mean over 3 tokens
    close(out.loss, (-2 * w0 + w1) / 3)
    close(g, [[-w0 / 3, -w0 / 3], [w1 / 3, 0.0]])  # w is detached: no gradient through it
    close(out.metrics["is_weight_mean"], (2 * w0 + w1) / 3)
    close(out.metrics["is_weight_max"], 3.0)
    close(out.metrics["is_clipfrac"], 1 / 3)


def test_rollout_is_sequence_on_policy(impl):
    """Without old_logp (old = sg(logp)) the sequence weight still sums over the counted tokens
    only: a masked token's old_t = logp_t != 0 while its rollout_logp (masked input) is zeroed,
    so a sum over every token would take log w = -log 4 more there. Seq: log w = 0.2 + 0.3."""
    w = math.exp(0.5)
    out, g = run(
        impl, [[0.0, 0.0, 0.0]], [1.0], mask=[[1, 1, 0]], roll_logw=[[0.2, 0.3, 1.0]],
        on_policy=True, rollout_is="sequence",
    )  # fmt: skip
    close(out.loss, -w)  # r = 1: l = -A w, token-mean over 2 tokens
    close(g, [[-w / 2, -w / 2, 0.0]])
    close(out.metrics["is_weight_mean"], w)
    close(out.metrics["is_weight_max"], w)


def test_rollout_is_clamp_at_20(impl):
    out, _ = run(impl, [[0.0]], [1.0], roll_logw=[[30.0]], rollout_is="token", rollout_is_cap=1e10)
    close(out.metrics["is_weight_max"], math.exp(20.0))


# --------------------------------------------------------------------------- SPEC 4: KL
X = [-30.0, -12.0, -5.0, -1.0, -0.25, 0.5, 1.0, 3.0, 30.0]


def kl_row(est: str, x: float) -> tuple[float, float]:
    """(value, d/dlogp) of the SPEC 4 table at x = ref - logp."""
    if est == "k1":
        return -x, 1.0
    if est == "abs":
        return abs(x), -math.copysign(1.0, x)
    if est == "k2":
        return x * x / 2, -x
    if est == "k3":
        return math.exp(x) - x - 1, 1 - math.exp(x)
    xc = min(max(x, -20.0), 20.0)
    v = math.exp(xc) - xc - 1
    if v > 10.0:
        return 10.0, 0.0
    return v, (1 - math.exp(xc)) if -20.0 < x < 20.0 else 0.0


@pytest.mark.parametrize("est", ["k1", "abs", "k2", "k3", "low_var_kl"])
def test_kl_estimators_per_token(est):
    xs = X
    logp = torch.tensor([-1.5] * len(xs), dtype=torch.float64, requires_grad=True)
    ref = logp.detach() + torch.tensor(xs, dtype=torch.float64)
    kl = reference.kl_penalty(logp, ref, est)
    (d,) = torch.autograd.grad(kl.sum(), logp)
    close(kl, [kl_row(est, x)[0] for x in xs], rtol=1e-9, atol=1e-9)
    close(d, [kl_row(est, x)[1] for x in xs], rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("est", ["k1", "abs", "k2", "k3", "low_var_kl"])
def test_kl_in_full_loss(impl, est):
    # A = 0 on-policy, so L_t = beta kl_t; token-mean over 5 tokens; beta = 0.5
    xs = [-12.0, -1.0, -0.25, 0.5, 3.0]
    beta = 0.5
    out, g = run(
        impl, [[0.0] * 5], [0.0], ref_x=[xs], on_policy=True, kl_coef=beta, kl_estimator=est
    )
    vals = [kl_row(est, x)[0] for x in xs]
    ders = [kl_row(est, x)[1] for x in xs]
    close(out.kl, [vals], rtol=1e-4, atol=1e-5)
    close(out.metrics["kl"], sum(vals) / 5, rtol=1e-4, atol=1e-5)
    close(out.loss, beta * sum(vals) / 5, rtol=1e-4, atol=1e-5)
    close(g, [[beta * d / 5 for d in ders]], rtol=1e-4, atol=1e-5)


def test_kl_bias_correction(impl):
    # k3 times the token ratio r_t (also under ratio_level="sequence"); A = 0 so l = 0
    xs, log_r = [-0.5, 0.4, 1.0], [0.3, -0.2, 0.1]
    for level in ("token", "sequence"):
        out, g = run(
            impl, [log_r], [0.0], ref_x=[xs], kl_coef=1.0, kl_estimator="k3",
            kl_bias_correction=True, ratio_level=level, clip_high=9.0, clip_low=0.9,
        )  # fmt: skip
        vals = [(math.exp(x) - x - 1) * math.exp(lr) for x, lr in zip(xs, log_r)]
        # d(kl r)/dlogp = kl' r + kl r
        ders = [
            ((1 - math.exp(x)) + (math.exp(x) - x - 1)) * math.exp(lr) for x, lr in zip(xs, log_r)
        ]
        close(out.kl, [vals])
        close(out.loss, sum(vals) / 3)
        close(g, [[d / 3 for d in ders]])


# --------------------------------------------------------------------------- SPEC 5: total + agg
def test_per_token_total(impl):
    # L = w l + beta kl - c_H H, H = log 4; ppo with r = 1.5 (A = -1: l = 1.5, dl/dlogp = 1.5),
    # r = 1 (A = 2: l = -2, dl = -2); rollout weights 3 -> 2 (truncate), 0.5; k1 KL: x = -0.4, 0.6
    beta, c_h = 0.1, 0.05
    out, g = run(
        impl, [[math.log(1.5), 0.0]], [[-1.0, 2.0]], ref_x=[[-0.4, 0.6]],
        roll_logw=[[math.log(3.0), math.log(0.5)]], rollout_is="token", kl_coef=beta,
        kl_estimator="k1", entropy_coef=c_h,
    )  # fmt: skip
    L = [2.0 * 1.5 + beta * 0.4 - c_h * LOGV, 0.5 * -2.0 + beta * -0.6 - c_h * LOGV]
    close(out.loss, sum(L) / 2)
    # w multiplies l only; k1's d/dlogp = 1; the entropy gradient vanishes at uniform logits
    close(g, [[(2.0 * 1.5 + beta) / 2, (0.5 * -2.0 + beta) / 2]])
    close(out.metrics["entropy"], LOGV)


# reinforce with uniform logits: L_t = -A_t logp_t = A_t log 4, dL/dlogp_t = -A_t.
AGG_A = [[1.0, 2.0, 3.0], [4.0, 5.0, 6.0], [7.0, 8.0, 9.0]]
AGG_MASK = [[1, 1, 0], [0, 0, 0], [1, 0, 0]]  # sequence 1 is empty


@pytest.mark.parametrize(
    "cfg,value,weights",
    [  # value: loss / log 4; weights: dloss/dL_t for the counted tokens (0,0), (0,1), (2,0)
        (dict(agg="token-mean"), 10 / 3, [1 / 3, 1 / 3, 1 / 3]),
        (dict(agg="token-mean", num_tokens=8.0), 10 / 8, [1 / 8] * 3),
        (dict(agg="token-mean", num_tokens=torch.tensor(8.0)), 10 / 8, [1 / 8] * 3),
        (dict(agg="seq-mean-token-mean"), (1.5 + 0 + 7) / 3, [1 / 6, 1 / 6, 1 / 3]),
        (dict(agg="seq-mean-token-mean", num_seqs=5), 8.5 / 5, [1 / 10, 1 / 10, 1 / 5]),
        (
            dict(agg="seq-mean-token-mean", num_seqs=torch.tensor(5.0)),
            8.5 / 5,
            [1 / 10, 1 / 10, 1 / 5],
        ),
        (dict(agg="seq-mean-token-sum"), 10 / 3, [1 / 3] * 3),
        (dict(agg="seq-mean-token-sum", num_seqs=2), 10 / 2, [1 / 2] * 3),
        (dict(agg="seq-mean-token-sum-norm"), 10 / 9, [1 / 9] * 3),
        (dict(agg="seq-mean-token-sum-norm", max_len=5), 10 / 15, [1 / 15] * 3),
        (dict(agg="seq-mean-token-sum-norm", max_len=5, num_seqs=4), 10 / 20, [1 / 20] * 3),
    ],
    ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(f"{k}={v[k]}" for k in v),
)
def test_aggregation(impl, cfg, value, weights):
    out, g = run(impl, [[0.0] * 3] * 3, AGG_A, mask=AGG_MASK, policy="reinforce", **cfg)
    close(out.loss, value * LOGV)
    expected = torch.zeros(3, 3, dtype=torch.float64)
    for (i, t), w in zip([(0, 0), (0, 1), (2, 0)], weights):
        expected[i, t] = -AGG_A[i][t] * w
    close(g, expected)


ALL_AGGS = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("agg", ALL_AGGS)
@pytest.mark.parametrize("extra", [{}, dict(ratio_level="sequence", rollout_is="sequence")])
def test_all_masked_batch(impl, agg, extra):
    B, T = 2, 3
    logits = torch.randn(B, T, 5, requires_grad=True)
    tokens = torch.randint(0, 5, (B, T))
    old = torch.randn(B, T) - 2
    out = impl.policy_loss(
        logits, tokens, torch.randn(B), old_logp=old, ref_logp=torch.randn(B, T) - 2,
        mask=torch.zeros(B, T), rollout_logp=old + 0.1 if extra else None, agg=agg,
        kl_coef=0.1, entropy_coef=0.01, clip_dual=3.0, **extra,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(out.loss, logits)
    assert out.loss.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))
    for name, v in out.metrics.items():
        assert torch.isfinite(v).all(), name


# --------------------------------------------------------------------------- SPEC 5: presets
PRESET_TABLE = {  # policy, clip_low, clip_high, ratio_level, kl_coef, kl_estimator, agg
    "ppo": ("ppo", 0.2, 0.2, "token", 0.0, None, "token-mean"),
    "grpo": ("ppo", 0.2, 0.2, "token", 0.04, "k3", "seq-mean-token-mean"),
    "dapo": ("ppo", 0.2, 0.28, "token", 0.0, None, "token-mean"),
    "dr_grpo": ("ppo", 0.2, 0.2, "token", 0.0, None, "seq-mean-token-sum-norm"),
    "gspo": ("ppo", 3e-4, 4e-4, "sequence", 0.0, None, "seq-mean-token-mean"),
    "cispo": ("cispo", 1.0, 4.0, "token", 0.0, None, "token-mean"),
}


@pytest.mark.parametrize("name", sorted(PRESET_TABLE))
def test_presets(name):
    policy, lo, hi, level, beta, est, agg = PRESET_TABLE[name]
    for cfg in (getattr(LossConfig, name)(), LossConfig.preset(name)):
        assert cfg.policy == policy
        assert cfg.clip_low == lo and cfg.clip_high == hi
        assert cfg.ratio_level == level
        assert cfg.kl_coef == beta
        if est is not None:
            assert cfg.kl_estimator == est
        assert cfg.agg == agg
        # the rest is off in every preset
        assert cfg.clip_dual is None and cfg.clip_delta is None
        assert cfg.entropy_coef == 0.0 and cfg.temperature == 1.0
        assert cfg.rollout_is is None and cfg.kl_bias_correction is False


def test_preset_by_name_in_loss(impl):
    # grpo by name: seq-mean-token-mean with k3 at beta = 0.04; on-policy, A = 0
    out, _ = run(impl, [[0.0, 0.0]], [0.0], ref_x=[[1.0, 1.0]], on_policy=True, config="grpo")
    close(out.loss, 0.04 * (math.e - 2), rtol=1e-4)


# --------------------------------------------------------------------------- SPEC 7: advantages
def test_group_grpo_scales(impl):
    R = torch.tensor([1.0, 2.0, 3.0, 4.0])
    s = math.sqrt(0.5)  # unbiased std of {1, 2} and of {3, 4}
    adv = impl.group_advantages(R, group_size=2)
    close(adv, [-0.5 / (s + 1e-6), 0.5 / (s + 1e-6)] * 2)
    close(impl.group_advantages(R, group_size=2, scale="none"), [-0.5, 0.5, -0.5, 0.5])
    sb = math.sqrt(5 / 3)  # unbiased std of the batch {1, 2, 3, 4}
    eb = 1e-6
    close(
        impl.group_advantages(R, group_size=2, scale="batch"),
        [-0.5 / (sb + eb), 0.5 / (sb + eb)] * 2,
    )
    # group ids instead of contiguous groups
    ids = torch.tensor([0, 1, 0, 1])
    R2 = torch.tensor([1.0, 3.0, 2.0, 4.0])
    close(impl.group_advantages(R2, group_ids=ids, scale="none"), [-0.5, -0.5, 0.5, 0.5])


def test_group_three(impl):
    R = torch.tensor([0.0, 1.0, 5.0])  # mu = 2, unbiased sigma = sqrt(7)
    close(impl.group_advantages(R, group_size=3), [x / (math.sqrt(7) + 1e-6) for x in (-2, -1, 3)])
    # RLOO: R_i - mean of the others = 3/2 (R_i - mu): -3, -1.5, 4.5
    close(impl.group_advantages(R, group_size=3, estimator="rloo", scale="none"), [-3, -1.5, 4.5])


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++"])
@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_group_degenerate(impl, estimator, scale):
    # all-equal group -> 0; a group of one (by id) -> 0; never NaN
    R = torch.tensor([2.0, 2.0, 2.0, 1.0, 3.0])
    ids = torch.tensor([0, 0, 0, 1, 2])
    scale = None if estimator == "reinforce++" else scale  # reinforce++ whitens over the batch
    adv = impl.group_advantages(R, group_ids=ids, scale=scale, estimator=estimator)
    close(adv, [0.0] * 5)
    adv = impl.group_advantages(
        torch.full((4,), 7.0), group_size=2, scale=scale, estimator=estimator
    )
    close(adv, [0.0] * 4)


def test_rloo_default_is_spec_leave_one_out(impl):
    # SPEC 7: A_i = R_i - mean_{j != i} R_j, no division by sigma unless asked for
    R = torch.tensor([0.0, 1.0, 5.0, 5.0, 6.0, 10.0])
    close(impl.group_advantages(R, group_size=3, estimator="rloo"), [-3, -1.5, 4.5, -3, -1.5, 4.5])


def test_reinforce_pp_without_mask_whitens_over_responses(impl):
    R = torch.tensor([1.0, 3.0, 2.0, 2.0])  # R - mu_g = -1, 1, 0, 0: mean 0, unbiased var 2/3
    sd = math.sqrt(2 / 3 + 1e-8)
    close(impl.group_advantages(R, group_size=2, estimator="reinforce++"), [-1 / sd, 1 / sd, 0, 0])


def test_reinforce_pp(impl):
    R = torch.tensor([1.0, 3.0, 2.0, 2.0])  # R - mu_g = -1, 1, 0, 0
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.float32)
    adv = impl.group_advantages(R, group_size=2, estimator="reinforce++", mask=mask)
    # counted values -1, -1, 1, 0, 0: mean -0.2, unbiased var 2.8 / 4 = 0.7
    sd = math.sqrt(0.7 + 1e-8)
    expected = [[-0.8 / sd, -0.8 / sd], [1.2 / sd, 0.0], [0.2 / sd, 0.2 / sd], [0.0, 0.0]]
    close(adv[mask > 0], torch.tensor(expected, dtype=torch.float64)[mask > 0])


def test_gae_hand_worked(impl):
    # gamma 0.9, lambda 0.8; token 1 is a tool token (m = 0): its reward and value are skipped
    r = torch.tensor([[0.0, 0.5, 0.0, 1.0]])
    v = torch.tensor([[0.5, 9.0, 0.4, 0.2]])
    m = torch.tensor([[1.0, 0.0, 1.0, 1.0]])
    # t=3: delta = 1 - 0.2 = 0.8, A = 0.8; t=2: delta = 0.9*0.2 - 0.4 = -0.22,
    # A = -0.22 + 0.72*0.8 = 0.356; t=1 skipped: A = 0.356; t=0: delta = 0.9*0.4 - 0.5 = -0.14,
    # A = -0.14 + 0.72*0.356 = 0.11632
    raw = [0.11632, 0.356, 0.356, 0.8]
    adv, ret = impl.gae(r, v, m, 0.9, 0.8)
    close(ret, [[0.11632 + 0.5, 0.356 + 9.0, 0.356 + 0.4, 0.8 + 0.2]])
    counted = [raw[0], raw[2], raw[3]]
    mean = sum(counted) / 3
    var = sum((a - mean) ** 2 for a in counted) / 2
    close(adv[m > 0], [(a - mean) / math.sqrt(var + 1e-8) for a in counted])
    # gamma = lambda = 1 with a full mask: A_t = sum of future rewards - V_t
    adv, ret = impl.gae(torch.tensor([[0.0, 0.0, 2.0]]), torch.tensor([[1.0, 0.5, 0.0]]),
                        torch.ones(1, 3))  # fmt: skip
    close(ret, [[2.0, 2.0, 2.0]])


def test_whiten(impl):
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    close(impl.whiten(x), [(a - 2.5) / math.sqrt(5 / 3 + 1e-8) for a in (1, 2, 3, 4)])
    m = torch.tensor([1.0, 1.0, 0.0, 1.0])  # counted 1, 2, 4: mean 7/3, var (16+1+25)/9/2
    mean, var = 7 / 3, (16 + 1 + 25) / 9 / 2
    w = impl.whiten(x, m)
    close(w[m > 0], [(a - mean) / math.sqrt(var + 1e-8) for a in (1, 2, 4)])


# --------------------------------------------------------------------------- SPEC 8: value loss
def test_value_loss(impl):
    # (v, v_old, G): clipped wins; equal (no clip); clipped wins; unclipped wins
    v = torch.tensor([[1.0, 0.6, 2.0, 2.0]], requires_grad=True)
    v_old = torch.tensor([[0.5, 0.5, 1.0, 1.0]])
    G = torch.tensor([[1.5, 0.0, 3.0, 1.0]])
    maxes = [0.64, 0.36, 3.24, 1.0]
    loss, clipfrac = impl.value_loss(v, v_old, G, clip=0.2)
    close(loss, 0.5 * sum(maxes) / 4)
    close(clipfrac, 2 / 4)
    (grad,) = torch.autograd.grad(loss, v)
    # d/dv of 1/2 (v-G)^2 / N where unclipped wins; 0 where the clipped (constant) term wins
    close(grad, [[0.0, 0.6 / 4, 0.0, 1.0 / 4]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    loss, clipfrac = impl.value_loss(v, v_old, G, mask=mask, clip=0.2)
    close(loss, 0.5 * (0.64 + 0.36 + 3.24) / 3)
    close(clipfrac, 2 / 3)
    loss, clipfrac = impl.value_loss(v, v_old, G, clip=None)
    close(loss, 0.5 * (0.25 + 0.36 + 1.0 + 1.0) / 4)
    close(clipfrac, 0.0)


# --------------------------------------------------------------------------- SPEC 9: DAPO
def test_overlong_penalty(impl):
    lengths = torch.tensor([3, 6, 7, 9, 10, 11])  # L_max = 10, L_cache = 4, L_exp = 6
    close(impl.overlong_penalty(lengths, 10, 4), [0, 0, -1 / 4, -3 / 4, -1, -1])
    close(impl.overlong_penalty(lengths, 10, 4, 0.5), [0, 0, -1 / 8, -3 / 8, -0.5, -0.5])


def test_dynamic_sampling_filter(impl):
    R = torch.tensor([1.0, 1.0, 0.0, 1.0, 2.0, 2.0, 0.0, 3.0])
    kept = impl.dynamic_sampling_filter(R, 2)
    assert kept.tolist() == [1, 3]
    assert impl.dynamic_sampling_filter(torch.ones(4), 2).tolist() == []


def _weights_by_autograd(x):
    """c_t = d aggregate / d L_t by autograd of terms.aggregate (how aggregation_weights formed
    them before its closed form)."""
    from fastrl import terms

    if x.packing is not None:
        return x.packing.unpad(_weights_by_autograd(x.packing.padded_inputs(x)))
    zeros = torch.zeros_like(x.mask, requires_grad=True)
    cfg = x.config
    loss = terms.aggregate(zeros, x.mask, cfg.agg, x.num_tokens, x.num_seqs, cfg.max_len)
    return torch.autograd.grad(loss, zeros)[0]


@pytest.mark.parametrize("agg", [*ALL_AGGS, "token-sum"])
@pytest.mark.parametrize("shape", [(0, 4), (1, 1), (3, 5), (7, 13)], ids=str)
@pytest.mark.parametrize("mask", ["fractional", "bool", "empty"])
@pytest.mark.parametrize("counts", ["local", "numbers", "tensors", "nan", "inf-and-zero"])
def test_aggregation_weights_are_autograds_bitwise(agg, shape, mask, counts):
    """terms.aggregation_weights' closed form gives autograd of terms.aggregate bit for bit
    (NaN where autograd's is NaN): every aggregation, empty batches and masks, fractional
    masks, global counts as numbers, tensors, and tensors that are not finite numbers > 0."""
    from fastrl import terms
    from fastrl._inputs import prepare_policy_inputs

    g = torch.Generator().manual_seed(sum(shape))
    B, T = shape
    m = torch.rand(B, T, generator=g) * 3 * (torch.rand(B, T, generator=g) > 0.3)
    m = {"fractional": m, "bool": m > 0, "empty": torch.zeros(B, T)}[mask]
    overrides = {
        "local": {},
        "numbers": dict(num_tokens=7.0, num_seqs=3.0, max_len=11),
        "tensors": dict(num_tokens=torch.tensor(7.3), num_seqs=torch.tensor(2.9)),
        "nan": dict(num_tokens=torch.tensor(float("nan")), num_seqs=torch.tensor(float("nan"))),
        "inf-and-zero": dict(num_tokens=torch.tensor(float("inf")), num_seqs=torch.tensor(0.0)),
    }[counts]
    x = prepare_policy_inputs(
        None, torch.zeros(B, T, dtype=torch.long), torch.randn(B, T, generator=g), None, None, m,
        None, "ppo", dict(agg=agg, **overrides), per_token=torch.zeros(B, T),
    )  # fmt: skip
    got, want = terms.aggregation_weights(x), _weights_by_autograd(x)
    assert got.shape == want.shape == (B, T) and got.dtype == want.dtype == torch.float32
    assert torch.equal(got.isnan(), want.isnan())
    assert torch.equal(got.nan_to_num(), want.nan_to_num())


def test_aggregation_weights_of_packed_sequences():
    """Packed rows (cu_seqlens): the weights of the padded sequences, brought back to (1, N)."""
    from fastrl import terms
    from fastrl._inputs import prepare_policy_inputs

    m = (torch.arange(20) % 3 != 0).float()
    cu = torch.tensor([0, 4, 13, 20])
    for agg in ALL_AGGS:
        x = prepare_policy_inputs(
            None, torch.zeros(20, dtype=torch.long), torch.randn(3), None, None, m, None, "ppo",
            dict(agg=agg, max_len=9), per_token=torch.zeros(20), cu_seqlens=cu,
        )  # fmt: skip
        got, want = terms.aggregation_weights(x), _weights_by_autograd(x)
        assert got.shape == (1, 20) and torch.equal(got, want), agg
