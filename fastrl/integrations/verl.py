"""verl: fastrl in a verl run by one call, and the `LossConfig` of a verl actor config.

    import fastrl.integrations.verl as fastrl_verl
    fastrl_verl.install()          # before verl builds its workers / engines
    # then, in the verl config:  actor_rollout_ref.actor.policy_loss.loss_mode=fastrl
    #                            (or fastrl_gspo, fastrl_sapo, fastrl_cispo, fastrl_gpg)

`install()` does two things (verl stays an optional dependency: only `install` imports it):

1. registers fastrl's policy loss in verl's policy-loss registry
   (`verl.trainer.ppo.core_algos.register_policy_loss`) as `fastrl` (= verl's `vanilla`, the
   dual-clip PPO) and `fastrl_<mode>` for verl's gspo / sapo / cispo / gpg. The loss is SPEC 1-5
   (`fastrl.policy_loss_from_logprobs`, the per-token math fastrl's kernels are checked
   against) with `loss_config_from_verl(actor)`, verl's normalisers (`global_batch_info`:
   dp_size, batch_num_tokens, global_batch_size, loss_scale_factor) and verl's precomputed
   `rollout_is_weights` (verl's rollout correction) multiplying each token's policy term as in
   verl. verl adds its own KL and entropy terms around it, as for its built-in modes.
2. routes verl's logits -> log-prob / entropy computation to fastrl's ops:
   `verl.utils.torch_functional.logprobs_from_logits` -> `fastrl.logprobs`,
   `entropy_from_logits` / `entropy_from_logits_with_chunking` -> `fastrl.logprobs(...,
   entropy=True)`, and the fused-kernel path (`use_fused_kernels=True`: its "torch" and
   "liger" backends' `verl.utils.experimental.torch_functional.FusedLinearForPPO`, its
   "triton" backend's `verl.utils.kernel.linear_cross_entropy`, single-device: with
   Megatron's tensor-parallel group verl's kernel runs) -> `fastrl.linear_logprobs`
   (hidden states and lm_head weight in, (B, T, V) logits never held). Modules that imported
   these names already are patched too; engines that cached them (verl's FSDP engine keeps
   `compute_entropy_from_logits`) must be built after `install()`; their default
   torch.compile(dynamic=True) of it then traces fastrl's op (symbolic shapes, tested). Log-probs
   and entropies come back in fp32 (verl's own log-probs follow the logits' dtype).

verl runs its workers in Ray processes: set `VERL_USE_EXTERNAL_MODULES=fastrl.integrations.verl`
in their environment (verl imports the listed modules when it is imported; this module then
calls `install()` itself), e.g. through `ray_kwargs.ray_init.runtime_env.env_vars`.

`loss_config_from_verl(actor)` alone gives the LossConfig for `fastrl.policy_loss`:

    cfg = loss_config_from_verl(config.actor_rollout_ref.actor)   # a DictConfig or a dict
    out = fastrl.policy_loss(response_logits, responses, advantages, old_log_prob,
                             ref_log_prob, response_mask, config=cfg)

SPEC.md follows verl's names and clamps (loss_agg_mode, the dual clip `clip_ratio_c`, the +-20
ratio clamp, low_var_kl), so this mostly renames:

    clip_ratio / clip_ratio_low / clip_ratio_high -> clip_low / clip_high
    clip_ratio_c                                   -> clip_dual (policy_loss.loss_mode vanilla)
    loss_agg_mode (token-mean, token-sum,
                   seq-mean-token-mean / -sum / -sum-norm) -> agg (loss_scale_factor -> max_len)
    use_kl_loss, kl_loss_coef, kl_loss_type        -> kl_coef, kl_estimator
    entropy_coeff                                  -> entropy_coef
    tau_pos / tau_neg                              -> sapo_tau_pos / sapo_tau_neg
    policy_loss.loss_mode vanilla                  -> ppo + dual clip
                          gspo                     -> ppo, sequence ratio, seq_ratio_grad="token"
                          sapo                     -> sapo, agg seq-mean-token-mean (verl's sapo
                                                      ignores loss_agg_mode)
                          cispo                    -> cispo (clip_ratio_low / _high)
                          gpg                      -> reinforce

verl's kl_loss_type names differ from SPEC's: verl's "k3" is the clamped low_var_kl (SPEC's
`low_var_kl`), "kl" is k1 and "mse" is k2. What SPEC cannot express raises a ValueError naming
the option: the loss modes clip_cov, kl_cov, geo_mean, dro, dppo_tv, dppo_kl and bypass_mode,
the "full" KL and the straight-through "+" KL variants. verl's GSPO clamps the sequence
log-ratio at +10 rather than +-20: where a sequence's ratio is above e^10, the value differs
and so does the gradient (verl's clamp cuts that sequence's gradient to 0; fastrl's sends it
through in full, e^10 times the advantage and more). verl's seq-mean modes count only
sequences with a counted token when no global batch size is given (the registered loss passes
that count); its `token-sum` and the others are multiplied by dp_size (done by the registered
loss; `fastrl.policy_loss` users pass global counts divided by dp_size). With dp_size > 1 verl
requires the global count (batch_num_tokens for token-mean, global_batch_size
for the seq-mean modes): the registered loss raises a ValueError naming it, as verl does.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

from ..config import LossConfig
from .trl_config import config_from_options

_KL_TYPES = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2"}
_KL_TYPES.update({"low_var_kl": "low_var_kl", "k3": "low_var_kl"})
# verl loss_mode -> (policy, ratio_level)
_LOSS_MODES = {
    "vanilla": ("ppo", "token"),
    "gspo": ("ppo", "sequence"),
    "sapo": ("sapo", "token"),
    "cispo": ("cispo", "token"),
    "gpg": ("reinforce", "token"),
}
FASTRL_MODES = ("fastrl",) + tuple(f"fastrl_{m}" for m in _LOSS_MODES if m != "vanilla")


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, Mapping) or hasattr(cfg, "get"):
        value = cfg.get(key, default)
    else:
        value = getattr(cfg, key, default)
    return default if value is None else value


def _base_mode(loss_mode: str) -> str:
    """`fastrl` -> `vanilla`, `fastrl_gspo` -> `gspo`; verl's own names unchanged."""
    if loss_mode == "fastrl":
        return "vanilla"
    if loss_mode.startswith("fastrl_"):
        return loss_mode[len("fastrl_") :]
    return loss_mode


