"""LossConfig validation and the input checks of `policy_loss` (fastrl/_inputs.py).

Every bad value must raise a ValueError whose message names the offending field or argument.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

import fastrl
from fastrl import reference
from fastrl.config import PRESETS, LossConfig, LossConfigError

IMPLS = {"reference": reference, "fastrl": fastrl}


@pytest.fixture(params=sorted(IMPLS))
def impl(request):
    return IMPLS[request.param]


BAD_FIELDS = [
    ("clip_dual", 1.0),
    ("clip_dual", 0.5),
    ("clip_dual", math.inf),
    ("temperature", 0.0),
    ("temperature", -1.0),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", "1.0"),
    ("policy", "grpo"),
    ("agg", "mean"),
    ("agg", "token_mean"),
    ("kl_estimator", "k4"),
    ("ratio_level", "seq"),
    ("rollout_is", "geometric"),
    ("rollout_is_mode", "clip"),
    ("kl_coef", -0.1),
    ("kl_coef", math.nan),
    ("kl_coef", 1e39),  # finite in Python, inf in fp32: the loss would be inf
    ("clip_high", 1e300),  # the clamp could not convert it (a RuntimeError)
    ("temperature", 1e39),  # z / inf = 0: a uniform softmax, silently
    ("num_seqs", 1e39),
    ("entropy_coef", -1e-3),
    ("clip_high", -0.1),
    ("clip_low", -0.1),
    ("clip_low", 1.5),
    ("clip_delta", 1.1),  # must exceed 1 + clip_high = 1.2
    ("num_tokens", 0),
    ("num_tokens", -3.0),
    ("num_seqs", 0),
    ("max_len", 0),
    ("max_len", 2.5),
    ("max_len", True),
    ("kl_bias_correction", 1),
    ("kl_bias_correction", "yes"),
    ("sapo_tau_pos", 0.0),
    ("sapo_tau_neg", -1.0),
    ("rollout_is_cap", 0.0),
]


@pytest.mark.parametrize("name,value", BAD_FIELDS, ids=[f"{n}={v!r}" for n, v in BAD_FIELDS])
def test_bad_field_raises_naming_it(name, value):
    with pytest.raises(ValueError, match=name):
        LossConfig(**{name: value})
    # the presets and replace() go through the same checks
    with pytest.raises(ValueError, match=name):
        LossConfig.grpo(**{name: value})
    with pytest.raises(ValueError, match=name):
        dataclasses.replace(LossConfig(), **{name: value})
    # ... and the error carries the field, the value and what was expected (the trainer names
    # the flag behind the field from them)
    with pytest.raises(LossConfigError) as info:
        LossConfig(**{name: value})
    e = info.value
    assert e.field == name and e.expected and e.expected in str(e)
    assert e.value is value or (
        isinstance(value, float) and math.isnan(value) and e.value != e.value
    )


def test_rollout_is_needs_a_cap():
    with pytest.raises(ValueError, match="rollout_is_cap"):
        LossConfig(rollout_is="token", rollout_is_cap=None)
    assert LossConfig(rollout_is="sequence", rollout_is_cap=3.0).rollout_is_cap == 3.0


def test_good_edge_values():
    LossConfig(clip_low=0.0)
    LossConfig(clip_low=1.0)
    LossConfig(clip_high=0.0)
    LossConfig(clip_dual=1.0001)
    LossConfig(temperature=1e-3)
    LossConfig(max_len=1, num_tokens=1, num_seqs=1)
    LossConfig(kl_bias_correction=True)


@pytest.mark.parametrize("name", PRESETS)
def test_preset_unknown_override(name):
    with pytest.raises(ValueError, match="bogus"):
        getattr(LossConfig, name)(bogus=1)
    with pytest.raises(ValueError, match="bogus"):
        LossConfig.preset(name, bogus=1)


def test_unknown_preset_name():
    with pytest.raises(ValueError, match="nope"):
        LossConfig.preset("nope")


def test_preset_overrides_apply():
    cfg = LossConfig.grpo(kl_coef=0.01, entropy_coef=1e-3)
    assert cfg.kl_coef == 0.01 and cfg.entropy_coef == 1e-3
    assert cfg.agg == "seq-mean-token-mean" and cfg.kl_estimator == "k3"
    cfg = LossConfig.dapo(clip_high=0.3)
    assert cfg.clip_high == 0.3 and cfg.clip_low == 0.2
    cfg = LossConfig.gspo(agg="token-mean")
    assert cfg.agg == "token-mean" and cfg.ratio_level == "sequence"
    cfg = LossConfig.cispo(clip_high=2.0)
    assert cfg.policy == "cispo" and cfg.clip_high == 2.0 and cfg.clip_low == 1.0
    assert LossConfig.preset("dr_grpo", max_len=64).max_len == 64


def test_default_is_ppo():
    assert LossConfig() == LossConfig.ppo()
    assert LossConfig() == LossConfig.preset("ppo")
    assert LossConfig() != LossConfig.grpo()
    cfg = LossConfig()
    assert (cfg.clip_low, cfg.clip_high, cfg.ratio_level, cfg.kl_coef, cfg.entropy_coef) == (
        0.2,
        0.2,
        "token",
        0.0,
        0.0,
    )
    assert cfg.temperature == 1.0 and cfg.agg == "token-mean"


def test_replace_revalidates():
    cfg = LossConfig.grpo()
    assert cfg.replace(kl_coef=0.5).kl_coef == 0.5
    with pytest.raises(ValueError, match="kl_coef"):
        cfg.replace(kl_coef=-1.0)
    with pytest.raises(ValueError, match="bogus"):
        cfg.replace(bogus=1)


def test_numpy_scalars_become_python_numbers():
    """numpy's scalars (np.float64 is a float subclass) are accepted and stored as Python's int /
    float: the custom ops rebuild the config from its repr, which 'np.float64(0.28)' was not."""
    np = pytest.importorskip("numpy")
    cfg = LossConfig.dapo(clip_high=np.float64(0.28), kl_coef=np.float32(0.5), max_len=np.int64(8))
    assert type(cfg.clip_high) is float and cfg.clip_high == 0.28
    assert type(cfg.kl_coef) is float and type(cfg.max_len) is int and cfg.max_len == 8
    z = torch.randn(B, T, V, requires_grad=True)
    y, adv, ref_logp = torch.randint(0, V, (B, T)), torch.randn(B, T), torch.randn(B, T) - 2
    out = fastrl.policy_loss(z, y, adv, ref_logp=ref_logp, config=cfg, num_tokens=np.float64(6))
    out.loss.backward()
    assert torch.isfinite(z.grad).all()
    with pytest.raises(ValueError, match="clip_high"):
        LossConfig(clip_high=np.float64("nan"))


# --------------------------------------------------------------------------- policy_loss inputs
B, T, V = 2, 3, 5


def good_inputs():
    return dict(
        logits=torch.randn(B, T, V),
        tokens=torch.randint(0, V, (B, T)),
        advantages=torch.randn(B),
        old_logp=torch.randn(B, T) - 2,
        ref_logp=torch.randn(B, T) - 2,
        mask=torch.ones(B, T),
    )


BAD_INPUTS = [
    ("logits", torch.randn(B, T)[0], "logits"),  # 1-D
    ("logits", torch.randn(B, T, V).double(), "logits"),
    ("logits", torch.randn(B, T, V).long(), "logits"),
    ("tokens", torch.randint(0, V, (B, T + 1)), "tokens"),
    ("tokens", torch.randint(0, V, (B, T)).float(), "tokens"),
    ("tokens", torch.full((B, T), V), "tokens"),
    ("tokens", torch.full((B, T), -1), "tokens"),
    ("advantages", torch.randn(B + 1), "advantages"),
    ("advantages", torch.randn(B, T + 1), "advantages"),
    ("advantages", torch.ones(B, dtype=torch.long), "advantages"),
    ("old_logp", torch.randn(B, T + 1), "old_logp"),
    ("old_logp", torch.randn(B * T), "old_logp"),
    ("old_logp", torch.ones(B, T, dtype=torch.long), "old_logp"),
    ("ref_logp", torch.randn(B, 1), "ref_logp"),
    ("mask", torch.ones(B, T + 1), "mask"),
    ("mask", torch.full((B, T), 3, dtype=torch.long), "mask"),
    ("mask", -torch.ones(B, T), "mask"),
]


@pytest.mark.parametrize(
    "arg,value,name", BAD_INPUTS, ids=[f"{a}-{i}" for i, (a, _, _) in enumerate(BAD_INPUTS)]
)
def test_bad_input_names_argument(impl, arg, value, name):
    kwargs = good_inputs()
    kwargs[arg] = value
    with pytest.raises(ValueError, match=name):
        impl.policy_loss(**kwargs, kl_coef=0.1)


def test_good_inputs_pass(impl):
    out = impl.policy_loss(**good_inputs(), kl_coef=0.1)
    assert torch.isfinite(out.loss)


def test_kl_without_ref(impl):
    kwargs = good_inputs()
    del kwargs["ref_logp"]
    with pytest.raises(ValueError, match="ref_logp"):
        impl.policy_loss(**kwargs, kl_coef=0.1)
    with pytest.raises(ValueError, match="ref_logp"):
        impl.policy_loss(**kwargs, config="grpo")
    impl.policy_loss(**kwargs)  # kl_coef = 0: fine without it


def test_rollout_is_without_rollout_logp(impl):
    with pytest.raises(ValueError, match="rollout_logp"):
        impl.policy_loss(**good_inputs(), rollout_is="token")
    with pytest.raises(ValueError, match="rollout_logp"):
        impl.policy_loss(**good_inputs(), rollout_logp=torch.randn(B, T))  # rollout_is None


@pytest.mark.parametrize(
    "opt,name",
    [
        (dict(ratio_level="sequence"), "ratio_level"),
        (dict(rollout_is="sequence"), "rollout_is"),
        (dict(agg="seq-mean-token-mean"), "agg"),
        (dict(agg="seq-mean-token-sum-norm"), "agg"),
        (dict(config="grpo"), "agg"),
    ],
)
def test_sequence_options_need_sequences(impl, opt, name):
    N = 6
    kwargs = dict(
        logits=torch.randn(N, V),
        tokens=torch.randint(0, V, (N,)),
        advantages=torch.randn(N),
        ref_logp=torch.randn(N) - 2,
    )
    if opt.get("rollout_is"):
        kwargs["rollout_logp"] = torch.randn(N) - 2
    with pytest.raises(ValueError, match=name):
        impl.policy_loss(**kwargs, **opt)
    # flat inputs are fine with token-level options
    kwargs.pop("rollout_logp", None)
    out = impl.policy_loss(**kwargs, kl_coef=0.1)
    assert out.logp.shape == (N,)
    out = impl.policy_loss(**kwargs, rollout_logp=kwargs["ref_logp"], rollout_is="token")
    assert out.logp.shape == (N,)


def test_bad_config_type_and_override(impl):
    with pytest.raises(ValueError, match="config"):
        impl.policy_loss(**good_inputs(), config=42)
    with pytest.raises(ValueError, match="bogus"):
        impl.policy_loss(**good_inputs(), bogus=1)
    with pytest.raises(ValueError, match="temperature"):
        impl.policy_loss(**good_inputs(), temperature=0.0)


def test_num_tokens_tensor_must_be_scalar(impl):
    with pytest.raises(ValueError, match="num_tokens"):
        impl.policy_loss(**good_inputs(), num_tokens=torch.ones(2))


@pytest.mark.parametrize("temperature", [0.0, -1.0, math.nan, math.inf])
def test_logprobs_bad_temperature(impl, temperature):
    kw = good_inputs()
    with pytest.raises(ValueError, match="temperature"):
        impl.logprobs(kw["logits"], kw["tokens"], temperature=temperature)


def test_logprobs_bad_tokens(impl):
    with pytest.raises(ValueError, match="tokens"):
        impl.logprobs(torch.randn(B, T, V), torch.full((B, T), V))
    with pytest.raises(ValueError, match="tokens"):
        impl.logprobs(torch.randn(B, T, V), torch.zeros(B, T + 1, dtype=torch.long))


@pytest.mark.parametrize("arg", ["tokens", "advantages", "old_logp", "ref_logp", "mask"])
def test_device_mismatch(impl, arg):
    # a second real device is not needed: a "meta" tensor is on another device than the CPU logits
    kwargs = good_inputs()
    kwargs[arg] = torch.empty_like(kwargs[arg], device="meta")
    with pytest.raises(ValueError, match=arg):
        impl.policy_loss(**kwargs, kl_coef=0.1)


def test_a_preset_name_is_made_once_and_shared():
    """resolve_config makes each named preset once (LossConfig is frozen: one instance serves
    every call) and never lets a call's overrides reach it."""
    from fastrl.config import resolve_config

    first = resolve_config("grpo", {})
    assert resolve_config("grpo", {}) is first and first == LossConfig.grpo()
    assert resolve_config(None, {}) is resolve_config("ppo", {}) == LossConfig()
    changed = resolve_config("grpo", {"kl_coef": 0.5})
    assert changed.kl_coef == 0.5 and first.kl_coef == 0.04 and changed is not first
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.kl_coef = 1.0
    with pytest.raises(ValueError, match="unknown LossConfig preset"):
        resolve_config("grpo2", {})
