"""Input checking and canonical shapes for the policy loss (shared by reference and fused path).

Every public loss accepts either sequence-shaped inputs (logits (B, T, V), tokens (B, T)) or
flat ones (logits (N, V), tokens (N,)). Both are brought to the (B, T) form here, as views (the
logits are never copied): flat inputs become one row of N tokens, `flat=True`. Sequence-level
options (`ratio_level="sequence"`, `rollout_is="sequence"`, the `seq-mean-*` aggregations) need
real sequences and raise on flat inputs.

Errors are ValueErrors that name the argument, its shape or dtype, and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .config import TAU_MIN, TAU_MIN_TEXT, LossConfig, _is_finite32, _is_int, resolve_config
from .packing import Packing, make_packing

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def shape_error(name: str, t: Tensor, expected: str) -> ValueError:
    return ValueError(
        f"{name} has shape {tuple(t.shape)} and dtype {t.dtype} on {t.device}; expected {expected}"
    )


def describe(x) -> str:
    """How an argument looks, for error messages: shape / dtype / device, or its type."""
    if isinstance(x, Tensor):
        return f"shape {tuple(x.shape)}, dtype {x.dtype} on {x.device}"
    return type(x).__name__


def check_bool(name: str, value) -> bool:
    """`value` must be a bool, numpy's included (not 1, "yes" or None, which would read as one);
    else a ValueError naming `name`. Returns Python's own bool."""
    import numpy as np

    if not isinstance(value, (bool, np.bool_)):
        kind = f"{type(value).__module__}.{type(value).__qualname__}".removeprefix("builtins.")
        raise ValueError(f"{name} must be a bool, got {kind} {value!r}")
    return bool(value)


def check_float(name: str, x, expected: str, shape: tuple | None = None, device=None) -> Tensor:
    """`x` must be a float tensor (of `shape` and on `device` when given); else a ValueError
    naming `name`, what it is and what was `expected`."""
    ok = isinstance(x, Tensor) and x.is_floating_point()
    ok = ok and (shape is None or tuple(x.shape) == tuple(shape))
    ok = ok and (device is None or x.device == torch.device(device))
    if not ok:
        raise ValueError(f"{name} must be a float tensor of {expected}, got {describe(x)}")
    return x


def check_mask(name: str, mask, shape: tuple, device, as_float: bool = True) -> Tensor:
    """A mask of `shape` on `device`: bool, integer 0/1 (e.g. TRL's int64 completion_mask) or
    float >= 0 (1 = counts). fp32 when `as_float`. The values (finite in fp32, no negative
    weight, integer masks 0/1) are checked on CPU tensors outside torch.compile only: on an
    accelerator that would be a host sync, and in a compiled graph a graph break. A mask is a
    constant of every loss (like the advantages): returned detached, no gradient flows to a
    float mask that requires grad (the fused ops have no derivative w.r.t. it)."""
    ok = isinstance(mask, Tensor) and tuple(mask.shape) == tuple(shape)
    ok = ok and mask.device == torch.device(device)
    ok = ok and mask.dtype != torch.complex64 and mask.dtype != torch.complex128
    if not ok:
        raise ValueError(
            f"{name} must be a bool, integer (0/1) or float tensor of shape {tuple(shape)} on "
            f"{device}, got {describe(mask)}"
        )
    check = mask.device.type == "cpu" and not torch.compiler.is_compiling()
    if check and mask.dtype != torch.bool and mask.numel() > 0:
        if mask.is_floating_point():  # (an inf weight, or one past fp32's range: NaN results)
            bad = bool((~torch.isfinite(mask.float()) | (mask < 0)).any())
            what = "finite values >= 0 (no NaN or inf, no negative weight; fp32's range)"
        else:
            bad = bool(((mask != 0) & (mask != 1)).any())
            what = "integer values 0 or 1"
        if bad:
            raise ValueError(
                f"{name} must hold {what}, got values in [{mask.min().item()}, "
                f"{mask.max().item()}] ({describe(mask)})"
            )
    mask = mask.detach()
    return mask.float() if as_float else mask


def check_number(name: str, value, expected: str, ok) -> float:
    """`value` as a float when it is an int / float, finite in fp32 (where the kernels use it:
    1e39 is a finite Python float but inf there) and `ok(value)`; else a ValueError naming
    `name` and the `expected` ("a float > 0")."""
    if not _is_finite32(value) or not ok(value):
        raise ValueError(f"{name} must be {expected}, finite in fp32 (<= 3.4e38), got {value!r}")
    return float(value)


