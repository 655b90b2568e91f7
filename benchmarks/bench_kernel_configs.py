"""Benchmark: the logits kernels' launch configurations, swept on a GPU (what the launchers'
heuristics should choose; DESIGN, "the road to the floor").

    python benchmarks/bench_kernel_configs.py --out DIR            # CUDA: N = 16384, bf16,
                                                                   # V = 151936 then 32000
    TRITON_INTERPRET=1 python benchmarks/bench_kernel_configs.py --quick --out DIR   # CPU plumbing

Each kernel is launched through its own launcher (fastrl.kernels.policy_loss: `row_stats`,
`row_grad_`, `policy_rows_`) with its configuration replaced: the `config(...)` the launchers'
`*_configs` functions build is wrapped so that the kernel named in the sweep gets the swept
BLOCK_V, num_warps, num_stages and fp fusion (their lru caches cleared around each case), and the
one-pass kernel's persistent grid comes from FASTRL_ROWS_IN_FLIGHT (0: one program per row).
Rows (kind):
  floor          out.copy_(logits): 1 read + 1 write of the logits, the HBM floor of a fused
                 forward + backward; `read` torch.amax over the rows (1 read)
  stats          _token_stats_fwd_kernel (1 read: lse, logp, entropy, m and log s) at each config
  grad           _token_stats_bwd_kernel (1 read + 1 write: dL/dz from stored statistics, p_j
                 from m and log s: the variants the default path runs)
  one-pass       _policy_loss_fwd_kernel (GRPO with its k3 KL, no entropy bonus: the statistics,
                 then dL/dz)
                 at each config and grid P
  sample         kernels.sampling.sample_rows (Gumbel-max, one read of each row) on 256 rows
                 (split-V) and 4096 rows (a program per row) at each (BLOCK_V, warps), and at
                 the launcher's own choice
  e2e            fastrl.policy_loss(..., config="grpo") forward + backward as users call it,
                 at the launchers' own choices: `default` (FASTRL_ONE_PASS unset: the statistics
                 kernel, the O(N) Triton kernel of every token's dL/dlogp and dL/dH, the
                 gradient kernel) and `one-pass (FASTRL_ONE_PASS=1)` (the one-pass kernel), its A/B
  profile        one e2e call under torch.profiler: each CUDA kernel's count and time, and the
                 host's wall time per call against the device's (a launch-bound call shows the
                 host slower); the same for fastrl.sample on 256 rows (decode's shape); then
                 the host side of an e2e call under cProfile (`host V=...`: the functions with
                 the most self time per call, _common.host_profile), and once per run the
                 host's cost of one launch (`launch_us`: a Triton kernel that returns at once,
                 through its launcher and bare, and a small torch op; `launch_overhead`)
  fusion         the one-pass kernel at its launcher's configuration with fp fusion on and off
                 (the cost of launch.EXACT_PRODUCTS)
Each timed row: median ms (q20, q80) and n_samples by _common.time_fn on CUDA (do_bench's
method, at least 10 timed calls), GB/s of the bytes that
kernel must move (stats, sample: N V itemsize; grad, one-pass, e2e, floor: 2 N V itemsize) and
that as a
share of the `floor` row's GB/s. Rows are written as they are measured
(<out>/bench_kernel_configs_<device>.json), so a run cut at its timeout keeps what it timed.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as common  # noqa: E402
import torch  # noqa: E402
from fastrl.kernels import policy_loss as PL  # noqa: E402
from fastrl.kernels import sampling as SK  # noqa: E402

import fastrl  # noqa: E402

NAME = "bench_kernel_configs"
# (BLOCK_V, num_warps, num_stages or None for triton's default). The launchers' choices for bf16
# rows of V >= 2048: statistics (2048, 2), one-pass (2048, 4), gradient (8192, 16); before the
# first sweep every kernel ran (8192, 16) (policy_loss._launch_config / _grad_launch_config)
# (the statistics sweeps keep per-column sums since 2026-11-27: registers grow with the logits a
# thread holds, BLOCK_V / (32 warps), so the grids span 8 to 32 of them)
STATS = [(1024, 1, None), (2048, 1, None), (2048, 2, None), (2048, 4, None), (2048, 8, None),
         (4096, 2, None), (4096, 4, None), (8192, 8, None), (8192, 16, None),
         (16384, 16, None)]  # fmt: skip
GRAD = [(2048, 4, None), (4096, 4, None), (4096, 8, None), (8192, 8, None), (8192, 16, None),
        (16384, 16, None), (16384, 32, None)]  # fmt: skip
ONE_PASS = [(1024, 2, None), (2048, 2, None), (2048, 4, None), (2048, 8, None), (4096, 4, None),
            (4096, 8, None), (8192, 16, None)]  # fmt: skip
GRIDS = ["0", "1056", "264", "132"]  # FASTRL_ROWS_IN_FLIGHT: 0 = one program per row
QUICK = dict(N=8, Vs=[300], stats=[(64, 1, None), (256, 4, None)], grad=[(64, 1, None)],
             one_pass=[(64, 1, None)], grids=["0", "2"])  # fmt: skip

_OVERRIDE: dict = {}  # kernel name -> {"BLOCK_V", "num_warps", "num_stages", "fusion"}
_plain_config = PL.config  # (kernels/sampling.py imports the same launch.config)
# the sampler's sweep (BLOCK_V, num_warps): its launcher's choice today is (4096, 4) (32 logits
# a thread, the group noise laid out per thread); (4096, 8) moves that noise between threads,
# (8192, 8) and the smaller blocks run a Philox call per group instead of per 4 groups
SAMPLE = [(1024, 1, None), (2048, 2, None), (2048, 8, None), (4096, 4, None), (4096, 8, None),
          (8192, 8, None)]  # fmt: skip
SAMPLE_ROWS = (256, 4096)  # decode's few rows (split-V) and a batch (a program per row)


def _swept_config(kernel, grid, num_warps, args, *, options=(), **constexprs):
    """PL.config, with the swept kernel's BLOCK_V / num_warps / num_stages / fusion replaced."""
    o = _OVERRIDE.get(kernel.__name__)
    if o:
        constexprs["BLOCK_V"] = o["BLOCK_V"]
        num_warps = o["num_warps"]
        opts = {**dict(options), "enable_fp_fusion": o.get("fusion", False)}
        if o.get("num_stages"):
            opts["num_stages"] = o["num_stages"]
        options = tuple(opts.items())
    return _plain_config(kernel, grid, num_warps, args, options=options, **constexprs)


