"""What trainers run today, written out for the benchmarks (never a fastrl code path).

The GRPO setting everywhere: token-level ratio, clip eps_low = eps_high = 0.2, k3 KL against the
reference policy with beta = 0.04, "seq-mean-token-mean" aggregation (TRL's loss_type="grpo") -
the same loss as `fastrl.LossConfig.grpo()`.

    trl_grpo_math(logp, ...)        TRL 1.16 GRPOTrainer._compute_loss, per-token math, verbatim
                                    (ratio, two-sided clip, k3 KL, beta, loss_type="grpo")
    trl_eager_loss(logits, ...)     trl.trainer.utils.selective_log_softmax on the logits, the
                                    entropy metric under no_grad (`entropy_from_logits`), then
                                    trl_grpo_math. On the CPU both helpers run eager torch loops;
                                    on CUDA (triton importable) each dispatches to TRL's own
                                    Triton kernel (trl/kernels/logprob_entropy.py). TRL 1.16's
                                    GRPOTrainer calls neither on logits: it runs its fused LM head
                                    (trl_chunked_logprobs below)
    verl_logprobs_from_logits()     verl.utils.torch_functional.logprobs_from_logits, or None
                                    (with the reason) when `import verl` fails
    verl_grpo_math(logp, ...)       verl's own functions, called as its actor loss
                                    (verl/workers/utils/losses.py ppo_loss) calls them:
                                    core_algos.compute_policy_loss_vanilla (ratio clamp, dual clip
                                    c = 3) + kl_loss_coef * agg_loss(kl_penalty(.., "low_var_kl")),
                                    seq-mean-token-mean, with a small ActorConfig (verl_actor)
    trl_chunked_logprobs(h, w, ...) TRL 1.16's ChunkedLogProbFunction called as the trainer's
                                    fused LM head does it off CUDA (add_fused_lm_head: every
                                    position scored, outputs=("log_probs", "entropy"))

TRL's logging-only metrics (clip fractions, gathered means) are (B, T)-sized and left out.
"""

from __future__ import annotations

import sys
import types

import torch

EPS_LOW = EPS_HIGH = 0.2
BETA = 0.04
VERL_CLIP_RATIO_C = 3.0  # verl's default dual-clip constant (actor.clip_ratio_c)


def trl_grpo_math(logp, old_logp, ref_logp, advantages, mask, beta=BETA, eps=(EPS_LOW, EPS_HIGH)):
    """TRL 1.16 GRPO loss (loss_type="grpo", token-level IS, beta != 0) from per-token log-probs.

    Also what the fused-linear baselines apply after their log-prob op."""
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(1)
    mask = mask.to(logp.dtype)
    coef_1 = torch.exp(logp - old_logp)
    per_token_kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1
    coef_2 = torch.clamp(coef_1, 1 - eps[0], 1 + eps[1])
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    per_token_loss = per_token_loss + beta * per_token_kl
    return ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()


def trl_log_softmax_fns():
    """(selective_log_softmax, entropy_from_logits) from trl.trainer.utils (trl 1.16)."""
    from trl.trainer.utils import entropy_from_logits, selective_log_softmax

    return selective_log_softmax, entropy_from_logits


def make_trl_eager_loss():
    """loss(logits, tokens, advantages, old_logp, ref_logp, mask) as TRL's GRPOTrainer computes it
    on materialised logits: selective_log_softmax (a per-sequence logsumexp loop for fp32, a
    per-sequence log_softmax loop for bf16), the entropy metric without gradient, the GRPO math."""
    selective_log_softmax, entropy_from_logits = trl_log_softmax_fns()

    def trl_eager_loss(logits, tokens, advantages, old_logp, ref_logp, mask):
        logp = selective_log_softmax(logits, tokens)
        with torch.no_grad():  # logged as the `entropy` metric; no gradient at entropy_coef = 0
            entropy = entropy_from_logits(logits)
        loss = trl_grpo_math(logp.float(), old_logp, ref_logp, advantages, mask)
        return loss, entropy

    return trl_eager_loss


RAY_PLACEHOLDER = (
    "verl imported with a placeholder for `ray`, which is not installed (its wheel is larger "
    "than a device call carries): verl's package reads ray.ObjectRef at import; the functions "
    "timed never call ray"
)


def import_verl() -> str:
    """`import verl`: "" when it imports as installed, RAY_PLACEHOLDER when it needed a stand-in
    `ray` module; raises what the import raises otherwise (not installed, a dependency missing).

    verl's package __init__ imports ray for its DataProto / worker layer; the functions the
    benchmarks time (logprobs_from_logits, core_algos, FusedLinearForPPO, linear_cross_entropy)
    never touch it. Where ray is absent (the lent GPU image: its 79 MB wheel is over the 64 MiB
    a device call carries), a module `ray` holding only `ObjectRef` (a class) stands in: any
    other use of ray, or of a ray submodule, still fails loudly."""
    try:
        import verl  # noqa: F401

        return RAY_PLACEHOLDER if getattr(sys.modules.get("ray"), "_stand_in", False) else ""
    except ModuleNotFoundError as e:
        if e.name != "ray":
            raise
    placeholder = types.ModuleType("ray")
    placeholder._stand_in = True
    placeholder.__path__ = []  # a package without submodules: `import ray.util` fails
    placeholder.ObjectRef = type("ObjectRef", (), {})
    sys.modules["ray"] = placeholder
    import verl  # noqa: F401

    return RAY_PLACEHOLDER


