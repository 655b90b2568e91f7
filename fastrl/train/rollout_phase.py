"""Rollout and scoring: the supervised warm-up, generation with the reward calls, the
algorithm's reward shaping / group filter, pi_old and pi_ref log-probs, greedy evaluation."""

from __future__ import annotations

import random
import time

import torch

from ..losses import logprobs
from . import algos
from .common import Batch
from .rollout import Rollout, forward_completion_logits, generate, left_pad, sequence_logprobs
from .tasks import Example


class RolloutMixin:
    """Trainer methods that produce data: `collect` (one RL step's Batch) and `evaluate`."""

    # ------------------------------------------------------------------ text <-> ids
    def encode(self, examples: list[Example]) -> list[list[int]]:
        """Token ids of each prompt; ValueError for a prompt the tokenizer makes no token of."""
        ids = [self.tok(e.prompt).input_ids for e in examples]
        for e, row in zip(examples, ids):
            if not row:
                raise ValueError(
                    f"the prompt {e.prompt!r} encodes to no tokens with this tokenizer: every "
                    "prompt needs at least one token"
                )
        return ids

    def decode(self, r: Rollout) -> list[str]:
        ids = r.completion_ids.tolist()
        out = []
        for row, n in zip(ids, r.lengths.tolist()):
            row = [t for t in row[:n] if t not in self.eos]
            out.append(self.tok.decode(row, skip_special_tokens=True))
        return out

    # ------------------------------------------------------------------ warm-up
    def supervised_warmup(self):
        """Short supervised fine-tuning on (prompt, target + EOS) pairs of the task's warm-up
        distribution, with its own AdamW (discarded afterwards)."""
        cfg = self.cfg
        rng = random.Random(cfg.seed + 17)
        opt = torch.optim.AdamW(self.policy.parameters(), lr=cfg.sft_lr, betas=(0.9, 0.99))
        self.policy.train()
        steps = range(self.sft_steps)
        if cfg.progress and self.rank == 0 and self.sft_steps >= 100:
            from tqdm.auto import tqdm

            steps = tqdm(steps, desc="supervised warm-up", dynamic_ncols=True, leave=False)
        for _ in steps:
            r = self._teacher_forced(self.task.warmup_examples(rng, cfg.sft_batch_size))
            with self.amp():
                logits, _ = forward_completion_logits(self.policy, r)
                lp = logprobs(logits, r.completion_ids)
            loss = -(lp * r.completion_mask).sum() / r.completion_mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.policy.parameters(), cfg.max_grad_norm)
            opt.step()
        note = getattr(self.task, "warmup_note", "")
        self.log(
            f"supervised warm-up: {self.sft_steps} steps x {cfg.sft_batch_size} examples "
            f"(lr {cfg.sft_lr}){note}, final loss {loss.item():.3f}"
        )

    def _teacher_forced(self, examples: list[Example]) -> Rollout:
        prompts = self.encode(examples)
        targets = [
            self.tok(self.task.target(e), add_special_tokens=False).input_ids + [self.eos[0]]
            for e in examples
        ]
        p_ids, p_mask = left_pad(prompts, self.pad_id, self.device)
        T = max(len(t) for t in targets)
        c_ids = torch.full((len(targets), T), self.pad_id, dtype=torch.long)
        c_mask = torch.zeros((len(targets), T))
        for i, t in enumerate(targets):
            c_ids[i, : len(t)] = torch.tensor(t)
            c_mask[i, : len(t)] = 1
        dev = self.device
        return Rollout(
            p_ids,
            p_mask,
            c_ids.to(dev),
            c_mask.to(dev),
            torch.zeros_like(c_mask).to(dev),
            c_mask.sum(1).long().to(dev),
            torch.zeros(len(targets), dtype=torch.bool, device=dev),
        )

    # ------------------------------------------------------------------ evaluation
    @torch.no_grad()
    def evaluate(self) -> float:
        """Share of the eval prompts whose greedy completion gets reward >= 1."""
        self.policy.eval()
        correct = failed = 0
        for s in range(0, len(self.eval_set), 256):
            ex = self.eval_set[s : s + 256]
            with self.amp():
                r = generate(
                    self.policy,
                    self.encode(ex),
                    1,
                    self.cfg.max_new_tokens,
                    self.eos,
                    self.pad_id,
                    temperature=0.0,
                    sync_stop=self.cfg.fsdp,
                )
            res = self.scorer(self.decode(r), [e.answer for e in ex])
            correct += sum(x >= 1.0 - 1e-6 for x in res.rewards)
            failed += res.errors
        self.policy.train()
        if failed:
            self._warn(
                f"warning: eval after step {self.step}: {failed} of {len(self.eval_set)} reward "
                "calls failed (scored 0, counted as wrong)"
            )
        return correct / max(len(self.eval_set), 1)

    # ------------------------------------------------------------------ one RL step's data
    def _sample_and_score(self, n_prompts: int, st: dict) -> tuple[Rollout, torch.Tensor]:
        """`n_prompts` prompts x group_size samples and their task rewards (stats into st)."""
        cfg = self.cfg
        ex = self.task.sample(self.task_rng, n_prompts)
        t0 = time.perf_counter()
        with self.amp():
            r = generate(
                self.policy,
                self.encode(ex),
                cfg.group_size,
                cfg.max_new_tokens,
                self.eos,
                self.pad_id,
                temperature=cfg.temperature,
                top_k=cfg.top_k,
                top_p=cfg.top_p,
                generator=self.sample_gen,
                sync_stop=cfg.fsdp,
            )
        t1 = time.perf_counter()
        res = self.scorer(self.decode(r), [e.answer for e in ex for _ in range(cfg.group_size)])
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

    @torch.no_grad()
    def collect(self) -> tuple[Batch, dict]:
        """Generate, score and compute advantages for one RL step (this rank's share)."""
        cfg, G = self.cfg, self.cfg.group_size
        n_prompts = cfg.batch_size // self.world
        dapo = cfg.algo == "dapo"
        self.policy.eval()
        st = dict.fromkeys(
            ("reward_sum", "success", "len_sum", "truncated", "gen_time", "reward_time"), 0.0
        )
        st.update(dict.fromkeys(("n", "errors", "raised", "invalid", "timeouts"), 0))
        st.update(nonzero=0, tokens=0, rewards=[], gen_batches=0, kept_groups=0)
        parts, part_rewards = [], []
        for _ in range(cfg.max_gen_batches if dapo else 1):
            st["gen_batches"] += 1
            r, rewards = self._sample_and_score(n_prompts, st)
            if not dapo:
                parts, part_rewards = [r], [rewards]
                break
            rewards = algos.dapo_shaped_rewards(cfg, r, rewards)
            idx = algos.dapo_keep(rewards, G, n_prompts - st["kept_groups"])
            if len(idx):
                parts.append(r.select(idx.to(self.device)))
                part_rewards.append(rewards[idx])
            st["kept_groups"] += len(idx) // G
            if self._all_ranks(st["kept_groups"] >= n_prompts):
                break
        if not parts:  # dapo found no informative group: train on a fully masked group
            parts, part_rewards = [r.select(torch.arange(G, device=self.device))], [rewards[:G]]
            parts[0].completion_mask = torch.zeros_like(parts[0].completion_mask)
        rollout = Rollout.cat(parts, self.pad_id) if len(parts) > 1 else parts[0]
        rewards = torch.cat(part_rewards).to(self.device)
        if dapo and cfg.overlong_filter:
            rollout.completion_mask = rollout.completion_mask * (~rollout.truncated)[:, None]

        N = rollout.completion_ids.shape[0]
        chunk = N if cfg.fsdp else max(1, N // cfg.minibatches)  # fsdp: one forward per rank
        kw = dict(temperature=cfg.temperature, chunk=chunk, top_k=cfg.top_k, top_p=cfg.top_p)
        kw["lm_head"] = self.fused_lm_head
        with self.amp():
            old_logp = sequence_logprobs(self.policy, rollout, **kw)
            ref_logp = sequence_logprobs(self.ref, rollout, **kw) if self.ref is not None else None
        st["sampler_gap"] = float(
            ((old_logp - rollout.sampler_logp).abs() * rollout.completion_mask).max()
        )
        if cfg.algo == "ppo":
            batch = self._ppo_advantages(rollout, rewards, old_logp, ref_logp)
        else:
            batch = algos.group_batch(rollout, rewards, old_logp, ref_logp, G)
        self.policy.train()
        return batch, st

    def _all_ranks(self, flag: bool) -> bool:
        """`flag` on every rank (--fsdp: a sharded model's forwards are collectives, so a rank
        whose dapo batch is full keeps generating, and discarding, until every rank's is)."""
        if not self.cfg.fsdp:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
        return bool(t.item())

    def _ppo_advantages(self, rollout, rewards, old_logp, ref_logp) -> Batch:
        return algos.ppo_batch(
            self.critic, self.cfg, rollout, rewards, old_logp, ref_logp, self.amp
        )
