"""fastrl.integrations.trl: TRL GRPOConfig -> LossConfig, and what it refuses."""

from types import SimpleNamespace

import pytest
import torch

import fastrl
from fastrl import LossConfig
from fastrl._inputs import prepare_policy_inputs
from fastrl.integrations.trl import loss_config_from_trl
from fastrl.reference import aggregate, is_token_separable, token_terms

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
    # TRL applies delta to its PPO-style losses only (sapo / cispo ignore it)
    delta = 1.5 if policy == "ppo" else None
    assert (cfg.clip_low, cfg.clip_high, cfg.clip_delta) == (0.2, 0.28, delta)
    assert (cfg.kl_coef, cfg.kl_estimator, cfg.temperature) == (0.04, "k3", 0.7)
    assert cfg.max_len == (64 if loss_type == "dr_grpo" else None)
    assert cfg.rollout_is is None  # use_vllm is off


def test_delta_as_trl_uses_it(tmp_path):
    # cispo ignores delta in TRL: accepted, not applied (it was refused with clip_delta's name)
    args = grpo_config(tmp_path, loss_type="cispo", epsilon_high=5.0, delta=1.5)
    assert loss_config_from_trl(args).clip_delta is None
    # a delta inside the clip range is refused under TRL's own option name
    with pytest.raises(ValueError, match=r"TRL option delta=1.1 must be > 1 \+ epsilon_high"):
        loss_config_from_trl(grpo_config(tmp_path, loss_type="dapo", epsilon_high=0.28, delta=1.1))


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


def test_epsilon_high_defaults_to_epsilon(tmp_path):
    """TRL: epsilon_high=None means the upper clip is epsilon too (GRPOTrainer:
    `args.epsilon_high if args.epsilon_high is not None else args.epsilon`), whatever epsilon
    is, not the default 0.2; cispo's cap then is epsilon as well."""
    cfg = loss_config_from_trl(grpo_config(tmp_path, loss_type="dapo", epsilon=0.3))
    assert (cfg.clip_low, cfg.clip_high) == (0.3, 0.3)
    cfg = loss_config_from_trl(SimpleNamespace(loss_type="grpo", epsilon=0.1))
    assert (cfg.clip_low, cfg.clip_high) == (0.1, 0.1)
    cfg = loss_config_from_trl(SimpleNamespace(loss_type="cispo", epsilon=3.0))
    assert (cfg.clip_low, cfg.clip_high) == (1.0, 2.0)


