"""Property tests (hypothesis) for `whiten`, `group_advantages` and `gae` (issue 10).

Over inputs with large offsets, magnitudes from 1e-20 to 1e30 (fp32) or 1e-200 to 1e200 (fp64)
and NaN / inf / huge values at masked entries, none of them may return a finite value that
differs from an exact reference by more than the tolerance of the dtypes involved, and a
reference value that is finite (and fits fp32) must come back finite: what the mask excludes
never reaches the result.

The reference is exact: Python `Fraction`s for every sum, mean and product (the inputs are read
back from the tensors, so it sees the same rounded values), `Decimal` (60 digits) only for the
square root. The tolerance of each entry is 1e-5 relative (the fp32 output) plus the error that
the computation's own dtype allows for the entry's conditioning, e.g. n·eps64·max|x| / sqrt(var)
for a float64 whitening: a result that is zero where it should be ±0.7, 1e4·x where it should be
0, or NaN-free but shifted by a masked value, is far outside it.
"""

from __future__ import annotations

import math
from decimal import Decimal, localcontext
from fractions import Fraction

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fastrl

EPS64 = 2.0**-52
EPS32 = 2.0**-23
WHITEN_EPS = Fraction(1e-8)  # SPEC 7, as the float the library adds
GROUP_EPS = Fraction(1e-6)  # SPEC 7, the default eps of group_advantages
MASKED_BAD = [math.nan, math.inf, -math.inf]