# LossConfig fields -> the verl actor option each comes from (its errors name that option)
_VERL_OPTIONS = {
    "clip_low": "clip_ratio_low (clip_ratio when unset)",
    "clip_high": "clip_ratio_high (clip_ratio when unset)",
    "clip_dual": "clip_ratio_c",
    "agg": "loss_agg_mode",
    "entropy_coef": "entropy_coeff",
    "sapo_tau_pos": "tau_pos",
    "sapo_tau_neg": "tau_neg",
    "max_len": "loss_scale_factor",
    "kl_coef": "kl_loss_coef",
}


def loss_config_from_verl(actor: Any, *, loss_mode: str | None = None, **overrides: Any):
    """LossConfig equal to verl's actor loss for `actor` (a mapping / DictConfig / dataclass
    with verl's actor fields). `loss_mode` replaces `actor.policy_loss.loss_mode` (`fastrl` and
    `fastrl_<mode>` read as verl's `vanilla` / `<mode>`); `overrides` are LossConfig fields
    applied last (e.g. `temperature`, `num_tokens`).

    With a seq-mean loss_agg_mode, verl divides by the sequences that have a counted token
    (when no global batch size is given); a LossConfig without `num_seqs` divides by every
    row of the batch, empty ones included. Where a batch may hold an empty row, pass
    `num_seqs=(mask.sum(-1) > 0).sum()` (the registered loss `fastrl*` does)."""
    if actor is None or isinstance(actor, (str, bytes, int, float, bool)):
        raise ValueError(
            f"actor must be verl's actor config (a mapping, DictConfig or dataclass with its "
            f"fields, e.g. config.actor_rollout_ref.actor), got {type(actor).__name__} {actor!r}"
        )
    clip = _get(actor, "clip_ratio", 0.2)
    if loss_mode is None:
        loss_mode = _get(_get(actor, "policy_loss", {}), "loss_mode", "vanilla")
    mode = _base_mode(loss_mode)
    if mode not in _LOSS_MODES:
        raise ValueError(
            f"verl policy_loss.loss_mode={loss_mode!r} has no fastrl equivalent; supported: "
            f"{sorted(_LOSS_MODES)} (and {list(FASTRL_MODES)} once installed)"
        )
    policy, level = _LOSS_MODES[mode]
    agg = _get(actor, "loss_agg_mode", "token-mean")
    fields: dict[str, Any] = dict(
        policy=policy,
        ratio_level=level,
        # a ratio is > 0, so verl's lower bound 1 - c <= 0 never binds for c >= 1: that is
        # SPEC's clip_low = 1 (in [0, 1]: no lower clip), where verl accepts any c
        clip_low=min(float(_get(actor, "clip_ratio_low", clip)), 1.0),
        clip_high=float(_get(actor, "clip_ratio_high", clip)),
        clip_dual=float(_get(actor, "clip_ratio_c", 3.0)) if mode == "vanilla" else None,
        # verl's sapo aggregates seq-mean-token-mean whatever loss_agg_mode says
        agg="seq-mean-token-mean" if mode == "sapo" else agg,
        entropy_coef=float(_get(actor, "entropy_coeff", 0.0)),
        sapo_tau_pos=float(_get(actor, "tau_pos", 1.0)),
        sapo_tau_neg=float(_get(actor, "tau_neg", 1.05)),
    )
    if mode == "gspo":  # verl: log r_t = sg(log r_i) + logp_t - sg(logp_t)
        fields["seq_ratio_grad"] = "token"
    scale = _get(actor, "loss_scale_factor")
    if scale is not None:
        try:
            whole = not isinstance(scale, bool) and float(scale).is_integer()
        except (TypeError, ValueError):
            whole = False
        if not whole:  # (int() would truncate it: verl's agg_loss divides by it as given)
            raise ValueError(
                f"verl loss_scale_factor={scale!r} must be a whole number of tokens (verl types "
                "it Optional[int]; fastrl's max_len divides by that integer)"
            )
        fields["max_len"] = int(scale)
    if _get(actor, "use_kl_loss", False):
        kl_type = _get(actor, "kl_loss_type", "low_var_kl")
        if kl_type not in _KL_TYPES:
            raise ValueError(
                f"verl kl_loss_type={kl_type!r} has no fastrl equivalent; supported: "
                f"{sorted(_KL_TYPES)}"
            )
        fields.update(kl_coef=float(_get(actor, "kl_loss_coef", 0.001)),
                      kl_estimator=_KL_TYPES[kl_type])  # fmt: skip
    fields.update(overrides)
    extra = {k: fields[k] for k in ("kl_coef", "entropy_coef") if fields.get(k)}
    if mode == "sapo" and agg != "seq-mean-token-mean" and extra and "agg" not in overrides:
        # verl's ppo_loss aggregates its KL and entropy terms with loss_agg_mode, and only the
        # sapo policy term with seq-mean-token-mean: one LossConfig.agg cannot say both
        raise ValueError(
            f"verl's sapo loss with loss_agg_mode={agg!r} and {extra} has no single fastrl "
            "LossConfig: verl aggregates the sapo policy term seq-mean-token-mean whatever "
            "loss_agg_mode says, but its KL and entropy terms with loss_agg_mode. Set "
            "loss_agg_mode='seq-mean-token-mean', or use the registered loss_mode='fastrl_sapo' "
            "(verl then adds its own KL and entropy terms)"
        )
    # (an invalid value named as the verl option it came from)
    return config_from_options(fields, overrides, _VERL_OPTIONS, "verl")


