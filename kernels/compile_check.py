"""Compile every Triton kernel of fastrl ahead of time for sm_80 and sm_90a, without a GPU.

    python -m fastrl.kernels.compile_check                 # a table; exit status 1 on a failure
    python -m fastrl.kernels.compile_check --json          # the results as JSON on stdout

The launch configurations come from the launchers' own `*_configs` functions
(policy_loss.row_stats_configs, row_grad_configs, scale_configs, sampling.sample_rows_configs,
gae.gae_scan_configs, policy_terms.policy_terms_configs, token_grads_configs), called over a grid of shapes: V from
1000 to 262144, few rows (decode: split-V) and many, fp32 / bf16 / fp16 logits, both values of every constexpr flag (ROW_TEMP: a
scalar or a per-row temperature), two SM counts.
Identical configurations (same kernel, constexprs, warps and pointer element types: `_key`)
compile once, with the argument specialization of the first launch that chose them. Each is
compiled with `triton.compile` for each target; ptxas's own report (`-v`, the compile's log)
gives registers and spills, the compiled metadata the shared memory. A config passes when it
compiles, spills 0 bytes and its shared memory fits the architecture's limit per block. Every
entry kernel (`_*_kernel`) of every module of this package must be covered by some config: a
kernel added without one fails the check.

Results are kept in ~/.cache/fastrl/compile_check (`--no-cache` to compile everything), keyed by
all the compile depends on (triton's version, the kernel's source and the sources of the jit
functions it calls, the specialization, warps, target): a warm run takes seconds, a cold one
about a minute and a half of CPU.

Triton's interpreter (TRITON_INTERPRET=1, set by the test suite) replaces `@triton.jit`
functions by interpreted ones, which cannot be compiled: run this in a process without it (the
test runs it as a subprocess). Nothing here needs a GPU or its driver; triton's bundled ptxas
does the assembly.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import importlib
import io
import json
import os
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

# target arch -> (ptxas name, shared memory one block may use, bytes): 163 KB on sm_80 (A100),
# 227 KB on sm_90 (H100 / H200), CUDA programming guide, compute capabilities table
ARCHS = {80: ("sm_80", 163 * 1024), 90: ("sm_90a", 227 * 1024)}
# 16384: 2 splits; 50257 (GPT-2): a row stride that is no multiple of 16, so unaligned rows
VOCABS = (1000, 4096, 16384, 32000, 50257, 65536, 128256, 151936, 262144)
ROWS = (16384, 256, 64, 1)  # training, and decode (split-V below 2 * SMs rows: 2 to 32 splits)
SM_COUNTS = (132, 108)  # H100 SXM / H200, A100: the split-V heuristic depends on it
LOGIT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
GAE_STEPS = (16, 32, 64, 128, 256, 512, 1024, 4096)  # every BLOCK_T from 16 to 1024
VALUE_DTYPES = (torch.float32, torch.bfloat16)  # of the values given to gae (rewards fp32)
_DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def launcher_calls():
    """(description, LaunchConfig) of every launch the launchers choose over the shape grid."""
    from .gae import gae_scan_configs
    from .policy_loss import (
        policy_rows_configs,
        row_grad_configs,
        row_stats_configs,
        scale_configs,
    )
    from .policy_terms import policy_terms_configs, token_grads_configs
    from .sampling import sample_rows_configs

    for dtype in LOGIT_DTYPES:
        dt = _DTYPE_NAMES[dtype]
        for V in VOCABS:
            for N in ROWS:
                for row_temp in (False, True):  # a scalar or a per-row (tensor) temperature
                    rt = ", row_temp=True" if row_temp else ""
                    for sms in SM_COUNTS:
                        # (the policy loss skips masked rows, and always with shift)
                        for shift, skip in ((False, False), (True, False), (True, True)):
                            for cfg in row_stats_configs(
                                N, V, dtype, sms, row_temp=row_temp, shift=shift, skip=skip
                            ):
                                yield (
                                    f"row_stats(N={N}, V={V}, {dt}, sms={sms}{rt}, shift={shift}"
                                    f", skip={skip})",
                                    cfg,
                                )
                        for greedy in (False, True) if not row_temp else (False,):
                            for cfg in sample_rows_configs(
                                N, V, dtype, greedy, sms, row_temp=row_temp
                            ):
                                yield (
                                    f"sample_rows(N={N}, V={V}, {dt}, greedy={greedy}, "
                                    f"sms={sms}{rt})",
                                    cfg,
                                )
                    for has_h in (False, True):
                        for shift in (False, True):
                            for cfg in row_grad_configs(
                                N, V, dtype, has_h, row_temp=row_temp, has_shift=shift
                            ):
                                yield (
                                    f"row_grad_(N={N}, V={V}, {dt}, grad_entropy={has_h}{rt}, "
                                    f"shift={shift})",
                                    cfg,
                                )
                        for cfg in policy_rows_configs(N, V, dtype, has_h, row_temp=row_temp):
                            yield (
                                f"policy_rows_(N={N}, V={V}, {dt}, entropy_coef={has_h}{rt})",
                                cfg,
                            )
                for cfg in scale_configs(N, V, dtype):
                    yield f"scale_(R={N}, C={V}, {dt})", cfg
    for N in ROWS:
        for cfg in policy_terms_configs(N):
            yield f"policy_terms(N={N})", cfg
        for cfg in token_grads_configs(N):
            yield f"token_grads(N={N})", cfg
    for dtype in VALUE_DTYPES:
        for T in GAE_STEPS:
            for cfg in gae_scan_configs(64, T, torch.float32, values_dtype=dtype):
                yield f"gae_scan(B=64, T={T}, rewards fp32, values {_DTYPE_NAMES[dtype]})", cfg


def entry_kernels() -> dict[str, str]:
    """{kernel name: module} of every `@triton.jit` entry kernel (a `_*_kernel` function
    defined in a module of this package; helpers without the suffix are inlined into them)."""
    package = importlib.import_module(__package__)
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        module = importlib.import_module(f"{__package__}.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # a JITFunction / InterpretedFunction wraps `fn`
            if (
                name.startswith("_")
                and name.endswith("_kernel")
                and callable(fn)
                and fn.__module__ == module.__name__
            ):
                found[name] = module.__name__
    return found


def _example(value):
    """A launch argument triton can specialize: a small CPU tensor for a Ptr."""
    from .launch import Ptr

    if isinstance(value, Ptr):
        t = torch.empty(64, dtype=value.dtype)
        return t if value.aligned else t[1:]  # one element in: not 16-byte aligned
    return value


def specialization(cfg):
    """(signature, constexprs, attrs) of `cfg` as triton's launcher would derive them from its
    example arguments (triton's own specialization rules: 16-byte alignment, ints equal to 1)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    kernel = cfg.kernel
    consts, examples = dict(cfg.constexprs), dict(cfg.args)
    names = list(kernel.arg_names)
    if sorted(names) != sorted([*consts, *examples]):
        raise ValueError(
            f"{cfg.name}: the config names {sorted([*consts, *examples])}, the kernel takes {names}"
        )
    params = {p.name: p for p in kernel.params}
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        if name in consts:
            if not params[name].is_constexpr:
                raise ValueError(f"{cfg.name}: {name} is not a tl.constexpr")
            signature[name], constexprs[name] = "constexpr", consts[name]
            continue
        p = params[name]
        ty, spec = native_specialize_impl(
            BaseBackend,
            _example(examples[name]),
            p.is_const,
            not p.do_not_specialize,
            not p.do_not_specialize_on_alignment,
        )
        signature[name] = ty
        if ty == "constexpr":  # an int equal to 1: compiled in as a constant
            constexprs[name] = spec
        elif isinstance(spec, str):
            attrs[(i,)] = BaseBackend.parse_attr(spec)
    return signature, constexprs, attrs


def _key(cfg) -> str:
    """Identical launch configurations: the same kernel, constexprs, num_warps and pointer
    element types. How triton specializes the integer arguments (i32 or i64, a multiple of 16,
    equal to 1) is left out: the first launch in enumeration order (training shapes first)
    stands for the others."""
    signature, _, _ = specialization(cfg)
    pointers = {k: v for k, v in signature.items() if v.startswith("*")}
    return json.dumps([cfg.name, cfg.constexprs, cfg.num_warps, cfg.options, pointers], default=str)


_PTXAS = {
    "registers": re.compile(r"Used (\d+) registers"),
    "spill_stores": re.compile(r"(\d+) bytes spill stores"),
    "spill_loads": re.compile(r"(\d+) bytes spill loads"),
    "stack": re.compile(r"(\d+) bytes stack frame"),
}


def default_cache_dir() -> Path:
    """Where results are kept between runs: $FASTRL_COMPILE_CHECK_CACHE, else
    ~/.cache/fastrl/compile_check."""
    env = os.environ.get("FASTRL_COMPILE_CHECK_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fastrl" / "compile_check"


_ROW_FORMAT = 3  # the fields a kept result holds (2: ptx_fma, 3: sweeps): a change recompiles all


def _result_key(cfg, arch: int, spec) -> str:
    """Everything the compiled binary depends on: triton's version and cache-invalidating
    environment, the kernel's source and the sources of the jit functions it calls (triton's
    `cache_key` of the kernel), the specialization, num_warps and the target."""
    import triton
    from triton._C.libtriton import get_cache_invalidating_env_vars

    signature, constexprs, attrs = spec
    text = json.dumps(
        [
            _ROW_FORMAT,
            triton.__version__,
            get_cache_invalidating_env_vars(),
            cfg.kernel.cache_key,
            arch,
            cfg.num_warps,
            cfg.options,
            signature,
            sorted(constexprs.items()),
            sorted(attrs.items()),
        ],
        default=str,
    )
    return hashlib.sha256(text.encode()).hexdigest()


def compile_one(cfg, arch: int, cache_dir: Path | None = None) -> dict:
    """Compile `cfg` for `arch` (80 or 90) and read ptxas's report. With `cache_dir`, a result
    kept there for the same inputs (_result_key) is returned instead of compiling again."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    gpu, shared_limit = ARCHS[arch]
    spec = specialization(cfg)
    signature, constexprs, attrs = spec
    path = None
    if cache_dir is not None:
        path = Path(cache_dir) / f"{_result_key(cfg, arch, spec)}.json"
        if path.exists():
            with contextlib.suppress(ValueError, OSError):
                return {**json.loads(path.read_text()), "cached": True}
    row = {
        "kernel": cfg.name,
        "arch": gpu,
        "constexprs": dict(cfg.constexprs),
        "num_warps": cfg.num_warps,
        "options": dict(cfg.options),
        "signature": {k: v for k, v in signature.items() if v != "constexpr"},
        "specialized": {k: v for k, v in constexprs.items() if k not in dict(cfg.constexprs)},
        "shared_limit": shared_limit,
    }
    start = time.perf_counter()
    log = io.StringIO()
    try:
        knobs.nvidia.dump_ptxas_log = True  # ptxas -v's report, printed by the compile,
        knobs.compilation.always_compile = True  # which a hit in triton's cache would skip
        src = triton.compiler.ASTSource(cfg.kernel, signature, constexprs, attrs)
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(
                src,
                target=GPUTarget("cuda", arch, 32),
                options={"num_warps": cfg.num_warps, **dict(cfg.options)},
            )
    except Exception as e:  # noqa: BLE001 - reported per config, the run goes on
        row.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        return row
    row["seconds"] = round(time.perf_counter() - start, 3)
    text = log.getvalue()
    for field, pattern in _PTXAS.items():
        match = pattern.search(text)
        row[field] = int(match.group(1)) if match else None
    row["shared"] = int(compiled.metadata.shared)
    # fused multiply-adds in the PTX: 0 under launch.EXACT_PRODUCTS (no contraction; ptxas
    # does not fuse the .rn-rounded mul / add the compiler then emits)
    row["ptx_fma"] = compiled.asm["ptx"].count("fma.rn.f32")
    row["sweeps"] = sweeps(compiled.asm["cubin"], cfg)
    problems = []
    if row["registers"] is None:
        problems.append("no ptxas report captured")
    if row["spill_stores"] or row["spill_loads"]:
        problems.append(f"spills {row['spill_stores']} B stored / {row['spill_loads']} B loaded")
    if row["shared"] > shared_limit:
        problems.append(f"shared memory {row['shared']} B > {shared_limit} B")
    if not dict(cfg.options).get("enable_fp_fusion", True) and row["ptx_fma"]:
        problems.append(f"{row['ptx_fma']} fused multiply-adds although fp fusion is off")
    row.update(ok=not problems, error="; ".join(problems) or None)
    if path is not None and row["registers"] is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(row, default=str))
        os.replace(tmp, path)  # atomic: concurrent runs never read half a file
    return {**row, "cached": False}


_SASS_LINE = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_BRANCH = re.compile(r"^(@!?U?P\w+\s+)?BRA\s+(0x[0-9a-f]+)")


def sass(cubin: bytes) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS instruction of a compiled kernel (triton's bundled
    cuobjdump -sass; predicates kept, encodings dropped)."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run([str(tool), "-sass", str(path)], capture_output=True, text=True)
    if out.returncode != 0 or not out.stdout.strip():
        raise RuntimeError(f"{tool} -sass failed ({out.returncode}): {out.stderr[-2000:]}")
    return [(int(m[1], 16), m[2]) for m in map(_SASS_LINE.match, out.stdout.splitlines()) if m]


def _opcode(instruction: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def sweeps(cubin: bytes, cfg) -> list[dict]:
    """The innermost loops of a compiled kernel (a backward branch to a lower address, with no
    other loop inside), as the per-logit cost of its sweeps over a row: `instructions` in the
    loop body, `cold` of them skipped by a forward branch inside it (the bodies of uniform
    `if`s: the rescale when the row max grows, the one block that holds column y), `hot` = the
    rest, executed every block; per logit: hot / (BLOCK_V / (32 num_warps)) logits a thread
    handles per block, when the kernel has a BLOCK_V. `kind`: "statistics" (exponentials, no
    store), "gradient" (exponentials and stores), "store" (stores only) or "other"."""
    code = sass(cubin)
    index = {addr: i for i, (addr, _) in enumerate(code)}
    branches = []  # (from index, to index)
    for i, (_, ins) in enumerate(code):
        m = _BRANCH.match(ins)
        if m and int(m[2], 16) in index:
            branches.append((i, index[int(m[2], 16)]))
    loops = [(to, i) for i, to in branches if to < i]
    block = dict(cfg.constexprs).get("BLOCK_V")
    per_thread = block / (32 * cfg.num_warps) if block else None
    out = []
    for lo, hi in loops:
        if any(lo <= a and b <= hi and (a, b) != (lo, hi) for a, b in loops):
            continue  # not innermost
        skipped = set()  # instructions a forward branch inside the loop jumps over (once)
        for i, to in branches:
            if lo <= i < to <= hi:
                skipped.update(range(i + 1, to))
        cold = len(skipped)
        body = [_opcode(ins) for _, ins in code[lo : hi + 1]]
        mufu, stores = body.count("MUFU"), body.count("STG")
        if mufu:
            kind = "gradient" if stores else "statistics"
        else:
            kind = "store" if stores else "other"
        hot = len(body) - cold
        out.append({
            "kind": kind, "instructions": len(body), "cold": cold, "hot": hot,
            "barriers": body.count("BAR"), "mufu": mufu, "logits_per_thread": per_thread,
            "hot_per_logit": round(hot / per_thread, 2) if per_thread else None,
        })  # fmt: skip
    return out


_TASKS: list = []  # (LaunchConfig, arch, cache_dir) of this run, inherited by forked workers


def _run_task(i: int) -> dict:
    return compile_one(*_TASKS[i])


def run(archs=(80, 90), jobs: int | None = None, cache_dir: Path | None = None) -> dict:
    """Enumerate, deduplicate, compile (in `jobs` processes; results kept in `cache_dir`, None:
    compile everything) and summarize."""
    import triton

    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("TRITON_INTERPRET=1: the kernels are interpreted; unset it to compile")
    start = time.perf_counter()
    unique: dict[str, tuple] = {}  # key -> (config, [launcher calls])
    n_calls = 0
    for call, cfg in launcher_calls():
        n_calls += 1
        unique.setdefault(_key(cfg), (cfg, []))[1].append(call)
    kernels = entry_kernels()
    covered = {cfg.name for cfg, _ in unique.values()}
    _TASKS[:] = [(cfg, arch, cache_dir) for cfg, _ in unique.values() for arch in archs]
    # the longest compiles (most warps, largest blocks) first: better packing over the workers
    order = sorted(range(len(_TASKS)), key=lambda i: -_TASKS[i][0].num_warps)
    jobs = jobs or os.cpu_count() or 1
    with tempfile.TemporaryDirectory() as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # fresh: every compile runs ptxas (its report)
        if jobs > 1:
            import multiprocessing

            ctx = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
                rows = dict(zip(order, pool.map(_run_task, order)))
        else:
            rows = {i: _run_task(i) for i in order}
    results = []
    calls = [c for _, c in unique.values() for _ in archs]
    for i in range(len(_TASKS)):
        row = rows[i]
        row["launches"] = len(calls[i])
        row["example_launch"] = calls[i][0]
        results.append(row)
    uncovered = sorted(set(kernels) - covered)
    return {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "archs": [ARCHS[a][0] for a in archs],
        "kernels": kernels,
        "covered": sorted(covered),
        "uncovered": uncovered,
        "launcher_calls": n_calls,
        "unique_configs": len(unique),
        "compiles": len(results),
        "cached": sum(r.get("cached", False) for r in results),
        "failed": sum(not r["ok"] for r in results),
        "seconds": round(time.perf_counter() - start, 1),
        "ok": not uncovered and all(r["ok"] for r in results),
        "results": results,
    }


def _table(report: dict) -> str:
    lines = [
        f"triton {report['triton']}: {report['launcher_calls']} launcher calls -> "
        f"{report['unique_configs']} configs x {len(report['archs'])} archs = "
        f"{report['compiles']} compiles ({report['cached']} cached) in {report['seconds']} s; "
        f"failed {report['failed']}",
        f"{'kernel':34} {'arch':7} {'constexprs':34} {'warps':>5} {'regs':>5} {'spill':>6} "
        f"{'shared':>7}  status",
    ]
    for r in report["results"]:
        const = ",".join(f"{k}={v}" for k, v in r["constexprs"].items())
        spill = (r.get("spill_stores") or 0) + (r.get("spill_loads") or 0)
        lines.append(
            f"{r['kernel']:34} {r['arch']:7} {const:34} {r['num_warps']:>5} "
            f"{r.get('registers') or '-':>5} {spill:>6} {r.get('shared', '-'):>7}  "
            f"{'ok' if r['ok'] else 'FAIL: ' + str(r['error'])}"
        )
    if report["uncovered"]:
        lines.append(f"kernels without a launch config: {', '.join(report['uncovered'])}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument(
        "--arch", type=int, nargs="+", default=[80, 90], choices=sorted(ARCHS), help="targets"
    )
    parser.add_argument("--jobs", type=int, default=None, help="compile processes (all cores)")
    parser.add_argument(
        "--no-cache",
        action="store_true",
        help=f"compile everything (default: reuse results kept in {default_cache_dir()})",
    )
    args = parser.parse_args(argv)
    report = run(tuple(args.arch), args.jobs, None if args.no_cache else default_cache_dir())
    print(json.dumps(report, indent=1) if args.json else _table(report))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
