"""fastrl.sample (SPEC 10): the sampled distribution (chi-square), logp / entropy against
log_softmax, truncation, reproducibility, the Triton kernel under the interpreter, bad input."""

import math
import os

import pytest
import torch
import triton
import triton.language as tl
from fastrl.kernels import sampling as kernel_sampling

import fastrl
from fastrl import reference as ref
from fastrl.sampling import truncate_logits

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:
    from scipy.stats import chi2 as _chi2
except ImportError:  # pragma: no cover
    _chi2 = None

# fixed 0.999 quantiles of chi-square with df degrees of freedom (used without scipy)
CHI2_999 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}
LOGITS = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, 1.5])  # V = 9


def truncated_probs(logits, temperature, top_k=None, top_p=None):
    """The distribution the sampler must draw from, computed independently (numpy-style)."""
    z = (logits.double() / temperature).tolist()
    order = sorted(range(len(z)), key=lambda j: -z[j])
    keep = order[: top_k or len(z)]
    if top_p is not None and top_p < 1:
        zk = torch.tensor([z[j] for j in keep])
        p = torch.softmax(zk, 0).tolist()
        kept, mass = [], 0.0
        for j, pj in zip(keep, p):
            if mass < top_p or not kept:
                kept.append(j)
            mass += pj
        keep = kept
    probs = torch.zeros(len(z), dtype=torch.float64)
    zk = torch.tensor([z[j] for j in keep], dtype=torch.float64)
    probs[keep] = torch.softmax(zk, 0)
    return probs


def assert_chi_square(tokens, probs):
    """Pearson's test of the token counts against probs (support only), at level 1e-3."""
    counts = torch.bincount(tokens, minlength=len(probs)).double()
    n = counts.sum()
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token outside the support"
    expected = n * probs[support]
    stat = (((counts[support] - expected) ** 2) / expected).sum().item()
    df = int(support.sum()) - 1
    if df == 0:
        return
    critical = _chi2.ppf(0.999, df) if _chi2 is not None else CHI2_999[df]
    assert stat < critical, f"chi-square {stat:.1f} >= {critical:.1f} (df {df}): counts {counts}"


@pytest.fixture(params=__import__("conftest").KERNEL_DEVICES)
def kernel_dev(request):
    """The device a direct kernel test runs on (conftest.KERNEL_DEVICES)."""
    return request.param


CASES = [  # (temperature, top_k, top_p)
    (1.0, None, None),
    (0.5, None, None),
    (2.0, None, None),
    (1.0, 4, None),
    (0.8, None, 0.7),
    (1.3, 5, 0.9),
]


@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_sampled_distribution_torch(temperature, top_k, top_p):
    """10k draws per case, 60k in all: the counts follow the (truncated) softmax."""
    n = 10_000
    g = torch.Generator().manual_seed(123)
    logits = LOGITS.expand(n, -1)
    tokens, logp, entropy = fastrl.sample(logits, temperature, top_k, top_p, generator=g)
    probs = truncated_probs(LOGITS, temperature, top_k, top_p)
    assert_chi_square(tokens, probs)
    torch.testing.assert_close(logp, probs.log()[tokens].float())
    h = -(probs[probs > 0] * probs[probs > 0].log()).sum().float()
    torch.testing.assert_close(entropy, h.expand(n))


def test_chi_square_detects_a_wrong_distribution():
    """The test above can fail: draws at temperature 1 do not pass for temperature 0.8."""
    g = torch.Generator().manual_seed(0)
    tokens, _, _ = fastrl.sample(LOGITS.expand(10_000, -1), 1.0, generator=g)
    with pytest.raises(AssertionError):
        assert_chi_square(tokens, truncated_probs(LOGITS, 0.8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logp_entropy_equal_log_softmax(dtype, temperature):
    logits = (torch.randn(16, 1000) * 3).to(dtype)
    tokens, logp, entropy = fastrl.sample(logits, temperature, generator=torch.Generator())
    ls = torch.log_softmax(logits.float() / temperature, -1)
    torch.testing.assert_close(logp, ls.gather(1, tokens[:, None]).squeeze(1))
    # -Σ p log p and the reference's lse - Σ p z' differ by fp32 rounding (|z'| up to ~20)
    torch.testing.assert_close(entropy, -(ls.exp() * ls).sum(-1), atol=1e-4, rtol=1e-5)
    ref_logp, ref_entropy = ref.token_logprobs(logits, tokens, temperature)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy, atol=5e-5, rtol=1e-5)
    assert logp.dtype == entropy.dtype == torch.float32 and tokens.dtype == torch.int64


def test_truncated_logp_and_support():
    logits = torch.randn(32, 50)
    tokens, logp, entropy = fastrl.sample(logits, 0.9, top_k=10, top_p=0.8)
    z = truncate_logits(logits / 0.9, 10, 0.8)
    ls = torch.log_softmax(z, -1)
    assert torch.isfinite(ls.gather(1, tokens[:, None])).all()  # inside the support
    assert ((z > float("-inf")).sum(-1) <= 10).all()
    torch.testing.assert_close(logp, ls.gather(1, tokens[:, None]).squeeze(1))
    p = ls.exp()
    torch.testing.assert_close(entropy, -(p * ls.nan_to_num(neginf=0.0)).sum(-1))


def test_greedy():
    logits = torch.randn(8, 33)
    tokens, logp, entropy = fastrl.sample(logits, 0.0, top_k=3)
    assert torch.equal(tokens, logits.argmax(-1))
    ls = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logp, ls.max(-1).values)
    torch.testing.assert_close(entropy, -(ls.exp() * ls).sum(-1))