# ============================================================================ registered loss
def _verl_counts(agg: str, mask: Tensor, info: Mapping) -> tuple[dict, float]:
    """verl's `agg_loss` normalisers as fastrl counts: ({num_tokens / num_seqs}, the factor
    dp_size the aggregated loss is multiplied by). As verl, the local count stands in for a
    missing global one only when dp_size is 1; with dp_size > 1 that is a ValueError (verl's)."""
    dp = int(info.get("dp_size") or 1)
    counts: dict[str, Any] = {}
    if agg == "token-mean":
        tokens = info.get("batch_num_tokens")
        if tokens is None and dp > 1:
            raise ValueError(
                f"loss_agg_mode='token-mean' with dp_size={dp} > 1 needs the global token count "
                "global_batch_info['batch_num_tokens'] (verl: (global) batch_num_tokens is "
                "required when dp_size > 1)"
            )
        counts["num_tokens"] = mask.sum() if tokens is None else tokens
    elif agg.startswith("seq-mean"):
        seqs = info.get("global_batch_size")
        if seqs is None and dp > 1:
            raise ValueError(
                f"loss_agg_mode={agg!r} with dp_size={dp} > 1 needs the global sequence count "
                "global_batch_info['global_batch_size'] (verl: global_batch_size is required "
                "when dp_size > 1)"
            )
        counts["num_seqs"] = (mask.sum(-1) > 0).sum() if seqs is None else seqs
    counts = {
        k: torch.as_tensor(v, dtype=torch.float32, device=mask.device).reshape(()).clamp(min=1e-20)
        for k, v in counts.items()
    }
    return counts, float(dp)


