"""Benchmark: fastrl.gae against the per-step Python loop that verl-style trainers run.

    python benchmarks/bench_gae.py                   # CPU: B=512, T=8192, fp32, 1 thread
    python benchmarks/bench_gae.py --device cuda     # Triton reverse scan
    python benchmarks/bench_gae.py --help

Workload: rewards / values (B, T) fp32, a response mask with random lengths (trailing padding)
and ~10% masked tokens inside the responses (tool output), γ = 1, λ = 0.95, advantages whitened
over the counted tokens on both sides. Methods:
  python-loop   for t = T-1 .. 0 over (B,) slices, then masked whitening (written here, the
                baseline of speedup_vs_loop: it runs where verl is not installed)
  verl          verl's own core_algos.compute_gae_advantage_return (the same loop and
                verl_F.masked_whiten), when verl imports (skipped with a note otherwise, e.g. on
                a GPU image without verl's dependencies); --no-verl leaves it out
  fastrl.gae    CPU: the blocked closed-form scan; CUDA: the Triton kernel (check=False: no
                NaN check, so no host sync)
Reported: median and q20/q80 time (ms) and n_samples (timed calls; on CUDA at least 10, the
per-step loops 5), speedup of the median over the loop, GBs = the floor
traffic (read rewards, values and the bool mask once, write advantages and returns once: 17 bytes
a token) / median time, pct_bw = GBs against the device's peak bandwidth (known GPUs) or the CPU's
copy bandwidth measured with the same threads (in the JSON meta), peak memory (MiB) of one call
above the inputs (CPU: measured in a child process with MALLOC_MMAP_THRESHOLD_=65536, see
benchmarks/_common.py; CUDA: max_memory_allocated). On CPU both methods use --threads torch
threads (default: all cores); fastrl's scan runs whole chunks of rows on that many
single-threaded workers (no intra-op barrier per op, so another process on one core slows it
only by that core's share: --busy 1 measures it).
Results: <out>/bench_gae_<device>.{json,csv,png} (--out, default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _baselines import import_verl  # noqa: E402
from _common import (  # noqa: E402
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

LOOP_MIN_CALLS = 5  # CUDA: timed calls of the per-step loops at least (the others: 10)


def loop_gae(rewards, values, mask, gamma, lam):
    """The per-step loop (verl's masked form), then masked whitening (unbiased variance)."""
    B, T = rewards.shape
    next_value = torch.zeros(B, device=rewards.device)
    last_gae = torch.zeros(B, device=rewards.device)
    reversed_adv = []
    for t in reversed(range(T)):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        gae_t = delta + gamma * lam * last_gae
        next_value = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_value
        last_gae = gae_t * mask[:, t] + (1 - mask[:, t]) * last_gae
        reversed_adv.append(last_gae)
    adv = torch.stack(reversed_adv[::-1], dim=1)
    returns = adv + values
    count = mask.sum()
    mean = (adv * mask).sum() / count
    var = ((adv - mean) ** 2 * mask).sum() / (count - 1)
    return (adv - mean) * torch.rsqrt(var + 1e-8), returns


def make_inputs(B, T, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(B, T, generator=g)
    values = torch.randn(B, T, generator=g)
    lengths = torch.randint(T // 4, T + 1, (B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]) & (torch.rand(B, T, generator=g) > 0.1)
    return rewards.to(device), values.to(device), mask.to(device)


def verl_gae():
    """(verl's compute_gae_advantage_return, note) or (None, why it cannot be imported); note:
    None, or _baselines.RAY_PLACEHOLDER when verl imported with a stand-in for ray."""
    try:
        note = import_verl()
        from verl.trainer.ppo.core_algos import compute_gae_advantage_return
    except Exception as e:  # not installed, or one of its own imports missing
        return None, f"verl not importable ({type(e).__name__}: {e})"
    return compute_gae_advantage_return, note or None


def methods(args, r, v, m, notes: dict | None = None) -> dict:
    """name -> () -> one call on (r, v, m); the loops left out with --skip-loop, verl's also
    with --no-verl or when it cannot be imported (the reason goes to `notes`)."""
    gamma, lam = 1.0, 0.95
    calls = {"python-loop": lambda: loop_gae(r, v, m.float(), gamma, lam)}
    verl, why = verl_gae() if not (args.skip_loop or args.no_verl) else (None, "--no-verl")
    if verl is not None:
        gamma_t, lam_t, mf = torch.tensor(gamma), torch.tensor(lam), m.float()
        calls["verl"] = lambda: verl(r, v, mf, gamma_t, lam_t)
        if notes is not None and why:
            notes["verl"] = why
    elif notes is not None and not args.skip_loop:
        notes["verl"] = why
    calls["fastrl.gae"] = lambda: fastrl.gae(r, v, m, gamma, lam, check=False)
    if args.skip_loop:
        del calls["python-loop"]
    return calls


def memory_child(args) -> None:
    """Run in a child process: print {method: peak bytes} as JSON."""
    torch.set_num_threads(args.threads)
    calls = methods(args, *make_inputs(args.B, args.T, args.device))
    print(json.dumps(measure_peaks(calls, args.device)[0]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--B", type=int, default=512)
    p.add_argument("--T", type=int, default=8192)
    p.add_argument("--rep", type=int, default=None, help="timed calls (CPU) / ms (CUDA)")
    p.add_argument("--loop-rep", type=int, default=3, help="timed calls of the slow loop (CPU)")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="torch CPU threads for both methods (default: all cores; 1 on a shared machine)",
    )
    p.add_argument("--skip-loop", action="store_true", help="time only fastrl.gae")
    p.add_argument("--no-verl", action="store_true", help="leave out verl's own function")
    p.add_argument(
        "--busy",
        type=int,
        default=0,
        help="time with this many other processes each keeping one core busy (a pure-Python "
        "loop), as on a shared machine; results go to bench_gae_<device>_busy<K>.*",
    )
    add_out_arg(p, "bench_gae")
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    check_sizes(p, args)
    if args.memory_child:
        return memory_child(args)
    cuda = torch.device(args.device).type == "cuda"
    torch.set_num_threads(args.threads)
    r, v, m = make_inputs(args.B, args.T, args.device)

    # agreement check (not timed)
    adv, ret = fastrl.gae(r, v, m, 1.0, 0.95, check=False)
    if not args.skip_loop:
        ref_adv, ref_ret = loop_gae(r, v, m.float(), 1.0, 0.95)
        max_err = (adv - ref_adv).abs().max().item()
    else:
        max_err = None

    notes: dict = {}
    calls = methods(args, r, v, m, notes)
    if "verl" in calls:  # the same loop: check it agrees too (not timed)
        verl_adv, _ = calls["verl"]()
        max_err_verl = (adv - verl_adv).abs().max().item()
    else:
        max_err_verl = None
    child = ["--device", args.device, "--B", str(args.B), "--T", str(args.T)]
    child += ["--threads", str(args.threads)] + (["--skip-loop"] if args.skip_loop else [])
    child += ["--no-verl"] if "verl" not in calls else []
    peaks, memory_method = measure_peaks(calls, args.device, __file__, child)
    loop_reps = (args.rep or 500) if cuda else args.loop_rep
    reps = {"python-loop": loop_reps, "verl": loop_reps}
    reps["fastrl.gae"] = args.rep or (100 if cuda else 10)
    # the per-step loop takes seconds a call on a GPU (1.3 s on an H200): 5 timed calls there
    least = {"python-loop": LOOP_MIN_CALLS, "verl": LOOP_MIN_CALLS}
    rows: list[dict] = []
    with keep_rows_on_interrupt(notes, rows), busy_processes(args.busy):  # a stage timeout
        time_rows(calls, reps, args.device, peaks, rows, least, B=args.B, T=args.T)
    if not rows:
        raise SystemExit("interrupted before the first row was timed")
    base = next((row["median_ms"] for row in rows if row["method"] == "python-loop"), None)
    for row in rows:
        row["speedup_vs_loop"] = round(base / row["median_ms"], 2) if base else None
    meta = device_info(args.device)
    rates = {} if cuda else cpu_rates()
    # the floor of any GAE: read rewards, values (fp32) and the mask (bool) once, write the
    # advantages and returns (fp32) once: 17 bytes a token
    add_traffic(
        rows, 17 * args.B * args.T, meta["peak_bandwidth_GBs"] if cuda else rates["copy_GBs"]
    )
    meta.update(
        machine_rates=rates or None,
        busy_processes=args.busy,
        torch_threads=torch.get_num_threads(),
        gamma=1.0,
        lam=0.95,
        counted_fraction=round(m.float().mean().item(), 3),
        max_abs_err_vs_loop=max_err,
        max_abs_err_vs_verl=max_err_verl,
        memory_method=memory_method,
        notes=notes,
    )
    paths = save_bars(
        f"bench_gae_{torch.device(args.device).type}" + (f"_busy{args.busy}" if args.busy else ""),
        rows,
        meta,
        args.out,
        f"GAE B={args.B} T={args.T} on {meta['device_name']} ({meta['torch_threads']} thr)",
    )
    print(json.dumps({**paths, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
