"""Benchmark: the no-grad log-probs of pi_old / pi_ref, what a trainer computes before each
update, from padded batches: fastrl against the code trainers run, from the logits and from the
last hidden states and the LM-head weight.

    python benchmarks/bench_logprobs.py                  # CPU: B=4, T=512, V=32000, H=1024, bf16
    python benchmarks/bench_logprobs.py --device cuda    # B=16, T=1024, V=151936, H=4096, bf16
    python benchmarks/bench_logprobs.py --help

Every call runs under torch.no_grad() on B sequences of T positions whose lengths are drawn
uniformly from [T / 2, T] (seeded): the rest is padding, as in a batch of rollouts (the mask).
Methods, entry "logits" (the (B, T, V) logits given):
  trl selective_log_softmax   trl.trainer.utils.selective_log_softmax (TRL 1.16; on CUDA with
                              triton importable it runs TRL's own Triton kernel, on the CPU a
                              per-sequence loop: logsumexp for fp32, log_softmax for bf16)
  trl +entropy_from_logits    the same and TRL's entropy_from_logits (the entropy a trainer logs)
  verl logprobs_from_logits   verl.utils.torch_functional.logprobs_from_logits (verl 0.9.1)
  log_softmax+gather          torch.log_softmax(z.float(), -1).gather(y): plain eager torch
  compiled log_softmax+gather the same under torch.compile (--no-compile: left out)
  fastrl.logprobs             every row read
  fastrl.logprobs mask=       rows with mask 0 not read (logp = 0 there)
  fastrl.logprobs mask= +H    the same with the entropy
entry "hidden" (hidden (B, T, H) and the weight (V, H) given; --no-hidden: left out):
  gemm-floor                  hidden @ weight.T into a preallocated (N, V) buffer: the floor of
                              any method that forms the logits
  matmul+trl                  the logits materialised, then TRL's selective_log_softmax
  trl-chunked                 TRL 1.16's fused LM head (ChunkedLogProbFunction, logp + entropy
                              as GRPOTrainer asks for them)
  verl-fused-linear           verl 0.9.1's FusedLinearForPPO (logp + entropy), 512-row chunks
  fastrl.linear_logprobs mask=     rows with mask 0 not computed (no GEMM work)
  fastrl.linear_logprobs mask= +H  the same with the entropy
Reported: median and q20 / q80 ms, the speed-up of the median over TRL's method of the same
entry (`speedup_vs_trl`: selective_log_softmax, trl-chunked), for "logits" GB/s of reading the
logits once (N * V * itemsize bytes) against the device's peak bandwidth (CUDA) or the CPU's
measured copy bandwidth, for "hidden" TFLOP/s of the one GEMM (2 N H V) and the time over the
floor's (`x_gemm_floor`), the peak memory of one call above the inputs (CPU: RSS high-water
mark in a child process, see benchmarks/_common.py; CUDA: max_memory_allocated), and each
method's largest |logp - exact| at counted tokens (exact: fp32 log_softmax of the logits, or of
the GEMM formed in fp32), which shows what a bf16 log_softmax's rounding costs the ratio
pi / pi_old. Rows whose library is missing are left out, the reason in the file's notes.
Results: <out>/bench_logprobs_<device>.{json,csv,png} (--out, default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _baselines import (  # noqa: E402
    import_verl,
    trl_chunked_logprobs,
    trl_log_softmax_fns,
    verl_logprobs_from_logits,
)
from _common import (  # noqa: E402
    DTYPES,
    add_out_arg,
    check_sizes,
    cpu_rates,
    device_info,
    keep_rows_on_interrupt,
    measure_peaks,
    save_bars,
    time_rows,
)

import fastrl  # noqa: E402

TRL_METHODS = ("trl selective_log_softmax", "trl-chunked")  # each entry's `speedup_vs_trl` base
CPU_SHAPE = dict(B=4, T=512, V=32000, H=1024)
CUDA_SHAPE = dict(B=16, T=1024, V=151936, H=4096)


def make_inputs(B, T, V, H, dtype, device, seed=0):
    """logits (B, T, V), tokens (B, T), mask (B, T) bool (lengths in [T / 2, T]), and, with H,
    hidden (B, T, H) and weight (V, H) (logits = hidden @ weight.T, fp32-rounded to dtype)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(T // 2, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).to(device)
    tokens = torch.randint(0, V, (B, T), generator=g).to(device)
    hidden = weight = None
    if H:
        hidden = torch.randn(B, T, H, generator=g).to(device, dtype)
        weight = (torch.randn(V, H, generator=g) / H**0.5).to(device, dtype)
        logits = hidden @ weight.T
    else:
        logits = (torch.randn(B, T, V, generator=g) * 2).to(device, dtype)
    return logits, tokens, mask, hidden, weight


def logits_methods(logits, tokens, mask, compile_: bool, notes: dict) -> dict:
    """name -> () -> one no-grad log-prob call on the logits (entry "logits")."""
    selective_log_softmax, entropy_from_logits = trl_log_softmax_fns()

    def eager(z, y):
        return torch.log_softmax(z.float(), -1).gather(-1, y[..., None]).squeeze(-1)

    calls = {
        "trl selective_log_softmax": lambda: selective_log_softmax(logits, tokens),
        "trl +entropy_from_logits": lambda: (
            selective_log_softmax(logits, tokens),
            entropy_from_logits(logits),
        ),
    }
    verl_fn, why = verl_logprobs_from_logits()
    if verl_fn is None:
        notes["verl logprobs_from_logits"] = f"skipped: `import verl` failed ({why})"[:300]
    else:
        calls["verl logprobs_from_logits"] = lambda: verl_fn(logits, tokens)
        if why:
            notes["verl logprobs_from_logits"] = why
    calls["log_softmax+gather"] = lambda: eager(logits, tokens)
    if compile_:
        compiled = torch.compile(eager)
        calls["compiled log_softmax+gather"] = lambda: compiled(logits, tokens)
    calls["fastrl.logprobs"] = lambda: fastrl.logprobs(logits, tokens)
    calls["fastrl.logprobs mask="] = lambda: fastrl.logprobs(logits, tokens, mask=mask)
    calls["fastrl.logprobs mask= +H"] = lambda: fastrl.logprobs(
        logits, tokens, entropy=True, mask=mask
    )
    return calls


def hidden_methods(hidden, weight, tokens, mask, notes: dict) -> dict:
    """name -> () -> one no-grad log-prob call from the hidden states (entry "hidden")."""
    selective_log_softmax, _ = trl_log_softmax_fns()
    B, T, H = hidden.shape
    flat = hidden.reshape(-1, H)
    out = torch.empty(B * T, weight.shape[0], dtype=hidden.dtype, device=hidden.device)
    calls = {
        "gemm-floor": lambda: torch.matmul(flat, weight.T, out=out),
        "matmul+trl": lambda: selective_log_softmax(hidden @ weight.T, tokens),
        "trl-chunked": lambda: trl_chunked_logprobs(hidden, weight, tokens, mask),
    }
    try:
        note = import_verl()
        from verl.utils.experimental.torch_functional import FusedLinearForPPO

        fused = FusedLinearForPPO()  # verl's models build it so: chunk_size 512, "torch"
        calls["verl-fused-linear"] = lambda: fused(
            hidden_states=hidden, vocab_weights=weight, input_ids=tokens, temperature=1.0
        )
        if note:
            notes["verl-fused-linear"] = note
    except Exception as e:  # not installed, or one of its dependencies missing
        notes["verl-fused-linear"] = f"skipped: `import verl` failed ({type(e).__name__}: {e})"
    calls["fastrl.linear_logprobs mask="] = lambda: fastrl.linear_logprobs(
        hidden, weight, tokens, mask=mask
    )
    calls["fastrl.linear_logprobs mask= +H"] = lambda: fastrl.linear_logprobs(
        hidden, weight, tokens, mask=mask, entropy=True
    )
    return calls


def all_methods(inputs, args, notes: dict) -> dict:
    """entry -> {name: call}, each call wrapped in torch.no_grad()."""
    logits, tokens, mask, hidden, weight = inputs

    def no_grad(fn):
        def call():
            with torch.no_grad():
                return fn()

        return call

    entries = {"logits": logits_methods(logits, tokens, mask, args.compile, notes)}
    if hidden is not None:
        entries["hidden"] = hidden_methods(hidden, weight, tokens, mask, notes)
    return {e: {n: no_grad(f) for n, f in calls.items()} for e, calls in entries.items()}


def flat_calls(entries: dict) -> dict:
    """{"entry: name": call} of all entries (the memory child's and the timing's keys)."""
    return {f"{e}: {n}": f for e, calls in entries.items() for n, f in calls.items()}


def reference_logp(inputs) -> dict:
    """entry -> fp32 (B, T) log-probs of the tokens: log_softmax of the logits in fp32
    ("logits"), of hidden @ weight.T formed in fp32 ("hidden")."""
    logits, tokens, _, hidden, weight = inputs

    def of(z):
        return torch.log_softmax(z.float(), -1).gather(-1, tokens[..., None]).squeeze(-1)

    with torch.no_grad():
        ref = {"logits": of(logits)}
        if hidden is not None:
            ref["hidden"] = of(hidden.float() @ weight.float().T)
    return ref


def logp_errors(entries: dict, inputs) -> dict:
    """ "entry: name" -> the largest |logp - reference| at counted tokens of one call of each
    method (its log-probs: the output, or its first item; None where the method gives none, the
    GEMM floor), untimed (it also warms each call up: the compiled row compiles here)."""
    mask = inputs[2]
    ref = reference_logp(inputs)
    errors = {}
    for entry, calls in entries.items():
        for name, call in calls.items():
            out = call()
            logp = out[0] if isinstance(out, (tuple, list)) else out
            ok = isinstance(logp, torch.Tensor) and logp.shape == mask.shape
            err = (logp.float() - ref[entry])[mask].abs().max().item() if ok else None
            errors[f"{entry}: {name}"] = err
    return errors


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    for k in ("B", "T", "V", "H"):
        what = {"B": "sequences", "T": "positions per sequence", "V": "vocabulary size"}
        what["H"] = "hidden size of the 'hidden' entry (--no-hidden leaves it out)"
        p.add_argument(
            f"--{k}", type=int, default=None, help=f"{what[k]} (CPU {CPU_SHAPE[k]}, CUDA "
            f"{CUDA_SHAPE[k]})"
        )  # fmt: skip
    p.add_argument("--dtype", default="bf16", choices=list(DTYPES), help="logits / hidden dtype")
    p.add_argument("--rep", type=int, default=None, help="timed calls (CPU, 5) / ms (CUDA, 100)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="leave out the torch.compile row (its compile takes a while on the CPU)",
    )
    p.add_argument("--no-hidden", action="store_true", help="leave out the 'hidden' entry")
    add_out_arg(p, "bench_logprobs")
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    return p


def resolve(args) -> None:
    """Fill the shape defaults of the device (CPU_SHAPE / CUDA_SHAPE); --no-hidden sets H = 0."""
    shape = CUDA_SHAPE if torch.device(args.device).type == "cuda" else CPU_SHAPE
    for k, v in shape.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.no_hidden:
        args.H = 0


def child_argv(args) -> list[str]:
    argv = ["--device", args.device, "--dtype", args.dtype]
    argv += [x for k in ("B", "T", "V", "H") for x in (f"--{k}", str(getattr(args, k)))]
    argv += [] if args.compile else ["--no-compile"]
    return argv + ([] if args.threads is None else ["--threads", str(args.threads)])


def main(argv=None) -> None:
    p = build_parser()
    args = p.parse_args(argv)
    resolve(args)
    check_sizes(p, args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cuda = torch.device(args.device).type == "cuda"
    dtype = DTYPES[args.dtype]
    inputs = make_inputs(args.B, args.T, args.V, args.H, dtype, args.device)
    notes: dict = {}
    entries = all_methods(inputs, args, notes)
    if args.memory_child:
        print(json.dumps(measure_peaks(flat_calls(entries), args.device)[0]))
        return
    errors = logp_errors(entries, inputs)
    peaks, memory_method = measure_peaks(
        flat_calls(entries), args.device, __file__, child_argv(args)
    )
    rows: list[dict] = []
    N = args.B * args.T
    with keep_rows_on_interrupt(notes, rows):  # a stage timeout keeps the rows done
        for entry, calls in entries.items():
            reps = dict.fromkeys(calls, args.rep or (100 if cuda else 5))
            shape = dict(entry=entry, B=args.B, T=args.T, V=args.V, dtype=args.dtype)
            shape.update({"H": args.H} if entry == "hidden" else {})
            entry_peaks = {n: peaks[f"{entry}: {n}"] for n in calls}
            time_rows(calls, reps, args.device, entry_peaks, rows, **shape)
    if not rows:
        raise SystemExit("interrupted before the first row was timed")
    meta = device_info(args.device)
    rates = {} if cuda else cpu_rates()
    peak_bw = meta["peak_bandwidth_GBs"] if cuda else rates["copy_GBs"]
    read_gb = N * args.V * dtype.itemsize / 1e9
    base = {r["entry"]: r["median_ms"] for r in rows if r["method"] in TRL_METHODS}
    for row in rows:
        row["max_abs_err_logp"] = errors[f"{row['entry']}: {row['method']}"]
        trl = base.get(row["entry"])
        row["speedup_vs_trl"] = round(trl / row["median_ms"], 2) if trl else None
        if row["entry"] == "logits":
            row["GBs"] = round(read_gb / (row["median_ms"] / 1e3), 2)
            row["pct_bw"] = round(100 * row["GBs"] / peak_bw, 1) if peak_bw else None
    floor = next((r["median_ms"] for r in rows if r["method"] == "gemm-floor"), None)
    for row in rows:
        if row["entry"] == "hidden":
            row["TFLOPs"] = round(2 * N * args.H * args.V / 1e12 / (row["median_ms"] / 1e3), 3)
            row["x_gemm_floor"] = round(row["median_ms"] / floor, 2) if floor else None
        row["method"] = f"{row['entry']}: {row['method']}"
    counted = inputs[2].float().mean().item()
    meta.update(
        torch_threads=torch.get_num_threads(),
        counted_share=round(counted, 3),
        memory_method=memory_method,
        read_once_GB=read_gb,
        machine_rates=rates or None,
        notes=notes,
        logp_reference="fp32 torch.log_softmax of the logits (entry logits) or of hidden @ "
        "weight.T formed in fp32 (entry hidden), at counted tokens",
    )
    name = f"bench_logprobs_{torch.device(args.device).type}"
    title = (
        f"no-grad log-probs B={args.B} T={args.T} V={args.V} {args.dtype} on {meta['device_name']}"
    )
    paths = save_bars(name, rows, meta, args.out, title)
    print(json.dumps(paths, indent=1))


if __name__ == "__main__":
    main()
