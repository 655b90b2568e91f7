"""The two Triton paths of a token-separable policy loss. By default: the statistics kernel,
g_t = c_t dL_t/dlogp_t and h_t for every token in one O(N) kernel (`_token_grads_fwd_kernel`,
SPEC 1-4's derivative written in the kernel), the gradient kernel. With FASTRL_ONE_PASS=1: the
one-pass kernel (`_policy_loss_fwd_kernel`), one program per row doing all three. Both checked in
Triton's interpreter against the fp32 reference and against each other, over every policy, KL
estimator and option they serve, with log-ratios spread across every clip region; and which
kernels each case launches (a sequence-level loss: statistics, autograd of fastrl.terms,
gradient).
"""

from __future__ import annotations

import pytest
import torch
from fastrl.kernels import policy_loss as PL
from fastrl.kernels import policy_terms as PT
from test_kernels_compile import _as_launched
from test_policy_loss import assert_match, make_batch, run_both

import fastrl
from fastrl.config import resolve_config
from fastrl.terms import is_token_separable

pytestmark = pytest.mark.skipif(
    not __import__("conftest").INTERPRET, reason="needs TRITON_INTERPRET=1 (no CUDA)"
)

# every option the one-pass kernel serves (token-separable), with the batch's rollout_logp
# passed only where rollout_is asks for it
CASES = {
    "grpo": dict(config="grpo"),
    "dapo entropy": dict(config="dapo", entropy_coef=0.01),
    "dr_grpo": dict(config="dr_grpo"),
    "cispo": dict(config="cispo"),
    "sapo": dict(policy="sapo", sapo_tau_pos=2.0, sapo_tau_neg=0.5),
    "reinforce k1": dict(policy="reinforce", kl_coef=0.1, kl_estimator="k1"),
    "ppo abs": dict(kl_coef=0.1, kl_estimator="abs"),
    "ppo k2 token-sum": dict(kl_coef=0.1, kl_estimator="k2", agg="token-sum"),
    "ppo low_var_kl dual": dict(kl_coef=0.2, kl_estimator="low_var_kl", clip_dual=1.5),
    "ppo k3 bias delta": dict(kl_coef=0.1, kl_bias_correction=True, clip_delta=1.25),
    "grpo token IS truncate": dict(config="grpo", rollout_is="token", rollout_is_cap=1.1),
    "grpo token IS mask floor": dict(
        config="grpo",
        rollout_is="token",
        rollout_is_mode="mask",
        rollout_is_cap=1.2,
        rollout_is_floor=0.9,
    ),  # fmt: skip
    "ppo temperature": dict(temperature=0.7, clip_low=0.1, clip_high=0.3),
}


def _batch(B=3, T=8, V=37, dtype=torch.float32):
    """make_batch with old / ref log-probs placed so that log-ratios run from -0.6 to 0.6 over
    each sequence: every clip region (below, inside, above; dual clip; delta) has tokens, for
    positive and negative advantages."""
    batch = make_batch(B, T, V, dtype=dtype, rollout=True)
    from fastrl import reference as R

    logp, _ = R.token_logprobs(batch["logits"].float(), batch["tokens"])
    spread = torch.linspace(-0.6, 0.6, T).expand(B, T)  # each sequence: every region
    batch["old_logp"] = logp - spread
    batch["ref_logp"] = logp + spread.flip(-1)
    batch["advantages"] = torch.tensor([1.0, -1.5, 0.7])[:B]
    return batch


def _inputs(batch, case):
    kw = dict(CASES[case])
    if "rollout_is" not in kw:
        batch = {k: v for k, v in batch.items() if k != "rollout_logp"}
    return batch, kw


def _both_paths(batch, monkeypatch, **kw):
    """run_both (fused and reference outputs, gradients) with the one-pass kernel, then with
    the default path (statistics, token_grads, gradient)."""
    monkeypatch.setenv("FASTRL_ONE_PASS", "1")
    one = run_both(batch, **kw)
    monkeypatch.setenv("FASTRL_ONE_PASS", "0")
    two = run_both(batch, **kw)
    return one, two