def test_cispo_cap_of_one_is_accepted():
    """CISPO's cap epsilon_high may be 1 (TRL: clamp(r, max=1), the ratio never above 1): the
    cap must be >= 1, so 1 itself maps to clip(r, 0, 1 + 0), i.e. clip_high = 0; only a cap
    below 1 is refused. The loss by hand: ratios 2 and 0.5 are capped to 1 and kept at 0.5."""
    args = SimpleNamespace(loss_type="cispo", epsilon_high=1.0)
    cfg = loss_config_from_trl(args)
    assert (cfg.policy, cfg.clip_low, cfg.clip_high) == ("cispo", 1.0, 0.0)
    logits = torch.zeros(1, 2, 4, requires_grad=True)  # logp = log 1/4 for every token
    old = torch.log(torch.tensor([[0.25 / 2.0, 0.25 / 0.5]]))  # r = 2, 0.5
    out = fastrl.policy_loss(logits, torch.zeros(1, 2, dtype=torch.long), torch.ones(1), old,
                             config=cfg)  # fmt: skip
    expected = -(1.0 + 0.5) * torch.log(torch.tensor(0.25)) / 2
    torch.testing.assert_close(out.loss, expected)
    with pytest.raises(ValueError, match="epsilon_high"):
        loss_config_from_trl(SimpleNamespace(loss_type="cispo", epsilon_high=0.99))


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
        (dict(loss_type="vespo"), "loss_type"),
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(top_entropy_quantile=0.2), "top_entropy_quantile"),
        (dict(top_entropy_quantile=0.0), "top_entropy_quantile"),  # TRL: the top token only
        (dict(loss_type="cispo", epsilon_high=0.28), "epsilon_high"),
        (dict(loss_type="dapo", entropy_coef=0.01), "entropy_coef"),
        (dict(loss_type="grpo", entropy_coef=0.01), "entropy_coef"),
        (dict(loss_type="bnpo", use_adaptive_entropy=True), "use_adaptive_entropy"),
        (
            dict(
                use_vllm=True,
                vllm_importance_sampling_correction=True,
                vllm_importance_sampling_mode="token_mask",
                vllm_importance_sampling_clip_min=0.5,
                vllm_importance_sampling_clip_max=None,
            ),
            "vllm_importance_sampling_clip_max",
        ),
    ],
)
def test_what_spec_cannot_express_raises(fields, option):
    with pytest.raises(ValueError, match=option):
        loss_config_from_trl(SimpleNamespace(**fields))


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(loss_type="dr_grpo", max_completion_length=None), "TRL option max_completion_length"),
        (dict(loss_type="dr_grpo", max_completion_length=0), "TRL option max_completion_length"),
        (dict(epsilon=1.5), "TRL option epsilon gives LossConfig.clip_low=1.5"),
        (dict(epsilon_high=-0.1), "TRL option epsilon_high .* gives LossConfig.clip_high=-0.1"),
        (dict(beta=-1.0), "TRL option beta gives LossConfig.kl_coef=-1.0"),
        (dict(temperature=0.0), "TRL option temperature gives LossConfig.temperature=0.0"),
    ],
)
def test_bad_trl_values_are_named_as_trl_options(fields, message):
    """A TRL value fastrl cannot take is refused naming the TRL option (dr_grpo without a
    max_completion_length was a bare TypeError of int(None); epsilon = 1.5 was named as
    LossConfig.clip_low)."""
    with pytest.raises(ValueError, match=message):
        loss_config_from_trl(SimpleNamespace(**fields))
    # a LossConfig field the caller overrides is named as that field
    with pytest.raises(ValueError, match="^LossConfig.clip_low=1.5"):
        loss_config_from_trl(SimpleNamespace(), clip_low=1.5)


def test_gspo_with_beta_weights_the_kl_by_the_sequence_ratio(tmp_path):
    # TRL's default use_bias_correction_kl=True multiplies the KL by coef_1, the sequence ratio
    args = grpo_config(tmp_path, loss_type="grpo", importance_sampling_level="sequence", beta=0.04)
    cfg = loss_config_from_trl(args)
    assert (cfg.ratio_level, cfg.kl_bias_correction, cfg.kl_bias_ratio) == (
        "sequence",
        True,
        "sequence",
    )
    assert not is_token_separable(cfg)
    token = loss_config_from_trl(grpo_config(tmp_path, beta=0.04))
    assert (token.kl_bias_correction, token.kl_bias_ratio) == (True, "token")


def test_entropy_coef_maps_for_bnpo_and_luspo_maps(tmp_path):
    cfg = loss_config_from_trl(grpo_config(tmp_path, loss_type="bnpo", entropy_coef=0.01))
    assert (cfg.agg, cfg.entropy_coef) == ("token-mean", 0.01)
    luspo = loss_config_from_trl(
        grpo_config(tmp_path, loss_type="luspo", importance_sampling_level="sequence")
    )
    assert (luspo.policy, luspo.agg, luspo.ratio_level) == ("ppo", "seq-mean-token-sum", "sequence")


def test_vllm_clip_min_is_the_rollout_is_floor():
    args = SimpleNamespace(
        loss_type="grpo",
        use_vllm=True,
        vllm_importance_sampling_correction=True,
        vllm_importance_sampling_mode="sequence_mask",
        vllm_importance_sampling_clip_max=2.0,
        vllm_importance_sampling_clip_min=0.5,
    )
    cfg = loss_config_from_trl(args)
    assert (cfg.rollout_is, cfg.rollout_is_mode) == ("sequence", "mask")
    assert (cfg.rollout_is_floor, cfg.rollout_is_cap) == (0.5, 2.0)


