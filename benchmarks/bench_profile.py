"""Profile: where the time of fastrl's ops and of their baselines goes, kernel by kernel, so that a
missed target can be explained from a measurement (issue 22: "the note says what the profile
shows stands in the way").

    python benchmarks/bench_profile.py --device cuda   # the issue's shapes, bf16 (about 1 min)
    python benchmarks/bench_profile.py --quick         # tiny shapes on the CPU (smoke test)
    python benchmarks/bench_profile.py --help

Workloads (the inputs and methods of the two benchmarks, imported from them):
  policy-loss   bench_policy_loss.py's GRPO loss on logits (B, T, V) = (64, 128, 151936) on CUDA:
                fastrl (the default path), fastrl-one-pass (FASTRL_ONE_PASS=1: the one-pass
                kernel, CUDA only), trl-eager, liger (CUDA only)
  fused-linear  bench_fused_linear.py's GRPO loss from hidden states and the LM head,
                N = 8192, H = 4096, V = 151936 on CUDA: fastrl-fused-linear,
                linear_logprobs+grpo, gemm-floor, trl-chunked, liger-fused-linear
Each method runs --warmup forward + backward steps, then --calls steps under torch.profiler.
On CUDA a row is one GPU kernel (its self device time); on the CPU one operator (its self CPU
time, which is a rough guide: the chunk threads' ops are attributed where the profiler sees them).

Reported, per method: step_ms = the profiled time per step summed over its kernels, floor_ms =
the bytes floor of the workload at the device's peak bandwidth (policy-loss: 1 read + 1 write of
the logits) or the gemm-floor method's step_ms (fused-linear); and its --top kernels (the rest
summed as "(other)"): calls per step, ms per step, share of step_ms.
Results: <out>/bench_profile_<device>.{json,md} (--out, default benchmarks/results/).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_fused_linear  # noqa: E402
import bench_policy_loss  # noqa: E402
import torch  # noqa: E402
from _common import (  # noqa: E402
    DTYPES,
    _pyplot,
    _save_figure,
    add_out_arg,
    check_sizes,
    device_info,
    keep_rows_on_interrupt,
    write_results,
)
from torch.profiler import ProfilerActivity, profile  # noqa: E402

POLICY_METHODS = ("fastrl", "fastrl-one-pass", "trl-eager", "liger")
LINEAR_METHODS = (
    "fastrl-fused-linear",
    "linear_logprobs+grpo",
    bench_fused_linear.FLOOR,
    "trl-chunked",
    "liger-fused-linear",
)


def policy_steps(B, T, V, dtype, device, no_liger, notes) -> dict:
    """name -> () -> one forward + backward of bench_policy_loss's method on its inputs."""
    inp = bench_policy_loss.make_inputs(B, T, V, dtype, device)
    args = types.SimpleNamespace(slice=False, methods=",".join(POLICY_METHODS), no_compile=True,
                                 no_verl=True, no_reference=True, no_liger=no_liger)  # fmt: skip
    steps = {}
    for name, (forward, base, prepare) in bench_policy_loss.build_methods(
        inp, args, device, notes
    ).items():
        x = base.detach().clone().requires_grad_()

        def step(forward=forward, x=x, prepare=prepare):
            x.grad = None
            forward(prepare(x) if prepare else x).backward()

        steps[name] = step
    return steps


def linear_steps(N, H, V, dtype, device, no_liger, notes) -> dict:
    """name -> () -> one forward + backward of bench_fused_linear's method on its inputs."""
    hidden, weight, li, full, masked = bench_fused_linear.make_inputs(N, H, V, 256, dtype, device)
    args = types.SimpleNamespace(methods=",".join(LINEAR_METHODS), no_liger=no_liger)
    h, w = bench_fused_linear.leaves(hidden, weight)
    steps = {}
    for name, fn in bench_fused_linear.build_methods(
        hidden, weight, li, full, masked, args, notes
    ).items():

        def step(fn=fn):
            h.grad = w.grad = None
            fn(h, w)

        steps[name] = step
    return steps


def profile_step(step, device, warmup: int, calls: int) -> list[dict]:
    """Kernels (CUDA) or operators (CPU) of `calls` steps: name, calls, self time (ms), all per
    step, longest first."""
    cuda = device.type == "cuda"
    for _ in range(warmup):
        step()
    if cuda:
        torch.cuda.synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(calls):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    out = []
    for e in prof.key_averages():
        if cuda:
            if e.device_type != torch.autograd.DeviceType.CUDA:
                continue
            us = e.self_device_time_total
        else:
            us = e.self_cpu_time_total
        if us > 0:
            out.append({"kernel": e.key, "calls": e.count / calls, "ms": us / 1e3 / calls})
    return sorted(out, key=lambda r: -r["ms"])


