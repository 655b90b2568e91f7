"""Building a run from its TrainConfig. `build` makes the Run and the first TrainState (checks of
the options and of --out, device, task, eval set, reward scorer, model and tokenizer, loss config,
the run's RNGs); `setup` readies the state for training (supervised warm-up, reference and
critic, optimizer and learning-rate schedule, DDP / FSDP2), or loads it from a checkpoint."""

from __future__ import annotations

import copy
import gc
import hashlib
import math
import os
import random
from collections.abc import Callable

import numpy as np
import torch
import torch.distributed as dist

from .algos import ValueModel
from .common import rank_world
from .config import TrainConfig, loss_config
from .report import Console
from .rewards import RewardScorer
from .rollout import CHARS, eos_ids, lm_head_fusable, load_model
from .rollout_phase import supervised_warmup
from .rundir import check_out_creatable, check_out_dir
from .runlog import tensorboard_writer_class
from .saving import resume, resume_candidates
from .state import Run, TrainState
from .tasks import (
    BUILTIN_TASKS,
    EpochOrder,
    Example,
    JsonlTask,
    Task,
    get_task,
    load_jsonl,
    prompt_stream,
)

DEFAULT_SFT_STEPS = 1000
"""Supervised warm-up steps of the embedded default (built-in task, no --model)."""


# --------------------------------------------------------------------------- build
def build(cfg: TrainConfig, log, load_models: Callable[[], tuple]) -> tuple[Run, TrainState]:
    """The Run of `cfg` (validated; the process group of a torchrun run up) and its TrainState
    before `setup`: the policy on its device, seeded, and the run's RNGs at step 0.

    `log`: where rank 0's lines go; `load_models()`: (model, tokenizer) of the run (`Trainer`'s
    `_load_models`, i.e. `load_models(cfg)`). Bad input raises ValueError, and everything that
    can be checked without the model is checked before it loads (options, --out, the task)."""
    rank, world = rank_world()
    console = Console(log, rank, world)
    check_options(cfg, world)
    check_out_creatable(cfg.out)
    check_out_dir(cfg)
    device = pick_device(cfg.device, world)
    auto_dtype = "bf16" if native_bf16(device) else "fp32"
    data_sha256 = data_fingerprints(cfg)  # (just before reading them)
    task = get_task(cfg.task, cfg.reward)  # raises on unknown task / bad JSONL
    eval_set = eval_examples(cfg, task, console.log)  # held-out lines leave the training set
    scorer = RewardScorer(task.reward_fn, cfg.reward_timeout, report=console.report)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    model, tok = load_models()
    disable_dropout(model)  # (the reference copy and ppo's critic are copies of it)
    if cfg.model is None:
        check_vocabulary(cfg, task, eval_set)
    elif (cfg.model_hidden, cfg.model_layers) != (64, 2):
        console.warn(
            f"warning: --model-hidden {cfg.model_hidden} / --model-layers {cfg.model_layers} "
            f"size the embedded model only: ignored with --model {cfg.model}"
        )
    eos = eos_ids(tok, model)
    compute_dtype = auto_dtype if cfg.dtype == "auto" else cfg.dtype
    if cfg.model is not None:  # (the embedded model is built for sdpa)
        from .rollout import attn_implementation

        attn = attn_implementation(device, compute_dtype)
        if attn != "sdpa":
            try:
                model.set_attn_implementation(attn)
            except (ValueError, ImportError) as e:  # e.g. an architecture without it
                console.warn(f"note: --model {cfg.model}: {attn} unavailable ({e}); using sdpa")
    policy = model.to(device)
    if device.type == "cpu":
        torch.set_num_threads(cfg.num_threads or auto_threads(policy, world))
    loss_cfg = loss_config(cfg)
    run = Run(
        cfg=cfg,
        rank=rank,
        world=world,
        device=device,
        compute_dtype=compute_dtype,
        console=console,
        task=task,
        eval_set=eval_set,
        scorer=scorer,
        tok=tok,
        eos=eos,
        pad_id=tok.pad_token_id,
        sft_steps=resolve_sft_steps(cfg),
        loss_cfg=loss_cfg,
        use_ref=loss_cfg.kl_coef > 0 or (cfg.algo == "ppo" and bool(cfg.kl_coef)),
        fused_lm_head=cfg.fsdp and lm_head_fusable(policy, cfg.top_k, cfg.top_p),
        grad_scale=world,  # DDP and FSDP2 average gradients; the loss is a sum
        data_sha256=data_sha256,
    )
    state = TrainState(
        policy=policy,
        task_rng=prompt_stream(cfg.seed, rank),
        sample_gen=torch.Generator(device=device).manual_seed(cfg.seed + 7919 * rank),
        shuffle_gen=torch.Generator().manual_seed(cfg.seed + 104729 * (rank + 1)),
        task_order=EpochOrder(cfg.seed, rank, world),
    )
    return run, state


