"""Benchmark: fastrl.sample (token + logp + entropy in one pass) against the usual two-step
rollout code: torch.multinomial(softmax(z / τ)) then a separate log_softmax gather.

    python benchmarks/bench_sample.py                  # CPU: N=256, V=151936, fp32, 1 thread
    python benchmarks/bench_sample.py --device cuda    # bf16, Triton kernel
    python benchmarks/bench_sample.py --help

Methods (τ = 0.7, no truncation unless named):
  multinomial+log_softmax   probs = softmax(z/τ); y = multinomial(probs, 1);
                            logp = log_softmax(z/τ).gather(y)    (no entropy)
  fastrl.sample             y, logp and entropy (CPU: chunked PyTorch Gumbel-max; CUDA: Triton)
  fastrl.sample top_p=0.9   the truncated path (sort + the same sampler)
Reported: median and q20/q80 time (ms), speedup of the median over the baseline, GBs = the
read-once traffic (N * V * itemsize bytes: the floor of any sampler, which must read every logit)
/ median time, pct_bw = GBs against the device's peak bandwidth (known GPUs) or, on the CPU, the
copy bandwidth measured at the start with the same threads (stored in the JSON meta), peak memory
of one call above the inputs (CPU: RSS high-water mark in a child process with
MALLOC_MMAP_THRESHOLD_=65536, see benchmarks/_common.py; CUDA: max_memory_allocated).
With --busy K, K other processes each keep a core busy (a pure-Python loop) while the methods
are timed, as on a shared machine.
Results: <out>/bench_sample_<device>[_busy<K>].{json,csv,png} (--out, default
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import (  # noqa: E402
    DTYPES,
    add_out_arg,
    add_traffic,
    busy_processes,
    check_sizes,
    cpu_rates,
    device_info,
    keep_rows_on_interrupt,
    measure_peaks,
    save_bars,
    time_rows,
)

import fastrl  # noqa: E402

TEMPERATURE = 0.7


def baseline(logits, generator):
    z = logits.float() / TEMPERATURE
    probs = torch.softmax(z, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    logp = torch.log_softmax(z, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logp


def methods(x, device) -> dict:
    """name -> () -> one sampling call on the logits x (one shared generator, seed 0)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        "multinomial+log_softmax": lambda: baseline(x, gen),
        "fastrl.sample": lambda: fastrl.sample(x, TEMPERATURE, generator=gen),
        "fastrl.sample top_p=0.9": lambda: fastrl.sample(x, TEMPERATURE, top_p=0.9, generator=gen),
    }


def make_logits(N, V, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(N, V, generator=g, device=device) * 3).to(dtype)


def memory_child(args) -> None:
    torch.set_num_threads(args.threads)
    x = make_logits(args.N, args.V, DTYPES[args.dtype], args.device)
    print(json.dumps(measure_peaks(methods(x, args.device), args.device)[0]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--N", type=int, default=256)
    p.add_argument("--V", type=int, default=151936)
    p.add_argument(
        "--dtype", default=None, choices=list(DTYPES), help="default fp32 CPU, bf16 CUDA"
    )
    p.add_argument("--rep", type=int, default=None, help="timed calls (CPU) / ms (CUDA)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        help="time with this many other processes each keeping one core busy (a pure-Python "
        "loop), as on a shared machine; results go to bench_sample_<device>_busy<K>.*",
    )
    add_out_arg(p, "bench_sample")
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    check_sizes(p, args)
    cuda = torch.device(args.device).type == "cuda"
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    if args.memory_child:
        return memory_child(args)
    torch.set_num_threads(args.threads)
    x = make_logits(args.N, args.V, DTYPES[args.dtype], args.device)

    # agreement check (not timed): logp and entropy against log_softmax
    tokens, logp, entropy = fastrl.sample(x, TEMPERATURE)
    ls = torch.log_softmax(x.float() / TEMPERATURE, -1)
    logp_err = (logp - ls.gather(1, tokens[:, None]).squeeze(1)).abs().max().item()
    ent_err = (entropy + (ls.exp() * ls).sum(-1)).abs().max().item()
    del ls

    child = ["--device", args.device, "--N", str(args.N), "--V", str(args.V)]
    child += ["--dtype", args.dtype, "--threads", str(args.threads)]
    peaks, memory_method = measure_peaks(methods(x, args.device), args.device, __file__, child)
    calls = methods(x, args.device)  # timed with a fresh generator
    reps = dict.fromkeys(calls, args.rep or (100 if cuda else 5))
    rows: list[dict] = []
    notes: dict = {}
    with keep_rows_on_interrupt(notes, rows), busy_processes(args.busy):  # a stage timeout
        time_rows(calls, reps, args.device, peaks, rows, N=args.N, V=args.V, dtype=args.dtype)
    if not rows:
        raise SystemExit("interrupted before the first row was timed")
    base = rows[0]["median_ms"]
    meta = device_info(args.device)
    rates = {} if cuda else cpu_rates()
    peak_bw = meta["peak_bandwidth_GBs"] if cuda else rates["copy_GBs"]
    read_gb = args.N * args.V * DTYPES[args.dtype].itemsize / 1e9
    for row in rows:
        row["speedup_vs_baseline"] = round(base / row["median_ms"], 2)
    add_traffic(rows, read_gb * 1e9, peak_bw)
    meta.update(
        busy_processes=args.busy,
        torch_threads=torch.get_num_threads(),
        temperature=TEMPERATURE,
        max_abs_err_logp=logp_err,
        max_abs_err_entropy=ent_err,
        memory_method=memory_method,
        read_once_GB=read_gb,
        machine_rates=rates or None,
        notes=notes,
    )
    paths = save_bars(
        f"bench_sample_{torch.device(args.device).type}"
        + (f"_busy{args.busy}" if args.busy else ""),
        rows,
        meta,
        args.out,
        f"sample N={args.N} V={args.V} {args.dtype} on {meta['device_name']}",
    )
    print(json.dumps(paths, indent=1))


if __name__ == "__main__":
    main()
