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
Reported: median and q20/q80 time (ms), speedup of the median over the baseline, peak memory of
one call above the inputs (CPU: RSS high-water mark in a child process with
MALLOC_MMAP_THRESHOLD_=65536, see benchmarks/_common.py; CUDA: max_memory_allocated).
Results: <out>/bench_sample_<device>.{json,csv,png} (--out, default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import (  # noqa: E402
    RESULTS_DIR,
    device_info,
    peak_memory,
    plot_bars,
    time_fn,
    write_results,
)

import fastrl  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
TEMPERATURE = 0.7


def baseline(logits, generator):
    z = logits.float() / TEMPERATURE
    probs = torch.softmax(z, dim=-1)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    logp = torch.log_softmax(z, dim=-1).gather(1, tokens[:, None]).squeeze(1)
    return tokens, logp


def methods(device):
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        "multinomial+log_softmax": lambda x: baseline(x, gen),
        "fastrl.sample": lambda x: fastrl.sample(x, TEMPERATURE, generator=gen),
        "fastrl.sample top_p=0.9": lambda x: fastrl.sample(
            x, TEMPERATURE, top_p=0.9, generator=gen
        ),
    }


def make_logits(N, V, dtype, device):
    g = torch.Generator(device=device).manual_seed(0)
    return (torch.randn(N, V, generator=g, device=device) * 3).to(dtype)


def memory_child(args) -> None:
    torch.set_num_threads(args.threads)
    x = make_logits(args.N, args.V, DTYPES[args.dtype], args.device)
    out = {
        n: peak_memory(lambda f=f: f(x), args.device)["bytes"]
        for n, f in methods(args.device).items()
    }
    print(json.dumps(out))


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
        "--out",
        default=str(RESULTS_DIR),
        help="results folder (default benchmarks/results/); files bench_sample_<device>.*",
    )
    p.add_argument("--memory-child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
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

    if cuda:
        peaks = {
            n: peak_memory(lambda f=f: f(x), args.device)["bytes"]
            for n, f in methods(args.device).items()
        }
    else:
        env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
        child = [sys.executable, __file__, "--memory-child", "--device", args.device]
        child += ["--N", str(args.N), "--V", str(args.V), "--dtype", args.dtype]
        child += ["--threads", str(args.threads)]
        res = subprocess.run(child, env=env, capture_output=True, text=True, check=True)
        peaks = json.loads(res.stdout.strip().splitlines()[-1])

    rows = []
    for name, fn in methods(args.device).items():
        if cuda:
            t = time_fn(lambda fn=fn: fn(x), 25, args.rep or 100, "cuda")
        else:
            t = time_fn(lambda fn=fn: fn(x), 1, args.rep or 5)
        rows.append(
            {
                "method": name,
                "N": args.N,
                "V": args.V,
                "dtype": args.dtype,
                "median_ms": round(t["median"], 3),
                "q20_ms": round(t["q20"], 3),
                "q80_ms": round(t["q80"], 3),
                "peak_MB": round(peaks[name] / 2**20, 1),
            }
        )
        print(rows[-1], flush=True)
    base = rows[0]["median_ms"]
    for row in rows:
        row["speedup_vs_baseline"] = round(base / row["median_ms"], 2)
    meta = device_info(args.device)
    meta.update(
        torch_threads=torch.get_num_threads(),
        temperature=TEMPERATURE,
        max_abs_err_logp=logp_err,
        max_abs_err_entropy=ent_err,
        memory_method="CUDA max_memory_allocated delta"
        if cuda
        else "RSS high-water mark delta in a child with MALLOC_MMAP_THRESHOLD_=65536",
    )
    name = f"bench_sample_{torch.device(args.device).type}"
    paths = write_results(name, rows, meta, Path(args.out))
    png = plot_bars(
        Path(args.out) / f"{name}.png",
        rows,
        "method",
        [("median_ms", "median time (ms)"), ("peak_MB", "peak memory (MB)")],
        title=f"sample N={args.N} V={args.V} {args.dtype} on {meta['device_name']}",
    )
    print(json.dumps({**paths, "png": png}, indent=1))


if __name__ == "__main__":
    main()
