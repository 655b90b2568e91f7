"""Benchmark: the GRPO policy loss on materialised logits, forward + backward, side by side.

    python benchmarks/bench_policy_loss.py            # CPU: N = 2048, 8192 at V = 32000 and
                                                      # N = 1024 at V = 151936; fp32 and bf16
    python benchmarks/bench_policy_loss.py --quick    # tiny smoke run (seconds)
    python benchmarks/bench_policy_loss.py --B 8 --T 512 --V 151936 --dtype bf16   # your shape
    python benchmarks/bench_policy_loss.py --device cuda                           # + Liger

Workload: the GRPO loss (token-level ratio, clip 0.2 / 0.2, k3 KL with beta 0.04,
seq-mean-token-mean = TRL's loss_type="grpo") over B sequences of T tokens (N = B * T); logits
(B, T, V) in the row's dtype, old / reference log-probs fp32 near the policy's, random sequence
lengths in [T / 2, T]. Every method gets the same inputs and differentiates the same loss
w.r.t. the logits (their values agree; each row records its loss value).

Rows (methods):
  fastrl               fastrl.policy_loss(..., config=LossConfig.grpo()): dL/dlogits is computed
                       in the forward; the backward only scales it by grad_output. On CUDA a
                       token-separable loss (GRPO here) runs, by default (FASTRL_ONE_PASS unset
                       or 0), the statistics kernel, one O(N) Triton kernel of every token's
                       g_t = dL/dlogp_t and h_t = dL/dH_t (_token_grads_fwd_kernel), then the
                       gradient kernel
  fastrl-one-pass      CUDA only: the same with FASTRL_ONE_PASS=1: the one-pass kernel, each
                       row's statistics and gradient in one program (_policy_loss_fwd_kernel):
                       the A/B of the default path
  fastrl-inplace       the same with inplace=True: the gradient overwrites the logits buffer (each
                       timed call gets a fresh copy from an untimed prepare(); the cost does not
                       depend on the values)
  trl-eager            THE BASELINE of every speed-up and memory ratio: TRL 1.16's logits helpers
                       trl.trainer.utils.selective_log_softmax and, under no_grad, the entropy
                       metric entropy_from_logits, then TRL's per-token GRPO math
                       (benchmarks/_baselines.py). What they run depends on the device: on the
                       CPU their eager torch loops (a per-sequence logsumexp for fp32, a
                       per-sequence log_softmax for bf16; entropy in 128-row chunks); on CUDA
                       (triton importable) each dispatches to TRL's own Triton kernel
                       (trl/kernels/logprob_entropy.py, `_fused_logprob_entropy`), one call for
                       the log-probs and one for the entropy. The key stays `trl-eager` (the
                       results files' row name); report.py labels the row per device. TRL
                       1.16's GRPOTrainer itself calls neither on logits: it patches the model
                       with its fused, chunked LM head (add_fused_lm_head ->
                       ChunkedLogProbFunction), the `trl-chunked` row of bench_fused_linear.py
  trl-eager-compiled   torch.compile of that whole trl-eager loss function (compiled once per
                       shape and dtype; compilation is in the warm-up, not the timings)
  verl-eager           verl.utils.torch_functional.logprobs_from_logits, then verl's own
                       core_algos.compute_policy_loss_vanilla (dual clip c = 3), kl_penalty
                       ("low_var_kl") and agg_loss (seq-mean-token-mean), called as verl's actor
                       does (benchmarks/_baselines.py); skipped, with a printed note, when
                       `import verl` fails
  reference (oracle)   fastrl.reference.policy_loss: the readable oracle of SPEC.md, shown for
                       context only - never the baseline of a speed-up; fewer repetitions
                       (--slow-rep) because it is slow
  liger                Liger-Kernel's triton_grpo_loss (CUDA only, when installed)

Reported per row:
  fwd_ms     forward only (autograd graph built, no backward): median, q20, q80
  total_ms   forward + backward: median, q20, q80
  bwd_ms     max(total_ms - fwd_ms, 0) of the medians. fastrl computes the gradient inside its
             forward, so its fwd_ms holds nearly all the work and its bwd_ms is ~0: compare
             total_ms across methods, not fwd / bwd.
  n_samples  timed calls of total_ms (fwd_n_samples: of fwd_ms)
  peak_MB    peak memory (MiB) of one forward + backward above the inputs (CPU: resident-set
             high-water mark in a child process per shape and dtype; CUDA: max_memory_allocated;
             see benchmarks/_common.py)
  GBs        nominal traffic / total time, the nominal traffic being the floor of any method:
             read the logits once and write their gradient once, 2 * N * V * itemsize bytes
             (the same bytes for every method); pct_bw: against the measured copy bandwidth
             (CPU) or the device's peak (known GPUs)
  exp_floor_ratio   (CPU) total_ms / (N * V / measured exp rate): one exp per logit is the floor
  speedup_vs_trl_eager, memory_vs_trl_eager   against the trl-eager row of the same shape/dtype
The CPU's copy bandwidth and exp rate are measured at the start and stored in the JSON meta.
Repetitions (CPU): --warmup 2 and --rep 7 calls per timing by default; the reference oracle row
--slow-rep 3 (after 1 warm-up). On CUDA --warmup / --rep are milliseconds, as for do_bench, with
at least 10 timed calls per timing (benchmarks/_common.py: cuda_calls).
Results: <out>/bench_policy_loss_<device>.{json,csv,png}; `python benchmarks/report.py --readme`
turns them into the README table.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")  # Dynamo tracing TRL's helpers
import _common as common  # noqa: E402
from _baselines import make_trl_eager_loss, make_verl_eager_loss  # noqa: E402

import fastrl  # noqa: E402
from fastrl import reference  # noqa: E402

BASELINE = "trl-eager"
ORACLE = "reference (oracle)"
METHODS = (
    "fastrl",
    "fastrl-one-pass",  # CUDA only: FASTRL_ONE_PASS=1, the A/B of the default path
    "fastrl-inplace",
    "trl-eager",
    "trl-eager-compiled",
    "verl-eager",
    ORACLE,
    "liger",
)
# (B, T, V): N = B * T rows
CPU_SHAPES = [(16, 128, 32000), (64, 128, 32000), (8, 128, 151936)]
CUDA_SHAPES = [(64, 128, 32000), (128, 128, 151936)]
QUICK_SHAPES = [(2, 16, 512)]
DEFAULT_B, DEFAULT_T, DEFAULT_V = 16, 128, 32000


def make_inputs(B, T, V, dtype, device, seed=0):
    """Logits (B, T + 1, V) (the methods use the first T rows, Liger takes all), tokens,
    advantages (B,), old / ref log-probs (B, T) fp32 near the policy's, a mask of random
    sequence lengths in [T / 2, T]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    gd = torch.Generator(device=device).manual_seed(seed)
    logits = torch.empty(B, T + 1, V, device=device, dtype=dtype)
    for b in range(B):  # fp32 randn one sequence at a time: no (N, V) fp32 temporary
        logits[b] = torch.randn(T + 1, V, generator=gd, device=device)
    tokens = torch.randint(0, V, (B, T), generator=g).to(device)
    with torch.no_grad():
        logp = fastrl.logprobs(logits[:, :T], tokens)
    noise = lambda: 0.05 * torch.randn(B, T, generator=g).to(device)  # noqa: E731
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)
    return dict(
        logits=logits,
        tokens=tokens,
        advantages=torch.randn(B, generator=g).to(device),
        old_logp=logp + noise(),
        ref_logp=logp + noise(),
        mask=mask,
    )


