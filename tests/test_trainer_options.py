"""Trainer options of issue 12: DAPO shaping defaults, warm-up only for the embedded default,
held-out eval, the Hugging Face export round trip, --loss presets, lr schedules, top-k / top-p
on the same truncation, --dtype, --gradient-checkpointing, --report-to tensorboard, --max-time,
and the metrics (kl vs approx_kl, clip fractions, std, times, curves)."""

import json
import math
import sys
import types

import pytest
import tiny_run
import torch

from fastrl.cli import main
from fastrl.config import PRESETS
from fastrl.train import algos
from fastrl.train.build import lr_factor
from fastrl.train.config import TrainConfig, loss_config
from fastrl.train.rollout import Rollout
from fastrl.train.trainer import Trainer, read_metrics


def tiny(out, **kw) -> TrainConfig:
    return tiny_run.tiny(out, **{"group_size": 4, "eval_every": 2, **kw})


def quiet(*a, **k):
    pass


def _rollout(lengths, truncated, T):
    n = len(lengths)
    z = torch.zeros(n, T)
    return Rollout(
        torch.zeros(n, 1, dtype=torch.long),
        torch.ones(n, 1, dtype=torch.long),
        torch.zeros(n, T, dtype=torch.long),
        z,
        z,
        torch.tensor(lengths),
        torch.tensor(truncated),
    )


# ----------------------------------------------------------------------- 1. DAPO shaping
def test_dapo_overlong_default_never_penalises_an_answer_that_ends_inside_the_budget():
    # max_new_tokens 4: "12" + EOS is 3 tokens. The old default (L_cache 2, EOS counted) gave
    # it -0.5 while a wrong 1-digit answer got 0, so a policy below 50% on 2-digit sums was
    # pushed to answer with one digit (eval accuracy collapsed). Now: L_cache = 4 // 5 = 0.
    cfg = TrainConfig(algo="dapo", max_new_tokens=4)
    assert algos.overlong_cache(cfg) == 0
    r = _rollout([2, 3, 4, 4], [False, False, False, True], 4)
    assert algos.dapo_shaped_rewards(cfg, r, torch.ones(4)).tolist() == [1, 1, 1, 1]
    # a longer budget: L_cache = 10 // 5 = 2, |y| = tokens before the EOS
    cfg = TrainConfig(algo="dapo", max_new_tokens=10)
    assert algos.overlong_cache(cfg) == 2
    r = _rollout([3, 9, 10, 10, 10], [False, False, False, True, True], 10)
    shaped = algos.dapo_shaped_rewards(cfg, r, torch.zeros(5)).tolist()
    assert shaped == pytest.approx([0.0, 0.0, -0.5, -1.0, -1.0])  # |y| 2, 8 -> 0, 9 -> -0.5
    # max_new_tokens 6 (the embedded default): L_cache 1, every EOS-ended answer is free
    cfg = TrainConfig(algo="dapo", max_new_tokens=6)
    r = _rollout([1, 6, 6], [False, False, True], 6)
    assert algos.dapo_shaped_rewards(cfg, r, torch.zeros(3)).tolist() == [0, 0, -1]
    assert algos.dapo_shaped_rewards(
        TrainConfig(algo="dapo", max_new_tokens=6, overlong_cache=0), r, torch.zeros(3)
    ).tolist() == [0, 0, 0]


def test_dapo_dynamic_sampling_keeps_groups_by_accuracy_and_trains_on_shaped_rewards():
    """SPEC 9: a group is kept when its task rewards differ (some right, some wrong), not when
    only the overlong penalty differs. Filtered on the shaped rewards, the all-wrong group 0
    below (one answer ended with EOS, one truncated: shaped 0 and -1) was kept, and the wrong
    answer that stopped in time got a positive advantage."""
    cfg = TrainConfig(algo="dapo", max_new_tokens=6, group_size=2)  # L_cache = 1
    r = _rollout([3, 6, 6, 2, 6, 6], [False, True, True, False, True, True], 6)
    task = torch.tensor([0.0, 0.0, 1.0, 0.0, 1.0, 1.0])  # groups: all wrong, mixed, all right
    idx, shaped = algos.dapo_select(cfg, r, task, room=3)
    assert idx.tolist() == [2, 3]  # group 1 only
    assert shaped.tolist() == [0.0, 0.0]  # 1 - 1 (truncated) and 0 (ended with EOS)
    assert algos.dapo_select(cfg, r, task, room=0)[0].tolist() == []


