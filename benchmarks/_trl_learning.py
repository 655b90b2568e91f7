"""`bench_learning.py --vs-trl`: TRL's GRPOTrainer and `fastrl train` side by side, from the same
warm start, on the same JSONL task, reward, eval and settings, back to back.

    python benchmarks/bench_learning.py --vs-trl                # 2 seeds, both trainers
    python benchmarks/bench_learning.py --vs-trl --ablate       # + the ablation runs (below)
    python benchmarks/bench_learning.py --vs-trl --quick        # smoke test (tiny, < 60 s idle)

1. Task (`--trl-task`): addition pairs as JSONL, `{"prompt": "47+38=", "answer": "85"}`, the
   exact-match reward. Default `add`, fastrl's embedded task (operands 0..49, 2500 pairs); a
   seeded 200 of them are held out (eval.jsonl) and never trained on, the other 2300 are the
   training task (train.jsonl). `add_small` (single digits) and `add19` (0..19) also exist.
2. Model: a tiny Llama built from a config (`--hidden 64 --layers 2`: 122k parameters) over
   fastrl's packaged character tokenizer, saved with save_pretrained, then warmed up once by
   fastrl's own supervised warm-up through the CLI (`fastrl train --sft-steps 300` on the
   training pairs, `--warm-noise` of them one too high: 0 by default, a correct but short
   warm-up that leaves held-out greedy accuracy at ~0.3 and the arithmetic to RL). Both
   trainers start from that Hugging Face export (`--sft-steps 0` for fastrl).
3. Each seed, back to back, one run at a time: TRL `trl.GRPOTrainer` (stock) in a child
   process, then `fastrl train` (`python -m fastrl.cli train`) in a child process. The same G
   (8), prompts per step (32: 256 completions), peak lr (1e-3), steps (`--max-steps`, the
   horizon of both trainers' default linear lr decay), completion length (6), temperature (1,
   no top-k / top-p), no KL, one optimizer step per rollout batch (TRL:
   gradient_accumulation_steps = steps_per_generation = num_iterations = 1; fastrl's
   defaults for grpo), fp32, 1 torch thread each (fastrl's own choice for a model this small).
   Everything else is each trainer's default: TRL `loss_type="dapo"`, no warm-up, linear lr
   decay; fastrl `--algo grpo` (with `--kl-coef 0`: token-mean loss, AdamW betas (0.9, 0.999),
   prompts in shuffled epochs, no warm-up, linear lr decay: TRL's own choices, made fastrl's
   defaults after the ablations below showed that they matter together; the group std eps
   stays SPEC's 1e-6); TRL's
   gradient checkpointing is turned off (its default is on; fastrl's off) so that both do the
   same compute.
4. Eval: fastrl's greedy evaluation (greedy decoding with fastrl's sampler, exact match) on the
   held-out pairs every `--eval-every` steps: fastrl's own `--eval-file` eval, and for TRL the
   same generate + reward (`greedy_accuracy`) from a TrainerCallback. Both start from the same
   step-0 accuracy (a check). Training seconds are the sum of the steps' own times
   (generation, rewards, loss, backward, optimizer: fastrl's `step_time_s`, TRL's
   on_step_begin -> on_step_end); evaluations, logging and checkpoints are not counted. A run
   stops after `--budget` training seconds or once it reaches `--stop-at` (fastrl: SIGTERM
   from this process, after which fastrl finishes the step and exits).
5. benchmarks/results/learning_vs_trl.json (learning_vs_trl_TASK.json for another --trl-task;
   every eval point of every run, steps and seconds
   to each threshold per seed and their mean, settings, machine, versions, command lines),
   .png (accuracy against training seconds and against steps) and .md (the tables).

`--ablate`: the two base runs again for `--ablate-steps` steps each (no budget, no early
stop), then runs that each change one setting of one trainer to the other's value (ABLATIONS):
through existing `fastrl train` options, TRL GRPOConfig fields, or monkeypatches applied in the
fastrl child before `fastrl.cli.main` (`_apply_patches`; benchmark-only, never committed
behaviour). Compared by steps to each threshold and by the mean eval accuracy over the steps
(a noise-robust area under the curve).

Everything goes through public entry points (the CLI, `fastrl.train.rollout.generate`,
`fastrl.advantages.group_advantages`, `JsonlTask.sample`), not the
trainer's internals.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

THRESHOLDS = (0.5, 0.8, 0.9)
TASKS = {"add": 49, "add_small": 9, "add19": 19}  # largest operand of each pair task

# --ablate: runs that each change one setting of one trainer to the other trainer's value, or
# to fastrl's defaults before they changed (2 minibatches, constant lr).
#   name: (trainer, fastrl CLI options, fastrl monkeypatches, GRPOConfig overrides)
OLD_AGG = ["--loss-agg", "seq-mean-token-mean"]  # the GRPO paper's, fastrl's grpo before
ABLATIONS = {
    "fastrl + seq-mean-token-mean loss (its old default)": ("fastrl", OLD_AGG, [], {}),
    "fastrl + AdamW beta2 0.99 (its old default)": ("fastrl", ["--adam-beta2", "0.99"], [], {}),
    "fastrl + prompts with replacement (its old default)": ("fastrl", [], ["replacement"], {}),
    "fastrl + 5 warm-up steps (its old default)": ("fastrl", ["--warmup-steps", "5"], [], {}),
    "fastrl + all of its old defaults": (
        "fastrl",
        [*OLD_AGG, "--adam-beta2", "0.99", "--warmup-steps", "5"],
        ["replacement"],
        {},
    ),
    "fastrl + adv std eps 1e-4 (TRL's)": ("fastrl", [], ["adv_eps"], {}),
    "fastrl + 2 minibatches (its old default)": ("fastrl", ["--minibatches", "2"], [], {}),
    "fastrl + constant lr (its old default)": ("fastrl", ["--lr-schedule", "constant"], [], {}),
    "fastrl + k3 KL 0.04 (its grpo default)": ("fastrl", ["--kl-coef", "0.04"], [], {}),
    "TRL + loss_type grpo": ("trl", [], [], {"loss_type": "grpo"}),
    "TRL + AdamW betas (0.9, 0.99)": ("trl", [], [], {"adam_beta2": 0.99}),
    "TRL + constant lr": ("trl", [], [], {"lr_scheduler_type": "constant"}),
    # not a matched setting: DAPO (its preset, dynamic sampling up to 4 generation batches, no
    # KL, clip-higher 0.28, token-mean loss, overlong shaping) on the same task and horizon
    "fastrl --algo dapo (dynamic sampling)": ("fastrl", ["--algo", "dapo"], [], {}),
    # TRL's DAPO as its documentation gives it (its GRPOTrainer has no dynamic sampling)
    "TRL DAPO recipe (epsilon_high 0.28, mask_truncated_completions)": (
        "trl",
        [],
        [],
        {"epsilon_high": 0.28, "mask_truncated_completions": True},
    ),
}
DEFAULT_ABLATIONS = [
    "fastrl + all of its old defaults",
    "fastrl + 5 warm-up steps (its old default)",
    "fastrl + 2 minibatches (its old default)",
    "fastrl + constant lr (its old default)",
    "TRL + constant lr",
    "fastrl + k3 KL 0.04 (its grpo default)",
]


# --------------------------------------------------------------------------- task and model
def make_task(tmp: Path, task: str, eval_n: int, noise: float = 0.0) -> dict:
    """train.jsonl / eval.jsonl in `tmp`: every pair of the task, `eval_n` of them held out
    (seeded shuffle, the same for every run and trainer); warm.jsonl: the training pairs, 4
    copies each, whose answer is one too high with probability `noise` (the warm-up's teacher)."""
    hi = TASKS[task]
    pairs = [(a, b) for a in range(hi + 1) for b in range(hi + 1)]
    rng = random.Random(1234)
    rng.shuffle(pairs)
    held, train = pairs[:eval_n], pairs[eval_n:]
    warm = [(a, b, a + b + (rng.random() < noise)) for a, b in train * 4]
    for name, rows in (
        ("train", [(a, b, a + b) for a, b in train]),
        ("eval", [(a, b, a + b) for a, b in held]),
        ("warm", warm),
    ):
        with open(tmp / f"{name}.jsonl", "w") as f:
            for a, b, c in rows:
                f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(c)}) + "\n")
    return {
        "name": task,
        "train": str(tmp / "train.jsonl"),
        "eval": str(tmp / "eval.jsonl"),
        "warm": str(tmp / "warm.jsonl"),
        "n_train": len(train),
        "n_eval": len(held),
        "operands": f"0..{hi}",
        "reward": "exact_match",
    }