def test_same_seed_same_tokens():
    logits = torch.randn(64, 300)
    a = fastrl.sample(logits, generator=torch.Generator().manual_seed(7))[0]
    b = fastrl.sample(logits, generator=torch.Generator().manual_seed(7))[0]
    c = fastrl.sample(logits, generator=torch.Generator().manual_seed(8))[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)


def test_non_contiguous_rows_and_chunking(monkeypatch):
    monkeypatch.setattr("fastrl.sampling._CHUNK_ELEMENTS", 64)  # several row chunks
    base = torch.randn(20, 64)
    logits = base[:, ::2]  # strided view, V = 32
    tokens, logp, _ = fastrl.sample(logits, generator=torch.Generator().manual_seed(0))
    ls = torch.log_softmax(logits, -1)
    torch.testing.assert_close(logp, ls.gather(1, tokens[:, None]).squeeze(1))


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(logits=torch.randn(2, 3, 4)), "logits"),
        (dict(logits=torch.zeros(2, 3, dtype=torch.long)), "logits"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=1e39), "temperature"),  # inf in fp32: z / inf = 0, a uniform draw
        (dict(temperature=1e-39), "temperature"),  # 1 / τ is inf in fp32
        (dict(temperature=torch.tensor([0.5, 1e-39])), "temperature"),
        (dict(top_k=0), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(generator=3), "generator"),
    ],
)
def test_sample_bad_input(kwargs, match):
    args = dict(logits=torch.randn(2, 5))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        fastrl.sample(**args)


@pytest.mark.parametrize("top_k", [None, 2])
def test_a_tiny_temperature_samples_the_argmax_exactly(top_k):
    """τ down to TAU_MIN with logits whose z / τ overflows fp32: the PyTorch path divides
    max-shifted logits, so it draws the argmax with logp = H = 0 (not NaN and token 0), per-row
    τ too; a row of ties stays uniform over them."""
    from fastrl.config import TAU_MIN

    logits = torch.tensor([[10.0, 30.0, 20.0], [5.0, 5.0, -1.0]])
    g = torch.Generator().manual_seed(0)
    for tau in (1e-37, TAU_MIN, torch.tensor([1e-37, TAU_MIN])):
        tokens, logp, entropy = fastrl.sample(logits, tau, top_k=top_k, generator=g)
        assert tokens[0] == 1 and tokens[1] in (0, 1)
        torch.testing.assert_close(logp, torch.tensor([0.0, -math.log(2)]))
        torch.testing.assert_close(entropy, torch.tensor([0.0, math.log(2)]))


def test_the_scaled_row_max_is_the_max_of_the_scaled_row():
    """The PyTorch path reuses _scaled's m' as the row max of z' = z / τ instead of reading z'
    again: it must equal z'.amax(-1) bit for bit, for finite rows, tiny and large τ, per-row τ,
    and rows holding NaN, +inf or only -inf."""
    from fastrl.sampling import _scaled

    inf = float("inf")
    z = torch.randn(7, 50, generator=torch.Generator().manual_seed(3)) * 40
    z[1, 7], z[2, 3], z[3] = float("nan"), inf, -inf
    z[4, :10] = -inf
    per_row = torch.tensor([0.3, 1.7, 2.9e-39, 1e30, 0.7, 1e-20, 5.0])[:, None]
    for tau in (0.7, 3e-39, 1e20, per_row):
        zs, m = _scaled(z, tau)
        torch.testing.assert_close(m, zs.amax(-1, keepdim=True), rtol=0, atol=0, equal_nan=True)