# ----------------------------------------------------------------------- 2. user tasks
def _jsonl(path, n):
    lines = [
        json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)})
        for a in range(10)
        for b in range(10)
    ][:n]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_warmup_only_for_the_embedded_default(tmp_path):
    f = _jsonl(tmp_path / "t.jsonl", 20)
    assert Trainer(tiny(tmp_path / "a", sft_steps=None), log=quiet).sft_steps == 1000
    assert Trainer(tiny(tmp_path / "b", sft_steps=None, task=str(f)), log=quiet).sft_steps == 0
    assert Trainer(tiny(tmp_path / "c", sft_steps=7, task=str(f)), log=quiet).sft_steps == 7


def test_held_out_split_is_never_trained_on(tmp_path):
    f = _jsonl(tmp_path / "t.jsonl", 40)
    lines = []
    t = Trainer(tiny(tmp_path / "o", task=str(f), eval_split=0.25, eval_size=100), log=lines.append)
    held = {e.prompt for e in t.eval_set}
    assert len(held) == 10 and any("10 lines of" in line for line in lines)
    trained = {e.prompt for e in t.task.examples}
    assert len(trained) == 30 and not held & trained
    import random

    drawn = {e.prompt for e in t.task.sample(random.Random(0), 500)}
    assert not drawn & held
    # --eval-file: evaluate on that file, train on all lines of the task
    ev = _jsonl(tmp_path / "eval.jsonl", 5)
    t = Trainer(tiny(tmp_path / "p", task=str(f), eval_file=str(ev)), log=quiet)
    assert len(t.eval_set) == 5 and len(t.task.examples) == 40


def test_no_rank_trains_on_the_built_in_eval_prompts_in_order(tmp_path):
    """A built-in task's prompts of rank r come from a stream of their own: the stream seeded
    seed * 1_000_003 + r was the eval stream (seed + 1_000_003) at seed 1, rank 1, so under
    torchrun --seed 1 rank 1 drew exactly the eval prompts, in order (eval accuracy measured on
    its training draws). The trainer takes its stream from tasks.prompt_stream."""
    import random

    from fastrl.train.tasks import get_task, prompt_stream

    task = get_task("add")
    for seed in range(4):
        ev = [e.prompt for e in task.eval_examples(32, seed)]
        warm = [e.prompt for e in task.sample(random.Random(seed + 17), 32)]
        for rank in range(32):
            drawn = [e.prompt for e in task.sample(prompt_stream(seed, rank), 32)]
            assert drawn != ev and drawn != warm, (seed, rank)
    t = Trainer(tiny(tmp_path / "o", seed=1), log=quiet)
    assert t.state.task_rng.getstate() == prompt_stream(1, 0).getstate()


def test_jsonl_prompts_come_in_shuffled_epochs(tmp_path):
    import random

    from fastrl.train.tasks import EpochOrder

    f = _jsonl(tmp_path / "t.jsonl", 7)
    t = Trainer(tiny(tmp_path / "o", task=str(f), eval_split=0), log=quiet)
    order = EpochOrder(seed=0)
    drawn = [e.prompt for _ in range(7) for e in t.task.sample(random.Random(0), 3, order)]
    lines = sorted(e.prompt for e in t.task.examples)
    epochs = [drawn[i : i + 7] for i in range(0, 21, 7)]  # 21 draws: 3 epochs
    for epoch in epochs:
        assert sorted(epoch) == lines  # every line once before any line again
    assert epochs[0] != epochs[1] or epochs[1] != epochs[2]  # each epoch its own shuffle
    assert order.drawn == 21
    assert t.state.task_order.drawn == 0  # the trainer's own order: untouched by this test


