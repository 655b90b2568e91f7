"""Trainer: 2-process gloo == 1 process on the same data, resume == uninterrupted, an
interrupted save keeps the last good checkpoint, and each algorithm learns a small task."""

import json
import os
import subprocess
import sys

import pytest
import tiny_run
import torch

from fastrl.advantages import group_advantages
from fastrl.train import checkpoint as ckpt_io
from fastrl.train.config import TrainConfig
from fastrl.train.rollout import generate, sequence_logprobs
from fastrl.train.trainer import Batch, Trainer, read_metrics

TIMING = tiny_run.TIMING


def tiny(**kw) -> TrainConfig:
    base = {"group_size": 4, "eval_size": 16, "eval_every": 2, "num_threads": 0}
    return tiny_run.tiny(**{**base, **kw})


# ----------------------------------------------------------------------- data parallel
def _fixed_batch(trainer: Trainer, zero_rows: int = 0) -> Batch:
    """The same rollout batch in every process (seeded); each rank keeps its contiguous share
    and computes advantages on it as the trainer does (PPO whitens over all ranks). grpo / dapo:
    the first `zero_rows` rows of the whole batch get advantage 0."""
    ex = trainer.task.sample(__import__("random").Random(123), 4)
    r = generate(
        trainer.policy,
        trainer.encode(ex),
        4,
        4,
        trainer.eos,
        trainer.pad_id,
        generator=torch.Generator().manual_seed(5),
    )
    rewards = torch.tensor([float(i % 3 == 0) for i in range(r.completion_ids.shape[0])])
    rewards = rewards + 0.1 * r.lengths.float()
    n = r.completion_ids.shape[0] // trainer.world
    idx = torch.arange(trainer.rank * n, (trainer.rank + 1) * n)
    r, rewards = r.select(idx), rewards[idx]
    old = sequence_logprobs(trainer.policy, r)
    ref = sequence_logprobs(trainer.ref, r) if trainer.ref is not None else None
    if trainer.cfg.algo == "ppo":
        return trainer._ppo_advantages(r, rewards, old, ref)
    adv = torch.where(idx < zero_rows, 0.0, group_advantages(rewards, group_size=4))
    return Batch(r, adv, old, ref)


def _update_once(algo: str, grad_accum: int, zero_rows: int = 0, **kw) -> dict:
    """One `update` on the fixed batch (this rank's contiguous share of it; `_fixed_batch`)."""
    t = Trainer(
        tiny(
            algo=algo,
            grad_accum=grad_accum,
            minibatches=1,
            device="cpu",
            num_threads=1,
            kl_coef=0.1 if algo != "dapo" else None,
            **kw,
        ),
        log=lambda *a: None,
    )
    t.setup()
    out = t.update(_fixed_batch(t, zero_rows))
    params = [getattr(p, "full_tensor", lambda p=p: p)() for p in t.policy.parameters()]
    out["params"] = torch.cat([p.detach().flatten() for p in params]).tolist()
    out["fused_lm_head"] = t.fused_lm_head
    t.close()  # DDP wrappers released, then the process group (torchrun workers)
    return out


WORKER = """
import json, os, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
from test_trainer import _update_once
out = _update_once({algo!r}, 1, **{kw!r})
if int(os.environ["RANK"]) == 0:  # the process group is closed by now
    with open({path!r}, "w") as f:
        json.dump(out, f)
sys.stdout.flush()
sys.stderr.flush()
# skip interpreter finalisation: gloo's worker threads can still hold tensors then, and their
# release at teardown aborts the process now and then ("terminate called without an active
# exception", a known torch issue); the result is written and the process group closed
os._exit(0)
"""


def torchrun(args, tmp_path, timeout=300):
    """`torchrun --standalone --nproc_per_node 2 ARGS` in tmp_path, 1 thread per rank."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    proc = subprocess.run(
        [*cmd, *args], env=env, timeout=timeout, capture_output=True, text=True, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def update_two_ranks(algo: str, tmp_path, **kw) -> dict:
    """`_update_once(algo, 1, **kw)` on 2 torchrun ranks; rank 0's result."""
    script, path = tmp_path / "worker.py", tmp_path / "out.json"
    tests = os.path.dirname(__file__)
    script.write_text(WORKER.format(tests=tests, algo=algo, path=str(path), kw=kw))
    torchrun([str(script)], tmp_path)
    return json.loads(path.read_text())


