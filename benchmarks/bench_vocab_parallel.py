"""Benchmark: the vocab-parallel LM head (`group=`: each of P processes holds V / P rows of the
(V, H) weight) against the unsharded op in one process, forward + backward.

    python benchmarks/bench_vocab_parallel.py               # without CUDA: N = 1024, H = 512,
                                                            # V = 32000, fp32, P = 2 gloo
                                                            # processes
    python benchmarks/bench_vocab_parallel.py --quick       # tiny smoke run (< 40 s)
    python benchmarks/bench_vocab_parallel.py --world 2,3   # P = 2 and P = 3
    python benchmarks/bench_vocab_parallel.py --device cuda # unsharded on the GPU (the default
                                                            # with CUDA); the P rows need P
                                                            # CUDA devices (NCCL)

Workload: hidden (B, T, H) with T = --T tokens per sequence (N = B * T rows, every position
valid), weight (V, H) / sqrt(H), tokens uniform in [0, V), in the row's dtype; GRPO loss
(--config, default "grpo": LossConfig.grpo(), token-separable) with advantages (B,) and old /
reference log-probs fp32 near the policy's. Every process gets the same inputs (built once and
loaded from a temporary file); a rank of P keeps its contiguous V / P rows of the weight.
Timed: one forward + backward (gradients of hidden and of the process's weight rows).

Ops (--ops):
  policy-loss  fastrl.fused_linear_policy_loss(hidden, weight, tokens, advantages, old, ref,
               config=--config[, group=pg]).loss.backward()
  logprobs     fastrl.linear_logprobs(hidden, weight, tokens, entropy=True[, group=pg]) then
               (logp * u).sum() + (H * v).sum() with fixed random u, v: the op under a
               trainer's own loss (4 GEMMs per chunk: the backward recomputes the logits)
Methods (rows), per op:
  unsharded            the op on the whole weight in one process (no process group), once per
                       thread count: the per-rank budget of each P (one "device": what a rank
                       of P has) and the whole budget (--threads: the same machine)
  vocab-parallel P=k   k processes (torch.distributed, gloo on the CPU, NCCL on k GPUs), each
                       with V / k rows and --threads // k torch threads (the same total budget
                       split among them; more processes than cores oversubscribes, and the
                       results say so). Per timed call every rank waits at a barrier, then
                       times its own call; the row's time per call is the max over the ranks
                       (the slowest rank is the step's time)
Processes: every run (the unsharded ones too) is a fresh process from one forkserver that has
imported torch and fastrl once, so each method starts from the same state.

Reported per row:
  total_ms       forward + backward: median of the per-call max over ranks, q20 / q80
                 (total_ms_q20 / _q80); rank_ms: each rank's own median
  peak_MB        peak memory (MiB) of one forward + backward above its inputs, the max over ranks
                 (rank_peak_MB: each rank's). CPU: the process's resident-set high-water mark
                 (see benchmarks/_common.py), measured after the timing with mallopt
                 M_MMAP_THRESHOLD = 64 KiB and malloc_trim in that process (what
                 MALLOC_MMAP_THRESHOLD_=65536 does at start-up: freed tensors leave the resident
                 set at once); CUDA: max_memory_allocated delta
  comm_MB        MiB communicated per call, from fastrl.vocab_parallel's docstring: the
                 all-gather of 4 fp32 per counted row per rank (16 * N * P bytes; per chunk of
                 rows for a token-separable config, once for all rows otherwise), the all-reduce
                 of d hidden (N * H * itemsize) and the plan's all-gather of 18 int64 per rank
                 (comm_allgather_B, comm_allreduce_B, comm_plan_B); logits_MB (N * V * itemsize)
                 is what gathering the logits instead would move
  comm_ms        the same collectives alone (same sizes, same count), timed like total_ms
  TFLOPs         nominal GEMM rate over all ranks: 6 N H V (policy-loss) or 8 N H V (logprobs)
                 / total time
  speedup_vs_unsharded            unsharded total_ms at this row's threads per rank / total_ms
                                  (P devices vs one; the ideal is P)
  speedup_vs_unsharded_all_threads  unsharded total_ms at P * threads / total_ms (the same
                                  machine, one process vs P; the ideal is 1)
  memory_vs_unsharded             peak_MB (the max over ranks) / the unsharded peak_MB
  loss, loss_rel_diff_vs_unsharded, grad_hidden_rel_diff, grad_weight_rel_diff
                 the numerical check: the vocab-parallel loss (policy-loss: the loss; logprobs:
                 the objective above) and gradients (d hidden; d weight: the ranks' rows put
                 together) against the unsharded run at the same threads, as
                 max |a - b| / max |b|
Repetitions: --warmup (CPU 1, CUDA 5) untimed calls, then --rep (CPU 5, CUDA 20; --quick 1 / 3)
timed calls per row, after one call whose loss and gradients are kept for the check.
On a CUDA machine with fewer devices than P the vocab-parallel rows are skipped with a note
(and only the unsharded row runs): run --device cpu for the gloo rows. The NCCL path (P CUDA
devices, rank r on cuda:r) has not run yet (no multi-GPU machine so far).
Results: <out>/bench_vocab_parallel_<device>.{json,csv,png}.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import gc
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")
import _common as common  # noqa: E402

import fastrl  # noqa: E402
from fastrl import vocab_parallel as vp  # noqa: E402
from fastrl._linear_ops import default_chunk  # noqa: E402
from fastrl.config import resolve_config  # noqa: E402
from fastrl.terms import is_token_separable  # noqa: E402

OPS = ("policy-loss", "logprobs")
GEMMS = {"policy-loss": 6, "logprobs": 8}  # nominal flops per N H V
CPU_DEFAULT = dict(N=1024, T=256, H=512, V=32000, dtype="fp32", warmup=1, rep=5)
CUDA_DEFAULT = dict(N=8192, T=1024, H=4096, V=151936, dtype="bf16", warmup=5, rep=20)
QUICK_DEFAULT = dict(N=128, T=64, H=64, V=4096, dtype="fp32", warmup=1, rep=3)
M_MMAP_THRESHOLD = -3  # glibc mallopt parameter


# ---------------------------------------------------------------------------- inputs
def make_inputs(args, device) -> dict:
    """Everything a run needs, on the CPU (each process moves it to its device)."""
    N, T, H, V, dtype = args.N, args.T, args.H, args.V, common.DTYPES[args.dtype]
    B = N // T
    g = torch.Generator().manual_seed(args.seed)
    hidden = torch.randn(B, T, H, generator=g).to(dtype)
    weight = (torch.randn(V, H, generator=g) / H**0.5).to(dtype)
    tokens = torch.randint(0, V, (B, T), generator=g)
    logp = torch.empty(N)
    with torch.no_grad():  # the policy's log-probs in plain torch, 1024 rows at a time (a first
        w = weight.to(device)  # fastrl call here would import torch._dynamo: seconds)
        h, y = hidden.reshape(N, H), tokens.reshape(N)
        for i in range(0, N, 1024):
            z = (h[i : i + 1024].to(device) @ w.T).float().log_softmax(-1)
            logp[i : i + 1024] = z.gather(1, y[i : i + 1024, None].to(device))[:, 0].cpu()
    logp = logp.view(B, T)
    noise = lambda: 0.05 * torch.randn(B, T, generator=g)  # noqa: E731
    return dict(
        hidden=hidden,
        weight=weight,
        tokens=tokens,
        advantages=torch.randn(B, generator=g),
        old_logp=logp + noise(),
        ref_logp=logp + noise(),
        up_logp=torch.randn(B, T, generator=g) / N,
        up_entropy=0.01 * torch.randn(B, T, generator=g) / N,
    )


def shard_rows(V: int, P: int, rank: int) -> slice:
    """Rank `rank`'s contiguous rows of V split in P near-equal shards."""
    start = rank * V // P
    return slice(start, (rank + 1) * V // P)


def make_step(op: str, x: dict, hidden, weight, config: str, group):
    """() -> loss tensor of one forward + backward (gradients reset first)."""
    kw = {} if group is None else {"group": group}

    def loss_fn():
        if op == "policy-loss":
            return fastrl.fused_linear_policy_loss(
                hidden,
                weight,
                x["tokens"],
                x["advantages"],
                x["old_logp"],
                x["ref_logp"],
                config=config,
                **kw,
            ).loss
        logp, ent = fastrl.linear_logprobs(hidden, weight, x["tokens"], entropy=True, **kw)
        return (logp * x["up_logp"]).sum() + (ent * x["up_entropy"]).sum()

    def step():
        hidden.grad = weight.grad = None
        loss = loss_fn()
        loss.backward()
        return loss

    return step


def comm_plan(op: str, args, P: int, device: str) -> dict:
    """The collectives one vocab-parallel call makes (fastrl.vocab_parallel's docstring): sizes
    in bytes and how many all-gathers of (3, rows) fp32; `device` the job's ("cpu" / "cuda":
    the library's default chunk depends on it)."""
    N, itemsize = args.N, common.DTYPES[args.dtype].itemsize
    chunk = default_chunk(
        max(shard_rows(args.V, P, r).stop - shard_rows(args.V, P, r).start for r in range(P)),
        device,
    )
    per_chunk = op == "policy-loss" and is_token_separable(resolve_config(args.config, {}))
    sizes = [min(chunk, N - i) for i in range(0, N, chunk)] if per_chunk else [N]
    return {
        "allgather_rows": sizes,
        "comm_allgather_B": 4 * vp.MERGE_FLOATS * N * P,
        "comm_allreduce_B": N * args.H * itemsize,
        "comm_plan_B": 8 * vp.PLAN_INTS * P,
    }


# ---------------------------------------------------------------------------- worker processes
def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, warmup: int, rep: int, device, group) -> list[float]:
    """`rep` wall times (ms) of fn(), each after a barrier of the group (when there is one)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(rep):
        _sync(device)
        if group is not None:
            dist.barrier(group=group)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def _comm_fn(plan: dict, P: int, dtype, N: int, H: int, device, group):
    """() -> None: the collectives of one vocab-parallel call, alone."""
    mine = torch.zeros(8, dtype=torch.int64, device=device)
    table = [torch.empty_like(mine) for _ in range(P)]
    stats = {n: torch.zeros(3, n, device=device) for n in set(plan["allgather_rows"])}
    parts = {n: [torch.empty_like(t) for _ in range(P)] for n, t in stats.items()}
    dh = torch.zeros(N, H, dtype=dtype, device=device)

    def fn():
        dist.all_gather(table, mine, group=group)
        table[0].tolist()  # the plan's host read
        for n in plan["allgather_rows"]:
            dist.all_gather(parts[n], stats[n], group=group)
        dist.all_reduce(dh, group=group)

    return fn


def _trim() -> None:
    """Give the freed heap memory back to the OS (glibc malloc_trim(0); else nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _release_freed_memory() -> str:
    """Make freed tensors leave the resident set from now on (CPU peak memory): mallopt
    M_MMAP_THRESHOLD = 64 KiB (as MALLOC_MMAP_THRESHOLD_=65536 does) and malloc_trim(0)."""
    if os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return f"MALLOC_MMAP_THRESHOLD_={os.environ['MALLOC_MMAP_THRESHOLD_']}"
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(M_MMAP_THRESHOLD, 65536)
        libc.malloc_trim(0)
        return "mallopt M_MMAP_THRESHOLD=65536 + malloc_trim in the process"
    except (OSError, AttributeError):  # pragma: no cover - not glibc
        return "glibc malloc settings not available"


def _worker(rank: int, job: dict, tmp: str) -> None:
    """One process of one run: `job` names P, threads, device, ops; writes <tmp>/<id>_<rank>.json
    (times, memory, loss) and, for the check, <tmp>/<id>_<op>_<rank>.pt (gradients)."""
    P, args = job["P"], argparse.Namespace(**job["args"])
    torch.set_num_threads(job["threads"])
    if job["device"] == "cuda":
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    group = None
    if P > 1:
        dist.init_process_group(
            job["backend"],
            store=dist.FileStore(os.path.join(tmp, f"store_{job['id']}"), P),
            rank=rank,
            world_size=P,
            timeout=datetime.timedelta(seconds=300),
        )
        group = dist.group.WORLD
    try:
        x = torch.load(os.path.join(tmp, "inputs.pt"), mmap=True)
        rows = shard_rows(args.V, P, rank)
        hidden = x.pop("hidden").to(device, copy=True).requires_grad_()
        weight = x.pop("weight")[rows].to(device, copy=True).requires_grad_()
        x = {k: v.to(device, copy=True) for k, v in x.items()}
        out = {"rank": rank, "threads": torch.get_num_threads(), "rows": rows.stop - rows.start}
        steps = {}
        for op in job["ops"]:
            step = steps[op] = make_step(op, x, hidden, weight, args.config, group)
            loss = float(step().detach())  # the checked call
            if job["save"]:
                grads = {"hidden": hidden.grad.float().cpu(), "weight": weight.grad.float().cpu()}
                torch.save(grads, os.path.join(tmp, f"{job['id']}_{op}_{rank}.pt"))
            times = _timed(step, args.warmup, args.rep, device, group)
            res = {"loss": loss, "times": times}
            if group is not None:
                plan = comm_plan(op, args, P, job["device"])
                comm = _comm_fn(plan, P, hidden.dtype, args.N, args.H, device, group)
                res["comm_times"] = _timed(comm, 1, args.rep, device, group)
            out[op] = res
        hidden.grad = weight.grad = None
        if args.memory != "none":  # after the timing: it changes the malloc settings
            how = _release_freed_memory() if device.type == "cpu" else ""
            for op, step in steps.items():
                step()
                hidden.grad = weight.grad = None
                gc.collect()
                if device.type == "cpu":
                    _trim()
                if group is not None:
                    dist.barrier(group=group)
                mem = common.peak_memory(step, device)
                hidden.grad = weight.grad = None
                if device.type == "cpu":
                    mem["method"] = mem["method"].split(" (")[0] + f" ({how})"
                out[op]["memory"] = mem
        with open(os.path.join(tmp, f"{job['id']}_{rank}.json"), "w") as f:
            json.dump(out, f)
    finally:
        if group is not None:
            dist.destroy_process_group()


def run_job(job: dict, tmp: str) -> list[dict]:
    """Start the job's P processes from the forkserver, wait, return each rank's results."""
    mp.start_processes(_worker, args=(job, tmp), nprocs=job["P"], start_method="forkserver")
    return [json.loads(Path(tmp, f"{job['id']}_{r}.json").read_text()) for r in range(job["P"])]


# ---------------------------------------------------------------------------- rows
NUMERICS = ("loss_rel_diff_vs_unsharded", "grad_hidden_rel_diff", "grad_weight_rel_diff")


def _stats(per_rank: list[list[float]]) -> dict:
    """Median / q20 / q80 of the per-call max over ranks, and n_samples (calls)."""
    calls = [max(ts) for ts in zip(*per_rank)]
    return {**common.quantiles(calls), "n_samples": len(calls)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def make_rows(job: dict, results: list[dict], args, tmp: str) -> list[dict]:
    P, rows = job["P"], []
    label = (
        f"unsharded ({job['threads']} thr)"
        if P == 1
        else f"vocab-parallel P={P} ({job['threads']} thr/rank)"
    )
    if job["device"] == "cuda":
        label = "unsharded" if P == 1 else f"vocab-parallel P={P}"
    for op in job["ops"]:
        t = _stats([r[op]["times"] for r in results])
        mems = [r[op].get("memory") for r in results]
        row = {
            "op": op,
            "method": "unsharded" if P == 1 else "vocab-parallel",
            "label": label,
            "P": P,
            "threads": job["threads"],
            "total_threads": P * job["threads"],
            "N": args.N,
            "T": args.T,
            "H": args.H,
            "V": args.V,
            "V_per_rank": [r["rows"] for r in results],
            "dtype": args.dtype,
            "config": args.config if op == "policy-loss" else None,
            "warmup": args.warmup,
            "rep": args.rep,
            "total_ms": t["median"],
            "total_ms_q20": t["q20"],
            "total_ms_q80": t["q80"],
            "n_samples": t["n_samples"],
            "rank_ms": [statistics.median(r[op]["times"]) for r in results],
            "peak_MB": None if None in mems else max(m["bytes"] for m in mems) / 2**20,
            "rank_peak_MB": None if None in mems else [m["bytes"] / 2**20 for m in mems],
            "memory_method": None if None in mems else mems[0]["method"],
            "loss": results[0][op]["loss"],
            "logits_MB": args.N * args.V * common.DTYPES[args.dtype].itemsize / 2**20,
            "TFLOPs": GEMMS[op] * args.N * args.H * args.V / 1e12 / (t["median"] / 1e3),
        }
        if P > 1:
            plan = comm_plan(op, args, P, job["device"])
            c = _stats([r[op]["comm_times"] for r in results])
            row.update({k: v for k, v in plan.items() if k.startswith("comm_")})
            row["comm_MB"] = sum(v for k, v in plan.items() if k.startswith("comm_")) / 2**20
            row["allgathers_per_call"] = len(plan["allgather_rows"])
            row.update(comm_ms=c["median"], comm_ms_q20=c["q20"], comm_ms_q80=c["q80"])
        rows.append(row)
    return rows


def check_numerics(rows: list[dict], jobs: list[dict], tmp: str) -> None:
    """loss / gradient differences of each vocab-parallel row against the unsharded run at the
    same threads per rank (whose gradients were kept)."""
    ref_job = {(j["threads"]): j for j in jobs if j["P"] == 1 and j["save"]}
    for row in rows:
        if row["method"] != "vocab-parallel":
            continue
        job = next(j for j in jobs if j["P"] == row["P"])
        ref = ref_job.get(row["threads"]) or next(iter(ref_job.values()))
        want = torch.load(Path(tmp, f"{ref['id']}_{row['op']}_0.pt"))
        got = [torch.load(Path(tmp, f"{job['id']}_{row['op']}_{r}.pt")) for r in range(row["P"])]
        base = next(
            r
            for r in rows
            if r["method"] == "unsharded"
            and r["op"] == row["op"]
            and r["threads"] == ref["threads"]
        )
        row["loss_rel_diff_vs_unsharded"] = abs(row["loss"] - base["loss"]) / max(
            abs(base["loss"]), 1e-30
        )
        row["grad_hidden_rel_diff"] = max(_rel(g["hidden"], want["hidden"]) for g in got)
        row["grad_weight_rel_diff"] = _rel(torch.cat([g["weight"] for g in got]), want["weight"])


def add_ratios(rows: list[dict], cuda: bool) -> None:
    def unsharded(op, threads):
        for r in rows:
            if r["method"] == "unsharded" and r["op"] == op and (cuda or r["threads"] == threads):
                return r
        return None

    for r in rows:
        if r["method"] != "vocab-parallel":
            continue
        one, same = unsharded(r["op"], r["threads"]), unsharded(r["op"], r["total_threads"])
        r["speedup_vs_unsharded"] = one["total_ms"] / r["total_ms"] if one else None
        r["speedup_vs_unsharded_all_threads"] = (
            same["total_ms"] / r["total_ms"] if same and not cuda else None
        )
        r["memory_vs_unsharded"] = (
            r["peak_MB"] / one["peak_MB"]
            if one and r["peak_MB"] is not None and one["peak_MB"]
            else None
        )


# ---------------------------------------------------------------------------- main
def build_parser():
    p = common.bench_parser(
        "bench_vocab_parallel.py",
        __doc__,
        "cpu (gloo processes on the CPU), cuda (the unsharded row on the GPU; the "
        "vocab-parallel rows only with P CUDA devices, over NCCL) or auto (default: cuda when "
        "available)",
    )
    p.add_argument(
        "--N",
        type=int,
        default=None,
        help="rows (tokens) per call (default CPU 1024, CUDA 8192, --quick 128)",
    )
    p.add_argument(
        "--T",
        type=int,
        default=None,
        help="tokens per sequence; N must be a multiple (default CPU 256, CUDA 1024, --quick 64)",
    )
    p.add_argument(
        "--H", type=int, default=None, help="hidden size (default CPU 512, CUDA 4096, --quick 64)"
    )
    p.add_argument(
        "--V",
        type=int,
        default=None,
        help="vocabulary: the weight's rows (default CPU 32000, CUDA 151936, --quick 4096)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=list(common.DTYPES),
        help="hidden / weight dtype (default CPU fp32, CUDA bf16)",
    )
    p.add_argument(
        "--world",
        default="2",
        help="comma list of process counts P >= 2, one vocab-parallel row each "
        "(default 2; e.g. 2,3)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="the CPU thread budget: the unsharded process gets it all (one row) and "
        "--threads // P (one row per P); each vocab-parallel rank --threads // P "
        "(at least 1). Default: the cores this process may run on",
    )
    p.add_argument(
        "--ops",
        default=",".join(OPS),
        help="comma list of ops: policy-loss (fused_linear_policy_loss), logprobs "
        "(linear_logprobs with entropy) (default both)",
    )
    p.add_argument(
        "--config",
        default="grpo",
        help="LossConfig preset of the policy-loss op (default grpo; gspo takes the "
        "sequence-level path: one all-gather for all rows)",
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="untimed calls before the timed ones (default CPU 1, CUDA 5)",
    )
    p.add_argument(
        "--rep",
        type=int,
        default=None,
        help="timed calls per row (default CPU 5, CUDA 20, --quick 3)",
    )
    p.add_argument(
        "--memory",
        choices=("inline", "none"),
        default="inline",
        help="peak memory: 'inline' measures it in each process after its timing "
        "(default), 'none' skips it",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs (default 0)")
    common.add_run_args(
        p,
        "bench_vocab_parallel",
        "tiny smoke run: N=128 (T=64), H=64, V=4096, fp32, 1 warm-up and 3 timed calls "
        "(unless other options say otherwise); for tests",
        memory_only=False,
    )
    return p


def resolve(args, device) -> list[int]:
    """Fill the defaults that depend on the device and --quick; returns the world sizes."""
    defaults = (
        QUICK_DEFAULT if args.quick else CUDA_DEFAULT if device.type == "cuda" else CPU_DEFAULT
    )
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    args.T = min(args.T, args.N)
    if args.N % args.T:
        raise SystemExit(f"--N {args.N} is not a multiple of --T {args.T}")
    worlds = sorted({int(w) for w in args.world.split(",") if w})
    if not worlds or worlds[0] < 2:
        raise SystemExit(f"--world: process counts must be >= 2, got {args.world!r}")
    ops = [o for o in args.ops.split(",") if o]
    bad = [o for o in ops if o not in OPS]
    if bad or not ops:
        raise SystemExit(f"--ops: unknown {bad}; choose from {list(OPS)}")
    args.ops = ops
    resolve_config(args.config, {})  # a bad preset name fails here, not in the workers
    if args.threads is None:
        args.threads = (
            len(os.sched_getaffinity(0))
            if hasattr(os, "sched_getaffinity")
            else (os.cpu_count() or 1)
        )
    return worlds


def plan_jobs(args, device, worlds, notes) -> list[dict]:
    cuda = device.type == "cuda"
    shared = {
        "device": device.type,
        "ops": args.ops,
        "args": {
            k: getattr(args, k)
            for k in ("N", "T", "H", "V", "dtype", "config", "warmup", "rep", "memory")
        },
    }
    jobs = []
    per_rank = {P: max(1, args.threads // P) for P in worlds}
    if cuda:
        jobs.append({**shared, "P": 1, "threads": args.threads, "save": True})
    else:
        for t in sorted(set(per_rank.values()) | {args.threads}):
            jobs.append({**shared, "P": 1, "threads": t, "save": t in per_rank.values()})
    n_gpus = torch.cuda.device_count() if cuda else 0
    for P in worlds:
        if cuda and n_gpus < P:
            notes[f"vocab-parallel P={P}"] = (
                f"skipped: vocab-parallel P={P} needs {P} CUDA devices (NCCL, one rank per "
                f"device), this machine has {n_gpus}; `--device cpu` runs it over gloo on the CPU"
            )
            continue
        threads = args.threads if cuda else per_rank[P]
        if not cuda and P * threads > args.threads:
            notes[f"vocab-parallel P={P}"] = (
                f"oversubscribed: {P} processes x {threads} thread(s) on a budget of "
                f"{args.threads} thread(s)"
            )
        jobs.append(
            {
                **shared,
                "P": P,
                "threads": threads,
                "save": True,
                "backend": "nccl" if cuda else "gloo",
            }
        )
    for i, j in enumerate(jobs):
        j["id"] = f"job{i}"
    return jobs


def main(argv=None):
    args, device = common.parse_bench_args(build_parser(), argv)
    cuda = device.type == "cuda"
    worlds = resolve(args, device)
    notes: dict[str, str] = {}
    jobs = plan_jobs(args, device, worlds, notes)
    for why in notes.values():
        print(why, file=sys.stderr, flush=True)
    info = common.device_info(device)
    # torch._dynamo: torch imports it at a custom op's first call; torch.distributed.tensor:
    # fastrl's DTensor check imports it (seconds each, in every process otherwise)
    preload = ["torch", "torch._dynamo", "torch.distributed.tensor", "fastrl", _worker.__module__]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    rows: list[dict] = []
    bar = common.progress(len(jobs), "bench_vocab_parallel", disable=args.no_progress)
    with tempfile.TemporaryDirectory(prefix="bench_vp_") as tmp:
        torch.save(make_inputs(args, device), os.path.join(tmp, "inputs.pt"))
        if cuda:
            torch.cuda.empty_cache()  # the GPU to the worker processes
        with common.keep_rows_on_interrupt(notes, rows):  # a stage timeout: keep the jobs done
            for job in jobs:
                what = f"P={job['P']}" if job["P"] > 1 else "unsharded"
                bar.set_postfix_str(f"{what}, {job['threads']} thread(s)")
                job_rows = make_rows(job, run_job(job, tmp), args, tmp)
                rows += job_rows
                for r in job_rows:
                    bar.write(
                        f"{r['op']:12s} {r['label']:34s} {r['total_ms']:9.2f} ms "
                        f"[{r['total_ms_q20']:.2f}, {r['total_ms_q80']:.2f}]  peak "
                        + ("n/a" if r["peak_MB"] is None else f"{r['peak_MB']:.1f} MiB")
                        + (f"  comm {r['comm_ms']:.2f} ms" if "comm_ms" in r else "")
                    )
                bar.update()
        if "interrupted" in notes:  # the numerics need every job's files: not checked
            for r in rows:
                if r["method"] == "vocab-parallel":
                    r.update(dict.fromkeys(NUMERICS))
        else:
            check_numerics(rows, jobs, tmp)
    bar.close()
    add_ratios(rows, cuda)
    for r in rows:
        if r["method"] == "vocab-parallel":
            print(
                f"{r['op']:12s} P={r['P']}: x{_fmt(r['speedup_vs_unsharded'])} vs unsharded at "
                f"{r['threads']} thread(s), x{_fmt(r['speedup_vs_unsharded_all_threads'])} vs "
                f"unsharded at {r['total_threads']}; memory per rank "
                f"x{_fmt(r['memory_vs_unsharded'])}; {r['comm_MB']:.2f} MiB communicated; "
                "loss rel diff / grads: " + " / ".join(_fmt(r[k], ".1e") for k in NUMERICS),
                file=sys.stderr,
            )

    meta = {
        **info,
        "benchmark": "vocab-parallel LM head (P processes, V / P weight rows each) vs the "
        "unsharded op, forward + backward",
        "ops": {
            "policy-loss": f"fastrl.fused_linear_policy_loss(config={args.config!r})",
            "logprobs": "fastrl.linear_logprobs(entropy=True), objective "
            "(logp * u).sum() + (H * v).sum()",
        },
        "shape": {k: getattr(args, k) for k in ("N", "T", "H", "V", "dtype")},
        "worlds": worlds,
        "thread_budget": args.threads,
        "threads_per_rank": {str(P): max(1, args.threads // P) for P in worlds},
        "backend": "nccl" if cuda else "gloo",
        "processes": "fresh processes from one forkserver (torch, fastrl preloaded)",
        "timing": f"perf_counter per call after a barrier, max over ranks; warmup {args.warmup}, "
        f"rep {args.rep}",
        "memory": args.memory,
        "communication": f"per call: all-gather of {vp.MERGE_FLOATS} fp32 per row per rank "
        f"({4 * vp.MERGE_FLOATS} N P B), all-reduce of d hidden (N H itemsize B), the plan's "
        f"all-gather of {vp.PLAN_INTS} int64 per rank",
        "seed": args.seed,
        "env": common.run_env(),
        "notes": notes,
    }
    paths = common.save_cases(
        f"bench_vocab_parallel_{device.type}",
        rows,
        meta,
        args,
        lambda r: f"{r['op']}: N={r['N']}, H={r['H']}, V={r['V']}, {r['dtype']}",
        [
            (
                "total_ms",
                "fwd+bwd ms (median of max over ranks, q20-q80)",
                ("total_ms_q20", "total_ms_q80"),
            ),
            ("peak_MB", "peak memory per process (MiB)"),
            ("comm_ms", "the collectives alone (ms)"),
        ],
        "vocab-parallel LM head vs unsharded",
        label="label",
    )
    print(paths)
    return rows


def _fmt(v, spec: str = ".2f") -> str:
    return "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:{spec}}"


if __name__ == "__main__":
    main()
