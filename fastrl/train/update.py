"""The update: `epochs` passes over `minibatches` shuffled minibatches, each one AdamW step (unless
it cannot move the policy: below) over `grad_accum` micro-batches of the fused
`fastrl.policy_loss` (+ the clipped value loss for ppo).

The loss normaliser is the token / sequence count of the whole optimizer step summed over
micro-batches and ranks (`num_tokens` / `num_seqs`), so accumulation and data parallelism give
the gradient of the full batch. DDP and FSDP2 average gradients over the ranks, so the loss must
be `grad_scale` (the world size) times the sum: that factor is folded into the normalisers
(num_tokens / grad_scale, num_seqs / grad_scale), not multiplied onto the loss, so that
`backward()` starts from a gradient of exactly 1 and the fused loss's backward hands on the
gradient it computed in the forward without another pass over the (n, T, V) logits (a factor
!= 1 there reads and writes every logit once more: DESIGN's "road to the floor", step 3).
`token-sum` has no normaliser to fold it into: on more than one rank it runs as token-mean over a
count of 1 / grad_scale (the same sum, times grad_scale), for the same reason.
A minibatch whose loss is exactly 0 on every rank by construction (`algos.signal_rows`: no row
with a counted token and, for grpo / dapo without a KL or entropy term, a non-zero advantage;
dapo's fully masked fallback when no group was informative, a grpo step whose every group is
uniform, a minibatch with no row at all when dapo kept fewer rows than --minibatches) is skipped:
no forward, no optimizer step (an AdamW step on a zero gradient still moves the weights, by its
momentum and its weight decay), only the schedule's step, so the learning rate keeps to the RL
steps. Which minibatches those are is known before the first one: one host read of the rows
that can move the policy, and one all-reduce of the per-minibatch counts over the ranks.
Rows the batch marks untrained (`Batch.trained`: zero advantage, no KL / entropy term) count in
the normalisers but are not forwarded: their loss and gradient are exactly 0.
Metric sums and gradient norms stay on the device and are read once per update; a non-finite
loss, value loss or gradient norm found there raises TrainingError naming the step.
"""

from __future__ import annotations

import contextlib
import functools
import warnings

import torch
import torch.distributed as dist
from torch import Tensor

from ..config import LossConfig
from ..linear import fused_linear_policy_loss
from ..losses import policy_loss, value_loss
from . import algos
from .common import Batch, TrainingError, all_reduce, last_good
from .rollout import completion_hidden, forward_completion_logits, truncate_like_sampler
from .state import Run, TrainState

# summed per update (token-weighted where it says n_tok): the one host read holds these
SUMS = (
    "loss",
    "tokens",
    "entropy",
    "kl",
    "clipfrac",
    "approx_kl",
    "value_loss",
    "vf_clipfrac",
    "clipfrac_low",
    "clipfrac_high",
)
_I = {k: i for i, k in enumerate(SUMS)}


