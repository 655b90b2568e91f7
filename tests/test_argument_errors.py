"""Arguments refused with an error that names them (from an audit of the public API as a new
user would call it), and config readers that read what they are given or refuse it: never the
defaults in place of a config they could not read (`loss_config_from_trl` used `getattr` only,
so a dict, None or a number gave TRL's defaults without a word)."""

import warnings

import pytest
import torch

import fastrl
from fastrl.integrations.trl import loss_config_from_trl
from fastrl.integrations.verl import loss_config_from_verl


def test_trl_reader_takes_a_mapping_of_grpo_config_fields():
    """A dict of GRPOConfig fields (e.g. `GRPOConfig.to_dict()`) reads as the config itself."""
    options = dict(loss_type="dr_grpo", epsilon=0.5, beta=0.1, max_completion_length=8)
    cfg = loss_config_from_trl(options)
    assert (cfg.clip_low, cfg.clip_high, cfg.kl_coef, cfg.max_len) == (0.5, 0.5, 0.1, 8)
    assert cfg.agg == "seq-mean-token-sum-norm"
    trl = pytest.importorskip("trl")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = trl.GRPOConfig(output_dir="unused", report_to=[], use_cpu=True, bf16=False,
                              **options)  # fmt: skip
    assert loss_config_from_trl(args) == cfg == loss_config_from_trl(args.to_dict())


def test_trl_reader_refuses_a_misspelt_key():
    pytest.importorskip("trl")  # (the known fields come from trl.GRPOConfig)
    with pytest.raises(ValueError, match=r"\['epsilone'\] are not trl.GRPOConfig fields"):
        loss_config_from_trl({"loss_type": "grpo", "epsilone": 0.3})


@pytest.mark.parametrize("bad", [None, 42, 0.2, "grpo"])
def test_readers_refuse_what_is_no_config(bad):
    with pytest.raises(ValueError, match="args must be a trl.GRPOConfig"):
        loss_config_from_trl(bad)
    with pytest.raises(ValueError, match="actor must be verl's actor config"):
        loss_config_from_verl(bad)


def test_trl_reader_defaults_are_trls():
    """What an absent option means (an object without the attribute, a dict without the key)
    is TRL's own default: `use_bias_correction_kl` absent read as False where TRL's is True,
    and vLLM's importance-sampling correction as off where TRL's is on."""
    trl = pytest.importorskip("trl")
    import dataclasses

    from fastrl.integrations.trl_config import _TRL_DEFAULTS

    fields = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    assert {k: fields[k] for k in _TRL_DEFAULTS} == _TRL_DEFAULTS
    cfg = loss_config_from_trl({"loss_type": "grpo", "beta": 0.04})
    assert cfg.kl_bias_correction  # TRL's default use_bias_correction_kl=True
    cfg = loss_config_from_trl({"use_vllm": True})
    assert (cfg.rollout_is, cfg.rollout_is_mode, cfg.rollout_is_cap) == ("sequence", "mask", 3.0)


def test_vocab_parallel_group_must_be_a_process_group():
    """group=1 ended in torch's "Default process group has not been initialized"."""
    h, w, t = torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,))
    with pytest.raises(ValueError, match="group must be a torch.distributed ProcessGroup"):
        fastrl.fused_linear_policy_loss(h, w, t, torch.randn(4), group=1)
    with pytest.raises(ValueError, match="group must be a torch.distributed ProcessGroup"):
        fastrl.linear_logprobs(h, w, t, group="world")


def test_a_bias_of_another_dtype_is_named_with_the_dtype_expected():
    h, w, t = torch.randn(4, 8), torch.randn(11, 8), torch.randint(0, 11, (4,))
    with pytest.raises(ValueError, match="bias must be a \\(11,\\) tensor of weight's dtype "
                       "torch.float32 on cpu, got .* torch.float64"):  # fmt: skip
        fastrl.linear_logprobs(h, w, t, bias=torch.zeros(11, dtype=torch.float64))


def test_cu_seqlens_on_another_device_is_named():
    """cu_seqlens on `meta` (standing in for another GPU) ended in "Tensor.item() cannot be
    called on meta tensors" from deep inside the packing."""
    logits, tokens = torch.randn(6, 11), torch.randint(0, 11, (6,))
    cu = torch.tensor([0, 3, 6], device="meta")
    with pytest.raises(ValueError, match="cu_seqlens is on meta: expected the CPU or the rows'"):
        fastrl.policy_loss(logits, tokens, torch.randn(6), cu_seqlens=cu)


@pytest.mark.parametrize("bad", ["yes", 1, None])
def test_flags_must_be_bools(bad):
    """logprobs(entropy="yes") returned (logp, H) for any truthy value."""
    with pytest.raises(ValueError, match="entropy must be a bool"):
        fastrl.logprobs(torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), entropy=bad)
    # policy_loss(inplace="False") overwrote the caller's logits, check_finite="no" checked,
    # linear_logprobs(entropy="False") returned (logp, H) (an audit helper's find)
    logits, tokens, adv = torch.randn(2, 3, 5), torch.zeros(2, 3, dtype=torch.long), torch.ones(2)
    for flag in ("inplace", "check_finite"):
        with pytest.raises(ValueError, match=f"{flag} must be a bool"):
            fastrl.policy_loss(logits.clone().requires_grad_(), tokens, adv, **{flag: bad})
    with pytest.raises(ValueError, match="entropy must be a bool"):
        fastrl.linear_logprobs(torch.randn(2, 3, 4), torch.randn(5, 4), tokens, entropy=bad)
    pytest.importorskip("verl")
    import fastrl.integrations.verl as fastrl_verl

    with pytest.raises(ValueError, match="losses must be a bool"):
        fastrl_verl.install(losses=bad)


def test_verl_loss_names_the_tensor_whose_shape_differs_in_verls_names():
    """A log_prob of (bs, response_length + 1) was reported as "advantages has shape (2, 3) ...
    expected (2,) or (2, 4)", in fastrl's names and about the wrong tensor."""
    pytest.importorskip("verl")
    from fastrl.integrations.verl import make_policy_loss

    loss = make_policy_loss("fastrl")
    B, T = 2, 3
    good = dict(old_log_prob=torch.zeros(B, T), log_prob=torch.zeros(B, T),
                advantages=torch.zeros(B, T), response_mask=torch.ones(B, T))  # fmt: skip
    cfg = {"clip_ratio": 0.2}
    for name, bad in (("log_prob", torch.zeros(B, T + 1)), ("advantages", torch.zeros(B)),
                      ("response_mask", torch.ones(B, T + 1))):  # fmt: skip
        expected = "old_log_prob must be like log_prob" if name == "log_prob" else name
        with pytest.raises(ValueError, match=expected):
            loss(**{**good, name: bad}, config=cfg)
    with pytest.raises(ValueError, match="rollout_is_weights must be like log_prob"):
        loss(**good, config=cfg, rollout_is_weights=torch.ones(B, T + 1))