def test_resume_on_another_number_of_processes_is_refused(tmp_path):
    """A checkpoint continues only on as many processes as saved it: each rank's prompts and
    samples come from its own stored RNGs (2 ranks resuming a 1-process run both took rank 0's
    and drew the same data). The error names --resume, both sizes and the command to use."""
    from tiny_run import TINY

    from fastrl.cli import main

    out = tmp_path / "run"
    assert main(["train", "--steps", "1", "--save-every", "1", "--out", str(out), *TINY]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    cmd += ["-m", "fastrl.cli", "train", "--resume", str(out), "--steps", "2"]
    proc = subprocess.run(cmd, env=env, timeout=300, capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode != 0
    assert "--resume" in proc.stderr and "saved by a run of 1 process(es), this one has 2" in (
        proc.stderr
    ), proc.stderr[-3000:]
    assert f"fastrl train --resume {out}" in proc.stderr
    # a checkpoint of an older fastrl (no "world" in its state): one rng_rank<r>.json per rank
    from types import SimpleNamespace

    from fastrl.train.saving import _check_world

    ckpt = tmp_path / "old"
    ckpt.mkdir()
    run = lambda world: SimpleNamespace(world=world, cfg=SimpleNamespace(out="o"))  # noqa: E731
    _check_world(run(1), str(ckpt), {})
    with pytest.raises(ValueError, match="1 process"):
        _check_world(run(2), str(ckpt), {})
    for r in range(2):
        (ckpt / f"rng_rank{r}.json").write_text("{}")
    _check_world(run(2), str(ckpt), {})
    with pytest.raises(ValueError, match="torchrun --standalone --nproc_per_node 2"):
        _check_world(run(1), str(ckpt), {})


@pytest.mark.parametrize("algo", ["grpo", "dapo", "ppo"])
def test_two_process_gloo_equals_one_process(algo, tmp_path):
    one = _update_once(algo, 2)  # one process, 2 micro-batches
    two = update_two_ranks(algo, tmp_path)  # 2 gloo processes, 1 micro-batch each
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5, abs=1e-7)
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-4)
    assert one["entropy"] == pytest.approx(two["entropy"], rel=1e-5)
    assert ("kl" in one) == (algo != "dapo")  # kl: to the reference, which dapo has not
    for key in ("kl", "approx_kl", "clipfrac_low", "clipfrac_high", "ratio_max"):
        if key in one:
            assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-7), key
    # one AdamW step from the same weights with the same gradient: the same weights. Adam's first
    # step is lr * g / (|g| + eps), close to lr * sign(g): a gradient entry within rounding of 0
    # (summed in another order across ranks) may legitimately land on the other side, so a
    # handful of entries (not more than 0.1%) may differ by up to 2 * lr.
    p1, p2 = torch.tensor(one["params"]), torch.tensor(two["params"])
    off = (p1 - p2).abs() > 1e-4
    assert off.float().mean() < 1e-3, f"{int(off.sum())} of {off.numel()} weights differ"
    assert (p1 - p2).abs().max() < 2.5e-3


def test_ranks_skip_alike_when_only_one_has_signal(tmp_path):
    """dapo (no KL): rank 0's rows all have advantage 0, rank 1's do not. The minibatch can
    move the policy on rank 1, so both ranks step (rank 0 forwarding a masked row into DDP's
    all-reduce, no rank left waiting), as one process does on the whole batch."""
    one = _update_once("dapo", 2, zero_rows=8)  # rank 0's share of the 16 rows: the first 8
    two = update_two_ranks("dapo", tmp_path, zero_rows=8)
    assert one["opt_steps"] == two["opt_steps"] == 1
    assert one["loss"] == pytest.approx(two["loss"], rel=1e-5, abs=1e-7) and one["loss"] != 0
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-4)
    p1, p2 = torch.tensor(one["params"]), torch.tensor(two["params"])
    assert ((p1 - p2).abs() > 1e-4).float().mean() < 1e-3


@pytest.mark.parametrize(
    "algo,fused,agg",
    [("grpo", False, None), ("ppo", False, None), ("dapo", True, None),
     ("grpo", False, "token-sum"), ("dapo", True, "token-sum"), ("ppo", False, "token-sum")],
)  # fmt: skip
def test_the_rank_average_is_folded_into_the_normalisers(algo, fused, agg, monkeypatch):
    """grad_scale (the world size: DDP / FSDP2 average gradients) divides num_tokens / num_seqs
    instead of multiplying the loss, so every fused backward starts from exactly 1 (no second
    pass over the logits, or over dW on the LM-head path); the gradient is grad_scale times the
    single-process one and the logged loss is unchanged. token-sum, which has no normaliser,
    too (it was the single-process gradient: 1 / world of the batch's after DDP's average). The
    value loss stays a token mean under a token-sum policy loss (it took the policy's stand-in
    count, 1 / world: a token sum, 2 N times the critic's loss and gradient on two ranks)."""
    import dataclasses

    import fastrl.ops

    scales = []
    scale_grad = fastrl.ops.scale_grad_

    def spy(grad, scale):
        scales.append(float(scale))
        scale_grad(grad, scale)

    monkeypatch.setattr(fastrl.ops, "scale_grad_", spy)
    outs = {}
    for grad_scale in (1, 2):
        t = Trainer(tiny(algo=algo, grad_accum=2, minibatches=1, device="cpu", num_threads=1,
                         kl_coef=0.1 if algo != "dapo" else None, loss_agg=agg),
                    log=lambda *a: None)  # fmt: skip
        t.setup()
        t.run = dataclasses.replace(t.run, grad_scale=grad_scale, fused_lm_head=fused)
        outs[grad_scale] = t.update(_fixed_batch(t))
        t.close()
    assert scales and set(scales) == {1.0}, scales  # 2 micro-batches x 2 runs
    one, two = outs[1], outs[2]
    assert two["loss"] == pytest.approx(one["loss"], rel=1e-6)
    assert two["grad_norm"] == pytest.approx(2 * one["grad_norm"], rel=1e-5)
    if algo == "ppo":
        assert two["value_loss"] == pytest.approx(one["value_loss"], rel=1e-6)
        assert two["critic_grad_norm"] == pytest.approx(2 * one["critic_grad_norm"], rel=1e-5)


