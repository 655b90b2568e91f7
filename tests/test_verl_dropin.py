"""fastrl.integrations.verl.install() against verl's own code (verl 0.9.1, installed with
--no-deps; skipped without it): every registered `fastrl*` loss mode equals verl's mode in loss,
gradient and metrics; verl's `ppo_loss` (workers/utils/losses.py) trains a tiny model to the same
parameters with fastrl installed (its log-probs / entropies on fastrl's ops, through verl's
`logprobs_from_logits` / `entropy_from_logits` or its fused `FusedLinearForPPO` path) as with
verl's own; `uninstall()` restores verl."""

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("verl.trainer.ppo.core_algos", exc_type=ImportError)
pytest.importorskip("verl.workers.utils.losses", exc_type=ImportError)

import verl.utils.torch_functional as verl_F  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils import tensordict_utils as tu  # noqa: E402
from verl.utils.experimental.torch_functional import FusedLinearForPPO  # noqa: E402
from verl.workers.config import FSDPActorConfig, PolicyLossConfig  # noqa: E402
from verl.workers.utils.losses import ppo_loss  # noqa: E402

import fastrl  # noqa: E402
import fastrl.integrations.verl as fastrl_verl  # noqa: E402
from fastrl.train.rollout import default_model  # noqa: E402

MODES = ["vanilla", "gspo", "sapo", "cispo", "gpg"]
AGGS = ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum",
        "seq-mean-token-sum-norm"]  # fmt: skip


@pytest.fixture
def installed():
    modes = fastrl_verl.install()
    yield modes
    fastrl_verl.uninstall()


def actor_config(mode: str, **kw) -> FSDPActorConfig:
    base = dict(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        policy_loss=PolicyLossConfig(loss_mode=mode),
    )
    base.update(kw)
    return FSDPActorConfig(**base)


def fastrl_mode(mode: str) -> str:
    return "fastrl" if mode == "vanilla" else f"fastrl_{mode}"


def test_install_registers_and_uninstall_restores():
    original = verl_F.logprobs_from_logits
    assert fastrl_verl.install() == list(fastrl_verl.FASTRL_MODES)
    try:
        assert set(fastrl_verl.FASTRL_MODES) <= set(core_algos.POLICY_LOSS_REGISTRY)
        assert verl_F.logprobs_from_logits is not original
    finally:
        fastrl_verl.uninstall()
    assert verl_F.logprobs_from_logits is original
    assert not set(fastrl_verl.FASTRL_MODES) & set(core_algos.POLICY_LOSS_REGISTRY)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", AGGS)
def test_policy_loss_modes_equal_verl(mode, agg, installed):
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    mask = torch.rand(B, T, generator=g) > 0.2
    mask[2] = False  # a fully masked sequence (verl's seq-mean counts only non-empty ones)
    advantages = torch.randn(B, T, generator=g)  # per token: GSPO-token's gradient shows
    old = -2 * torch.rand(B, T, generator=g)
    weights = 2 * torch.rand(B, T, generator=g)
    weights[0, :3] = 0  # rollout correction that rejects tokens
    new = old + 0.3 * torch.randn(B, T, generator=g)
    new[1, 0], mask[1, 0] = old[1, 0] - 25.0, True  # beyond verl's +-20 clamp (and its ppo_kl's)
    infos = [{}, dict(dp_size=2, batch_num_tokens=70, global_batch_size=12)]
    for info in infos:
        for w in (None, weights):
            config = actor_config(mode, loss_agg_mode=agg)
            config.global_batch_info.update(info)
            results = []
            for name in (mode, fastrl_mode(mode)):
                logp = new.clone().requires_grad_()
                loss, metrics = core_algos.get_policy_loss_fn(name)(
                    old_log_prob=old, log_prob=logp, advantages=advantages,
                    response_mask=mask, loss_agg_mode=agg, config=config,
                    rollout_is_weights=w,
                )  # fmt: skip
                (grad,) = torch.autograd.grad(loss, logp)
                results.append((loss.detach(), grad, metrics))
            (theirs, g1, m1), (ours, g2, m2) = results
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
            assert m2.keys() == m1.keys()
            for k in m1:
                assert m2[k] == pytest.approx(m1[k], abs=1e-6), (mode, agg, info, k)
            assert g1.abs().sum() > 0


