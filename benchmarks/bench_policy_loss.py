"""Benchmark: fused fastrl.policy_loss vs the eager reference vs torch.compile(reference)
(vs Liger-Kernel's triton_grpo_loss on CUDA), forward + backward time and peak memory.

    python benchmarks/bench_policy_loss.py                 # CPU default: N=2048, V=32000, fp32
    python benchmarks/bench_policy_loss.py --device cuda   # N=16384, V=151936, bf16 (+ Liger)
    python benchmarks/bench_policy_loss.py --help

Workload: GRPO preset (clip 0.2/0.2, k3 KL with beta 0.04, seq-mean-token-mean), B sequences of
T tokens (N = B*T), logits (B, T, V) in --dtype; old/ref log-probs fp32, a random mask.
Each method runs forward + backward of the loss w.r.t. the logits. Reported per method:
  fwd_ms      forward only (graph built, no backward), median and q20/q80
  total_ms    forward + backward, median and q20/q80;  bwd_ms = total - fwd (medians)
  peak_MB     peak memory of one forward + backward above the inputs (see benchmarks/_common.py
              for how it is measured on CPU and CUDA)
  GBs         nominal logits traffic / total time, the traffic being what the fused path must
              move: read the logits twice (forward, backward) and write the gradient once,
              3 * N * V * itemsize bytes; with the device's peak bandwidth when known (H200:
              4.8 TB/s) as pct_peak. The same nominal bytes are used for every method.
Results: benchmarks/results/bench_policy_loss_<device>.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import gc
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


def make_inputs(B, T, V, dtype, device, seed=0):
    """Logits (B, T + 1, V) (the fused/eager paths use the first T rows, Liger takes all),
    tokens, advantages (B,), old/ref log-probs (B, T) fp32 near the policy's, a mask."""
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


def build_methods(inp, args, device):
    """name -> (forward(x) -> loss tensor, x: the leaf the backward differentiates)."""
    cfg = fastrl.LossConfig.grpo()
    T = inp["tokens"].shape[1]
    rest = {k: v for k, v in inp.items() if k != "logits"}
    # by default the loss gets a (B, T, V) tensor; --slice passes the HF-style view [:, :-1] of
    # (B, T+1, V) instead (autograd's slice backward then allocates a full-size gradient too)
    base = inp["logits"] if args.slice else inp["logits"][:, :T].contiguous()
    view = (lambda x: x[:, :T]) if args.slice else (lambda x: x)

    methods = {}
    methods["fused"] = lambda x: fastrl.policy_loss(view(x), **rest, config=cfg).loss
    methods["fused-inplace"] = lambda x: (
        fastrl.policy_loss(view(x), **rest, config=cfg, inplace=True).loss
    )
    methods["eager"] = lambda x: reference.policy_loss(view(x), **rest, config=cfg).loss
    if not args.no_compile:
        compiled = torch.compile(reference.policy_loss)
        methods["compiled"] = lambda x: compiled(view(x), **rest, config=cfg).loss
    if device.type == "cuda" and not args.no_liger:
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

            methods["liger"] = (liger, liger_logits)
        except Exception as e:  # pragma: no cover - depends on the install
            print(f"liger-kernel unavailable: {e}", file=sys.stderr)
    if args.methods:
        keep = set(args.methods.split(","))
        methods = {k: v for k, v in methods.items() if k in keep}
    return {k: (v if isinstance(v, tuple) else (v, base)) for k, v in methods.items()}


def measure_memory(forward, base, device):
    """Peak memory of one forward + backward (after a warm-up call)."""
    x = base.detach().clone().requires_grad_()

    def fwd_bwd():
        x.grad = None
        forward(x).backward()

    fwd_bwd()  # warm-up (compilation, Triton JIT, page-in)
    x.grad = None
    gc.collect()
    return peak_memory(fwd_bwd, device)


