"""Rollout: greedy equals HF generate, sampler log-probs equal the recomputed ones, masks after
EOS, loading a saved model through fastrl's loader."""

import pytest
import torch

from fastrl.train.rollout import (
    Rollout,
    default_model,
    default_tokenizer,
    generate,
    left_pad,
    load_model,
    sequence_logprobs,
)

PROMPTS = ["12+3=", "7+45=", "99+99=", "1=", "0+0+0+0="]


@pytest.fixture(scope="module")
def saved_model(tmp_path_factory):
    """A tiny random Qwen2 + the char tokenizer, written with save_pretrained."""
    path = tmp_path_factory.mktemp("tiny_lm")
    tok = default_tokenizer()
    model = default_model(len(tok), seed=3, hidden=32, layers=2)
    with torch.no_grad():  # make EOS likely enough that some rows stop early
        model.model.embed_tokens.weight[tok.eos_token_id] *= 6
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _ids(tok, prompts):
    return [tok(p).input_ids for p in prompts]


def test_load_and_greedy_equals_hf_generate(saved_model):
    model, tok = load_model(saved_model)
    model.eval()
    prompts = _ids(tok, PROMPTS)
    r = generate(model, prompts, 1, 10, tok.eos_token_id, tok.pad_token_id, temperature=0.0)
    ids, attn = left_pad(prompts, tok.pad_token_id)
    ref = model.generate(
        input_ids=ids,
        attention_mask=attn,
        max_new_tokens=10,
        do_sample=False,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )[:, ids.shape[1] :]
    assert r.completion_ids.shape == ref.shape
    assert torch.equal(r.completion_ids, ref)


def test_group_samples_and_sampler_logp_equal_recomputed(saved_model):
    model, tok = load_model(saved_model)
    model.eval()
    gen = torch.Generator().manual_seed(0)
    r = generate(
        model,
        _ids(tok, PROMPTS),
        4,
        8,
        tok.eos_token_id,
        tok.pad_token_id,
        temperature=1.0,
        generator=gen,
    )
    assert r.completion_ids.shape[0] == len(PROMPTS) * 4 and r.group_size == 4
    assert not torch.equal(r.completion_ids[0], r.completion_ids[1]) or not torch.equal(
        r.completion_ids[1], r.completion_ids[2]
    )  # samples differ within a group
    old = sequence_logprobs(model, r, temperature=1.0, chunk=7)
    m = r.completion_mask.bool()
    ratio = torch.exp(old - r.sampler_logp)[m]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    assert (old[~m] == 0).all()
    # a temperature is applied to both the sampler and the recomputation
    r2 = generate(
        model,
        _ids(tok, PROMPTS),
        2,
        6,
        tok.eos_token_id,
        tok.pad_token_id,
        temperature=0.7,
        generator=gen,
    )
    old2 = sequence_logprobs(model, r2, temperature=0.7)
    m2 = r2.completion_mask.bool()
    torch.testing.assert_close(old2[m2], r2.sampler_logp[m2], atol=1e-5, rtol=0)


def test_masks_after_eos():
    tok = default_tokenizer()
    model = default_model(len(tok), seed=1, hidden=32, layers=1).eval()
    prompts = _ids(tok, PROMPTS)
    free = generate(model, prompts, 1, 8, tok.eos_token_id, tok.pad_token_id, temperature=0.0)
    # declare as EOS a token that row 0 produces at step 2: rows stop at its first occurrence
    eos = int(free.completion_ids[0, 2])
    r = generate(model, prompts, 1, 8, eos, tok.pad_token_id, temperature=0.0)
    stopped = 0
    for i in range(len(prompts)):
        row = free.completion_ids[i].tolist()
        first = row.index(eos) if eos in row else None
        n = 8 if first is None else first + 1
        assert int(r.lengths[i]) == n
        assert bool(r.truncated[i]) == (first is None)
        assert r.completion_mask[i, :n].eq(1).all() and r.completion_mask[i, n:].eq(0).all()
        assert r.completion_ids[i, :n].tolist() == row[:n]
        assert r.completion_ids[i, n:].eq(tok.pad_token_id).all()
        assert r.sampler_logp[i, n:].eq(0).all()
        stopped += first is not None
    assert stopped >= 1
    assert r.completion_ids.shape[1] <= 8


def test_no_forward_past_the_last_token():
    """T new tokens take 1 prefill + T - 1 decode forwards: the logits of a forward after the
    last token would never be sampled (one wasted decode step in every truncated batch)."""
    tok = default_tokenizer()
    model = default_model(len(tok), seed=1, hidden=32, layers=1).eval()
    calls = []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    never = len(tok) + 5  # an EOS no row can draw: every row runs to max_new_tokens
    r = generate(model, _ids(tok, PROMPTS), 2, 5, never, tok.pad_token_id, temperature=0.0)
    assert r.completion_ids.shape[1] == 5 and bool(r.truncated.all())
    assert len(calls) == 5  # prefill + 4 decodes