def build_methods(inp, args, device, notes):
    """name -> (forward(y) -> loss tensor, base, prepare): x = a leaf copy of base, the tensor the
    backward differentiates; y = prepare(x) (untimed, unmeasured) or x when prepare is None."""
    cfg = fastrl.LossConfig.grpo()
    T = inp["tokens"].shape[1]
    rest = {k: v for k, v in inp.items() if k != "logits"}
    r = (rest["tokens"], rest["advantages"], rest["old_logp"], rest["ref_logp"], rest["mask"])
    # by default the loss gets a (B, T, V) tensor; --slice passes the HF-style view [:, :-1] of
    # (B, T+1, V) instead (autograd's slice backward then allocates a full-size gradient too)
    base = inp["logits"] if args.slice else inp["logits"][:, :T].contiguous()
    view = (lambda x: x[:, :T]) if args.slice else (lambda x: x)
    wanted = set(args.methods.split(",")) if args.methods else set(METHODS)

    methods = {}
    if "fastrl" in wanted:
        methods["fastrl"] = lambda x: fastrl.policy_loss(view(x), **rest, config=cfg).loss
    if device.type == "cuda" and "fastrl-one-pass" in wanted:

        def one_pass(x):  # the one-pass kernel: a row's statistics and gradient in one program
            saved = os.environ.get("FASTRL_ONE_PASS")
            os.environ["FASTRL_ONE_PASS"] = "1"
            try:
                return fastrl.policy_loss(view(x), **rest, config=cfg).loss
            finally:
                os.environ.pop("FASTRL_ONE_PASS")
                if saved is not None:
                    os.environ["FASTRL_ONE_PASS"] = saved

        methods["fastrl-one-pass"] = one_pass
    if "fastrl-inplace" in wanted:
        # inplace=True refuses the caller's own leaf tensor: it gets what a trainer passes, the
        # output of an op (here `x + 0`, made outside the timed and measured region)
        methods["fastrl-inplace"] = (
            lambda y: fastrl.policy_loss(view(y), **rest, config=cfg, inplace=True).loss,
            base,
            lambda x: x + 0,
        )
    trl_eager = make_trl_eager_loss()
    if "trl-eager" in wanted:
        methods["trl-eager"] = lambda x: trl_eager(view(x), *r)[0]
    if "trl-eager-compiled" in wanted and not args.no_compile:
        torch._dynamo.reset()  # a fresh static-shape compilation for every shape and dtype
        compiled = torch.compile(trl_eager)
        methods["trl-eager-compiled"] = lambda x: compiled(view(x), *r)[0]
    if "verl-eager" in wanted and not args.no_verl:
        verl_eager, why = make_verl_eager_loss()
        if verl_eager is None:
            notes["verl-eager"] = f"skipped: `import verl` failed ({why})"[:300]
        else:
            methods["verl-eager"] = lambda x: verl_eager(view(x), *r)[0]
            if why:  # imported with a stand-in for ray (_baselines.import_verl)
                notes["verl-eager"] = why
    if ORACLE in wanted and not args.no_reference:
        methods[ORACLE] = lambda x: reference.policy_loss(view(x), **rest, config=cfg).loss
    if device.type == "cuda" and "liger" in wanted and not args.no_liger:
        try:
            from liger_kernel.transformers.grpo_loss import triton_grpo_loss

            liger_logits = inp["logits"]  # (B, T + 1, V): Liger drops the last row itself

            def liger(x):
                loss, _ = triton_grpo_loss(
                    x,
                    rest["old_logp"],
                    rest["ref_logp"],
                    rest["tokens"],
                    rest["advantages"],
                    rest["mask"],
                    temperature=1.0,
                    beta=cfg.kl_coef,
                    eps_low=cfg.clip_low,
                    eps_high=cfg.clip_high,
                    inplace=True,
                    loss_type="grpo",
                    reduce=True,
                )
                return loss

            methods["liger"] = (liger, liger_logits, None)
        except Exception as e:  # pragma: no cover - depends on the install
            notes["liger"] = f"skipped: liger-kernel unavailable ({e})"[:300]
    return {k: (v if isinstance(v, tuple) else (v, base, None)) for k, v in methods.items()}


