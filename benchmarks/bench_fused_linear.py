"""Benchmark: the GRPO loss from the last hidden states and the LM-head weight, forward + backward
(gradients of the hidden states and the weight), side by side in one run.

    python benchmarks/bench_fused_linear.py            # CPU: N = 2048, 4096 x H = 512, 1024,
                                                       # V = 32000; fp32 and bf16
    python benchmarks/bench_fused_linear.py --quick    # tiny smoke run (seconds)
    python benchmarks/bench_fused_linear.py --N 4096 --H 2048 --V 151936 --dtype bf16
    python benchmarks/bench_fused_linear.py --chunk-sizes 256 1024 4096   # + a chunk-size sweep

Workload: hidden (B, T, H) with T = --T (256) tokens per sequence, N = B * T; weight (V, H) /
sqrt(H); hidden, weight and every GEMM in the row's dtype; the GRPO loss of
LossConfig.grpo() (clip 0.2 / 0.2, k3 KL beta 0.04, seq-mean-token-mean = TRL's
loss_type="grpo"); old / reference log-probs fp32 near the policy's; every position valid
(mask of ones) except in the 90 %-masked rows. All methods get the same inputs and compute the
same loss (each row records its value).

Rows (methods):
  linear_logprobs+grpo  fastrl.linear_logprobs(hidden, weight, tokens, entropy=True, mask=...)
                        then TRL's GRPO math in plain torch: fastrl as the log-prob op under a
                        trainer's own loss
  fastrl-fused-linear   fastrl.fused_linear_policy_loss(...): per row chunk one GEMM for the
                        logits, the loss terms and dL/dz (ops.stats_and_grad_), then the two
                        gradient GEMMs
  gemm-floor            the three bare GEMMs of the same shapes and dtype, timed together:
                        h @ W.T -> (N, V), g @ W -> (N, H), g.T @ h -> (V, H), outputs
                        preallocated (its peak memory is therefore ~0 and not comparable): the
                        floor of any fused-linear loss
  matmul+fastrl         logits = h @ W.T materialised, then fastrl.policy_loss
  matmul+trl-eager      logits = h @ W.T, then bench_policy_loss's trl-eager loss (TRL's logits
                        helpers selective_log_softmax + entropy_from_logits under no_grad, TRL
                        GRPO math; eager torch loops on the CPU, TRL's Triton kernel on CUDA):
                        THE MEMORY BASELINE
  trl-chunked           what TRL 1.16's GRPOTrainer runs: its fused LM head's
                        ChunkedLogProbFunction (trl/kernels/chunked_logprob.py; its chunk folds
                        are Triton kernels on CUDA, torch tiles on the CPU), outputs log_probs and
                        entropy, then TRL's GRPO math. Every position is scored, as the trainer
                        does off CUDA; on CUDA the trainer scores only the valid ones (the same
                        here: every position is valid)
  verl-fused-linear     what verl 0.9.1's actor runs with use_fused_kernels (impl_backend
                        "torch", its default): FusedLinearForPPO() as the HF models' patched
                        forward builds it (chunks of 512 rows, log-probs and entropy), then
                        verl's own GRPO math (_baselines.make_verl_grpo_math: core_algos'
                        vanilla policy loss with dual clip c = 3, low_var_kl, seq-mean-token-
                        mean); skipped with a note when verl does not import
  verl-linear-ce        CUDA only: verl's Triton fused LM head (impl_backend "triton"),
                        verl.utils.kernel.linear_cross_entropy(h, W, labels, 1.0, "none"),
                        then the same verl GRPO math
  liger-fused-linear    liger_kernel.chunked_loss.LigerFusedLinearGRPOLoss(loss_type="grpo",
                        beta 0.04, eps 0.2, defaults otherwise: compiled loss math, chunk_size 1)
                        on its torch path; skipped with a note when it cannot be imported
  <fastrl row> (90% masked)   the two fastrl rows with only the first 10 % of every sequence's
                        positions valid (prompt / padding positions cost no GEMM work there, so
                        their flops count the valid positions only)
  <fastrl row>[chunk=C] only with --chunk-sizes C ...: linear_logprobs+grpo and
                        fastrl-fused-linear again with chunk_size=C rows per chunk (the rows
                        above use the library's default, chunk_size=None), one row per C, after
                        the others: the sweep that picks a device's chunk size

Reported per row: total_ms (forward + backward, median, q20, q80) and n_samples (timed calls);
flops = 6 * valid_tokens * H * V (the forward GEMM and the two gradient GEMMs of the positions
the mask keeps: N in every row but the masked ones, whose masked positions cost no GEMM) and
TFLOP/s = flops / total time; x_gemm_floor = total / the gemm-floor row of the same shape and dtype;
peak_MB (MiB; CPU: resident-set high-water mark in a child process per shape and dtype; CUDA:
max_memory_allocated; see benchmarks/_common.py); memory_vs_matmul_trl_eager; for the masked
rows vs_unmasked = total / the same method's unmasked total; chunk_size = C for the [chunk=C]
rows (None for the others) and vs_default_chunk = total / the same method's default-chunk total.
Repetitions (CPU): 1 warm-up (after the memory child's and the loss-value call) and 7 timed
calls; rows whose warm-up call takes more than --slow-ms (2500 ms) get --slow-rep (5) timed
calls. On CUDA --warmup / --rep are milliseconds, as for do_bench, with at least 10 timed calls
per row (benchmarks/_common.py: cuda_calls).
Results: <out>/bench_fused_linear_<device>.{json,csv,png}; `python benchmarks/report.py --readme`.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")  # Dynamo tracing TRL's helpers
import _common as common  # noqa: E402
from _baselines import (  # noqa: E402
    BETA,
    EPS_HIGH,
    EPS_LOW,
    import_verl,
    make_trl_eager_loss,
    make_verl_grpo_math,
    trl_chunked_logprobs,
    trl_grpo_math,
)

import fastrl  # noqa: E402

FLOOR = "gemm-floor"
MEM_BASELINE = "matmul+trl-eager"
MASKED = " (90% masked)"
CHUNKED = ("linear_logprobs+grpo", "fastrl-fused-linear")  # the rows --chunk-sizes repeats
METHODS = (
    "linear_logprobs+grpo",
    "fastrl-fused-linear",
    FLOOR,
    "matmul+fastrl",
    MEM_BASELINE,
    "trl-chunked",
    "verl-fused-linear",
    "verl-linear-ce",
    "liger-fused-linear",
    "masked",  # the two fastrl rows on the 90 %-masked batch
)
CPU_SHAPES = [(2048, 512), (2048, 1024), (4096, 512), (4096, 1024)]  # (N, H)
CUDA_SHAPES = [(16384, 4096)]
QUICK_SHAPES = [(64, 32)]
DEFAULT_N, DEFAULT_H = 2048, 512


def chunk_label(method: str, chunk: int) -> str:
    """The row of `method` run with chunk_size=`chunk`: "fastrl-fused-linear[chunk=1024]"."""
    return f"{method}[chunk={chunk}]"


def library_chunk(V: int, device) -> int | None:
    """The rows per chunk that chunk_size=None gives at V on `device` (fastrl.linear's
    default_chunk), for the results' meta; None where fastrl does not say."""
    try:
        from fastrl.linear import default_chunk
    except ImportError:  # pragma: no cover - depends on the library's layout
        return None
    try:
        return int(default_chunk(V, device))
    except TypeError:  # a default_chunk(V) without a device: the same on every device
        return int(default_chunk(V))