SETTINGS = dict(
    max_examples=50,
    deadline=None,
    derandomize=True,  # a fixed set of examples: no flakiness across runs
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


# --------------------------------------------------------------------------- exact reference
def _sqrt(x: Fraction) -> Fraction:
    with localcontext() as ctx:
        ctx.prec = 60
        root = (Decimal(x.numerator) / Decimal(x.denominator)).sqrt()
    return Fraction(root)


def _to_float(x: Fraction) -> float:
    try:
        return float(x)
    except OverflowError:
        return math.inf if x > 0 else -math.inf


def exact_whiten(x: list, w: list) -> tuple[list[Fraction | None], Fraction]:
    """SPEC 7 whitening of x (floats or Fractions) over weights w (> 0 counts), exactly.
    Returns (out, D): out an exact Fraction per entry (None where x is not finite), D =
    sqrt(var + eps). Nothing counted: zeros (D = 1)."""
    counted = [(Fraction(xi), Fraction(wi)) for xi, wi in zip(x, w) if wi > 0]
    count = sum(wi for _, wi in counted)
    if count == 0:
        return [Fraction(0)] * len(x), Fraction(1)
    mean = sum(wi * xi for xi, wi in counted) / count
    ss = sum(wi * (xi - mean) ** 2 for xi, wi in counted)
    var = ss / (count - 1) if count > 1 else ss / count
    d = _sqrt(var + WHITEN_EPS)
    finite = [isinstance(xi, Fraction) or math.isfinite(xi) for xi in x]
    return [(Fraction(xi) - mean) / d if ok else None for xi, ok in zip(x, finite)], d


def exact_group_advantages(r, ids, estimator, scale, mask=None):
    """SPEC 7 group advantages, exactly. Returns (out (B,) or (B, T) of Fractions, den (B,) or
    (B, T): the divisor of each entry, for the tolerance)."""
    B = len(r)
    groups: dict[int, list[int]] = {}
    for i, g in enumerate(ids):
        groups.setdefault(g, []).append(i)
    rf = [Fraction(x) for x in r]
    centered = [Fraction(0)] * B
    sigma = [Fraction(0)] * B
    for members in groups.values():
        n = len(members)
        vals = [rf[i] for i in members]
        if n < 2 or len(set(vals)) == 1:  # groups of one, all-equal groups: exactly 0
            continue
        mu = sum(vals) / n
        sd = _sqrt(sum((v - mu) ** 2 for v in vals) / (n - 1))
        for i in members:
            centered[i] = (rf[i] - mu) * (Fraction(n, n - 1) if estimator == "rloo" else 1)
            sigma[i] = sd
    if estimator == "reinforce++":  # whitened over the responses, or over mask's tokens
        if mask is None:
            out, d = exact_whiten(centered, [1] * B)
            return out, [d] * B
        T = len(mask[0])
        out, d = exact_whiten([centered[b] for b in range(B) for _ in range(T)], _flatten(mask))
        return [out[b * T : (b + 1) * T] for b in range(B)], [[d] * T for _ in range(B)]
    if scale == "none":
        return centered, [Fraction(1)] * B
    if scale == "group":
        den = [s + GROUP_EPS for s in sigma]
    else:
        mu = sum(rf) / B
        sd = _sqrt(sum((x - mu) ** 2 for x in rf) / (B - 1)) if B > 1 else Fraction(0)
        den = [sd + GROUP_EPS] * B
    return [c / d for c, d in zip(centered, den)], den


def exact_gae(r, v, m, gamma, lam):
    """SPEC 7 GAE, exactly, one step at a time; a token with m = 0 is skipped (never read)."""
    g, c = Fraction(gamma), Fraction(gamma) * Fraction(lam)
    adv = []
    for rb, vb, mb in zip(r, v, m):
        next_v = last = Fraction(0)
        row = [Fraction(0)] * len(rb)
        for t in range(len(rb) - 1, -1, -1):
            if mb[t]:
                vt = Fraction(vb[t])
                last = Fraction(rb[t]) + g * next_v - vt + c * last
                next_v = vt
            row[t] = last
        adv.append(row)
    return adv


def check_close(out: torch.Tensor, expected, tol, what: str) -> None:
    """Every finite entry of `out` is within tol of the exact value; every exact value that is
    finite and fits fp32 comes back finite. expected / tol: nested lists (None = not finite)."""
    got = out.double().flatten().tolist()
    exp = _flatten(expected)
    tols = _flatten(tol)
    assert len(got) == len(exp) == len(tols)
    for i, (o, e, t) in enumerate(zip(got, exp, tols)):
        e_f = None if e is None else _to_float(e)
        finite_ref = e_f is not None and math.isfinite(e_f)
        if math.isfinite(o):
            assert finite_ref, f"{what}[{i}] = {o} is finite, the exact value is {e_f}"
            assert abs(o - e_f) <= t, f"{what}[{i}] = {o}, exact {e_f}, tolerance {t}"
        elif finite_ref:
            assert abs(e_f) > 1e37, f"{what}[{i}] = {o}, the exact value is finite: {e_f}"


def _flatten(x):
    if isinstance(x, (list, tuple)):
        return [y for item in x for y in _flatten(item)]
    return [x]


# --------------------------------------------------------------------------- inputs
def _magnitude(lo: int, hi: int):
    exponent = st.integers(lo, hi) | st.sampled_from([lo, hi, hi - 1])  # the extremes often
    return exponent.map(lambda k: 10.0**k)


@st.composite
def values(draw, n: int, dtype: torch.dtype, lo: int = -20, hi: int = 30) -> torch.Tensor:
    """n values offset + scale·u: scales 10^lo .. 10^hi, offsets up to 1e9 times the scale (the
    values collapse to a few distinct floats, or to one) and |offset| <= 10^hi, u small integers
    or floats in [-1, 1]."""
    scale = draw(_magnitude(lo, hi))
    offset = draw(st.sampled_from([0.0, 0.0, 1.0, -1.0, 1e3, -1e6, 1e9])) * scale
    offset = max(-(10.0**hi), min(10.0**hi, offset))  # finite in fp32 for hi = 30
    unit = st.integers(-3, 3).map(float) | st.floats(-1, 1, allow_nan=False, width=32)
    u = draw(st.lists(unit, min_size=n, max_size=n))
    return torch.tensor([offset + scale * x for x in u], dtype=torch.float64).to(dtype)


@st.composite
def masks(draw, shape, weights=(0.0, 1.0)) -> torch.Tensor:
    n = math.prod(shape)
    return torch.tensor(draw(st.lists(st.sampled_from(weights), min_size=n, max_size=n))).view(
        shape
    )


def poison(draw, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x with NaN / inf / a huge finite value at some masked entries."""
    huge = torch.finfo(x.dtype).max / 2
    bad = st.sampled_from([*MASKED_BAD, huge, None])
    out = x.clone()
    flat, m = out.view(-1), mask.reshape(-1)
    for i in range(flat.numel()):
        if m[i] == 0:
            b = draw(bad)
            if b is not None:
                flat[i] = b
    return out


# --------------------------------------------------------------------------- whiten
@settings(**SETTINGS)
@given(data=st.data())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_whiten_never_finite_and_wrong(dtype, data):
    n = data.draw(st.integers(1, 12), label="n")
    hi = 200 if dtype == torch.float64 else 30
    lo = -200 if dtype == torch.float64 else -20
    x = data.draw(values(n, dtype, lo, hi), label="x")
    mask = data.draw(masks((n,), (0.0, 1.0, 1.0, 0.5, 2.0)), label="mask")
    x = poison(data.draw, x, mask)
    shift_mean = data.draw(st.booleans(), label="shift_mean")
    out = fastrl.whiten(x, mask, shift_mean=shift_mean)
    assert out.dtype == torch.float32 and out.shape == x.shape

    xs, ws = x.double().tolist(), mask.tolist()
    expected, d = exact_whiten(xs, ws)
    if not shift_mean and any(w > 0 for w in ws):
        counted = [(Fraction(a), Fraction(w)) for a, w in zip(xs, ws) if w > 0]
        mean = sum(w * a for a, w in counted) / sum(w for _, w in counted)
        expected = [None if e is None else e + mean for e in expected]
    scale = max((abs(a) for a, w in zip(xs, ws) if w > 0), default=0.0)
    cond = 16 * n * EPS64 * scale / float(d)  # float64 statistics of the counted entries
    tol = [1e-5 * abs(_to_float(e)) + 1e-6 + cond if e is not None else 0.0 for e in expected]
    check_close(out, expected, tol, "whiten")


# --------------------------------------------------------------------------- group advantages
ESTIMATORS = [
    ("grpo", "group"),
    ("grpo", "batch"),
    ("grpo", "none"),
    ("rloo", "none"),
    ("rloo", "group"),
    ("reinforce++", None),
]


@settings(**{**SETTINGS, "max_examples": 40})
@given(data=st.data())
@pytest.mark.parametrize("estimator,scale", ESTIMATORS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_group_advantages_never_finite_and_wrong(estimator, scale, dtype, data):
    B = data.draw(st.integers(1, 10), label="B")
    lo, hi = (-200, 200) if dtype == torch.float64 else (-20, 30)
    r = data.draw(values(B, dtype, lo, hi), label="rewards")
    ids = data.draw(st.lists(st.integers(0, 3), min_size=B, max_size=B), label="group_ids")
    mask = None
    if estimator == "reinforce++" and data.draw(st.booleans(), label="token mask"):
        mask = data.draw(masks((B, data.draw(st.integers(1, 4), label="T"))), label="mask")
    out = fastrl.group_advantages(
        r, group_ids=torch.tensor(ids), scale=scale, estimator=estimator, mask=mask
    )
    assert out.dtype == torch.float32

    rs = r.double().tolist()
    expected, den = exact_group_advantages(
        rs, ids, estimator, scale, None if mask is None else mask.tolist()
    )
    # float64 arithmetic on the rewards: error ~ B·eps64·max|R| before the division by den (σ +
    # eps, or the whitening's sqrt(var + eps) for reinforce++, or 1)
    big = max(abs(x) for x in rs)
    tol = [
        1e-5 * abs(_to_float(e)) + 1e-6 + 64 * B * EPS64 * big / float(d)
        for e, d in zip(_flatten(expected), _flatten(den))
    ]
    check_close(out, expected, tol, f"group_advantages[{estimator}, {scale}]")


# --------------------------------------------------------------------------- gae
GAMMA_LAM = [(1.0, 1.0), (0.99, 0.95), (0.9, 0.5), (0.5, 0.1), (1.0, 0.0), (0.0, 1.0)]


@settings(**{**SETTINGS, "max_examples": 40})
@given(data=st.data())
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
def test_gae_never_finite_and_wrong(engine, data):
    device, _ = engine
    B = data.draw(st.integers(1, 3), label="B")
    T = data.draw(st.integers(1, 8), label="T")
    gamma, lam = data.draw(st.sampled_from(GAMMA_LAM), label="gamma, lam")
    r = data.draw(values(B * T, torch.float32), label="rewards").view(B, T)
    v = data.draw(values(B * T, torch.float32), label="values").view(B, T)
    mask = data.draw(masks((B, T)), label="mask").bool()
    r, v = poison(data.draw, r, mask), poison(data.draw, v, mask)
    whiten = data.draw(st.booleans(), label="whiten")
    adv, ret = fastrl.gae(r.to(device), v.to(device), mask.to(device), gamma, lam, whiten=whiten)

    rs, vs, ms = r.double().tolist(), v.double().tolist(), mask.tolist()
    raw = exact_gae(rs, vs, ms, gamma, lam)
    counted = [(rs[b][t], vs[b][t]) for b in range(B) for t in range(T) if ms[b][t]]
    big = max((abs(a) + 2 * abs(c) for a, c in counted), default=0.0)
    big_adv = max(abs(float(a)) for a in _flatten(raw))
    # fp32 δ and (on the Triton path) an fp32 scan: error ~ T·eps32·(max|r| + 2 max|V| + max|A|)
    err_a = 4 * (T + 1) * EPS32 * (big + big_adv)
    ret_expected = [
        [raw[b][t] + Fraction(vs[b][t]) if math.isfinite(vs[b][t]) else None for t in range(T)]
        for b in range(B)
    ]
    ret_tol = [
        [1e-5 * abs(_to_float(e)) + 1e-6 + err_a if e is not None else 0.0 for e in row]
        for row in ret_expected
    ]
    check_close(ret, ret_expected, ret_tol, "gae returns")
    if not whiten:
        tol = [[1e-5 * abs(float(a)) + 1e-6 + err_a for a in row] for row in raw]
        check_close(adv, raw, tol, "gae advantages")
        return
    flat = [float(a) for a in _flatten(raw)]
    expected, d = exact_whiten(flat, [float(m) for m in _flatten(ms)])
    cond = (err_a + 16 * B * T * EPS64 * big_adv) / float(d)
    tol = [(1e-5 + cond) * abs(_to_float(e)) + 1e-6 + cond for e in expected]
    check_close(adv, expected, tol, "gae whitened advantages")
