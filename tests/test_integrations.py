"""fastrl.integrations.trl: TRL GRPOConfig -> LossConfig, and what it refuses."""

from types import SimpleNamespace

import pytest
import torch

import fastrl
from fastrl.integrations.trl import loss_config_from_trl

trl = pytest.importorskip("trl")


def grpo_config(tmp_path, **kw):
    return trl.GRPOConfig(output_dir=str(tmp_path), report_to=[], bf16=False, use_cpu=True, **kw)


@pytest.mark.parametrize(
    "loss_type, policy, agg",
    [
        ("grpo", "ppo", "seq-mean-token-mean"),
        ("bnpo", "ppo", "token-mean"),
        ("dr_grpo", "ppo", "seq-mean-token-sum-norm"),
        ("dapo", "ppo", "token-mean"),
        ("sapo", "sapo", "seq-mean-token-mean"),
    ],
)
def test_loss_types(tmp_path, loss_type, policy, agg):
    args = grpo_config(
        tmp_path,
        loss_type=loss_type,
        epsilon=0.2,
        epsilon_high=0.28,
        beta=0.04,
        delta=1.5,
        temperature=0.7,
        max_completion_length=64,
    )
    cfg = loss_config_from_trl(args)
    assert (cfg.policy, cfg.agg) == (policy, agg)
    assert (cfg.clip_low, cfg.clip_high, cfg.clip_delta) == (0.2, 0.28, 1.5)
    assert (cfg.kl_coef, cfg.kl_estimator, cfg.temperature) == (0.04, "k3", 0.7)
    assert cfg.max_len == (64 if loss_type == "dr_grpo" else None)
    assert cfg.rollout_is is None  # use_vllm is off


def test_defaults_and_overrides(tmp_path):
    cfg = loss_config_from_trl(grpo_config(tmp_path), entropy_coef=0.01)
    assert cfg.agg == "token-mean" and cfg.clip_high == cfg.clip_low == 0.2  # TRL's dapo default
    assert cfg.kl_coef == 0.0 and not cfg.kl_bias_correction and cfg.entropy_coef == 0.01


def test_cispo_caps_the_ratio_at_epsilon_high(tmp_path):
    cfg = loss_config_from_trl(grpo_config(tmp_path, loss_type="cispo", epsilon_high=5.0))
    assert (cfg.policy, cfg.clip_low, cfg.clip_high) == ("cispo", 1.0, 4.0)
    # TRL: -clamp(r, max=5).detach() * A * logp; fastrl's clip(r, 1 - 1, 1 + 4) is the same
    logits = torch.zeros(1, 3, 4, requires_grad=True)
    old = torch.log(torch.tensor([[0.25 / 7.0, 0.25 / 2.0, 0.25]]))  # r = 7, 2, 1
    out = fastrl.policy_loss(
        logits, torch.zeros(1, 3, dtype=torch.long), torch.ones(1), old, config=cfg
    )
    expected = -(5.0 + 2.0 + 1.0) * torch.log(torch.tensor(0.25)) / 3
    torch.testing.assert_close(out.loss, expected)


def test_vllm_importance_sampling(tmp_path):
    args = SimpleNamespace(
        loss_type="grpo",
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="token_truncate",
        vllm_importance_sampling_clip_max=3.0,
        vllm_importance_sampling_clip_min=None,
    )
    cfg = loss_config_from_trl(args)
    assert (cfg.rollout_is, cfg.rollout_is_mode, cfg.rollout_is_cap) == ("token", "truncate", 3.0)


@pytest.mark.parametrize(
    "fields, option",
    [
        (dict(loss_type="luspo"), "loss_type"),
        (dict(loss_type="vespo"), "loss_type"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(top_entropy_quantile=0.2), "top_entropy_quantile"),
        (dict(loss_type="cispo", epsilon_high=0.28), "epsilon_high"),
        (
            dict(beta=0.04, use_bias_correction_kl=True, importance_sampling_level="sequence"),
            "use_bias_correction_kl",
        ),
        (
            dict(
                use_vllm=True,
                vllm_importance_sampling_correction=True,
                vllm_importance_sampling_mode="token_mask",
                vllm_importance_sampling_clip_min=0.5,
                vllm_importance_sampling_clip_max=2.0,
            ),
            "vllm_importance_sampling_clip_min",
        ),
    ],
)
def test_what_spec_cannot_express_raises(fields, option):
    with pytest.raises(ValueError, match=option):
        loss_config_from_trl(SimpleNamespace(**fields))


# ----------------------------------------------------------------------------------- verl
def test_verl_defaults_are_vanilla_dual_clip_token_mean():
    from fastrl.integrations.verl import loss_config_from_verl

    cfg = loss_config_from_verl({"clip_ratio": 0.2, "clip_ratio_c": 3.0, "entropy_coeff": 0})
    assert (cfg.policy, cfg.clip_low, cfg.clip_high, cfg.clip_dual) == ("ppo", 0.2, 0.2, 3.0)
    assert (cfg.agg, cfg.kl_coef, cfg.entropy_coef) == ("token-mean", 0.0, 0.0)


def test_verl_grpo_style_actor():
    from fastrl.integrations.verl import loss_config_from_verl

    actor = {
        "clip_ratio": 0.2,
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "loss_scale_factor": 512,
        "use_kl_loss": True,
        "kl_loss_coef": 0.001,
        "kl_loss_type": "k3",
        "entropy_coeff": 1e-3,
    }
    cfg = loss_config_from_verl(actor, temperature=0.6)
    assert (cfg.clip_high, cfg.agg, cfg.max_len) == (0.28, "seq-mean-token-sum-norm", 512)
    # verl's "k3" is its clamped estimator: SPEC's low_var_kl, not TRL's k3
    assert (cfg.kl_coef, cfg.kl_estimator) == (0.001, "low_var_kl")
    assert (cfg.entropy_coef, cfg.temperature) == (1e-3, 0.6)


@pytest.mark.parametrize(
    "loss_mode, policy, level, dual",
    [
        ("vanilla", "ppo", "token", 3.0),
        ("gspo", "ppo", "sequence", None),
        ("gpg", "reinforce", "token", None),
    ],
)
def test_verl_loss_modes(loss_mode, policy, level, dual):
    from fastrl.integrations.verl import loss_config_from_verl

    cfg = loss_config_from_verl({"policy_loss": {"loss_mode": loss_mode}})
    assert (cfg.policy, cfg.ratio_level, cfg.clip_dual) == (policy, level, dual)


@pytest.mark.parametrize(
    "actor, option",
    [
        ({"policy_loss": {"loss_mode": "clip_cov"}}, "loss_mode"),
        ({"use_kl_loss": True, "kl_loss_type": "full"}, "kl_loss_type"),
        ({"use_kl_loss": True, "kl_loss_type": "k3+"}, "kl_loss_type"),
    ],
)
def test_verl_what_spec_cannot_express_raises(actor, option):
    from fastrl.integrations.verl import loss_config_from_verl

    with pytest.raises(ValueError, match=option):
        loss_config_from_verl(actor)
