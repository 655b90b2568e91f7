"""TRL: a drop-in `GRPOTrainer` whose log-probs and loss are fastrl's, and the `LossConfig` of a
`GRPOConfig`.

    from fastrl.integrations.trl import GRPOTrainer     # instead of `from trl import GRPOTrainer`
    trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    trainer.train()

`GRPOTrainer` is a subclass of `trl.GRPOTrainer` (same constructor, same `GRPOConfig`, same
generation, rewards, advantages, buffering and logging). Two things change:

1. the per-token log-probs and entropies of the policy, pi_old and pi_ref come from
   `fastrl.linear_logprobs(hidden, lm_head.weight, labels, mask=...)` on the last hidden
   states: the (B, T, V) logits are never held, prompt and padding positions are skipped
   (mask = 0: no GEMM work for them). TRL 1.16 always scores through its own fused LM head
   (`trl.trainer.utils.add_fused_lm_head`, there is no switch to turn it off); the drop-in
   replaces that head's computation on the same `model(..., fused_lm_head=True)` call, so
   temperature, `cast_lm_head_to_fp32`, logit scale / softcap, PEFT and MoE aux losses behave
   as in TRL. Under DeepSpeed ZeRO-3 the partitioned head is gathered for the call and again
   in its backward (TRL's `maybe_gather_lm_head_ctx`), as TRL's head does.
2. the loss is SPEC 1-5 (`fastrl.policy_loss_from_logprobs`, the per-token math the fused
   kernels are checked against) on those (B, T) log-probs, with `loss_config_from_trl(args)`
   and TRL's normalisers: grpo / sapo / luspo / bnpo / dr_grpo divide by the gradient
   accumulation steps, dapo / cispo by `num_items_in_batch` rescaled to one accumulation window
   (`num_iterations` and `steps_per_generation` included). TRL's entropy bonus (a local token
   mean, also adaptive) and MoE aux loss are added as TRL adds them, and TRL's metrics (kl,
   entropy, clip_ratio/*, cispo_clip_ratio, policy_loss, entropy_coef) keep their meaning.

Options SPEC cannot express raise a ValueError naming the option when the trainer is built.

`loss_config_from_trl(args)` alone gives the LossConfig for `fastrl.policy_loss`:

    cfg = loss_config_from_trl(grpo_args)
    out = fastrl.policy_loss(completion_logits, completion_ids, inputs["advantages"],
                             inputs.get("old_per_token_logps"), inputs.get("ref_per_token_logps"),
                             inputs["completion_mask"], config=cfg,
                             num_tokens=normalizer)   # loss_type dapo / cispo: TRL's normalizer

Mapped (TRL -> LossConfig): loss_type grpo / bnpo / dr_grpo / dapo / luspo (ppo with the
aggregations of `_LOSS_TYPES`), cispo (clip [0, epsilon_high]), sapo (sapo_temperature_pos /
_neg); epsilon / epsilon_high / delta; importance_sampling_level (GSPO); beta (k3);
use_bias_correction_kl (token ratio, or the sequence ratio under sequence-level sampling:
`kl_bias_ratio="sequence"`); temperature; max_completion_length (dr_grpo); vLLM importance
sampling (mode, clip_max -> rollout_is_cap, clip_min -> rollout_is_floor); entropy_coef for
bnpo (where TRL's local token-mean bonus is SPEC's c_H). Refused: loss_type vespo,
off_policy_mask_threshold, top_entropy_quantile < 1, entropy_coef != 0 / use_adaptive_entropy
for the other loss types (TRL's bonus has its own normaliser; the drop-in trainer adds it
itself), vllm_importance_sampling_clip_max=None.

Two normalisers are the caller's: for `dapo` / `cispo` TRL divides by `num_items_in_batch`
rescaled to one accumulation window (pass it as `num_tokens`), and TRL divides the `grpo`,
`bnpo`, `dr_grpo`, `sapo`, `luspo` losses by the gradient-accumulation steps afterwards (do the
same). TRL's ratios have no clamp; SPEC clamps log r to [-20, 20], so the two differ only at a
token whose log-ratio lies beyond +-20 (its probability moved by a factor over 4.9e8): there
fastrl holds r at the bound and passes no gradient through it, TRL the unclamped r and its
gradient.
"""

