"""The stages that produce data: `collect` (one RL step's Batch: generation, rewards, the
algorithm's shaping / group filter, pi_old and pi_ref log-probs, advantages), `evaluate` (greedy,
on the eval set) and `supervised_warmup`. Each takes the Run and what of the TrainState it reads."""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist
from torch import nn

from ..losses import logprobs
from . import algos
from .common import Batch, TrainingError, all_ranks
from .rollout import (
    Rollout,
    check_positions,
    forward_completion_logits,
    generate,
    left_pad,
    sequence_logprobs,
)
from .state import Run, TrainState
from .tasks import Example


# --------------------------------------------------------------------------- text <-> ids
def encode(run: Run, examples: list[Example]) -> list[list[int]]:
    """Token ids of each prompt; ValueError for a prompt the tokenizer makes no token of."""
    ids = [run.tok(e.prompt).input_ids for e in examples]
    for e, row in zip(examples, ids):
        if not row:
            raise ValueError(
                f"the prompt {e.prompt!r} encodes to no tokens with this tokenizer: every "
                "prompt needs at least one token"
            )
    return ids


def decode(run: Run, r: Rollout) -> list[str]:
    """The text of each completion (up to its EOS, which is left out)."""
    out = []
    for row, n in zip(r.completion_ids.tolist(), r.lengths.tolist()):
        row = [t for t in row[:n] if t not in run.eos]
        out.append(run.tok.decode(row, skip_special_tokens=True))
    return out


# --------------------------------------------------------------------------- warm-up
def supervised_warmup(run: Run, policy: nn.Module) -> None:
    """`run.sft_steps` steps of supervised fine-tuning of `policy` (in place) on (prompt,
    target + EOS) pairs of the task's warm-up distribution, with its own AdamW (discarded
    afterwards) and its own RNG (seed + 17)."""
    cfg = run.cfg
    rng = random.Random(cfg.seed + 17)
    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.99))
    policy.train()
    steps = range(run.sft_steps)
    if cfg.progress and run.rank == 0 and run.sft_steps >= 100:
        from tqdm.auto import tqdm

        steps = tqdm(steps, desc="supervised warm-up", dynamic_ncols=True, leave=False)

    def nll(r: Rollout) -> torch.Tensor:
        with run.amp():
            logits, _ = forward_completion_logits(policy, r)
            lp = logprobs(logits, r.completion_ids, mask=r.completion_mask)
        return -(lp * r.completion_mask).sum() / r.completion_mask.sum()

    def refuse(what: str) -> None:
        raise TrainingError(
            f"supervised warm-up: {what}, so nothing was trained by RL and no eval is logged: "
            f"lower --sft-lr (now {cfg.sft_lr}) or --sft-steps (now {run.sft_steps}), or run "
            "without a warm-up (--sft-steps 0)"
        )

    for i in steps:
        r = _teacher_forced(run, run.task.warmup_examples(rng, cfg.sft_batch_size))
        P, T = r.prompt_ids.shape[1], r.completion_ids.shape[1]
        check_positions(policy, P, T, f"--sft-steps {run.sft_steps} (a target of {T} tokens)")
        loss = nll(r)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.max_grad_norm)
        # the norm of the gradients every rank holds alike (DDP / FSDP reduce them): each rank
        # stops at the same step; a non-finite one would make every weight NaN
        if not torch.isfinite(norm):
            bad = f"a non-finite loss ({float(loss.detach()):.4g}) or gradient norm"
            refuse(f"step {i + 1} of {run.sft_steps} had {bad} ({float(norm):.4g})")
        opt.step()
    with torch.no_grad():  # the loss after the last step (the same batch): the weights it left
        loss = nll(r)
    if not torch.isfinite(loss):
        refuse(f"the weights after its last step give a non-finite loss ({float(loss):.4g})")
    note = getattr(run.task, "warmup_note", "")
    run.console.log(
        f"supervised warm-up: {run.sft_steps} steps x {cfg.sft_batch_size} examples "
        f"(lr {cfg.sft_lr}){note}, final loss {loss.item():.3f}"
    )


