"""`skip_zero_advantage`: grpo / dapo forward only the sequences whose loss can be non-zero.

A sequence with advantage 0 (its group's rewards all equal) or no counted token adds exactly 0
to the loss and its gradient when the loss has no KL and no entropy term, so skipping it (while
the normalisers still count it) must give the same update, and must really skip it."""

import pytest
import tiny_run
import torch

from fastrl.advantages import group_advantages
from fastrl.train import algos
from fastrl.train import update as update_phase
from fastrl.train.config import TrainConfig
from fastrl.train.rollout import generate, sequence_logprobs
from fastrl.train.trainer import Batch, Trainer, read_metrics

G = 4
# per group of 4: all right, mixed, all wrong, mixed -> groups 0 and 2 have advantage 0
REWARDS = [1.0, 1, 1, 1, 1, 0, 0, 1, 0, 0, 0, 0, 0, 1, 1, 1]


def _trainer(**kw) -> Trainer:
    cfg = tiny_run.tiny(group_size=G, batch_size=4, device="cpu", num_threads=1, eval_size=4, **kw)
    t = Trainer(cfg, log=lambda *a: None)
    t.setup()
    return t


def _batch(t: Trainer, skip: bool) -> Batch:
    """The same 16-sequence batch every call; with `skip`, the trainer's `trained` rows and
    NaN pi_old log-probs on the others (a skipped row that were read would spoil the loss)."""
    ex = t.task.sample(__import__("random").Random(7), 4)
    gen = torch.Generator().manual_seed(3)
    r = generate(t.policy, t.encode(ex), G, 4, t.eos, t.pad_id, generator=gen)
    r.completion_mask[5] = 0  # a mixed-group row with nothing counted: skipped as well
    adv = group_advantages(torch.tensor(REWARDS), group_size=G)
    old = sequence_logprobs(t.policy, r)
    if not skip:
        return Batch(r, adv, old)
    trained = algos.trained_rows(t.cfg, t.run.loss_cfg, adv, r.completion_mask, False)
    old = torch.where(trained[:, None], old, float("nan"))
    return Batch(r, adv, old, trained=trained)


def _rows_forwarded(t: Trainer) -> list[int]:
    seen = []
    t.policy.register_forward_hook(lambda m, a, kw, out: seen.append(kw["input_ids"].shape[0]),
                                   with_kwargs=True)  # fmt: skip
    return seen


@pytest.mark.parametrize("algo", ["grpo", "dapo"])
@pytest.mark.parametrize("minibatches,grad_accum", [(1, 1), (2, 2)])
def test_skipping_zero_advantage_rows_gives_the_same_update(algo, minibatches, grad_accum):
    kw = dict(algo=algo, minibatches=minibatches, grad_accum=grad_accum, kl_coef=0)
    full, skip = _trainer(**kw), _trainer(**kw)
    for a, b in zip(full.policy.parameters(), skip.policy.parameters()):
        assert torch.equal(a, b)
    bf, bs = _batch(full, False), _batch(skip, True)
    assert bs.trained.tolist() == [False] * 4 + [True, False, True, True] + [False] * 4 + [True] * 4
    seen = _rows_forwarded(skip)
    out_full, out_skip = full.update(bf), skip.update(bs)
    assert sum(seen) == 7  # only the trained rows went through the model
    assert out_skip["loss"] == pytest.approx(out_full["loss"], rel=1e-5, abs=1e-8)
    assert out_skip["grad_norm"] == pytest.approx(out_full["grad_norm"], rel=1e-5)
    assert out_full["loss"] != 0.0
    for a, b in zip(full.policy.parameters(), skip.policy.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "fields,ref",
    [
        (dict(algo="grpo"), True),  # grpo's preset: k3 KL to a reference, beta 0.04
        (dict(algo="grpo", kl_coef=0, entropy_coef=0.01), False),
        (dict(algo="ppo"), False),
        (dict(algo="grpo", kl_coef=0, skip_zero_advantage=False), False),
    ],
)
def test_no_skipping_when_a_zero_advantage_row_has_a_gradient(fields, ref):
    cfg = TrainConfig(**fields)
    from fastrl.train.config import loss_config

    adv, mask = torch.tensor([0.0, 1.0]), torch.ones(2, 3)
    assert algos.trained_rows(cfg, loss_config(cfg), adv, mask, ref) is None


def test_skip_is_on_for_grpo_without_kl_and_for_dapo():
    from fastrl.train.config import loss_config

    adv, mask = torch.tensor([0.0, 1.0, -1.0]), torch.tensor([[1.0, 1], [1, 0], [0, 0]])
    for cfg in (TrainConfig(algo="grpo", kl_coef=0), TrainConfig(algo="dapo")):
        rows = algos.trained_rows(cfg, loss_config(cfg), adv, mask, False)
        assert rows.device.type == "cpu" and rows.tolist() == [False, True, False]