def rows_of(workload, method, shape, kernels, top, floor_ms) -> list[dict]:
    """The method's --top kernels and one "(other)" row; step_ms, share and floor_ms on each."""
    step_ms = sum(k["ms"] for k in kernels)
    head, rest = kernels[:top], kernels[top:]
    if rest:
        head = head + [{"kernel": "(other)", "calls": sum(k["calls"] for k in rest),
                        "ms": sum(k["ms"] for k in rest)}]  # fmt: skip
    return [
        dict(workload=workload, method=method, **shape, kernel=k["kernel"][:120],
             calls_per_step=round(k["calls"], 2), ms_per_step=round(k["ms"], 4),
             share=round(k["ms"] / step_ms, 4) if step_ms else None,
             step_ms=round(step_ms, 4), floor_ms=floor_ms)
        for k in head
    ]  # fmt: skip


def plot(rows: list[dict], path: Path, title: str) -> str:
    """One panel per workload: a horizontal bar per method, its kernels stacked (ms a step, the
    longest first, "(other)" last), the floor as a dashed line."""
    plt = _pyplot()
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    n_methods = len({(r["workload"], r["method"]) for r in rows})
    fig, axes = plt.subplots(len(workloads), 1, figsize=(10, 1.5 + 0.55 * n_methods),
                             squeeze=False)  # fmt: skip
    for ax, workload in zip(axes[:, 0], workloads):
        mine = [r for r in rows if r["workload"] == workload]
        methods = list(dict.fromkeys(r["method"] for r in mine))
        widest = max(r["step_ms"] for r in mine) or 1.0
        for y, method in enumerate(methods):
            left = 0.0
            for i, r in enumerate(x for x in mine if x["method"] == method):
                color = "0.75" if r["kernel"] == "(other)" else f"C{i % 10}"
                ax.barh(y, r["ms_per_step"], left=left, color=color, edgecolor="white")
                if r["ms_per_step"] > 0.15 * widest:  # name the segments wide enough to read
                    ax.text(left + r["ms_per_step"] / 2, y, r["kernel"][:28], ha="center",
                            va="center", fontsize=6, color="white")  # fmt: skip
                left += r["ms_per_step"]
            ax.text(left, y, f" {left:.2f} ms", va="center", fontsize=8)
        floor = mine[0]["floor_ms"]
        if floor:
            ax.axvline(floor, color="k", linestyle="--", linewidth=1)
            ax.text(floor, len(methods) - 0.4, " floor", fontsize=8)
        ax.set_yticks(range(len(methods)), methods, fontsize=8)
        ax.invert_yaxis()
        ax.set_xlabel("ms a step (kernels stacked, longest first; grey: the rest)")
        ax.set_title(workload, fontsize=9)
    return _save_figure(fig, path, title, dpi=110)


def markdown(rows: list[dict], meta: dict) -> str:
    what = (
        "self device time of each GPU kernel"
        if meta["device"].startswith("cuda")
        else "self CPU time of each operator"
    )
    lines = [
        f"# Profile: {meta['device_name']} ({meta['device']}), torch {meta['torch']}, triton "
        f"{meta['triton']}, commit {str(meta['git_commit'])[:12]}, {meta['time_utc']}",
        "",
        f"{meta['calls']} profiled steps per method after {meta['warmup']} warm-up steps; {what}.",
    ]
    for note in (meta.get("notes") or {}).items():
        lines.append(f"- {note[0]}: {note[1]}")
    methods = dict.fromkeys((r["workload"], r["method"]) for r in rows)
    for workload, method in methods:
        mine = [r for r in rows if (r["workload"], r["method"]) == (workload, method)]
        r0 = mine[0]
        floor = f", floor {r0['floor_ms']:.3f} ms" if r0["floor_ms"] else ""
        shape = ", ".join(f"{k}={r0[k]}" for k in ("N", "H", "V", "dtype") if k in r0)
        title = f"## {workload}: {method} ({shape}): {r0['step_ms']:.3f} ms a step{floor}"
        lines += ["", title, "", "| kernel | calls / step | ms / step | share |"]
        lines.append("|---|---|---|---|")
        for r in mine:
            share = "" if r["share"] is None else f"{100 * r['share']:.1f} %"
            lines.append(
                f"| `{r['kernel']}` | {r['calls_per_step']:g} | {r['ms_per_step']:.3f} | {share} |"
            )
    return "\n".join(lines) + "\n"