def _teacher_forced(run: Run, examples: list[Example]) -> Rollout:
    """The examples' targets (+ EOS) as a Rollout, as if the policy had generated them."""
    prompts = encode(run, examples)
    targets = [
        run.tok(run.task.target(e), add_special_tokens=False).input_ids + [run.eos[0]]
        for e in examples
    ]
    p_ids, p_mask = left_pad(prompts, run.pad_id, run.device)
    T = max(len(t) for t in targets)
    c_ids = torch.full((len(targets), T), run.pad_id, dtype=torch.long)
    c_mask = torch.zeros((len(targets), T))
    for i, t in enumerate(targets):
        c_ids[i, : len(t)] = torch.tensor(t)
        c_mask[i, : len(t)] = 1
    dev = run.device
    return Rollout(
        p_ids,
        p_mask,
        c_ids.to(dev),
        c_mask.to(dev),
        torch.zeros_like(c_mask).to(dev),
        c_mask.sum(1).long().to(dev),
        torch.zeros(len(targets), dtype=torch.bool, device=dev),
    )


# --------------------------------------------------------------------------- evaluation
@torch.no_grad()
def evaluate(run: Run, policy: nn.Module, step: int) -> float:
    """Share of the eval prompts whose greedy completion from `policy` gets reward >= 1 (a
    warning names `step` when reward calls failed). Consumes no RNG."""
    policy.eval()
    correct = failed = 0
    for s in range(0, len(run.eval_set), 256):
        ex = run.eval_set[s : s + 256]
        with run.amp():
            r = generate(
                policy,
                encode(run, ex),
                1,
                run.cfg.max_new_tokens,
                run.eos,
                run.pad_id,
                temperature=0.0,
                sync_stop=run.cfg.fsdp,
            )
        res = run.scorer(decode(run, r), [e.answer for e in ex])
        correct += sum(x >= 1.0 - 1e-6 for x in res.rewards)
        failed += res.errors
    policy.train()
    if failed:
        run.console.warn(
            f"warning: eval after step {step}: {failed} of {len(run.eval_set)} reward "
            "calls failed (scored 0, counted as wrong)"
        )
    return correct / max(len(run.eval_set), 1)