def _clear_caches() -> None:
    for fn in (PL._row_stats_configs, PL.row_grad_configs, PL._policy_rows_configs,
               SK._sample_rows_configs):  # fmt: skip
        fn.cache_clear()


@contextlib.contextmanager
def override(kernel: str | None, block: int = 0, warps: int = 0, stages=None, fusion=False,
             rows_in_flight: str | None = None, one_pass: str | None = None):  # fmt: skip
    """The launchers run `kernel` at (block, warps, stages, fusion), the one-pass grid at
    FASTRL_ROWS_IN_FLIGHT=rows_in_flight and FASTRL_ONE_PASS=one_pass (None: unset)."""
    saved = {k: os.environ.get(k) for k in ("FASTRL_ROWS_IN_FLIGHT", "FASTRL_ONE_PASS")}
    for key, value in (("FASTRL_ROWS_IN_FLIGHT", rows_in_flight), ("FASTRL_ONE_PASS", one_pass)):
        os.environ.pop(key, None)
        if value is not None:
            os.environ[key] = value
    if kernel is not None:
        _OVERRIDE[kernel] = {"BLOCK_V": block, "num_warps": warps, "num_stages": stages,
                             "fusion": fusion}  # fmt: skip
    _clear_caches()
    try:
        yield
    finally:
        _OVERRIDE.clear()
        _clear_caches()
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def _inputs(N: int, V: int, dtype, device):
    g = torch.Generator(device="cpu").manual_seed(0)
    logits = (torch.randn(1, N, V, generator=g) * 2).to(device, dtype)
    tokens = torch.randint(0, V, (1, N), generator=g).to(device)
    adv = torch.randn(1, N, generator=g).to(device)
    old = torch.randn(1, N, generator=g).to(device) - 5
    ref = old + 0.1 * torch.randn(1, N, generator=g).to(device)
    return logits, tokens, adv, old, ref