def check_int(name: str, value, minimum: int = 1, optional: bool = False) -> int | None:
    """`value` as Python's own int when it is an integer (numpy's too; a bool is not one) >=
    `minimum`, or None when `optional`; else a ValueError naming `name`."""
    if value is None and optional:
        return None
    if not _is_int(value) or value < minimum:
        what = f"an int >= {minimum}" + (" or None" if optional else "")
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return int(value)


def packed_per_sequence(name: str, t: Tensor, packing: Packing | None, N: int) -> bool:
    """Whether the per-row-or-per-sequence input `t` of packed rows (flat, N of them) holds one
    value per sequence, shape (S,), rather than one per row, (N,) or (1, N). When S == N the
    shape cannot tell: the two readings agree when every sequence is one row (max_seqlen 1);
    otherwise (an empty sequence, so another has several rows) a ValueError asks for (1, N)."""
    if packing is None or tuple(t.shape) != (packing.num_seqs,):
        return False
    if packing.num_seqs != N or packing.max_seqlen <= 1:
        return packing.num_seqs != N
    raise ValueError(
        f"{name} has shape ({N},): one per row (N = {N}) and one per packed sequence (S = "
        f"{packing.num_seqs}) at once, two readings that differ unless every sequence is one "
        f"row (an empty sequence makes another longer). Pass one value per row as shape (1, "
        f"{N}); per-sequence values repeated over their rows first "
        f"(values.repeat_interleave(cu_seqlens.diff())) are that too"
    )


def inv_tau(tau):
    """1 / tau, what the torch path multiplies by to form z' = z * (1 / tau): the float's
    reciprocal, or (R, 1) fp32 reciprocals of a column of per-row temperatures. A multiply, not a
    division, on every device and for both kinds, as the Triton kernels do: CUDA computes
    x / float as x * (1 / float), so a division gave a float and a constant tensor of the same
    temperature different last bits on the GPU (true division there for the tensor)."""
    return 1.0 / tau if isinstance(tau, float) else torch.reciprocal(tau)


def check_temperature(temperature: float) -> float:
    expected = "a float >= " + TAU_MIN_TEXT + " (1 / temperature finite in fp32)"
    return check_number("temperature", temperature, expected, lambda t: t >= TAU_MIN)


def check_temperature_rows(
    temperature: Tensor, B: int, T: int, flat: bool, device, packing: Packing | None = None
) -> Tensor:
    """A per-token temperature tensor as a detached fp32 (B, T) (a broadcast view when given per
    sequence or as one value): the shape of the tokens ((B, T), or (N,) for flat inputs), (B,)
    one per sequence (broadcast over T), (S,) one per packed sequence with `packing`, or () one
    for all. A float dtype, on the logits' device or the CPU (then moved). The values (finite,
    >= config.TAU_MIN) are checked on CPU tensors outside torch.compile only (elsewhere a host
    sync / a graph break): a ValueError naming `temperature`, its shape and the expected shapes
    otherwise."""
    shapes = [(), (T,), (1, T)] if flat else [(), (B,), (B, T)]
    if packing is not None:
        shapes.append((packing.num_seqs,))
    ok = isinstance(temperature, Tensor) and tuple(temperature.shape) in shapes
    ok = ok and temperature.is_floating_point()
    ok = ok and temperature.device in (torch.device(device), torch.device("cpu"))
    if not ok:  # (the message is formed here only: torch.compile cannot trace a concatenation
        # of strings holding symbolic sizes, with dynamic shapes)
        expected = "() (one for all), (N,) = " if flat else "() (one for all), (B,) = "
        expected += (
            f"{(T,)} or {(1, T)} (like tokens)"
            if flat
            else f"{(B,)} (one per sequence) or {(B, T)}"
        )
        if packing is not None:
            expected += f" or {(packing.num_seqs,)} (one per packed sequence)"
        if not flat:
            expected += " (like tokens)"
        raise ValueError(
            f"temperature as a tensor must be a float tensor of shape {expected}, on {device}"
            f"{'' if torch.device(device).type == 'cpu' else ' or the CPU'}; got "
            f"{describe(temperature)}"
        )
    t = temperature.detach()
    if t.device.type == "cpu" and not torch.compiler.is_compiling() and t.numel() > 0:
        bad = ~torch.isfinite(t) | (t < TAU_MIN)
        if bool(bad.any()):
            first = t.reshape(-1)[bad.reshape(-1).nonzero()[0, 0]].item()
            raise ValueError(
                f"temperature must hold finite values >= {TAU_MIN:.3g} (1 / temperature finite "
                f"in fp32); the tensor of shape {tuple(t.shape)} "
                f"holds {int(bad.sum())} that are not (e.g. {first})"
            )
    t = t.to(device=device, dtype=torch.float32)
    if t.dim() == 0:
        return t.expand(B, T)
    if packed_per_sequence("temperature", t, packing, T):
        return packing.per_row(t).view(1, T)
    if flat:
        return t.view(1, T)
    if t.dim() == 1:  # (B,): one per sequence
        return t[:, None].expand(B, T)
    return t.reshape(B, T)