def update(run: Run, state: TrainState, batch: Batch) -> dict:
    """At most `epochs` x `minibatches` optimizer steps on this rank's `batch` (none for a
    minibatch whose loss is 0 on every rank: `_live_minibatches`).

    Reads `run` (config, loss config, device, ranks), `state.shuffle_gen` (the minibatch order),
    and trains `state.policy` / `state.critic` through `state.train_policy` / `state.train_critic`
    with `state.opt` and `state.sched` (stepped once per minibatch). Returns the update's metrics,
    summed / averaged over ranks (identical on every rank). A non-finite loss, value loss or
    gradient norm raises TrainingError naming step `state.step + 1` (the weights are then
    spoiled: the run must stop before they are saved)."""
    cfg = run.cfg
    N = batch.rollout.completion_ids.shape[0]
    sums = torch.zeros(len(SUMS), dtype=torch.float64, device=run.device)
    ratio_max = torch.zeros((), dtype=torch.float64, device=run.device)
    grad_norms, lrs = [], []
    mask = batch.rollout.completion_mask
    perms = [torch.randperm(N, generator=state.shuffle_gen) for _ in range(cfg.epochs)]
    minibatches = [torch.tensor_split(perm, cfg.n_minibatches) for perm in perms]
    live = _live_minibatches(run, batch, minibatches)
    for e in range(cfg.epochs):
        for k, mb in enumerate(minibatches[e]):
            lrs.append(state.sched.get_last_lr()[0])  # the lr of this minibatch's step
            if not live[e][k]:  # loss 0 on every rank: no step but the schedule's
                _schedule_only(state.sched)
                continue
            one = torch.tensor(float(len(mb)), device=mask.device)
            num_tokens, num_seqs = all_reduce(torch.stack([mask[mb.to(run.device)].sum(), one]))
            if batch.trained is not None:  # rows of exactly zero loss: counted, not forwarded
                mb = mb[batch.trained[mb]]
            micros = torch.tensor_split(mb.to(run.device), cfg.grad_accum)
            state.opt.zero_grad(set_to_none=True)
            for i, mi in enumerate(micros):
                last = i == len(micros) - 1
                s, rmax = _micro_step(run, state, batch, mi, num_tokens, num_seqs, last)
                sums += s
                ratio_max = torch.maximum(ratio_max, rmax)
            grad_norms.append(_clip_and_step(cfg, state))
    n_opt = len(grad_norms)
    # the host read of this update's results: metric sums, ratio max, every grad norm pair
    ratio_max = all_reduce(ratio_max.reshape(1), dist.ReduceOp.MAX if run.world > 1 else None)
    norms = torch.stack(grad_norms).double().flatten() if n_opt else sums.new_zeros(0)
    host = torch.cat([all_reduce(sums), ratio_max, norms]).cpu()
    sums, ratio_max, norms = host[: len(SUMS)], host[len(SUMS)], host[len(SUMS) + 1 :]
    norms = norms.view(n_opt, 2)
    _check_finite(sums, norms, state.step + 1, cfg.out)
    # the loss is averaged over the optimizer steps taken; a step with none had a loss of
    # exactly 0 and no gradient to report
    out = {"loss": sums[0].item() / max(n_opt, 1), "opt_steps": n_opt, "lr": sum(lrs) / len(lrs)}
    if n_opt:
        out["grad_norm"] = norms[:, 0].mean().item()
    tok = sums[_I["tokens"]].item()
    # per-token averages over the forwarded tokens: none on a step that forwarded no counted
    # token (every group uniform, or dapo's fully masked fallback), rather than a false 0
    if tok > 0:
        for k in ("entropy", "approx_kl", "clipfrac", "clipfrac_low", "clipfrac_high"):
            out[k] = sums[_I[k]].item() / tok
        out["ratio_max"] = ratio_max.item()
        if batch.ref_logp is not None:  # KL to the reference; approx_kl is the KL to pi_old
            out["kl"] = sums[_I["kl"]].item() / tok
    if cfg.algo == "ppo":
        out["value_loss"] = sums[_I["value_loss"]].item() / max(n_opt, 1)
        if tok > 0:
            out["vf_clipfrac"] = sums[_I["vf_clipfrac"]].item() / tok
        if n_opt:
            out["critic_grad_norm"] = norms[:, 1].mean().item()
    return out


def _schedule_only(sched) -> None:
    """Step the lr schedule of a skipped optimizer step, without torch's warning that the
    schedule stepped before the optimizer did (meant for a misordered loop, not a skip)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)`")
        sched.step()


def _live_minibatches(run: Run, batch: Batch, minibatches: list) -> list[list[bool]]:
    """[epoch][k]: whether minibatch k (row indices into `batch`) of that epoch holds, on some
    rank, a row whose loss can be non-zero (`algos.signal_rows`). One host read, and on more
    than one rank one all-reduce of the (epochs * minibatches) counts: every rank skips alike."""
    r = batch.rollout
    rows = algos.signal_rows(
        run.cfg, run.loss_cfg, batch.advantages, r.completion_mask, batch.ref_logp is not None
    )
    counts = torch.tensor([[int(rows[mb].sum()) for mb in mbs] for mbs in minibatches])
    if run.world > 1:
        counts = all_reduce(counts.to(run.device)).cpu()
    return (counts > 0).tolist()


def _micro_step(
    run: Run,
    state: TrainState,
    batch: Batch,
    idx: Tensor,
    num_tokens: Tensor,
    num_seqs: Tensor,
    sync: bool,
) -> tuple[Tensor, Tensor]:
    """Forward + backward of one micro-batch (rows idx): its metric sums and ratio max.
    num_tokens / num_seqs: the optimizer step's global counts."""
    cfg, r = run.cfg, batch.rollout
    # the rank-average of DDP / FSDP2 folded into the normalisers (see the module docstring)
    num_tokens, num_seqs = num_tokens / run.grad_scale, num_seqs / run.grad_scale
    value_tokens = num_tokens  # the value loss is a token mean whatever the policy's aggregation
    loss_cfg = run.loss_cfg
    if loss_cfg.agg == "token-sum" and run.grad_scale != 1:  # no normaliser to fold it into
        loss_cfg, num_tokens = _as_token_mean(loss_cfg), 1.0 / run.grad_scale
    if len(idx) == 0:  # an empty micro-batch still joins DDP's all-reduce: a masked row
        idx = torch.zeros(1, dtype=torch.long, device=run.device)
        mask = torch.zeros_like(r.completion_mask[idx])
    else:
        mask = r.completion_mask[idx]
    no_sync = contextlib.ExitStack() if sync or run.world == 1 else _no_sync_all(state)
    tokens = r.completion_ids[idx]
    with no_sync:
        with run.amp():
            args = (
                tokens,
                batch.advantages[idx],
                batch.old_logp[idx],
                batch.ref_logp[idx] if batch.ref_logp is not None else None,
                mask,
            )
            kw = dict(config=loss_cfg, num_tokens=num_tokens, num_seqs=num_seqs)
            if run.fused_lm_head:  # LM head through the fused linear loss: never (n, T, V)
                hidden, head = completion_hidden(state.train_policy, r, idx)
                w = head.weight
                out = fused_linear_policy_loss(hidden.to(w.dtype), w, *args, bias=head.bias, **kw)
            else:
                logits, _ = forward_completion_logits(state.train_policy, r, idx)  # a view
                logits = truncate_like_sampler(
                    logits, tokens, cfg.temperature, cfg.top_k, cfg.top_p
                )
                out = policy_loss(logits, *args, **kw)
            loss = out.loss
            vloss = vclip = torch.zeros((), device=run.device)
            if state.critic is not None:
                values = state.train_critic(r, idx)
                vloss, vclip = value_loss(
                    values,
                    batch.old_values[idx],
                    batch.returns[idx],
                    mask,
                    clip=cfg.value_clip,
                    agg="token-mean",
                    num_tokens=value_tokens,  # the global count / grad_scale
                )
                loss = loss + cfg.vf_coef * vloss
        loss.backward()  # d loss / d loss = 1: no extra pass over the logits
    n_tok = mask.sum().double()
    m = out.metrics
    zero = torch.zeros((), dtype=torch.float64, device=run.device)
    kl = m["kl"].double() if batch.ref_logp is not None and m.get("kl") is not None else zero
    sums = torch.stack(
        [
            out.loss.detach().double() / run.grad_scale,  # the summed-over-ranks loss
            n_tok,
            m["entropy"].double() * n_tok,
            kl * n_tok,
            m["clipfrac"].double() * n_tok,
            m["approx_kl"].double() * n_tok,
            vloss.detach().double() / run.grad_scale,
            vclip.double() * n_tok,
            m["clipfrac_low"].double() * n_tok,
            m["clipfrac_high"].double() * n_tok,
        ]
    )
    rmax = torch.where(n_tok > 0, m["ratio_max"].double(), zero)
    return sums, rmax