def make_inputs(N, H, V, T, dtype, device, seed=0):
    """hidden (B, T, H), weight (V, H), and the loss inputs (tokens, advantages, old / ref
    log-probs, an all-ones mask and a 90 %-masked one)."""
    T = min(T, N)
    if N % T:
        raise SystemExit(f"N = {N} is not a multiple of T = {T} (--T)")
    B = N // T
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(device, dtype)
    tokens = torch.randint(0, V, (B, T), generator=g).to(device)
    with torch.no_grad():
        logp = fastrl.linear_logprobs(hidden, weight, tokens)
    keep = max(1, T // 10)
    masked = (torch.arange(T)[None, :] < keep).expand(B, T).contiguous().to(device)
    loss_inputs = dict(
        tokens=tokens,
        advantages=torch.randn(B, generator=g).to(device),
        old_logp=logp + 0.05 * torch.randn(B, T, generator=g).to(device),
        ref_logp=logp + 0.05 * torch.randn(B, T, generator=g).to(device),
    )
    full = torch.ones(B, T, dtype=torch.bool, device=device)
    return hidden, weight, loss_inputs, full, masked


def build_methods(hidden, weight, li, full, masked, args, notes):
    """name -> step(h, w): one forward + backward (gradients into h.grad / w.grad); returns the
    loss (a tensor) or None for the GEMM floor."""
    cfg = fastrl.LossConfig.grpo()
    tok, adv, old, ref = li["tokens"], li["advantages"], li["old_logp"], li["ref_logp"]
    wanted = set(args.methods.split(",")) if args.methods else set(METHODS)
    trl_eager = make_trl_eager_loss()
    B, T, H = hidden.shape
    V = weight.shape[0]

    def loss_step(loss_fn):
        def step(h, w):
            loss = loss_fn(h, w)
            loss.backward()
            return loss

        return step

    def lp_grpo(mask, chunk=None):
        def f(h, w):
            logp, _entropy = fastrl.linear_logprobs(
                h, w, tok, entropy=True, mask=mask, chunk_size=chunk
            )
            return trl_grpo_math(logp, old, ref, adv, mask)

        return f

    def fused(mask, chunk=None):
        return lambda h, w: (
            fastrl.fused_linear_policy_loss(
                h, w, tok, adv, old, ref, mask, config=cfg, chunk_size=chunk
            ).loss
        )

    methods = {}
    if "linear_logprobs+grpo" in wanted:
        methods["linear_logprobs+grpo"] = loss_step(lp_grpo(full))
    if "fastrl-fused-linear" in wanted:
        methods["fastrl-fused-linear"] = loss_step(fused(full))
    if FLOOR in wanted:
        dtype, device = hidden.dtype, hidden.device
        g_buf = torch.empty(B * T, V, dtype=dtype, device=device).normal_(0.0, 1e-3)  # dL/dz
        z_out = torch.empty(B * T, V, dtype=dtype, device=device)
        dh_out = torch.empty(B * T, H, dtype=dtype, device=device)
        dw_out = torch.empty(V, H, dtype=dtype, device=device)

        def floor(h, w):
            h2 = h.detach().reshape(-1, H)
            w2 = w.detach()
            torch.mm(h2, w2.t(), out=z_out)  # logits
            torch.mm(g_buf, w2, out=dh_out)  # dL/dh
            torch.mm(g_buf.t(), h2, out=dw_out)  # dL/dW
            return None

        methods[FLOOR] = floor
    if "matmul+fastrl" in wanted:
        methods["matmul+fastrl"] = loss_step(
            lambda h, w: fastrl.policy_loss(h @ w.t(), tok, adv, old, ref, full, config=cfg).loss
        )
    if MEM_BASELINE in wanted:
        methods[MEM_BASELINE] = loss_step(
            lambda h, w: trl_eager(h @ w.t(), tok, adv, old, ref, full)[0]
        )
    if "trl-chunked" in wanted:

        def chunked(h, w):
            logp, _entropy = trl_chunked_logprobs(h, w, tok, full)
            return trl_grpo_math(logp, old, ref, adv, full)

        methods["trl-chunked"] = loss_step(chunked)
    if {"verl-fused-linear", "verl-linear-ce"} & wanted and not args.no_verl:
        for name, loss_fn in verl_losses(tok, adv, old, ref, full, wanted, notes).items():
            methods[name] = loss_step(loss_fn)
    if "liger-fused-linear" in wanted and not args.no_liger:
        try:
            from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

            liger = LigerFusedLinearGRPOLoss(
                beta=BETA,
                epsilon_low=EPS_LOW,
                epsilon_high=EPS_HIGH,
                loss_type="grpo",
                temperature=1.0,
                use_ref_model=True,
            )

            def liger_loss(h, w):
                out = liger(h, w, tok, full, adv, ref_per_token_logps=ref, old_per_token_logps=old)
                return out[0] if isinstance(out, tuple) else out

            methods["liger-fused-linear"] = loss_step(liger_loss)
        except Exception as e:  # pragma: no cover - depends on the install
            notes["liger-fused-linear"] = f"skipped: liger-kernel unavailable ({e})"[:300]
    if "masked" in wanted:
        if "linear_logprobs+grpo" in wanted:
            methods["linear_logprobs+grpo" + MASKED] = loss_step(lp_grpo(masked))
        if "fastrl-fused-linear" in wanted:
            methods["fastrl-fused-linear" + MASKED] = loss_step(fused(masked))
    # the chunk-size sweep last: every row above is timed (and printed) before it
    for name, make in zip(CHUNKED, (lp_grpo, fused)):
        for chunk in getattr(args, "chunk_sizes", None) or ():
            if name in wanted:
                methods[chunk_label(name, chunk)] = loss_step(make(full, chunk))
    return methods


def verl_losses(tok, adv, old, ref, mask, wanted, notes) -> dict:
    """name -> loss(h, w): verl's fused LM heads (the rows verl-fused-linear and verl-linear-ce,
    see the module docstring), each then verl's GRPO math; none, with the reason in `notes`,
    where verl does not import (or, for the Triton head, off CUDA)."""
    names = [n for n in ("verl-fused-linear", "verl-linear-ce") if n in wanted]
    try:
        note = import_verl()
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        verl_grpo_math = make_verl_grpo_math()
    except Exception as e:  # not installed, or one of its dependencies missing
        why = f"skipped: `import verl` failed ({type(e).__name__}: {e})"[:300]
        notes.update(dict.fromkeys(names, why))
        return {}
    heads = {}
    if "verl-fused-linear" in names:
        fused = FusedLinearForPPO()  # verl's models build it so: chunk_size 512, "torch"
        heads["verl-fused-linear"] = lambda h, w: fused(
            hidden_states=h, vocab_weights=w, input_ids=tok, temperature=1.0
        )
    if "verl-linear-ce" in names and tok.device.type != "cuda":
        notes["verl-linear-ce"] = "skipped: verl's linear_cross_entropy is CUDA only"
    elif "verl-linear-ce" in names:
        from verl.utils.kernel.linear_cross_entropy import linear_cross_entropy

        B, T = tok.shape
        heads["verl-linear-ce"] = lambda h, w: [
            x.view(B, T) for x in linear_cross_entropy(h, w, tok, 1.0, "none")
        ]

    def then_math(head):
        return lambda h, w: verl_grpo_math(head(h, w)[0].float(), old, ref, adv, mask)

    if note:  # imported with a stand-in for ray (_baselines.import_verl)
        notes.update(dict.fromkeys(heads, note))
    return {name: then_math(head) for name, head in heads.items()}


def leaves(hidden, weight):
    return hidden.clone().requires_grad_(), weight.clone().requires_grad_()


def measure_memory(step, hidden, weight, device):
    """Peak memory of one forward + backward (after a warm-up call)."""
    h, w = leaves(hidden, weight)
    step(h, w)  # warm-up (compilation, page-in)
    h.grad = w.grad = None
    gc.collect()

    def once():
        h.grad = w.grad = None
        step(h, w)

    return common.peak_memory(once, device)


def run(name, step, hidden, weight, case, args, device, mem, chunk=None, valid=None):
    """One row: time, TFLOP/s and memory of `name` on `case` (`chunk`: its chunk_size, None for
    the library default; `valid`: the positions its mask keeps, default all N)."""
    N, H, V, dtype = case
    h, w = leaves(hidden, weight)
    if mem is None:
        mem = measure_memory(step, hidden, weight, device)
    t0 = time.perf_counter()
    loss = step(h, w)  # also the first warm-up call
    first_ms = (time.perf_counter() - t0) * 1e3
    loss_value = None if loss is None else float(loss.detach().float())

    def fwd_bwd():
        h.grad = w.grad = None
        step(h, w)

    slow = device.type != "cuda" and first_ms > args.slow_ms
    warmup = max(args.warmup - 1, 0) if device.type != "cuda" else args.warmup
    rep = min(args.slow_rep, args.rep) if slow else args.rep
    t = common.time_fn(fwd_bwd, warmup=warmup, rep=rep, device=device)
    # the GEMM work of the valid positions: the fused paths skip the GEMMs of masked rows, so
    # charging a 90 %-masked row 6 N H V gave rates above the hardware's peak
    valid = N if valid is None else valid
    flops = 6 * valid * H * V
    itemsize = common.DTYPES[dtype].itemsize
    row = {
        "method": name,
        "role": "floor"
        if name == FLOOR
        else "baseline"
        if name == MEM_BASELINE
        else "fastrl"
        if name.startswith(("fastrl", "linear_logprobs", "matmul+fastrl"))
        else "other",
        "N": N,
        "H": H,
        "V": V,
        "B": hidden.shape[0],
        "T": hidden.shape[1],
        "dtype": dtype,
        "masked_frac": 1.0 - valid / N,
        "valid_tokens": valid,
        "chunk_size": chunk,
        "warmup": warmup + 1,
        "rep": rep,
        "total_ms": t["median"],
        "total_ms_q20": t["q20"],
        "total_ms_q80": t["q80"],
        "n_samples": t["n_samples"],
        "flops": flops,
        "TFLOPs": flops / 1e12 / (t["median"] / 1e3),
        "peak_MB": mem["bytes"] / 2**20,
        "logits_MB": N * V * itemsize / 2**20,
        "loss": loss_value,
    }
    return row, mem["method"]


def positive_int(text: str) -> int:
    """An int >= 1 (argparse type of --chunk-sizes)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an int >= 1, got {text!r}")
    return value


def build_parser():
    p = common.bench_parser("bench_fused_linear.py", __doc__)
    p.add_argument(
        "--N",
        type=int,
        default=None,
        help=f"tokens; giving --N or --H runs that one shape (missing: N={DEFAULT_N}, "
        f"H={DEFAULT_H}) instead of the default list",
    )
    p.add_argument("--H", type=int, default=None, help="hidden size (one shape run)")
    p.add_argument(
        "--shapes",
        default=None,
        help=f"comma list of NxH shapes (default CPU: {common.shapes_text(CPU_SHAPES)}; CUDA: "
        f"{common.shapes_text(CUDA_SHAPES)})",
    )
    p.add_argument("--V", type=int, default=None, help="vocabulary (default 32000; 151936 on CUDA)")
    p.add_argument("--T", type=int, default=256, help="tokens per sequence (default 256)")
    p.add_argument(
        "--dtype",
        default=None,
        help=f"comma list from {','.join(common.DTYPES)} (default fp32,bf16 on CPU, bf16 on CUDA)",
    )
    common.add_reps(
        p,
        "untimed calls before the timing, the loss-value call included (default 1)",
        "timed calls (default 7)",
    )
    p.add_argument(
        "--slow-rep",
        type=int,
        default=5,
        help="CPU: timed calls for rows whose first call exceeds --slow-ms (default 5)",
    )
    p.add_argument(
        "--slow-ms", type=float, default=2500.0, help="CPU: see --slow-rep (default 2500)"
    )
    p.add_argument(
        "--methods",
        default="",
        help="comma list of rows to run: " + ",".join(METHODS) + " ('masked' = the two "
        "fastrl rows on the 90%%-masked batch, needs those rows)",
    )
    p.add_argument("--no-liger", action="store_true", help="skip the liger-fused-linear row")
    p.add_argument(
        "--no-verl", action="store_true", help="skip the verl-fused-linear and verl-linear-ce rows"
    )
    p.add_argument(
        "--chunk-sizes",
        type=positive_int,
        nargs="+",
        default=None,
        metavar="C",
        help="rows per chunk to sweep (e.g. --chunk-sizes 256 1024 4096): for each C one more "
        "row of linear_logprobs+grpo and of fastrl-fused-linear (those of them --methods "
        "keeps), labelled <method>[chunk=C], run with chunk_size=C, timed and measured like the "
        "others, after them, in the same results files (chunk_size and vs_default_chunk = "
        "total / the default-chunk row's total in each row). Default: none, only the library's "
        "default chunk_size (fastrl.linear.default_chunk; the meta's cases record its rows)",
    )
    common.add_run_args(
        p,
        "bench_fused_linear",
        "tiny smoke run: N=64, H=32, V=512, T=16, fp32 and bf16, 1 warm-up and 2 timed "
        "calls (unless --warmup / --rep / --V / --T say otherwise); for tests",
    )
    return p


def resolve(args, device, raw_argv):
    cuda = device.type == "cuda"
    one = None
    if args.N is not None or args.H is not None:
        one = (args.N or DEFAULT_N, args.H or DEFAULT_H)
    shapes = common.choose_shapes(args, one, cuda, CPU_SHAPES, CUDA_SHAPES, QUICK_SHAPES)
    if args.V is None:
        args.V = 512 if args.quick else (151936 if cuda else 32000)
    if args.quick and not any(a == "--T" or a.startswith("--T=") for a in raw_argv):
        args.T = 16
    dtypes = common.parse_dtypes(args.dtype or ("bf16" if cuda else "fp32,bf16"))
    common.fill_reps(args, cuda, 1, 2 if args.quick else 7)
    return [(n, h, args.V, d) for (n, h) in shapes for d in dtypes]


def main(argv=None):
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args, device = common.parse_bench_args(build_parser(), raw_argv)
    cuda = device.type == "cuda"
    cases = resolve(args, device, raw_argv)
    notes: dict[str, str] = {}

    if args.memory_only:  # child of a CPU run: {method: peak memory} of its one case, one line
        (case,) = cases
        N, H, V, dtype = case
        dt = common.DTYPES[dtype]
        hidden, weight, li, full, masked = make_inputs(N, H, V, args.T, dt, device)
        methods = build_methods(hidden, weight, li, full, masked, args, notes)
        mems = {
            name: measure_memory(step, hidden, weight, device) for name, step in methods.items()
        }
        print(json.dumps(mems))
        return mems

    info = common.device_info(device)
    probe = make_inputs(16, 8, 32, 16, torch.float32, device)
    n_methods = len(build_methods(*probe, args, {}))
    bar = common.progress(len(cases) * n_methods, "bench_fused_linear", disable=args.no_progress)
    rows, mem_method = [], ""
    with common.keep_rows_on_interrupt(notes, rows):  # a stage timeout keeps the rows measured
        for case in cases:
            N, H, V, dtype = case
            label = f"N={N} H={H} V={V} {dtype}"
            child_argv = [*raw_argv, "--N", str(N), "--H", str(H), "--V", str(V), "--dtype", dtype]
            child_argv += ["--T", str(args.T)]
            mems = {} if cuda else common.case_memory(bar, label, __file__, child_argv)
            dt = common.DTYPES[dtype]
            hidden, weight, li, full, masked = make_inputs(N, H, V, args.T, dt, device)
            methods = build_methods(hidden, weight, li, full, masked, args, notes)
            chunks = {chunk_label(m, c): c for c in args.chunk_sizes or () for m in CHUNKED}
            n_valid = int(masked.sum())
            for name, step in methods.items():
                bar.set_postfix_str(f"{label}: {name}")
                valid = n_valid if name.endswith(MASKED) else None
                row, mem_method = run(
                    name, step, hidden, weight, case, args, device, mems.get(name),
                    chunks.get(name), valid,
                )  # fmt: skip
                rows.append(row)
                bar.update()
                bar.write(
                    f"{label:26s} {name:36s} {row['total_ms']:9.1f} ms [{row['total_ms_q20']:.1f}, "
                    f"{row['total_ms_q80']:.1f}]  {row['TFLOPs']:.3f} TFLOP/s  "
                    f"peak {row['peak_MB']:.0f} MiB"
                )
            del hidden, weight, li, methods
            gc.collect()
    for case in cases:  # the ratios within each case, of the rows it has
        case_rows = [r for r in rows if (r["N"], r["H"], r["V"], r["dtype"]) == case]
        floor = next((r for r in case_rows if r["method"] == FLOOR), None)
        base = next((r for r in case_rows if r["method"] == MEM_BASELINE), None)
        by_name = {r["method"]: r for r in case_rows}
        for r in case_rows:
            r["x_gemm_floor"] = r["total_ms"] / floor["total_ms"] if floor else None
            r["memory_vs_matmul_trl_eager"] = (
                r["peak_MB"] / base["peak_MB"] if base and base["peak_MB"] > 0 else None
            )
            unmasked = by_name.get(r["method"][: -len(MASKED)]) if r["masked_frac"] else None
            r["vs_unmasked"] = r["total_ms"] / unmasked["total_ms"] if unmasked else None
            default = (
                by_name.get(r["method"].removesuffix(f"[chunk={r['chunk_size']}]"))
                if r["chunk_size"]
                else None
            )
            r["vs_default_chunk"] = r["total_ms"] / default["total_ms"] if default else None
    bar.close()
    for why in notes.values():
        print(why, file=sys.stderr)

    meta = {
        **info,
        "benchmark": "GRPO loss from hidden states and the LM-head weight, fwd+bwd (grads of "
        "hidden and weight); LossConfig.grpo() (clip 0.2/0.2, k3 KL beta 0.04, "
        "seq-mean-token-mean)",
        "cases": [
            {
                "N": n,
                "H": h,
                "V": v,
                "dtype": d,
                "T": args.T,
                "default_chunk": library_chunk(v, device),
            }
            for n, h, v, d in cases
        ],
        "floor": f"{FLOOR}: h @ W.T, g @ W, g.T @ h with preallocated outputs; x_gemm_floor of "
        "every row is against it (same shape and dtype)",
        "memory_baseline": f"{MEM_BASELINE}: logits materialised + TRL-style eager loss",
        "masked_rows": "first 10 % of every sequence's positions valid, 90 % masked",
        "chunk_sizes": args.chunk_sizes,
        "chunk_rows": "<method>[chunk=C]: chunk_size=C; every other row chunk_size=None (the "
        "library's default: each case's default_chunk rows); vs_default_chunk = total / the "
        "default row's total",
        "timing": "_common.cuda_calls: do_bench's method (L2 flushed, CUDA events), warmup "
        f"{args.warmup} ms, rep {args.rep} ms, at least {common.MIN_CUDA_CALLS} timed calls"
        if cuda
        else f"perf_counter, warmup {args.warmup} (the loss-value call), rep {args.rep}; rows "
        f"whose first call exceeds {args.slow_ms:.0f} ms: rep {min(args.slow_rep, args.rep)}",
        "memory_method": mem_method,
        "nominal_flops": "6 * valid_tokens * H * V (forward GEMM and the two gradient GEMMs of the "
        "positions the mask keeps: N for every row but the masked ones), the row's `flops`",
        "threads": torch.get_num_threads(),
        "env": common.run_env(),
        "notes": notes,
    }
    paths = common.save_cases(
        f"bench_fused_linear_{device.type}",
        rows,
        meta,
        args,
        lambda r: f"N={r['N']}, H={r['H']}, V={r['V']}, {r['dtype']}",
        [common.TOTAL_MS_PANEL, ("peak_MB", "peak memory (MiB)")],
        "GRPO loss from hidden states (LM head fused), fwd+bwd",
    )
    print(paths)
    return rows


if __name__ == "__main__":
    main()