def make_model(path: Path, hidden: int, layers: int, seed: int = 0) -> int:
    """A random-init Llama over fastrl's character tokenizer, saved with save_pretrained."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    from fastrl.train.rollout import default_tokenizer

    hf_logging.disable_progress_bar()
    tok = default_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=int(3.5 * hidden),
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def warm_start(tmp: Path, task: dict, random_dir: Path, sft_steps: int, threads: int) -> tuple:
    """fastrl's own supervised warm-up (`fastrl train --sft-steps N`: AdamW lr 3e-3, 64 examples
    a step) of the random-init model on warm.jsonl (the training pairs only), through the CLI.
    In this process (`fastrl.cli.main`). The CLI has no warm-up-only mode, so the run takes one
    RL step at lr 1e-12 (a no-op: Adam's first step moves each weight by about lr) and its
    Hugging Face export is the warm start.
    Returns (its directory, its greedy eval accuracy on the held-out pairs, the command)."""
    out = tmp / "warm"
    argv = [
        "train", "--model", str(random_dir), "--task", task["warm"], "--eval-file", task["eval"],
        "--eval-size", str(task["n_eval"]), "--sft-steps", str(sft_steps), "--steps", "1",
        "--lr", "1e-12", "--batch-size", "4", "--group-size", "2", "--save-every", "0",
        "--device", "cpu", "--num-threads", str(threads), "--progress", "false",
        "--out", str(out), "--force",
    ]  # fmt: skip
    import contextlib
    import io

    from fastrl import cli

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        rc = cli.main(argv)  # in this process: one interpreter start less
    if rc != 0:
        raise RuntimeError(f"the warm-up run failed (exit {rc}): fastrl {shlex.join(argv)}")
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    acc = next(r["eval_accuracy"] for r in recs if r["step"] == 0 and "eval_accuracy" in r)
    hf = sorted(out.glob("checkpoints/*/hf"))[-1]
    return hf, acc, "fastrl " + shlex.join(argv)


# --------------------------------------------------------------------------- the eval
def greedy_accuracy(model, tok, examples, max_new_tokens: int, reward_fn) -> float:
    """fastrl's evaluation, for a model trained elsewhere: greedy completions from fastrl's
    sampler (`fastrl.train.rollout.generate`, temperature 0, batches of 256), decoded up to the
    EOS, correct when the reward is >= 1."""
    import torch

    from fastrl.train.rollout import eos_ids, generate

    eos = eos_ids(tok, model)
    was_training = model.training
    model.eval()
    correct = 0
    with torch.no_grad():
        for s in range(0, len(examples), 256):
            ex = examples[s : s + 256]
            r = generate(
                model, [tok(e.prompt).input_ids for e in ex], 1, max_new_tokens, eos,
                tok.pad_token_id, temperature=0.0,
            )  # fmt: skip
            for row, n, e in zip(r.completion_ids.tolist(), r.lengths.tolist(), ex):
                text = tok.decode([t for t in row[:n] if t not in eos], skip_special_tokens=True)
                correct += reward_fn(text, e.answer) >= 1.0 - 1e-6
    model.train(was_training)
    return correct / max(len(examples), 1)


# --------------------------------------------------------------------------- child: fastrl
def _apply_patches(names: list[str]) -> None:
    """Monkeypatches of an --ablate fastrl child (benchmark-only, never committed behaviour),
    on public names so that they survive refactors of the trainer's internals."""
    import functools

    import fastrl.advantages
    import fastrl.train.trainer  # noqa: F401  (imports every trainer module)
    from fastrl.train import tasks

    if "adv_eps" in names:  # TRL: (r - mean) / (std + 1e-4); fastrl's default eps is 1e-6
        orig = fastrl.advantages.group_advantages
        patched = functools.partial(orig, eps=1e-4)
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("fastrl") and (
                getattr(mod, "group_advantages", None) is orig
            ):
                mod.group_advantages = patched
    if "replacement" in names:  # fastrl's JSONL sampling before shuffled epochs: uniform draws
        orig_sample = tasks.JsonlTask.sample
        tasks.JsonlTask.sample = lambda self, rng, n, order=None: orig_sample(self, rng, n)


def child_fastrl(spec: dict) -> None:
    _apply_patches(spec["patches"])
    from fastrl import cli

    sys.exit(cli.main(spec["argv"]))


def _metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def dynamic_sampling(recs: list[dict], window: int = 500) -> dict | None:
    """DAPO's dynamic sampling in a fastrl run's metrics: generation batches per step and the
    share of steps whose batch was filled with informative groups (not all rewards equal), per
    `window` steps; None for a run without it (one generation batch every step)."""
    steps = [r for r in recs if r["step"] > 0 and "gen_batches" in r]
    if not steps or all(r["gen_batches"] <= 1 and r.get("batch_full", True) for r in steps):
        return None
    out = []
    for lo in range(0, steps[-1]["step"], window):
        w = [r for r in steps if lo < r["step"] <= lo + window]
        if w:
            out.append(
                {
                    "steps": f"{lo + 1}-{w[-1]['step']}",
                    "gen_batches_mean": round(sum(r["gen_batches"] for r in w) / len(w), 3),
                    "batch_full_share": round(sum(bool(r["batch_full"]) for r in w) / len(w), 3),
                    "kept_groups_mean": round(sum(r["kept_groups"] for r in w) / len(w), 2),
                }
            )
    return {"window": window, "per_window": out}


def fastrl_evals(recs: list[dict]) -> list[dict]:
    """Eval points of a fastrl run: step, training seconds (the sum of `step_time_s` of the
    steps up to it: rollout, rewards, update; no evaluation, logging or checkpoint), accuracy."""
    evals, train_s = [], 0.0
    for r in recs:
        train_s += r.get("step_time_s", 0.0) if r["step"] > 0 else 0.0
        if "eval_accuracy" in r:
            evals.append(
                {"step": r["step"], "train_s": round(train_s, 3), "acc": r["eval_accuracy"]}
            )
    return evals


# --------------------------------------------------------------------------- child: TRL
def child_trl(spec: dict) -> None:
    """trl.GRPOTrainer (stock) on the task; fastrl's greedy eval every `eval_every` steps."""
    import warnings

    warnings.filterwarnings("ignore")
    import datasets
    import torch
    import trl
    from transformers import AutoTokenizer, TrainerCallback

    from fastrl.train.rewards import resolve_reward
    from fastrl.train.tasks import load_jsonl

    torch.set_num_threads(spec["threads"])
    task, s = spec["task"], spec["settings"]
    train = load_jsonl(task["train"])
    eval_set = load_jsonl(task["eval"])
    ds = datasets.Dataset.from_dict(
        {"prompt": [e.prompt for e in train], "answer": [e.answer for e in train]}
    )
    exact = resolve_reward(task["reward"])

    def reward(completions, answer, **kw):
        return [exact(c, a) for c, a in zip(completions, answer)]

    tok = AutoTokenizer.from_pretrained(spec["model"], local_files_only=True, padding_side="left")
    kwargs = trl_config(spec["settings"], spec["seed"], spec.get("trl_overrides", {}))
    args = trl.GRPOConfig(output_dir=spec["out"], report_to=[], **kwargs)
    trainer = trl.GRPOTrainer(
        model=spec["model"], reward_funcs=reward, args=args, train_dataset=ds, processing_class=tok
    )

    class Bench(TrainerCallback):
        """Eval every `eval_every` steps and training seconds: the sum of each optimizer
        step's on_step_begin -> on_step_end (generation, rewards, loss, backward, AdamW)."""

        def __init__(self):
            self.evals, self.train_s, self.steps = [], 0.0, 0

        def on_train_begin(self, args, state, control, model=None, **kw):
            self.threads = torch.get_num_threads()
            acc = greedy_accuracy(model, tok, eval_set, s["max_new_tokens"], exact)
            self.evals.append({"step": 0, "train_s": 0.0, "acc": acc})

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, model=None, **kw):
            self.train_s += time.perf_counter() - self.t
            self.steps = step = state.global_step
            over = self.train_s >= spec["budget"]
            if step % spec["eval_every"] == 0 or over:
                acc = greedy_accuracy(model, tok, eval_set, s["max_new_tokens"], exact)
                self.evals.append({"step": step, "train_s": round(self.train_s, 3), "acc": acc})
                over = over or acc >= spec["stop_at"]
            if over:
                control.should_training_stop = True

    cb = Bench()
    trainer.add_callback(cb)
    trainer.train()
    Path(spec["out"], "evals.json").write_text(
        json.dumps({"evals": cb.evals, "steps": cb.steps, "threads": cb.threads})
    )