def make_policy_loss(loss_mode: str = "fastrl"):
    """A verl policy-loss function (verl's `PolicyLossFn` signature) computing SPEC 1-5 with
    the LossConfig of verl's actor config for `loss_mode`, verl's normalisers and its
    precomputed `rollout_is_weights`. Returns (loss, metrics) with verl's metric names."""
    from ..losses import policy_loss_from_logprobs

    base = _base_mode(loss_mode)
    if base not in _LOSS_MODES:
        raise ValueError(f"loss_mode={loss_mode!r}: expected one of {list(FASTRL_MODES)}")

    def fastrl_policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Any]]:
        """verl policy loss `loss_mode` by fastrl: log_prob / old_log_prob / advantages /
        response_mask / rollout_is_weights (B, T). KL and entropy are verl's (kl_coef =
        entropy_coef = 0 here); rollout_is_weights w >= 0 multiply the policy term, which is
        positively homogeneous in A for every SPEC policy, so w_t ℓ_t(A_t) = ℓ_t(w_t A_t)."""
        if config is None:
            raise ValueError("the fastrl verl policy loss needs verl's actor config (config=)")
        _check_like_log_prob(
            log_prob,
            old_log_prob=old_log_prob,
            advantages=advantages,
            response_mask=response_mask,
            rollout_is_weights=rollout_is_weights,
        )
        agg = "seq-mean-token-mean" if base == "sapo" else loss_agg_mode
        info = dict(_get(config, "global_batch_info", {}) or {})
        counts, scale = _verl_counts(agg, response_mask, info)
        # the policy term only: verl adds its KL and entropy terms itself. verl's agg_loss reads
        # loss_scale_factor from global_batch_info (its ppo_loss copies the actor's there), not
        # from the actor config
        actor = {**_actor_fields(config), "use_kl_loss": False}
        if info.get("loss_scale_factor") is not None:
            actor["loss_scale_factor"] = info["loss_scale_factor"]
        cfg = loss_config_from_verl(actor, loss_mode=base, agg=agg, entropy_coef=0.0)
        weighted = advantages
        if rollout_is_weights is not None:
            weighted = advantages * rollout_is_weights.detach()
        out = policy_loss_from_logprobs(
            log_prob, None, weighted, old_log_prob, None, response_mask, None, cfg, **counts
        )
        return out.loss * scale, _verl_metrics(base, out, old_log_prob, response_mask,
                                               advantages, cfg)  # fmt: skip

    fastrl_policy_loss.__name__ = f"fastrl_policy_loss_{base}"
    return fastrl_policy_loss


def _check_like_log_prob(log_prob: Tensor, **others: Tensor | None) -> None:
    """ValueError, in verl's names, unless log_prob is a (bs, response_length) tensor and each
    of `others` (None: not given) a tensor of its shape on its device."""
    from .._inputs import describe

    if not isinstance(log_prob, Tensor) or log_prob.dim() != 2:
        raise ValueError(
            f"log_prob must be a (bs, response_length) tensor, got {describe(log_prob)}"
        )
    for name, t in others.items():
        if t is not None and (
            not isinstance(t, Tensor) or t.shape != log_prob.shape or t.device != log_prob.device
        ):
            raise ValueError(
                f"{name} must be like log_prob {tuple(log_prob.shape)} on {log_prob.device}, "
                f"got {describe(t)}"
            )


def _actor_fields(config: Any) -> dict:
    """The actor fields `loss_config_from_verl` reads, from an ActorConfig / DictConfig / dict."""
    keys = ("clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c", "loss_agg_mode",
            "tau_pos", "tau_neg")  # fmt: skip
    return {k: _get(config, k) for k in keys if _get(config, k) is not None}


