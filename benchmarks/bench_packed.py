"""Benchmark: packed (padding-free, `cu_seqlens`) vs padded batches at ~50 % padding, GRPO policy
loss forward + backward (time and peak memory).

    python benchmarks/bench_packed.py              # CPU: S = 16 sequences, T = 256, V = 32000,
                                                   # fp32 and bf16
    python benchmarks/bench_packed.py --quick      # tiny smoke run (seconds)
    python benchmarks/bench_packed.py --device cuda    # S = 64, T = 2048, V = 151936, bf16
    python benchmarks/bench_packed.py --S 32 --T 1024 --V 151936 --dtype bf16   # your shape

Workload: S sequences whose lengths are drawn uniformly in [1, T] (stratified: one draw in each
of S equal slices of [1, T], shuffled, the longest set to T, from --seed), so the padded (S, T)
batch is ~50 % padding (the exact fraction is in every row, pad_frac). The padded batch: logits
(S, T, V) in the row's dtype, tokens / old / reference log-probs (S, T), mask (S, T) with zeros
past each sequence's length (what a trainer without packing hands its loss: it computes all S * T
rows). The packed batch: the same sequences' N real rows (N ~ S * T / 2) laid end to end, logits
(N, V), per-token tensors (N,), cu_seqlens (S + 1,) int32 and max_seqlen (the padded width).
Both hold the same values: every row of a method family computes the same loss (recorded per
row). The loss: GRPO as LossConfig.grpo() (clip 0.2 / 0.2, k3 KL beta 0.04,
seq-mean-token-mean = TRL's loss_type="grpo": the sequence boundaries matter), advantages
(S,) from fastrl.group_advantages of 0/1 rewards in groups of --group-size; old / reference
log-probs fp32 near the policy's. Timed: forward + backward (the gradient of the logits).

Rows (methods), section "logits":
  fastrl-padded      fastrl.policy_loss on the padded (S, T, V) logits with the mask
  fastrl-packed      fastrl.policy_loss on the packed (N, V) rows with cu_seqlens / max_seqlen
  trl-eager-padded   THE BASELINE: what TRL's GRPOTrainer runs on padded logits
                     (benchmarks/_baselines.make_trl_eager_loss: selective_log_softmax, the
                     entropy metric under no_grad, TRL 1.16's GRPO math)
  trl-eager-packed   the same TRL ops on the packed rows as TRL's padding-free path feeds them
                     (logits (1, N, V): trl_log_softmax_fns() of benchmarks/_baselines), the
                     (N,) log-probs scattered into (S, T) for trl_grpo_math, so that the
                     seq-mean-token-mean loss is the same (that O(N) scatter is timed too)
Section "fused-linear" (only when fastrl.fused_linear_policy_loss takes `cu_seqlens`; checked
with inspect.signature at run time, and skipped with a printed note otherwise):
  fused-linear-padded  fastrl.fused_linear_policy_loss(hidden (S, T, H), weight (V, H), ...,
                       mask): the masked rows do no GEMM work
  fused-linear-packed  the same on hidden (N, H) with cu_seqlens / max_seqlen
  (hidden and weight in the row's dtype, weight / sqrt(H); gradients of hidden and weight)

Reported per row:
  total_ms     forward + backward: median, q20 (total_ms_q20), q80 (total_ms_q80)
  peak_MB      peak memory of one forward + backward above its inputs (CPU: resident-set
               high-water mark, in a child process by default, see --memory; CUDA:
               max_memory_allocated delta; see benchmarks/_common.py)
  rows         logits rows the method computes: S * T (padded) or N (packed)
  GBs          logits traffic / total time, the traffic being 2 * rows * V * itemsize (read the
               logits once, write their gradient once): what the method moves, padding included;
               pct_bw against the measured copy bandwidth (CPU) or the device's peak (known GPUs)
  useful_GBs   2 * N * V * itemsize / total time: the real tokens' bytes only (comparable
               between padded and packed)
  (fused-linear: TFLOPs = 6 * rows * H * V / time, useful_TFLOPs = 6 * N * H * V / time)
  speedup_packed_vs_padded    (packed rows) the padded row's total_ms / this total_ms, same family
  memory_packed_vs_padded     (packed rows) peak_MB / the padded row's peak_MB, same family
  speedup_vs_trl_eager_padded (section logits) against the trl-eager-padded row
  loss, loss_rel_diff_vs_padded  the loss value and its relative difference to the same family's
                                 padded row
Rows that run out of device memory (CUDA) are kept with oom = true and no numbers.
Repetitions (CPU): --warmup 2 and --rep 7 calls per timing by default; on CUDA --warmup /
--rep are milliseconds for triton.testing.do_bench (25 / 100). The padded and packed logits are
generated one layout at a time (the same values from per-sequence seeds), never both at once.
Results: <out>/bench_packed_<device>.{json,csv,png}.
"""