# ----------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("algo,jsonl", [("grpo", False), ("ppo", False), ("dapo", False),
                                        ("grpo", True)])  # fmt: skip
def test_resume_equals_uninterrupted(tmp_path, algo, jsonl):
    # the lr of a --steps 2 run and of a --steps 4 run agree only in a warm-up (the decay ends
    # at --steps): 5 warm-up steps cover all 4
    kw = dict(algo=algo, save_every=2, num_threads=1, warmup_steps=5)
    if jsonl:  # 6 lines, 4 prompts a step: the checkpoint of step 2 holds how far into the
        # shuffled epochs it was; a resume that lost it would draw other prompts
        f = tmp_path / "t.jsonl"
        f.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n"
                             for a in range(6)))  # fmt: skip
        kw.update(task=str(f), eval_split=0)
    full = tiny(steps=4, out=str(tmp_path / "full"), **kw)
    Trainer(full, log=lambda *a: None).train()
    part = tiny(steps=2, out=str(tmp_path / "part"), **kw)
    Trainer(part, log=lambda *a: None).train()
    resumed = tiny(steps=4, out=str(tmp_path / "part"), resume=str(tmp_path / "part"), **kw)
    Trainer(resumed, log=lambda *a: None).train()
    a = read_metrics(str(tmp_path / "full" / "metrics.jsonl"))
    b = read_metrics(str(tmp_path / "part" / "metrics.jsonl"))
    assert [r["step"] for r in b] == [0, 1, 2, 3, 4]
    for ra, rb in zip(a[3:], b[3:]):
        assert {k: v for k, v in ra.items() if k not in TIMING} == {
            k: v for k, v in rb.items() if k not in TIMING
        }


def test_interrupted_save_keeps_last_good_checkpoint(tmp_path, monkeypatch):
    cfg = tiny(steps=2, save_every=1, out=str(tmp_path / "run"), num_threads=1)
    t = Trainer(cfg, log=lambda *a: None)
    t.train()
    root = str(tmp_path / "run" / "checkpoints")
    good = ckpt_io.latest_checkpoint(root)
    assert good.endswith("step-000002")
    t.step = 3

    def boom(*a, **k):
        raise KeyboardInterrupt("power cut")

    monkeypatch.setattr(ckpt_io.torch, "save", boom)  # dies after the weights, mid-checkpoint
    with pytest.raises(KeyboardInterrupt):
        t.save()
    monkeypatch.undo()
    assert ckpt_io.latest_checkpoint(root) == good
    assert not any(d.startswith(".tmp") for d in os.listdir(root))
    # the pointer file itself may be lost: the newest complete directory is still found
    os.unlink(os.path.join(root, "latest"))
    assert ckpt_io.latest_checkpoint(root) == good
    with open(os.path.join(good, "state.json")) as f:
        assert json.load(f)["step"] == 2


# ----------------------------------------------------------------------- learning
LEARN = dict(
    task="add_small",
    model_hidden=64,
    model_layers=2,
    batch_size=16,
    group_size=8,
    sft_steps=300,
    eval_size=100,
    eval_every=10,
    max_new_tokens=4,
    progress=False,
    num_threads=1,
)