@pytest.mark.parametrize("lines,world,n", [(8, 2, 4), (7, 3, 2), (5, 2, 3)])
def test_ranks_split_each_epoch_between_them(lines, world, n):
    """Ranks in step, each drawing n prompts a step: after every step all ranks together have
    drawn each line floor or ceil of (draws / lines) times; with world * n == lines, one step
    is one whole epoch. Ranks that shuffled on their own would draw some lines twice."""
    from fastrl.train.tasks import EpochOrder

    orders = [EpochOrder(seed=3, rank=r, world=world) for r in range(world)]
    counts = [0] * lines
    for step in range(9):
        for o in orders:
            for i in o.take(n, lines):
                counts[i] += 1
        assert max(counts) - min(counts) <= 1, (step, counts)
    # a resumed rank (its `drawn` restored) goes on exactly where it was
    again = EpochOrder(seed=3, rank=world - 1, world=world, drawn=orders[-1].drawn)
    assert again.take(2 * n, lines) == orders[-1].take(2 * n, lines)
    with pytest.raises(ValueError, match="rank must be in"):
        EpochOrder(seed=0, rank=world, world=world)


# ----------------------------------------------------------------------- 3. export
def test_export_from_pretrained_and_model_round_trip(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    rc = main(
        [
            "train", "--out", str(out), "--steps", "2", "--save-every", "1", "--model-hidden",
            "32", "--model-layers", "1", "--batch-size", "4", "--group-size", "2",
            "--sft-steps", "3", "--eval-size", "4", "--max-new-tokens", "4", "--progress",
            "false",
        ]
    )  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    hf = out / "checkpoints" / "step-000002" / "hf"
    assert f"model: {hf}" in text
    assert (out / "checkpoints" / "step-000001" / "hf" / "config.json").is_file()  # each one
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    from safetensors.torch import load_file

    saved = load_file(str(out / "checkpoints" / "step-000002" / "policy.safetensors"))
    for name, p in model.state_dict().items():
        if name in saved:
            assert torch.equal(p, saved[name]), name
    # --model accepts it (no warm-up for a user model)
    lines = []
    cfg = tiny(tmp_path / "again", model=str(hf), sft_steps=None, steps=1)
    t = Trainer(cfg, log=lines.append)
    assert t.sft_steps == 0
    for a, b in zip(t.policy.state_dict().values(), model.state_dict().values()):
        assert torch.equal(a, b)
    t.train()
    assert (tmp_path / "again" / "checkpoints" / "step-000001" / "hf" / "tokenizer.json").exists()


# ----------------------------------------------------------------------- 4. knobs
@pytest.mark.parametrize("preset", PRESETS)
def test_every_loss_preset_trains(tmp_path, preset):
    t = Trainer(tiny(tmp_path, loss=preset, steps=1), log=quiet)
    assert t.loss_cfg == loss_config(t.cfg)
    t.train()
    rec = read_metrics(str(tmp_path / "metrics.jsonl"))[-1]
    assert math.isfinite(rec["loss"]) and ("kl" in rec) == (preset == "grpo")


def test_grpo_trains_on_token_mean_unless_told_otherwise():
    from fastrl.config import LossConfig

    grpo = loss_config(TrainConfig(algo="grpo"))  # the trainer's choice for --algo grpo
    assert grpo.agg == "token-mean" and grpo.kl_coef == 0.04
    assert grpo == LossConfig.preset("grpo", agg="token-mean", temperature=1.0)
    assert loss_config(TrainConfig(algo="grpo", loss="grpo")).agg == "seq-mean-token-mean"
    assert loss_config(TrainConfig(algo="dapo")).agg == "token-mean"
    assert loss_config(TrainConfig(algo="ppo")).agg == LossConfig.preset("ppo").agg
    own = loss_config(TrainConfig(algo="grpo", loss_agg="seq-mean-token-mean"))
    assert own.agg == "seq-mean-token-mean"
    norm = loss_config(TrainConfig(loss_agg="seq-mean-token-sum-norm", max_new_tokens=7))
    assert norm.max_len == 7  # Dr.GRPO's normaliser is the generation budget
    assert loss_config(TrainConfig(loss="dr_grpo", max_new_tokens=9)).max_len == 9


def test_loss_config_errors_are_named_as_flags(monkeypatch):
    """validate() builds the run's LossConfig: a field an option sets is named as that option
    (every mapped option is a TrainConfig field); any other LossConfig error keeps LossConfig's
    words behind the --loss preset it came from."""
    from dataclasses import fields

    from fastrl.train import config as train_config

    names = {f.name for f in fields(TrainConfig)}
    assert set(train_config._LOSS_FLAGS.values()) <= names
    with pytest.raises(ValueError, match=r"--clip-high=-1.0 is invalid: expected a finite num"):
        TrainConfig(loss="cispo", clip_high=-1.0).validate()
    monkeypatch.delitem(train_config._LOSS_FLAGS, "clip_high")
    with pytest.raises(ValueError, match=r"^--loss cispo with these options: LossConfig.clip_h"):
        TrainConfig(loss="cispo", clip_high=-1.0).validate()


def test_adam_betas_reach_the_optimizer(tmp_path):
    t = Trainer(tiny(tmp_path, adam_beta1=0.8, adam_beta2=0.95), log=quiet)
    t.setup()
    assert t.state.opt.param_groups[0]["betas"] == (0.8, 0.95)
    assert TrainConfig().adam_beta2 == 0.999 and TrainConfig().warmup_steps == 0


@pytest.mark.parametrize(
    "field,value,extra",
    [("loss_agg", "sum", {}), ("adam_beta2", 1.0, {}), ("adam_beta1", -0.1, {}),
     # used to fail late (after the warm-up) or name another option
     ("value_clip", -1.0, {}), ("value_clip", math.nan, {}), ("kl_coef", math.nan, {}),
     ("kl_coef", math.inf, {}), ("lam", 2.0, {}), ("lam", math.nan, {}), ("seed", -1, {}),
     ("temperature", 1e-45, {}), ("model_hidden", 0, {}), ("model_hidden", 30, {}),
     ("model_layers", 0, {}),
     # finite in Python, inf in fp32: NaN at step 1 (or a LossConfig error naming no flag)
     ("kl_coef", 1e300, {}), ("temperature", 1e39, {}), ("lr", 1e39, {}),
     ("entropy_coef", 1e39, {}), ("entropy_coef", -1.0, {}),
     # LossConfig's own checks of the run's loss, named as the flag that set the field
     ("clip_low", 1.5, {}), ("clip_high", math.nan, {}), ("clip_low", -0.1, dict(loss="cispo")),
     ("kl_coef", 1e39, dict(algo="grpo")), ("entropy_coef", math.inf, dict(loss="gspo"))],
)  # fmt: skip
def test_bad_options_are_refused_up_front_naming_them(field, value, extra):
    with pytest.raises(ValueError, match="--" + field.replace("_", "-") + "="):
        TrainConfig(**{field: value}, **extra).validate()


def test_resume_with_more_steps_follows_the_new_schedule(tmp_path):
    """--steps may grow on --resume: the first resumed step takes the new schedule's lr (it
    used to take the checkpoint's, the old schedule's: 0 at its end)."""
    kw = dict(save_every=2, num_threads=1, warmup_steps=0, lr_schedule="linear")
    Trainer(tiny(tmp_path / "full", steps=4, **kw), log=quiet).train()
    Trainer(tiny(tmp_path / "part", steps=2, **kw), log=quiet).train()
    out = str(tmp_path / "part")
    Trainer(tiny(out, steps=4, resume=out, **kw), log=quiet).train()

    def lrs(run):
        return {r["step"]: r["lr"] for r in read_metrics(f"{run}/metrics.jsonl") if "lr" in r}

    full, resumed = lrs(tmp_path / "full"), lrs(out)
    assert resumed[3] == pytest.approx(full[3]) and resumed[3] > 0
    assert resumed[4] == pytest.approx(full[4])


def test_lr_schedules():
    assert [lr_factor(s, 2, 10, "constant") for s in range(4)] == [0.5, 1, 1, 1]
    lin = [lr_factor(s, 2, 10, "linear") for s in range(2, 10)]
    assert lin[0] == 1 and all(a > b for a, b in zip(lin, lin[1:])) and lin[-1] > 0
    cos = [lr_factor(s, 0, 10, "cosine") for s in range(10)]
    assert cos[0] == 1 and cos[5] == pytest.approx(0.5) and cos[-1] > 0


def test_lr_schedule_in_a_run(tmp_path):
    t = Trainer(tiny(tmp_path, lr_schedule="cosine", warmup_steps=0, steps=3), log=quiet)
    t.train()
    lrs = [r["lr"] for r in read_metrics(str(tmp_path / "metrics.jsonl")) if "lr" in r]
    assert lrs[0] > lrs[1] > lrs[2] > 0


@pytest.mark.parametrize("trunc", [{"top_k": 3}, {"top_p": 0.7}, {"top_k": 5, "top_p": 0.9}])
def test_top_k_top_p_loss_on_the_same_truncated_distribution(tmp_path, trunc):
    t = Trainer(tiny(tmp_path, steps=1, **trunc), log=quiet)
    t.setup()
    batch, st = t.collect()
    # pi_old's log-probs under the truncation equal the sampler's (same model, same rule)
    assert st["sampler_gap"] < 1e-4
    assert torch.isfinite(batch.old_logp).all()
    # without the truncation they would differ (the truncated distribution is renormalised)
    from fastrl.train.rollout import sequence_logprobs

    full = sequence_logprobs(t.policy, batch.rollout)
    m = batch.rollout.completion_mask
    assert ((full - batch.rollout.sampler_logp).abs() * m).max() > 1e-3
    out = t.update(batch)
    assert out["approx_kl"] == pytest.approx(0.0, abs=1e-6) or out["approx_kl"] >= 0


def test_bf16_and_gradient_checkpointing_on_cpu(tmp_path):
    t = Trainer(tiny(tmp_path / "a", dtype="bf16", gradient_checkpointing=True, algo="ppo"),
                log=quiet)  # fmt: skip
    t.train()
    assert (
        getattr(t.policy, "is_activation_checkpointing", None) or t.policy.is_gradient_checkpointing
    )
    rec = read_metrics(str(tmp_path / "a" / "metrics.jsonl"))[-1]
    assert math.isfinite(rec["loss"]) and math.isfinite(rec["value_loss"])


def test_report_to_tensorboard(tmp_path, monkeypatch, capsys):
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        rc = main(["train", "--out", str(tmp_path / "x"), "--report-to", "tensorboard"])
        assert rc == 2
        assert "pip install tensorboard" in capsys.readouterr().err
    scalars, opened = [], []

    class Writer:
        def __init__(self, log_dir, purge_step=None):
            self.log_dir = log_dir
            opened.append(purge_step)

        def add_scalar(self, tag, value, step):
            scalars.append((tag, value, step))

        def flush(self):
            pass

        def close(self):
            pass

    fake = types.ModuleType("torch.utils.tensorboard")
    fake.SummaryWriter = Writer
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", fake)
    Trainer(tiny(tmp_path / "tb", report_to="tensorboard"), log=quiet).train()
    tags = {tag for tag, _, _ in scalars}
    assert "reward/eval_accuracy" in tags and "train/loss" in tags and "train/lr" in tags
    assert (tmp_path / "tb" / "metrics.jsonl").is_file()  # beside metrics.jsonl
    # a resume rewrites the steps after its checkpoint: the events from there on are purged
    # (they mixed with the new ones); --force deletes an earlier run's event files
    kw = dict(report_to="tensorboard", warmup_steps=5, save_every=2)
    Trainer(tiny(tmp_path / "r", steps=2, **kw), log=quiet).train()
    Trainer(tiny(tmp_path / "r", steps=4, resume=str(tmp_path / "r"), **kw), log=quiet).train()
    assert opened == [None, None, 3]
    old = tmp_path / "r" / "tensorboard" / "events.out.tfevents.old"
    old.parent.mkdir(exist_ok=True)
    old.write_text("")
    Trainer(tiny(tmp_path / "r", steps=1, force=True, **kw), log=quiet).train()
    assert not old.exists()


def test_max_time_stops_with_eval_and_checkpoint(tmp_path):
    t = Trainer(tiny(tmp_path, steps=1000, max_time=1e-9, eval_every=500), log=quiet)
    t.train()
    recs = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert recs[-1]["step"] == 1 and "eval_accuracy" in recs[-1]
    assert (tmp_path / "checkpoints" / "step-000001" / "hf").is_dir()


# ----------------------------------------------------------------------- 5. metrics
def test_metrics_say_what_happened(tmp_path):
    lines = []
    cfg = tiny(tmp_path / "d", algo="dapo", max_gen_batches=1, steps=2, group_size=2)
    Trainer(cfg, log=lines.append).train()
    rec = read_metrics(str(tmp_path / "d" / "metrics.jsonl"))[-1]
    assert "kl" not in rec  # no reference: approx_kl is the KL to pi_old
    for key in (
        "reward_std", "adv_std", "gen_time_s", "update_time_s", "kept_groups", "batch_full",
    ):  # fmt: skip
        assert key in rec, key
    # the per-token averages are there exactly when some token was trained (a dapo step that
    # kept no group trains a fully masked one)
    for key in ("approx_kl", "clipfrac_low", "clipfrac_high", "ratio_max", "entropy"):
        assert (key in rec) == (rec["kept_groups"] > 0), key
    if not rec["batch_full"]:
        assert any("training on a partially filled batch" in line for line in lines)
    assert (tmp_path / "d" / "curves.png").stat().st_size > 10_000
    Trainer(tiny(tmp_path / "g", kl_coef=0.1), log=quiet).train()
    rec = read_metrics(str(tmp_path / "g" / "metrics.jsonl"))[-1]
    assert rec["kl"] >= 0 and rec["approx_kl"] >= 0


def test_bench_learning_smoke(tmp_path):
    import subprocess
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_learning.py"
    args = ["--quick", "--budget", "1", "--algos", "grpo", "--seeds", "0", "--eval-every", "2"]
    args += ["--eval-size", "4", "--out", str(tmp_path)]
    proc = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "learning.json").read_text())
    evals = data["runs"]["grpo"]["0"]["evals"]
    assert evals[0]["step"] == 0 and evals[-1]["step"] >= 1
    assert (tmp_path / "learning.png").is_file() and "| grpo |" in (
        tmp_path / "learning.md"
    ).read_text()