def test_kernel_at_the_smallest_temperature(kernel_dev):
    """The kernel scales by log2(e) / τ in fp32: at τ = 1 / FP32_MAX (the floor until
    2026-11-27) that is inf, and every row came out NaN with token 0. At TAU_MIN it is finite:
    rows whose |z| / τ stays in fp32 are exact, also where |z| log2(e) / τ does not."""
    from fastrl.kernels import sampling as S

    from fastrl.config import TAU_MIN

    dev = kernel_dev
    z = torch.tensor([[1.0, 0.5, -1.0], [0.0, 0.0, 0.0]], device=dev)
    seed = torch.tensor([4], device=dev)
    for tau in (TAU_MIN, torch.full((2,), TAU_MIN, device=dev)):
        tokens, logp, entropy = S.sample_rows(z, seed, tau, False)
        assert tokens[0] == 0 and 0 <= tokens[1] < 3
        torch.testing.assert_close(logp.cpu(), torch.tensor([0.0, -math.log(3)]))
        torch.testing.assert_close(entropy.cpu(), torch.tensor([0.0, math.log(3)]))
    with pytest.raises(ValueError, match="temperature"):
        fastrl.sample(z, 1 / 3.4028234663852886e38)
    # |z| / τ within fp32 (3.0e38 and 3.15e38) but |z| log2(e) / τ beyond it: keys in log2
    # units tied at inf, and the first group won with a finite logp (-1.5e37)
    z = torch.full((2, 16), -5.0, device=dev)
    z[:, 0], z[:, 9] = 2.0, 2.1
    tokens, logp, _ = S.sample_rows(z, seed, 1 / 1.5e38, False)
    assert tokens.tolist() == [9, 9] and logp.tolist() == [0.0, 0.0]
    # |z| / τ past fp32's range (3 / 6e-39 = 5e38): logp and H NaN, never a silent value (H
    # came out as a finite 0 until 2026-11-28), in both launch shapes; the row within range is exact
    z = torch.tensor([[1.0, 3.0, 2.0, 0.5], [-1.0, -3.0, 2.0, 0.5]], device=dev)
    for split in (0, 32):
        _, logp, entropy = S.sample_rows(z, seed, 6e-39, False, split_chunk=split)
        assert logp[0].isnan() and entropy[0].isnan()
        assert logp[1].item() == 0.0 and entropy[1].item() == 0.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_logits_are_never_written(dtype):
    """The PyTorch path shifts its fp32 chunk in place when the chunk is its own copy: the
    caller's logits (fp32 views at τ = 1 included, strided too) stay bit for bit as they were."""
    full = (torch.randn(9, 70, generator=torch.Generator().manual_seed(4)) * 3).to(dtype)
    for logits in (full, full[:, ::2], full[1::2]):
        before = logits.clone()
        for kw in (dict(), dict(temperature=0.7), dict(top_k=5), dict(temperature=0)):
            fastrl.sample(logits, **kw)
            torch.testing.assert_close(logits, before, rtol=0, atol=0)


def test_numpy_scalars_for_top_k_and_top_p():
    """top_k / top_p as numpy scalars sample exactly as Python's int / float; a non-integral
    top_k is still refused."""
    np = pytest.importorskip("numpy")
    logits = torch.randn(6, 40)
    draws = [
        fastrl.sample(logits, 0.8, k, p, generator=torch.Generator().manual_seed(1))
        for k, p in ((np.int64(5), np.float64(0.9)), (5, 0.9))
    ]
    for got, want in zip(*draws):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="top_k"):
        fastrl.sample(logits, top_k=np.float64(5))


