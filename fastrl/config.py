"""Loss configuration: one dataclass for every knob of SPEC.md sections 1-5, plus presets.

`LossConfig()` with no arguments is the `ppo` preset. Every preset takes keyword overrides:

    cfg = LossConfig.grpo(kl_coef=0.01)
    cfg = LossConfig.dapo(clip_high=0.3, entropy_coef=1e-3)

All values are checked in `__post_init__`; an impossible value raises a `ValueError` that names
the field, the value and what was expected. `dataclasses.replace(cfg, field=value)` re-checks.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

POLICIES = ("ppo", "cispo", "sapo", "reinforce")
RATIO_LEVELS = ("token", "sequence")
KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl", "abs")
AGGS = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
    "token-sum",
)
ROLLOUT_IS_LEVELS = ("token", "sequence")
ROLLOUT_IS_MODES = ("truncate", "mask")
SEQ_RATIO_GRADS = ("mean", "token")
KL_BIAS_RATIOS = ("token", "sequence")


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass(frozen=True)
class LossConfig:
    """Every option of the fused policy loss (SPEC.md sections 1-5)."""

    policy: str = "ppo"
    """Per-token policy term (SPEC 2): `ppo` (clipped surrogate; GRPO, DAPO, Dr.GRPO and GSPO
    use it), `cispo` (clipped, stop-gradient IS weight times log-prob), `sapo` (soft sigmoid
    gate) or `reinforce` (-A * logp, no ratio)."""

    clip_low: float = 0.2
    """epsilon_low: the ratio is clipped from below at 1 - clip_low. In [0, 1]; 1 means no
    lower bound (CISPO)."""

    clip_high: float = 0.2
    """epsilon_high: the ratio is clipped from above at 1 + clip_high (DAPO's clip-higher uses
    0.28). Must be >= 0."""

    clip_dual: float | None = None
    """Dual-clip constant c (verl `clip_ratio_c`): for A < 0 the loss is capped at -A * c.
    None disables it; otherwise must be > 1."""

    clip_delta: float | None = None
    """Two-sided bound delta (INTELLECT-2; TRL `delta`): the unclipped ratio is replaced by
    min(r, delta). None disables it; otherwise must be > 1 + clip_high."""

    ratio_level: str = "token"
    """`token` (PPO/GRPO: one ratio per token) or `sequence` (GSPO: the ratio of the
    length-normalised sequence log-likelihoods, broadcast over the sequence's tokens)."""

    seq_ratio_grad: str = "mean"
    """Gradient of the sequence ratio (`ratio_level="sequence"` only; SPEC 1). `mean` (GSPO
    paper, TRL): log r_i = sum_t m_t (logp_t - old_t) / |y_i| and the gradient flows through
    the mean, d log r_i / d logp_t = m_t / |y_i|. `token` (GSPO-token, verl's `gspo` loss mode):
    log r_it = sg(log r_i) + logp_t - sg(logp_t), the same value with d log r_it / d logp_t = 1
    for its own token only. The two gradients agree when the advantage is constant over each
    sequence; they differ for per-token advantages."""

    kl_coef: float = 0.0
    """beta, the weight of the per-token KL to the reference policy. >= 0; when > 0 the caller
    must pass `ref_logp`."""

    kl_estimator: str = "k3"
    """KL estimator (SPEC 4): `k1`, `k2`, `k3` (TRL's, unclamped), `low_var_kl` (verl's
    clamped k3) or `abs`."""

    kl_bias_correction: bool = False
    """Multiply each token's KL by an importance ratio (differentiable), as in DeepSeek-V3.2 and
    TRL's `use_bias_correction_kl`; which ratio is `kl_bias_ratio`."""

    kl_bias_ratio: str = "token"
    """The ratio of `kl_bias_correction` (SPEC 4): `token` (r_t = exp(logp_t - old_t), the
    unbiased reverse-KL gradient) or `sequence` (the GSPO sequence ratio r_i of SPEC 1, with
    the gradient of `seq_ratio_grad`; what TRL multiplies by under
    `importance_sampling_level="sequence"`). `sequence` couples the tokens of a sequence."""

    entropy_coef: float = 0.0
    """c_H, the weight of the entropy bonus: the loss gets -c_H * H_t per token. >= 0."""

    temperature: float = 1.0
    """tau: logits are divided by it before the softmax. Must be finite and > 0; use the
    sampler's temperature so that training log-probs match the rollout's."""

    agg: str = "token-mean"
    """How per-token losses become one scalar (SPEC 5): `token-mean`, `seq-mean-token-mean`,
    `seq-mean-token-sum`, `seq-mean-token-sum-norm` or `token-sum` (verl: the plain masked sum,
    no normaliser)."""

    num_tokens: float | None = None
    """Global token count for `token-mean` (across data-parallel ranks and gradient
    accumulation steps; TRL `num_items_in_batch`). None = the local sum of the mask. May also be
    passed as a 0-dim tensor to `policy_loss` to avoid a host sync."""

    num_seqs: float | None = None
    """Global sequence count B for the `seq-mean-*` aggregations. None = the local batch size."""

    max_len: int | None = None
    """L_max for `seq-mean-token-sum-norm` (Dr.GRPO). None = the padded length T."""

    rollout_is: str | None = None
    """Rollout correction (SPEC 3): None (off), `token` or `sequence` truncated importance
    sampling between the trainer's pi_old and the sampler's own log-probs (`rollout_logp`)."""

    rollout_is_cap: float | None = 2.0
    """Cap C of the rollout IS weight. Must be > 0 when `rollout_is` is set."""

    rollout_is_mode: str = "truncate"
    """`truncate` (w = clamp(w, C_min, C)) or `mask` (w = w * 1[C_min <= w <= C])."""

    rollout_is_floor: float | None = None
    """Lower bound C_min of the rollout IS weight (TRL `vllm_importance_sampling_clip_min`;
    IcePop masks outside [C_min, C]). None: no lower bound. Otherwise a finite number >= 0 and
    < `rollout_is_cap`; only used when `rollout_is` is set."""

    sapo_tau_pos: float = 1.0
    """SAPO gate temperature for A > 0. Must be > 0."""

    sapo_tau_neg: float = 1.05
    """SAPO gate temperature for A <= 0. Must be > 0."""

    # ------------------------------------------------------------------ validation
    def __post_init__(self) -> None:
        def bad(name: str, expected: str) -> ValueError:
            return ValueError(
                f"LossConfig.{name}={getattr(self, name)!r} is invalid: expected {expected}"
            )

        def choice(name: str, allowed: tuple) -> None:
            if getattr(self, name) not in allowed:
                raise bad(name, "one of " + ", ".join(repr(a) for a in allowed))

        def real(name: str, expected: str, ok, optional: bool = False) -> None:
            v = getattr(self, name)
            if v is None and optional:
                return
            if not _is_real(v) or not math.isfinite(v) or not ok(v):
                raise bad(name, expected)

        choice("policy", POLICIES)
        choice("ratio_level", RATIO_LEVELS)
        choice("kl_estimator", KL_ESTIMATORS)
        choice("agg", AGGS)
        choice("rollout_is", ROLLOUT_IS_LEVELS + (None,))
        choice("rollout_is_mode", ROLLOUT_IS_MODES)
        choice("seq_ratio_grad", SEQ_RATIO_GRADS)
        choice("kl_bias_ratio", KL_BIAS_RATIOS)
        if self.seq_ratio_grad != "mean" and self.ratio_level != "sequence":
            raise bad(
                "seq_ratio_grad",
                f"'mean' unless ratio_level='sequence' (it is the gradient of the sequence "
                f"ratio; ratio_level={self.ratio_level!r})",
            )
        real("clip_low", "a finite number in [0, 1]", lambda v: 0.0 <= v <= 1.0)
        real("clip_high", "a finite number >= 0", lambda v: v >= 0.0)
        real("clip_dual", "None or a finite number > 1", lambda v: v > 1.0, optional=True)
        real(
            "clip_delta",
            f"None or a finite number > 1 + clip_high = {1 + self.clip_high}",
            lambda v: v > 1.0 + self.clip_high,
            optional=True,
        )
        real("kl_coef", "a finite number >= 0", lambda v: v >= 0.0)
        real("entropy_coef", "a finite number >= 0", lambda v: v >= 0.0)
        real("temperature", "a finite number > 0", lambda v: v > 0.0)
        real("num_tokens", "None or a finite number > 0", lambda v: v > 0, optional=True)
        real("num_seqs", "None or a finite number > 0", lambda v: v > 0, optional=True)
        if self.max_len is not None and (
            not isinstance(self.max_len, int) or isinstance(self.max_len, bool) or self.max_len < 1
        ):
            raise bad("max_len", "None or an int >= 1")
        real("rollout_is_cap", "None or a finite number > 0", lambda v: v > 0.0, optional=True)
        if self.rollout_is is not None and self.rollout_is_cap is None:
            raise bad(
                "rollout_is_cap",
                f"a finite number > 0 because rollout_is={self.rollout_is!r} is set",
            )
        real(
            "rollout_is_floor",
            f"None or a finite number >= 0 and < rollout_is_cap = {self.rollout_is_cap}",
            lambda v: v >= 0.0 and (self.rollout_is_cap is None or v < self.rollout_is_cap),
            optional=True,
        )
        real("sapo_tau_pos", "a finite number > 0", lambda v: v > 0.0)
        real("sapo_tau_neg", "a finite number > 0", lambda v: v > 0.0)
        if not isinstance(self.kl_bias_correction, bool):
            raise bad("kl_bias_correction", "a bool")

    # ------------------------------------------------------------------ helpers
    def replace(self, **overrides: Any) -> LossConfig:
        """A copy with `overrides` applied (and validated). Unknown names raise a ValueError."""
        known = {f.name for f in fields(self)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"unknown LossConfig field(s) {unknown}; known fields: {sorted(known)}"
            )
        return replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    # ------------------------------------------------------------------ presets (SPEC 5)
    @classmethod
    def _preset(cls, base: dict[str, Any], overrides: dict[str, Any]) -> LossConfig:
        return cls().replace(**{**base, **overrides})

    @classmethod
    def ppo(cls, **overrides: Any) -> LossConfig:
        """PPO: clip 0.2 / 0.2, token ratios, no KL (shaping is the trainer's), token-mean."""
        return cls._preset({}, overrides)

    @classmethod
    def grpo(cls, **overrides: Any) -> LossConfig:
        """GRPO: clip 0.2 / 0.2, token ratios, k3 KL with beta = 0.04, seq-mean-token-mean."""
        base = dict(kl_coef=0.04, kl_estimator="k3", agg="seq-mean-token-mean")
        return cls._preset(base, overrides)

    @classmethod
    def dapo(cls, **overrides: Any) -> LossConfig:
        """DAPO: clip-higher 0.2 / 0.28, token ratios, no KL, token-mean (over the global count)."""
        return cls._preset(dict(clip_high=0.28), overrides)

    @classmethod
    def dr_grpo(cls, **overrides: Any) -> LossConfig:
        """Dr.GRPO: clip 0.2 / 0.2, no KL, seq-mean-token-sum-norm (constant normaliser)."""
        return cls._preset(dict(agg="seq-mean-token-sum-norm"), overrides)

    @classmethod
    def gspo(cls, **overrides: Any) -> LossConfig:
        """GSPO: sequence-level ratio, clip 3e-4 / 4e-4, no KL, seq-mean-token-mean."""
        base = dict(
            clip_low=3e-4, clip_high=4e-4, ratio_level="sequence", agg="seq-mean-token-mean"
        )
        return cls._preset(base, overrides)

    @classmethod
    def cispo(cls, **overrides: Any) -> LossConfig:
        """CISPO: stop-gradient IS weight clipped to [0, 5], no KL, token-mean."""
        return cls._preset(dict(policy="cispo", clip_low=1.0, clip_high=4.0), overrides)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> LossConfig:
        """A preset by name: one of `PRESETS`."""
        if name not in PRESETS:
            raise ValueError(f"unknown LossConfig preset {name!r}; expected one of {PRESETS}")
        return getattr(cls, name)(**overrides)


PRESETS = ("ppo", "grpo", "dapo", "dr_grpo", "gspo", "cispo")


def resolve_config(config: LossConfig | str | None, overrides: dict[str, Any]) -> LossConfig:
    """The config a loss call uses: `config` (a LossConfig, a preset name or None = ppo) with
    keyword `overrides` of LossConfig fields applied."""
    if config is None:
        config = LossConfig()
    elif isinstance(config, str):
        config = LossConfig.preset(config)
    elif not isinstance(config, LossConfig):
        raise ValueError(
            f"config must be a LossConfig, a preset name or None, got {type(config).__name__}"
        )
    return config.replace(**overrides) if overrides else config


# ====================================================================== trainer configuration
ALGOS = ("ppo", "grpo", "dapo")
LR_SCHEDULES = ("constant", "linear", "cosine")
TRAIN_DTYPES = ("auto", "fp32", "bf16")
REPORT_TO = ("none", "tensorboard")


@dataclass
class TrainConfig:
    """Every option of the minimal trainer (`fastrl train`); each field is a CLI flag
    (`batch_size` -> `--batch-size`) whose help text is the field's docstring. The defaults are
    the embedded default run, which learns on a CPU in minutes. Checked by `validate()` before
    anything is loaded or trained."""

    algo: str = "grpo"
    """Algorithm: `ppo` (policy + critic, GAE on token rewards, clipped value loss), `grpo` (G
    samples per prompt, group advantages, k3 KL to a frozen reference) or `dapo` (clip-higher,
    global token-mean, dynamic sampling, overlong shaping and filtering, no KL / reference)."""

    loss: str | None = None
    """The LossConfig preset of the policy loss: ppo, grpo, dapo, dr_grpo, gspo or cispo (None:
    the preset named like --algo). --algo chooses the pipeline (rollout, advantages, critic),
    --loss the loss on it; a preset with a KL term (grpo) loads a frozen reference."""

    model: str | None = None
    """A local Hugging Face causal LM directory (save_pretrained output). None: the embedded
    tiny random-init Qwen2 with the packaged character tokenizer (nothing is downloaded)."""

    task: str = "add"
    """A built-in task (`add`: the sum of two numbers from 0 to 49, `47+38=` -> `85`, exact
    answer; `add_format`: the same with a format + answer reward; `arith`: addition and
    subtraction of numbers from 0 to 99; `add_small`: single digits) or a .jsonl file of
    {"prompt", "answer"} lines."""

    reward: str | None = None
    """Reward function for the task: a built-in name (exact_match, last_number, bracket_format)
    or `module:function` taking (completion, answer) -> float, where the module is importable
    from the current directory (as with `python -m`) or sys.path. None: the task's own. A call
    that raises, hangs past --reward-timeout, or returns a non-number, a non-finite number or
    |r| > 1e6 scores 0 and is counted (the first of each kind is printed with its traceback, and
    each step with failures prints a warning); SystemExit / KeyboardInterrupt raised by it stop
    the run with a checkpoint."""

    eval_file: str | None = None
    """A .jsonl file of {"prompt", "answer"} lines to evaluate on (held-out data). None: built-in
    tasks evaluate on a fixed set drawn from a stream disjoint from training; a .jsonl task holds
    out --eval-split of its lines (never trained on)."""

    eval_split: float = 0.1
    """A .jsonl task without --eval-file: the fraction of its lines (seeded shuffle, at most
    --eval-size) held out for evaluation and never trained on. 0: evaluate on the first
    --eval-size training lines (then eval accuracy is training accuracy)."""

    reward_timeout: float = 5.0
    """Seconds one reward call may take; a longer call scores 0 and is counted as a timeout.
    A module:function reward runs in a worker process (its module imported again there), which
    is killed and restarted when a call runs past the limit: any call is stopped, also one that
    holds the GIL (a pure-Python loop, a catastrophically backtracking regex); 5 timeouts in a
    row stop the run with an error. The built-in rewards, and from Python a reward callable
    that another process cannot import by name (a lambda, a closure, a function of __main__),
    run in a thread instead, where a call that holds the GIL cannot be stopped (it stalls the
    run) and a timed-out call keeps running in the background (more than 4 at once stop the
    run). 0: no limit, calls run in the main thread (for reward functions that need it, e.g.
    ones that use signals)."""

    steps: int = 100
    """Number of RL steps (one rollout batch each, then `epochs` passes of updates)."""

    batch_size: int = 32
    """Prompts per RL step across all ranks (each gets `group_size` samples)."""

    group_size: int = 8
    """Samples per prompt (G). Must be >= 2 for grpo and dapo (group advantages)."""

    lr: float = 1e-3
    """Peak AdamW learning rate of the policy."""

    lr_schedule: str = "constant"
    """Learning-rate schedule after the linear warm-up: `constant`, `linear` (to 0 at the last
    optimizer step) or `cosine` (to 0 at the last optimizer step)."""

    max_new_tokens: int = 6
    """Longest completion, in tokens (EOS included). Must be >= 1."""

    seed: int = 0
    """Seed of everything: model init, task sampling, rollout sampling, shuffling."""

    out: str = "runs/fastrl"
    """Output directory: config.json, metrics.jsonl, curves.png and checkpoints/."""

    resume: str | None = None
    """Resume from this output directory's last complete checkpoint (the run continues exactly
    as if uninterrupted; the other options are taken from its config.json)."""

    force: bool = False
    """Start a fresh run in an --out directory that already holds a run (config.json,
    metrics.jsonl or checkpoints/), deleting that run's files. Without it such a directory is
    refused (unless --resume points at it)."""

    device: str = "auto"
    """`cpu`, `cuda`, `cuda:N` or `auto` (cuda when available). Under torchrun each rank uses
    cuda:LOCAL_RANK."""

    temperature: float = 1.0
    """Sampling temperature of the rollouts; the loss uses the same (training log-probs then
    match the sampler's)."""

    top_k: int | None = None
    """Rollout top-k sampling (None: off). The loss then uses the same truncation: every
    log-prob (pi_old, pi_ref, the trained policy) is under the top-k / top-p truncated,
    renormalised distribution of that model's own logits, with the sampled token always kept in
    the support; for pi_old this equals the sampler's log-prob (metric sampler_logp_gap)."""

    top_p: float | None = None
    """Rollout nucleus (top-p) sampling in (0, 1] (None: off); the loss uses the same
    truncation (see --top-k)."""

    dtype: str = "auto"
    """Compute precision: `fp32`, `bf16` (bf16 autocast of forwards, fp32 weights, optimizer
    and loss; on CPU too, where it is usually slower) or `auto` (bf16 on CUDA, fp32 on CPU)."""

    gradient_checkpointing: bool = False
    """Recompute the policy's (and critic's) activations in the backward (Hugging Face
    gradient checkpointing): less memory, about 30% more compute per update."""

    report_to: str = "none"
    """`tensorboard`: also log every metric to OUT/tensorboard (needs the optional `tensorboard`
    package: pip install "fastrl[tensorboard]"). metrics.jsonl is always written."""

    epochs: int = 1
    """K: passes over each rollout batch."""

    minibatches: int = 2
    """Optimizer steps per epoch: the rollout batch is shuffled and split into this many."""

    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation; the loss normaliser is the token
    / sequence count of the whole optimizer step across ranks)."""

    warmup_steps: int = 5
    """Linear learning-rate warm-up, in optimizer steps."""

    max_grad_norm: float = 1.0
    """Gradient clipping (global L2 norm)."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    kl_coef: float | None = None
    """KL weight beta. grpo: k3 KL in the loss (None = 0.04). ppo: KL-in-reward shaping
    coefficient (None = 0, no reference model). dapo: must be None or 0."""

    entropy_coef: float = 0.0
    """Entropy bonus weight in the loss."""

    clip_low: float | None = None
    """epsilon_low of the ratio clip (None: the algorithm's preset, 0.2)."""

    clip_high: float | None = None
    """epsilon_high of the ratio clip (None: the preset, 0.2; dapo 0.28)."""

    gamma: float = 1.0
    """ppo: discount of GAE."""

    lam: float = 0.95
    """ppo: lambda of GAE."""

    critic_lr: float = 1e-3
    """ppo: learning rate of the critic (a copy of the backbone with a fresh value head)."""

    vf_coef: float = 0.5
    """ppo: weight of the clipped value loss."""

    value_clip: float = 0.2
    """ppo: clip range of the value loss."""

    max_gen_batches: int = 4
    """dapo: most generation batches per step while dynamic sampling fills the batch."""

    overlong_cache: int | None = None
    """dapo: L_cache of the overlong reward shaping: the last L_cache tokens of the budget,
    where the penalty ramps from 0 to -overlong_factor. |y| counts the generated tokens before
    the EOS (the EOS itself is not length), so a response that ends with EOS within
    max_new_tokens - L_cache tokens is never penalised. None: max_new_tokens // 5 (the DAPO
    paper's 4096 of 20480), which is 0 (no shaping) below 5 tokens; 0 disables the shaping."""

    overlong_factor: float = 1.0
    """dapo: the largest overlong penalty."""

    overlong_filter: bool = True
    """dapo: truncated completions (no EOS) get loss mask 0."""

    sft_steps: int | None = None
    """Supervised warm-up steps before RL (0: none), on the task's warm-up examples (a .jsonl
    task: its training lines). None: 1000 for the embedded default (built-in task, no --model),
    0 otherwise (a user model or task starts RL from the model as given). On the built-in tasks
    the warm-up imitates a sloppy teacher whose answer is one too high 75% of the time: that
    teaches the format and most of the arithmetic but leaves greedy eval accuracy low (about
    10%); RL on the exact-answer reward then does the lifting."""

    sft_lr: float = 3e-3
    """Learning rate of the supervised warm-up."""

    sft_batch_size: int = 64
    """Examples per supervised warm-up step."""

    eval_every: int = 10
    """Evaluate (greedy, on a fixed eval set) every this many steps, at step 0 and at the end."""

    eval_size: int = 200
    """Eval prompts (fixed, disjoint from the training stream for built-in tasks)."""

    save_every: int = 50
    """Write a checkpoint every this many steps (and at the end); 0: only at the end. Each
    checkpoint holds a Hugging Face model directory, OUT/checkpoints/step-N/hf (save_pretrained
    of the policy and tokenizer), that AutoModelForCausalLM.from_pretrained and --model load."""

    save_total_limit: int | None = 2
    """How many checkpoints to keep under OUT/checkpoints, the newest included (TRL's / HF
    TrainingArguments' name): after each save the oldest are deleted, each deletion printed.
    None or 0: keep every checkpoint."""

    max_time: float = 0.0
    """Stop after this many seconds of RL (checked after each step; evaluates and saves as at
    the last step). 0: no limit, run --steps steps."""

    fsdp: bool = False
    """Shard the policy (and critic / reference) with PyTorch FSDP2 (fully_shard: each decoder
    layer, then the whole model) across the torchrun ranks instead of replicating it with DDP.
    The LM-head log-probs then come from the last hidden states through fastrl.linear_logprobs /
    fused_linear_policy_loss (never the (n, T, V) logits; not with --top-k / --top-p).
    Checkpoints hold the full weights and the Hugging Face export; an --fsdp run cannot be
    resumed (start a new one with --model OUT/checkpoints/step-N/hf)."""

    model_hidden: int = 64
    """Embedded model only: hidden size."""

    model_layers: int = 2
    """Embedded model only: number of decoder layers."""

    num_threads: int = 0
    """CPU threads for torch (0: all cores of this process's share)."""

    progress: bool = True
    """Show a tqdm progress bar (reward, KL, entropy)."""

    def validate(self) -> None:
        """Raise ValueError naming the option and what to fix."""

        def bad(name: str, expected: str) -> ValueError:
            flag = "--" + name.replace("_", "-")
            return ValueError(f"{flag}={getattr(self, name)!r} is invalid: expected {expected}")

        if self.algo not in ALGOS:
            raise bad("algo", "one of " + ", ".join(ALGOS))
        for name in (
            "steps",
            "batch_size",
            "epochs",
            "minibatches",
            "grad_accum",
            "max_gen_batches",
            "eval_every",
            "eval_size",
            "sft_batch_size",
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise bad(name, "an integer >= 1")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens <= 0:
            raise bad("max_new_tokens", "an integer >= 1")
        if not isinstance(self.group_size, int) or self.group_size < 1:
            raise bad("group_size", "an integer >= 1")
        if self.algo in ("grpo", "dapo") and self.group_size < 2:
            raise bad("group_size", f">= 2 for {self.algo} (group advantages need 2+ samples)")
        for name in ("warmup_steps", "sft_steps", "save_every", "num_threads", "overlong_cache"):
            v = getattr(self, name)
            if v is None and name in ("sft_steps", "overlong_cache"):
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad(name, "an integer >= 0")
        for name, choices in (
            ("lr_schedule", LR_SCHEDULES),
            ("dtype", TRAIN_DTYPES),
            ("report_to", REPORT_TO),
        ):
            if getattr(self, name) not in choices:
                raise bad(name, "one of " + ", ".join(choices))
        if self.loss is not None and self.loss not in PRESETS:
            raise bad("loss", "None or a LossConfig preset: " + ", ".join(PRESETS))
        if self.top_k is not None and (
            not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 1
        ):
            raise bad("top_k", "None or an integer >= 1")
        if self.top_p is not None and (not _is_real(self.top_p) or not 0 < self.top_p <= 1):
            raise bad("top_p", "None or a number in (0, 1]")
        if not _is_real(self.eval_split) or not 0 <= self.eval_split < 1:
            raise bad("eval_split", "a fraction in [0, 1)")
        if not _is_real(self.max_time) or not 0 <= self.max_time < math.inf:
            raise bad("max_time", "a finite number of seconds >= 0 (0: no limit)")
        for name in ("lr", "critic_lr", "max_grad_norm", "sft_lr"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or v <= 0:
                raise bad(name, "a finite number > 0")
        for name in ("weight_decay", "entropy_coef", "vf_coef", "overlong_factor"):
            v = getattr(self, name)
            if not _is_real(v) or not math.isfinite(v) or v < 0:
                raise bad(name, "a finite number >= 0")
        if not _is_real(self.temperature) or not self.temperature > 0:
            raise bad("temperature", "a number > 0")
        if not _is_real(self.reward_timeout) or not 0 <= self.reward_timeout < math.inf:
            raise bad("reward_timeout", "a finite number of seconds >= 0 (0: no limit)")
        if self.save_total_limit is not None and (
            not isinstance(self.save_total_limit, int)
            or isinstance(self.save_total_limit, bool)
            or self.save_total_limit < 0
        ):
            raise bad("save_total_limit", "None or an integer >= 0 (None / 0: keep every one)")
        if self.kl_coef is not None and (not _is_real(self.kl_coef) or self.kl_coef < 0):
            raise bad("kl_coef", "None or a number >= 0")
        if self.algo == "dapo" and self.kl_coef:
            raise bad("kl_coef", "None or 0 for dapo (DAPO has no KL term and no reference)")
        if (
            self.algo == "dapo"
            and self.overlong_cache is not None
            and self.overlong_cache >= self.max_new_tokens
        ):
            raise bad("overlong_cache", f"< max_new_tokens = {self.max_new_tokens}")
        if self.batch_size * self.group_size < self.minibatches * self.grad_accum:
            raise bad("minibatches", "minibatches * grad_accum <= batch_size * group_size")
        if not (0 <= self.gamma <= 1 and 0 <= self.lam <= 1):
            raise bad("gamma", "gamma and lam in [0, 1]")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