@pytest.mark.parametrize("case", list(CASES))
def test_one_pass_matches_reference_and_two_pass(case, monkeypatch, launched):
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    batch, kw = _inputs(_batch(), case)
    cfg = resolve_config(kw.pop("config", None), kw)
    assert is_token_separable(cfg)
    one, two = _both_paths(batch, monkeypatch, config=cfg)
    assert_match(*one)
    assert_match(*two)
    # the two kernels paths agree to fp32 rounding: same loss, same gradient
    torch.testing.assert_close(one[2], two[2], rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(one[0].loss, two[0].loss, rtol=1e-6, atol=1e-7)
    names = {name for name, *_ in launched}
    assert {
        "_policy_loss_fwd_kernel",
        "_token_grads_fwd_kernel",
        "_token_stats_bwd_kernel",
    } <= names


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_one_pass_half_dtypes_inplace_and_row_temperature(dtype, monkeypatch):
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    batch, _ = _inputs(_batch(dtype=dtype), "grpo")
    tau = torch.linspace(0.5, 1.5, 24).view(3, 8)
    assert_match(*run_both(batch, config="dapo", entropy_coef=0.02, temperature=tau), dtype=dtype)
    assert_match(*run_both(batch, inplace=True, config="grpo"), dtype=dtype)


def test_one_pass_on_policy_and_packed(monkeypatch):
    """No old_logp (r = 1, pi_old = pi) and packed rows (cu_seqlens, per-sequence advantages)."""
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    batch, _ = _inputs(_batch(), "grpo")
    on_policy = {k: v for k, v in batch.items() if k != "old_logp"}
    assert_match(*run_both(on_policy, config="grpo", entropy_coef=0.01))
    N = 24
    flat = {k: v.reshape(N, -1).squeeze(-1) for k, v in batch.items() if k != "advantages"}
    adv = torch.tensor([0.5, -1.0, 2.0, 1.0])
    cu = torch.tensor([0, 5, 11, 20, 24])
    grads = []
    for one_pass in ("1", "0"):
        monkeypatch.setenv("FASTRL_ONE_PASS", one_pass)
        x = flat["logits"].clone().requires_grad_()
        rest = {k: v for k, v in flat.items() if k not in ("logits", "rollout_logp")}
        out = fastrl.policy_loss(x, **rest, advantages=adv, cu_seqlens=cu, config="dapo")
        out.loss.backward()
        grads.append((out.loss, x.grad))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=1e-5, atol=1e-7)
    assert grads[0][1].abs().sum() > 0


