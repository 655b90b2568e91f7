"""The integrations' config readers read what they are given, or refuse it: never the defaults
in place of a config they could not read (`loss_config_from_trl` used `getattr` only, so a
dict, None or a number gave TRL's defaults without a word)."""

import warnings

import pytest

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