# --------------------------------------------------------------------------- one RL step's data
@torch.no_grad()
def collect(run: Run, state: TrainState) -> tuple[Batch, dict]:
    """One RL step's data, this rank's share: `batch_size / world` prompts x `group_size`
    samples from `state.policy` (drawing prompts from `state.task_rng`, tokens from
    `state.sample_gen`), their rewards (dapo: generation repeated until dynamic sampling, on
    the task rewards, has filled the batch or `max_gen_batches` is reached; the kept groups
    trained on their shaped rewards), the pi_old log-probs (and
    pi_ref's from `state.ref`), and the advantages (ppo: GAE with `state.critic`).

    Returns (the Batch the update trains on, stats): the step's counts and reward sums (summed
    over ranks by `report.step_record`), the rewards, generation / reward times and the
    sampler's largest log-prob gap to pi_old."""
    cfg, G = run.cfg, run.cfg.group_size
    n_prompts = cfg.batch_size // run.world
    dapo = cfg.algo == "dapo"
    state.policy.eval()
    st = dict.fromkeys(
        ("reward_sum", "success", "len_sum", "truncated", "gen_time", "reward_time"), 0.0
    )
    st.update(dict.fromkeys(("n", "errors", "raised", "invalid", "timeouts"), 0))
    st.update(nonzero=0, tokens=0, rewards=[], gen_batches=0, kept_groups=0)
    parts, part_rewards = [], []
    for _ in range(cfg.max_gen_batches if dapo else 1):
        st["gen_batches"] += 1
        r, rewards = _sample_and_score(run, state, n_prompts, st)
        if not dapo:
            parts, part_rewards = [r], [rewards]
            break
        idx, kept_rewards = algos.dapo_select(cfg, r, rewards, n_prompts - st["kept_groups"])
        if len(idx):
            parts.append(r.select(idx.to(run.device)))
            part_rewards.append(kept_rewards)
        st["kept_groups"] += len(idx) // G
        full = st["kept_groups"] >= n_prompts
        if cfg.fsdp:  # a sharded model's forwards are collectives, so a rank whose batch is
            # full keeps generating, and discarding, until every rank's is
            full = bool(all_ranks(int(full), dist.ReduceOp.MIN, run.device, torch.int64))
        if full:
            break
    if not parts:  # dapo found no informative group: train on a fully masked group
        parts, part_rewards = [r.select(torch.arange(G, device=run.device))], [rewards[:G]]
        parts[0].completion_mask = torch.zeros_like(parts[0].completion_mask)
    rollout = Rollout.cat(parts, run.pad_id) if len(parts) > 1 else parts[0]
    rewards = torch.cat(part_rewards).to(run.device)
    if dapo and cfg.overlong_filter:
        rollout.completion_mask = rollout.completion_mask * (~rollout.truncated)[:, None]

    N, mask = rollout.completion_ids.shape[0], rollout.completion_mask
    chunk = N if cfg.fsdp else max(1, N // cfg.n_minibatches)  # fsdp: one forward per rank
    kw = dict(temperature=cfg.temperature, chunk=chunk, top_k=cfg.top_k, top_p=cfg.top_p)
    kw["lm_head"] = run.fused_lm_head
    adv = trained = None
    if cfg.algo != "ppo":  # grpo / dapo: one advantage per sequence, within its group
        adv, trained = algos.group_rows(cfg, run.loss_cfg, rewards, mask, state.ref is not None)
    with run.amp():
        old_logp = _old_logprobs(state.policy, rollout, trained, run.device, **kw)
        ref_logp = sequence_logprobs(state.ref, rollout, **kw) if state.ref is not None else None
    counted = mask if trained is None else mask * trained.to(run.device)[:, None]
    st["sampler_gap"] = float(((old_logp - rollout.sampler_logp).abs() * counted).max())
    if cfg.algo == "ppo":
        batch = algos.ppo_batch(state.critic, cfg, rollout, rewards, old_logp, ref_logp, run.amp)
    else:
        batch = Batch(rollout, adv, old_logp, ref_logp, trained=trained)
    state.policy.train()
    return batch, st


def _old_logprobs(policy, rollout: Rollout, trained, device, **kw) -> torch.Tensor:
    """pi_old log-probs (N, T) fp32 (`sequence_logprobs`); with `trained` (N,) only of those
    rows (at least one: an FSDP forward is a collective every rank joins), the others 0 (never
    read: the update does not forward them)."""
    if trained is None:
        return sequence_logprobs(policy, rollout, **kw)
    out = torch.zeros(rollout.completion_mask.shape, dtype=torch.float32, device=device)
    rows = trained.nonzero().flatten()
    rows = (rows if len(rows) else torch.zeros(1, dtype=torch.long)).to(device)
    out[rows] = sequence_logprobs(policy, rollout.select(rows), **kw)
    return out


def _sample_and_score(
    run: Run, state: TrainState, n_prompts: int, st: dict
) -> tuple[Rollout, torch.Tensor]:
    """`n_prompts` prompts x group_size samples and their task rewards (stats into st)."""
    cfg = run.cfg
    ex = run.task.sample(state.task_rng, n_prompts, state.task_order)
    t0 = time.perf_counter()
    with run.amp():
        r = generate(
            state.policy,
            encode(run, ex),
            cfg.group_size,
            cfg.max_new_tokens,
            run.eos,
            run.pad_id,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            generator=state.sample_gen,
            sync_stop=cfg.fsdp,
        )
    t1 = time.perf_counter()
    res = run.scorer(decode(run, r), [e.answer for e in ex for _ in range(cfg.group_size)])
    st["gen_time"] += t1 - t0
    st["reward_time"] += time.perf_counter() - t1
    raw = res.rewards
    st["rewards"] += list(raw)
    st["reward_sum"] += sum(raw)
    st["success"] += sum(x >= 1.0 - 1e-6 for x in raw)
    st["n"] += len(raw)
    for k in ("errors", "raised", "invalid", "timeouts"):
        st[k] += getattr(res, k)
    st["nonzero"] += sum(x != 0.0 for x in raw)
    st["tokens"] += int(r.lengths.sum())
    st["len_sum"] += float(r.lengths.float().sum())
    st["truncated"] += float(r.truncated.float().sum())
    return r, torch.tensor(raw, dtype=torch.float32)
