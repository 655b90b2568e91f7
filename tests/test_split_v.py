"""Split-V launches (issue 11 item 3) and max-shifted entropy (issue 10 item 2), Triton kernels.

* `_split_config`: the heuristic that picks one program per row or split-V (few rows, large V).
* row_stats / sample_rows forced onto split-V with tiny slices (the interpreter is slow)
  give the one-program outputs: identical tokens for the same seed (the Gumbel noise of (row, j)
  does not depend on the split), logp / entropy equal to fp32 rounding.
* H = log s - Σ p (z' - m) keeps fp32 accuracy where lse - Σ p z' cancels: logits offset by
  1000, temperature 0.1, the fp16 extreme [6e4, 6e4, -6e4, 0]. The logits are dyadic (k / 64),
  so z' = z / τ is exact in fp32 and the float64 reference is the exact answer on every backend.
"""

import math
import os

import pytest
import torch
from fastrl.kernels import policy_loss as PL
from fastrl.kernels import softmax as SM
from fastrl.kernels.policy_loss import _split_config, row_stats
from fastrl.kernels.sampling import sample_rows

import fastrl

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # set by conftest.py without CUDA
CPU = torch.device("cpu")
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
DEVICES = __import__("conftest").KERNEL_DEVICES


def entropy64(z64: torch.Tensor) -> torch.Tensor:
    """Float64 entropy of rows of scaled logits (-inf entries have p = 0)."""
    ls = torch.log_softmax(z64, -1)
    return -(ls.exp() * ls.nan_to_num(neginf=0.0)).sum(-1)


def dyadic(*shape, scale=3.0, offset=0.0):
    """Logits k / 64: z / 0.1 and z * fp32(1 / 0.1) are exact in fp32 for |z| < 2^11."""
    return torch.round(torch.randn(*shape) * scale * 64) / 64 + offset


# --------------------------------------------------------------------------- heuristic
def test_split_config_heuristic():
    block = 4096
    # decode shapes on the default 132 SMs: split, slices of >= _SPLIT_MIN_CHUNK covering V
    for n, V in [(1, 262144), (16, 151936), (64, 262144), (263, 151936)]:
        splits, chunk = _split_config(n, V, block, CPU)
        assert splits > 1 and chunk % block == 0 and chunk >= SM._SPLIT_MIN_CHUNK
        assert (splits - 1) * chunk < V <= splits * chunk
        assert n * splits <= 2 * SM._SPLIT_WAVES * SM._SPLIT_SM_COUNT  # no needless slicing
    assert _split_config(1, 262144, block, CPU) == (32, 8192)
    # many rows (training shapes) or a small V: one program per row
    assert _split_config(264, 262144, block, CPU) == (1, 262144)
    assert _split_config(16384, 151936, block, CPU) == (1, 151936)
    assert _split_config(1, 2 * SM._SPLIT_MIN_CHUNK - 1, block, CPU)[0] == 1
    # forced (tests): 0 = one program per row, k = slices of k columns
    assert _split_config(1, 262144, block, CPU, split_chunk=0) == (1, 262144)
    assert _split_config(10**6, 1000, 1024, CPU, split_chunk=64) == (16, 64)
    assert _split_config(1, 50, 64, CPU, split_chunk=64) == (1, 50)


