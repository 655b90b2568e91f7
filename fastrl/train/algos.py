"""What differs between the algorithms, in one place.

            rewards                       groups kept                  advantages
  grpo      task reward                   all                          group (r - mean) / std
  dapo      task reward + overlong        dynamic sampling: groups     group, on the kept groups;
            shaping (EOS not counted)     whose rewards differ         truncated ones masked
  ppo       task reward on the last       all                          GAE with a critic,
            token (- beta * KL shaping)                                whitened over all ranks

grpo / dapo with no KL and no entropy term (`skip_zero_advantage`) forward only the sequences
whose advantage is not 0 (`group_rows`): the others add exactly nothing to the loss.

The loss (`--loss`, a LossConfig preset, default the one named like the algorithm) is the same
fused `fastrl.policy_loss` for all of them (fastrl/train/update.py).
"""

from __future__ import annotations

import copy

import torch
from torch import Tensor, nn

from ..advantages import (
    dynamic_sampling_filter,
    gae,
    group_advantages,
    overlong_penalty,
    whiten,
)
from .common import Batch, gather_rows
from .config import TrainConfig
from .rollout import Rollout


# --------------------------------------------------------------------------- grpo / dapo
def overlong_cache(cfg: TrainConfig) -> int:
    """L_cache of DAPO's overlong shaping: the option, or max_new_tokens // 5 (the paper's
    4096 of 20480; 0, i.e. no shaping, below 5 tokens)."""
    return cfg.max_new_tokens // 5 if cfg.overlong_cache is None else cfg.overlong_cache


def dapo_shaped_rewards(cfg: TrainConfig, r: Rollout, rewards: Tensor) -> Tensor:
    """rewards + DAPO's soft overlong penalty (SPEC 9) on |y| = the tokens before the EOS (a
    truncated response: all max_new_tokens of them), so an answer that ends with EOS within
    max_new_tokens - L_cache tokens is never penalised, whatever its length."""
    cache = overlong_cache(cfg)
    if cache <= 0:
        return rewards
    content = (r.lengths - (~r.truncated).long()).cpu()
    return rewards + overlong_penalty(content, cfg.max_new_tokens, cache, cfg.overlong_factor)


def dapo_keep(rewards: Tensor, group_size: int, room: int) -> Tensor:
    """Sequence indices of (at most `room`) groups whose rewards are not all equal."""
    keep = dynamic_sampling_filter(rewards, group_size)[:room]
    return (keep[:, None] * group_size + torch.arange(group_size)).flatten()


def dapo_select(cfg: TrainConfig, r: Rollout, rewards: Tensor, room: int):
    """DAPO's dynamic sampling of one generation batch (SPEC 9): (the indices of the sequences
    of at most `room` groups whose task rewards are not all equal, their shaped rewards).
    Kept by the task rewards (accuracy, as in the DAPO paper), trained on the shaped ones:
    filtered on the shaped rewards, an all-wrong group whose answers differ only in length was
    kept, and the wrong answer that stopped in time pushed up."""
    idx = dapo_keep(rewards, cfg.group_size, room)
    return idx, dapo_shaped_rewards(cfg, r, rewards)[idx]


def group_rows(cfg: TrainConfig, loss_cfg, rewards: Tensor, mask: Tensor, ref: bool):
    """grpo / dapo: (advantages (N,) on mask's device: `group_advantages` of the rewards (N,) in
    groups of group_size, scaled as --scale-rewards says, `trained_rows` of them)."""
    adv = group_advantages(rewards, group_size=cfg.group_size, scale=cfg.advantage_scale)
    adv = adv.to(mask.device)
    return adv, trained_rows(cfg, loss_cfg, adv, mask, ref)


def trained_rows(cfg: TrainConfig, loss_cfg, adv: Tensor, mask: Tensor, ref: bool):
    """grpo / dapo with `skip_zero_advantage`: (N,) bool on the host, the sequences whose loss
    can be non-zero (`signal_rows`), or None (train on all: `skip_zero_advantage` off, ppo, or a
    KL / entropy term, where every sequence with a counted token can move the policy)."""
    if not cfg.skip_zero_advantage or cfg.algo == "ppo" or loss_cfg.entropy_coef:
        return None
    if ref and loss_cfg.kl_coef:
        return None
    return signal_rows(cfg, loss_cfg, adv, mask, ref)