def _verl_metrics(base: str, out, old_logp: Tensor, mask: Tensor, A: Tensor, cfg: LossConfig):
    """verl's pg metrics with verl's meaning: pg_clipfrac (share of counted tokens whose clipped
    term wins; for cispo the share whose ratio is clipped; 0 for sapo), ppo_kl (mean of
    old - logp, clamped to +-20 as verl does but for gspo), pg_clipfrac_lower (share where the
    dual clip bites; 0 but for vanilla), from the loss output `out` (its per-token ratio and
    logp), verl's old_logp and response mask and its advantages A (B, T) before the rollout IS
    weights."""
    from ..terms import LOG_RATIO_CLAMP, masked_mean

    if base == "gpg":
        return {}
    with torch.no_grad():
        mask, ratio = mask.float(), out.ratio
        A = A.detach().float().expand_as(mask)
        zero = torch.zeros((), device=mask.device)
        if base == "sapo":
            clipfrac = zero
        elif base == "cispo":
            clipped = (ratio < 1 - cfg.clip_low) | (ratio > 1 + cfg.clip_high)
            clipfrac = masked_mean(clipped.float(), mask)
        else:
            high = (A > 0) & (ratio > 1 + cfg.clip_high)
            low = (A < 0) & (ratio < 1 - cfg.clip_low)
            clipfrac = masked_mean((high | low).float(), mask)
        log_ratio = out.logp - old_logp.float()
        if base != "gspo":  # verl clamps it (+-20) for these modes, not for gspo
            log_ratio = log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        ppo_kl = masked_mean(-log_ratio, mask)
        lower = zero
        if base == "vanilla":
            pg = torch.maximum(-A * ratio, -A * ratio.clamp(1 - cfg.clip_low, 1 + cfg.clip_high))
            lower = masked_mean(((A < 0) & (pg > -A * cfg.clip_dual)).float(), mask)
    return {
        "actor/pg_clipfrac": clipfrac.item(),
        "actor/ppo_kl": ppo_kl.item(),
        "actor/pg_clipfrac_lower": lower.item(),
    }


# ============================================================================ kernel routing
_ORIGINALS: dict[tuple[str, str], Any] = {}


def _logprobs_from_logits(logits: Tensor, labels: Tensor, inplace_backward: bool = True):
    """verl's `logprobs_from_logits` (logits (..., V), labels (...)) on `fastrl.logprobs`:
    fp32 log-probs shaped like labels, one streaming pass, no (N, V) copy for the backward."""
    import fastrl

    shape = labels.shape
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return fastrl.logprobs(logits, labels.reshape(-1).long()).view(shape)


def _entropy_from_logits(logits: Tensor, chunk_size: int | None = None):
    """verl's `entropy_from_logits` / `entropy_from_logits_with_chunking` on `fastrl.logprobs(
    ..., entropy=True)` (fp32, shaped like logits without V; already chunked)."""
    import fastrl

    shape = logits.shape[:-1]
    flat = logits.reshape(-1, logits.shape[-1])
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    tokens = torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device)
    return fastrl.logprobs(flat, tokens, entropy=True)[1].view(shape)


def _fused_linear_for_ppo_forward(self, hidden_states, vocab_weights, input_ids, temperature=1.0):
    """verl's `FusedLinearForPPO.forward` on `fastrl.linear_logprobs`: (log_probs fp32,
    entropy in the hidden states' dtype, as verl returns them), never holding the logits."""
    import fastrl

    log_probs, entropy = fastrl.linear_logprobs(
        hidden_states, vocab_weights.to(hidden_states.dtype), input_ids.long(),
        temperature=float(temperature), entropy=True,
    )  # fmt: skip
    return log_probs, entropy.to(hidden_states.dtype)


_LCE = ("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy")