def measure_memory(forward, base, prepare, device):
    """Peak memory of one forward + backward (after a warm-up call)."""
    x = base.detach().clone().requires_grad_()
    prepare = prepare or (lambda t: t)

    def fwd_bwd(y):
        x.grad = None
        forward(y).backward()

    fwd_bwd(prepare(x))  # warm-up (compilation, Triton JIT, page-in)
    x.grad = None
    y = prepare(x)
    gc.collect()
    return common.peak_memory(lambda: fwd_bwd(y), device)


def bench_method(name, method, case, args, device, mem, rates):
    """One row: fwd and fwd+bwd timings, memory, traffic and floors of `name` on `case`."""
    forward, base, prepare = method
    B, T, V, dtype = case
    x = base.detach().clone().requires_grad_()
    loss_value = float(forward(prepare(x) if prepare else x).detach().float())

    def fwd_bwd(y):
        x.grad = None
        forward(y).backward()

    def fwd_only(y):
        forward(y)

    if mem is None:
        mem = measure_memory(forward, base, prepare, device)
    slow = name == ORACLE and device.type != "cuda"
    warmup = min(args.warmup, 1) if slow else args.warmup
    rep = min(args.slow_rep, args.rep) if slow else args.rep
    x.grad = None
    # every row timed alike (common.time_fn: on CUDA do_bench's method with the L2 flushed before
    # each call); the in-place row gets its fresh buffer from prepare(), outside the timed region
    make = (lambda: prepare(x)) if prepare is not None else (lambda: x)
    t_total = common.time_fn(fwd_bwd, warmup=warmup, rep=rep, device=device, prepare=make)
    x.grad = None
    t_fwd = common.time_fn(fwd_only, warmup=warmup, rep=rep, device=device, prepare=make)
    x.grad = None
    N = B * T
    itemsize = common.DTYPES[dtype].itemsize
    nominal = 2 * N * V * itemsize
    row = {
        "method": name,
        "role": "baseline"
        if name == BASELINE
        else "oracle"
        if name == ORACLE
        else "fastrl"
        if name.startswith("fastrl")
        else "other",
        "B": B,
        "T": T,
        "N": N,
        "V": V,
        "dtype": dtype,
        "warmup": warmup,
        "rep": rep,
        "fwd_ms": t_fwd["median"],
        "fwd_ms_q20": t_fwd["q20"],
        "fwd_ms_q80": t_fwd["q80"],
        "total_ms": t_total["median"],
        "total_ms_q20": t_total["q20"],
        "total_ms_q80": t_total["q80"],
        "n_samples": t_total["n_samples"],
        "fwd_n_samples": t_fwd["n_samples"],
        "bwd_ms": max(t_total["median"] - t_fwd["median"], 0.0),
        "fwd_includes_grad": name.startswith("fastrl"),
        "peak_MB": mem["bytes"] / 2**20,
        "logits_MB": N * V * itemsize / 2**20,
        "nominal_GB": nominal / 1e9,
        "GBs": nominal / 1e9 / (t_total["median"] / 1e3),
        "loss": loss_value,
    }
    peak_bw = rates.get("copy_GBs") or rates.get("peak_bandwidth_GBs")
    row["pct_bw"] = 100 * row["GBs"] / peak_bw if peak_bw else None
    if rates.get("exp_per_s"):
        row["exp_floor_ms"] = N * V / rates["exp_per_s"] * 1e3
        row["exp_floor_ratio"] = row["total_ms"] / row["exp_floor_ms"]
    return row, mem["method"]


