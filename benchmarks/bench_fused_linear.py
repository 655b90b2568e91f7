"""Benchmark: fastrl.fused_linear_policy_loss vs lm_head matmul + policy loss, forward + backward.

    python benchmarks/bench_fused_linear.py                 # CPU: N=2048, H=512, V=32000, fp32
    python benchmarks/bench_fused_linear.py --device cuda   # N=16384, H=4096, V=151936, bf16

Methods (GRPO preset, gradients w.r.t. the hidden states and the lm_head weight):
  fused-linear   fastrl.fused_linear_policy_loss(hidden, weight, ...): row chunks, never (N, V)
  linear+fused   logits = hidden @ weight.T, then fastrl.policy_loss (the (N, V) logits and
                 their gradient exist)
  linear+eager   logits = hidden @ weight.T, then the eager reference
Reported: median and q20/q80 time; TFLOP/s against the nominal 6 N H V of one forward matmul
and its two gradient matmuls (the fused path recomputes the logits once more, 8 N H V in all,
and is still charged 6); peak memory above the inputs (CPU: a child process, see _common.py;
CUDA: max_memory_allocated). Results: benchmarks/results/bench_fused_linear_<device>.*
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from _common import (  # noqa: E402
    RESULTS_DIR,
    device_info,
    memory_in_child,
    peak_memory,
    plot_bars,
    time_fn,
    write_results,
)

import fastrl  # noqa: E402
from fastrl import reference  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(N, H, V, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    hidden = torch.randn(N, H, generator=g).to(device, dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(device, dtype)
    tokens = torch.randint(0, V, (1, N), generator=g).to(device)
    with torch.no_grad():
        logp = fastrl.logprobs((hidden @ weight.T)[None], tokens)
    rest = dict(
        tokens=tokens,
        advantages=torch.randn(1, N, generator=g).to(device),
        old_logp=logp + 0.05 * torch.randn(1, N, generator=g).to(device),
        ref_logp=logp + 0.05 * torch.randn(1, N, generator=g).to(device),
    )
    return hidden[None], weight, rest


def methods(rest):
    cfg = fastrl.LossConfig.grpo(agg="token-mean")
    return {
        "fused-linear": lambda h, w: fastrl.fused_linear_policy_loss(h, w, **rest, config=cfg).loss,
        "linear+fused": lambda h, w: fastrl.policy_loss(h @ w.T, **rest, config=cfg).loss,
        "linear+eager": lambda h, w: reference.policy_loss(h @ w.T, **rest, config=cfg).loss,
    }


def run(name, fn, hidden, weight, args, device, mem):
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def fwd_bwd():
        h.grad = w.grad = None
        fn(h, w).backward()

    if mem is None:
        fwd_bwd()
        mem = peak_memory(fwd_bwd, device)
    t = time_fn(fwd_bwd, warmup=args.warmup, rep=args.rep, device=device)
    flops = 6 * args.N * args.H * args.V
    return {
        "method": name,
        "N": args.N,
        "H": args.H,
        "V": args.V,
        "dtype": args.dtype,
        "total_ms": t["median"],
        "total_ms_q20": t["q20"],
        "total_ms_q80": t["q80"],
        "TFLOPs": flops / 1e12 / (t["median"] / 1e3),
        "peak_MB": mem["bytes"] / 2**20,
        "logits_MB": args.N * args.V * hidden.element_size() / 2**20,
    }, mem["method"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    p.add_argument("--N", type=int, default=None, help="tokens (default: 2048 cpu, 16384 cuda)")
    p.add_argument("--H", type=int, default=None, help="hidden size (default: 512 cpu, 4096 cuda)")
    p.add_argument("--V", type=int, default=None, help="vocabulary (32000 cpu, 151936 cuda)")
    p.add_argument("--dtype", choices=list(DTYPES), default=None, help="fp32 cpu, bf16 cuda")
    p.add_argument("--warmup", type=int, default=None, help="CPU: calls; CUDA: ms (do_bench)")
    p.add_argument("--rep", type=int, default=None, help="CPU: timed calls; CUDA: ms (do_bench)")
    p.add_argument("--out", default=str(RESULTS_DIR), help="results folder")
    p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw_argv)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    cuda = device.type == "cuda"
    args.N = args.N or (16384 if cuda else 2048)
    args.H = args.H or (4096 if cuda else 512)
    args.V = args.V or (151936 if cuda else 32000)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.warmup = args.warmup if args.warmup is not None else (25 if cuda else 1)
    args.rep = args.rep if args.rep is not None else (100 if cuda else 5)

    hidden, weight, rest = make_inputs(args.N, args.H, args.V, DTYPES[args.dtype], device)
    if args.memory_only:  # child of a CPU run: {method: peak memory} as one JSON line
        mems = {}
        for name, fn in methods(rest).items():
            h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
            fn(h, w).backward()  # warm-up
            h.grad = w.grad = None
            mems[name] = peak_memory(lambda h=h, w=w, fn=fn: fn(h, w).backward(), device)
        print(json.dumps(mems))
        return mems
    mems = {}
    if not cuda:
        mems = memory_in_child(Path(__file__).resolve(), raw_argv)
    rows, mem_method = [], ""
    for name, fn in methods(rest).items():
        row, mem_method = run(name, fn, hidden, weight, args, device, mems.get(name))
        rows.append(row)
        print(
            f"{name:13s} {row['total_ms']:9.1f} ms [{row['total_ms_q20']:.1f}, "
            f"{row['total_ms_q80']:.1f}]  {row['TFLOPs']:.3f} TFLOP/s  "
            f"peak {row['peak_MB']:.0f} MB",
            flush=True,
        )
    info = device_info(device)
    meta = {
        **info,
        "benchmark": "fused linear policy loss fwd+bwd (grads of hidden and weight), GRPO "
        "preset with token-mean",
        "shape": {"N": args.N, "H": args.H, "V": args.V, "dtype": args.dtype},
        "timing": "triton.testing.do_bench"
        if cuda
        else f"perf_counter, warmup {args.warmup}, rep {args.rep}",
        "memory_method": mem_method,
        "nominal_flops": "6 * N * H * V (forward matmul and the two gradient matmuls)",
    }
    name = f"bench_fused_linear_{device.type}"
    paths = write_results(name, rows, meta, Path(args.out))
    title = f"fused linear policy loss, N={args.N} H={args.H} V={args.V} {args.dtype}"
    paths["png"] = plot_bars(
        Path(args.out) / f"{name}.png",
        rows,
        "method",
        [("total_ms", "fwd+bwd time (ms, median)"), ("peak_MB", "peak memory (MB)")],
        title,
    )
    print(paths)
    return rows


if __name__ == "__main__":
    main()