def _both_losses(mode, agg, info, installed, B=4, T=6, **config_fields):
    """[(loss, grad) or the ValueError] of verl's `mode` and fastrl's, on one batch, with
    `info` in config.global_batch_info."""
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[1] = False
    advantages = torch.randn(B, T, generator=g)
    old = -2 * torch.rand(B, T, generator=g)
    new = old + 0.3 * torch.randn(B, T, generator=g)
    results = []
    for name in (mode, fastrl_mode(mode)):
        config = actor_config(mode, loss_agg_mode=agg, **config_fields)
        config.global_batch_info.update(info)
        logp = new.clone().requires_grad_()
        try:
            loss, _ = core_algos.get_policy_loss_fn(name)(
                old_log_prob=old, log_prob=logp, advantages=advantages, response_mask=mask,
                loss_agg_mode=agg, config=config,
            )  # fmt: skip
        except ValueError as e:
            results.append(e)
            continue
        results.append((loss.detach(), torch.autograd.grad(loss, logp)[0]))
    return results


@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
@pytest.mark.parametrize("low", [1.0, 1.5])
def test_a_lower_clip_ratio_of_one_or_more_reads_as_verl(mode, low, installed):
    """verl accepts clip_ratio_low >= 1 (a lower bound 1 - c <= 0, which a ratio > 0 never
    reaches): fastrl reads it as no lower clip, clip_low = 1, and equals verl (1.5 was refused
    with an error about LossConfig.clip_low, a field verl users never set)."""
    (theirs, g1), (ours, g2) = _both_losses(mode, "token-mean", {}, installed, B=5, T=7,
                                            clip_ratio_low=low, clip_ratio_high=0.28)  # fmt: skip
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g2, g1, rtol=1e-5, atol=1e-6)
    assert fastrl_verl.loss_config_from_verl(actor_config(mode, clip_ratio_low=low)).clip_low == 1


def test_registered_sapo_reads_the_actor_taus(installed):
    """The registered fastrl_sapo takes tau_pos / tau_neg from verl's actor config, as verl's
    sapo does: with taus other than the defaults (0.8 / 2.0) loss and gradient equal verl's."""
    theirs, ours = _both_losses("sapo", "seq-mean-token-mean", {}, installed, tau_pos=0.8,
                                tau_neg=2.0)  # fmt: skip
    default, _ = _both_losses("sapo", "seq-mean-token-mean", {}, installed)
    assert not torch.allclose(theirs[0], default[0])  # the taus matter on this batch
    torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("agg", AGGS)
def test_a_micro_batch_with_nothing_counted_adds_zero(mode, agg, installed):
    """A micro-batch whose response mask is all 0 (no global counts given): nothing is counted,
    so the registered loss is 0 with a zero gradient (Σ m L = 0 over a count floored above 0).
    verl's own modes give 0 / 0 = NaN here, which would poison the accumulated gradient."""
    g = torch.Generator().manual_seed(0)
    B, T = 3, 4
    old = -torch.rand(B, T, generator=g)
    logp = (old + 0.1 * torch.randn(B, T, generator=g)).requires_grad_()
    mask = torch.zeros(B, T, dtype=torch.bool)
    loss, _ = core_algos.get_policy_loss_fn(fastrl_mode(mode))(
        old_log_prob=old, log_prob=logp, advantages=torch.randn(B, T, generator=g),
        response_mask=mask, loss_agg_mode=agg, config=actor_config(mode, loss_agg_mode=agg),
    )  # fmt: skip
    assert loss.item() == 0.0
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(grad, torch.zeros_like(grad))


# verl's agg_loss needs the global counts once dp_size > 1: without them it raises (a local count
# times dp_size would make the gradient dp_size times too large); fastrl raised nothing.
@pytest.mark.parametrize("mode", MODES)
def test_dp_size_without_global_counts_raises_as_verl(mode, installed):
    raised = 0
    for agg in AGGS:
        for info in (
            dict(dp_size=2),
            dict(dp_size=2, batch_num_tokens=30),
            dict(dp_size=2, global_batch_size=8),
            dict(dp_size=2, batch_num_tokens=None, global_batch_size=None),
        ):
            theirs, ours = _both_losses(mode, agg, info, installed)
            if isinstance(theirs, ValueError):
                raised += 1
                missing = "batch_num_tokens" if "batch_num_tokens" in str(theirs) else None
                missing = missing or "global_batch_size"
                assert missing in str(theirs)
                assert isinstance(ours, ValueError), (mode, agg, info, ours)
                assert missing in str(ours) and "dp_size" in str(ours), (mode, agg, info)
            else:
                assert not isinstance(ours, ValueError), (mode, agg, info, ours)
                torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-6)
                torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-6)
    assert raised > 0


