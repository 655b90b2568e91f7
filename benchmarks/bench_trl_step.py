"""Benchmark: one optimizer step of the TRL drop-in, `fastrl.integrations.trl.GRPOTrainer`, against
the stock `trl.GRPOTrainer`, on the same tiny local model, data, seed and GRPOConfig.

    python benchmarks/bench_trl_step.py            # CUDA when available, else CPU
    python benchmarks/bench_trl_step.py --quick    # a tiny CPU-sized run (about a minute)
    python benchmarks/bench_trl_step.py --model path/to/hf-model-dir --dtype bf16

Model: by default a random-init Qwen2 decoder built from a config over fastrl's packaged
character tokenizer (`fastrl.train.rollout.default_model` / `default_tokenizer`, as in the README's
"Use it in TRL"); nothing is downloaded. --model takes any local Hugging Face causal-LM folder
(with its tokenizer) instead. The vocabulary of the default model is the tokenizer's (~100
symbols), so this measures the drop-in's overhead and integration in a whole trainer step, not
the loss kernels at a large V (bench_policy_loss.py and bench_fused_linear.py do that).

Each trainer runs `--warmup-steps + --steps` optimizer steps (gradient accumulation 1, one
generation per step, loss_type --loss-type, beta --beta); a TrainerCallback times every step
(on_step_begin -> on_step_end, CUDA-synchronised) and a wrapper times the generation inside it
(GRPOTrainer._generate_and_score_completions: sampling, rewards, old / reference log-probs).
The first --warmup-steps steps are dropped.

Rows (methods): trl.GRPOTrainer (THE BASELINE) and fastrl.integrations.trl.GRPOTrainer.
Reported per row:
  step_ms        one optimizer step: median, q20, q80 over the timed steps
  generate_ms    the generation part of the step (median)
  train_ms       step minus generation per step (scoring, loss, backward, optimizer): median,
                 q20, q80
  speedup_step_vs_trl, speedup_train_vs_trl   trl's median / this row's median
  peak_MB        CUDA: torch.cuda.max_memory_allocated during the timed steps above the
                 allocation before them; CPU: not measured (None; both trainers share one
                 process, so a resident-set delta would not be comparable)
  last_loss      the loss TRL logged at the last step (the two trainers compute the same loss;
                 sampling on CUDA may differ between the runs)
Results: <out>/bench_trl_step_<device>.{json,csv,png}.
"""

from __future__ import annotations

import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common  # noqa: E402
import torch  # noqa: E402

BASELINE = "trl.GRPOTrainer"
FASTRL = "fastrl.integrations.trl.GRPOTrainer"
PROMPTS = ["1+1=", "2+3=", "ab", "xyz", "hello", "7*6=", "abc", "q"]


def reward_len(completions, **kwargs):
    """Reward: completions close to 8 characters (the README's example)."""
    return [-abs(8 - len(c)) for c in completions]