@pytest.mark.parametrize("partial", [False, True])
def test_top_k_keeps_every_tie_at_the_kth_value(partial):
    """HF's TopKLogitsWarper and vLLM keep every entry equal to the k-th largest; exactly k
    were kept, so of two equal logits one was dropped, which one by the sort's order."""
    from transformers import TopKLogitsWarper

    z = torch.tensor([[2.0, 0.0, 2.0, -1.0], [3.0, 1.0, 1.0, 1.0]])
    z = torch.cat([z, torch.full((2, 1500), -5.0)], 1)  # V > the partial sort's 1024 candidates
    for k in (1, 2, 3):
        got = truncate_logits(z, k, None, partial=partial)
        want = TopKLogitsWarper(k)(None, z.clone())
        assert torch.equal(got, want), k
    assert torch.isfinite(truncate_logits(z, 1, None, partial=partial)[0]).sum() == 2


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sample_top_k_draws_tied_tokens_alike(monkeypatch, backend):
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FASTRL_BACKEND", backend)
    n = 240 if backend == "triton" else 4000
    logits = torch.tensor([2.0, 0.0, 2.0, -1.0]).expand(n, -1)
    g = torch.Generator().manual_seed(5)
    tokens, logp, _ = fastrl.sample(logits, 1.0, top_k=1, generator=g)
    assert_chi_square(tokens, torch.tensor([0.5, 0.0, 0.5, 0.0], dtype=torch.float64))
    torch.testing.assert_close(logp, torch.full((n,), math.log(0.5)))


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_sample_outputs_are_constants(monkeypatch, backend):
    """Logits that require grad (a rollout outside no_grad): the draws hold no graph. On the
    PyTorch path logp used to carry one, whose backward failed (an in-place clamp after
    logsumexp), and which kept the model's graph alive."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FASTRL_BACKEND", backend)
    logits = torch.randn(3, 10, requires_grad=True)
    for kwargs in ({}, {"temperature": 0.7, "top_k": 4}, {"temperature": 0.0}):
        tokens, logp, entropy = fastrl.sample(logits * 1, **kwargs)
        assert not logp.requires_grad and not entropy.requires_grad, kwargs


# --------------------------------------------------------------------------- Triton (interpreter)
@pytest.fixture
def triton_backend(monkeypatch):
    monkeypatch.setenv("FASTRL_BACKEND", "triton")


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, None, None), (0.7, 4, 0.95)])
def test_sampled_distribution_kernel(triton_backend, temperature, top_k, top_p):
    """Fewer draws under the interpreter (one program per row): 500 per case, V = 5."""
    n = 500
    g = torch.Generator().manual_seed(3)
    small = LOGITS[:5]
    tokens, logp, _ = fastrl.sample(small.expand(n, -1), temperature, top_k, top_p, generator=g)
    probs = truncated_probs(small, temperature, top_k, top_p)
    assert_chi_square(tokens, probs)
    torch.testing.assert_close(logp, probs.log()[tokens].float())


@pytest.mark.parametrize("V", [7, 5000])  # 5000: two vocabulary blocks
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_logp_entropy(triton_backend, V, dtype):
    logits = (torch.randn(3, V) * 2).to(dtype)
    logits[1, V // 2] = 30.0  # a row that is nearly deterministic
    tokens, logp, entropy = fastrl.sample(logits, 0.9, generator=torch.Generator().manual_seed(1))
    ref_logp, ref_entropy = ref.token_logprobs(logits, tokens, 0.9)
    torch.testing.assert_close(logp, ref_logp)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-5, rtol=1e-5)
    assert tokens[1] == V // 2


def test_kernel_reproducible_greedy_and_truncated(triton_backend):
    logits = torch.randn(4, 40)
    a = fastrl.sample(logits, generator=torch.Generator().manual_seed(5))[0]
    b = fastrl.sample(logits, generator=torch.Generator().manual_seed(5))[0]
    assert torch.equal(a, b)
    tokens, logp, entropy = fastrl.sample(logits, 0.0)
    assert torch.equal(tokens, logits.argmax(-1))
    ls = torch.log_softmax(logits, -1)
    torch.testing.assert_close(entropy, -(ls.exp() * ls).sum(-1))
    tokens, logp, _ = fastrl.sample(logits[:, ::2], 1.0, top_k=2)  # strided, truncated
    z = truncate_logits(logits[:, ::2].float(), 2, None)
    torch.testing.assert_close(logp, torch.log_softmax(z, -1).gather(1, tokens[:, None])[:, 0])


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, None, None), (0.0, None, None), (0.8, 3, 0.9)]
)
def test_nan_row_gives_nan_on_both_backends(monkeypatch, backend, temperature, top_k, top_p):
    """A row with a NaN logit: logp = entropy = NaN on every backend (never silently dropped),
    the token some value in [0, V); the other rows are untouched. -inf is not NaN."""
    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1")
    monkeypatch.setenv("FASTRL_BACKEND", backend)
    logits = torch.randn(4, 43)  # a last group of 3 columns: the 5 past V load as -inf
    logits[0, 17] = float("nan")
    logits[1, :] = float("nan")
    logits[2, 3] = float("-inf")
    g = torch.Generator().manual_seed(0)
    tokens, logp, entropy = fastrl.sample(logits, temperature, top_k, top_p, generator=g)
    assert torch.isnan(logp[:2]).all() and torch.isnan(entropy[:2]).all()
    assert ((tokens >= 0) & (tokens < 43)).all()
    assert torch.isfinite(logp[2:]).all() and torch.isfinite(entropy[2:]).all()
    z = logits[2:] / (temperature or 1.0)  # temperature 0: greedy, logp under tau = 1
    if top_k is not None:
        z = truncate_logits(z, top_k, top_p)
    ls = torch.log_softmax(z, -1)
    torch.testing.assert_close(logp[2:], ls.gather(1, tokens[2:, None])[:, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sample_cuda(dtype):
    logits = (torch.randn(64, 151936, device="cuda") * 3).to(dtype)
    g = torch.Generator(device="cuda").manual_seed(0)
    tokens, logp, entropy = fastrl.sample(logits, 0.7, generator=g)
    ref_logp, ref_entropy = ref.token_logprobs(logits, tokens, 0.7)
    torch.testing.assert_close(logp, ref_logp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(entropy, ref_entropy, atol=1e-4, rtol=1e-4)
    g = torch.Generator(device="cuda").manual_seed(0)
    assert torch.equal(fastrl.sample(logits, 0.7, generator=g)[0], tokens)


def pooled_pearson(counts, expected, least=5.0):
    """Pearson's statistic and its degrees of freedom, the cells expected fewer than `least`
    times pooled into one (smallest first, until the pool reaches `least`): with a cell expected
    0.1 times, two draws of it alone add 31, and the chi-square law no longer holds."""
    order = torch.argsort(expected)
    k = int((torch.cumsum(expected[order], 0) < least).sum()) + 1
    pool, rest = order[:k], order[k:]
    c = torch.cat([counts[pool].sum()[None], counts[rest]])
    e = torch.cat([expected[pool].sum()[None], expected[rest]])
    return (((c - e) ** 2) / e).sum().item(), len(e) - 1


def draws_under_many_seeds(device, seeds=200, n=4000, taus=(0.5, 2.0)):
    """{tau: [(statistic, df)] over the seeds}: each call draws 2n rows, n at each of two
    temperatures (V = 9: the last column is alone in the second group of 8)."""
    z = LOGITS.to(device)
    tau = torch.tensor(taus, device=device).repeat_interleave(n)
    stats = {t: [] for t in taus}
    for seed in range(seeds):
        g = torch.Generator(device=device).manual_seed(seed)
        tokens, _, _ = fastrl.sample(z.expand(2 * n, -1), temperature=tau, generator=g)
        counts = torch.stack([torch.bincount(b, minlength=9) for b in tokens.view(2, n)])
        for t, c in zip(taus, counts.double().cpu()):
            stats[t].append(pooled_pearson(c, n * torch.softmax(LOGITS.double() / t, 0)))
    return stats


def assert_draws_under_many_seeds(stats):
    """A correct sampler's statistics average their degrees of freedom (sd sqrt(2 df / 200)
    <= 0.28 here) and pass the 0.999 quantile about 0.2 times in 200 (3 or more: p ~ 1e-3)."""
    for t, st in stats.items():
        df = st[0][1]
        values = torch.tensor([v for v, _ in st])
        assert abs(values.mean().item() - df) < 1.5, (t, df, values.mean(), values.max())
        assert (values > CHI2_999[df]).sum() <= 2, (t, df, sorted(values.tolist())[-5:])


def test_pooled_pearson_over_many_seeds_torch_path(monkeypatch):
    """The many-seed check below, on the torch path here (a test of the check: unpooled, the
    cell expected 0.1 times at tau = 0.5 put 4 of 200 statistics past the 0.999 quantile)."""
    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    assert_draws_under_many_seeds(draws_under_many_seeds("cpu", seeds=100))


@pytest.mark.gpu
def test_the_kernel_draws_well_under_every_seed_cuda():
    """200 seeds, 4000 draws each: under every seed each block of rows follows its softmax. An
    H200 run of 40 seeds drew one unpooled statistic of 41.5 (two draws of the column expected
    0.1 times, as the torch path also does); pooled, the law holds."""
    assert_draws_under_many_seeds(draws_under_many_seeds("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("temperature,top_k,top_p", CASES)
def test_sampled_distribution_cuda(temperature, top_k, top_p):
    n = 40_000
    logits = LOGITS.cuda().expand(n, -1)
    g = torch.Generator(device="cuda").manual_seed(11)
    tokens, _, _ = fastrl.sample(logits, temperature, top_k, top_p, generator=g)
    assert_chi_square(tokens.cpu(), truncated_probs(LOGITS, temperature, top_k, top_p))


@pytest.mark.parametrize(
    "top_k,top_p", [(5, None), (5, 0.5), (None, 0.6), (None, 0.999), (40, 0.9)]
)
@pytest.mark.parametrize("peaked", [True, False])
def test_partial_sort_truncation_is_exact(monkeypatch, top_k, top_p, peaked):
    """The topk shortcut of truncate_logits gives the full sort's support (or falls back)."""
    monkeypatch.setattr("fastrl.sampling._PARTIAL_SORT", 16)
    z = torch.randn(6, 300) * (6.0 if peaked else 0.5)
    full = truncate_logits(z, top_k, top_p, partial=False)
    fast = truncate_logits(z, top_k, top_p, partial=True)
    assert torch.equal(full == float("-inf"), fast == float("-inf"))
    torch.testing.assert_close(fast, full)