def trl_config(s: dict, seed: int, overrides: dict) -> dict:
    """GRPOConfig fields of a run (TRL's defaults for everything else)."""
    kw = dict(
        use_cpu=True,
        bf16=False,  # fp32, as fastrl on a CPU
        gradient_checkpointing=False,  # TRL's default is True; fastrl's is False
        seed=seed,
        learning_rate=s["lr"],
        lr_scheduler_type="linear",  # TRL's default: linear decay to 0 at max_steps
        warmup_steps=0,  # TRL's default
        per_device_train_batch_size=s["completions_per_step"],
        gradient_accumulation_steps=1,  # -> steps_per_generation 1: one AdamW step per batch
        num_generations=s["group_size"],
        max_completion_length=s["max_new_tokens"],
        temperature=s["temperature"],
        beta=0.0,
        loss_type="dapo",  # TRL's default
        num_iterations=1,
        max_steps=s["max_steps"],
        logging_steps=10,
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    kw.update(overrides)
    return kw


# --------------------------------------------------------------------------- parent
def _env() -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore", TOKENIZERS_PARALLELISM="false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


def _fail(what: str, log: Path, rc: int):
    raise RuntimeError(f"{what} failed (exit {rc}):\n{log.read_text()[-5000:]}")


def fastrl_argv(args, task: dict, model: Path, seed: int, out: Path, extra: list[str]) -> list:
    """`fastrl train` options of a run: the settings of `settings()`, the rest fastrl's defaults
    (--algo grpo: group advantages, its loss preset with token-mean aggregation, one minibatch,
    AdamW (0.9, 0.999), no warm-up, linear lr decay to 0 at --steps; no KL as in TRL's
    beta = 0)."""
    return [
        "train", "--algo", "grpo", "--kl-coef", "0", "--seed", str(seed),
        "--model", str(model), "--task", task["train"], "--eval-file", task["eval"],
        "--eval-size", str(task["n_eval"]), "--sft-steps", "0",
        "--batch-size", str(args.batch_prompts), "--group-size", str(args.group_size),
        "--lr", str(args.lr),
        "--max-new-tokens", str(args.max_new_tokens), "--temperature", "1.0",
        "--steps", str(args.max_steps), "--max-time", str(round(3 * args.budget + 60)),  # cap
        "--eval-every", str(args.eval_every), "--save-every", "0",
        "--device", "cpu", "--num-threads", str(args.threads), "--progress", "false",
        "--out", str(out), "--force", *extra,
    ]  # fmt: skip


def run_fastrl(args, task, model, seed, out: Path, extra=(), patches=()) -> dict:
    """`fastrl train` in a child process (`python -m fastrl.cli`; with `patches`, a child that
    applies them and then calls `fastrl.cli.main`), stopped with SIGTERM (fastrl finishes the
    step and saves) once its metrics show `stop_at` reached or `budget` training seconds."""
    out.mkdir(parents=True, exist_ok=True)
    run = out / "run"
    argv = fastrl_argv(args, task, model, seed, run, list(extra))
    if patches:
        spec = out / "spec.json"
        spec.write_text(json.dumps({"argv": argv, "patches": list(patches)}))
        cmd = [sys.executable, str(Path(__file__).resolve()), "fastrl", str(spec)]
    else:
        cmd = [sys.executable, "-m", "fastrl.cli", *argv]
    log = out / "log.txt"
    t = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=_env(), cwd=out)
        stopped = False
        while proc.poll() is None:
            time.sleep(0.25)
            evals = fastrl_evals(_metrics(run / "metrics.jsonl"))
            if (
                not stopped
                and len(evals) > 1
                and (evals[-1]["acc"] >= args.stop_at or evals[-1]["train_s"] >= args.budget)
            ):
                proc.terminate()  # SIGTERM: fastrl finishes the step, saves and exits 143
                stopped = True
        rc = proc.wait()
    if rc not in (0, 143):
        _fail("fastrl train", log, rc)
    wall = time.perf_counter() - t
    recs = _metrics(run / "metrics.jsonl")
    evals = fastrl_evals(recs)
    last = max(i for i, e in enumerate(evals) if i == 0 or e["train_s"] <= args.budget + 60)
    evals = evals[: last + 1]
    steps = evals[-1]["step"]
    cmd_text = "fastrl " + shlex.join(argv)
    if patches:
        cmd_text += f"  [benchmark monkeypatches: {', '.join(patches)}]"
    out = {
        "command": cmd_text,
        "process_wall_s": round(wall, 1),
        "steps": steps,
        "evals": evals,
        "sec_per_step": round(evals[-1]["train_s"] / max(steps, 1), 4),
    }
    ds = dynamic_sampling(recs)
    if ds is not None:
        out["dynamic_sampling"] = ds
    return out