@functools.lru_cache(maxsize=4)
def _as_token_mean(loss_cfg: LossConfig) -> LossConfig:
    """`loss_cfg` (token-sum) as token-mean: Σ m L / num_tokens is the token-sum Σ m L times
    grad_scale at num_tokens = 1 / grad_scale."""
    return loss_cfg.replace(agg="token-mean")


@contextlib.contextmanager
def _no_sync_all(state: TrainState):
    """No gradient all-reduce in the backwards inside (DDP's no_sync, FSDP2's
    set_requires_gradient_sync): micro-batches before the last of an optimizer step."""
    with contextlib.ExitStack() as stack:
        for m in (state.train_policy, state.train_critic):
            if m is not None and hasattr(m, "no_sync"):
                stack.enter_context(m.no_sync())
            elif m is not None and hasattr(m, "set_requires_gradient_sync"):  # FSDP2
                m.set_requires_gradient_sync(False)
                stack.callback(m.set_requires_gradient_sync, True)
        yield


def _clip_and_step(cfg, state: TrainState) -> Tensor:
    """Clip, step; (policy, critic) gradient norms before clipping, on the device (no sync)."""
    norm = _full(torch.nn.utils.clip_grad_norm_(state.policy.parameters(), cfg.max_grad_norm))
    cnorm = torch.zeros_like(norm)
    if state.critic is not None:
        cnorm = _full(
            torch.nn.utils.clip_grad_norm_(state.critic.parameters(), cfg.max_grad_norm)
        ).to(norm)
    state.opt.step()
    state.sched.step()
    return torch.stack([norm, cnorm])


def _check_finite(sums: Tensor, norms: Tensor, step: int, out: str) -> None:
    """Raise TrainingError naming RL step `step` when this update's loss, value loss or a
    gradient norm (host copies) is NaN / inf."""
    if bool(torch.isfinite(sums).all()) and bool(torch.isfinite(norms).all()):
        return
    what = []
    if not torch.isfinite(sums[0]):
        what.append(f"loss {sums[0].item()}")
    if not torch.isfinite(sums[_I["value_loss"]]):
        what.append(f"value loss {sums[_I['value_loss']].item()}")
    for col, name in ((0, "policy"), (1, "critic")):
        bad = (~torch.isfinite(norms[:, col])).nonzero().flatten().tolist()
        if bad:
            what.append(
                f"{name} gradient norm {norms[bad[0], col].item()} at optimizer step "
                f"{bad[0] + 1} of {len(norms)}"
            )
    if not what:
        what.append("loss metrics (entropy / KL / clip fractions)")
    raise TrainingError(
        f"step {step}: non-finite {', '.join(what)}; stopping. The weights are "
        f"spoiled, so this step is not saved; {last_good(out)}"
    )


def _full(norm: Tensor) -> Tensor:
    """A gradient norm as a plain tensor (FSDP2's clip_grad_norm_ returns a DTensor)."""
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm
