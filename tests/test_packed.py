"""Packed (padding-free) batches, `cu_seqlens`: every op equals the padded (S, T) computation of
the same sequences (fp32, 1e-6 relative), forward and gradient, for every preset and the
sequence-level options; bad boundaries are refused with a clear error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fastrl
from fastrl.config import PRESETS

LENS = [3, 5, 1, 4, 0, 6]  # an empty sequence included
T = 8  # the padded batch is wider than the longest sequence
V = 13


def _batch(seed=0, lens=LENS):
    """Packed rows and the padded (S, T) batch of the same sequences."""
    g = torch.Generator().manual_seed(seed)
    S, N = len(lens), sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()])
    packed = {
        "logits": torch.randn(N, V, generator=g) * 2,
        "tokens": torch.randint(0, V, (N,), generator=g),
        "old": torch.randn(N, generator=g) * 0.3 - 2.5,
        "rollout": torch.randn(N, generator=g) * 0.3 - 2.5,
        "mask": torch.rand(N, generator=g).round() * 0.5 + 0.5,  # fractional: 0.5 and 1
    }
    packed["ref"] = packed["old"] + 0.1 * torch.randn(N, generator=g)
    padded = {k: torch.zeros((S, T) + tuple(v.shape[1:]), dtype=v.dtype) for k, v in packed.items()}
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for k in packed:
            padded[k][i, : b - a] = packed[k][a:b]
    adv = torch.randn(S, generator=g)
    return cu, packed, padded, adv


def _unpad(t, lens=LENS):
    return torch.cat([t[i, :n] for i, n in enumerate(lens)])


CASES = [
    *[{"config": p} for p in sorted(PRESETS)],
    {"config": "grpo", "kl_coef": 0.1, "kl_bias_correction": True, "kl_bias_ratio": "sequence"},
    {"config": "ppo", "rollout_is": "sequence", "rollout_is_cap": 2.0},
    {"config": "ppo", "rollout_is": "token", "rollout_is_cap": 2.0, "entropy_coef": 0.01},
    {"config": "ppo", "agg": "seq-mean-token-sum"},
]


def _kw(case):
    """The case's options, with a KL term, and dr_grpo's constant L (packed rows have no T)."""
    kw = {"kl_coef": 0.05, **case}
    if kw["config"] == "dr_grpo":
        kw["max_len"] = T
    return kw


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{v}" for v in c.values()))
@pytest.mark.parametrize("inplace", [False, True])
def test_policy_loss_packed_equals_padded(engine, case, inplace):
    device, _ = engine
    cu, p, q, adv = _batch()
    kw = _kw(case)
    roll = "rollout_is" in kw

    def run(d, packed: bool):
        z = (d["logits"] * 1.0).to(device).requires_grad_()
        logits = z * 1.0  # not a leaf: inplace may overwrite it
        extra = {"cu_seqlens": cu} if packed else {}
        out = fastrl.policy_loss(
            logits, d["tokens"].to(device), adv.to(device), d["old"].to(device),
            d["ref"].to(device), d["mask"].to(device), d["rollout"].to(device) if roll else None,
            inplace=inplace, **extra, **kw,
        )  # fmt: skip
        out.loss.backward()
        return out, z.grad

    o, g = run(p, packed=True)
    e, ge = run(q, packed=False)
    tol = dict(rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(o.loss, e.loss, **tol)
    torch.testing.assert_close(g, _unpad(ge.cpu()).to(device), **tol)
    for name in ("logp", "entropy", "kl", "ratio"):
        torch.testing.assert_close(getattr(o, name), _unpad(getattr(e, name)), **tol)
    assert o.metrics.keys() == e.metrics.keys()
    for k in o.metrics:
        torch.testing.assert_close(o.metrics[k], e.metrics[k], **tol)


@pytest.mark.parametrize("case", CASES[:6], ids=lambda c: c["config"])
def test_from_logprobs_packed_equals_padded(case):
    cu, p, q, adv = _batch(1)
    kw = _kw(case)
    lp = torch.randn(len(p["old"])) * 0.3 - 2.5
    lpp = torch.zeros(len(LENS), T)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        lpp[i, : b - a] = lp[a:b]
    lp.requires_grad_()
    lpp.requires_grad_()
    o = fastrl.policy_loss_from_logprobs(lp, None, adv, p["old"], p["ref"], p["mask"],
                                         cu_seqlens=cu, max_seqlen=max(LENS), **kw)  # fmt: skip
    e = fastrl.policy_loss_from_logprobs(lpp, None, adv, q["old"], q["ref"], q["mask"], **kw)
    o.loss.backward()
    e.loss.backward()
    torch.testing.assert_close(o.loss, e.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(lp.grad, _unpad(lpp.grad), rtol=1e-6, atol=1e-7)


def test_per_token_advantages_and_per_sequence_are_the_same():
    cu, p, _, adv = _batch(2)
    per_row = torch.repeat_interleave(adv, torch.tensor(LENS))
    a = fastrl.policy_loss(
        p["logits"], p["tokens"], adv, p["old"], cu_seqlens=cu, config="grpo", kl_coef=0.0
    )
    b = fastrl.policy_loss(p["logits"], p["tokens"], per_row, p["old"], cu_seqlens=cu,
                           config="grpo", kl_coef=0.0)  # fmt: skip
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)


def test_logprobs_accept_packed_rows():
    cu, p, _, _ = _batch(3)
    a = fastrl.logprobs(p["logits"], p["tokens"], entropy=True, cu_seqlens=cu)
    b = fastrl.logprobs(p["logits"], p["tokens"], entropy=True)
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y, rtol=0, atol=0)


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce++"])
def test_group_advantages_packed_equals_padded(estimator):
    cu, p, q, _ = _batch(4)
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5, 1.0, 0.0])
    kw = dict(group_size=2, estimator=estimator)
    packed = fastrl.group_advantages(rewards, cu_seqlens=cu, mask=p["mask"], **kw)
    assert packed.shape == (sum(LENS),)
    if estimator == "reinforce++":
        padded = fastrl.group_advantages(rewards, mask=q["mask"], **kw)
        torch.testing.assert_close(packed, _unpad(padded), rtol=1e-6, atol=1e-7)
    else:
        per_seq = fastrl.group_advantages(rewards, **kw)
        torch.testing.assert_close(packed, torch.repeat_interleave(per_seq, torch.tensor(LENS)))
    # without a mask N is read from cu_seqlens, and every estimator gives the unpacked call's
    # (B,) values repeated over each response's rows (reinforce++ then whitens over the B
    # responses, as the unpacked call without a mask: documented, not SPEC 7's token whitening)
    no_mask = fastrl.group_advantages(rewards, cu_seqlens=cu, **kw)
    per_seq = fastrl.group_advantages(rewards, **kw)
    torch.testing.assert_close(no_mask, torch.repeat_interleave(per_seq, torch.tensor(LENS)))
    with pytest.raises(ValueError, match=r"one per packed sequence of cu_seqlens \(7,\)"):
        fastrl.group_advantages(rewards[:5], cu_seqlens=cu, **kw)


@pytest.mark.parametrize(
    "cu, match",
    [
        (torch.tensor([0, 3, 2, 19]), "never decrease"),
        (torch.tensor([1, 5, 19]), "start at 0"),
        (torch.tensor([0, 5, 18]), "end at N = 19"),
        (torch.tensor([0.0, 19.0]), "int32 / int64 tensor of shape"),
        (torch.tensor([19]), r"shape \(S \+ 1,\)"),
    ],
)
def test_bad_cu_seqlens_is_refused(cu, match):
    _, p, _, _ = _batch()
    with pytest.raises(ValueError, match=match):
        fastrl.policy_loss(p["logits"], p["tokens"], torch.zeros(19), cu_seqlens=cu)


def test_bad_packed_inputs_name_the_argument():
    cu, p, q, adv = _batch()
    with pytest.raises(ValueError, match=r"rows must be flat \(N, V\) logits"):
        fastrl.policy_loss(q["logits"], q["tokens"], adv, cu_seqlens=cu)
    B, T = q["tokens"].shape
    hidden, weight = torch.randn(B, T, 4), torch.randn(q["logits"].shape[-1], 4)
    with pytest.raises(ValueError, match=r"rows must be flat \(N, H\) hidden states"):
        fastrl.fused_linear_policy_loss(hidden, weight, q["tokens"], adv, cu_seqlens=cu)
    with pytest.raises(ValueError, match=r"rows must be flat \(N,\) log-probs"):
        fastrl.policy_loss_from_logprobs(torch.randn(B, T), None, adv, cu_seqlens=cu)
    # each entry point names its own inputs, and the packed alternative
    flat_hidden = hidden.reshape(B * T, 4)
    with pytest.raises(ValueError, match=r"pass \(B, T\) inputs \(hidden \(B, T, H\).*cu_seqlens"):
        fastrl.fused_linear_policy_loss(flat_hidden, weight, q["tokens"].reshape(-1),
                                        torch.randn(B * T), config="gspo")  # fmt: skip
    with pytest.raises(ValueError, match=r"pass \(B, T\) inputs \(logp \(B, T\)"):
        fastrl.policy_loss_from_logprobs(torch.randn(B * T), None, torch.randn(B * T),
                                         config="gspo")  # fmt: skip
    with pytest.raises(ValueError, match="hidden must be a float32 / bfloat16 / float16 tensor"):
        fastrl.linear_logprobs(None, weight, q["tokens"])
    with pytest.raises(ValueError, match=r"N is the length of mask shape \(8,\)"):
        fastrl.group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.5]), group_size=2,
                                estimator="reinforce++", cu_seqlens=torch.tensor([0, 3, 3, 5, 9]),
                                mask=torch.ones(8))  # fmt: skip
    with pytest.raises(
        ValueError, match=r"advantages .*\(19,\) or \(1, 19\) \(like tokens\) or \(6,\)"
    ):
        fastrl.policy_loss(p["logits"], p["tokens"], torch.zeros(5), cu_seqlens=cu)
    with pytest.raises(ValueError, match="seq-mean-token-sum-norm.*needs max_len"):
        fastrl.policy_loss(
            p["logits"], p["tokens"], adv, cu_seqlens=cu, agg="seq-mean-token-sum-norm"
        )
    with pytest.raises(ValueError, match="max_seqlen=2 is shorter"):
        fastrl.policy_loss(p["logits"], p["tokens"], adv, cu_seqlens=cu, max_seqlen=2)
    for bad in (True, -1, 7.0):
        with pytest.raises(ValueError, match=f"max_seqlen must be None or an int >= 0, got {bad}"):
            fastrl.policy_loss(p["logits"], p["tokens"], adv, cu_seqlens=cu, max_seqlen=bad)
    with pytest.raises(ValueError, match="max_seqlen is given without cu_seqlens"):
        fastrl.policy_loss(p["logits"], p["tokens"], torch.zeros(19), max_seqlen=2)
    with pytest.raises(ValueError, match=r"rewards must have shape \(6,\)"):
        fastrl.group_advantages(torch.zeros(4), 2, cu_seqlens=cu)


def test_as_many_rows_as_sequences_is_read_exactly_or_refused():
    """N == S: an (N,) tensor is one per row and one per sequence at once. With an empty sequence
    the readings differ (here rows 0-1 are sequence 1): advantages and temperature of that shape
    are refused on every entry, never guessed; (1, N) says one per row. With every sequence one
    row the readings agree and (N,) is accepted."""
    g = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, 0, 2])
    logits, tokens = torch.randn(2, V, generator=g), torch.randint(0, V, (2,), generator=g)
    hidden, weight = torch.randn(2, 4, generator=g), torch.randn(V, 4, generator=g)
    adv = torch.tensor([1.0, -1.0])
    tau = torch.tensor([2.0, 0.5])
    refused = {
        "policy_loss": lambda a: fastrl.policy_loss(logits, tokens, a, cu_seqlens=cu),
        "from_logprobs": lambda a: fastrl.policy_loss_from_logprobs(
            logits[:, 0], None, a, logits[:, 1], cu_seqlens=cu
        ),
        "fused_linear": lambda a: fastrl.fused_linear_policy_loss(
            hidden, weight, tokens, a, cu_seqlens=cu
        ),
        "temperature": lambda t: fastrl.policy_loss(
            logits, tokens, adv[None], cu_seqlens=cu, temperature=t
        ),
        "logprobs": lambda t: fastrl.logprobs(logits, tokens, temperature=t, cu_seqlens=cu),
        "linear_logprobs": lambda t: fastrl.linear_logprobs(
            hidden, weight, tokens, temperature=t, cu_seqlens=cu
        ),
    }
    for name, call in refused.items():
        arg = tau if name in ("temperature", "logprobs", "linear_logprobs") else adv
        with pytest.raises(ValueError, match=r"\(2,\): one per row .* one per packed sequence"):
            call(arg)
        call(arg[None])  # (1, N): one per row
    # (1, N) advantages and temperature against the padded (S, T) = (2, 2) batch
    padded = dict(logits=torch.zeros(2, 2, V), tokens=torch.zeros(2, 2, dtype=torch.long))
    padded["logits"][1], padded["tokens"][1] = logits, tokens
    mask = torch.tensor([[0.0, 0.0], [1.0, 1.0]])
    z = logits.clone().requires_grad_()
    out = fastrl.policy_loss(z, tokens, adv[None], cu_seqlens=cu, temperature=tau[None])
    out.loss.backward()
    zp = padded["logits"].clone().requires_grad_()
    want = fastrl.policy_loss(zp, padded["tokens"], torch.stack([adv, adv]), mask=mask,
                              temperature=torch.stack([tau, tau]))  # fmt: skip
    want.loss.backward()
    torch.testing.assert_close(out.loss, want.loss, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(z.grad, zp.grad[1], rtol=1e-6, atol=1e-7)
    # every sequence one row: (N,) is both, and accepted
    one_each = torch.tensor([0, 1, 2])
    a = fastrl.policy_loss(logits, tokens, adv, cu_seqlens=one_each, temperature=tau)
    b = fastrl.policy_loss(logits, tokens, adv[None], cu_seqlens=one_each, temperature=tau[None])
    torch.testing.assert_close(a.loss, b.loss, rtol=0, atol=0)


def test_numpy_max_seqlen_is_an_int():
    """max_seqlen as numpy's integer packs exactly as Python's int (and as reading it from
    cu_seqlens), in the logits path and the log-prob path."""
    cu, p, _, adv = _batch(3)
    losses = []
    for max_seqlen in (None, max(LENS), np.int64(max(LENS)), np.int32(max(LENS) + 2)):
        kw = dict(cu_seqlens=cu, max_seqlen=max_seqlen, config="gspo")
        a = fastrl.policy_loss(p["logits"], p["tokens"], adv, p["old"], **kw).loss
        b = fastrl.policy_loss_from_logprobs(p["old"] + 0.1, None, adv, p["old"], **kw).loss
        losses.append(torch.stack([a, b]))
    for got in losses[1:]:
        torch.testing.assert_close(got, losses[0], rtol=0, atol=0)


def test_packed_under_torch_compile():
    cu, p, _, adv = _batch(5)

    def loss_fn(logits):
        return fastrl.policy_loss(logits, p["tokens"], adv, p["old"], cu_seqlens=cu,
                                  max_seqlen=max(LENS), config="gspo").loss  # fmt: skip

    z1 = p["logits"].clone().requires_grad_()
    z2 = p["logits"].clone().requires_grad_()
    eager = loss_fn(z1)
    eager.backward()
    compiled = torch.compile(loss_fn, fullgraph=True)(z2)
    compiled.backward()
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(z2.grad, z1.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("config", ["grpo", "gspo", "dapo"])
def test_fused_linear_packed_equals_padded(engine, config):
    device, _ = engine
    cu, p, q, adv = _batch(6)
    g = torch.Generator().manual_seed(7)
    H = 16
    weight = (torch.randn(V, H, generator=g) * 0.3).to(device)
    hid = torch.randn(sum(LENS), H, generator=g)
    hid_pad = torch.zeros(len(LENS), T, H)
    for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        hid_pad[i, : b - a] = hid[a:b]
    kw = dict(config=config, kl_coef=0.05)

    def run(h, d, **extra):
        h = h.to(device).requires_grad_()
        w = weight.clone().requires_grad_()
        out = fastrl.fused_linear_policy_loss(
            h, w, d["tokens"].to(device), adv.to(device), d["old"].to(device),
            d["ref"].to(device), d["mask"].to(device), **kw, **extra,
        )  # fmt: skip
        out.loss.backward()
        return out, h.grad, w.grad

    o, gh, gw = run(hid, p, cu_seqlens=cu)
    e, gh_pad, gw_pad = run(hid_pad, q)
    tol = dict(rtol=1e-5, atol=1e-6)  # the GEMM's blocking moves with the row count
    torch.testing.assert_close(o.loss, e.loss, **tol)
    torch.testing.assert_close(gh, _unpad(gh_pad.cpu()).to(device), **tol)
    torch.testing.assert_close(gw, gw_pad, **tol)
    torch.testing.assert_close(o.logp, _unpad(e.logp), **tol)
    lp = fastrl.linear_logprobs(hid.to(device), weight, p["tokens"].to(device), cu_seqlens=cu)
    torch.testing.assert_close(lp, o.logp, **tol)


def test_one_row_per_sequence_takes_an_n_temperature_in_logprobs_and_linear_logprobs():
    """`logprobs` / `linear_logprobs` read an (N,) temperature of packed rows where N == S from
    cu_seqlens when it is on the CPU (exact max_seqlen): with every sequence one row the two
    readings agree, so it is accepted, and row r is divided by its own tau_r (the oracle's
    log_softmax(z_r / tau_r)). Only on an accelerator (no host read) is max_seqlen the bound N,
    and then such a tensor is refused."""
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, 1, 2, 3])
    logits, tokens = torch.randn(3, V, generator=g), torch.randint(0, V, (3,), generator=g)
    tau = torch.tensor([0.5, 1.0, 2.0])
    want = torch.log_softmax(logits / tau[:, None], -1).gather(1, tokens[:, None])[:, 0]
    got = fastrl.logprobs(logits, tokens, temperature=tau, cu_seqlens=cu)
    torch.testing.assert_close(got, want)
    hidden, weight = torch.randn(3, 4, generator=g), torch.randn(V, 4, generator=g)
    want = torch.log_softmax((hidden @ weight.T) / tau[:, None], -1).gather(1, tokens[:, None])
    got = fastrl.linear_logprobs(hidden, weight, tokens, temperature=tau, cu_seqlens=cu)
    torch.testing.assert_close(got, want[:, 0])


@pytest.mark.parametrize(
    "cu, match",
    [(torch.tensor([0, 3, 2, 19]), "never decrease"), (torch.tensor([0, 5, 18]), "end at N = 19")],
)
def test_log_prob_ops_check_cu_seqlens_too(cu, match):
    """`logprobs` and `linear_logprobs` take cu_seqlens only to check it (their rows are
    independent), and check it they must, as the losses do: boundaries that do not describe the
    N rows are a caller's bug (a batch packed with other lengths), refused, never ignored."""
    _, p, _, _ = _batch()
    with pytest.raises(ValueError, match=match):
        fastrl.logprobs(p["logits"], p["tokens"], cu_seqlens=cu)
    hidden, weight = torch.randn(19, 4), torch.randn(V, 4)
    with pytest.raises(ValueError, match=match):
        fastrl.linear_logprobs(hidden, weight, p["tokens"], cu_seqlens=cu)


def test_log_prob_ops_refuse_cu_seqlens_with_batched_rows():
    """cu_seqlens describes flat (N,) rows: with (B, T) rows (B, T, V) logits or (B, T, H)
    hidden states) it describes nothing, and `logprobs` / `linear_logprobs` refuse it, as the
    losses do, rather than read it against T."""
    g = torch.Generator().manual_seed(0)
    logits, tokens = torch.randn(2, 3, V, generator=g), torch.randint(0, V, (2, 3), generator=g)
    cu = torch.tensor([0, 1, 3])  # a valid split of T = 3 rows
    with pytest.raises(ValueError, match=r"logits must be flat \(N, V\) rows"):
        fastrl.logprobs(logits, tokens, cu_seqlens=cu)
    hidden, weight = torch.randn(2, 3, 4, generator=g), torch.randn(V, 4, generator=g)
    with pytest.raises(ValueError, match=r"hidden / tokens must be flat \(N, H\) / \(N,\)"):
        fastrl.linear_logprobs(hidden, weight, tokens, cu_seqlens=cu)