# verl's agg_loss reads loss_scale_factor from config.global_batch_info (verl's ppo_loss copies
# the actor's loss_scale_factor there), not from config.loss_scale_factor; fastrl read the latter
# (with only config.loss_scale_factor=100: verl -0.01898 (T = 6), fastrl -0.001139).
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
def test_loss_scale_factor_read_as_verl(mode, installed):
    # (config.loss_scale_factor, global_batch_info["loss_scale_factor"]); (100, 100) is what
    # verl's ppo_loss passes
    for actor_factor, info_factor in [(100, None), (None, 4), (100, 4), (100, 100), (None, None)]:
        info = {} if info_factor is None else {"loss_scale_factor": info_factor}
        theirs, ours = _both_losses(
            mode, "seq-mean-token-sum-norm", info, installed, loss_scale_factor=actor_factor
        )
        case = (mode, actor_factor, info_factor)
        torch.testing.assert_close(ours[0], theirs[0], rtol=1e-5, atol=1e-7, msg=str(case))
        torch.testing.assert_close(ours[1], theirs[1], rtol=1e-5, atol=1e-8, msg=str(case))
        assert theirs[1].abs().sum() > 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("use_kl_loss", [False, True])
def test_an_actor_config_left_out_reads_as_verl_defaults(mode, use_kl_loss):
    """`loss_config_from_verl` of a dict that names only the loss mode equals the LossConfig of
    verl's own actor config with every field at verl's default (FSDPActorConfig: clip ratios
    0.2, clip_ratio_c 3.0, token-mean, tau_pos / tau_neg 1.0 / 1.05, kl_loss_coef 0.001,
    low_var_kl): a field a user leaves out means what it means in verl."""
    # (sapo with a KL term needs seq-mean-token-mean: refused with verl's default token-mean)
    kw = dict(use_kl_loss=use_kl_loss)
    if mode == "sapo" and use_kl_loss:
        kw["loss_agg_mode"] = "seq-mean-token-mean"
    verl_defaults = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1,
                                    policy_loss=PolicyLossConfig(loss_mode=mode), **kw)  # fmt: skip
    bare = {"policy_loss": {"loss_mode": mode}, **kw}
    want = fastrl_verl.loss_config_from_verl(verl_defaults)
    assert fastrl_verl.loss_config_from_verl(bare) == want
    if use_kl_loss:
        assert want.kl_coef == verl_defaults.kl_loss_coef > 0
    if mode == "sapo":
        assert (want.sapo_tau_pos, want.sapo_tau_neg) == (verl_defaults.tau_pos,
                                                          verl_defaults.tau_neg)  # fmt: skip


