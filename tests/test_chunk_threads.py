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


def _many_chunks(monkeypatch, V=129, rows=7):
    """FASTRL_CPU_THREADS=2 and `rows` rows per chunk, so that a small call spreads over both
    worker threads."""
    monkeypatch.setenv("FASTRL_BACKEND", "torch")
    monkeypatch.setenv("FASTRL_CPU_THREADS", "2")
    monkeypatch.setattr(chunked, "CHUNK_BYTES", V * 4 * rows)
    monkeypatch.setattr(chunked, "SUB_BYTES", V * 4 * 3)


def test_inference_mode_reaches_the_workers(monkeypatch):
    """Under torch.inference_mode (a common way to score pi_old / pi_ref) the outputs are
    inference tensors: the worker threads must write them in inference mode too. They raised
    'Inplace update to inference tensor outside InferenceMode' once a call had two chunks."""
    _many_chunks(monkeypatch)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 40, 129, generator=g)
    tokens = torch.randint(0, 129, (2, 40), generator=g)
    adv = torch.randn(2, generator=g)
    rewards, values = torch.randn(64, 50, generator=g), torch.randn(64, 50, generator=g)

    def calls():
        lp, ent = fastrl.logprobs(logits, tokens, entropy=True)
        loss = fastrl.policy_loss(logits, tokens, adv, config="dapo").loss
        return lp, ent, loss, *fastrl.gae(rewards, values, torch.ones(64, 50, dtype=torch.bool))

    with torch.no_grad():
        want = calls()
    with torch.inference_mode():
        got = calls()
    for a, b in zip(got, want):
        assert a.is_inference() and torch.equal(a, b)


def test_a_forked_child_gets_a_pool_of_its_own(monkeypatch):
    """A child forked after the parent's pool exists (multiprocessing's fork, a DataLoader
    worker) has none of its threads: its chunks waited forever. The pool is made anew there."""
    import os
    import signal

    _many_chunks(monkeypatch)
    logits = torch.randn(40, 129)
    tokens = torch.randint(0, 129, (40,))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # torch's own OpenMP pool does not survive a fork either
    try:
        want = fastrl.logprobs(logits, tokens)  # the parent's pool now has its threads
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the call returns the parent's numbers
            signal.alarm(60)
            ok = torch.equal(fastrl.logprobs(logits, tokens), want)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
    finally:
        torch.set_num_threads(threads)
    assert os.waitstatus_to_exitcode(status) == 0  # -14: hung until its alarm


@pytest.mark.parametrize("fails_on", ["first", "second"])
def test_nothing_runs_on_after_a_chunk_fails(monkeypatch, fails_on):
    """When a chunk raises, no new chunk starts and the chunks in progress end before the call
    raises: once it has raised, nothing it started writes into the caller's memory (the other
    workers used to run the remaining chunks in the background). The failing chunk runs on the
    thread that took chunk 0 ("first") or on the other one (the caller waits on the futures in
    order: a stop set only after the first future's result let the other drain the queue)."""
    import threading
    import time

    monkeypatch.setenv("FASTRL_CPU_THREADS", "2")
    done, first, lock = [], [], threading.Lock()

    def body(r0, r1, work):
        me = threading.current_thread().name
        with lock:
            if r0 == 0:
                first.append(me)
            fail = r0 >= 2 and first and (me == first[0]) == (fails_on == "first")
        if fail:
            raise RuntimeError("a chunk failed")
        time.sleep(0.005)
        done.append(r0)

    with pytest.raises(RuntimeError, match="a chunk failed"):
        chunked.run_chunks(100, 1, torch.device("cpu"), body)
    ran = len(done)
    time.sleep(0.1)
    assert len(done) == ran < 20  # nothing after the raise; the rest never started


def test_a_warm_pool_leaves_the_thread_count_alone(monkeypatch):
    """torch.set_num_threads also sets the count that threads new to torch start with: a pool
    thread sets its own once, so a call on a warm pool only restores the caller's setting (a
    thread that first used torch during any call used to keep 1 thread for good)."""
    _many_chunks(monkeypatch)
    logits, tokens = torch.randn(40, 129), torch.randint(0, 129, (40,))
    fastrl.logprobs(logits, tokens)  # the pool threads are warm
    real, seen = torch.set_num_threads, []
    monkeypatch.setattr(torch, "set_num_threads", lambda n: seen.append(n) or real(n))
    fastrl.logprobs(logits, tokens)
    assert seen == [torch.get_num_threads()]