def profile_workloads(workloads, rows, notes, args, device, dtype, dtype_name, peak) -> None:
    """Profile each workload's methods into `rows` as they are done (the fused-linear ones also
    when the run is cut short: their floor comes from the gemm-floor method, profiled first)."""
    cuda = device.type == "cuda"
    if args.quick:
        (B, T, V), (N, H, VL) = (2, 16, 512), (64, 32, 512)
    elif cuda:
        (B, T, V), (N, H, VL) = (64, 128, 151936), (8192, 4096, 151936)
    else:
        (B, T, V), (N, H, VL) = (8, 128, 32000), (1024, 512, 32000)
    if "policy-loss" in workloads:
        steps = policy_steps(B, T, V, dtype, device, args.no_liger, notes)
        shape = dict(N=B * T, V=V, dtype=dtype_name)
        bytes_floor = 2 * B * T * V * dtype.itemsize  # read the logits once, write dL/dz once
        floor = round(bytes_floor / (peak * 1e9) * 1e3, 4) if peak else None
        for name, step in steps.items():
            kernels = profile_step(step, device, args.warmup, args.calls)
            rows += rows_of("policy-loss", name, shape, kernels, args.top, floor)
            print(f"policy-loss {name}: {rows[-1]['step_ms']:.3f} ms a step", flush=True)
        del steps
        gc.collect()
    if "fused-linear" in workloads:
        steps = linear_steps(N, H, VL, dtype, device, args.no_liger, notes)
        shape = dict(N=N, H=H, V=VL, dtype=dtype_name)
        results = {}
        try:
            for name, step in steps.items():
                results[name] = profile_step(step, device, args.warmup, args.calls)
                print(f"fused-linear {name}: {sum(k['ms'] for k in results[name]):.3f} ms a step",
                      flush=True)  # fmt: skip
        finally:  # also when cut short: the methods profiled so far
            floor_kernels = results.get(bench_fused_linear.FLOOR)
            floor = round(sum(k["ms"] for k in floor_kernels), 4) if floor_kernels else None
            for name, kernels in results.items():
                rows += rows_of("fused-linear", name, shape, kernels, args.top, floor)


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--quick", action="store_true", help="tiny shapes (smoke test, seconds)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES), help="default bf16 (fp32 CPU)")
    p.add_argument("--warmup", type=int, default=3, help="unprofiled steps per method first")
    p.add_argument("--calls", type=int, default=5, help="profiled steps per method")
    p.add_argument("--top", type=int, default=8, help="kernels listed per method")
    p.add_argument("--no-liger", action="store_true", help="leave out Liger's methods")
    p.add_argument(
        "--workloads",
        default="policy-loss,fused-linear",
        help="comma list of policy-loss, fused-linear",
    )
    add_out_arg(p, "bench_profile")
    args = p.parse_args(argv)
    check_sizes(p, args)
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype_name = args.dtype or ("bf16" if cuda else "fp32")
    dtype = DTYPES[dtype_name]
    for name, low in (("calls", 1), ("top", 1), ("warmup", 0)):
        if getattr(args, name) < low:
            p.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    workloads = [w for w in args.workloads.split(",") if w]
    bad = set(workloads) - {"policy-loss", "fused-linear"}
    if bad:
        p.error(f"--workloads: unknown {sorted(bad)}; expected policy-loss, fused-linear")
    meta = device_info(device)
    notes: dict = {}
    rows: list[dict] = []
    peak = meta["peak_bandwidth_GBs"] if cuda else None
    with keep_rows_on_interrupt(notes, rows):  # a stage timeout keeps the methods profiled
        profile_workloads(workloads, rows, notes, args, device, dtype, dtype_name, peak)
    meta.update(warmup=args.warmup, calls=args.calls, notes=notes,
                floor="policy-loss: 2 N V itemsize bytes at the peak bandwidth (CUDA only); "
                "fused-linear: the gemm-floor method's profiled time")  # fmt: skip
    name = f"bench_profile_{device.type}"
    paths = write_results(name, rows, meta, Path(args.out))
    title = f"where the time goes: {meta['device_name']} ({dtype_name})"
    if rows:
        paths["png"] = plot(rows, Path(args.out) / f"{name}.png", title)
    md = Path(args.out) / f"{name}.md"
    md.write_text(markdown(rows, meta))
    paths["md"] = str(md)
    print(json.dumps(paths, indent=1))
    return paths


if __name__ == "__main__":
    main()