def test_refused_loss_modes():
    for mode in ("clip_cov", "kl_cov", "geo_mean", "dro", "dppo_tv", "dppo_kl", "bypass_mode"):
        with pytest.raises(ValueError, match="loss_mode"):
            fastrl_verl.loss_config_from_verl({"policy_loss": {"loss_mode": mode}})


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
@pytest.mark.parametrize("mode", ["sapo", "vanilla"])
def test_loss_config_from_verl_with_kl_and_entropy(mode, agg):
    """`loss_config_from_verl` with use_kl_loss and entropy_coeff: fastrl's loss equals verl's
    policy term + entropy and KL terms, each aggregated as verl's ppo_loss does (its own
    functions). verl's sapo policy term ignores loss_agg_mode while its KL and entropy terms
    follow it; one LossConfig.agg cannot say both, so sapo with another agg is refused."""
    g = torch.Generator().manual_seed(0)
    B, T = 4, 8
    logp = (torch.randn(B, T, generator=g) * 0.5 - 2).requires_grad_()
    ent = (torch.rand(B, T, generator=g) * 2).requires_grad_()
    old = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    ref = logp.detach() + 0.3 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, 1, generator=g).expand(B, T).contiguous()
    mask = torch.ones(B, T, dtype=torch.bool)
    mask[0, 2:] = False
    mask[1, 5:] = False
    actor = actor_config(mode, loss_agg_mode=agg, use_kl_loss=True, kl_loss_coef=0.5,
                         kl_loss_type="low_var_kl", entropy_coeff=0.1)  # fmt: skip
    if mode == "sapo" and agg != "seq-mean-token-mean":
        with pytest.raises(ValueError, match="loss_agg_mode"):
            fastrl_verl.loss_config_from_verl(actor)
        return
    pg, _ = core_algos.get_policy_loss_fn(mode)(
        old_log_prob=old, log_prob=logp, advantages=adv, response_mask=mask,
        loss_agg_mode=agg, config=actor,
    )  # fmt: skip
    kl = core_algos.agg_loss(core_algos.kl_penalty(logp, ref, "low_var_kl"), mask, agg)
    want = pg - 0.1 * core_algos.agg_loss(ent, mask, agg) + 0.5 * kl
    cfg = fastrl_verl.loss_config_from_verl(actor)
    got = fastrl.policy_loss_from_logprobs(logp, ent, adv, old, ref, mask, config=cfg).loss
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_kernels_routed_to_fastrl(installed, monkeypatch):
    calls = []
    for name in ("logprobs", "linear_logprobs"):
        real = getattr(fastrl, name)

        def counting(*a, _real=real, _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(fastrl, name, counting)
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 5, 40, generator=g, requires_grad=True)
    labels = torch.randint(0, 40, (3, 5), generator=g)
    hidden = torch.randn(3, 5, 16, generator=g, requires_grad=True)
    weight = torch.randn(40, 16, generator=g, requires_grad=True)

    def outputs():
        return [
            verl_F.logprobs_from_logits(logits, labels),
            verl_F.entropy_from_logits(logits),
            verl_F.entropy_from_logits_with_chunking(logits.reshape(15, 40), chunk_size=4),
            *FusedLinearForPPO().forward(hidden, weight, labels, temperature=0.7),
        ]

    ours = outputs()
    assert calls == ["logprobs", "logprobs", "logprobs", "linear_logprobs"]
    fastrl_verl.uninstall()
    theirs = outputs()
    fastrl_verl.install()
    for a, b in zip(ours, theirs):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    weights = [torch.randn(o.shape, generator=g) for o in ours]
    grads = [torch.autograd.grad(sum((o * w).sum() for o, w in zip(out, weights)),
                                 [logits, hidden, weight]) for out in (ours, theirs)]  # fmt: skip
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_fused_linear_for_ppo_returns_verl_dtypes_in_half_precision(installed):
    """verl's FusedLinearForPPO returns fp32 log-probs and the entropy in the hidden states'
    dtype; routed to fastrl it does the same in bf16 (verl's own, uninstalled, is the oracle of
    the dtypes, and of the values to bf16's rounding), not an fp32 entropy where verl's callers
    hold a bf16 one."""
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(2, 5, 16, generator=g).bfloat16()
    weight = (torch.randn(40, 16, generator=g) / 4).bfloat16()
    labels = torch.randint(0, 40, (2, 5), generator=g)
    ours = FusedLinearForPPO().forward(hidden, weight, labels, temperature=0.7)
    fastrl_verl.uninstall()
    try:
        theirs = FusedLinearForPPO().forward(hidden, weight, labels, temperature=0.7)
    finally:
        fastrl_verl.install()
    assert [t.dtype for t in ours] == [t.dtype for t in theirs] == [torch.float32, torch.bfloat16]
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a.float(), b.float(), rtol=2e-2, atol=2e-2)