def verl_logprobs_from_logits():
    """(verl's logprobs_from_logits, note) or (None, why it is unavailable); note: "" or
    RAY_PLACEHOLDER (`import_verl`)."""
    try:
        note = import_verl()
        from verl.utils.torch_functional import logprobs_from_logits
    except Exception as e:  # not installed, or its dependencies (tensordict, ...) missing
        return None, f"{type(e).__name__}: {e}"
    return logprobs_from_logits, note


def verl_actor(beta=BETA, eps=(EPS_LOW, EPS_HIGH)):
    """verl's actor config of the GRPO setting (one process: global_batch_info left empty)."""
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig

    return FSDPActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio_low=eps[0],
        clip_ratio_high=eps[1],
        clip_ratio_c=VERL_CLIP_RATIO_C,
        loss_agg_mode="seq-mean-token-mean",
        use_kl_loss=True,
        kl_loss_coef=beta,
        kl_loss_type="low_var_kl",
        entropy_coeff=0.0,
        policy_loss=PolicyLossConfig(loss_mode="vanilla"),
    )


def make_verl_grpo_math(beta=BETA, eps=(EPS_LOW, EPS_HIGH)):
    """loss(logp, old_logp, ref_logp, advantages, mask): verl's actor loss for GRPO through
    verl's own core_algos functions, as verl's ppo_loss calls them (its pg metrics included:
    compute_policy_loss_vanilla reads three of them back with .item()). Equal to the TRL loss
    unless a clamp (log-ratio +-20, dual clip c = 3, k3 +-10) is hit."""
    from verl.trainer.ppo import core_algos

    actor = verl_actor(beta, eps)
    agg = actor.loss_agg_mode

    def verl_grpo_math(logp, old_logp, ref_logp, advantages, mask):
        if advantages.dim() == 1:  # verl's advantages are per token (broadcast, no copy)
            advantages = advantages.unsqueeze(1).expand_as(logp)
        mask = mask.to(torch.bool)
        pg_loss, _metrics = core_algos.compute_policy_loss_vanilla(
            old_log_prob=old_logp,
            log_prob=logp,
            advantages=advantages,
            response_mask=mask,
            loss_agg_mode=agg,
            config=actor,
        )
        kld = core_algos.kl_penalty(logprob=logp, ref_logprob=ref_logp, kl_penalty="low_var_kl")
        kl_loss = core_algos.agg_loss(
            loss_mat=kld, loss_mask=mask, loss_agg_mode=agg, **actor.global_batch_info
        )
        return pg_loss + kl_loss * actor.kl_loss_coef

    return verl_grpo_math


def make_verl_eager_loss():
    """(loss(logits, ...) as verl's dp_actor computes it (entropy_coeff = 0: no entropy), note)
    or (None, why it is unavailable); note: "" or RAY_PLACEHOLDER."""
    logprobs_from_logits, why = verl_logprobs_from_logits()
    if logprobs_from_logits is None:
        return None, why

    verl_grpo_math = make_verl_grpo_math()

    def verl_eager_loss(logits, tokens, advantages, old_logp, ref_logp, mask):
        logp = logprobs_from_logits(logits, tokens)
        return verl_grpo_math(logp.float(), old_logp, ref_logp, advantages, mask), None

    return verl_eager_loss, why


def trl_chunked_logprobs(hidden, weight, tokens, mask):
    """Per-token (log-probs, entropy) of hidden @ weight.T through TRL 1.16's
    ChunkedLogProbFunction, exactly as `add_fused_lm_head`'s patched forward calls it off CUDA
    (all positions scored, labels clamped, masked positions zero-filled after)."""
    from trl.kernels.chunked_logprob import ChunkedLogProbFunction
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE

    B, T = tokens.shape
    logp, entropy, *_ = ChunkedLogProbFunction.apply(
        hidden.reshape(-1, hidden.size(-1)),
        weight,
        None,  # lm_head bias
        tokens.clamp(min=0).reshape(-1),
        1.0,  # temperature
        _CHUNKED_LOGPROB_CHUNK_SIZE,
        None,  # final_logit_softcapping
        1.0,  # logit_scale
        ("log_probs", "entropy"),  # what GRPOTrainer asks for
    )
    logp = logp.view(B, T).masked_fill(~mask, 0)
    entropy = entropy.view(B, T).masked_fill(~mask, 0)
    return logp, entropy