# ------------------------------------------------------------------- new LossConfig options
def _terms(logp, cfg, A, old=None, ref=None, mask=None, rollout=None):
    x = prepare_policy_inputs(None, None, A, old, ref, mask, rollout, cfg, {}, per_token=logp)
    return x, token_terms(logp, torch.zeros_like(logp), x)


@pytest.mark.parametrize(
    "mode, expected",
    [("truncate", [0.5, 0.5, 1.0, 2.0]), ("mask", [0.0, 0.5, 1.0, 0.0])],
)
def test_rollout_is_floor(mode, expected):
    # w = exp(old - roll) = 0.25, 0.5, 1, 4 with [C_min, C] = [0.5, 2]
    old = torch.zeros(1, 4)
    roll = -torch.log(torch.tensor([[0.25, 0.5, 1.0, 4.0]]))
    cfg = LossConfig(policy="reinforce", rollout_is="token", rollout_is_cap=2.0,
                     rollout_is_floor=0.5, rollout_is_mode=mode)  # fmt: skip
    logp = torch.full((1, 4), -1.0, requires_grad=True)
    _, t = _terms(logp, cfg, torch.ones(1), old=old, rollout=roll)
    torch.testing.assert_close(t.is_weight, torch.tensor([expected]))
    torch.testing.assert_close(t.is_over_cap, torch.tensor([[1.0, 0.0, 0.0, 1.0]]))
    torch.testing.assert_close(t.per_token_loss, torch.tensor([expected]))  # -w A logp


def test_token_sum_aggregation():
    L = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert aggregate(L, m, "token-sum").item() == 7.0


def test_seq_ratio_grad_token_is_gspo_token():
    # value: the sequence ratio; gradient: -A_t r_i for its own token (verl's GSPO), instead of
    # -(1/|y|) sum_s A_s r_i through the mean (TRL)
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -0.6]])
    A = torch.tensor([[1.0, -2.0, 0.5]])
    r = torch.exp((logp.detach() - old).mean())
    grads = {}
    for grad in ("mean", "token"):
        cfg = LossConfig(ratio_level="sequence", seq_ratio_grad=grad, clip_low=0.5, clip_high=0.5,
                         agg="token-sum")  # fmt: skip
        _, t = _terms(logp, cfg, A, old=old)
        torch.testing.assert_close(t.ratio, r.expand(1, 3))
        (grads[grad],) = torch.autograd.grad(t.per_token_loss.sum(), logp)
    torch.testing.assert_close(grads["token"], -A * r)
    torch.testing.assert_close(grads["mean"], (-(A.sum()) * r / 3).expand(1, 3))


def test_kl_bias_ratio_sequence_is_trl_coef_1():
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9, -0.7]])
    ref = torch.tensor([[-1.3, -1.5, -0.2]])
    cfg = LossConfig(ratio_level="sequence", kl_coef=0.1, kl_bias_correction=True,
                     kl_bias_ratio="sequence")  # fmt: skip
    _, t = _terms(logp, cfg, torch.zeros(1), old=old, ref=ref)
    # TRL: per_token_kl * coef_1 with coef_1 = exp(mean(logp - old)), differentiable
    coef_1 = torch.exp((logp - old).mean())
    expected = (torch.exp(ref - logp) - (ref - logp) - 1) * coef_1
    torch.testing.assert_close(t.kl, expected)
    (g1,) = torch.autograd.grad(t.kl.sum(), logp, retain_graph=True)
    (g2,) = torch.autograd.grad(expected.sum(), logp)
    torch.testing.assert_close(g1, g2)