def test_modules_that_imported_a_routed_name_are_patched_and_restored():
    """install() routes verl's functions in every verl module that imported them by name (a
    `from verl.utils.torch_functional import logprobs_from_logits` holds its own reference):
    such a module calls fastrl's after install() and verl's again after uninstall()."""
    import types

    module = types.ModuleType("verl._fastrl_import_by_name")
    module.logprobs_from_logits = original = verl_F.logprobs_from_logits
    module.entropy_from_logits = original_entropy = verl_F.entropy_from_logits
    sys.modules[module.__name__] = module
    try:
        fastrl_verl.install()
        try:
            assert module.logprobs_from_logits is verl_F.logprobs_from_logits is not original
            assert module.entropy_from_logits is verl_F.entropy_from_logits
            assert module.entropy_from_logits is not original_entropy
        finally:
            fastrl_verl.uninstall()
        assert module.logprobs_from_logits is original
        assert module.entropy_from_logits is original_entropy
    finally:
        del sys.modules[module.__name__]


def test_triton_fused_backend_routed_to_fastrl(installed, monkeypatch):
    """verl's `fused_kernel_options.impl_backend="triton"`: its HF models' forward
    (`forward_with_triton_backend`) calls `verl.utils.kernel.linear_cross_entropy`, verl's Triton
    fused LM head. Installed, it runs on fastrl.linear_logprobs: verl's own forward of a tiny
    Qwen2 gives the log-probs, entropies and gradients of the model's logits; with a process
    group (Megatron's tensor parallel) verl's kernel is still the one called."""
    import verl.utils.kernel.linear_cross_entropy as lce
    from verl.models.transformers.dense_common import forward_with_triton_backend

    calls = []
    real = fastrl.linear_logprobs

    def counting(*a, **k):
        calls.append(a[0].shape)
        return real(*a, **k)

    monkeypatch.setattr(fastrl, "linear_logprobs", counting)
    model = default_model(48, seed=0, hidden=32, layers=2)
    model.config.use_cache = False
    batch = _batch(48)
    input_ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    am = batch["attention_mask"]
    kw = dict(input_ids=input_ids, attention_mask=am, position_ids=(am.cumsum(-1) - 1).clamp(min=0))
    out = forward_with_triton_backend(model, **kw, return_dict=True, temperature=0.7)
    assert calls == [(input_ids.numel(), 32)]
    ls = torch.log_softmax(model(**kw).logits.double() / 0.7, -1)
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    want = (ls.gather(-1, labels[..., None])[..., 0], -(ls.exp() * ls).sum(-1))
    g = torch.Generator().manual_seed(2)
    weights = [torch.randn(input_ids.numel(), generator=g, dtype=torch.float64) for _ in want]
    grads = []
    for got in ((out.log_probs, out.entropy), [w.reshape(-1) for w in want]):
        assert got[0].shape == got[1].shape == (input_ids.numel(),)
        total = sum((v.double() * w).sum() for v, w in zip(got, weights))
        grads.append(torch.autograd.grad(total, [model.lm_head.weight]))
    for a, b in zip((out.log_probs, out.entropy), want):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b.reshape(-1), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(grads[0][0].double(), grads[1][0].double(), rtol=1e-4, atol=1e-5)
    seen = []  # with a process group verl's own kernel runs
    monkeypatch.setitem(fastrl_verl._ORIGINALS, fastrl_verl._LCE, lambda *a: seen.append(a) or 7)
    assert lce.linear_cross_entropy(out.log_probs, None, None, 1.0, "none", object()) == 7
    assert len(seen) == 1 and len(calls) == 1
    # so it does for a reduced loss ("mean" / "sum": one number, which fastrl's per-token
    # log-probs and entropies are not), with or without a process group
    for reduction in ("mean", "sum", "MEAN"):
        assert lce.linear_cross_entropy(out.log_probs, None, None, 1.0, reduction) == 7
    assert len(seen) == 4 and len(calls) == 1
    monkeypatch.undo()
    fastrl_verl.uninstall()
    assert (
        lce.linear_cross_entropy == lce.LinearCrossEntropy.apply
    )  # (a new bound method each time)
    fastrl_verl.install()