def test_which_kernels_run(monkeypatch, launched):
    """Token-separable losses: statistics, token_grads, gradient (with FASTRL_ONE_PASS=1 the
    one-pass kernel, except at split-V shapes: few rows, a long vocabulary); statistics, torch
    O(N) autograd, gradient for sequence-level options (GSPO) and rollout IS without old_logp
    (its weight depends on logp)."""
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    batch, _ = _inputs(_batch(), "grpo")

    def kernels(batch, **kw):
        launched.clear()
        x = batch["logits"].clone().requires_grad_()
        rest = {k: v for k, v in batch.items() if k != "logits"}
        fastrl.policy_loss(x, **rest, **kw).loss.backward()
        return [name for name, *_ in launched if name != "_scale_grad_kernel"]

    # every token-separable loss then has its per-token terms and metrics formed in one O(N)
    # kernel (ops.policy_output); a sequence-level one in torch
    terms = ["_policy_terms_fwd_kernel"]
    one_pass = ["_policy_loss_fwd_kernel", *terms]
    two_pass = ["_token_stats_fwd_kernel", "_token_stats_bwd_kernel"]
    default = ["_token_stats_fwd_kernel", "_token_grads_fwd_kernel", "_token_stats_bwd_kernel"]
    assert kernels(batch, config="grpo") == default + terms
    x, tokens = batch["logits"].clone().requires_grad_(), batch["tokens"]
    expected = (
        PL.row_stats_configs(24, 37, torch.float32, shift=True, skip=True)
        + PT.token_grads_configs(24)
        + PL.row_grad_configs(24, 37, torch.float32, False, has_shift=True)
        + PT.policy_terms_configs(24)
    )  # fmt: skip
    launched.clear()
    fastrl.policy_loss(x, tokens, batch["advantages"], batch["old_logp"], config="dapo")
    assert launched == _as_launched(expected)
    assert kernels(batch, config="gspo") == two_pass
    rollout = {k: v for k, v in _batch().items() if k != "old_logp"}
    assert kernels(rollout, config="grpo", rollout_is="token") == two_pass + terms
    monkeypatch.setenv("FASTRL_ONE_PASS", "0")
    assert kernels(batch, config="grpo") == default + terms
    monkeypatch.setenv("FASTRL_ONE_PASS", "1")
    assert kernels(batch, config="grpo") == one_pass
    expected = PL.policy_rows_configs(24, 37, torch.float32, False) + PT.policy_terms_configs(24)
    launched.clear()
    fastrl.policy_loss(x, tokens, batch["advantages"], batch["old_logp"], config="dapo")
    assert launched == _as_launched(expected)
    decode = make_batch(1, 2, 70000)  # 2 rows of 70000: split-V, then token_grads
    names = kernels(decode, config="grpo")
    assert names[0] == "_token_stats_split_fwd_kernel" and "_token_grads_fwd_kernel" in names
    monkeypatch.setenv("FASTRL_ONE_PASS", "yes")
    for config in ("grpo", "gspo"):  # refused whatever the loss
        with pytest.raises(ValueError, match="FASTRL_ONE_PASS"):
            kernels(batch, config=config)


def test_lm_head_path_runs_one_pass(monkeypatch, launched):
    """fused_linear_policy_loss on Triton with FASTRL_ONE_PASS=1: one one-pass launch per chunk
    of rows, the same result as the reference (and by default the three kernels per chunk)."""
    from test_fused_linear import compare
    from test_fused_linear import make as make_linear

    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    batch = make_linear(B=2, T=5, H=8, V=37)
    monkeypatch.setenv("FASTRL_ONE_PASS", "1")
    compare(batch, chunk_size=4, config="dapo", entropy_coef=0.01, kl_coef=0.05)
    names = [name for name, *_ in launched if name != "_scale_grad_kernel"]
    assert names and set(names) == {"_policy_loss_fwd_kernel", "_policy_terms_fwd_kernel"}
    monkeypatch.delenv("FASTRL_ONE_PASS")
    launched.clear()
    compare(batch, chunk_size=4, config="dapo", entropy_coef=0.01, kl_coef=0.05)
    names = {name for name, *_ in launched if name != "_scale_grad_kernel"}
    assert names == {"_token_stats_fwd_kernel", "_token_grads_fwd_kernel",
                     "_token_stats_bwd_kernel", "_policy_terms_fwd_kernel"}  # fmt: skip


@pytest.mark.parametrize("kw", [dict(config="dapo"), dict(kl_coef=0.1, kl_estimator="k1")])
def test_one_pass_minus_inf_logit_at_the_token(kw, monkeypatch):
    """A -inf logit at a counted token's own y (logp = -inf: a masked vocabulary entry that was
    sampled): the ratio's clamp keeps the loss and gradient finite, as in the reference (the
    kernels formed a 1 as 1 + 0 * x, NaN at x = inf: a NaN loss, and with k1 a NaN row)."""
    monkeypatch.setenv("FASTRL_BACKEND", "triton")
    batch, _ = _inputs(_batch(), "grpo")
    batch["logits"][0, 1, batch["tokens"][0, 1]] = float("-inf")
    batch["mask"][0, 1] = True
    fused, ref, grad_f, grad_r = run_both(batch, **kw)
    assert_match(fused, ref, grad_f, grad_r)
    assert torch.isfinite(grad_f).all() and torch.isfinite(fused.metrics["clipfrac"])
    if "kl_coef" not in kw:
        assert torch.isfinite(fused.loss)