def data_fingerprints(cfg: TrainConfig) -> dict[str, str]:
    """{option: SHA-256 of its file} for the data files the run reads: a .jsonl --task and
    --eval-file (a built-in task reads none)."""
    files = {"--task": cfg.task if cfg.task not in BUILTIN_TASKS else None,
             "--eval-file": cfg.eval_file}  # fmt: skip
    out = {}
    for option, path in files.items():
        if path and os.path.isfile(path):
            digest = hashlib.sha256()
            with open(path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    digest.update(block)
            out[option] = digest.hexdigest()
    return out


def check_options(cfg: TrainConfig, world: int) -> None:
    """ValueError for options this launch cannot run (they need the number of ranks)."""
    if cfg.batch_size % world:
        raise ValueError(
            f"--batch-size={cfg.batch_size} must be divisible by the number of ranks ({world})"
        )
    if cfg.fsdp and world == 1:
        raise ValueError("--fsdp shards over torchrun ranks: run it under torchrun")
    if cfg.fsdp and cfg.resume:
        raise ValueError(
            "--resume of an --fsdp run is not supported: its checkpoints hold the full "
            "weights and the Hugging Face export, not the sharded optimizer state (start a "
            "new run with --model OUT/checkpoints/step-N/hf)"
        )
    if cfg.report_to == "tensorboard":
        tensorboard_writer_class()  # a clear error now, not after the warm-up


def init_distributed(cfg: TrainConfig) -> bool:
    """Start the process group of a torchrun launch (nccl on CUDA, else gloo) unless there is
    one; True when this call started it (`close_distributed` then ends it)."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() and cfg.device != "cpu" else "gloo"
        dist.init_process_group(backend=backend)
        return True
    return False


def close_distributed(owned: bool) -> None:
    if owned and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def native_bf16(device: torch.device) -> bool:
    """Whether `device` is a CUDA GPU with bf16 in hardware (compute capability >= 8.0: A100,
    H100, RTX 30xx and newer). torch.cuda.is_bf16_supported() says yes on a V100 or T4 too,
    where bf16 is emulated (slow) and flash-attn refuses to run."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8


def pick_device(name: str, world: int) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(name)
    except RuntimeError as e:
        raise ValueError(f"--device={name!r} is not a torch device: {e}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={name!r} but CUDA is not available; use --device cpu")
    if dev.type == "cuda":
        if world > 1 and dev.index is not None:
            raise ValueError(
                f"--device={name!r} with {world} processes: each rank takes its own GPU, "
                "cuda:LOCAL_RANK; pass --device cuda (or auto)"
            )
        if world > 1:
            dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        elif dev.index is None:  # torch.cuda.set_device refuses a device without an index
            dev = torch.device("cuda", torch.cuda.current_device())
        if dev.index >= torch.cuda.device_count():
            which = "LOCAL_RANK " if world > 1 else ""
            raise ValueError(
                f"--device={name!r}: {which}index {dev.index}, but this process sees "
                f"{torch.cuda.device_count()} CUDA device(s) (CUDA_VISIBLE_DEVICES)"
            )
        torch.cuda.set_device(dev)
    return dev


def auto_threads(policy: torch.nn.Module, world: int) -> int:
    """1 thread for tiny models (thread hand-offs cost more than the matmuls, and badly so on a
    shared machine), else this rank's share of the cores."""
    if sum(p.numel() for p in policy.parameters()) < 10_000_000:
        return 1
    return max(1, (os.cpu_count() or 1) // world)


# --------------------------------------------------------------------------- model, data, loss
def resolve_sft_steps(cfg: TrainConfig) -> int:
    """--sft-steps, or by default 1000 for the embedded model on a built-in task, else 0."""
    if cfg.sft_steps is not None:
        return cfg.sft_steps
    return DEFAULT_SFT_STEPS if cfg.model is None and cfg.task in BUILTIN_TASKS else 0


def load_models(cfg: TrainConfig):
    """(model, tokenizer): --model, or the embedded default (its size from --model-hidden /
    --model-layers)."""
    if cfg.model is not None:
        return load_model(cfg.model, seed=cfg.seed)
    from . import rollout

    model, tok = load_model(None, seed=cfg.seed)
    if cfg.model_hidden != 64 or cfg.model_layers != 2:
        model = rollout.default_model(len(tok), cfg.seed, cfg.model_hidden, cfg.model_layers)
    return model, tok


def check_vocabulary(cfg: TrainConfig, task: Task, eval_set: list[Example]) -> None:
    """ValueError unless every character of the task is in the embedded vocabulary: the
    tokenizer drops any other (it has no unknown token, as AutoTokenizer reloads it from an
    export), so every line of a .jsonl task and of the eval set is checked, not a sample."""
    lines = task.examples if isinstance(task, JsonlTask) else task.eval_examples(50, cfg.seed)
    for what, examples in (
        (f"task {cfg.task!r}", lines),
        (
            f"--eval-file {cfg.eval_file!r}"
            if cfg.eval_file
            else f"the eval lines held out of task {cfg.task!r} (--eval-split {cfg.eval_split})",
            eval_set,
        ),  # fmt: skip
    ):
        text = "".join(e.prompt + task.target(e) for e in examples)
        missing = sorted(set(text) - set(CHARS))
        if missing:
            raise ValueError(
                f"{what}: characters {missing} are missing from the embedded model's tokenizer "
                f"(it has {CHARS!r}; it would drop them); pass --model with a local HF model"
            )


def eval_examples(cfg: TrainConfig, task: Task, log) -> list[Example]:
    """The eval set: --eval-file, else a held-out split of a .jsonl task (removed from its
    training lines), else the built-in task's own eval stream (not held out: see
    TrainConfig.eval_file)."""
    if cfg.eval_file:
        return load_jsonl(cfg.eval_file, "--eval-file")[: cfg.eval_size]
    if isinstance(task, JsonlTask):
        held = task.hold_out(cfg.eval_split, cfg.eval_size, cfg.seed)
        if held:
            log(
                f"eval: {len(held)} lines of {cfg.task} held out (--eval-split "
                f"{cfg.eval_split}), training on the other {len(task.examples)}"
            )
            return held
        log(
            f"eval: on the first {min(cfg.eval_size, len(task.examples))} training lines of "
            f"{cfg.task} (no held-out data: pass --eval-file or --eval-split > 0)"
        )
    return task.eval_examples(cfg.eval_size, cfg.seed)


def _is_dropout_name(name: str) -> bool:
    """A dropout rate's name: `*dropout*`, `*_pdrop` (GPT-2's) or OPT's `layerdrop`."""
    name = name.lower()
    return "dropout" in name or name.endswith("_pdrop") or name == "layerdrop"


def disable_dropout(model: torch.nn.Module) -> None:
    """Switch dropout off in `model`'s modules: every nn.Dropout's p, every float attribute of
    a module named like a dropout rate (`_is_dropout_name`: what HF attention reads from its
    config at init and passes to sdpa, e.g. Qwen2's `attention_dropout`, and OPT's
    `layerdrop`, which skips whole layers at random) and the same fields of the modules'
    configs (Falcon, Gemma3, GPT-Neo read `config.hidden_dropout` / `attention_dropout` in
    their forward) set to 0; the reference copy and ppo's critic, copies of these modules,
    inherit it. The configs' own values are kept in `model._fastrl_config_dropout` and
    `export_hf` writes them back into the export (an exported model keeps its dropout). With
    dropout on in train mode, the update's log-probs are not the sampler's nor pi_old's
    (computed in eval mode): the first minibatch's ratio is not 1, the clip and the KL act on
    noise. (TRL's `disable_dropout`, off by default there.)"""
    from transformers import PretrainedConfig

    configs, saved = {}, []
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for name, value in list(vars(module).items()):
            if _is_dropout_name(name) and isinstance(value, float):
                setattr(module, name, 0.0)
        config = getattr(module, "config", None)
        if isinstance(config, PretrainedConfig):
            configs[id(config)] = config
    for config in configs.values():
        rates = {
            k: v
            for k, v in vars(config).items()
            if _is_dropout_name(k) and isinstance(v, float) and v != 0.0
        }
        for k in rates:
            setattr(config, k, 0.0)
        if rates:
            saved.append((config, rates))
    model._fastrl_config_dropout = saved


# --------------------------------------------------------------------------- setup
def setup(run: Run, state: TrainState) -> None:
    """Ready `state` for training: a fresh run gets its supervised warm-up (`run.sft_steps`),
    then the reference copy (`run.use_ref`), ppo's critic, gradient checkpointing, FSDP2 shards,
    optimizer and schedule; --resume loads the newest intact checkpoint into all of it instead
    of the warm-up. Fills state.ref / critic / opt / sched / train_policy / train_critic."""
    cfg = run.cfg
    candidates = resume_candidates(cfg, run.console.log) if cfg.resume else []
    if not cfg.resume and run.sft_steps > 0:
        supervised_warmup(run, state.policy)
    if run.use_ref:
        state.ref = copy.deepcopy(state.policy).eval().requires_grad_(False)
    if cfg.algo == "ppo":
        state.critic = ValueModel(state.policy).to(run.device)
    if cfg.gradient_checkpointing:
        for m in (state.policy, state.critic.backbone if state.critic is not None else None):
            if m is not None:
                _checkpoint_activations(m)
    if cfg.fsdp:
        shard(run.device, state.policy, state.critic, state.ref)
    state.opt, state.sched = build_optimizer(cfg, state.policy, state.critic)
    if candidates:
        resume(run, state, candidates)
    state.train_policy, state.train_critic = wrap(run, state.policy, state.critic)


def _checkpoint_activations(model: torch.nn.Module) -> None:
    kw = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # newer transformers
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def build_optimizer(cfg: TrainConfig, policy, critic):
    """(AdamW over the policy's trainable parameters and the critic's, the LambdaLR of
    --warmup-steps / --lr-schedule over every minibatch of the run, one schedule step each, whether
    or not it takes an optimizer step)."""
    groups = [{"params": [p for p in policy.parameters() if p.requires_grad], "lr": cfg.lr}]
    if critic is not None:
        groups.append({"params": list(critic.parameters()), "lr": cfg.critic_lr})
    betas = (cfg.adam_beta1, cfg.adam_beta2)
    opt = torch.optim.AdamW(groups, betas=betas, weight_decay=cfg.weight_decay)
    total = cfg.steps * cfg.epochs * cfg.n_minibatches
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: lr_factor(s, cfg.warmup_steps, total, cfg.lr_schedule)
    )
    return opt, sched


def lr_factor(step: int, warmup: int, total: int, schedule: str) -> float:
    """The learning-rate multiplier at optimizer step `step` (0-based): linear warm-up over
    `warmup` steps, then constant, or linear / cosine decay to 0 at step `total`."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    progress = min(1.0, max(0.0, (step - warmup) / max(1, total - warmup)))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def wrap(run: Run, policy, critic) -> tuple:
    """(policy, critic) as the update trains them: DDP replicas (several ranks, not --fsdp),
    the models themselves otherwise."""
    if run.world == 1 or run.cfg.fsdp:
        return policy, critic
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [run.device.index] if run.device.type == "cuda" else None
    train_policy = DDP(policy, device_ids=ids)
    train_critic = DDP(critic, device_ids=ids) if critic is not None else None
    return train_policy, train_critic


def transformer_blocks(model) -> list:
    """The model's repeated blocks, the units FSDP2 shards one by one: modules whose class is in
    the model's `_no_split_modules` (Hugging Face's own list: GPT2Block, GPTNeoXLayer,
    LlamaDecoderLayer, ...) or whose class name ends in DecoderLayer."""
    names = set()
    for m in model.modules():  # (a critic's backbone copy: its own modules' lists)
        names |= set(getattr(m, "_no_split_modules", None) or [])

    def is_block(m) -> bool:
        name = type(m).__name__
        return m is not model and (name in names or name.endswith("DecoderLayer"))

    return [m for m in model.modules() if is_block(m)]


def shard(device: torch.device, *models) -> None:
    """--fsdp: FSDP2 `fully_shard` on each transformer block (`transformer_blocks`) and then each
    whole model (None skipped), in place; parameters become DTensors sharded over the ranks, on
    a mesh of the run's device type (fully_shard's default mesh takes the build's accelerator:
    a --device cpu run on a CUDA machine had its shards moved to the GPU). A model with no block
    found is refused: sharded as one root group, the fused LM-head loss (which does not use the
    root forward's output) never ran FSDP2's gradient reduce-scatter, and GPT-2's weights never
    changed while a gradient norm was logged."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for model in models:
        if model is None:
            continue
        blocks = transformer_blocks(model)
        if not blocks:
            raise ValueError(
                f"--fsdp: no transformer block found in {type(model).__name__} to shard (none "
                f"of its modules is in its _no_split_modules "
                f"{getattr(model, '_no_split_modules', None)} or ends in DecoderLayer); run it "
                "without --fsdp (DDP)"
            )
        # innermost first: a block nested in another (one listed class inside another) is
        # sharded before the one around it, as FSDP2 wants
        for m in reversed(blocks):
            fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)


def release_wrappers(state: TrainState) -> None:
    """Drop the DDP wrappers (first thing at close: a DDP reducer that outlives its process
    group can abort the process at exit, "terminate called without an active exception")."""
    if state.train_policy is not state.policy:
        state.train_policy, state.train_critic = state.policy, state.critic
        gc.collect()
