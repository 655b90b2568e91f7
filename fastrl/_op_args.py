"""The per-token inputs of a policy loss as custom-op arguments, written once.

`POLICY_ARGS_SCHEMA` is the argument list of fastrl::policy_loss_grad(_) and
fastrl::linear_policy_grad; `op_inputs` packs a PolicyInputs into it and `policy_inputs_from_op`
unpacks it. The LossConfig travels as its numbers (a `float[]`, Python counts included) and a
string constant of the rest (`config_key`); tensor counts, a per-token temperature, the
aggregation weights the caller formed and packed-sequence boundaries as tensors.
`flat_inputs` / `select_rows` give the (1, R) rows of a token-separable loss's chunk.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
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


def _numeric_fields() -> dict[str, bool]:
    """LossConfig's number fields (float, int, optional or not), each -> whether it is an int."""
    out = {}
    for f in dataclasses.fields(LossConfig):
        kinds = {t.strip() for t in str(f.type).split("|")} - {"None"}
        if kinds & {"float", "int"}:
            out[f.name] = kinds == {"int"}
    return out


_NUMERIC = _numeric_fields()


def config_key(cfg) -> tuple[list[float], str]:
    """A LossConfig as op arguments: its numbers (a `float[]`) and the rest as a string, a
    constant of the op schema (so of a compiled graph): `name=repr(value)` of every field but
    the numbers, which appear as `name=#` (`name=None` when unset), joined by ";"
    (`config_from_key` inverts it).

    The numbers are arguments, not part of the string: torch.compile makes a Python number that
    changes between calls (a kl_coef, a temperature, a num_tokens, a LossConfig rebuilt every
    step) symbolic, and a symbolic number cannot be formatted into a constant ("BUILD_STRING
    type error" under fullgraph=True); as a `float[]` argument it is a graph input. Built field
    by field, so that Dynamo folds it from the values it traces: a config created or replaced
    inside a compiled region (a preset name, keyword overrides) is never rebuilt from its class
    defaults (asdict of a traced dataclass once handed the op the default clip range)."""
    values, items = [], []
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        if f.name in _NUMERIC and v is not None:
            values.append(float(v))  # ints up to 2**53 are exact
            items.append(f"{f.name}=#")
        else:
            items.append(f"{f.name}={v!r}")
    return values, ";".join(items)


def config_from_key(values: list[float], key: str):
    """The LossConfig of `config_key`'s (values, key): the strings, bools and Nones of `key`,
    its `#` fields the `values` in order (an int field's as an int). Cached (LossConfig is
    frozen): parsing the key and validating the config took about 60 us of host time a call,
    once per op call in a training step."""
    if all(type(v) is float for v in values):  # (plain floats: hashable, never symbolic)
        return _config_from_key_cached(tuple(values), key)
    return _config_from_key(values, key)


@functools.lru_cache(maxsize=64)
def _config_from_key_cached(values: tuple[float, ...], key: str):
    return _config_from_key(values, key)


def _config_from_key(values, key: str):
    numbers = iter(values)
    fields = {}
    for item in key.split(";"):
        name, text = item.split("=", 1)
        if text == "#":
            v = next(numbers)
            fields[name] = int(v) if _NUMERIC[name] else v
        else:
            fields[name] = ast.literal_eval(text)
    return LossConfig(**fields)


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
# by `op_inputs` and unpacked by `policy_inputs_from_op`. Python counts travel in config_values;
# a per-token temperature (PolicyInputs.temperature_rows, fp32 (B, T)) travels as
# `temperature_rows` and replaces the config's float temperature. `weights`: the aggregation
# weights c_t of a token-separable loss (terms.aggregation_weights, x's layout) when the caller
# has formed them (it needs them again for the loss's value: ops.policy_output), else None.
POLICY_ARGS_SCHEMA = (
    "Tensor tokens, Tensor advantages, Tensor? old_logp, Tensor? ref_logp, "
    "Tensor? rollout_logp, Tensor mask, Tensor? num_tokens, Tensor? num_seqs, "
    "Tensor? temperature_rows, Tensor? weights, Tensor? cu_seqlens, int max_seqlen, "
    "float[] config_values, str config"
)


def op_inputs(x, weights=None) -> tuple:
    """PolicyInputs (and the aggregation weights, or None) as the POLICY_ARGS_SCHEMA
    arguments (tokens ... config)."""
    counts = [c if isinstance(c, Tensor) else None for c in (x.num_tokens, x.num_seqs)]
    pack = x.packing
    packing = (None, 0) if pack is None else (pack.cu_seqlens, pack.max_seqlen)
    return (x.tokens, x.advantages, x.old_logp, x.ref_logp, x.rollout_logp, x.mask, *counts,
            x.temperature_rows, weights, *packing, *config_key(x.config))  # fmt: skip


def policy_inputs_from_op(logits, args):
    """(PolicyInputs, the aggregation weights or None) from the POLICY_ARGS_SCHEMA arguments
    `args` (the inverse of `op_inputs`)."""
    tokens, advantages, old_logp, ref_logp, rollout_logp, mask, num_tokens, num_seqs = args[:8]
    temperature_rows, weights, cu_seqlens, max_seqlen, values, key = args[8:]
    cfg = config_from_key(values, key)
    packing = None
    if cu_seqlens is not None:  # checked by the public entry that packed the op's arguments
        packing = make_packing(cu_seqlens, mask.shape[1], mask.device, max_seqlen, check=False)
    x = PolicyInputs(
        logits, tokens, advantages, old_logp, ref_logp, rollout_logp, mask, packing is not None,
        cfg, cfg.num_tokens if num_tokens is None else num_tokens,
        cfg.num_seqs if num_seqs is None else num_seqs, packing, temperature_rows,
    )  # fmt: skip
    return x, weights