@pytest.mark.parametrize("name, world", [("cuda", 1), ("auto", 1), ("cuda", 2), ("cuda:0", 1)])
def test_pick_device_gives_set_device_an_index(monkeypatch, name, world):
    """--device cuda (and auto on a GPU machine) made every `fastrl train` on a GPU fail with
    torch.cuda.set_device's "Expected a torch.device with a specified index" (found on an
    H200). The device now gets the current index first. CUDA is faked here (_fake_cuda)."""
    from fastrl.train.build import pick_device

    chosen = _fake_cuda(monkeypatch, devices=2)
    monkeypatch.setenv("LOCAL_RANK", "0")
    dev = pick_device(name, world)
    assert dev == torch.device("cuda", 0) and chosen == [0]


def _fake_cuda(monkeypatch, devices: int) -> list:
    """CUDA faked with `devices` GPUs; returns the list of indices set_device receives (checked
    as the real set_device checks its argument before it reaches the driver)."""
    from torch.cuda._utils import _get_device_index

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: devices)
    chosen = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: chosen.append(_get_device_index(d)))
    return chosen


@pytest.mark.parametrize(
    "name, world, local_rank, match",
    [
        ("cuda:0", 2, 1, "each rank takes its own GPU"),  # every rank on cuda:0: NCCL fails
        ("cuda:5", 1, 0, "index 5, but this process sees 2"),  # set_device's own error: rc 1
        ("cuda", 2, 3, "LOCAL_RANK index 3, but this process sees 2"),
    ],
)
def test_pick_device_refuses_an_index_it_cannot_use(monkeypatch, name, world, local_rank, match):
    """An explicit GPU index under torchrun, or one past the visible devices, is a clear
    ValueError (`fastrl train: error`, exit status 2), not NCCL's duplicate-GPU error or a
    traceback from torch.cuda.set_device."""
    from fastrl.train.build import pick_device

    chosen = _fake_cuda(monkeypatch, devices=2)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    with pytest.raises(ValueError, match=match):
        pick_device(name, world)
    assert chosen == []
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert pick_device("cuda", 2) == torch.device("cuda", 1) and chosen == [1]


