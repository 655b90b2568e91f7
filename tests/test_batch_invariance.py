"""Batch invariance of the log-probs (README "What fastrl guarantees"): a row's logp, entropy and
logits gradient (for given per-token upstream gradients) are bitwise identical whatever the batch
size, the row's position in it, the chunk sizes of the CPU path and the other rows' contents,
on the chunked torch path and on the Triton kernels without split-V (the interpreter here; split-V
is taken only for fewer than 2 x SMs rows at V >= 16384, and changes the reduction order)."""

from __future__ import annotations

import pytest
import torch

import fastrl
from fastrl import chunked

V = 257


def _row_results(logits, tokens, up_lp, up_h):
    z = logits.clone().requires_grad_()
    logp, ent = fastrl.logprobs(z, tokens, entropy=True)
    ((logp * up_lp).sum() + (ent * up_h).sum()).backward()
    return logp.detach(), ent.detach(), z.grad


@pytest.mark.parametrize("chunk_rows", [None, 3, 16])
def test_a_row_is_bitwise_the_same_in_any_batch(engine, monkeypatch, chunk_rows):
    device, backend = engine
    if backend == "torch" and device != "cpu":
        # torch's CUDA reductions pick their thread layout (so their summation order) from the
        # tensor's shape: the torch path on a GPU is not batch-invariant (README, guarantees)
        pytest.skip("the torch path is batch-invariant on the CPU only")
    if chunk_rows is not None:
        if backend != "torch":
            pytest.skip("chunk sizes are the torch path's")
        monkeypatch.setattr(chunked, "CHUNK_BYTES", chunk_rows * V * 4)
        monkeypatch.setattr(chunked, "SUB_BYTES", max(1, chunk_rows // 2) * V * 4)
    g = torch.Generator().manual_seed(0)
    row = torch.randn(V, generator=g) * 3
    y = torch.randint(0, V, (), generator=g)
    up = torch.randn(2, generator=g)
    alone = _row_results(row.view(1, 1, V).to(device), y.view(1, 1).to(device),
                         up[0].view(1, 1).to(device), up[1].view(1, 1).to(device))  # fmt: skip
    for B, T, pos in [(1, 40, 0), (3, 13, 20), (5, 7, 34)]:
        logits = torch.randn(B, T, V, generator=g) * 5 - 2
        tokens = torch.randint(0, V, (B, T), generator=g)
        up_lp, up_h = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
        b, t = divmod(pos, T)
        logits[b, t], tokens[b, t], up_lp[b, t], up_h[b, t] = row, y, up[0], up[1]
        logp, ent, grad = _row_results(*(x.to(device) for x in (logits, tokens, up_lp, up_h)))
        assert torch.equal(logp[b, t], alone[0][0, 0]), (B, T, pos)
        assert torch.equal(ent[b, t], alone[1][0, 0]), (B, T, pos)
        assert torch.equal(grad[b, t], alone[2][0, 0]), (B, T, pos)