def _captured_terms(logits, tokens, adv, old, ref):
    """The TokenGradTerms fastrl.policy_loss hands policy_rows_ for this batch (GRPO)."""
    seen = {}
    real = PL.policy_rows_

    def spy(lg, tk, temperature, terms, out):
        seen.update(tokens=tk, temperature=temperature, terms=terms)
        return real(lg, tk, temperature, terms, out)

    PL.policy_rows_ = spy
    try:
        with override(None, one_pass="1"):
            fastrl.policy_loss(
                logits.clone().requires_grad_(), tokens, adv, old, ref, config="grpo"
            )
    finally:
        PL.policy_rows_ = real
    return seen


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", default=str(common.RESULTS_DIR), help="results folder")
    p.add_argument("--N", type=int, default=16384, help="rows (default 16384)")
    p.add_argument("--V", default="151936,32000", help="comma list of vocabulary sizes")
    p.add_argument("--warmup", type=float, default=10, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=float, default=40, help="do_bench repetitions (ms)")
    p.add_argument("--quick", action="store_true", help="tiny shapes (CPU + TRITON_INTERPRET)")
    args = p.parse_args(argv)
    common.check_sizes(p, args)
    cuda = torch.cuda.is_available() and not args.quick
    device = "cuda" if cuda else "cpu"
    if not cuda and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("needs a CUDA device, or --quick with TRITON_INTERPRET=1")
    dtype = torch.bfloat16
    N = QUICK["N"] if args.quick else args.N
    Vs = QUICK["Vs"] if args.quick else [int(v) for v in args.V.split(",")]
    stats_grid = QUICK["stats"] if args.quick else STATS
    grad_grid = QUICK["grad"] if args.quick else GRAD
    one_grid = QUICK["one_pass"] if args.quick else ONE_PASS
    grids = QUICK["grids"] if args.quick else GRIDS
    reps = (1, 2) if args.quick else (args.warmup, args.rep)
    os.environ.setdefault("FASTRL_BACKEND", "triton")
    PL.config = SK.config = _swept_config
    meta = {
        **common.device_info(device),
        "N": N,
        "dtype": "bf16",
        "timing": "_common.cuda_calls median",
    }
    notes: dict = {}
    meta["notes"] = notes
    rows: list[dict] = []
    out = Path(args.out)

    def save():
        common.write_results(f"{NAME}_{device}", rows, meta, out)

    def timed(kind, V, label, fn, nbytes, **extra):
        t = common.time_fn(fn, *reps, device=device)
        row = {"kind": kind, "V": V, "config": label, "ms": t["median"], "ms_q20": t["q20"],
               "ms_q80": t["q80"], "n_samples": t["n_samples"],
               "GBs": nbytes / t["median"] / 1e6, **extra}  # fmt: skip
        floor = next((r for r in rows if r["kind"] == "floor" and r["V"] == V), None)
        if floor is not None:
            row["vs_copy"] = row["GBs"] / floor["GBs"]
        rows.append(row)
        save()
        print(f"{kind:9} V={V:<7} {label:34} {t['median']:8.3f} ms  {row['GBs']:7.0f} GB/s"
              f"  {row.get('vs_copy', 0):5.2f} x copy", flush=True)  # fmt: skip

    with common.keep_rows_on_interrupt(notes, rows):
        if cuda:
            notes["launch_us"] = launch_overhead(device)
            print("launch_us", notes["launch_us"], flush=True)
            save()
        for V in Vs:
            _sweep_vocabulary(V, N, dtype, device, timed, notes, save,
                              (stats_grid, grad_grid, one_grid, grids))  # fmt: skip
            if cuda:
                torch.cuda.empty_cache()
    save()