@pytest.mark.slow
@pytest.mark.parametrize("algo,steps", [("grpo", 30), ("dapo", 30), ("ppo", 30)])
def test_algorithm_learns(tmp_path, algo, steps):
    cfg = TrainConfig(algo=algo, steps=steps, out=str(tmp_path / algo), save_every=0, **LEARN)
    Trainer(cfg, log=lambda *a: None).train()
    evals = [
        r["eval_accuracy"]
        for r in read_metrics(str(tmp_path / algo / "metrics.jsonl"))
        if "eval_accuracy" in r
    ]
    # the warm-up (a teacher that is off by one 75% of the time) leaves greedy accuracy low;
    # RL on the exact-answer reward must raise it well above. Where the warm-up ends is chaotic
    # in the last bit of its gradients (seed 0: 0.02 or 0.40 for two roundings of the same
    # backward), so the precondition has a margin and the claim is the gain RL adds.
    assert evals[0] <= 0.5, evals
    assert evals[-1] >= 0.7 and evals[-1] - evals[0] >= 0.4, evals


# ----------------------------------------------------------------------- tasks, rewards, dapo
def test_rewards_and_tasks():
    import random

    from fastrl.train.rewards import bracket_format, exact_match, last_number, resolve_reward, score
    from fastrl.train.tasks import get_task

    assert exact_match(" 85 ", "85") == 1.0 and exact_match("86", "85") == 0.0
    assert bracket_format("[85]", "85") == 1.0
    assert bracket_format("[84]", "85") == pytest.approx(0.2)
    assert bracket_format("85", "85") == 0.0
    assert last_number("so 3 then 85", "85") == 1.0
    assert last_number("__import__('os').getcwd()", "0") == 0.0  # text is never evaluated
    assert resolve_reward("exact_match") is exact_match
    rewards, errors = score(
        lambda c, a: 1 / 0 if c == "x" else float("nan") if c == "n" else 2e6 if c == "h" else 1,
        ["x", "n", "h", "ok"],
        ["1", "1", "1", "1"],
    )
    assert rewards == [0.0, 0.0, 0.0, 1.0] and errors == 3  # raised, NaN, |r| > MAX_ABS_REWARD
    task = get_task("arith")
    for ex in task.sample(random.Random(0), 200):
        assert int(ex.answer) >= 0  # subtraction results stay non-negative
    add = get_task("add")
    exs = add.sample(random.Random(1), 100)
    assert all(int(e.answer) == sum(map(int, e.prompt[:-1].split("+"))) for e in exs)
    noisy = add.warmup_examples(random.Random(1), 400)
    wrong = sum(int(e.answer) != sum(map(int, e.prompt[:-1].split("+"))) for e in noisy)
    assert 0.6 < wrong / 400 < 0.9  # the sloppy teacher of the warm-up
    assert get_task("add_format").target(exs[0]) == f"[{exs[0].answer}]"


def test_dapo_with_no_informative_group_takes_no_optimizer_step(tmp_path):
    # every reward is 0: dynamic sampling keeps nothing after max_gen_batches; the step's batch
    # is a fully masked group, so no minibatch can move the policy: none takes an AdamW step
    # (which would move the weights by its momentum), and the record says the batch was not full
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "never"}\n')
    cfg = tiny(
        algo="dapo",
        task=str(f),
        group_size=2,
        minibatches=2,
        grad_accum=2,
        steps=1,
        max_gen_batches=2,
        overlong_cache=0,
        out=str(tmp_path / "o"),
        num_threads=1,
    )
    t = Trainer(cfg, log=lambda *a: None)
    before = [p.detach().clone() for p in t.policy.parameters()]
    t.train()
    rec = read_metrics(str(tmp_path / "o" / "metrics.jsonl"))[-1]
    assert rec["kept_groups"] == 0 and rec["batch_full"] is False and rec["gen_batches"] == 2
    assert rec["loss"] == 0.0 and rec["opt_steps"] == 0 and "grad_norm" not in rec
    assert not t.state.opt.state and t.state.sched.last_epoch == 2  # the schedule still steps
    for b, p in zip(before, t.policy.parameters()):
        assert torch.equal(b, p)


@pytest.mark.parametrize("loss", ["gspo", "dapo"])
def test_dapo_with_fewer_rows_than_minibatches(tmp_path, loss):
    """dapo keeps G rows here (its fallback, fully masked) for 4 minibatches: every one is
    skipped (no optimizer step; the schedule still steps), never a NaN from a seq-mean over 0
    sequences (gspo stopped the run with "non-finite loss nan")."""
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "never"}\n')
    cfg = tiny(algo="dapo", loss=loss, task=str(f), batch_size=2, group_size=2, minibatches=4,
               steps=1, max_gen_batches=1, overlong_cache=0, out=str(tmp_path / "o"),
               num_threads=1)  # fmt: skip
    t = Trainer(cfg, log=lambda *a: None)
    t.train()
    rec = read_metrics(str(tmp_path / "o" / "metrics.jsonl"))[-1]
    assert rec["kept_groups"] == 0 and rec["loss"] == 0.0 and rec["opt_steps"] == 0
    assert not t.state.opt.state  # no AdamW step: no state
    assert t.state.sched.last_epoch == 4
