"""`skip_zero_advantage`: grpo / dapo forward only the sequences whose loss can be non-zero.

A sequence with advantage 0 (its group's rewards all equal) or no counted token adds exactly 0
to the loss and its gradient when the loss has no KL and no entropy term, so skipping it (while
the normalisers still count it) must give the same update, and must really skip it."""

import pytest
import tiny_run
import torch

from fastrl.advantages import group_advantages
from fastrl.train import algos
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
    # collective), the update's micro-batches are empty, and the weights stay as they were
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
    assert rec["loss"] == 0.0 and rec["grad_norm"] == 0.0
    for key in ("entropy", "approx_kl", "clipfrac", "clipfrac_low", "clipfrac_high", "ratio_max"):
        assert key not in rec, key  # no token was trained: no average of none, not a false 0
    for b, p in zip(before, t.policy.parameters()):
        assert torch.equal(b, p)