def build_model(path: Path, hidden: int, layers: int) -> str:
    from fastrl.train.rollout import default_model, default_tokenizer

    tok = default_tokenizer()
    default_model(len(tok), seed=0, hidden=hidden, layers=layers).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_trainer(cls, model: str, args, device: torch.device, out_dir: Path) -> dict:
    """Train `warmup_steps + steps` optimizer steps; per-step times and the peak memory."""
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig

    total = args.warmup_steps + args.steps
    batch = args.batch
    cfg = GRPOConfig(
        output_dir=str(out_dir),
        loss_type=args.loss_type,
        beta=args.beta,
        per_device_train_batch_size=batch,
        num_generations=args.num_generations,
        gradient_accumulation_steps=1,
        max_completion_length=args.completion_len,
        max_steps=total,
        learning_rate=1e-5,
        seed=0,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        use_cpu=device.type != "cuda",
        bf16=args.dtype == "bf16",
    )
    prompts = (PROMPTS * (batch * total // len(PROMPTS) + 2))[: batch * total + batch]
    tokenizer = AutoTokenizer.from_pretrained(model, padding_side="left", local_files_only=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = cls(
            model=model,
            reward_funcs=reward_len,
            args=cfg,
            train_dataset=Dataset.from_dict({"prompt": prompts}),
            processing_class=tokenizer,
        )

    steps: list[float] = []
    gen: list[float] = []
    state = {"t0": 0.0, "gen": 0.0, "base": 0}

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            _sync(device)
            if len(steps) == args.warmup_steps and device.type == "cuda":
                state["base"] = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
            state["gen"] = 0.0
            state["t0"] = time.perf_counter()

        def on_step_end(self, *a, **k):
            _sync(device)
            steps.append((time.perf_counter() - state["t0"]) * 1e3)
            gen.append(state["gen"])

    generate = trainer._generate_and_score_completions

    def timed_generate(*a, **k):
        _sync(device)
        t0 = time.perf_counter()
        out = generate(*a, **k)
        _sync(device)
        state["gen"] += (time.perf_counter() - t0) * 1e3
        return out

    trainer._generate_and_score_completions = timed_generate
    trainer.add_callback(StepTimer())
    trainer.train()
    peak = None
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - state["base"]) / 2**20
    losses = [r["loss"] for r in trainer.state.log_history if "loss" in r]
    del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    kept = slice(args.warmup_steps, None)
    return {
        "step": steps[kept],
        "gen": gen[kept],
        "peak_MB": peak,
        "last_loss": losses[-1] if losses else None,
        "n_steps": len(steps),
    }


def build_parser():
    p = common.bench_parser("bench_trl_step.py", __doc__)
    p.add_argument(
        "--model",
        default=None,
        help="a local Hugging Face causal-LM folder with its tokenizer (default: a tiny Qwen2 "
        "built from a config, see --hidden / --layers)",
    )
    p.add_argument(
        "--hidden", type=int, default=None, help="hidden size of the default model (256; quick 32)"
    )
    p.add_argument(
        "--layers", type=int, default=None, help="layers of the default model (4; quick 2)"
    )
    p.add_argument(
        "--batch", type=int, default=None, help="per-device batch, completions (16; quick 4)"
    )
    p.add_argument(
        "--num-generations", type=int, default=None, help="completions per prompt (8; quick 4)"
    )
    p.add_argument(
        "--completion-len", type=int, default=None, help="max_completion_length (32; quick 8)"
    )
    p.add_argument("--steps", type=int, default=None, help="timed optimizer steps (8; quick 3)")
    p.add_argument(
        "--warmup-steps", type=int, default=None, help="untimed first steps (2; quick 1)"
    )
    p.add_argument("--loss-type", default="dapo", help="GRPOConfig.loss_type (default dapo)")
    p.add_argument("--beta", type=float, default=0.04, help="GRPOConfig.beta (default 0.04)")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["fp32", "bf16"],
        help="bf16=True in GRPOConfig or not (default bf16 on CUDA, fp32 on CPU)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: a tiny model's ops gain nothing from more, and on a "
        "shared machine OpenMP's waits for a busy core made steps ~10x slower)",
    )
    common.add_run_args(
        p,
        "bench_trl_step",
        "tiny run for tests: hidden 32, 2 layers, batch 4, 4 generations, 8 tokens, "
        "1 warm-up + 3 timed steps (unless the options say otherwise)",
        progress=False,
        memory_only=False,
    )
    return p


def resolve(args, device) -> None:
    quick = args.quick
    defaults = dict(
        hidden=32 if quick else 256,
        layers=2 if quick else 4,
        batch=4 if quick else 16,
        num_generations=4 if quick else 8,
        completion_len=8 if quick else 32,
        steps=3 if quick else 8,
        warmup_steps=1 if quick else 2,
        dtype="bf16" if device.type == "cuda" else "fp32",
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)


def main(argv=None):
    args, device = common.parse_bench_args(build_parser(), argv)
    resolve(args, device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    import trl

    import fastrl.integrations.trl as fastrl_trl

    info = common.device_info(device)
    rows, notes = [], {}
    # a stage timeout keeps the trainer already timed
    with common.keep_rows_on_interrupt(notes, rows), tempfile.TemporaryDirectory() as tmp:
        model = args.model or build_model(Path(tmp) / "tiny-qwen2", args.hidden, args.layers)
        for name, cls in [(BASELINE, trl.GRPOTrainer), (FASTRL, fastrl_trl.GRPOTrainer)]:
            print(f"{name}: {args.warmup_steps} + {args.steps} steps ...", file=sys.stderr)
            res = run_trainer(cls, model, args, device, Path(tmp) / name)
            train = [s - g for s, g in zip(res["step"], res["gen"])]
            st, tr, ge = (common.quantiles(x) for x in (res["step"], train, res["gen"]))
            rows.append(
                {
                    "method": name,
                    "role": "baseline" if name == BASELINE else "fastrl",
                    "steps": len(res["step"]),
                    "step_ms": st["median"],
                    "step_ms_q20": st["q20"],
                    "step_ms_q80": st["q80"],
                    "generate_ms": ge["median"],
                    "train_ms": tr["median"],
                    "train_ms_q20": tr["q20"],
                    "train_ms_q80": tr["q80"],
                    "peak_MB": res["peak_MB"],
                    "last_loss": res["last_loss"],
                }
            )
            print(
                f"{name:40s} step {st['median']:9.1f} ms  generation {ge['median']:9.1f} ms  "
                f"rest {tr['median']:9.1f} ms",
                file=sys.stderr,
            )
    if not rows:
        raise SystemExit("interrupted before the first trainer was timed")
    base = rows[0]
    for r in rows:
        r["speedup_step_vs_trl"] = base["step_ms"] / r["step_ms"]
        r["speedup_train_vs_trl"] = base["train_ms"] / r["train_ms"] if r["train_ms"] > 0 else None

    meta = {
        **info,
        "benchmark": "one GRPOTrainer optimizer step: fastrl.integrations.trl.GRPOTrainer vs "
        "trl.GRPOTrainer, same model, data, seed and GRPOConfig",
        "baseline": f"{BASELINE}: every speed-up is against it",
        "trl": trl.__version__,
        "model": args.model
        or f"tiny Qwen2 from a config (default_model): hidden {args.hidden}, "
        f"{args.layers} layers, the packaged character tokenizer",
        "config": {
            "loss_type": args.loss_type,
            "beta": args.beta,
            "per_device_train_batch_size": args.batch,
            "num_generations": args.num_generations,
            "max_completion_length": args.completion_len,
            "gradient_accumulation_steps": 1,
            "dtype": args.dtype,
            "warmup_steps": args.warmup_steps,
            "timed_steps": args.steps,
        },
        "timing": "perf_counter between TrainerCallback.on_step_begin and on_step_end (CUDA "
        "synchronised); generation = GRPOTrainer._generate_and_score_completions; train = step "
        "- generation",
        "memory_method": "torch.cuda.max_memory_allocated delta over the timed steps"
        if device.type == "cuda"
        else "not measured on CPU",
        "threads": torch.get_num_threads(),
        "env": common.run_env(),
        "notes": notes,
    }
    paths = common.save_results(
        f"bench_trl_step_{device.type}",
        rows,
        meta,
        args,
        lambda png: common.plot_bars(
            png,
            [dict(r, method=r["method"].split(".")[0]) for r in rows],
            "method",
            [("step_ms", "step ms (median)"), ("train_ms", "step - generation, ms (median)")],
            title=f"GRPOTrainer step on {info['device_name'][:40]}, commit "
            f"{str(info['git_commit'])[:7]}",
        ),
    )
    print(paths)
    return rows


if __name__ == "__main__":
    main()