from __future__ import annotations

import gc
import inspect
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")
import _common as common  # noqa: E402
from _baselines import make_trl_eager_loss, trl_grpo_math, trl_log_softmax_fns  # noqa: E402

import fastrl  # noqa: E402

BASELINE = "trl-eager-padded"
FAMILIES = ("fastrl", "trl-eager", "fused-linear")
LAYOUTS = ("padded", "packed")
CPU_DEFAULT = dict(S=16, T=256, V=32000, H=512, dtype="fp32,bf16")
CUDA_DEFAULT = dict(S=64, T=2048, V=151936, H=2048, dtype="bf16")
QUICK_DEFAULT = dict(S=4, T=16, V=512, H=32, dtype="fp32,bf16")


def fused_linear_packing_support() -> tuple[bool, str]:
    """(whether fastrl.fused_linear_policy_loss takes cu_seqlens, why not)."""
    params = inspect.signature(fastrl.fused_linear_policy_loss).parameters
    if "cu_seqlens" in params:
        return True, ""
    return False, (
        "fused-linear section skipped: fastrl.fused_linear_policy_loss has no `cu_seqlens` "
        f"parameter (signature: {', '.join(params)})"
    )


def draw_lengths(S: int, T: int, g: torch.Generator) -> torch.Tensor:
    """S lengths uniform in [1, T], stratified (one draw in each of S equal slices, shuffled) so
    the padding fraction is ~50 % even for small S; the longest is T (the padded width)."""
    if S <= T:
        edges = [i * T // S for i in range(S + 1)]  # slice i: lengths edges[i] + 1 .. edges[i+1]
        lengths = torch.tensor(
            [
                edges[i] + 1 + int(torch.randint(0, edges[i + 1] - edges[i], (1,), generator=g))
                for i in range(S)
            ]
        )
    else:
        lengths = torch.randint(1, T + 1, (S,), generator=g)
    lengths[lengths.argmax()] = T
    return lengths[torch.randperm(S, generator=g)]


def sequence_logits(i: int, T: int, V: int, dtype, device, seed: int) -> torch.Tensor:
    """Sequence i's (T, V) logits, the same values whichever layout asks (per-sequence seed)."""
    gd = torch.Generator(device=device).manual_seed(seed * 100_003 + i)
    return torch.randn(T, V, generator=gd, device=device).to(dtype)


def make_batch(S, T, V, dtype, device, seed=0, group_size=4):
    """Everything but the logits, for both layouts (see the module docstring)."""
    if S % group_size:
        raise SystemExit(f"--S {S} is not a multiple of --group-size {group_size}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    lengths = draw_lengths(S, T, g)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    tokens = torch.randint(0, V, (S, T), generator=g)
    logp = torch.zeros(S, T)
    with torch.no_grad():  # the policy's log-probs, one sequence at a time
        for i in range(S):
            z = sequence_logits(i, T, V, dtype, device, seed)
            logp[i] = fastrl.logprobs(z, tokens[i].to(device)).float().cpu()
            del z
    noise = lambda: 0.05 * torch.randn(S, T, generator=g)  # noqa: E731
    old_logp = (logp + noise()) * mask
    ref_logp = (logp + noise()) * mask
    rewards = (torch.rand(S, generator=g) > 0.5).float()
    advantages = fastrl.group_advantages(rewards, group_size)
    cu = torch.zeros(S + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    index = mask.reshape(-1).nonzero().squeeze(1)  # packed row -> position in the (S * T) layout
    N = int(lengths.sum())
    d = lambda t: t.to(device)  # noqa: E731
    return {
        "S": S,
        "T": T,
        "V": V,
        "N": N,
        "dtype": dtype,
        "seed": seed,
        "lengths": lengths,
        "pad_frac": 1.0 - N / (S * T),
        "max_seqlen": int(lengths.max()),
        "advantages": d(advantages),
        "padded": {
            "tokens": d(tokens),
            "old_logp": d(old_logp),
            "ref_logp": d(ref_logp),
            "mask": d(mask),
        },
        "packed": {
            "tokens": d(tokens.reshape(-1)[index]),
            "old_logp": d(old_logp.reshape(-1)[index]),
            "ref_logp": d(ref_logp.reshape(-1)[index]),
            "cu_seqlens": d(cu),
            "index": d(index),
        },
    }


def make_logits(b, layout: str, device) -> torch.Tensor:
    """The layout's logits leaf: (S, T, V) padded or (N, V) packed, requires_grad."""
    S, T, V, N = b["S"], b["T"], b["V"], b["N"]
    shape = (S, T, V) if layout == "padded" else (N, V)
    out = torch.empty(shape, dtype=b["dtype"], device=device)
    row = 0
    for i, n in enumerate(b["lengths"].tolist()):
        z = sequence_logits(i, T, V, b["dtype"], device, b["seed"])
        if layout == "padded":
            out[i] = z
        else:
            out[row : row + n] = z[:n]
            row += n
        del z
    return out.requires_grad_()


def make_linear(b, device, H: int):
    """(hidden padded (S, T, H), hidden packed (N, H), weight (V, H)) leaves, and the old / ref
    log-probs of that LM head (near the policy's, zero on padding) for both layouts."""
    S, T, V, dtype = b["S"], b["T"], b["V"], b["dtype"]
    g = torch.Generator(device="cpu").manual_seed(b["seed"] + 1)
    hidden = torch.randn(S, T, H, generator=g).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(device, dtype)
    mask = b["padded"]["mask"]
    with torch.no_grad():
        logp = fastrl.linear_logprobs(hidden, weight, b["padded"]["tokens"]).float()
    noise = lambda: 0.05 * torch.randn(S, T, generator=g).to(device)  # noqa: E731
    old, ref = (logp + noise()) * mask, (logp + noise()) * mask
    index = b["packed"]["index"]
    packed_h = hidden.reshape(-1, H).index_select(0, index).contiguous()
    lp = {
        "padded": {"old_logp": old, "ref_logp": ref},
        "packed": {"old_logp": old.reshape(-1)[index], "ref_logp": ref.reshape(-1)[index]},
    }
    return hidden.requires_grad_(), packed_h.requires_grad_(), weight.requires_grad_(), lp


def logits_methods(b, families) -> dict:
    """name -> (layout, family, loss(logits) -> 0-dim loss tensor) of section "logits"."""
    cfg = fastrl.LossConfig.grpo()
    adv, pad, pk = b["advantages"], b["padded"], b["packed"]
    pad_args = (pad["tokens"], adv, pad["old_logp"], pad["ref_logp"], pad["mask"])
    pk_kw = dict(cu_seqlens=pk["cu_seqlens"], max_seqlen=b["max_seqlen"])
    out = {}
    if "fastrl" in families:
        out["fastrl-padded"] = (
            "padded",
            "fastrl",
            lambda z: fastrl.policy_loss(z, *pad_args, config=cfg).loss,
        )
        out["fastrl-packed"] = (
            "packed",
            "fastrl",
            lambda z: (
                fastrl.policy_loss(
                    z, pk["tokens"], adv, pk["old_logp"], pk["ref_logp"], None, config=cfg, **pk_kw
                ).loss
            ),
        )
    if "trl-eager" in families:
        trl_eager = make_trl_eager_loss()
        selective_log_softmax, entropy_from_logits = trl_log_softmax_fns()
        S, T = b["S"], b["T"]

        def trl_packed(z):
            logp = selective_log_softmax(z.unsqueeze(0), pk["tokens"].unsqueeze(0))[0]
            with torch.no_grad():  # the entropy metric, as in trl-eager
                entropy_from_logits(z)
            flat = logp.new_zeros(S * T, dtype=torch.float32)
            logp_pad = flat.index_put((pk["index"],), logp.float()).view(S, T)
            return trl_grpo_math(logp_pad, pad["old_logp"], pad["ref_logp"], adv, pad["mask"])

        out["trl-eager-padded"] = ("padded", "trl-eager", lambda z: trl_eager(z, *pad_args)[0])
        out["trl-eager-packed"] = ("packed", "trl-eager", trl_packed)
    return out


def linear_methods(b, lp) -> dict:
    """name -> (layout, family, loss(hidden, weight)) of section "fused-linear"."""
    cfg = fastrl.LossConfig.grpo()
    adv, pad, pk = b["advantages"], b["padded"], b["packed"]
    f = fastrl.fused_linear_policy_loss
    pk_kw = {"cu_seqlens": pk["cu_seqlens"]}
    if "max_seqlen" in inspect.signature(f).parameters:
        pk_kw["max_seqlen"] = b["max_seqlen"]

    def loss(layout, mask, **kw):  # loss(hidden, weight) on the layout's tokens and log-probs
        tokens, old, ref = b[layout]["tokens"], lp[layout]["old_logp"], lp[layout]["ref_logp"]
        return lambda h, w: f(h, w, tokens, adv, old, ref, mask, config=cfg, **kw).loss

    return {
        "fused-linear-padded": ("padded", "fused-linear", loss("padded", pad["mask"])),
        "fused-linear-packed": ("packed", "fused-linear", loss("packed", None, **pk_kw)),
    }


def fwd_bwd_fn(loss_fn, leaves):
    """() -> loss value of one forward + backward, the leaves' gradients reset first."""

    def step():
        for t in leaves:
            t.grad = None
        loss = loss_fn(*leaves)
        loss.backward()
        return loss

    return step


def measure_memory(step, leaves, device) -> dict:
    """Peak memory of one forward + backward (after a warm-up call), gradients freed before."""
    step()
    for t in leaves:
        t.grad = None
    gc.collect()
    return common.peak_memory(step, device)


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower()


def run_case(b, args, device, mems, notes, bar=None, sink=None) -> list[dict]:
    """The rows of one case (shape, dtype); `mems` is {method: peak_memory dict} from a memory
    child (CPU), or None to measure here. memory_only: only measure (the child's job). Each row
    is appended to `sink` (when given, else a new list) as it is measured, so that a run cut
    short keeps them (finish_case then gives them their rates and ratios)."""
    families = args.families
    cuda = device.type == "cuda"
    itemsize = b["dtype"].itemsize
    S, T, V, N = b["S"], b["T"], b["V"], b["N"]
    methods = logits_methods(b, families)
    rows, measured = ([] if sink is None else sink), {}

    def one(name, layout, family, step, leaves, section, extra):
        row = {
            "section": section,
            "method": name,
            "family": family,
            "layout": layout,
            "role": "baseline" if name == BASELINE else family,
            "S": S,
            "T": T,
            "V": V,
            "N": N,
            "rows": S * T if layout == "padded" else N,
            "max_seqlen": b["max_seqlen"],
            "pad_frac": b["pad_frac"],
            "dtype": args.dtype_name,
            **extra,
            "warmup": args.warmup,
            "rep": args.rep,
            "oom": False,
        }
        try:
            if args.memory_only:
                measured[name] = measure_memory(step, leaves, device)
                return
            loss = float(step().detach().float())
            mem = (mems or {}).get(name)
            if mem is None and args.memory != "none":
                mem = measure_memory(step, leaves, device)
            t = common.time_fn(step, warmup=args.warmup, rep=args.rep, device=device)
        except RuntimeError as e:
            if not (cuda and is_oom(e)):
                raise
            oom = f"out of memory: {str(e)[:200]}"
        else:
            oom = None
        finally:
            for x in leaves:
                x.grad = None
        if oom is not None:  # outside the except: its traceback no longer holds the tensors
            gc.collect()
            torch.cuda.empty_cache()
            row["oom"] = True
            notes[f"{name} {args.dtype_name}"] = oom
            rows.append(row)
            return
        row.update(
            total_ms=t["median"],
            total_ms_q20=t["q20"],
            total_ms_q80=t["q80"],
            n_samples=t["n_samples"],
            peak_MB=None if mem is None else mem["bytes"] / 2**20,
            memory_method=None if mem is None else mem["method"],
            loss=loss,
        )
        rows.append(row)

    for layout in LAYOUTS:
        names = [n for n, m in methods.items() if m[0] == layout]
        if not names:
            continue
        logits = make_logits(b, layout, device)
        for name in names:
            _, family, fn = methods[name]
            if bar is not None:
                bar.set_postfix_str(f"{args.dtype_name}: {name}")
            rows_v = S * T if layout == "padded" else N
            extra = {"logits_MB": rows_v * V * itemsize / 2**20}
            one(name, layout, family, fwd_bwd_fn(fn, [logits]), [logits], "logits", extra)
            if bar is not None:
                bar.update()
        del logits
        gc.collect()

    if "fused-linear" in families and args.fused_linear_ok:
        hidden, packed_h, weight, lp = make_linear(b, device, args.H)
        for name, (layout, family, fn) in linear_methods(b, lp).items():
            if bar is not None:
                bar.set_postfix_str(f"{args.dtype_name}: {name}")
            h = hidden if layout == "padded" else packed_h
            extra = {"H": args.H}
            one(
                name,
                layout,
                family,
                fwd_bwd_fn(fn, [h, weight]),
                [h, weight],
                "fused-linear",
                extra,
            )
            if bar is not None:
                bar.update()
        del hidden, packed_h, weight, lp
        gc.collect()

    if args.memory_only:
        return measured
    return finish_case(rows, b, args)


def finish_case(rows: list[dict], b, args) -> list[dict]:
    """Give the measured rows of one case their traffic (logits rows) or GEMM rate (fused-linear
    rows) and the packed / padded ratios of add_ratios; the rows, changed in place."""
    itemsize = b["dtype"].itemsize
    V, N = b["V"], b["N"]
    for r in rows:
        if r["oom"]:
            continue
        sec = r["total_ms"] / 1e3
        if r["section"] == "logits":
            nbytes = 2 * r["rows"] * V * itemsize
            r["nominal_GB"] = nbytes / 1e9
            r["GBs"] = nbytes / 1e9 / sec
            r["useful_GBs"] = 2 * N * V * itemsize / 1e9 / sec
            peak_bw = args.rates.get("copy_GBs") or args.rates.get("peak_bandwidth_GBs")
            r["pct_bw"] = 100 * r["GBs"] / peak_bw if peak_bw else None
        else:  # no logits in memory: GEMM throughput instead
            r["TFLOPs"] = 6 * r["rows"] * args.H * V / 1e12 / sec
            r["useful_TFLOPs"] = 6 * N * args.H * V / 1e12 / sec
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    """speedup / memory of each packed row against its family's padded row, and the speed-up of
    each logits row against trl-eager-padded."""
    ok = lambda r: r is not None and not r["oom"]  # noqa: E731
    by = {(r["family"], r["layout"]): r for r in rows}
    base = by.get(("trl-eager", "padded"))
    for r in rows:
        pad = by.get((r["family"], "padded"))
        good = ok(r) and ok(pad)
        r["speedup_packed_vs_padded"] = pad["total_ms"] / r["total_ms"] if good else None
        r["memory_packed_vs_padded"] = (
            r["peak_MB"] / pad["peak_MB"]
            if good and r.get("peak_MB") is not None and pad.get("peak_MB")
            else None
        )
        r["loss_rel_diff_vs_padded"] = (
            abs(r["loss"] - pad["loss"]) / max(abs(pad["loss"]), 1e-12) if good else None
        )
        r["speedup_vs_trl_eager_padded"] = (
            base["total_ms"] / r["total_ms"]
            if r["section"] == "logits" and ok(r) and ok(base)
            else None
        )


def build_parser():
    p = common.bench_parser("bench_packed.py", __doc__)
    p.add_argument(
        "--S",
        type=int,
        default=None,
        help="sequences (default CPU 16, CUDA 64, --quick 4); a multiple of --group-size",
    )
    p.add_argument(
        "--T",
        type=int,
        default=None,
        help="padded width = the longest sequence (default CPU 256, CUDA 2048, --quick 16)",
    )
    p.add_argument(
        "--V",
        type=int,
        default=None,
        help="vocabulary (default CPU 32000, CUDA 151936, --quick 512)",
    )
    p.add_argument(
        "--H",
        type=int,
        default=None,
        help="hidden size of the fused-linear section (default CPU 512, CUDA 2048, --quick 32)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help="comma list of logits dtypes, one case each: fp32, bf16, fp16 "
        "(default CPU fp32,bf16; CUDA bf16)",
    )
    p.add_argument(
        "--group-size", type=int, default=4, help="GRPO group size of the advantages (default 4)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the lengths and values (default 0)")
    p.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help="comma list of method families to run, each padded and packed: "
        + ",".join(FAMILIES)
        + " (default all; fused-linear only when fastrl supports it)",
    )
    common.add_reps(
        p,
        "untimed calls before each timing (default 2, --quick 1)",
        "timed calls per timing (default 7, --quick 2)",
    )
    p.add_argument(
        "--memory",
        choices=("child", "inline", "none"),
        default=None,
        help="CPU peak memory: 'child' measures it in a child process with "
        "MALLOC_MMAP_THRESHOLD_=65536 (exact for big tensors; the default), 'inline' in this "
        "process with its malloc settings (the --quick default: its tensors are too small to "
        "measure anyway, and it saves a second import), 'none' skips it. CUDA always measures "
        "inline (max_memory_allocated).",
    )
    p.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's default)"
    )
    common.add_run_args(
        p,
        "bench_packed",
        "tiny smoke run: S=4, T=16, V=512, H=32, fp32 and bf16, 1 warm-up and 2 timed calls, "
        "memory inline (unless other options say otherwise); for tests",
    )
    return p


def resolve(args, device) -> list[str]:
    """Fill the defaults that depend on the device and --quick; returns the dtype names."""
    cuda = device.type == "cuda"
    defaults = QUICK_DEFAULT if args.quick else CUDA_DEFAULT if cuda else CPU_DEFAULT
    for k in ("S", "T", "V", "H", "dtype"):
        if getattr(args, k) is None:
            setattr(args, k, defaults[k])
    dtypes = common.parse_dtypes(args.dtype)
    fams = [f for f in args.families.split(",") if f]
    bad = [f for f in fams if f not in FAMILIES]
    if bad:
        raise SystemExit(f"--families: unknown {bad}; choose from {list(FAMILIES)}")
    args.families = fams
    common.fill_reps(args, cuda, 1 if args.quick else 2, 2 if args.quick else 7)
    if args.memory is None:
        args.memory = "inline" if (args.quick or cuda) else "child"
    if cuda:
        args.memory = "inline" if args.memory == "child" else args.memory
    if args.threads:
        torch.set_num_threads(args.threads)
    return dtypes


def child_argv(args, dtype: str) -> list[str]:
    argv = ["--device", "cpu", "--S", str(args.S), "--T", str(args.T), "--V", str(args.V)]
    argv += ["--H", str(args.H), "--dtype", dtype, "--group-size", str(args.group_size)]
    argv += ["--seed", str(args.seed), "--families", ",".join(args.families)]
    argv += ["--threads", str(torch.get_num_threads())]
    return argv


def measure_cases(dtypes, args, device, bar, notes, rows: list, cases: list) -> None:
    """Measure every dtype's case into `rows` (and its description into `cases`): a case's rows
    join `rows` as they are measured, finished (rates, ratios) also when the run is cut short."""
    cuda = device.type == "cuda"
    for dtype in dtypes:
        args.dtype_name = dtype
        mems = None
        if not cuda and args.memory == "child":
            mems = common.case_memory(bar, dtype, __file__, child_argv(args, dtype))
        dt = common.DTYPES[dtype]
        b = make_batch(args.S, args.T, args.V, dt, device, args.seed, args.group_size)
        cases.append(
            {"S": b["S"], "T": b["T"], "V": b["V"], "N": b["N"], "dtype": dtype,
             "pad_frac": b["pad_frac"], "lengths": b["lengths"].tolist()}
        )  # fmt: skip
        case_rows: list[dict] = []
        try:
            run_case(b, args, device, mems, notes, bar, case_rows)
        except KeyboardInterrupt:  # a stage timeout: keep the rows of this case measured so far
            rows += finish_case(case_rows, b, args)
            raise
        for r in case_rows:
            if r["oom"]:
                bar.write(f"{dtype:5s} {r['method']:20s} out of memory")
                continue
            peak = "n/a" if r["peak_MB"] is None else f"{r['peak_MB']:8.1f} MiB"
            speed = r["speedup_packed_vs_padded"]
            bar.write(
                f"{dtype:5s} {r['method']:20s} {r['total_ms']:9.1f} ms "
                f"[{r['total_ms_q20']:.1f}, {r['total_ms_q80']:.1f}]  peak {peak}  "
                + (
                    f"{r['GBs']:6.1f} GB/s ({r['useful_GBs']:.1f} useful)"
                    if r["section"] == "logits"
                    else f"{r['TFLOPs']:6.2f} TFLOP/s ({r['useful_TFLOPs']:.2f} useful)"
                )
                + (f"  packed x{speed:.2f}" if r["layout"] == "packed" and speed else "")
            )
        rows += case_rows
        del b
        gc.collect()


def main(argv=None):
    args, device = common.parse_bench_args(build_parser(), argv)
    cuda = device.type == "cuda"
    dtypes = resolve(args, device)
    notes: dict[str, str] = {}
    args.fused_linear_ok, why = fused_linear_packing_support()
    if "fused-linear" in args.families and not args.fused_linear_ok:
        notes["fused-linear"] = why
    args.rates = {}

    if args.memory_only:  # child of a CPU run: {method: peak memory} of its one case, one line
        (args.dtype_name,) = dtypes
        b = make_batch(
            args.S, args.T, args.V, common.DTYPES[dtypes[0]], device, args.seed, args.group_size
        )
        print(json.dumps(run_case(b, args, device, None, notes)))
        return None
    for why in notes.values():
        print(why, file=sys.stderr, flush=True)

    info = common.device_info(device)
    args.rates = {"peak_bandwidth_GBs": info["peak_bandwidth_GBs"]}
    if not cuda:
        print("measuring the CPU's copy bandwidth ...", file=sys.stderr, flush=True)
        args.rates.update(common.cpu_rates(1 << 22 if args.quick else 1 << 26))
    n_methods = 2 * len([f for f in args.families if f != "fused-linear" or args.fused_linear_ok])
    bar = common.progress(len(dtypes) * n_methods, "bench_packed", disable=args.no_progress)
    rows, cases = [], []
    with common.keep_rows_on_interrupt(notes, rows):
        measure_cases(dtypes, args, device, bar, notes, rows, cases)
    bar.close()

    mem_methods = sorted({r["memory_method"] for r in rows if r.get("memory_method")})
    meta = {
        **info,
        "benchmark": "packed (cu_seqlens) vs padded batches at ~50 % padding: GRPO policy loss "
        "fwd+bwd (clip 0.2/0.2, k3 KL beta 0.04, seq-mean-token-mean)",
        "baseline": f"{BASELINE}: TRL's eager GRPO loss on the padded logits "
        "(benchmarks/_baselines.make_trl_eager_loss)",
        "cases": cases,
        "group_size": args.group_size,
        "seed": args.seed,
        "lengths": "uniform in [1, T], stratified (one draw per slice of [1, T]), longest = T",
        "timing": "_common.cuda_calls: do_bench's method (L2 flushed, CUDA events), warmup "
        f"{args.warmup} ms, rep {args.rep} ms, at least {common.MIN_CUDA_CALLS} timed calls"
        if cuda
        else f"perf_counter, warmup {args.warmup}, rep {args.rep}",
        "memory": args.memory,
        "memory_method": mem_methods,
        "nominal_traffic": "2 * rows * V * itemsize (rows = S * T padded, N packed): read the "
        "logits once, write their gradient once; useful_GBs counts the N real rows only",
        "fused_linear": {"supported": args.fused_linear_ok, "H": args.H},
        "machine_rates": args.rates,
        "threads": torch.get_num_threads(),
        "env": common.run_env(),
        "notes": notes,
    }
    paths = common.save_cases(
        f"bench_packed_{device.type}",
        rows,
        meta,
        args,
        lambda r: (
            f"{r['section']}: S={r['S']}, T={r['T']}, N={r['N']} "
            f"({100 * r['pad_frac']:.0f}% pad), V={r['V']}"
            + (f", H={r['H']}" if "H" in r else "")
            + f", {r['dtype']}"
        ),
        [
            common.TOTAL_MS_PANEL,
            ("peak_MB", "peak memory above inputs (MiB)"),
            ("useful_GBs", "useful GB/s (2 N V itemsize / time)"),
        ],
        "packed vs padded, GRPO policy loss fwd+bwd",
        plot_rows=[r for r in rows if not r["oom"]],
    )
    for why in notes.values():
        print(why, file=sys.stderr)
    print(paths)
    return rows


if __name__ == "__main__":
    main()