def _sweep_vocabulary(V, N, dtype, device, timed, notes, save, sweep) -> None:
    """Every row of one vocabulary size (see the module docstring), in order of importance."""
    stats_grid, grad_grid, one_grid, grids = sweep
    logits, tokens, adv, old, ref = _inputs(N, V, dtype, device)
    item = logits.element_size()
    one, two = N * V * item, 2 * N * V * item
    out_buf = torch.empty_like(logits)
    timed("floor", V, "copy (1R + 1W)", lambda: out_buf.copy_(logits), two)
    timed("floor", V, "read (amax)", lambda: torch.amax(logits, -1), one)

    def e2e():
        x = logits.detach().requires_grad_()
        fastrl.policy_loss(x, tokens, adv, old, ref, config="grpo").loss.backward()

    with override(None):
        timed("e2e", V, "default", e2e, two)
    with override(None, one_pass="1"):
        timed("e2e", V, "one-pass (FASTRL_ONE_PASS=1)", e2e, two)
    if device == "cuda":
        with override(None):
            notes[f"profile V={V}"] = _profile(e2e)
        print(notes[f"profile V={V}"], flush=True)
        save()
        with override(None):
            notes[f"host V={V}"] = common.host_profile(e2e)
        print(notes[f"host V={V}"], flush=True)
        save()

        sample_rows = logits[0, :256]  # the sampler at decode's shape: few rows, one read each
        notes[f"profile sample N=256 V={V}"] = _profile(lambda: fastrl.sample(sample_rows))
        save()

    seen = _captured_terms(logits, tokens, adv, old, ref)

    def one_pass():
        PL.policy_rows_(logits, seen["tokens"], 1.0, seen["terms"], out_buf)

    # the variants the default path of a token-separable loss runs: with each row's m and log s
    logp, entropy, lse, shifted = PL.row_stats(logits, tokens, 1.0, shift=True)
    g = torch.randn_like(logp)
    for block, warps, stages in one_grid:
        for grid in grids:
            label = f"BLOCK_V={block} warps={warps} P={grid}"
            with override("_policy_loss_fwd_kernel", block, warps, stages, rows_in_flight=grid):
                timed("one-pass", V, label, one_pass, two)
    for block, warps, stages in stats_grid:
        label = f"BLOCK_V={block} warps={warps} stages={stages or 'default'}"
        with override("_token_stats_fwd_kernel", block, warps, stages):
            timed("stats", V, label, lambda: PL.row_stats(logits, tokens, 1.0, shift=True), one)
    for block, warps, stages in grad_grid:
        label = f"BLOCK_V={block} warps={warps}"
        with override("_token_stats_bwd_kernel", block, warps, stages):
            timed("grad", V, label, lambda: PL.row_grad_(
                logits, tokens, logp, lse, entropy, g, None, 1.0, out_buf, shifted
            ), two)  # fmt: skip
    # the sampler (Gumbel-max with Philox noise): N rows of the same logits, read once each
    seed = torch.zeros(1, dtype=torch.int64, device=logits.device)
    cuda = device == "cuda"
    for rows in SAMPLE_ROWS if cuda else (N,):
        part = logits[0, :rows]
        for block, warps, stages in SAMPLE if cuda else [(64, 1, None)]:
            split = SK._split_config(rows, V, block, logits.device)[0] > 1
            kernel = "_sample_split_fwd_kernel" if split else "_sample_fwd_kernel"
            with override(kernel, block, warps, stages):
                timed("sample", V, f"N={rows} BLOCK_V={block} warps={warps}",
                      lambda part=part: SK.sample_rows(part, seed, 1.0, False),
                      rows * V * item)  # fmt: skip
        with override(None):
            timed("sample", V, f"N={rows} default", lambda part=part: SK.sample_rows(
                part, seed, 1.0, False), rows * V * item)  # fmt: skip
    # the cost of launch.EXACT_PRODUCTS: today's one-pass config with fp fusion on and off
    block, warps = PL._launch_config(V)
    for fusion in (True, False):
        with override("_policy_loss_fwd_kernel", block, warps, None, fusion):
            timed("fusion", V, f"one-pass fusion={fusion}", one_pass, two)


def launch_overhead(device, calls: int = 500) -> dict:
    """The host's microseconds per launch, `calls` launches queued without a sync between them
    (the device keeps up: each kernel is a few microseconds), so the loop's wall time is the
    host's: `scale_` (the Triton kernel that returns at once when the scale is 1) through its
    launcher (kernels.scale.scale_: its config, then LaunchConfig's call), the same
    LaunchConfig called directly, the bare `kernel[grid](...)` call, and `torch.add(..., out=)`
    on 4 floats (a torch op's launch). What a call made of a few Triton kernels and a few dozen
    small torch ops costs on the host, next to its kernels' device time."""
    from fastrl.kernels import scale as SC

    grad = torch.zeros(4, 4, device=device)
    one = torch.ones(1, device=device)
    (cfg,) = SC.scale_configs(4, 4, grad.dtype)
    a, b = torch.zeros(4, device=device), torch.empty(4, device=device)
    kernel, constexprs = cfg.kernel, dict(cfg.constexprs)
    options = dict(cfg.options)
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else lambda: None

    def bare():
        kernel[cfg.grid](grad, one, 4, 4, 4, **constexprs, num_warps=cfg.num_warps, **options)

    cases = {
        "triton_via_launcher": lambda: SC.scale_(grad, one),
        "triton_launch_config": lambda: cfg(grad, one, 4, 4, 4),
        "triton_bare": bare,
        "torch_add": lambda: torch.add(a, 1.0, out=b),
    }
    out = {}
    for name, fn in cases.items():
        fn()
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        out[name] = (time.perf_counter() - t0) * 1e6 / calls
        sync()
    return out


def _profile(fn, calls: int = 5) -> dict:
    """Each CUDA kernel's count and total microseconds over `calls` calls of fn, and the host's
    wall ms per call (synchronized once at the end) against the device's kernel ms per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 1e3 / calls
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    kernels = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0 and e.count:
            kernels.append({"kernel": e.key[:80], "calls": e.count // calls, "us": us / calls})
    kernels.sort(key=lambda k: -k["us"])
    device_ms = sum(k["us"] for k in kernels) / 1e3
    return {"host_ms_per_call": wall, "device_ms_per_call": device_ms, "kernels": kernels[:20],
            "launches_per_call": sum(k["calls"] for k in kernels)}  # fmt: skip


if __name__ == "__main__":
    main()