# ------------------------------------------------------------- training with verl's ppo_loss
def _batch(vocab: int, seed: int = 0):
    """A verl-style padded batch: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    B, P, R = 6, 4, 7
    prompts = torch.randint(3, vocab, (B, P), generator=g)
    responses = torch.randint(3, vocab, (B, R), generator=g)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_mask[4, :1] = 0
    response_mask = torch.ones(B, R, dtype=torch.long)
    response_mask[0, 5:] = 0
    response_mask[3, 2:] = 0
    prompts = prompts * prompt_mask
    responses = responses * response_mask
    return dict(
        prompts=prompts,
        responses=responses,
        attention_mask=torch.cat([prompt_mask, response_mask], 1),
        response_mask=response_mask,
        advantages=torch.randn(B, R, generator=g) * response_mask,
        rollout_is_weights=(0.5 + torch.rand(B, R, generator=g)) * response_mask,
    )


def _model_output(model, batch, fused: bool):
    """verl's no-padding log-probs / entropies: (total_nnz,) over every real token, position i
    scoring token i + 1, through verl's logprobs_from_logits / entropy_from_logits, or its fused
    FusedLinearForPPO on the hidden states (use_fused_kernels)."""
    input_ids = torch.cat([batch["prompts"], batch["responses"]], 1)
    am = batch["attention_mask"]
    position_ids = (am.cumsum(-1) - 1).clamp(min=0)
    labels = torch.roll(input_ids, shifts=-1, dims=-1)
    real = am.bool()
    if fused:
        hidden = model.model(input_ids=input_ids, attention_mask=am, position_ids=position_ids)
        log_probs, entropy = FusedLinearForPPO().forward(
            hidden.last_hidden_state[real], model.lm_head.weight, labels[real]
        )
        return {"log_probs": log_probs, "entropy": entropy}
    logits = model(input_ids=input_ids, attention_mask=am, position_ids=position_ids).logits
    return {
        "log_probs": verl_F.logprobs_from_logits(logits[real], labels[real]),
        "entropy": verl_F.entropy_from_logits(logits[real]),
    }


def _train(mode: str, fused: bool, steps: int = 3):
    model = default_model(48, seed=0, hidden=32, layers=2)
    model.config.use_cache = False
    batch = _batch(48)
    with torch.no_grad():
        out = _model_output(model, batch, fused)
        td = tu.get_tensordict({k: batch[k] for k in ("prompts", "responses", "attention_mask")})
        old = verl_padded(out["log_probs"], td)
    config = actor_config(
        mode, loss_agg_mode="seq-mean-token-mean", use_kl_loss=True, kl_loss_coef=0.05,
        kl_loss_type="low_var_kl", entropy_coeff=0.01,
    )  # fmt: skip
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    for _ in range(steps):
        data = tu.get_tensordict(
            {**batch, "old_log_probs": old, "ref_log_prob": old - 0.05},
            {"dp_size": 1, "batch_num_tokens": None, "global_batch_size": None},
        )
        loss, _ = ppo_loss(config, _model_output(model, batch, fused), data)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return before, [p.detach().clone() for p in model.parameters()]


def verl_padded(values, td):
    from verl.workers.utils.padding import no_padding_2_padding

    return no_padding_2_padding(values, td)


@pytest.mark.parametrize("fused", [False, True], ids=["logits", "fused_linear"])
@pytest.mark.parametrize("mode", ["vanilla", "gspo", "cispo"])
def test_ppo_loss_training_equals_verl(mode, fused, monkeypatch):
    before, theirs = _train(mode, fused)
    calls = []
    for name in ("logprobs", "linear_logprobs"):
        real = getattr(fastrl, name)
        monkeypatch.setattr(fastrl, name, lambda *a, _r=real, **k: calls.append(1) or _r(*a, **k))
    fastrl_verl.install()
    try:
        start, ours = _train(fastrl_mode(mode), fused)
    finally:
        fastrl_verl.uninstall()
    assert calls, "fastrl's ops did not run"
    assert all(torch.equal(a, b) for a, b in zip(before, start))
    update = torch.cat([(b - a).flatten() for a, b in zip(before, theirs)]).norm()
    diff = torch.cat([(b - a).flatten() for a, b in zip(theirs, ours)]).norm()
    assert update > 0.05, f"verl's own run barely moved ({update:.3g})"
    assert diff / update <= 1e-4, f"relative update difference {diff / update:.3g}"


def test_ray_workers_install_through_verl_external_modules():
    code = (
        "import verl, verl.utils.torch_functional as F\n"
        "from verl.trainer.ppo import core_algos\n"
        "assert F.logprobs_from_logits.__module__ == 'fastrl.integrations.verl'\n"
        "assert 'fastrl_gspo' in core_algos.POLICY_LOSS_REGISTRY\n"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_MODULES": "fastrl.integrations.verl"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
