"""`TrainConfig`: every option of the minimal trainer (`fastrl train`), one dataclass field per CLI
flag. The loss library's own configuration (`LossConfig`) is `fastrl.config`."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from ..config import AGGS, PRESETS, LossConfig, LossConfigError, _is_finite32, _is_real

ALGOS = ("ppo", "grpo", "dapo")
LR_SCHEDULES = ("constant", "linear", "cosine")
TRAIN_DTYPES = ("auto", "fp32", "bf16")
REPORT_TO = ("none", "tensorboard")
SCALE_REWARDS = ("auto", "group", "none")


@dataclass
class TrainConfig:
    """Every option of the minimal trainer (`fastrl train`); each field is a CLI flag
    (`batch_size` -> `--batch-size`) whose help text is the field's docstring. The defaults are
    the embedded default run, which learns on a CPU in minutes. Checked by `validate()` before
    anything is loaded or trained."""

    algo: str = "grpo"
    """Algorithm: `ppo` (policy + critic, GAE on token rewards, clipped value loss), `grpo` (G
    samples per prompt, group advantages, k3 KL to a frozen reference) or `dapo` (clip-higher,
    global token-mean, dynamic sampling, overlong shaping and filtering, no KL / reference).
    The loss and its KL term are --loss's preset when given (see --loss, --kl-coef)."""

    loss: str | None = None
    """The LossConfig preset of the policy loss: ppo, grpo, dapo, dr_grpo, gspo or cispo (None:
    the preset named like --algo). --algo chooses the pipeline (rollout, advantages, critic),
    --loss the loss on it; a preset with a KL term (grpo) loads a frozen reference."""

    loss_agg: str | None = None
    """How the per-token losses become one number (a LossConfig `agg`: token-mean,
    seq-mean-token-mean, seq-mean-token-sum, seq-mean-token-sum-norm, token-sum). None:
    token-mean for `--algo grpo` with no --loss (every counted token of the step weighs the
    same, TRL's default loss_type "dapo"; the GRPO paper's per-sequence mean learned more
    slowly on the side-by-side benchmark), otherwise the --loss preset's own."""

    scale_rewards: str = "auto"
    """grpo / dapo: what the group advantages R - mean_g are divided by (SPEC 7, TRL's
    scale_rewards): `group` (the group's std + 1e-6) or `none` (R - mean_g, as Dr.GRPO).
    `auto`: none with --loss dr_grpo (Dr.GRPO drops both the length and the std normalisation),
    group otherwise. ppo (GAE advantages): must be auto."""

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
    that raises, hangs past --reward-timeout, or returns a non-number (a string such as "1"
    included; a bool counts as 0 / 1), a non-finite number or |r| > 1e6 scores 0 and is
    counted (the first of each kind is printed with its traceback, and each step with failures
    prints a warning); SystemExit / KeyboardInterrupt raised by it stop the run with a
    checkpoint."""

    eval_file: str | None = None
    """A .jsonl file of {"prompt", "answer"} lines to evaluate on (held-out data). None: built-in
    tasks evaluate on a fixed set drawn from their own random stream (a stream of its own, not
    held-out pairs: `add` has 2,500 distinct sums, so most eval prompts are also trained on, and
    eval accuracy measures the skill on the task's distribution); a .jsonl task holds
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

    lr_schedule: str = "linear"
    """Learning-rate schedule after the linear warm-up: `linear` (reaching 0 just after the
    last optimizer step of --steps, which runs at lr / its count, as TRL's default; a run cut
    short by --max-time stops before the end of the decay), `cosine` (the same end) or
    `constant`."""

    max_new_tokens: int = 6
    """Longest completion, in tokens (EOS included). Must be >= 1."""

    seed: int = 0
    """Seed of everything: model init, task sampling, rollout sampling, shuffling."""

    out: str = "runs/fastrl"
    """Output directory: config.json, metrics.jsonl, curves.png and checkpoints/."""

    resume: str | None = None
    """Resume from this output directory's last complete checkpoint (the run continues exactly
    as if uninterrupted; the other options are taken from its config.json, except --steps,
    --device, --dtype, --progress, --num-threads, --save-every, --eval-every,
    --reward-timeout, --max-time and --report-to, which may be given anew). A .jsonl --task
    or --eval-file whose contents changed since the checkpoint is refused."""

    force: bool = False
    """Start a fresh run in an --out directory that already holds a run (config.json,
    metrics.jsonl or checkpoints/), deleting what a run writes there: metrics.jsonl,
    curves.png and the checkpoints/ and tensorboard/ folders whole (with anything put in them),
    and writing config.json anew; other files stay. Without it such a directory is refused
    (unless --resume points at it)."""

    device: str = "auto"
    """`cpu`, `cuda`, `cuda:N` or `auto` (cuda when available). Under torchrun each rank uses
    cuda:LOCAL_RANK (give `cuda` or `auto`: an explicit index is refused there). On a CUDA GPU
    with native bf16 (compute capability 8.0 or newer) and --dtype bf16, a --model uses
    flash_attention_2 when a usable flash-attn is installed, else SDPA (eager attention for an
    architecture without SDPA, e.g. Gemma2)."""

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
    and loss; on CPU too, where it is usually slower) or `auto` (bf16 on a CUDA GPU with native
    bf16, compute capability 8.0 or newer; else fp32: on a V100 or T4 bf16 is emulated)."""

    gradient_checkpointing: bool = False
    """Recompute the policy's (and critic's) activations in the backward (Hugging Face
    gradient checkpointing): less memory, about 30% more compute per update."""

    report_to: str = "none"
    """`tensorboard`: also log every metric to OUT/tensorboard (needs the optional `tensorboard`
    package: pip install tensorboard, or pip install -e ".[tensorboard]" in a checkout of fastrl).
    metrics.jsonl is always written."""

    epochs: int = 1
    """K: passes over each rollout batch."""

    minibatches: int | None = None
    """Optimizer steps per epoch: the rollout batch is shuffled and split into this many. None:
    1 for grpo and dapo (one optimizer step per rollout batch, as TRL's GRPOTrainer does by
    default; two half-batches learned more slowly on the learning benchmark), 2 for ppo."""

    grad_accum: int = 1
    """Micro-batches per optimizer step (gradient accumulation; the loss normaliser is the token
    / sequence count of the whole optimizer step across ranks)."""

    warmup_steps: int = 0
    """Linear learning-rate warm-up, in schedule steps: one per minibatch, including one that
    takes no optimizer step because nothing in it can move the policy (0: none, TRL's
    default)."""

    max_grad_norm: float = 1.0
    """Gradient clipping: each model's gradient scaled to at most this L2 norm over all of its
    parameters (the policy's, and ppo's critic's on its own; also the warm-up's)."""

    weight_decay: float = 0.0
    """AdamW weight decay, on every parameter of the policy and critic (biases and norm weights
    included: there are no separate parameter groups)."""

    adam_beta1: float = 0.9
    """AdamW beta1 (the decay of the gradient's running mean)."""

    adam_beta2: float = 0.999
    """AdamW beta2 (the decay of the squared gradient's running mean; torch's and TRL's default
    0.999: with 0.99 the step size followed single noisy batches more and learned more slowly
    on the side-by-side benchmark)."""

    kl_coef: float | None = None
    """KL weight beta. grpo / dapo: the in-loss k3 KL (None: the loss preset's own, --loss's
    else --algo's: grpo 0.04, the others 0; so --algo dapo --loss grpo has a KL of 0.04 and a
    reference model). dapo: a value other than None or 0 is refused. ppo: the KL-in-reward
    shaping coefficient (None = 0, no shaping); refused with a --loss preset that has its own
    in-loss KL (grpo), which it would leave in place. A reference model is loaded whenever
    either KL is nonzero."""

    entropy_coef: float = 0.0
    """Entropy bonus weight in the loss."""

    skip_zero_advantage: bool = True
    """grpo / dapo: forward only the sequences that can move the policy. With no KL term and no
    entropy bonus, a sequence whose advantage is 0 (every reward of its group equal) or whose
    tokens are all masked adds exactly 0 to the loss and to its gradient, so its pi_old forward
    and its training forward + backward are skipped, while the loss normalisers still count it:
    the same update up to rounding, at the cost of the informative sequences only. Entropy,
    clipfrac and approx_kl are then averaged over the trained sequences. False: forward every
    sequence of a minibatch that has one such sequence (those metrics over its whole batch). On
    or off, a minibatch with none on any rank takes no optimizer step (only the schedule's)."""

    clip_low: float | None = None
    """epsilon_low of the ratio clip (None: the preset's, that of --loss when given, else of
    --algo: 0.2 for ppo, grpo and dapo; gspo 3e-4, cispo 1.0)."""

    clip_high: float | None = None
    """epsilon_high of the ratio clip (None: the preset's, that of --loss when given, else of
    --algo: 0.2 for ppo and grpo, 0.28 for dapo; gspo 4e-4, cispo 4.0)."""

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
    teaches the format and most of the arithmetic but leaves greedy eval accuracy low (on
    `add` between 0 and 25% depending on the seed and the CPU); RL on the exact-answer reward
    then does the lifting."""

    sft_lr: float = 3e-3
    """Learning rate of the supervised warm-up."""

    sft_batch_size: int = 64
    """Examples per supervised warm-up step."""

    eval_every: int = 10
    """Evaluate (greedy, on a fixed eval set) every this many steps, at step 0 and at the end.
    `eval_accuracy` is the share of completions whose reward is >= 1, the full reward of every
    built-in task (with a --reward of your own that tops out below 1 it always reads 0)."""

    eval_size: int = 200
    """Eval prompts (fixed; for built-in tasks drawn from their own random stream, whose
    prompts the training stream may also draw)."""

    save_every: int = 50
    """Write a checkpoint every this many steps (and at the end); 0: only at the end. Each
    checkpoint holds a Hugging Face model directory, OUT/checkpoints/step-N/hf (save_pretrained
    of the policy and tokenizer), that AutoModelForCausalLM.from_pretrained and --model load."""

    save_total_limit: int | None = 2
    """How many checkpoints to keep under OUT/checkpoints, the newest included (TRL's / HF
    TrainingArguments' name): after each save the oldest are deleted, each deletion printed.
    None or 0: keep every checkpoint."""

    max_time: float = 0.0
    """Stop after this many seconds of RL: the RL loop's wall time, its evaluations and
    checkpoints included (checked after each step; that step then evaluates and saves as the
    last one does, so a run ends up to one step, one eval and one save past the limit). 0: no
    limit, run --steps steps."""

    fsdp: bool = False
    """Shard the policy (and critic / reference) with PyTorch FSDP2 (fully_shard: each
    transformer block the model's _no_split_modules names, then the whole model) across the
    torchrun ranks instead of replicating it with DDP. The LM-head log-probs then come from the
    last hidden states through fastrl.linear_logprobs / fused_linear_policy_loss (never the
    (n, T, V) logits), where one forward shows the head alone gives the model's logits (not
    with --top-k / --top-p, a logit softcap or a scale after the head: those use the logits).
    Checkpoints hold the full weights and the Hugging Face export; an --fsdp run cannot be
    resumed (start a new one with --model OUT/checkpoints/step-N/hf)."""

    model_hidden: int = 64
    """Embedded model only (with --model it is ignored, with a warning): hidden size, a
    multiple of 8 (4 attention heads)."""

    model_layers: int = 2
    """Embedded model only (with --model it is ignored, with a warning): number of decoder
    layers."""

    num_threads: int = 0
    """CPU threads for torch (0: automatic: 1 for a model under 10M parameters, whose thread
    hand-offs cost more than its matmuls, else all cores of this process's share)."""

    progress: bool = True
    """Show a tqdm progress bar (reward, KL, entropy)."""

    @property
    def n_minibatches(self) -> int:
        """--minibatches, or the algorithm's default when it is None."""
        if self.minibatches is not None:
            return self.minibatches
        return 2 if self.algo == "ppo" else 1

    @property
    def advantage_scale(self) -> str:
        """--scale-rewards resolved: `group_advantages`' scale, "group" or "none"."""
        if self.scale_rewards != "auto":
            return self.scale_rewards
        return "none" if self.loss == "dr_grpo" else "group"

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
            "grad_accum",
            "max_gen_batches",
            "eval_every",
            "eval_size",
            "sft_batch_size",
            "model_hidden",
            "model_layers",
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
            ("scale_rewards", SCALE_REWARDS),
        ):
            if getattr(self, name) not in choices:
                raise bad(name, "one of " + ", ".join(choices))
        if self.algo == "ppo" and self.scale_rewards != "auto":
            raise bad("scale_rewards", "auto with --algo ppo (its advantages are GAE's)")
        if self.loss is not None and self.loss not in PRESETS:
            raise bad("loss", "None or a LossConfig preset: " + ", ".join(PRESETS))
        if self.loss_agg is not None and self.loss_agg not in AGGS:
            raise bad("loss_agg", "None or one of " + ", ".join(AGGS))
        for name in ("adam_beta1", "adam_beta2"):
            v = getattr(self, name)
            if not _is_real(v) or not 0 <= v < 1:
                raise bad(name, "a number in [0, 1)")
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
        # used in fp32 tensors: 1e39 is a finite Python float but inf there
        for name in ("lr", "critic_lr", "max_grad_norm", "sft_lr"):
            v = getattr(self, name)
            if not _is_finite32(v) or v <= 0:
                raise bad(name, "a number > 0, finite in fp32 (<= 3.4e38)")
        for name in ("weight_decay", "vf_coef", "overlong_factor", "value_clip"):
            v = getattr(self, name)
            if not _is_finite32(v) or v < 0:
                raise bad(name, "a number >= 0, finite in fp32 (<= 3.4e38)")
        if not _is_finite32(self.temperature) or self.temperature < 1e-3:
            raise bad("temperature", "a number in [0.001, 3.4e38] (lower ones overflow z / τ)")
        if (
            not isinstance(self.seed, int)
            or isinstance(self.seed, bool)
            or not 0 <= self.seed < 2**32
        ):
            raise bad("seed", "an integer in [0, 2**32 - 1]")
        if self.model_hidden % 8:
            raise bad("model_hidden", "a multiple of 8 (4 attention heads of an even size)")
        if not _is_real(self.reward_timeout) or not 0 <= self.reward_timeout < math.inf:
            raise bad("reward_timeout", "a finite number of seconds >= 0 (0: no limit)")
        if self.save_total_limit is not None and (
            not isinstance(self.save_total_limit, int)
            or isinstance(self.save_total_limit, bool)
            or self.save_total_limit < 0
        ):
            raise bad("save_total_limit", "None or an integer >= 0 (None / 0: keep every one)")
        if self.kl_coef is not None and (not _is_finite32(self.kl_coef) or self.kl_coef < 0):
            raise bad("kl_coef", "None or a number >= 0, finite in fp32 (<= 3.4e38)")
        if self.algo == "dapo" and self.kl_coef:
            raise bad("kl_coef", "None or 0 for dapo (DAPO has no KL term and no reference)")
        preset_kl = LossConfig.preset(self.loss).kl_coef if self.loss in PRESETS else 0.0
        if self.algo == "ppo" and self.kl_coef is not None and preset_kl:
            # ppo reads kl_coef as its reward shaping; the preset's in-loss KL would stay
            raise bad(
                "kl_coef",
                f"None with --algo ppo --loss {self.loss}: for ppo it is the KL-in-reward "
                f"coefficient, and the {self.loss} preset keeps its own k3 KL in the loss "
                f"({preset_kl}), which it does not change. Use a --loss without a KL term (e.g. "
                "ppo) for reward shaping, or --algo grpo to set the in-loss KL",
            )
        if (
            self.algo == "dapo"
            and self.overlong_cache is not None
            and self.overlong_cache >= self.max_new_tokens
        ):
            raise bad("overlong_cache", f"< max_new_tokens = {self.max_new_tokens}")
        if self.minibatches is not None and (
            not isinstance(self.minibatches, int)
            or isinstance(self.minibatches, bool)
            or self.minibatches < 1
        ):
            raise bad("minibatches", "None or an integer >= 1")
        if self.batch_size * self.group_size < self.n_minibatches * self.grad_accum:
            default = self.minibatches is None  # then --grad-accum is what exceeds
            raise bad(
                "grad_accum" if default else "minibatches",
                f"minibatches * grad_accum <= batch_size * group_size, here {self.n_minibatches}"
                f" * {self.grad_accum} > {self.batch_size} * {self.group_size}"
                + (f" (--minibatches None is {self.n_minibatches} for --algo {self.algo})"
                   if default else ""),
            )  # fmt: skip
        for name in ("gamma", "lam"):
            v = getattr(self, name)
            if not _is_real(v) or not 0 <= v <= 1:
                raise bad(name, "a number in [0, 1]")
        # the run's LossConfig, checked by LossConfig itself; its errors named as the flags
        try:
            loss_config(self)
        except ValueError as e:
            if isinstance(e, LossConfigError) and e.field in _LOSS_FLAGS:
                raise bad(_LOSS_FLAGS[e.field], e.expected) from None
            raise ValueError(f"--loss {self.loss or self.algo} with these options: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# LossConfig's fields that the run's options set (loss_config), and the option that sets each
_LOSS_FLAGS = {
    "clip_low": "clip_low",
    "clip_high": "clip_high",
    "kl_coef": "kl_coef",
    "entropy_coef": "entropy_coef",
    "temperature": "temperature",
    "agg": "loss_agg",
    "max_len": "max_new_tokens",
}


def loss_config(cfg: TrainConfig) -> LossConfig:
    """The --loss preset (default: the one named like --algo) with the run's overrides (the
    aggregation: --loss-agg, or token-mean for --algo grpo without --loss)."""
    over = {"temperature": cfg.temperature, "entropy_coef": cfg.entropy_coef}
    if cfg.clip_low is not None:
        over["clip_low"] = cfg.clip_low
    if cfg.clip_high is not None:
        over["clip_high"] = cfg.clip_high
    if cfg.algo != "ppo" and cfg.kl_coef is not None:  # ppo: kl_coef shapes the reward
        over["kl_coef"] = cfg.kl_coef
    preset = cfg.loss or cfg.algo
    if cfg.loss_agg is not None:
        over["agg"] = cfg.loss_agg
    elif cfg.loss is None and cfg.algo == "grpo":  # the trainer's choice, not the preset's
        over["agg"] = "token-mean"
    loss_cfg = LossConfig.preset(preset, **over)
    if loss_cfg.agg == "seq-mean-token-sum-norm":  # dr_grpo: the normaliser is the budget,
        loss_cfg = loss_cfg.replace(max_len=cfg.max_new_tokens)  # not the batch's longest
    return loss_cfg