@pytest.mark.parametrize("temperature, top_k", [(1.0, None), (0.7, 5), (0.0, None)])
def test_looking_every_k_steps_gives_the_same_rollout_and_generator(temperature, top_k):
    """On a GPU the host looks at "all stopped?" every 8 steps (each look is a device sync):
    the steps run past the stop are dropped and the generator put back, so the rollout and the
    generator's next draws equal those of a look after every step, for every window."""
    tok = default_tokenizer()
    model = default_model(len(tok), seed=3, hidden=32, layers=2).eval()
    with torch.no_grad():  # EOS likely enough that every row stops within 40 tokens
        model.model.embed_tokens.weight[tok.eos_token_id] *= 20
    prompts = _ids(tok, PROMPTS)
    runs, calls = [], []
    model.register_forward_pre_hook(lambda *a: calls.append(1))
    for every in (1, 2, 3, 8, 40):
        gen = torch.Generator().manual_seed(5)
        calls.clear()
        kw = dict(temperature=temperature, top_k=top_k, generator=gen, check_every=every)
        r = generate(model, prompts, 3, 40, tok.eos_token_id, tok.pad_token_id, **kw)
        runs.append((r, torch.rand(4, generator=gen), len(calls), every))
    r1, next1, forwards1, _ = runs[0]
    assert 1 < r1.completion_ids.shape[1] < 40  # every row stopped early: the windows cut
    for r, nxt, forwards, every in runs[1:]:
        for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask",
                  "sampler_logp", "lengths", "truncated"):  # fmt: skip
            assert torch.equal(getattr(r, f), getattr(r1, f)), (every, f)
        assert torch.equal(nxt, next1), every  # the generator as after the last kept step
        assert forwards1 <= forwards < forwards1 + every
    with pytest.raises(ValueError, match="check_every"):
        generate(model, prompts, 1, 4, tok.eos_token_id, tok.pad_token_id, check_every=2)


def test_greedy_without_a_generator_looks_every_k_steps():
    """The eval's greedy generation (temperature 0, no generator) draws nothing, so it may look
    every k steps too (8 on a GPU by default): the same rollout for every window, and the
    default generator untouched."""
    tok = default_tokenizer()
    model = default_model(len(tok), seed=3, hidden=32, layers=2).eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[tok.eos_token_id] *= 20
    prompts, runs = _ids(tok, PROMPTS), []
    for every in (1, 3, 8, 40):
        state = torch.get_rng_state()
        r = generate(model, prompts, 1, 40, tok.eos_token_id, tok.pad_token_id,
                     temperature=0.0, check_every=every)  # fmt: skip
        assert torch.equal(torch.get_rng_state(), state), every
        runs.append(r)
    assert 1 < runs[0].completion_ids.shape[1] < 40
    for r, every in zip(runs[1:], (3, 8, 40)):
        for f in ("completion_ids", "completion_mask", "sampler_logp", "truncated"):
            assert torch.equal(getattr(r, f), getattr(runs[0], f)), (every, f)
    with pytest.raises(ValueError, match="check_every"):  # draws from the default generator
        generate(model, prompts, 1, 4, tok.eos_token_id, tok.pad_token_id,
                 temperature=0.5, check_every=2)  # fmt: skip


def test_eos_ids_put_the_tokenizers_eos_first():
    """The supervised warm-up ends its targets with eos[0]: the tokenizer's EOS, not the
    smallest id of the generation config's list (Qwen2.5-Instruct: <|im_end|> = 151645 with
    <|endoftext|> = 151643 in generation_config)."""
    from types import SimpleNamespace

    from fastrl.train.rollout import eos_ids

    tok = SimpleNamespace(eos_token_id=151645)
    model = SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=[151645, 151643, 7]))
    assert eos_ids(tok, model) == [151645, 7, 151643]
    assert eos_ids(tok, SimpleNamespace(generation_config=SimpleNamespace(eos_token_id=3))) == [
        151645,
        3,
    ]
    assert eos_ids(SimpleNamespace(eos_token_id=None), model) == [7, 151643, 151645]


def test_select_and_cat_roundtrip():
    tok = default_tokenizer()
    model = default_model(len(tok), seed=1, hidden=32, layers=1).eval()
    r = generate(
        model,
        _ids(tok, PROMPTS),
        2,
        5,
        tok.eos_token_id,
        tok.pad_token_id,
        generator=torch.Generator().manual_seed(1),
    )
    a, b = r.select(torch.arange(0, 4)), r.select(torch.arange(4, 10))
    c = Rollout.cat([a, b])
    assert torch.equal(c.completion_ids, r.completion_ids)
    assert torch.equal(c.prompt_ids, r.prompt_ids)
    assert torch.equal(c.completion_mask, r.completion_mask)


def test_bad_inputs():
    tok = default_tokenizer()
    model = default_model(len(tok), seed=1, hidden=32, layers=1)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [[4]], 1, 0, tok.eos_token_id, tok.pad_token_id)
    with pytest.raises(ValueError, match="not a local Hugging Face model"):
        load_model("/nonexistent/dir")


@pytest.mark.parametrize("top_k, top_p", [(5, None), (None, 0.6), (40, 0.9)])
def test_truncate_like_sampler_in_chunks_of_rows(monkeypatch, top_k, top_p):
    """The trainer's truncation of its training logits runs in chunks of rows (the sort of a
    whole (n T, V) block held ~25 bytes a logit: ~30 GB at 16 x 512 rows of V = 151936): the
    same support as the sampler's rule on every row at once, each row's token always kept."""
    from fastrl.sampling import truncate_logits
    from fastrl.train import rollout as R

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 7, 300, generator=g) * 3
    tokens = torch.randint(0, 300, (3, 7), generator=g)
    monkeypatch.setattr("fastrl.chunked.CHUNK_BYTES", 4 * 300 * 4)  # 4 rows a chunk
    got = R.truncate_like_sampler(logits, tokens, 0.8, top_k, top_p)
    keep = torch.isfinite(truncate_logits(logits.reshape(-1, 300) / 0.8, top_k, top_p))
    keep.scatter_(1, tokens.reshape(-1, 1), True)
    torch.testing.assert_close(torch.isfinite(got), keep.view(3, 7, 300))
    torch.testing.assert_close(got[torch.isfinite(got)], logits[keep.view(3, 7, 300)])