def check_logits_tokens(logits: Tensor, tokens: Tensor, check_range: bool | None = None):
    """Validate logits (B, T, V) / (N, V) against tokens (B, T) / (N,).

    The token range check [0, V) needs the values; it runs on CPU tensors (no device sync) or when
    `check_range=True`. Returns (logits as (B, T, V), tokens as (B, T), flat)."""
    if not isinstance(logits, Tensor) or logits.dim() not in (2, 3):
        raise ValueError(
            f"logits must be a tensor of shape (B, T, V) or (N, V), got "
            f"{tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__}"
        )
    if logits.dtype not in FLOAT_DTYPES:
        raise shape_error("logits", logits, "dtype float32, bfloat16 or float16")
    if logits.shape[-1] < 1:
        raise shape_error("logits", logits, "a vocabulary dimension V >= 1")
    if not isinstance(tokens, Tensor):
        raise ValueError(f"tokens must be an integer tensor, got {type(tokens).__name__}")
    if tokens.dtype not in (torch.int64, torch.int32):
        raise shape_error("tokens", tokens, "dtype int64 or int32")
    if tuple(tokens.shape) != tuple(logits.shape[:-1]):
        raise shape_error("tokens", tokens, f"shape {tuple(logits.shape[:-1])} (logits without V)")
    if tokens.device != logits.device:
        raise shape_error("tokens", tokens, f"device {logits.device} (the logits' device)")
    if check_range is None:
        check_range = tokens.device.type == "cpu"
    if check_range and tokens.numel() > 0:
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= logits.shape[-1]:
            raise ValueError(
                f"tokens must lie in [0, V) = [0, {logits.shape[-1]}), got values in [{lo}, {hi}]"
            )
    flat = logits.dim() == 2
    if flat:
        logits, tokens = logits.unsqueeze(0), tokens.unsqueeze(0)
    return logits, tokens, flat


def _per_token(name: str, x: Tensor | None, B: int, T: int, flat: bool, device) -> Tensor | None:
    """A per-token float tensor like tokens, as fp32 (B, T)."""
    if x is None:
        return None
    expected = f"shape {(T,) if flat else (B, T)} (like tokens), a float dtype, device {device}"
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a tensor of {expected}, got {type(x).__name__}")
    if not x.is_floating_point() or x.device != device:
        raise shape_error(name, x, expected)
    if flat:
        if tuple(x.shape) != (T,):
            raise shape_error(name, x, expected)
        x = x.unsqueeze(0)
    elif tuple(x.shape) != (B, T):
        raise shape_error(name, x, expected)
    # a constant of the loss (SPEC): a tensor that still requires grad (e.g. old_logp computed
    # outside torch.no_grad) must not let the loss's gradient flow into it
    return x.detach().float()


@dataclass
class PolicyInputs:
    """Canonical inputs: every per-token tensor is (B, T); advantages fp32, mask fp32."""

    logits: Tensor  # (B, T, V) view of the caller's logits
    tokens: Tensor  # (B, T) int64 or int32
    advantages: Tensor  # (B, T) fp32 (a broadcast view when given per sequence)
    old_logp: Tensor | None  # (B, T) fp32
    ref_logp: Tensor | None  # (B, T) fp32
    rollout_logp: Tensor | None  # (B, T) fp32
    mask: Tensor  # (B, T) fp32, 1 = counts
    flat: bool  # the caller passed (N, V) / (N,)
    config: LossConfig
    num_tokens: Tensor | float | None  # global token count (token-mean)
    num_seqs: Tensor | float | None  # global sequence count (seq-mean-*)
    # packed sequences (`cu_seqlens`): every per-token tensor is then (1, N), flat=True, and the
    # sequence-level math runs on `packing.padded_inputs(self)` (fastrl.packing)
    packing: Packing | None = None
    # per-token temperature tau_t, fp32 (B, T), detached (a constant of the loss), replacing
    # config.temperature; None: the config's float
    temperature_rows: Tensor | None = None

    @property
    def temperature(self):
        """What the fused ops take as the temperature: the (B, T) tensor, or the float."""
        return self.config.temperature if self.temperature_rows is None else self.temperature_rows

    def unflatten(self, x: Tensor) -> Tensor:
        """(B, T) back to the caller's layout: (N,) for flat inputs."""
        return x.squeeze(0) if self.flat else x