from __future__ import annotations

import contextlib
import functools
import math
import types
from typing import Any

import torch

from .. import ops
from ..config import LossConfig
from ..linear import default_chunk, linear_token_stats, linear_token_stats_backward
from .trl_config import _PER_STEP_LOSS_TYPES
from .trl_config import loss_config_from_trl as loss_config_from_trl  # public here too


# ============================================================================ drop-in trainer
def _logit_scale(text_config) -> float:
    """The pre-softcap logit multiplier of the model, read as TRL's `add_fused_lm_head` does."""
    scale = getattr(text_config, "logit_scale", None)
    if scale is None:
        scale = getattr(text_config, "output_multiplier", None)
    if scale is None:
        scale = getattr(text_config, "lm_head_multiplier", None)
    if scale is None and getattr(text_config, "logits_scaling", None) is not None:
        s = text_config.logits_scaling
        scale = s if text_config.model_type == "hyperclovax" else 1 / s
    return 1.0 if scale is None else float(scale)


def add_fastrl_lm_head(model, temperature: float, cast_lm_head_to_fp32: bool, entropy: bool):
    """Make `model(..., labels=labels, fused_lm_head=True)` return TRL's `FusedCausalLMOutput`
    with log-probs (and entropies) from `fastrl.linear_logprobs` on the backbone's last hidden
    states; any other call goes to the forward the model had (TRL's, then the model's own).

    labels (B, S) with -100 where nothing is scored: hidden[:, :-1] (B, S-1, H) against
    labels[:, 1:], rows with label -100 skipped (their log-prob and entropy are 0)."""
    import transformers
    from packaging.version import Version
    from trl.trainer.utils import FusedCausalLMOutput

    import fastrl

    previous_forward = model.forward
    text_config = model.config.get_text_config()
    softcap = getattr(text_config, "final_logit_softcapping", None)
    logit_scale = _logit_scale(text_config)
    backbone_attr = "base_model"
    if text_config is not model.config and Version(transformers.__version__) < Version("5.0.0"):
        backbone_attr = "model"

    @functools.wraps(type(model).forward)
    def _forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
        **kwargs,
    ):  # fmt: skip
        if not fused_lm_head:
            return previous_forward(
                *args, labels=labels, shift_labels=shift_labels,
                num_items_in_batch=num_items_in_batch, **kwargs,
            )  # fmt: skip
        kwargs["use_cache"] = False
        if getattr(text_config, "output_router_logits", False):
            kwargs.setdefault("output_router_logits", True)
        backbone_outputs = getattr(self, backbone_attr)(*args, **kwargs)
        if shift_labels is None:
            hidden = backbone_outputs.last_hidden_state[:, :-1]
            labels = labels[:, 1:]
        else:
            hidden = backbone_outputs.last_hidden_state
            labels = shift_labels
        lm_head = self.get_output_embeddings()
        hidden = hidden.to(lm_head.weight.device)
        labels = labels.to(lm_head.weight.device)
        mask = labels != -100
        weight, bias = lm_head.weight, lm_head.bias
        if hasattr(weight, "full_tensor"):  # FSDP2 DTensor: gather the head once
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        # the GEMM dtype of TRL's ChunkedLogProbFunction: fp32 with cast_lm_head_to_fp32, else
        # the autocast dtype, else the hidden states'
        device_type = hidden.device.type
        if cast_lm_head_to_fp32:
            dtype = torch.float32
        elif torch.is_autocast_enabled(device_type):
            dtype = torch.get_autocast_dtype(device_type)
        else:
            dtype = hidden.dtype
        tokens = labels.clamp(min=0)
        zero3 = _zero3_enabled()  # a partitioned head: gathered here and again in the backward
        with torch.autocast(device_type, enabled=False), _gather_head(weight, bias, zero3):
            if not zero3 and weight.dtype == dtype and (bias is None or bias.dtype == dtype):
                out = fastrl.linear_logprobs(
                    hidden.to(dtype), weight, tokens, bias=bias, temperature=temperature,
                    entropy=True, mask=mask, logit_scale=logit_scale, softcap=softcap,
                )  # fmt: skip
            else:  # cast in the forward and again in the backward: no (V, H) copy is saved
                out = _cast_head_logprobs(hidden, weight, bias, tokens, mask, dtype, temperature,
                                          logit_scale, softcap, zero3)  # fmt: skip
        log_probs, ent = out if entropy else (out[0], None)
        count = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        loss = -log_probs.sum() / count
        aux_loss = None
        if kwargs.get("output_router_logits"):
            from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

            num_experts = getattr(text_config, "num_experts", None)
            num_experts = getattr(self, "num_experts", None) if num_experts is None else num_experts
            top_k = getattr(text_config, "num_experts_per_tok", None)
            top_k = getattr(self, "num_experts_per_tok", None) if top_k is None else top_k
            aux_loss = load_balancing_loss_func(
                backbone_outputs.router_logits, num_experts, top_k, kwargs.get("attention_mask")
            )
            loss = loss + getattr(text_config, "router_aux_loss_coef", 0.0) * aux_loss
        return FusedCausalLMOutput(
            loss=loss, log_probs=log_probs, entropy=ent, label_mask=mask, aux_loss=aux_loss
        )

    model.forward = types.MethodType(_forward, model)