# --------------------------------------------------------------------------- token stats
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("V,chunk", [(300, 64), (1000, 200), (1000, 1000 - 1)])
def test_token_stats_split_equals_one_program(device, dtype, V, chunk):
    base = (torch.randn(2, 5, V) * 3).to(dtype)
    logits = base[:, 1:4].to(device)  # strided (B, T) view, T = 3
    logits[0, 0, :: V // 7] = float("-inf")  # masked entries in several slices
    logits[0, 1] = 0.0  # a uniform row: H = log V
    logits[1, 2, V - 1] = 40.0  # nearly deterministic, its max in the last slice
    tokens = torch.randint(0, V, (2, 3), device=device)
    tokens[1, 0] = V  # out of range: logp = NaN on both paths
    one = row_stats(logits, tokens, 0.7, split_chunk=0)
    split = row_stats(logits, tokens, 0.7, split_chunk=chunk)
    for a, b in zip(one, split):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6, equal_nan=True)
    z64 = logits.double() / 0.7
    lse64 = torch.logsumexp(z64, -1)
    logp64 = z64.gather(-1, tokens.clamp(max=V - 1)[..., None]).squeeze(-1) - lse64
    logp64[1, 0] = float("nan")
    logp, entropy, lse = split
    torch.testing.assert_close(logp.double(), logp64, rtol=1e-6, atol=1e-5, equal_nan=True)
    torch.testing.assert_close(entropy.double(), entropy64(z64), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(lse.double(), lse64, rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(entropy[0, 1].double().cpu(), torch.tensor(V).double().log())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [0, 64])
def test_token_stats_nonfinite_rows(device, chunk):
    """A NaN or +inf logit makes its row's logp, H and lse NaN on both paths (never dropped,
    whatever max does with NaN on the hardware); -inf entries have p = 0."""
    logits = torch.randn(1, 4, 300, device=device)
    logits[0, 0, 100] = float("nan")
    logits[0, 1, 299] = float("nan")  # in the last slice, not the token's
    logits[0, 2, 7] = float("inf")
    logits[0, 3, :250] = float("-inf")
    tokens = torch.tensor([[0, 1, 2, 260]], device=device)
    logp, entropy, lse = row_stats(logits, tokens, 1.0, split_chunk=chunk)
    assert torch.isnan(logp[0, :3]).all() and torch.isnan(entropy[0, :3]).all()
    assert torch.isnan(lse[0, :3]).all()
    z = logits[0, 3, 250:].double()
    torch.testing.assert_close(entropy[0, 3].double(), entropy64(z), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp[0, 3].double(), torch.log_softmax(z, -1)[10])


@pytest.mark.parametrize("device", DEVICES)
def test_split_merge_at_spreads_near_the_fp32_range(device):
    """Slices whose maxima are 6e38 apart: the lower slice's scale underflows to 0 while its
    s * (m_k - m) overflows to -inf (clamped d ~ -3.4e38 times 32 terms), and the merge's
    0 * -inf made H NaN on the split path only (softmax._lse_merge). Both paths now give
    H = log 32 (the 32 equal top logits), as float64 does; the sampler's merge too."""
    logits = torch.empty(2, 1, 64, device=device)
    logits[0, 0, :32], logits[0, 0, 32:] = -3e38, 3e38
    logits[1, 0, :32], logits[1, 0, 32:] = 3e38, -3e38  # the top slice first
    tokens = torch.tensor([[40], [3]], device=device)
    for chunk in (0, 32):
        logp, entropy, lse = row_stats(logits, tokens, 1.0, split_chunk=chunk)
        want = torch.full((2, 1), math.log(32))
        torch.testing.assert_close(entropy.cpu(), want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(logp.cpu(), -want, rtol=1e-6, atol=1e-6)
    seed = torch.tensor([5], dtype=torch.int64, device=device)
    for chunk in (0, 32):
        tokens, logp, entropy = sample_rows(logits[:, 0], seed, 1.0, False, split_chunk=chunk)
        assert ((tokens >= 32) == torch.tensor([True, False], device=device)).all(), tokens
        torch.testing.assert_close(entropy.cpu(), torch.full((2,), math.log(32)))


@pytest.mark.parametrize("device", DEVICES)
def test_policy_loss_gradient_at_a_large_offset_on_the_split_path(device, monkeypatch, launched):
    """Few rows with a long vocabulary run split-V: its merge kernel stores each row's m and
    log s too (STORE_SHIFT), so the gradient kernel forms p_j = exp((z'_j - m) - log s) as on
    the one-program path. From lse, rounded at |lse|'s scale, an entry was 6.8e-5 off float64
    at a logit offset of 1e4 (found in review)."""
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    g = torch.Generator().manual_seed(0)
    V = 16384
    base = torch.randn(1, 2, V, generator=g)
    base[..., :3] += 10.0  # a few large probabilities
    z = base + 1e4
    tokens, adv = torch.tensor([[0, 5]]), torch.tensor([1.0])
    x = z.to(device).requires_grad_()
    out = fastrl.policy_loss(x * 1.0, tokens.to(device), adv.to(device), policy="reinforce",
                             entropy_coef=0.1)  # fmt: skip
    out.loss.backward()
    assert "_token_stats_split_fwd_kernel" in {name for name, *_ in launched}

    w = z.detach().double().requires_grad_()
    ls = torch.log_softmax(w, -1)
    logp, entropy = ls.gather(-1, tokens[..., None])[..., 0], -(ls.exp() * ls).sum(-1)
    (-logp * adv[:, None] - 0.1 * entropy).mean().backward()
    torch.testing.assert_close(x.grad.cpu().double(), w.grad, rtol=0, atol=2e-6)


@needs_interpreter
def test_logprobs_takes_split_path_when_rows_are_few(monkeypatch):
    """fastrl.logprobs on the Triton backend picks split-V by itself for few rows / large V
    (the minimum slice lowered so that a tiny V qualifies), with the torch path's results."""
    monkeypatch.setattr(SM, "_SPLIT_MIN_CHUNK", 64)
    chosen = []

    def spy(*args, **kwargs):
        chosen.append(_split_config(*args, **kwargs))
        return chosen[-1]

    monkeypatch.setattr(PL, "_split_config", spy)
    logits, tokens = torch.randn(1, 3, 700) * 2, torch.randint(0, 700, (1, 3))
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    logp, entropy = fastrl.logprobs(logits, tokens, 0.8, entropy=True)
    assert chosen and chosen[-1][0] > 1
    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    ref_logp, ref_entropy = fastrl.logprobs(logits, tokens, 0.8, entropy=True)
    torch.testing.assert_close(logp, ref_logp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, ref_entropy, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- sampler
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("V,chunk", [(300, 64), (1000, 256)])
def test_sampler_split_same_tokens(device, greedy, V, chunk):
    base = torch.randn(6, 2 * V, device=device).to(torch.bfloat16)
    logits = base[:, ::2]  # strided over V too
    logits[0, V // 3 :] = float("-inf")  # a truncated support
    logits[1, 5] = 50.0  # nearly deterministic
    for s in (0, 1, 2**40 + 3):
        seed = torch.tensor([s], device=device)
        one = sample_rows(logits, seed, 0.8, greedy, split_chunk=0)
        split = sample_rows(logits, seed, 0.8, greedy, split_chunk=chunk)
        assert torch.equal(one[0], split[0])
        torch.testing.assert_close(split[1], one[1], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(split[2], one[2], rtol=1e-6, atol=1e-6)
    tokens, logp, entropy = split
    assert tokens[0] < V // 3 and tokens[1] == 5
    z64 = logits.double() / (1.0 if greedy else 0.8)
    ls = torch.log_softmax(z64, -1)
    torch.testing.assert_close(logp.double(), ls.gather(1, tokens[:, None])[:, 0])
    torch.testing.assert_close(entropy.double(), entropy64(z64), rtol=1e-6, atol=1e-6)
    if greedy:
        assert torch.equal(tokens, logits.float().argmax(-1))


@pytest.mark.parametrize("device", DEVICES)
def test_sampler_split_ties_pick_the_first(device):
    """Greedy ties across slices resolve to the first column, as the one-program sweep does."""
    logits = torch.zeros(3, 400, device=device)
    logits[1, [70, 130, 390]] = 2.0  # three slices of 64 hold the maximum
    logits[2, [391, 399]] = 1.0  # both in the last slice
    seed = torch.zeros(1, dtype=torch.int64, device=device)
    for chunk in (0, 64):
        tokens = sample_rows(logits, seed, 1.0, True, split_chunk=chunk)[0]
        assert tokens.tolist() == [0, 70, 391]


@needs_interpreter
def test_sample_takes_split_path_with_the_same_tokens(monkeypatch):
    """fastrl.sample (Triton backend) on few rows goes split-V by itself; same seed, same tokens
    as one program per row."""
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    logits = torch.randn(2, 700) * 2
    monkeypatch.setattr(SM, "_SPLIT_MIN_CHUNK", 64)
    assert _split_config(2, 700, 1024, CPU)[0] > 1
    split = fastrl.sample(logits, 0.9, generator=torch.Generator().manual_seed(4))
    monkeypatch.setattr(SM, "_SPLIT_MIN_CHUNK", 1 << 20)
    one = fastrl.sample(logits, 0.9, generator=torch.Generator().manual_seed(4))
    assert torch.equal(split[0], one[0])
    torch.testing.assert_close(split[1], one[1])
    torch.testing.assert_close(split[2], one[2])


# --------------------------------------------------------------------------- entropy precision
PRECISION_CASES = {  # name: (logits, temperature); the old lse - Σ p z' was off by 2e-6 .. 2e-3
    "offset_1000": (lambda: dyadic(4, 500, scale=2.0, offset=1000.0), 1.0),
    "offset_1000_tau_0.1": (lambda: dyadic(4, 500, scale=2.0, offset=1000.0), 0.1),
    "tau_0.1": (lambda: dyadic(4, 500), 0.1),
    "tau_0.05": (lambda: dyadic(4, 500), 0.05),
    "fp16_extreme": (lambda: torch.tensor([[6e4, 6e4, -6e4, 0.0]], dtype=torch.float16), 1.0),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunk", [0, 64])
@pytest.mark.parametrize("case", list(PRECISION_CASES))
def test_token_stats_entropy_precision(device, chunk, case):
    make, tau = PRECISION_CASES[case]
    logits = make().to(device)[None]  # (1, N, V)
    tokens = logits.argmin(-1)  # the least likely token: logp is max-shifted too
    logp, entropy, _ = row_stats(logits, tokens, tau, split_chunk=chunk)
    z64 = logits.double() / tau
    ls = torch.log_softmax(z64, -1)
    torch.testing.assert_close(entropy.double(), entropy64(z64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        logp.double(), ls.gather(-1, tokens[..., None])[..., 0], rtol=1e-6, atol=1e-6
    )


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_interpreter)])
@pytest.mark.parametrize("case", list(PRECISION_CASES))
def test_sampler_entropy_precision(monkeypatch, backend, case):
    monkeypatch.setenv("FASTRL_BACKEND", backend)
    make, tau = PRECISION_CASES[case]
    logits = make()
    g = torch.Generator().manual_seed(0)
    tokens, logp, entropy = fastrl.sample(logits, tau, generator=g)
    z64 = logits.double() / tau
    ls = torch.log_softmax(z64, -1)
    torch.testing.assert_close(entropy.double(), entropy64(z64), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(
        logp.double(), ls.gather(1, tokens[:, None])[:, 0], atol=1e-6, rtol=1e-6
    )
    if backend == "triton":  # split-V keeps the precision
        seed = torch.tensor([7])
        h = sample_rows(logits, seed, tau, False, split_chunk=64)[2]
        torch.testing.assert_close(h.double(), entropy64(z64), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- GPU shapes
@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8, 64])
@pytest.mark.parametrize("V", [151936, 262144])
def test_split_v_decode_shapes_cuda(N, V):
    """Decode shapes on hardware: the heuristic splits, and both paths agree."""
    logits = (torch.randn(N, V, device="cuda") * 3).to(torch.bfloat16)
    assert _split_config(N, V, 4096, logits.device)[0] > 1
    seed = torch.tensor([123], device="cuda")
    auto = sample_rows(logits, seed, 0.7, False)
    one = sample_rows(logits, seed, 0.7, False, split_chunk=0)
    assert torch.equal(auto[0], one[0])
    torch.testing.assert_close(auto[1], one[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(auto[2], one[2], rtol=1e-5, atol=1e-5)
    tokens = auto[0][None]
    a = row_stats(logits[None], tokens, 0.7)
    b = row_stats(logits[None], tokens, 0.7, split_chunk=0)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a[0][0], auto[1], rtol=1e-5, atol=1e-5)