def test_pool_threads_stay_single_threaded(monkeypatch):
    """A pool thread's torch ops run on one thread even when its first parallel op comes in a
    later call (after the caller restored its own count): torch's per-thread lazy init would
    otherwise re-read the process's count then, and bring back the intra-op barriers."""
    import threading
    import time

    monkeypatch.setenv("FASTRL_CPU_THREADS", "2")
    monkeypatch.setattr(chunked, "_POOL", None)  # new pool threads
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:  # call 1: no parallel op in the chunks; call 2: what each pool thread runs with
        chunked.run_chunks(4, 1, torch.device("cpu"), lambda r0, r1, w: time.sleep(0.01))
        seen, lock = {}, threading.Lock()

        def body(r0, r1, work):
            torch.randn(4096).sum()  # through at::parallel_for: the lazy init
            with lock:
                seen[threading.current_thread().name] = torch.get_num_threads()
            time.sleep(0.01)

        chunked.run_chunks(4, 1, torch.device("cpu"), body)
    finally:
        torch.set_num_threads(threads)
    assert seen and set(seen.values()) == {1}, seen


def test_a_call_from_inside_a_chunk_runs_inline(monkeypatch):
    """run_chunks called from a chunk (a pool thread) runs its chunks in that thread: queued
    behind the workers that wait for it, they would never run."""
    import threading

    monkeypatch.setenv("FASTRL_CPU_THREADS", "2")
    inner = []

    def outer(r0, r1, work):
        chunked.run_chunks(4, 1, torch.device("cpu"), lambda a, b, w: inner.append(a))

    t = threading.Thread(target=chunked.run_chunks, args=(4, 1, torch.device("cpu"), outer))
    t.start()
    t.join(timeout=30)
    assert not t.is_alive() and sorted(inner) == sorted([0, 1, 2, 3] * 4)


@pytest.mark.parametrize("value", ["auto", "2.0", "0", "-1"])
def test_bad_thread_count_is_named(monkeypatch, value):
    monkeypatch.setenv("FASTRL_CPU_THREADS", value)
    with pytest.raises(ValueError, match=f"FASTRL_CPU_THREADS must be an int >= 1.*'{value}'"):
        fastrl.logprobs(torch.randn(4, 9), torch.zeros(4, dtype=torch.long))


def test_per_token_temperature_over_many_chunks(monkeypatch):
    """A per-token temperature tensor on the chunked one-pass path (policy loss) and the logprobs
    backward, spread over 16 chunks: every chunk divides its rows by their own temperatures. A
    chunk that took the first chunk's temperatures went unseen while the per-token temperature
    tests had V small enough for one chunk."""
    from fastrl import reference

    _many_chunks(monkeypatch)
    g = torch.Generator().manual_seed(0)
    B, T, V = 3, 37, 129
    logits = torch.randn(B, T, V, generator=g)
    tokens = torch.randint(0, V, (B, T), generator=g)
    adv = torch.randn(B, generator=g)
    tau = 0.5 + torch.rand(B, T, generator=g)  # one temperature per token
    assert chunked.chunk_step(B * T, V, torch.device("cpu")) == 7
    close = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)  # noqa: E731
    grads = []
    for impl in (fastrl, reference):
        z = logits.clone().requires_grad_()
        out = impl.policy_loss(z, tokens, adv, config="grpo", kl_coef=0.0, temperature=tau)
        out.loss.backward()
        zl = logits.clone().requires_grad_()
        if impl is fastrl:
            lp = fastrl.logprobs(zl, tokens, temperature=tau)
        else:  # the oracle of test_temperature: the logits divided eagerly, at temperature 1
            lp = reference.logprobs(zl / tau[..., None], tokens)
        (lp * adv[:, None]).sum().backward()
        grads.append((out.loss, out.logp, z.grad, lp, zl.grad))
    for a, b in zip(*grads):
        close(a, b)