@pytest.mark.parametrize("default", [torch.bfloat16, torch.float16, torch.float64])
def test_the_default_dtype_does_not_change_the_draws(default):
    """The Gumbel noise is fp32 whatever torch's default dtype (some model loaders set bf16):
    the same generator gives the same tokens. With a bf16 default z' + G was rounded to bf16,
    and a token of probability 3.3e-4 came up 8x too rarely."""
    z = torch.tensor([[0.0, -4.0, -8.0]]).repeat(4096, 1)
    want = fastrl.sample(z, generator=torch.Generator().manual_seed(0))[0]
    before = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = fastrl.sample(z, generator=torch.Generator().manual_seed(0))[0]
    finally:
        torch.set_default_dtype(before)
    assert torch.equal(got, want)


@pytest.mark.parametrize("V", [1, 2, 3])
def test_kernel_samples_a_tiny_vocabulary(kernel_dev, triton_backend, V):
    """V < 4: the sweep's block still holds 32 columns, four groups of 8 (one Philox call serves
    four groups; a smaller block would ask for an empty arange)."""
    dev = kernel_dev
    logits = torch.randn(6, V, device=dev)
    for greedy in (False, True):
        tok, logp, ent = fastrl.sample(logits, temperature=0.0 if greedy else 1.0)
        assert ((tok >= 0) & (tok < V)).all()
        want = torch.log_softmax(logits.float(), -1).gather(-1, tok[:, None])[:, 0]
        if not greedy:
            torch.testing.assert_close(logp, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("chunk", [30, 33, 64])
def test_kernel_split_at_any_chunk_samples_the_same_tokens(kernel_dev, chunk):
    """A forced split_chunk that is not a multiple of 32 is rounded up to one (whole groups of 8
    columns, four to a Philox counter): each group and each column keeps its own Philox word,
    so split-V and one program per row draw the same tokens."""
    from fastrl.kernels import sampling as S

    dev = kernel_dev
    logits = torch.zeros(64, 100, device=dev)
    seed = torch.tensor([3], dtype=torch.int64, device=dev)
    one = S.sample_rows(logits, seed, 1.0, False, split_chunk=0)
    split = S.sample_rows(logits, seed, 1.0, False, split_chunk=chunk)
    assert torch.equal(one[0], split[0])


def test_kernel_draws_across_groups_and_super_blocks(kernel_dev):
    """The kernel draws a group of 8 columns by its weight, then a column inside it: a support
    spread over several groups, two in one group (and on CUDA both sides of the 4096-column
    super-block boundary of the group noise, where its Philox words are laid out per thread; the
    interpreter checks that layout against the small blocks' token for token, below) is sampled
    as softmax says (chi-square), with the logp of that distribution."""
    from fastrl.kernels import sampling as S

    dev = kernel_dev
    if dev == "cuda":
        n, V, cols = 20000, 4200, [0, 5, 9, 100, 2049, 4095, 4096, 4199]
    else:  # groups 0, 0, 1, 2, 3, 3, 4, 4 of a V = 40 row
        n, V, cols = 480, 40, [0, 5, 9, 17, 26, 31, 32, 39]
    row = torch.full((V,), float("-inf"))
    row[cols] = LOGITS[:8]
    tokens, logp, _ = S.sample_rows(
        row.to(dev).expand(n, -1), torch.tensor([11], device=dev), 0.8, False
    )
    tokens, logp = tokens.cpu(), logp.cpu()
    probs = truncated_probs(LOGITS[:8], 0.8)
    assert set(tokens.tolist()) <= set(cols)
    index = torch.tensor([cols.index(t) for t in tokens.tolist()])
    assert_chi_square(index, probs)
    torch.testing.assert_close(logp, probs.log()[index].float())


@pytest.mark.parametrize("V", [3, 13])
def test_kernel_an_all_nan_row_gives_a_token_inside_the_vocabulary(kernel_dev, V):
    """No group wins in an all-NaN row, and its column keys are NaN; the compiled max ignores
    NaN, so the columns past V (loaded as -inf) used to equal the 'max': token V or above."""
    from fastrl.kernels import sampling as S

    dev = kernel_dev
    logits = torch.full((2, V), float("nan"), device=dev)
    for greedy in (False, True):
        tokens, logp, entropy = S.sample_rows(logits, torch.tensor([1], device=dev), 1.0, greedy)
        assert ((tokens >= 0) & (tokens < V)).all(), tokens
        assert torch.isnan(logp).all() and torch.isnan(entropy).all()


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # interpreter
@pytest.mark.parametrize("split_chunk", [0, 64])
@pytest.mark.parametrize("greedy", [False, True])
def test_kernel_a_row_with_one_nan_logit_gives_nan(kernel_dev, split_chunk, greedy):
    """One NaN logit among finite ones: the row's logp and entropy are NaN, one program per
    row and split-V alike, the other rows untouched. The compiled max ignores NaN, so the
    row's max and the winner stay finite there and only the kernel's NaN count (n_nan) makes
    logp NaN (the interpreter's numpy max propagates NaN by itself: its run cannot tell;
    mutation K1 survived it, so this runs on CUDA in the GPU run)."""
    from fastrl.kernels import sampling as S

    dev = kernel_dev
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 200, generator=g)
    logits[0, 150] = float("nan")
    seed = torch.tensor([5], device=dev)
    tokens, logp, entropy = S.sample_rows(logits.to(dev), seed, 1.0, greedy,
                                          split_chunk=split_chunk)  # fmt: skip
    logp, entropy, tokens = logp.cpu(), entropy.cpu(), tokens.cpu()
    assert logp[0].isnan() and entropy[0].isnan(), (logp[0], entropy[0])
    assert ((tokens >= 0) & (tokens < 200)).all()
    ls = torch.log_softmax(logits[1:], -1)
    torch.testing.assert_close(logp[1:], ls.gather(1, tokens[1:, None])[:, 0])
    torch.testing.assert_close(entropy[1:], -(ls.exp() * ls).sum(-1))