def build_parser():
    p = common.bench_parser("bench_policy_loss.py", __doc__)
    p.add_argument(
        "--B",
        type=int,
        default=None,
        help=f"sequences; giving any of --B/--T/--V runs that one shape (missing ones: "
        f"B={DEFAULT_B}, T={DEFAULT_T}, V={DEFAULT_V}) instead of the default list",
    )
    p.add_argument("--T", type=int, default=None, help="tokens per sequence (one shape run)")
    p.add_argument("--V", type=int, default=None, help="vocabulary size (one shape run)")
    p.add_argument(
        "--shapes",
        default=None,
        help="comma list of BxTxV shapes, e.g. 16x128x32000,8x128x151936 (default CPU: "
        f"{common.shapes_text(CPU_SHAPES)}; CUDA: {common.shapes_text(CUDA_SHAPES)})",
    )
    p.add_argument(
        "--dtype",
        default=None,
        help=f"comma list of logits dtypes from {','.join(common.DTYPES)} (default: fp32,bf16 on "
        "CPU, bf16,fp32 on CUDA)",
    )
    common.add_reps(
        p, "untimed calls before each timing (default 2)", "timed calls per timing (default 7)"
    )
    p.add_argument(
        "--slow-rep",
        type=int,
        default=3,
        help="CPU: timed calls of the slow reference-oracle row (default 3, after 1 warm-up)",
    )
    p.add_argument("--methods", default="", help="comma list of rows to run: " + ",".join(METHODS))
    p.add_argument(
        "--slice",
        action="store_true",
        help="pass the HF-style view logits[:, :-1] of (B, T+1, V) instead of a (B, T, V) tensor",
    )
    p.add_argument("--no-compile", action="store_true", help="skip the trl-eager-compiled row")
    p.add_argument("--no-verl", action="store_true", help="skip the verl-eager row")
    p.add_argument("--no-reference", action="store_true", help="skip the reference (oracle) row")
    p.add_argument("--no-liger", action="store_true", help="skip Liger-Kernel on CUDA")
    common.add_run_args(
        p,
        "bench_policy_loss",
        f"tiny smoke run: shape {common.shapes_text(QUICK_SHAPES)}, fp32 and bf16, 1 warm-up and "
        "2 timed calls (unless --warmup / --rep say otherwise); for tests",
    )
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        help="time with this many other processes each keeping one core busy (a pure-Python "
        "loop), as on a shared machine; results go to bench_policy_loss_<device>_busy<K>.*",
    )
    return p