def test_new_options_validated_and_separability():
    for field, value, msg in [
        ("seq_ratio_grad", "token", "seq_ratio_grad"),
        ("kl_bias_ratio", "seq", "kl_bias_ratio"),
        ("rollout_is_floor", -0.1, "rollout_is_floor"),
        ("rollout_is_floor", 3.0, "rollout_is_floor"),  # above the cap 2.0
        ("agg", "token-total", "agg"),
    ]:
        with pytest.raises(ValueError, match=msg):
            LossConfig(**{field: value})
    assert is_token_separable(LossConfig(agg="token-sum", rollout_is="token", rollout_is_floor=0.5))
    assert not is_token_separable(LossConfig(ratio_level="sequence", seq_ratio_grad="token"))
    seq_kl = LossConfig(kl_coef=0.1, kl_bias_correction=True, kl_bias_ratio="sequence")
    assert not is_token_separable(seq_kl)
    assert is_token_separable(seq_kl.replace(kl_coef=0.0))


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
    "loss_mode, policy, level, dual, grad",
    [
        ("vanilla", "ppo", "token", 3.0, "mean"),
        ("fastrl", "ppo", "token", 3.0, "mean"),
        ("gspo", "ppo", "sequence", None, "token"),
        ("fastrl_gspo", "ppo", "sequence", None, "token"),
        ("gpg", "reinforce", "token", None, "mean"),
        ("cispo", "cispo", "token", None, "mean"),
        ("sapo", "sapo", "token", None, "mean"),
    ],
)
def test_verl_loss_modes(loss_mode, policy, level, dual, grad):
    from fastrl.integrations.verl import loss_config_from_verl

    actor = {"policy_loss": {"loss_mode": loss_mode}, "loss_agg_mode": "token-sum",
             "tau_pos": 0.9, "tau_neg": 1.2}  # fmt: skip
    cfg = loss_config_from_verl(actor)
    assert (cfg.policy, cfg.ratio_level, cfg.clip_dual) == (policy, level, dual)
    assert cfg.seq_ratio_grad == grad
    # verl's sapo aggregates seq-mean-token-mean whatever loss_agg_mode says
    assert cfg.agg == ("seq-mean-token-mean" if policy == "sapo" else "token-sum")
    assert (cfg.sapo_tau_pos, cfg.sapo_tau_neg) == (0.9, 1.2)


@pytest.mark.parametrize(
    "actor, option",
    [
        ({"policy_loss": {"loss_mode": "clip_cov"}}, "loss_mode"),
        ({"policy_loss": {"loss_mode": "geo_mean"}}, "loss_mode"),
        ({"policy_loss": {"loss_mode": "bypass_mode"}}, "loss_mode"),
        ({"use_kl_loss": True, "kl_loss_type": "full"}, "kl_loss_type"),
        ({"use_kl_loss": True, "kl_loss_type": "k3+"}, "kl_loss_type"),
    ],
)
def test_verl_what_spec_cannot_express_raises(actor, option):
    from fastrl.integrations.verl import loss_config_from_verl

    with pytest.raises(ValueError, match=option):
        loss_config_from_verl(actor)


@pytest.mark.parametrize(
    "actor, option",
    [
        ({"clip_ratio_c": 1.0}, "verl option clip_ratio_c gives LossConfig.clip_dual=1.0"),
        ({"loss_scale_factor": 0}, "verl option loss_scale_factor gives LossConfig.max_len=0"),
        ({"policy_loss": {"loss_mode": "sapo"}, "tau_pos": 0.0}, "verl option tau_pos"),
        ({"use_kl_loss": True, "kl_loss_coef": -1.0}, "verl option kl_loss_coef"),
        ({"entropy_coeff": -0.1}, "verl option entropy_coeff"),
        # int() would truncate it, where verl's agg_loss divides by 1.5 as given
        ({"loss_scale_factor": 1.5}, r"verl loss_scale_factor=1.5 must be a whole number"),
        ({"loss_scale_factor": "many"}, r"verl loss_scale_factor='many' must be a whole number"),
    ],
)
def test_verl_bad_values_name_the_verl_option(actor, option):
    """An invalid verl value is reported under the verl option the user set (as the TRL
    reader does), not only as the LossConfig field it becomes."""
    from fastrl.integrations.verl import loss_config_from_verl

    with pytest.raises(ValueError, match=option):
        loss_config_from_verl(actor)
    assert loss_config_from_verl({"loss_scale_factor": 512.0}).max_len == 512