def test_kernel_statistics_at_extreme_spreads_and_offsets(kernel_dev):
    """Two regressions of the two-stage kernel, found in review:
    * raw spreads near 3.4e38 (a row of -1.7e38, -1.7e38, 1.7e38 and -inf): merging a group
      whose scale underflows to 0 formed 0 * (s d) with s d = -inf, and H came out NaN (the
      per-column kernel gave H = 0);
    * a large |z'| (offset 1e3, τ = 0.1): each slot's max scaled to z' units before the merge
      cost ulp(|z'|) in the slots' weights (logp off by 1.7e-5, H by 1.2e-4 relative); the
      slots now merge in raw units and scale once."""
    from fastrl.kernels import sampling as S

    dev = kernel_dev
    seed = torch.tensor([3], device=dev)
    for V, chunk in ((16, 0), (100, 0), (100, 96), (9000, 0)):
        z = torch.full((1, V), float("-inf"), device=dev)
        z[0, 0] = z[0, 1] = -1.7e38
        z[0, V // 2] = 1.7e38
        tokens, logp, entropy = S.sample_rows(z, seed, 1.0, False, split_chunk=chunk)
        assert tokens.item() == V // 2 and logp.item() == 0 and entropy.item() == 0, (V, chunk)
    g = torch.Generator().manual_seed(0)
    z = (torch.randn(3, 9000, generator=g) * 3 + 1e3).to(dev)
    tokens, logp, entropy = S.sample_rows(z, seed, 0.1, False)
    ls = torch.log_softmax(z.double().cpu() / 0.1, -1)
    want_h = -(ls.exp() * ls).sum(-1)
    want_logp = ls.gather(1, tokens.cpu()[:, None])[:, 0]
    torch.testing.assert_close(logp.double().cpu(), want_logp, rtol=0, atol=5e-7)
    torch.testing.assert_close(entropy.double().cpu(), want_h, rtol=0, atol=5e-7)


@pytest.mark.parametrize("greedy", [False, True])
def test_kernel_whole_super_blocks_draw_as_small_blocks(kernel_dev, greedy):
    """One program per row sweeps V = 9000 in blocks of 4096 (whole super-blocks: one Philox call
    per 4 groups, laid out per thread); a split into slices of 1024 runs the per-group Philox of
    small blocks, one of 4096 the whole-super-block path in split-V: the same tokens."""
    from fastrl.kernels import sampling as S

    dev = kernel_dev
    logits = (torch.randn(3, 9000, generator=torch.Generator().manual_seed(1)) * 3).to(dev)
    logits[2, :4000] = float("-inf")
    seed = torch.tensor([2**33 + 5], device=dev)
    one = S.sample_rows(logits, seed, 0.9, greedy, split_chunk=0)
    assert [
        c.constexpr("BLOCK_V") for c in S.sample_rows_configs(3, 9000, logits.dtype, greedy)
    ] == [4096]
    for chunk in (1024, 4096):
        split = S.sample_rows(logits, seed, 0.9, greedy, split_chunk=chunk)
        assert torch.equal(one[0], split[0]), chunk
        torch.testing.assert_close(split[1], one[1], rtol=1e-6, atol=1e-6)
    assert one[0][2] >= 4000


# --------------------------------------------------------------------------- extreme noise draws
@pytest.mark.parametrize("top_k", [None, 1])
def test_a_zero_uniform_draw_still_samples_the_only_token_of_the_support(top_k):
    """Torch path: torch.rand draws U = 0 with probability 2^-24 an entry (seed 34 draws it at
    (291, 500) of a (292, 1024) draw). Its Gumbel noise was -inf, so a row whose support is that
    one token (a peaked top-p or top-k = 1: common) gave token 0 with logp = -inf."""
    g = torch.Generator().manual_seed(34)
    assert torch.rand(292, 1024, generator=g)[291, 500] == 0  # the premise
    logits = torch.randn(292, 1024, generator=torch.Generator().manual_seed(0))
    if top_k is None:
        logits[291] = float("-inf")
    logits[291, 500] = 10.0  # row 291's only token (top_k = 1: its argmax)
    g = torch.Generator().manual_seed(34)
    tokens, logp, entropy = fastrl.sample(logits, 1.0, top_k=top_k, generator=g)
    assert tokens[291] == 500 and logp[291] == 0 and entropy[291] == 0


@triton.jit
def _philox_words_kernel(seed_ptr, offset_ptr, out_ptr, OURS: tl.constexpr, BLOCK: tl.constexpr):
    # the four Philox words of each counter offset_ptr[i] -> out_ptr[4 i : 4 i + 4]
    i = tl.arange(0, BLOCK)
    off = tl.load(offset_ptr + i)
    seed = tl.load(seed_ptr)
    if OURS:
        r0, r1, r2, r3 = kernel_sampling._philox4x32(seed, off)
    else:
        r0, r1, r2, r3 = tl.randint4x(seed, off)
    tl.store(out_ptr + 4 * i, r0.to(tl.int64))
    tl.store(out_ptr + 4 * i + 1, r1.to(tl.int64))
    tl.store(out_ptr + 4 * i + 2, r2.to(tl.int64))
    tl.store(out_ptr + 4 * i + 3, r3.to(tl.int64))


def philox_words(seed, offsets, ours):
    """seed (1,) int64, offsets (n,) int64 (n a power of 2) -> (n, 4) int64: the four Philox
    words of each counter, from the sampler's `_philox4x32` (ours) or from tl.randint4x."""
    out = torch.empty(len(offsets), 4, dtype=torch.int64, device=offsets.device)
    _philox_words_kernel[(1,)](seed, offsets, out, OURS=ours, BLOCK=len(offsets))
    return out


@pytest.mark.parametrize("seed", [0, 3, 2871038, 2**40 + 7, -5, 2**63 - 1])
def test_kernel_philox_is_triton_randint4x_bit_for_bit(kernel_dev, seed):
    """The sampler's Philox4x32-10 (one wide multiply per product) draws tl.randint4x's words,
    counters past 2^32 included (compiled on CUDA, where the products are inline PTX)."""
    dev = kernel_dev
    offsets = torch.tensor([0, 1, 7, 2**31 + 5, 2**32 - 1, 2**32, 2**33 + 11, 2**40 + 3] * 2)
    offsets[8:] += 12345
    offsets = offsets.to(dev)
    s = torch.tensor([seed], dtype=torch.int64, device=dev)
    ours = philox_words(s, offsets, True)
    assert torch.equal(ours, philox_words(s, offsets, False))
    assert ((ours >= 0) & (ours < 2**32)).all() and ours.unique().numel() > 60


@pytest.mark.parametrize("split_chunk", [0, 4])
def test_kernel_a_philox_word_near_2_to_32_still_samples_its_token(kernel_dev, split_chunk):
    """Kernel: U = (word + 0.5) 2^-32 rounds to 1.0 in fp32 for the top 128 words (probability
    2^-25 a column): 1 - U = 0 gave E = inf and a key of -inf, so a row whose support is that
    one token gave token 0 with logp = -inf. Seed 2871038 draws such a word for column 2 of
    row 0 (counter 0, word 2)."""
    dev = kernel_dev
    seed = torch.tensor([2871038], dtype=torch.int64, device=dev)
    word = philox_words(seed, torch.zeros(2, dtype=torch.int64, device=dev), True)[0, 2]
    assert word >= 2**32 - 128  # the premise
    for support_only in (True, False):  # V = 8: split_chunk 4 makes two slices (one wins)
        logits = torch.full((1, 8), float("-inf"), device=dev)
        if not support_only:
            logits = torch.tensor([[-3.0, -2.0, 0.0, -3.0, -1.0, -4.0, -2.0, -3.0]], device=dev)
        logits[0, 2] = 0.0 if support_only else 6.0
        tokens, logp, _ = kernel_sampling.sample_rows(
            logits, seed, 1.0, False, split_chunk=split_chunk
        )
        if support_only:
            assert tokens.item() == 2 and logp.item() == 0
        else:  # its key is finite now: with 99 % of the mass it is still drawn at this seed
            assert tokens.item() == 2


def test_top_p_keeps_the_smallest_prefix_whose_mass_reaches_top_p():
    """SPEC 10 / truncate_logits: top-p keeps the smallest prefix of the sorted distribution
    whose mass reaches top_p. Four equal logits have p = 1/4 exactly (cumulative 1/4, 1/2, ...,
    all exact in fp32): top_p = 1/2 is reached by two tokens, so exactly two stay. Keeping a
    token whose preceding mass equals top_p (<= for <) keeps a third."""
    for partial in (False, True):
        z = truncate_logits(torch.zeros(3, 4), None, 0.5, partial=partial)
        assert (z > float("-inf")).sum(-1).tolist() == [2, 2, 2]
        z = truncate_logits(torch.zeros(1, 4), None, 0.75, partial=partial)
        assert (z > float("-inf")).sum().item() == 3


def test_top_p_always_keeps_the_most_likely_token_even_of_a_nan_or_inf_row():
    """truncate_logits keeps the most likely token whatever the mass (the first sorted entry; NaN
    sorts first). In a row with a NaN or +inf logit the probabilities are NaN, so no token passes
    the mass test: that entry must still stay, so the NaN / inf is passed on (the sampler then
    reports the row as NaN), never replaced by a row of -inf only."""
    for bad in (float("nan"), float("inf")):
        z = torch.tensor([[1.0, bad, 2.0, 0.5]])
        out = truncate_logits(z, None, 0.9)
        kept = ~(out == float("-inf"))
        assert kept.tolist() == [[False, True, False, False]]
        assert not torch.isfinite(out[0, 1])


def test_per_row_temperatures_follow_their_rows_across_chunks(monkeypatch):
    """With a temperature tensor (N,) the CPU path runs in row chunks, each dividing its rows by
    their own τ_r: row r's logp and entropy are log_softmax(z_r / τ_r)'s (the oracle's), in every
    chunk, not only the first (one row per chunk here)."""
    monkeypatch.setattr("fastrl.sampling._CHUNK_ELEMENTS", 16)  # V = 16: one row per chunk
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(5, 16, generator=g)
    tau = torch.tensor([0.3, 1.0, 2.5, 0.7, 4.0])
    tokens, logp, entropy = fastrl.sample(logits, tau, generator=g)
    want_logp, want_entropy = ref.token_logprobs(logits, tokens, tau[:, None])
    torch.testing.assert_close(logp, want_logp)
    torch.testing.assert_close(entropy, want_entropy, atol=1e-5, rtol=1e-5)


def test_partial_top_p_reads_probabilities_of_the_whole_row(monkeypatch):
    """The topk shortcut of top-p (no top_k) sorts only the _PARTIAL_SORT largest, but their
    probabilities are under the whole row (exp(z - lse), lse over all V), not renormalised over
    the candidates. Four logits of probability 0.2 each (0.8 together) and 36 sharing the other
    0.2: with top_p = 0.5 the mass before the 3rd is 0.4 < 0.5, so three stay (renormalised over
    the four, 0.25 each, the 3rd's mass before would be 0.5 and only two would stay)."""
    monkeypatch.setattr("fastrl.sampling._PARTIAL_SORT", 4)
    z = torch.full((2, 40), math.log(0.2 / 36))
    z[:, :4] = math.log(0.2)
    for partial in (True, False):
        kept = truncate_logits(z, None, 0.5, partial=partial) > float("-inf")
        assert kept.sum(-1).tolist() == [3, 3]
        assert kept[:, :4].sum(-1).tolist() == [3, 3]  # among the four likely ones