def run_trl(args, task, model, seed, out: Path, overrides: dict | None = None) -> dict:
    """trl.GRPOTrainer in a child process (`child_trl`)."""
    out.mkdir(parents=True, exist_ok=True)
    spec = {
        "task": task,
        "model": str(model),
        "seed": seed,
        "settings": settings(args),
        "threads": args.threads,
        "budget": args.budget,
        "eval_every": args.eval_every,
        "stop_at": args.stop_at,
        "trl_overrides": overrides or {},
        "out": str(out),
    }
    (out / "spec.json").write_text(json.dumps(spec, indent=1))
    log = out / "log.txt"
    t = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.call(
            [sys.executable, str(Path(__file__).resolve()), "trl", str(out / "spec.json")],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=_env(),
            cwd=out,
        )
    if rc != 0:
        _fail("trl.GRPOTrainer", log, rc)
    wall = time.perf_counter() - t
    res = json.loads((out / "evals.json").read_text())
    cfg = trl_config(settings(args), seed, overrides or {})
    keep = ("use_cpu", "bf16", "gradient_checkpointing", "seed", "learning_rate",
            "lr_scheduler_type", "warmup_steps", "per_device_train_batch_size",
            "gradient_accumulation_steps", "num_generations", "max_completion_length",
            "temperature", "beta", "loss_type", "num_iterations", *(overrides or {}))  # fmt: skip
    return {
        "command": "trl.GRPOTrainer(model=DIR, reward_funcs=exact_match, GRPOConfig("
        + ", ".join(f"{k}={cfg[k]!r}" for k in dict.fromkeys(keep))
        + "))",
        "process_wall_s": round(wall, 1),
        "steps": res["steps"],
        "torch_threads": res["threads"],
        "evals": res["evals"],
        "sec_per_step": round(res["evals"][-1]["train_s"] / max(res["steps"], 1), 4),
    }