def zero_uncounted(mask: Tensor, *tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """Each tensor (like `mask`, or broadcasting to it; None stays None) with 0 where `mask` is
    not > 0: the convention for what the mask excludes (a NaN there becomes 0, where x * 0 would
    stay NaN; torch.where's backward hands such an entry 0)."""
    counted = mask > 0
    return tuple(None if t is None else torch.where(counted, t, 0.0) for t in tensors)


def prepare_policy_inputs(
    logits: Tensor,
    tokens: Tensor,
    advantages: Tensor,
    old_logp: Tensor | None,
    ref_logp: Tensor | None,
    mask: Tensor | None,
    rollout_logp: Tensor | None,
    config: LossConfig | str | None,
    overrides: dict,
    check_range: bool | None = None,
    per_token: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    max_seqlen: int | None = None,
    temperature_tensor: bool = False,
) -> PolicyInputs:
    """Validate the arguments of `policy_loss` and bring them to the canonical (B, T) form.

    Without logits (logits = None), `per_token` (B, T) or (N,) (the caller's log-probs,
    `policy_loss_from_logprobs`), or else `tokens` (already checked by the caller, e.g. against
    the LM head's V), gives the layout, device and the (B, T) shape. `cu_seqlens` (S + 1,):
    flat inputs are S packed sequences (fastrl.packing); `advantages` may then be (S,).
    `temperature_tensor`: whether the caller handles a tensor `temperature` override (per-token
    temperature, `PolicyInputs.temperature_rows`, never in the LossConfig); else one raises."""
    overrides = dict(overrides)
    temperature = overrides.get("temperature")  # a tensor: per-token, kept out of the config
    temperature = overrides.pop("temperature") if isinstance(temperature, Tensor) else None
    if temperature is not None and not temperature_tensor:
        raise ValueError(
            f"temperature as a tensor ({describe(temperature)}) is not supported here: pass a "
            "float (per-token temperatures: fastrl.policy_loss, fastrl.logprobs, fastrl.sample)"
        )
    # Global counts may be 0-dim tensors (an all-reduced count): keep them out of the dataclass.
    counts = {}
    for key in ("num_tokens", "num_seqs"):
        if isinstance(overrides.get(key), Tensor):
            counts[key] = overrides.pop(key)
            c = counts[key]
            if c.numel() != 1 or c.is_complex() or c.dtype == torch.bool:
                raise shape_error(key, c, "a number or a one-element real tensor")
            like = next(t for t in (logits, per_token, tokens) if t is not None)
            if c.device.type == "meta" and like.device.type != "meta":
                raise shape_error(key, c, "a tensor on the logits' device or the CPU, not meta")
            counts[key] = c.detach()
    cfg = resolve_config(config, overrides)
    num_tokens = counts.get("num_tokens", cfg.num_tokens)
    num_seqs = counts.get("num_seqs", cfg.num_seqs)

    if logits is None:
        like = per_token if per_token is not None else tokens
        flat = like.dim() == 1
        B, T = (1, like.shape[0]) if flat else tuple(like.shape)
        dev = like.device
        if tokens is not None:
            tokens = tokens.reshape(B, T)
    else:
        logits, tokens, flat = check_logits_tokens(logits, tokens, check_range)
        B, T = tokens.shape
        dev = logits.device

    packing = None
    if cu_seqlens is not None:
        if not flat:
            rows = (
                "(N, V) logits"
                if logits is not None
                else "(N,) log-probs"
                if per_token is not None
                else "(N, H) hidden states"
            )
            raise ValueError(
                f"cu_seqlens is given, so the rows must be flat {rows} / (N,) per-token "
                f"tensors of packed sequences, got (B, T) = {(B, T)}"
            )
        packing = make_packing(cu_seqlens, T, dev, max_seqlen)
    elif max_seqlen is not None:
        raise ValueError("max_seqlen is given without cu_seqlens: it sizes packed sequences only")

    temperature_rows = None
    if temperature is not None:
        temperature_rows = check_temperature_rows(temperature, B, T, flat, dev, packing)

    if not isinstance(advantages, Tensor):
        raise ValueError(f"advantages must be a float tensor, got {type(advantages).__name__}")

    def adv_expected() -> str:  # (formed on an error only: see check_temperature_rows)
        text = f"shape {(T,)} or {(1, T)} (like tokens)" if flat else f"shape {(B,)} or {(B, T)}"
        per_seq = "" if packing is None else f" or {(packing.num_seqs,)} (one per sequence)"
        return text + per_seq

    if not advantages.is_floating_point() or advantages.device != dev:
        raise shape_error(
            "advantages", advantages, f"{adv_expected()}, a float dtype, device {dev}"
        )
    if packed_per_sequence("advantages", advantages, packing, T):
        advantages = packing.per_row(advantages)
    if flat:
        if tuple(advantages.shape) not in ((T,), (1, T)):
            raise shape_error("advantages", advantages, adv_expected())
        advantages = advantages.reshape(1, T)
    elif tuple(advantages.shape) == (B,):
        advantages = advantages.unsqueeze(1).expand(B, T)
    elif tuple(advantages.shape) != (B, T):
        raise shape_error("advantages", advantages, adv_expected())

    old_logp = _per_token("old_logp", old_logp, B, T, flat, dev)
    ref_logp = _per_token("ref_logp", ref_logp, B, T, flat, dev)
    rollout_logp = _per_token("rollout_logp", rollout_logp, B, T, flat, dev)

    if mask is None:
        mask = torch.ones(B, T, device=dev, dtype=torch.float32)
    else:
        mask = check_mask("mask", mask, (T,) if flat else (B, T), dev).reshape(B, T)
        # What the mask excludes never reaches the loss or its gradient: a NaN advantage or
        # log-prob at a masked token is replaced by 0 there (x * 0 would still be NaN).
        advantages, old_logp, ref_logp, rollout_logp = zero_uncounted(
            mask, advantages, old_logp, ref_logp, rollout_logp
        )

    if cfg.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} > 0 needs ref_logp (the reference log-probs)")
    if cfg.rollout_is is not None and rollout_logp is None:
        raise ValueError(
            f"rollout_is={cfg.rollout_is!r} needs rollout_logp (the sampler's log-probs)"
        )
    if cfg.rollout_is is None and rollout_logp is not None:
        raise ValueError(
            "rollout_logp was given but rollout_is is None: set rollout_is='token' or 'sequence' "
            "(with rollout_is_cap) to use it, or do not pass it"
        )
    if packing is not None and cfg.agg == "seq-mean-token-sum-norm" and cfg.max_len is None:
        raise ValueError(
            "agg='seq-mean-token-sum-norm' on packed sequences needs max_len (the constant L it "
            "divides by; a padded batch defaults it to its T, which packed rows do not have)"
        )
    if flat and packing is None:
        seq_opts = {
            "ratio_level": cfg.ratio_level == "sequence",
            "rollout_is": cfg.rollout_is == "sequence",
            "agg": cfg.agg not in ("token-mean", "token-sum"),
            # the k3 bias correction by the sequence's ratio (it couples a sequence's tokens)
            "kl_bias_ratio": cfg.kl_coef != 0
            and cfg.kl_bias_correction
            and cfg.kl_bias_ratio == "sequence",
        }
        used = [f"{k}={getattr(cfg, k)!r}" for k, on in seq_opts.items() if on]
        if used:
            what = "per-token tensors" if logits is None else f"logits {(T, logits.shape[-1])}"
            inputs = (
                "logits (B, T, V)"
                if logits is not None
                else "logp (B, T)"
                if per_token is not None
                else "hidden (B, T, H)"
            )
            raise ValueError(
                f"{', '.join(used)} needs sequences: pass (B, T) inputs ({inputs} and the "
                f"per-token tensors (B, T)), or flat rows with cu_seqlens marking each "
                f"sequence, not flat {what} alone"
            )
    return PolicyInputs(
        logits,
        tokens,
        advantages.detach().float(),
        old_logp,
        ref_logp,
        rollout_logp,
        mask,
        flat,
        cfg,
        num_tokens,
        num_seqs,
        packing,
        temperature_rows,
    )
