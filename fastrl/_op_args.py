"""The per-token inputs of a policy loss as custom-op arguments, written once.

`POLICY_ARGS_SCHEMA` is the argument list of fastrl::policy_loss_grad(_) and
fastrl::linear_policy_grad; `op_inputs` packs a PolicyInputs into it and `policy_inputs_from_op`
unpacks it. The LossConfig travels as a string constant (`config_key`); Python counts travel in
it, tensor counts, a per-token temperature and packed-sequence boundaries as tensors.
`flat_inputs` / `select_rows` give the (1, R) rows of a token-separable loss's chunk.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
from pathlib import Path

from torch import Tensor

from ._inputs import PolicyInputs
from .config import LossConfig
from .packing import make_packing


def _source_key() -> str:
    """A hash of fastrl's Python source (every .py under the package), 16 hex digits.

    The ops whose backward is registered with `register_autograd` (fastrl::token_logprobs,
    fastrl::linear_token_stats) take it as a constant argument. torch.compile's AOTAutograd
    cache keys a compiled forward + backward on the traced forward graph alone, where such an op
    is one call: after an upgrade of fastrl that changed its backward, a warm cache (e.g.
    /tmp/torchinductor_$USER) handed back the old backward (a schema error, or a silently
    different gradient). With the key in the forward graph, new source means a new entry."""
    root = Path(__file__).resolve().parent
    h = hashlib.sha1()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


SOURCE_KEY = _source_key()


def config_key(cfg) -> str:
    """A LossConfig as a string, a constant of the op schema (so of a compiled graph): the
    `name=repr(value)` of every field, joined by ";" (`config_from_key` inverts it). Built field
    by field, so that Dynamo folds it from the values it traces: a config created or replaced
    inside a compiled region (a preset name, keyword overrides) is never rebuilt from its class
    defaults (asdict of a traced dataclass once handed the op the default clip range)."""
    return ";".join(f"{f.name}={getattr(cfg, f.name)!r}" for f in dataclasses.fields(cfg))


def config_from_key(key: str):
    """The LossConfig of `config_key` (all its values are None, bools, numbers or strings)."""

    def value(text: str):
        return float(text) if text in ("inf", "-inf", "nan") else ast.literal_eval(text)

    items = (item.split("=", 1) for item in key.split(";"))
    return LossConfig(**{name: value(text) for name, text in items})


def flat_inputs(x):
    """PolicyInputs with every (B, T) tensor as (1, N) (for a token-separable loss, whose rows
    are independent)."""
    N = x.tokens.numel()
    flat = lambda t: None if t is None else t.reshape(1, N)  # noqa: E731
    return dataclasses.replace(
        x, logits=None, tokens=flat(x.tokens), advantages=flat(x.advantages),
        old_logp=flat(x.old_logp), ref_logp=flat(x.ref_logp), rollout_logp=flat(x.rollout_logp),
        mask=flat(x.mask), packing=None, temperature_rows=flat(x.temperature_rows),
    )  # fmt: skip


def select_rows(x, rows):
    """The rows `rows` (a slice or an index tensor) of flat PolicyInputs, as (1, R)."""
    if isinstance(rows, slice):
        pick = lambda t: None if t is None else t[:, rows]  # noqa: E731
    else:
        pick = lambda t: None if t is None else t.index_select(1, rows)  # noqa: E731
    return dataclasses.replace(
        x, tokens=pick(x.tokens), advantages=pick(x.advantages), old_logp=pick(x.old_logp),
        ref_logp=pick(x.ref_logp), rollout_logp=pick(x.rollout_logp), mask=pick(x.mask),
        temperature_rows=pick(x.temperature_rows),
    )  # fmt: skip


# The per-token inputs of a policy loss, as custom-op arguments: written once here, used by the
# schemas of fastrl::policy_loss_grad(_) and fastrl::linear_policy_grad, packed from PolicyInputs
# by `op_inputs` and unpacked by `policy_inputs_from_op`. Python counts travel in the config key;
# a per-token temperature (PolicyInputs.temperature_rows, fp32 (B, T)) travels as
# `temperature_rows` and replaces the config's float temperature.
POLICY_ARGS_SCHEMA = (
    "Tensor tokens, Tensor advantages, Tensor? old_logp, Tensor? ref_logp, "
    "Tensor? rollout_logp, Tensor mask, Tensor? num_tokens, Tensor? num_seqs, "
    "Tensor? temperature_rows, Tensor? cu_seqlens, int max_seqlen, str config"
)


def op_inputs(x) -> tuple:
    """PolicyInputs as the POLICY_ARGS_SCHEMA arguments (tokens ... config)."""
    counts = [c if isinstance(c, Tensor) else None for c in (x.num_tokens, x.num_seqs)]
    pack = x.packing
    packing = (None, 0) if pack is None else (pack.cu_seqlens, pack.max_seqlen)
    return (x.tokens, x.advantages, x.old_logp, x.ref_logp, x.rollout_logp, x.mask, *counts,
            x.temperature_rows, *packing, config_key(x.config))  # fmt: skip


def policy_inputs_from_op(logits, args):
    """PolicyInputs from the POLICY_ARGS_SCHEMA arguments `args` (the inverse of `op_inputs`)."""
    tokens, advantages, old_logp, ref_logp, rollout_logp, mask, num_tokens, num_seqs = args[:8]
    temperature_rows, cu_seqlens, max_seqlen, key = args[8:]
    cfg = config_from_key(key)
    packing = None
    if cu_seqlens is not None:  # checked by the public entry that packed the op's arguments
        packing = make_packing(cu_seqlens, mask.shape[1], mask.device, max_seqlen, check=False)
    return PolicyInputs(
        logits, tokens, advantages, old_logp, ref_logp, rollout_logp, mask, packing is not None,
        cfg, cfg.num_tokens if num_tokens is None else num_tokens,
        cfg.num_seqs if num_seqs is None else num_seqs, packing, temperature_rows,
    )  # fmt: skip