def settings(args) -> dict:
    return {
        "group_size": args.group_size,
        "batch_prompts": args.batch_prompts,
        "completions_per_step": args.group_size * args.batch_prompts,
        "lr": args.lr,
        "lr_schedule": "each trainer's default: linear decay to 0 at max_steps, no warm-up",
        "max_new_tokens": args.max_new_tokens,
        "temperature": 1.0,
        "kl": 0.0,
        "optimizer_steps_per_rollout": 1,
        "dtype": "fp32",
        "torch_threads": args.threads,
        "eval_every": args.eval_every,
        "budget_s": args.budget,
        "max_steps": args.max_steps,
        "stop_at": args.stop_at,
    }


def reach(evals: list[dict], thr: float) -> dict | None:
    """The first eval point at or above `thr` (steps and training seconds), or None."""
    for e in evals:
        if e["acc"] >= thr - 1e-9:
            return {"step": e["step"], "train_s": e["train_s"]}
    return None


def curve_stats(evals: list[dict], horizon: int) -> dict:
    """Noise-robust summaries of a curve up to step `horizon`: the mean eval accuracy over the
    eval points in (0, horizon] (the area under the curve / horizon) and the mean of the last 5
    of them."""
    pts = [e["acc"] for e in evals if 0 < e["step"] <= horizon]
    return {
        "horizon": horizon,
        "mean_acc": round(sum(pts) / len(pts), 4) if pts else None,
        "final_acc": round(sum(pts[-5:]) / len(pts[-5:]), 4) if pts else None,
    }


def summarise(runs: dict, horizon: int | None = None) -> dict:
    """Per trainer (or variant): each seed's steps / seconds to each threshold and their mean
    (None when a seed never reached it), and `curve_stats` up to the step `horizon` per seed
    and averaged. horizon None: thresholds over whole runs and curve_stats up to the fewest
    steps any run made; else both within the first `horizon` steps (the ablation)."""
    cut = horizon
    if horizon is None:
        horizon = min(r["evals"][-1]["step"] for by in runs.values() for r in by.values())
    out = {}
    for name, by_seed in runs.items():
        out[name] = {}
        for thr in THRESHOLDS:
            per = {
                s: reach([e for e in r["evals"] if cut is None or e["step"] <= cut], thr)
                for s, r in by_seed.items()
            }
            ok = [p for p in per.values() if p]
            full = len(ok) == len(per)
            out[name][str(thr)] = {
                "per_seed": per,
                "steps_mean": sum(p["step"] for p in ok) / len(ok) if full else None,
                "train_s_mean": round(sum(p["train_s"] for p in ok) / len(ok), 2) if full else None,
            }
        stats = {s: curve_stats(r["evals"], horizon) for s, r in by_seed.items()}
        vals = [v["mean_acc"] for v in stats.values() if v["mean_acc"] is not None]
        fin = [v["final_acc"] for v in stats.values() if v["final_acc"] is not None]
        out[name]["curve"] = {
            "horizon": horizon,
            "per_seed": stats,
            "mean_acc": round(sum(vals) / len(vals), 4) if vals else None,
            "final_acc": round(sum(fin) / len(fin), 4) if fin else None,
        }
        sps = [r["sec_per_step"] for r in by_seed.values()]
        out[name]["sec_per_step"] = round(sum(sps) / len(sps), 4)
        if cut is None:
            for r in by_seed.values():
                r["reached"] = {str(t): reach(r["evals"], t) for t in THRESHOLDS}
    return out


def _cell(p) -> str:
    return f"{p['step']} / {p['train_s']:.1f} s" if p else "not reached"


def _mean_cell(a: dict, bold: bool = True) -> str:
    if a["steps_mean"] is None:
        n = sum(1 for p in a["per_seed"].values() if p)
        return f"not reached ({n} of {len(a['per_seed'])} seeds did)"
    text = f"{a['steps_mean']:g} / {a['train_s_mean']:.1f} s"
    return f"**{text}**" if bold else text


def table(summary: dict) -> str:
    m, s, t = summary["machine"], summary["settings"], summary["task"]
    w = summary["warm_start"]
    where = summary.get("fastrl_imported_from", "")
    src = "" if where.startswith(str(HERE.parent)) else f" (fastrl imported from {where})"
    lines = [
        f"**fastrl vs TRL {summary['versions']['trl']} GRPOTrainer** on {t['name']} (operands "
        f"{t['operands']}, {t['n_train']} training pairs, {t['n_eval']} held out for the greedy "
        f"eval, exact-match reward): a {summary['model']['params'] / 1e3:.0f}k-parameter Llama "
        f"warm-started by fastrl's supervised warm-up ({w['sft_steps']} steps, teacher noise "
        f"{w['noise']:g}) to {summary['warm_start_acc']:.2f}; G = {s['group_size']}, "
        f"{s['completions_per_step']} completions per step, lr {s['lr']:g} "
        f"({s['lr_schedule']}), {s['max_steps']} steps at most, no KL, one "
        f"optimizer step per batch, max {s['max_new_tokens']} new tokens, fp32, "
        f"{s['torch_threads']} thread per run; TRL `loss_type=\"dapo\"`, fastrl `--algo grpo`; "
        f"at most {s['budget_s']:g} training s per run; seeds {summary['seeds']}; {m['cpu']} "
        f"({m['cores']} cores, load {m['load_avg_at_start']:.1f} at start), torch "
        f"{summary['versions']['torch']}, commit {summary['git_commit'][:7]}{src}"
        + (f"; `{summary['command']}`" if summary.get("command") else "")
        + ". Steps / training seconds (evaluations excluded) to held-out greedy accuracy:",
        "",
        "| trainer | seed | " + " | ".join(f"to {x:g}" for x in THRESHOLDS)
        + f" | s / step | mean acc, steps 1-{summary['summary']['trl']['curve']['horizon']} |",
        "|---|---|" + "---|" * (len(THRESHOLDS) + 2),
    ]  # fmt: skip
    for name, by_seed in summary["runs"].items():
        agg = summary["summary"][name]
        for seed, r in by_seed.items():
            cells = [_cell(r["reached"][str(x)]) for x in THRESHOLDS]
            cells += [
                f"{r['sec_per_step']:.3f}",
                f"{agg['curve']['per_seed'][seed]['mean_acc']:.3f}",
            ]
            lines.append(f"| {name} | {seed} | " + " | ".join(cells) + " |")
        cells = [_mean_cell(agg[str(x)]) for x in THRESHOLDS]
        cells += [f"{agg['sec_per_step']:.3f}", f"{agg['curve']['mean_acc']:.3f}"]
        lines.append(f"| {name} | mean | " + " | ".join(cells) + " |")
    if summary.get("ablation"):
        h = summary["ablation_settings"]["max_steps"]
        lines += [
            "",
            f"Ablation: {h} steps per run, the same seeds and warm start; each variant changes "
            "one trainer as its name says (most: one setting to the other trainer's value). "
            "Mean over seeds of the steps / training seconds to each threshold (steps per seed "
            "in brackets, - = not reached), of the mean eval accuracy over steps 1-"
            f"{h} and of the last 5 evals (the base runs stopped at {THRESHOLDS[-1]:g}, which "
            "lowers their mean):",
            "",
            "| variant | " + " | ".join(f"steps to {x:g}" for x in THRESHOLDS)
            + f" | mean acc 1-{h} | final acc |",
            "|---|" + "---|" * (len(THRESHOLDS) + 2),
        ]  # fmt: skip
        for name, agg in summary["ablation_summary"].items():
            cells = []
            for x in THRESHOLDS:
                a = agg[str(x)]
                per = ", ".join(f"{p['step']}" if p else "-" for p in a["per_seed"].values())
                mean = _mean_cell(a, bold=False) if a["steps_mean"] is not None else "-"
                cells.append(f"{mean} ({per})")
            c = agg["curve"]
            per = ", ".join(f"{v['mean_acc']:.3f}" for v in c["per_seed"].values())
            cells += [f"{c['mean_acc']:.3f} ({per})", f"{c['final_acc']:.3f}"]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        for name, by_seed in summary["ablation"].items():
            for seed, r in by_seed.items():
                if r.get("dynamic_sampling"):
                    w = r["dynamic_sampling"]["per_window"]
                    lines += [
                        "",
                        f"Dynamic sampling, {name}, seed {seed} (per window of steps: generation "
                        "batches per step, share of steps whose batch filled, informative groups "
                        "kept per step): "
                        + "; ".join(
                            f"{x['steps']}: {x['gen_batches_mean']:.2f}, "
                            f"{100 * x['batch_full_share']:.0f} %, {x['kept_groups_mean']:.1f}"
                            for x in w
                        ),
                    ]
    return "\n".join(lines) + "\n"


def plot(summary: dict, png: Path) -> None:
    """Accuracy against training seconds and against steps, both trainers, one line per seed;
    with an ablation, a third panel: each variant's mean over seeds against steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    abl = summary.get("ablation")
    fig, axes = plt.subplots(1, 3 if abl else 2, figsize=(16.5 if abl else 11, 4.2))
    styles = ["-", "--", ":", "-."]
    for i, (name, by_seed) in enumerate(summary["runs"].items()):
        for j, (seed, r) in enumerate(by_seed.items()):
            for x_key, ax in (("train_s", axes[0]), ("step", axes[1])):
                ax.plot(
                    [e[x_key] for e in r["evals"]],
                    [e["acc"] for e in r["evals"]],
                    color=f"C{i}",
                    ls=styles[j % len(styles)],
                    lw=1.4,
                    label=f"{name} seed {seed}",
                )
    labels = ["training seconds (evaluations excluded)", "step"]
    if abl:
        ax = axes[2]
        runs = {"TRL (base)": summary["runs"]["trl"], "fastrl (base)": summary["runs"]["fastrl"]}
        h = summary["ablation_settings"]["max_steps"]
        for i, (name, by_seed) in enumerate({**runs, **abl}.items()):
            grid = np.arange(0, h + 1, summary["settings"]["eval_every"])
            ys = [
                np.interp(grid, [e["step"] for e in r["evals"]], [e["acc"] for e in r["evals"]])
                for r in by_seed.values()
            ]
            x, y = grid, np.mean(ys, 0)
            if len(y) >= 5:  # a 5-eval moving average
                x, y = grid[2:-2], np.convolve(y, np.ones(5) / 5, mode="valid")
            color = (
                f"C{i}"
                if i < 2
                else plt.cm.tab20([4, 6, 8, 10, 12, 14, 16, 18, 5, 9][(i - 2) % 10])
            )
            ls = "--" if name.startswith("TRL +") else "-"  # TRL variants dashed
            ax.plot(x, y, color=color, ls=ls, lw=2.4 if i < 2 else 1.3, label=name)
        labels.append(f"step (ablation: mean of seeds, 5-eval moving average, {h} steps)")
    for ax, label in zip(axes, labels):
        for x in THRESHOLDS:
            ax.axhline(x, color="grey", lw=0.6, alpha=0.5)
        ax.set_xlabel(label)
        ax.set_ylabel("greedy eval accuracy (held out)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6.5)
    t, m = summary["task"], summary["machine"]
    fig.suptitle(
        f"fastrl vs TRL {summary['versions']['trl']} GRPOTrainer: {t['name']} ({t['n_eval']} "
        f"held-out prompts), {summary['model']['params'] / 1e3:.0f}k-param Llama from acc "
        f"{summary['warm_start_acc']:.2f}, {summary['settings']['completions_per_step']} "
        f"completions/step, lr {summary['settings']['lr']:g} — {m['cpu']}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("--vs-trl (benchmarks/_trl_learning.py)")
    g.add_argument("--vs-trl", action="store_true", help="TRL GRPOTrainer vs fastrl train")
    g.add_argument(
        "--trl-task",
        default="add",
        choices=list(TASKS),
        help="add: operands 0..49 (fastrl's embedded task); add_small: single digits; add19: "
        "operands 0..19",
    )
    g.add_argument("--eval-n", type=int, default=None, help="held-out pairs (default 200 / 30)")
    g.add_argument("--hidden", type=int, default=64, help="Llama hidden size")
    g.add_argument("--layers", type=int, default=2, help="Llama layers")
    g.add_argument(
        "--warm-sft-steps", type=int, default=300, help="warm-up steps (64 examples each)"
    )
    g.add_argument(
        "--warm-noise",
        type=float,
        default=0.0,
        help="share of warm-up answers that are one too high (0: a correct but short warm-up; "
        "fastrl's built-in tasks use 0.75)",
    )
    g.add_argument("--group-size", type=int, default=8, help="G")
    g.add_argument("--batch-prompts", type=int, default=32, help="prompts per step")
    g.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    g.add_argument("--max-new-tokens", type=int, default=6, help="completion length")
    g.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    g.add_argument(
        "--max-steps",
        type=int,
        default=2000,
        help="steps per run: both trainers' linear lr decay reaches 0 there",
    )
    g.add_argument("--stop-at", type=float, default=0.9, help="stop a run at this accuracy")
    g.add_argument("--ablate", action="store_true", help="also run the ABLATIONS")
    g.add_argument(
        "--ablate-steps", type=int, default=300, help="steps of each ablation run (no budget)"
    )
    g.add_argument(
        "--variants", nargs="*", default=None, help="ABLATIONS names (default DEFAULT_ABLATIONS)"
    )
    g.add_argument(
        "--ablate-from",
        metavar="JSON",
        default=None,
        help="with --ablate: take the side-by-side runs from this results file (made with the "
        "same options; the warm start is rebuilt, deterministically, and checked) and run only "
        "the ablation",
    )
    g.add_argument(
        "--replot", metavar="JSON", default=None, help="rewrite the .png / .md of a results file"
    )


def stem(task: str) -> str:
    """The results files' name: learning_vs_trl for the default task, else with the task."""
    return "learning_vs_trl" if task == "add" else f"learning_vs_trl_{task}"


def _save(summary: dict, out: Path) -> None:
    name = stem(summary["task"].get("name", "add"))
    (out / f"{name}.json").write_text(json.dumps(summary, indent=1) + "\n")