def test_fsdp_shards_on_a_mesh_of_the_runs_device(monkeypatch):
    """--fsdp shards every decoder layer, then the model, on a mesh of the run's device type:
    fully_shard's default mesh takes the torch build's accelerator, so a --device cpu run on a
    CUDA machine had its shards moved to the GPU (found reading torch's _init_default_mesh)."""
    import torch.distributed as dist
    import torch.distributed.device_mesh
    import torch.distributed.fsdp

    from fastrl.train import build

    meshes, sharded = [], []
    monkeypatch.setattr(dist, "get_world_size", lambda *a: 2)
    monkeypatch.setattr(torch.distributed.device_mesh, "init_device_mesh",
                        lambda kind, shape: meshes.append((kind, shape)) or "mesh")  # fmt: skip
    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard",
                        lambda m, mesh=None: sharded.append((type(m).__name__, mesh)))  # fmt: skip

    class Qwen2DecoderLayer(torch.nn.Linear):
        pass

    model = torch.nn.Sequential(Qwen2DecoderLayer(2, 2), Qwen2DecoderLayer(2, 2))
    build.shard(torch.device("cpu"), model, None)
    assert meshes == [("cpu", (2,))]
    assert sharded == [("Qwen2DecoderLayer", "mesh")] * 2 + [("Sequential", "mesh")]


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_a_model_with_dropout_trains_without_it(tmp_path, algo):
    """A --model whose config has dropout (GPT-2: resid / embd / attn_pdrop) trains with it off:
    pi_old is computed in eval mode and the update in train mode, so with dropout on, the first
    (on-policy) minibatch's ratio was not 1 and approx_kl not 0 at unchanged weights (seen:
    ratio_max 1.05). The reference copy and ppo's critic inherit it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from fastrl.train.rollout import default_tokenizer

    tok = default_tokenizer()
    config = GPT2Config(
        vocab_size=len(tok), n_positions=64, n_embd=32, n_layer=1, n_head=4, resid_pdrop=0.3,
        embd_pdrop=0.3, attn_pdrop=0.3, eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    path = tmp_path / "gpt2_dropout"
    GPT2LMHeadModel(config).save_pretrained(path)
    tok.save_pretrained(path)
    cfg = tiny(tmp_path / "run", model=str(path), algo=algo, steps=1, kl_coef=0.05, eval_every=100)
    t = Trainer(cfg, log=quiet)
    t.train()
    row = [r for r in read_metrics(str(tmp_path / "run" / "metrics.jsonl")) if "ratio_max" in r][0]
    assert row["ratio_max"] == 1.0 and row["approx_kl"] == 0.0, row
    for model in (t.policy, t.state.ref, t.state.critic):
        if model is not None:
            drops = [m.p for m in model.modules() if isinstance(m, torch.nn.Dropout)]
            assert drops and set(drops) == {0.0}
    assert t.policy.config.resid_pdrop == 0.0  # zeroed for the run, the export keeps 0.3
    from transformers import AutoConfig

    hf = tmp_path / "run" / "checkpoints" / "step-000001" / "hf"
    assert AutoConfig.from_pretrained(hf).resid_pdrop == 0.3


def test_ppo_values_are_not_rounded_to_bf16_under_autocast():
    """The critic's head runs in fp32 under --dtype bf16's autocast: its values (GAE's deltas,
    the value loss) are not bf16-rounded (8 bits: 2e-3 at V ~ 1), as they were."""
    from fastrl.train.rollout import default_model, default_tokenizer

    tok = default_tokenizer()
    torch.manual_seed(0)
    critic = algos.ValueModel(default_model(len(tok), seed=0, hidden=32, layers=1))
    torch.nn.init.normal_(critic.head.weight, std=0.3)
    r = _rollout([3, 4], [False, True], 4)
    r.completion_ids = torch.randint(3, len(tok), (2, 4))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        v = critic(r)
    assert v.dtype == torch.float32 and v.shape == (2, 4)
    assert (v != v.bfloat16().float()).any()  # finer than bf16's grid


def test_disable_dropout_reaches_what_attention_passes_to_sdpa():
    """Qwen2 / Llama attention keep `attention_dropout` (a float read from the config at init)
    and pass it to sdpa in train mode: disable_dropout zeroes it too (and the config's, kept
    for the export in model._fastrl_config_dropout)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fastrl.train.build import disable_dropout

    config = Qwen2Config(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, attention_dropout=0.2,
    )  # fmt: skip
    model = Qwen2ForCausalLM(config)
    attn = model.model.layers[0].self_attn
    assert attn.attention_dropout == 0.2
    disable_dropout(model)
    assert attn.attention_dropout == 0.0 and model.config.attention_dropout == 0.0
    assert model._fastrl_config_dropout == [(model.config, {"attention_dropout": 0.2})]
    model.train()
    ids = torch.randint(0, 32, (2, 6))
    torch.manual_seed(0)
    a = model(ids).logits
    torch.manual_seed(1)
    torch.testing.assert_close(model(ids).logits, a, rtol=0, atol=0)  # no randomness left