def signal_rows(cfg: TrainConfig, loss_cfg, adv: Tensor, mask: Tensor, ref: bool) -> Tensor:
    """(N,) bool on the host: the sequences whose loss, and so whose gradient, can be non-zero.
    A sequence with no counted token in `mask` (N, T) has loss 0 under every algorithm (the
    policy and the value loss are masked means / sums). For grpo / dapo with no KL term (`ref`
    False or beta 0) and no entropy bonus, every policy-gradient term of every loss preset is
    proportional to the advantage, so a sequence whose advantage `adv` (N,) is 0 has loss 0 too
    (one read of the mask and advantages: a host sync)."""
    rows = (mask > 0).any(-1)
    token_terms = loss_cfg.entropy_coef or (ref and loss_cfg.kl_coef)
    if cfg.algo != "ppo" and not token_terms:
        rows = rows & (adv != 0)
    return rows.cpu()


# --------------------------------------------------------------------------- ppo
class ValueModel(nn.Module):
    """PPO critic: a copy of the policy's backbone with a scalar head on its last hidden state."""

    def __init__(self, policy):
        super().__init__()
        base = getattr(policy, policy.base_model_prefix, None)
        if base is None:  # pragma: no cover - every HF causal LM has one
            raise ValueError("the policy model has no base model to copy for the critic")
        self.backbone = copy.deepcopy(base)
        # the width of the last hidden state: what the LM head reads (OPT-350m projects its
        # hidden_size 1024 to word_embed_proj_dim 512 before it), else the config's hidden_size
        lm_head = policy.get_output_embeddings()
        hidden = (
            lm_head.in_features if isinstance(lm_head, nn.Linear) else policy.config.hidden_size
        )
        self.head = nn.Linear(hidden, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, rollout: Rollout, idx: Tensor | None = None) -> Tensor:
        """Values (n, T) of the completion positions: V_t from the state that predicts token t."""
        p_ids, p_mask, c_ids = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids
        if idx is not None:
            p_ids, p_mask, c_ids = p_ids[idx], p_mask[idx], c_ids[idx]
        P = p_ids.shape[1]
        ids = torch.cat([p_ids, c_ids], 1)
        attn = torch.cat([p_mask, torch.ones_like(c_ids)], 1)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        h = self.backbone(
            input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=False
        ).last_hidden_state
        # the head in fp32 under bf16 autocast too: the values (and so GAE's deltas and the
        # value loss) are not rounded to bf16's 8 bits (2e-3 at V ~ 1)
        with torch.autocast(h.device.type, enabled=False):
            return self.head(h[:, P - 1 : -1].float()).squeeze(-1)


@torch.no_grad()
def ppo_batch(critic, cfg: TrainConfig, r: Rollout, rewards, old_logp, ref_logp, amp) -> Batch:
    """Terminal reward on the last counted token (minus kl_coef * (old - ref) per token when KL
    shaping is on), GAE with the critic's values, advantages whitened over every rank's counted
    tokens (`fastrl.whiten` on the gathered batch: the same numbers as in one process)."""
    mask = r.completion_mask
    counted = mask > 0
    with amp():
        values = torch.where(counted, critic(r).float(), 0.0)  # a NaN at a masked token stays out
    token_rewards = torch.zeros_like(mask)
    last = (r.lengths - 1).clamp(min=0)
    token_rewards[torch.arange(len(last), device=mask.device), last] = rewards
    if ref_logp is not None and cfg.kl_coef:
        token_rewards = token_rewards - cfg.kl_coef * (old_logp - ref_logp) * mask
    adv, returns = gae(token_rewards, values, mask, cfg.gamma, cfg.lam, whiten=False)
    adv_all, mine = gather_rows(adv)
    mask_all, _ = gather_rows(mask)
    adv = torch.where(counted, whiten(adv_all, mask_all)[mine], 0.0)
    return Batch(r, adv, old_logp, ref_logp, torch.where(counted, returns, 0.0), values)
