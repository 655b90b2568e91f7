"""Rollout sampler (SPEC 10): token, log-prob and entropy of each row from one pass.

`sample(logits, temperature, top_k, top_p, generator)` draws y ~ softmax(z / τ) by the Gumbel-max
trick, y = argmax_j (z'_j + G_j), and returns logp_y = z'_y - lse and H = lse - Σ p z' computed
in the same pass. Both are computed from max-shifted values (m = max z'):
logp_y = (z'_y - m) - log s and H = log s - Σ p (z' - m), s = Σ e^(z' - m), whose terms are all
>= 0, so H keeps fp32 accuracy at large logit offsets, low temperature and fp16 extremes. With
top-k / top-p the distribution sampled is the truncated, renormalised one (tokens outside the
support get z' = -inf; this needs a sort: a second pass), and logp / entropy are under it.
temperature = 0 is greedy: argmax token, logp and entropy under τ = 1 (top-k / top-p do not
change the argmax and are ignored then).

A small τ: the PyTorch path and the top-k / top-p copy divide max-shifted logits, (z - max z) / τ
(the same softmax), so any τ >= 5.88e-39 (config.TAU_MIN: 1 / τ times log2 e finite in fp32,
the smallest taken) samples exactly. The kernel multiplies by 1 / τ in its single pass: there
|z| / τ must stay finite in fp32 (|z| <= 3.4e38 τ), else that row's logp / entropy are NaN
(never a silent value) and its token is no draw (the first of the overflowed entries wins);
for the τ -> 0 limit pass temperature = 0 (greedy).

Per-row temperature: `temperature` may be a tensor (N,) (one τ_r per row, e.g. per request of a
batch) or () (one for all rows), any float dtype (used in fp32), every value finite and
>= 5.88e-39 (checked on CPU tensors outside torch.compile; greedy is the scalar 0 only). Row r is
then drawn from softmax(z_r / τ_r) (truncated by top-k / top-p as above, after the division),
and its logp and entropy are under that distribution: the same as sampling each row alone with
its τ_r.

Non-finite logits: -inf entries have probability 0 (never sampled, no contribution to H). A row
holding any NaN logit returns logp = NaN and entropy = NaN on every backend (the NaN is never
silently dropped); its token is unspecified, some value in [0, V). A +inf logit also makes its
row's logp / entropy NaN.

Backends: CUDA tensors -> the Triton kernel of `fastrl.kernels.sampling` (Philox noise keyed by a
seed drawn from `generator` on the device: no host sync; one program per row, or split-V for few
rows and a large V, which gives the same tokens); CPU tensors -> PyTorch, chunked over
rows (uniform noise drawn from `generator`); FASTRL_BACKEND=triton runs the kernel on CPU tensors
(with TRITON_INTERPRET=1). The same seed gives the same tokens on the same device and backend;
the two backends draw different noise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._inputs import check_int, check_number, inv_tau
from .config import FP32_MAX, TAU_MIN
from .ops import backend_for

_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
_CHUNK_ELEMENTS = 1 << 22  # CPU path: rows per chunk so that fp32 temporaries stay ~16 MB each
_PARTIAL_SORT = 1024  # truncate_logits: candidates sorted by torch.topk when that is exact
_FLT_LOWEST = -FP32_MAX  # the lowest finite fp32
_U_MIN = 2.0**-25  # the torch path's least uniform draw (half torch.rand's step)
_TAU_MIN = TAU_MIN  # the smallest temperature taken (config.TAU_MIN: 1 / τ · log2 e finite in fp32)


def _validate(logits, temperature, top_k, top_p, generator) -> tuple[int | None, float | None]:
    """Raise a ValueError naming the first bad argument; else (top_k, top_p) as Python's own
    int / float or None (numpy's scalars are accepted)."""
    if not isinstance(logits, Tensor) or logits.dim() != 2 or logits.dtype not in _FLOAT_DTYPES:
        got = (
            f"shape {tuple(logits.shape)} and dtype {logits.dtype}"
            if isinstance(logits, Tensor)
            else type(logits).__name__
        )
        raise ValueError(f"logits must be a float tensor of shape (N, V), got {got}")
    if logits.shape[1] < 1:
        raise ValueError(f"logits has shape {tuple(logits.shape)}; expected a vocabulary V >= 1")
    if isinstance(temperature, Tensor):
        _check_temperature_rows(temperature, logits)
    else:
        expected = (
            f"0 (greedy), a float >= {_TAU_MIN:.3g} (1 / τ · log2 e finite in fp32) or a tensor "
            "(N,) of per-row temperatures"
        )
        check_number("temperature", temperature, expected, lambda t: t == 0 or t >= _TAU_MIN)
    top_k = check_int("top_k", top_k, optional=True)
    if top_p is not None:
        top_p = check_number("top_p", top_p, "a float in (0, 1] or None", lambda p: 0 < p <= 1)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise ValueError(f"generator must be a torch.Generator or None, got {type(generator)}")
    return top_k, top_p


def _check_temperature_rows(temperature: Tensor, logits: Tensor) -> None:
    """A per-row temperature: a float tensor (N,) or (), on the logits' device or the CPU; its
    values finite and > 0, checked on CPU tensors outside torch.compile (no host sync)."""
    N = logits.shape[0]
    ok = tuple(temperature.shape) in ((N,), ()) and temperature.is_floating_point()
    ok = ok and temperature.device in (logits.device, torch.device("cpu"))
    if not ok:
        where = "the CPU" if logits.device.type == "cpu" else f"{logits.device} or the CPU"
        raise ValueError(
            f"temperature as a tensor must be a float tensor of shape ({N},) (one per row of "
            f"logits {tuple(logits.shape)}) or () (one for all), on {where}; "
            f"got shape {tuple(temperature.shape)}, dtype {temperature.dtype} on "
            f"{temperature.device}"
        )
    if temperature.device.type == "cpu" and not torch.compiler.is_compiling():
        t = temperature.detach()
        bad = ~torch.isfinite(t) | (t < _TAU_MIN)
        if bool(bad.any()):
            raise ValueError(
                f"temperature must hold finite values >= {_TAU_MIN:.3g} (1 / τ · log2 e finite in "
                f"fp32; greedy is the float 0); the tensor of shape {tuple(t.shape)} holds "
                f"{int(bad.sum())} that are not"
            )


def _scaled(z: Tensor, tau: float | Tensor) -> tuple[Tensor, Tensor]:
    """(z', m'): z' = z / τ (a new fp32 tensor (n, V); τ a float or (n, 1)) formed as (z - m) / τ
    with m the row max of z where finite: the same softmax, and no overflow to inf at a tiny τ
    (z' <= 0; the entries that reach -inf have probability 0 in fp32 anyway). Rows without a
    finite max (NaN, +inf, all -inf) are divided as they are. m' (n, 1) is z'.amax(-1) without
    reading z' again: 0 where m is finite, else m / τ (dividing by τ > 0 keeps the order, and
    rounding is monotone, so max(z / τ) = max(z) / τ exactly)."""
    m = z.amax(-1, keepdim=True)
    finite = torch.isfinite(m)
    inv = inv_tau(tau)  # a multiply, as the kernels (_inputs.inv_tau)
    return (z - torch.where(finite, m, 0.0)).mul_(inv), torch.where(finite, 0.0, m).mul_(inv)


def _row_tau(temperature: Tensor, N: int, device) -> Tensor:
    """A checked per-row temperature tensor as a detached fp32 (N,) on `device`."""
    return temperature.detach().to(device=device, dtype=torch.float32).expand(N).contiguous()


def _keep_sorted(sorted_z: Tensor, top_k, top_p, lse: Tensor | None = None) -> Tensor:
    """Which of the candidates sorted_z (N, K) (descending) stay in the support (N, K) bool.

    Probabilities are softmax over the kept top-k candidates, or exp(z - lse) when the full
    log-normaliser `lse` (N,) is given (the candidates are then a prefix of the whole row)."""
    keep = torch.ones_like(sorted_z, dtype=torch.bool)
    if top_k is not None and top_k < sorted_z.shape[1]:
        # the first k, and every later one equal to the k-th (ties stay, as in HF and vLLM: which
        # of two equal logits survived depended on the sort); NaN sorts first and stays
        keep[:, top_k:] = sorted_z[:, top_k:] >= sorted_z[:, top_k - 1 : top_k]
    if top_p is not None and top_p < 1:
        if lse is None:
            probs = torch.softmax(sorted_z.masked_fill(~keep, float("-inf")), dim=-1)
        else:
            probs = torch.exp(sorted_z - lse[:, None])
        mass_before = probs.cumsum(-1) - probs  # mass of the more likely tokens
        keep &= mass_before < top_p
        keep[:, 0] = True
    return keep


def truncate_logits(
    z: Tensor, top_k: int | None, top_p: float | None, partial: bool | None = None
) -> Tensor:
    """z (N, V) fp32 scaled logits -> a copy with -inf outside the top-k / top-p support.

    top-k keeps the k largest and every entry equal to the k-th largest (ties at the k-th value
    all stay, as in HF's TopKLogitsWarper and vLLM); top-p then keeps the smallest prefix of the
    (top-k renormalised)
    distribution, sorted by decreasing probability, whose mass reaches top_p (the token that
    crosses top_p is kept; the most likely token always is).

    A full sort of every row is the general path. With `partial` (default: on CPU tensors, where
    sorting V = 150k is slow), only the _PARTIAL_SORT largest are sorted (torch.topk) when that is
    exact: top_k <= _PARTIAL_SORT, or (no top_k) those candidates already hold top_p of the mass
    in every row (checked on the data: a host read, hence CPU only by default)."""
    N, V = z.shape
    neg_inf = float("-inf")
    K0 = _PARTIAL_SORT
    if partial is None:
        partial = z.device.type == "cpu"
    if partial and V > K0:
        if top_k is not None and top_k <= K0:
            vals, idx = torch.topk(z, top_k, dim=-1)  # (N, k) descending
            # exact unless an entry outside the k equals the k-th (a tie that stays: full sort)
            if bool(((z >= vals[:, -1:]).sum(-1) <= top_k).all()):
                keep = _keep_sorted(vals, None, top_p)
                out = torch.full_like(z, neg_inf)
                return out.scatter_(1, idx, vals.masked_fill(~keep, neg_inf))
        if top_k is None and top_p is not None and top_p < 1:
            vals, idx = torch.topk(z, K0, dim=-1)
            lse = torch.logsumexp(z, dim=-1)
            if bool((torch.exp(vals - lse[:, None]).sum(-1) >= top_p).all()):
                keep = _keep_sorted(vals, None, top_p, lse)
                out = torch.full_like(z, neg_inf)
                return out.scatter_(1, idx, vals.masked_fill(~keep, neg_inf))
    sorted_z, order = torch.sort(z, dim=-1, descending=True)  # (N, V)
    keep = _keep_sorted(sorted_z, top_k, top_p)
    keep_unsorted = torch.empty_like(keep).scatter_(1, order, keep)
    return z.masked_fill(~keep_unsorted, neg_inf)


def _generator_on(generator, device):
    """`generator` where it is on `device` (or None), else a generator on `device` seeded by one
    draw from it: a CPU generator then drives sampling on a CUDA device on this path too, as on
    the Triton path (_draw_seed); torch.rand refuses a generator of another device."""
    if generator is None or generator.device == torch.device(device):
        return generator
    seed = torch.randint(0, 2**62, (), generator=generator, device=generator.device)
    return torch.Generator(device=device).manual_seed(int(seed))  # (a CPU draw: no device sync)


def _sample_torch(logits: Tensor, temperature, greedy: bool, top_k, top_p, generator):
    """PyTorch path, rows in chunks (bounded fp32 temporaries, truncation included); temperature
    a float or an fp32 (N,) tensor of per-row temperatures (each chunk divides by its (n, 1)).

    Gumbel-max with G = -log(-log U), U ~ U[0, 1) from `generator` in steps of 2^-24; U = 0 is
    taken as 2^-25, half a step (its G would be -inf: a token that cannot be drawn, and a row
    whose support is that one token gave token 0 with logp = -inf). Statistics from zc = z' - m
    (m = row max): lse_c = log Σ e^zc, logp = zc_y - lse_c, H = lse_c - Σ p zc (no
    cancellation); a NaN logit makes m, hence logp and H, NaN."""
    N, V = logits.shape
    dev = logits.device
    generator = _generator_on(generator, dev)
    tokens = torch.empty(N, dtype=torch.int64, device=dev)
    logp = torch.empty(N, dtype=torch.float32, device=dev)
    entropy = torch.empty(N, dtype=torch.float32, device=dev)
    truncate = (top_k is not None and top_k < V) or (top_p is not None and top_p < 1)
    rows = max(1, _CHUNK_ELEMENTS // V)
    for s in range(0, N, rows):
        e = min(N, s + rows)
        z, m = logits[s:e].float(), None  # m: z's row max (n, 1) once known
        if isinstance(temperature, Tensor):
            z, m = _scaled(z, temperature[s:e, None])  # z' = z / τ_r, row by row
        elif temperature != 1.0:
            z, m = _scaled(z, temperature)
        if truncate:
            z, m = truncate_logits(z, top_k, top_p), None
        if greedy:
            tok = z.argmax(-1)
        else:
            # fp32 noise whatever the default dtype (a bf16 default rounded z' + G: biased draws)
            gumbel = torch.rand(z.shape, generator=generator, device=dev, dtype=torch.float32)
            gumbel.clamp_(min=_U_MIN).log_().neg_().log_()  # log E = -G, E = -log U ~ Exp(1)
            tok = gumbel.neg_().add_(z).argmax(-1)  # z' + G
            del gumbel
        tokens[s:e] = tok
        if m is None:
            m = z.amax(-1, keepdim=True)  # (n, 1); NaN if the row holds a NaN
        shift = m.masked_fill(m == float("-inf"), 0.0)
        # zc = z' - m <= 0 (an all -inf row: -inf); in place unless z' is a view of the logits
        view = z.untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
        zc = z - shift if view else z.sub_(shift)
        del z
        lse_c = torch.logsumexp(zc, dim=-1)  # (n,) log s
        logp[s:e] = zc.gather(1, tok[:, None]).squeeze(1) - lse_c
        p = torch.exp(zc - lse_c[:, None])
        zc.clamp_(min=_FLT_LOWEST)  # -inf -> finite: p·zc = 0·finite = 0 (NaN stays NaN)
        entropy[s:e] = lse_c - p.mul_(zc).sum(-1)
        del p, zc
    return tokens, logp, entropy


def _draw_seed(generator, device) -> Tensor:
    """A (1,) int64 Philox key on `device`, drawn from `generator` on the generator's device."""
    gen_device = generator.device if generator is not None else device
    seed = torch.randint(0, 2**62, (1,), generator=generator, device=gen_device, dtype=torch.int64)
    return seed.to(device, non_blocking=True)


def sample(
    logits: Tensor,
    temperature: float | Tensor = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample one token per row of logits (N, V) (any float dtype, any strides).

    temperature: a float (0 = greedy), or a tensor (N,) of per-row temperatures τ_r > 0 (or ()
    for all rows). Returns tokens (N,) int64, logp (N,) fp32 (log-prob of the token under the
    distribution sampled) and entropy (N,) fp32 (of that distribution). See the module
    docstring."""
    top_k, top_p = _validate(logits, temperature, top_k, top_p, generator)
    logits = logits.detach()  # a draw is a constant (and holds no graph), on every backend
    if isinstance(temperature, Tensor):
        greedy = False
        temperature = _row_tau(temperature, logits.shape[0], logits.device)
    else:
        greedy = temperature == 0
        temperature = 1.0 if greedy else float(temperature)
    truncate = not greedy and (
        (top_k is not None and top_k < logits.shape[1]) or (top_p is not None and top_p < 1)
    )
    if backend_for(logits.device) != "triton":
        if not truncate:
            top_k = top_p = None
        return _sample_torch(logits, temperature, greedy, top_k, top_p, generator)
    z = logits
    if truncate:  # the (N, V) truncated copy (fp32) for the kernel
        tau = temperature[:, None] if isinstance(temperature, Tensor) else temperature
        z = truncate_logits(_scaled(logits.float(), tau)[0], top_k, top_p)
        temperature = 1.0
    from .kernels.sampling import sample_rows

    if greedy:
        seed = torch.zeros(1, dtype=torch.int64, device=logits.device)
    else:
        seed = _draw_seed(generator, logits.device)
    return sample_rows(z, seed, temperature, greedy)


__all__ = ["sample", "truncate_logits"]