def bench_method(name, forward, base, args, device, mem):
    x = base.detach().clone().requires_grad_()

    def fwd_bwd():
        x.grad = None
        forward(x).backward()

    def fwd_only():
        forward(x)

    if mem is None:
        mem = measure_memory(forward, base, device)
    x.grad = None
    t_total = time_fn(fwd_bwd, warmup=args.warmup, rep=args.rep, device=device)
    x.grad = None
    t_fwd = time_fn(fwd_only, warmup=args.warmup, rep=args.rep, device=device)
    N, V = args.B * args.T, args.V
    nominal = 3 * N * V * base.element_size()
    row = {
        "method": name,
        "B": args.B,
        "T": args.T,
        "N": N,
        "V": V,
        "dtype": args.dtype,
        "fwd_ms": t_fwd["median"],
        "fwd_ms_q20": t_fwd["q20"],
        "fwd_ms_q80": t_fwd["q80"],
        "total_ms": t_total["median"],
        "total_ms_q20": t_total["q20"],
        "total_ms_q80": t_total["q80"],
        "bwd_ms": t_total["median"] - t_fwd["median"],
        "peak_MB": mem["bytes"] / 2**20,
        "logits_MB": N * V * base.element_size() / 2**20,
        "nominal_GB": nominal / 1e9,
        "GBs": nominal / 1e9 / (t_total["median"] / 1e3),
    }
    return row, mem["method"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when available)")
    p.add_argument("--B", type=int, default=None, help="sequences (default: 16 cpu, 128 cuda)")
    p.add_argument("--T", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument(
        "--V", type=int, default=None, help="vocabulary (default: 32000 cpu, 151936 cuda)"
    )
    p.add_argument(
        "--dtype", choices=list(DTYPES), default=None, help="default: fp32 cpu, bf16 cuda"
    )
    p.add_argument("--warmup", type=int, default=None, help="CPU: calls; CUDA: ms (do_bench)")
    p.add_argument("--rep", type=int, default=None, help="CPU: timed calls; CUDA: ms (do_bench)")
    p.add_argument(
        "--methods", default="", help="comma list of fused,fused-inplace,eager,compiled,liger"
    )
    p.add_argument("--slice", action="store_true", help="pass logits[:, :-1] views (HF style)")
    p.add_argument("--no-compile", action="store_true", help="skip torch.compile(reference)")
    p.add_argument("--no-liger", action="store_true", help="skip Liger-Kernel on CUDA")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--out", default=str(RESULTS_DIR), help="results folder")
    p.add_argument("--memory-only", action="store_true", help=argparse.SUPPRESS)
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(raw_argv)

    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    )
    cuda = device.type == "cuda"
    args.B = args.B or (128 if cuda else 16)
    args.V = args.V or (151936 if cuda else 32000)
    args.dtype = args.dtype or ("bf16" if cuda else "fp32")
    args.warmup = args.warmup if args.warmup is not None else (25 if cuda else 2)
    args.rep = args.rep if args.rep is not None else (100 if cuda else 5)

    info = device_info(device)
    inp = make_inputs(args.B, args.T, args.V, DTYPES[args.dtype], device)
    methods = build_methods(inp, args, device)
    if args.memory_only:  # child process of a CPU run: print {method: peak} as one JSON line
        mems = {name: measure_memory(fwd, base, device) for name, (fwd, base) in methods.items()}
        print(json.dumps(mems))
        return mems
    mems = {}
    if not cuda:
        print("measuring peak memory in a child process ...", file=sys.stderr, flush=True)
        mems = memory_in_child(Path(__file__).resolve(), raw_argv)
    rows, mem_method = [], ""
    for name, (forward, base) in methods.items():
        print(f"[{name}] running ...", file=sys.stderr, flush=True)
        row, mem_method = bench_method(name, forward, base, args, device, mems.get(name))
        if info["peak_bandwidth_GBs"]:
            row["pct_peak_bw"] = 100 * row["GBs"] / info["peak_bandwidth_GBs"]
        rows.append(row)
        print(
            f"{name:14s} fwd {row['fwd_ms']:9.1f} ms  total {row['total_ms']:9.1f} ms "
            f"[{row['total_ms_q20']:.1f}, {row['total_ms_q80']:.1f}]  peak {row['peak_MB']:8.1f} MB"
            f"  {row['GBs']:7.1f} GB/s",
            flush=True,
        )
    eager = next((r for r in rows if r["method"] == "eager"), None)
    if eager:
        for r in rows:
            r["speedup_vs_eager"] = eager["total_ms"] / r["total_ms"]
            r["memory_vs_eager"] = r["peak_MB"] / eager["peak_MB"] if eager["peak_MB"] else None
    meta = {
        **info,
        "benchmark": "policy_loss fwd+bwd, GRPO preset",
        "shape": {"B": args.B, "T": args.T, "V": args.V, "dtype": args.dtype, "slice": args.slice},
        "timing": "triton.testing.do_bench"
        if cuda
        else f"perf_counter, warmup {args.warmup}, rep {args.rep}",
        "memory_method": mem_method,
        "nominal_traffic": "3 * N * V * itemsize (read logits fwd + bwd, write gradient)",
    }
    name = f"bench_policy_loss_{device.type}"
    paths = write_results(name, rows, meta, Path(args.out))
    if not args.no_plot:
        title = (
            f"policy_loss fwd+bwd, GRPO, N={args.B * args.T} V={args.V} {args.dtype} on "
            f"{info['device_name'][:40]}"
        )
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
