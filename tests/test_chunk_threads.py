"""The CPU path's chunk scheduler: whole chunks on worker threads (no intra-op barrier per op)
give bitwise the same log-probs, entropies, loss and gradients as one thread, on every path
(one-pass fused loss, two-pass sequence-level loss, logprobs backward), with many chunks."""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import chunked


def _run(threads: int, monkeypatch, config: str):
    monkeypatch.setenv("FASTRL_CPU_THREADS", str(threads))
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 37, 129
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    old = torch.randn(B, T, generator=g) * 0.1 - 4.0
    mask = (torch.rand(B, T, generator=g) > 0.2).float() * 0.5
    z = logits.clone().requires_grad_()
    out = fastrl.policy_loss(z, tokens, adv, old, mask=mask, config=config, entropy_coef=0.01)
    (gz,) = torch.autograd.grad(out.loss, z)
    zl = logits.clone().requires_grad_()
    lp, ent = fastrl.logprobs(zl, tokens, entropy=True)
    (gl,) = torch.autograd.grad((lp * adv[:, None]).sum() + ent.sum(), zl)
    return out.loss, out.logp, out.entropy, gz, lp, ent, gl


@pytest.mark.parametrize("config", ["dapo", "gspo"])
def test_threads_are_bitwise_equal_to_one_thread(monkeypatch, config):
    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    monkeypatch.setattr(chunked, "CHUNK_BYTES", 129 * 4 * 7)  # 7 rows per chunk: 16 chunks
    monkeypatch.setattr(chunked, "SUB_BYTES", 129 * 4 * 3)
    one = _run(1, monkeypatch, config)
    assert chunked.chunk_step(111, 129, torch.device("cpu")) == 7
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = _run(2, monkeypatch, config)
        assert torch.get_num_threads() == 2  # the caller's setting survives the workers
    finally:
        torch.set_num_threads(threads)
    for a, b in zip(one, two):
        assert torch.equal(a, b)


@pytest.mark.parametrize("lam", [0.95, 0.1])  # the blockwise closed form and the truncated sum
def test_gae_threads_are_bitwise_equal_to_one_thread(monkeypatch, lam):
    """The CPU GAE scan runs its row chunks on the same workers: the advantages, returns and
    the whitening (statistics merged in chunk order) do not depend on the thread count."""
    from fastrl.gae import _gae_torch
    from fastrl.reference import gae as reference_gae

    g = torch.Generator().manual_seed(1)
    B, T = 23, 301
    rewards, values = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    lengths = torch.randint(0, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]) & (torch.rand(B, T, generator=g) > 0.1)
    runs = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            monkeypatch.setenv("FASTRL_CPU_THREADS", str(n))
            torch.set_num_threads(n)
            runs.append(_gae_torch(rewards, values, mask, 1.0, lam, True, rows_per_chunk=3))
            assert torch.get_num_threads() == n  # the caller's setting survives the workers
    finally:
        torch.set_num_threads(threads)
    (a1, r1), (a2, r2) = runs
    assert torch.equal(a1, a2) and torch.equal(r1, r2)
    ref_adv, ref_ret = reference_gae(rewards, values, mask.float(), 1.0, lam, False)
    torch.testing.assert_close(r1, ref_ret, rtol=1e-5, atol=1e-4)
    counted = ref_adv[mask]
    whitened = (counted - counted.mean()) / torch.sqrt(counted.var() + 1e-8)
    torch.testing.assert_close(a1[mask], whitened, rtol=1e-4, atol=1e-4)