def main(args) -> dict:
    import copy
    import tempfile

    import torch
    import transformers
    import trl
    from _common import device_info

    import fastrl

    if args.replot:
        summary = json.loads(Path(args.replot).read_text())
        summary["summary"] = summarise(summary["runs"])
        if summary.get("ablation"):
            base = {
                "TRL (base)": summary["runs"]["trl"],
                "fastrl (base)": summary["runs"]["fastrl"],
            }
            h = summary["ablation_settings"]["max_steps"]
            summary["ablation_summary"] = summarise({**base, **summary["ablation"]}, h)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        _save(summary, out)
        name = stem(summary["task"].get("name", "add"))
        plot(summary, out / f"{name}.png")
        (out / f"{name}.md").write_text(table(summary))
        print(table(summary))
        return summary
    if args.quick:
        args.hidden, args.layers, args.warm_sft_steps = 16, 1, 20
        args.batch_prompts, args.group_size, args.max_new_tokens = 4, 4, 4
        args.eval_every, args.ablate_steps = 2, 4
        args.budget = min(args.budget, 1.5)
        args.seeds = args.seeds[:1]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = device_info("cpu")
    eval_n = args.eval_n or {"add": 200, "add_small": 30, "add19": 100}[args.trl_task]
    if args.quick:
        eval_n = min(eval_n, 20)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        task = make_task(tmp, args.trl_task, eval_n, args.warm_noise)
        params = make_model(tmp / "random", args.hidden, args.layers)
        model, acc0, warm_cmd = warm_start(
            tmp, task, tmp / "random", args.warm_sft_steps, args.threads
        )
        print(f"warm start: {params} parameters, {args.warm_sft_steps} supervised steps, "
              f"held-out greedy accuracy {acc0:.3f}", flush=True)  # fmt: skip
        summary = {
            "task": {k: v for k, v in task.items() if k not in ("train", "eval", "warm")},
            "model": {"arch": "LlamaForCausalLM", "hidden": args.hidden, "layers": args.layers,
                      "params": params, "tokenizer": "fastrl's packaged character tokenizer",
                      "built": "LlamaConfig(intermediate 3.5 x hidden, 4 heads, tied "
                      "embeddings), seed 0, save_pretrained"},
            "warm_start": {"sft_steps": args.warm_sft_steps, "noise": args.warm_noise,
                           "command": warm_cmd},
            "warm_start_acc": acc0,
            "settings": settings(args),
            "thresholds": list(THRESHOLDS),
            "seeds": args.seeds,
            "training_seconds": "the sum over steps of each step's time: generation, rewards, "
            "loss, backward, optimizer (fastrl: metrics.jsonl step_time_s; TRL: on_step_begin "
            "-> on_step_end); evaluations, logging and checkpoints excluded",
            "eval": "fastrl's greedy evaluation (fastrl.train.rollout.generate at temperature "
            "0, exact match) on the held-out pairs: fastrl's own --eval-file eval in the fastrl "
            "runs, the same generate + reward from a TrainerCallback in the TRL runs",
            "machine": {"cpu": info.get("device_name"), "cores": info.get("cpu_count"),
                        "load_avg_at_start": os.getloadavg()[0]},
            "versions": {"torch": torch.__version__, "trl": trl.__version__,
                         "transformers": transformers.__version__},
            "git_commit": info.get("git_commit"),
            # the command as run, so that the file says how to reproduce it
            "command": shlex.join(["python", "benchmarks/bench_learning.py", *sys.argv[1:]]),
            "fastrl_imported_from": str(Path(fastrl.__file__).parent),
            "fastrl_is_this_checkout": HERE.parent in Path(fastrl.__file__).resolve().parents,
            "time_utc": info.get("time_utc"),
            "quick": bool(args.quick),
            "runs": {"trl": {}, "fastrl": {}},
        }  # fmt: skip
        if args.ablate_from:  # the side-by-side runs of an earlier results file, same warm start
            prev = json.loads(Path(args.ablate_from).read_text())
            for k in ("task", "model", "warm_start", "warm_start_acc", "settings", "seeds"):
                if prev[k] != summary[k] and k != "warm_start":
                    raise SystemExit(f"--ablate-from: {k} differs ({prev[k]} != {summary[k]})")
            summary = {**prev, "ablation_time_utc": info.get("time_utc"),
                       "ablation_git_commit": info.get("git_commit"),
                       "ablation_load_avg_at_start": os.getloadavg()[0]}  # fmt: skip
        else:
            for seed in args.seeds:  # back to back: TRL then fastrl, per seed
                for name, fn in (("trl", run_trl), ("fastrl", run_fastrl)):
                    r = fn(args, task, model, seed, tmp / f"{name}-{seed}")
                    summary["runs"][name][str(seed)] = r
                    _say(name, seed, r)
                    _save(summary, out)
        summary["summary"] = summarise(summary["runs"])
        if args.ablate:
            ab = copy.copy(args)
            ab.max_steps, ab.budget, ab.stop_at = args.ablate_steps, 1e6, 2.0
            if summary.get("ablation") and summary["ablation_settings"] != settings(ab):
                raise SystemExit("--ablate-from: its ablation ran with other settings")
            summary["ablation_settings"] = settings(ab)
            names = args.variants or DEFAULT_ABLATIONS
            summary["ablation"] = summary.get("ablation") or {}  # --ablate-from: add to it
            for i, name in enumerate(names):
                kind, extra, patches, overrides = ABLATIONS[name]
                for seed in args.seeds:
                    where = tmp / f"ablation-{i}-{seed}"
                    if kind == "trl":
                        r = run_trl(ab, task, model, seed, where, overrides)
                    else:
                        r = run_fastrl(ab, task, model, seed, where, extra, patches)
                    summary["ablation"].setdefault(name, {})[str(seed)] = r
                    _say(name, seed, r)
                    _save(summary, out)
            base = {
                "TRL (base)": summary["runs"]["trl"],
                "fastrl (base)": summary["runs"]["fastrl"],
            }
            summary["ablation_summary"] = summarise({**base, **summary["ablation"]}, ab.max_steps)
    _save(summary, out)
    name = stem(args.trl_task)
    plot(summary, out / f"{name}.png")
    (out / f"{name}.md").write_text(table(summary))
    print(table(summary))
    print(f"wrote {out / name}.json, .png and .md")
    return summary


def _say(name: str, seed: int, r: dict) -> None:
    reached = ", ".join(
        f"{t:g} at step {p['step']} ({p['train_s']:.1f} s)"
        for t in THRESHOLDS
        if (p := reach(r["evals"], t))
    )
    print(
        f"{name} seed {seed}: {r['steps']} steps ({r['sec_per_step']:.3f} s/step), acc "
        f"{r['evals'][0]['acc']:.3f} -> {r['evals'][-1]['acc']:.3f}; reached {reached or '-'}",
        flush=True,
    )


if __name__ == "__main__":  # the child processes
    kind, spec_path = sys.argv[1], sys.argv[2]
    spec = json.loads(Path(spec_path).read_text())
    {"fastrl": child_fastrl, "trl": child_trl}[kind](spec)