def _zero3_enabled() -> bool:
    """Whether DeepSpeed ZeRO-3 partitions the model's parameters (transformers' flag, which TRL
    reads): then lm_head.weight holds no data outside a gather."""
    from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

    return bool(is_deepspeed_zero3_enabled())


def _gather_head(weight, bias, zero3: bool):
    """TRL's `maybe_gather_lm_head_ctx(weight, bias)` under ZeRO-3 (the partitioned head
    gathered for a direct read, as TRL's fused head does), else a null context."""
    if not zero3:
        return contextlib.nullcontext()
    from trl.trainer.utils import maybe_gather_lm_head_ctx

    return maybe_gather_lm_head_ctx(weight, bias)


class _CastHeadLogprobs(torch.autograd.Function):
    """`fastrl.linear_logprobs` of hidden against weight / bias run in `dtype` when their own
    dtype differs (fp32 master weights under bf16 autocast, a bf16 head with
    cast_lm_head_to_fp32): the casts are made in the forward and again in the backward, so the
    graph keeps the tensors it was given (the head's parameters, held anyway) and no (V, H) copy
    between forward and backward, as TRL's ChunkedLogProbFunction (which casts per chunk).
    dW comes from the op in fp32 (each chunk's product formed in fp32, as TRL's) and is cast
    once, to the weight's dtype: fp32 master weights get the sum unrounded.
    `zero3`: a DeepSpeed ZeRO-3 head, partitioned outside a gather: the caller gathers it for
    the forward, the backward gathers it again (`_gather_head`), as TRL's fused head does."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, tokens, mask, dtype, temperature, logit_scale, softcap,
                zero3):  # fmt: skip
        h, w = hidden.to(dtype), weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        chunk = default_chunk(w.shape[0], w.device)
        logp, ent, m, log_s = linear_token_stats(
            h, w, b, tokens, mask, temperature, logit_scale, softcap, chunk, None, ops.SOURCE_KEY
        )
        del h, w, b
        ctx.save_for_backward(hidden, weight, bias, tokens, mask, logp, m, log_s, ent)
        ctx.args = (dtype, temperature, logit_scale, softcap, chunk)
        ctx.zero3 = zero3
        ctx.mark_non_differentiable(m, log_s)
        return logp.view(tokens.shape), ent.view(tokens.shape)

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        ops.refuse_double_backward("linear_logprobs")
        hidden, weight, bias, tokens, mask, logp, m, log_s, ent = ctx.saved_tensors
        dtype, temperature, logit_scale, softcap, chunk = ctx.args
        if grad_logp is None:
            grad_logp = torch.zeros_like(logp)
        with torch.autocast(hidden.device.type, enabled=False), _gather_head(weight, bias,
                                                                            ctx.zero3):  # fmt: skip
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            dh, dw, db = linear_token_stats_backward(
                h, w, b, tokens, mask, logp, m, log_s, ent, grad_logp, grad_entropy,
                temperature, logit_scale, softcap, chunk, None,
            )  # fmt: skip
            del h, w, b
            dw = dw.to(weight.dtype)
            db = None if bias is None else db.to(bias.dtype)
        dh = dh.view(hidden.shape).to(hidden.dtype)
        return dh, dw, db, None, None, None, None, None, None, None


def _cast_head_logprobs(hidden, weight, bias, tokens, mask, dtype, temperature, logit_scale,
                        softcap, zero3=False):  # fmt: skip
    """(logp, H) fp32 shaped like tokens: `fastrl.linear_logprobs(hidden, weight, tokens, ...)`
    with hidden, weight and bias cast to `dtype` (its checks of tokens, mask, temperature,
    logit_scale and softcap), through _CastHeadLogprobs (`zero3`: see there; weight and bias
    gathered by the caller)."""
    from .._inputs import check_mask, check_number, check_temperature
    from ..linear import _check_tokens

    for name, t in (("hidden", hidden), ("weight", weight), ("bias", bias)):
        if t is not None and t.device != tokens.device:
            raise ValueError(f"{name} is on {t.device}; expected the labels' {tokens.device}")
    _check_tokens(tokens, hidden, weight.shape[0])
    mask = check_mask("mask", mask, tuple(tokens.shape), tokens.device, as_float=False)
    check_number("logit_scale", logit_scale, "a float > 0", lambda c: c > 0)
    if softcap is not None:
        softcap = check_number("softcap", softcap, "None or a float > 0", lambda c: c > 0)
    return _CastHeadLogprobs.apply(
        hidden, weight, bias, tokens, mask, dtype, check_temperature(temperature),
        float(logit_scale), softcap, zero3,
    )  # fmt: skip


def _trainer_loss_config(args: Any) -> LossConfig:
    """The LossConfig of the drop-in trainer: `loss_config_from_trl` without the entropy bonus
    (the trainer adds TRL's), refusing what neither can express."""
    return loss_config_from_trl(args, entropy_coef=0.0)


def _make_trainer_class():
    import inspect

    import trl
    from accelerate.utils import is_peft_model
    from trl.trainer.utils import nanmax, nanmin

    from ..losses import policy_loss_from_logprobs

    base = trl.GRPOTrainer

    class GRPOTrainer(base):
        """`trl.GRPOTrainer` with fastrl's log-probs (`fastrl.linear_logprobs` on the hidden
        states) and fastrl's loss (SPEC 1-5 with TRL's normalisers). Same constructor and
        `GRPOConfig`; options SPEC cannot express raise a ValueError naming the option here."""

        def __init__(self, *args, **kwargs):
            bound = inspect.signature(base.__init__).bind(None, *args, **kwargs)
            if bound.arguments.get("args") is not None:  # refuse before loading anything
                _trainer_loss_config(bound.arguments["args"])
            super().__init__(*args, **kwargs)
            self.fastrl_config = _trainer_loss_config(self.args)
            policy = self.model.get_base_model() if is_peft_model(self.model) else self.model
            cast = bool(getattr(self.args, "cast_lm_head_to_fp32", False))
            add_fastrl_lm_head(policy, self.temperature, cast, entropy=True)
            if self.ref_model is not None:
                ref = self.accelerator.unwrap_model(self.ref_model)
                add_fastrl_lm_head(ref, self.temperature, cast, entropy=False)

        def _compute_loss(self, model, inputs):
            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            logits_to_keep = completion_ids.size(1)
            mask = (
                completion_mask
                if "tool_mask" not in inputs
                else completion_mask * inputs["tool_mask"]
            )  # noqa: E501

            # (B, T) fp32 log-probs and entropies from fastrl.linear_logprobs (the patched head)
            per_token_logps, entropies, aux_loss = self._get_per_token_logps_and_entropies(
                model, input_ids, attention_mask, logits_to_keep, compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
                **{k: inputs.get(k) for k in _MULTIMODAL_KEYS},
            )  # fmt: skip

            mode = "train" if self.model.training else "eval"
            cfg = self.fastrl_config
            loss_type = self.loss_type
            accumulation = self.current_gradient_accumulation_steps if mode == "train" else 1.0
            counts: dict[str, Any] = {}
            if loss_type not in _PER_STEP_LOSS_TYPES:  # dapo / cispo: the window's token count
                normalizer = inputs["num_items_in_batch"].clamp(min=1.0)
                normalizer = normalizer / self.accelerator.num_processes
                if mode == "train":
                    normalizer = normalizer * accumulation / self.args.steps_per_generation
                counts["num_tokens"] = normalizer
            old = inputs.get("old_per_token_logps")
            ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
            rollout = None
            if cfg.rollout_is is not None:
                rollout = inputs["sampling_per_token_logps"]  # TRL: a NaN one gets weight 1
                rollout = torch.where(torch.isnan(rollout), old, rollout)
            advantages = inputs["advantages"]

            # SPEC 1-5 (the math the kernels are checked against), TRL's normalisers
            out = policy_loss_from_logprobs(
                per_token_logps, entropies, advantages, old, ref, mask, rollout, cfg, **counts
            )
            loss = out.loss
            policy_loss = loss.detach()
            if loss_type in _PER_STEP_LOSS_TYPES:
                loss = loss / accumulation

            # TRL's entropy bonus: the local token-mean entropy, whatever the loss type
            if self._entropy_bonus_enabled:
                entropy_loss = (entropies * mask).sum() / mask.sum().clamp(min=1.0) / accumulation
                if self.use_adaptive_entropy:
                    below = self._last_world_entropy <= self.args.entropy_target
                    apply_coef = self.entropy_coef if below else 0.0
                else:
                    apply_coef = self.entropy_coef
                loss = loss - apply_coef * entropy_loss
                self._metrics[mode]["policy_loss"].append(
                    self.accelerator.gather(policy_loss).nanmean().item()
                )
                if self.use_adaptive_entropy and mode == "train":
                    self._update_adaptive_entropy(entropies, mask)
                if mode == "train" and self.accelerator.sync_gradients:
                    self._metrics[mode]["entropy_coef"].append(self.entropy_coef)

            if self.aux_loss_enabled:
                loss = loss + self.router_aux_loss_coef * aux_loss / accumulation
                self._metrics[mode]["aux_loss"].append(
                    self.accelerator.gather_for_metrics(aux_loss).mean().item()
                )
            self._log_loss_metrics(mode, out, entropies, advantages, mask)
            return loss

        def _update_adaptive_entropy(self, entropies, mask):
            """TRL's adaptive entropy controller (Skywork-OR1), unchanged."""
            stats = torch.stack([(entropies * mask).sum(), mask.sum()]).detach()
            window = self._entropy_window_stats
            self._entropy_window_stats = stats if window is None else window + stats
            if self.accelerator.sync_gradients:
                totals = self.accelerator.reduce(self._entropy_window_stats, reduction="sum")
                world_entropy = (totals[0] / totals[1].clamp(min=1.0)).item()
                a = self.args
                if world_entropy <= a.entropy_target:
                    self.entropy_coef = min(self.entropy_coef + a.entropy_coef_delta,
                                            a.entropy_coef_max)  # fmt: skip
                else:
                    self.entropy_coef = max(self.entropy_coef - a.entropy_coef_delta,
                                            a.entropy_coef_min)  # fmt: skip
                self._last_world_entropy = world_entropy
                self._entropy_window_stats = None

        def _log_loss_metrics(self, mode, out, entropies, advantages, mask):
            """TRL's kl / entropy / clip_ratio metrics from fastrl's per-token terms: the ratio
            is TRL's `coef_1` ((B, 1) under sequence-level sampling), kl includes the bias
            correction as TRL's `per_token_kl` does."""
            metrics = self._metrics[mode]
            adv = advantages.unsqueeze(1) if advantages.dim() == 1 else advantages
            coef_1 = out.ratio
            if self.importance_sampling_level == "sequence":
                # every counted token holds its sequence's ratio, a masked one 1 (a tool or
                # environment token may come first): the ratio of a counted token, 1 in a row
                # with none, TRL's (B, 1) coef_1
                counted = mask > 0
                coef_1 = torch.where(counted, coef_1, -math.inf).amax(-1, keepdim=True)
                coef_1 = torch.where(counted.any(-1, keepdim=True), coef_1, 1.0)

            # TRL takes any (B, 1) tensor for one value per sequence, so with one-token
            # completions (T = 1) it also averages a token-level one (kl, entropy, the token
            # ratios' clip fractions) over every row, masked ones too; here only the sequence
            # ratios' (B, 1) tensors are per sequence, a token-level one is averaged over the
            # counted tokens whatever T (docs/integrations.md)
            per_seq = self.importance_sampling_level == "sequence"

            def masked_seq_mean(v):
                if per_seq and v.shape[1] == 1:
                    return v.squeeze(1)
                return (v * mask).sum(-1) / mask.sum(-1)

            def global_masked_mean(v):
                if per_seq and v.shape[1] == 1:
                    local = v.sum(), torch.tensor(float(v.shape[0]), device=v.device)
                else:
                    local = (v * mask).sum(), mask.sum().float()
                totals = self.accelerator.reduce(torch.stack(local), reduction="sum")
                return (totals[0] / totals[1].clamp(min=1.0)).item()

            with torch.no_grad():
                if self.beta != 0.0:
                    metrics["kl"].append(global_masked_mean(out.kl))
                metrics["entropy"].append(global_masked_mean(entropies.detach()))
                if self.loss_type in ("grpo", "bnpo", "dr_grpo", "dapo", "luspo"):
                    low = ((coef_1 < 1 - self.epsilon_low) & (adv < 0)).float()
                    high = ((coef_1 > 1 + self.epsilon_high) & (adv > 0)).float()
                    region = torch.maximum(low, high)
                    metrics["clip_ratio/low_mean"].append(global_masked_mean(low))
                    metrics["clip_ratio/high_mean"].append(global_masked_mean(high))
                    metrics["clip_ratio/region_mean"].append(global_masked_mean(region))
                    gathered = self.accelerator.gather(masked_seq_mean(low))
                    metrics["clip_ratio/low_min"].append(nanmin(gathered).item())
                    gathered = self.accelerator.gather(masked_seq_mean(high))
                    metrics["clip_ratio/high_max"].append(nanmax(gathered).item())
                elif self.loss_type == "cispo":
                    clipped = ((coef_1 > self.epsilon_high) & (adv > 0)).float()
                    metrics["cispo_clip_ratio"].append(global_masked_mean(clipped))

    GRPOTrainer.__module__ = __name__
    GRPOTrainer.__qualname__ = "GRPOTrainer"
    return GRPOTrainer


# the inputs TRL's `_compute_loss` forwards to `_get_per_token_logps_and_entropies`
_MULTIMODAL_KEYS = (
    "pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask", "spatial_shapes",
    "num_tiles", "image_sizes", "token_type_ids", "mm_token_type_ids", "image_position_ids",
)  # fmt: skip


@functools.cache
def _trainer_class():
    return _make_trainer_class()


def __getattr__(name: str):
    # `GRPOTrainer` subclasses trl.GRPOTrainer: built on first access, so that importing this
    # module (for loss_config_from_trl) does not import TRL
    if name == "GRPOTrainer":
        return _trainer_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["GRPOTrainer", "add_fastrl_lm_head", "loss_config_from_trl"]  # noqa: F822 (lazy)