def _linear_cross_entropy(hidden, weight, labels, temperature=1.0, reduction="none",
                          dist_process_group=None):  # fmt: skip
    """verl's `linear_cross_entropy` (its Triton fused LM head: `fused_kernel_options.
    impl_backend="triton"`, what the HF models' `forward_with_triton_backend` call) on
    `fastrl.linear_logprobs`: hidden (..., H) and labels (...) flattened to N rows, returns fp32
    (log-probs (N,), entropy (N,)) as verl's kernel does. With a process group (Megatron's
    tensor-parallel vocabulary) or a reduction other than "none", verl's own kernel runs."""
    if dist_process_group is not None or str(reduction).lower() != "none":
        original = _ORIGINALS[_LCE]  # verl's, kept by install()
        return original(hidden, weight, labels, temperature, reduction, dist_process_group)
    import fastrl

    flat = hidden.reshape(-1, hidden.shape[-1])
    return fastrl.linear_logprobs(
        flat, weight.to(flat.dtype), labels.reshape(-1).long(),
        temperature=float(temperature), entropy=True,
    )  # fmt: skip


def _patch(module, name: str, new) -> None:
    key = (module.__name__, name)
    if key not in _ORIGINALS:
        _ORIGINALS[key] = getattr(module, name)
    setattr(module, name, new)


def install(losses: bool = True, kernels: bool = True) -> list[str]:
    """Put fastrl into verl (idempotent). `losses`: register `fastrl` and `fastrl_<mode>` in
    verl's policy-loss registry. `kernels`: route verl's logprobs_from_logits /
    entropy_from_logits / entropy_from_logits_with_chunking, FusedLinearForPPO (its "torch" and
    "liger" fused-kernel backends) and linear_cross_entropy (its "triton" backend, without a
    process group) to fastrl's ops, in verl's modules and in every verl module that imported
    them by name.
    Returns the registered loss modes. `uninstall()` undoes it."""
    from .._inputs import check_bool

    check_bool("losses", losses)
    check_bool("kernels", kernels)
    try:
        from verl.trainer.ppo import core_algos
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            'fastrl.integrations.verl.install() needs verl: pip install -e ".[verl]" && '
            "pip install --no-deps verl==0.9.1 (its pinned dependencies would replace "
            "transformers; see docs/integrations.md); "
            f"importing verl.trainer.ppo.core_algos failed: {e}"
        ) from e
    modes: list[str] = []
    if losses:
        for mode in FASTRL_MODES:
            core_algos.register_policy_loss(mode)(make_policy_loss(mode))
            modes.append(mode)
    if kernels:
        import verl.utils.kernel.linear_cross_entropy as verl_lce
        import verl.utils.torch_functional as verl_F
        from verl.utils.experimental import torch_functional as verl_exp

        routes = [
            (verl_F, "logprobs_from_logits", _logprobs_from_logits),
            (verl_F, "entropy_from_logits", _entropy_from_logits),
            (verl_F, "entropy_from_logits_with_chunking", _entropy_from_logits),
            (verl_lce, "linear_cross_entropy", _linear_cross_entropy),
        ]
        for owner, name, fn in routes:  # the owner and every verl module holding its original
            original = _ORIGINALS.get((owner.__name__, name), getattr(owner, name))
            for module in [m for n, m in list(sys.modules.items()) if n.startswith("verl")]:
                if module is owner or getattr(module, name, None) is original:
                    _patch(module, name, fn)
        _patch(verl_exp.FusedLinearForPPO, "forward", _fused_linear_for_ppo_forward)
    return modes


def uninstall() -> None:
    """Undo `install()`'s routing and remove the fastrl loss modes from verl's registry."""
    for (module_name, name), original in _ORIGINALS.items():
        owner = sys.modules.get(module_name)
        if owner is None:
            from verl.utils.experimental import torch_functional as verl_exp

            owner = verl_exp.FusedLinearForPPO if name == "forward" else None
        if owner is not None:
            setattr(owner, name, original)
    _ORIGINALS.clear()
    core_algos = sys.modules.get("verl.trainer.ppo.core_algos")
    if core_algos is not None:
        for mode in FASTRL_MODES:
            core_algos.POLICY_LOSS_REGISTRY.pop(mode, None)


# Ray workers: VERL_USE_EXTERNAL_MODULES=fastrl.integrations.verl makes verl import this module
# when verl itself is imported; install there and then.
if __name__ in os.environ.get("VERL_USE_EXTERNAL_MODULES", "").split(","):
    install()


__all__ = [
    "FASTRL_MODES",
    "install",
    "loss_config_from_verl",
    "make_policy_loss",
    "uninstall",
]