def test_a_step_where_every_group_is_uniform_trains_nothing(tmp_path):
    # every reward is 0: no row is trained, pi_old still runs one row (an FSDP forward is a
    # collective), the update skips every minibatch, and the weights stay as they were
    f = tmp_path / "t.jsonl"
    f.write_text('{"prompt": "1+1=", "answer": "never"}\n')
    cfg = tiny_run.tiny(
        algo="grpo", kl_coef=0, task=str(f), steps=1, minibatches=2, grad_accum=2,
        out=str(tmp_path / "o"),
    )  # fmt: skip
    t = Trainer(cfg, log=lambda *a: None)
    before = [p.detach().clone() for p in t.policy.parameters()]
    t.train()
    rec = read_metrics(str(tmp_path / "o" / "metrics.jsonl"))[-1]
    assert rec["loss"] == 0.0 and rec["opt_steps"] == 0 and "grad_norm" not in rec
    for key in ("entropy", "approx_kl", "clipfrac", "clipfrac_low", "clipfrac_high", "ratio_max"):
        assert key not in rec, key  # no token was trained: no average of none, not a false 0
    for b, p in zip(before, t.policy.parameters()):
        assert torch.equal(b, p)


@pytest.mark.parametrize("skip", [True, False])
def test_a_minibatch_that_cannot_move_the_policy_takes_no_optimizer_step(skip):
    """After a step with signal (AdamW holds momentum), a batch whose every advantage is 0 (no
    KL, no entropy term: its loss is exactly 0) leaves the weights as they were, with
    skip_zero_advantage on or off: an AdamW step on a zero gradient would move them by its
    momentum. The schedule still steps."""
    t = _trainer(algo="grpo", kl_coef=0, minibatches=2, skip_zero_advantage=skip)
    b = _batch(t, skip)
    assert t.update(b)["opt_steps"] == 2
    before = [p.detach().clone() for p in t.policy.parameters()]
    epoch = t.state.sched.last_epoch
    zero = Batch(b.rollout, torch.zeros_like(b.advantages), b.old_logp.nan_to_num(0.0))
    if skip:
        zero.trained = torch.zeros_like(b.trained)
    seen = _rows_forwarded(t)
    out = t.update(zero)
    assert out["opt_steps"] == 0 and out["loss"] == 0.0 and "grad_norm" not in out
    assert seen == [] and t.state.sched.last_epoch == epoch + 2
    for a, p in zip(before, t.policy.parameters()):
        assert torch.equal(a, p)


def test_a_kl_term_moves_the_policy_without_an_advantage():
    """With a KL term a zero-advantage batch still has a gradient: every minibatch steps."""
    t = _trainer(algo="grpo", kl_coef=0.1, minibatches=2)
    b = _batch(t, False)
    zero = Batch(b.rollout, torch.zeros_like(b.advantages), b.old_logp, b.old_logp - 0.5)
    before = [p.detach().clone() for p in t.policy.parameters()]
    out = t.update(zero)
    assert out["opt_steps"] == 2 and out["grad_norm"] > 0
    assert any(not torch.equal(a, p) for a, p in zip(before, t.policy.parameters()))


def test_live_minibatches_count_the_rows_that_can_move_the_policy():
    t = _trainer(algo="grpo", kl_coef=0, minibatches=2)
    b = _batch(t, False)  # rows 0-3 and 8-11 have advantage 0, row 5 no counted token
    split = [[torch.tensor([0, 5, 8]), torch.tensor([1, 4, 2])], [torch.tensor([11, 9, 5])] * 2]
    assert update_phase._live_minibatches(t.run, b, split) == [[False, True], [False, False]]
    ppo = _trainer(algo="ppo", minibatches=2)  # every row with a counted token counts
    assert update_phase._live_minibatches(ppo.run, b, split) == [[True, True], [True, True]]


@pytest.mark.parametrize("loss", ["gspo", "dapo"])
def test_fewer_rows_than_minibatches_step_once_per_row(loss):
    """Two informative rows for 4 minibatches (dapo can keep fewer rows than --minibatches):
    two single-row minibatches step, the two empty ones only step the schedule; the loss is
    finite (a seq-mean over 0 sequences once stopped the run with a NaN)."""
    t = _trainer(algo="dapo", loss=loss, minibatches=4, skip_zero_advantage=False)
    b = _batch(t, False)
    idx = torch.tensor([4, 6])  # a mixed group's rows: advantage != 0, tokens counted
    assert (b.advantages[idx] != 0).all()
    two = Batch(b.rollout.select(idx), b.advantages[idx], b.old_logp[idx])
    epoch = t.state.sched.last_epoch
    out = t.update(two)
    assert out["opt_steps"] == 2 and t.state.sched.last_epoch == epoch + 4
    assert out["loss"] != 0 and torch.isfinite(torch.tensor(out["loss"]))