def resolve(args, device):
    """Fill the defaults that depend on the device and on --quick; returns the case list."""
    cuda = device.type == "cuda"
    one = None
    if args.B is not None or args.T is not None or args.V is not None:
        one = (args.B or DEFAULT_B, args.T or DEFAULT_T, args.V or DEFAULT_V)
    shapes = common.choose_shapes(args, one, cuda, CPU_SHAPES, CUDA_SHAPES, QUICK_SHAPES)
    dtypes = common.parse_dtypes(args.dtype or ("bf16,fp32" if cuda else "fp32,bf16"))
    common.fill_reps(args, cuda, 1 if args.quick else 2, 2 if args.quick else 7)
    return [(b, t, v, d) for (b, t, v) in shapes for d in dtypes]


def case_argv(raw_argv, case):
    B, T, V, dtype = case
    return [*raw_argv, "--B", str(B), "--T", str(T), "--V", str(V), "--dtype", dtype]


def main(argv=None):
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args, device = common.parse_bench_args(build_parser(), raw_argv)
    cuda = device.type == "cuda"
    cases = resolve(args, device)
    notes: dict[str, str] = {}

    if args.memory_only:  # child of a CPU run: {method: peak memory} of its one case, one line
        (case,) = cases
        B, T, V, dtype = case
        inp = make_inputs(B, T, V, common.DTYPES[dtype], device)
        methods = build_methods(inp, args, device, notes)
        mems = {name: measure_memory(*m, device) for name, m in methods.items()}
        print(json.dumps(mems))
        return mems

    info = common.device_info(device)
    rates = {"peak_bandwidth_GBs": info["peak_bandwidth_GBs"]}
    if not cuda:
        print("measuring the CPU's copy bandwidth and exp rate ...", file=sys.stderr, flush=True)
        rates.update(common.cpu_rates(1 << 22 if args.quick else 1 << 26))
    n_methods = len(build_methods(make_inputs(1, 2, 8, torch.float32, device), args, device, {}))
    bar = common.progress(len(cases) * n_methods, "bench_policy_loss", disable=args.no_progress)
    rows, mem_method = [], ""
    with common.keep_rows_on_interrupt(notes, rows):  # a stage timeout keeps the rows measured
        for case in cases:
            B, T, V, dtype = case
            label = f"N={B * T} V={V} {dtype}"
            case_argv_ = case_argv(raw_argv, case)
            mems = {} if cuda else common.case_memory(bar, label, __file__, case_argv_)
            inp = make_inputs(B, T, V, common.DTYPES[dtype], device)
            methods = build_methods(inp, args, device, notes)
            for name, method in methods.items():
                bar.set_postfix_str(f"{label}: {name}")
                with common.busy_processes(args.busy):
                    row, mem_method = bench_method(
                        name, method, case, args, device, mems.get(name), rates
                    )
                rows.append(row)
                bar.update()
                bar.write(
                    f"{label:22s} {name:20s} fwd {row['fwd_ms']:9.1f}  total "
                    f"{row['total_ms']:9.1f} ms [{row['total_ms_q20']:.1f}, "
                    f"{row['total_ms_q80']:.1f}]  peak {row['peak_MB']:8.1f} MiB  "
                    f"{row['GBs']:6.1f} GB/s"
                )
            del inp, methods
            gc.collect()
    for case in cases:  # the ratios within each case, of the rows it has
        case_rows = [r for r in rows if (r["B"], r["T"], r["V"], r["dtype"]) == case]
        base_row = next((r for r in case_rows if r["method"] == BASELINE), None)
        for r in case_rows:
            r["speedup_vs_trl_eager"] = base_row["total_ms"] / r["total_ms"] if base_row else None
            r["memory_vs_trl_eager"] = (
                r["peak_MB"] / base_row["peak_MB"] if base_row and base_row["peak_MB"] > 0 else None
            )
    bar.close()
    for why in notes.values():
        print(why, file=sys.stderr)

    meta = {
        **info,
        "benchmark": "policy_loss fwd+bwd on logits, GRPO (clip 0.2/0.2, k3 KL beta 0.04, "
        "seq-mean-token-mean)",
        "baseline": f"{BASELINE}: trl.trainer.utils.selective_log_softmax + entropy_from_logits "
        "(no_grad) + TRL 1.16 GRPO per-token math; every speedup / memory ratio is against it. "
        + (
            "On CUDA both helpers dispatch to TRL's Triton kernel (_fused_logprob_entropy)"
            if cuda
            else "On the CPU both helpers run their eager torch loops"
        ),
        "oracle": f"{ORACLE}: fastrl.reference.policy_loss, the readable oracle; never a baseline",
        "cases": [{"B": b, "T": t, "V": v, "dtype": d} for b, t, v, d in cases],
        "slice": args.slice,
        "timing": "_common.cuda_calls: do_bench's method (L2 flushed, CUDA events), warmup "
        f"{args.warmup} ms, rep {args.rep} ms, at least {common.MIN_CUDA_CALLS} timed calls; the "
        "in-place row the same, its buffer prepared outside the timed region"
        if cuda
        else f"perf_counter, warmup {args.warmup}, rep {args.rep} "
        f"(the oracle row: warmup 1, rep {min(args.slow_rep, args.rep)})",
        "bwd_note": "bwd_ms = max(total_ms - fwd_ms, 0). fastrl computes dL/dlogits inside its "
        "forward (fwd_includes_grad), so its fwd_ms is most of its cost and its bwd_ms only "
        "applies grad_output; compare total_ms.",
        "memory_method": mem_method,
        "nominal_traffic": "2 * N * V * itemsize: read the logits once, write the gradient once",
        "machine_rates": rates,
        "exp_floor": "N * V / exp_per_s (one exp per logit)" if rates.get("exp_per_s") else None,
        "threads": torch.get_num_threads(),
        "busy_processes": args.busy,
        "env": common.run_env(),
        "notes": notes,
    }
    name = f"bench_policy_loss_{device.type}" + (f"_busy{args.busy}" if args.busy else "")
    case_of = lambda r: f"N={r['N']} (B={r['B']}, T={r['T']}), V={r['V']}, {r['dtype']}"  # noqa: E731
    panels = [common.TOTAL_MS_PANEL, ("peak_MB", "peak memory (MiB)")]
    title = "GRPO policy loss on logits, fwd+bwd"
    paths = common.save_cases(name, rows, meta, args, case_of, panels, title)
    print(paths)
    return rows


if __name__ == "__main__":
    main()
