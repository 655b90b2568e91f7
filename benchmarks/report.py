"""Turn the benchmark results (benchmarks/results/*.json) into the Markdown table the README shows.

    python benchmarks/report.py            # print the tables
    python benchmarks/report.py --readme   # rewrite the README blocks between its markers

Every number comes from a results file; each table names the machine, versions and commit that
produced it. Nothing is extrapolated: a device with no results file has no row.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
# README blocks: <!-- NAME:start --> ... <!-- NAME:end -->
BLOCKS = ("train", "learning", "vs_trl", "bench", "policy_summary", "scale")


def _rel(path: Path) -> str:
    path = path.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _fmt(x, digits=1):
    return "" if x is None else f"{x:.{digits}f}"


# the baselines' packages a results file's meta records (device_info's `packages`), as shown
BASELINE_PACKAGES = ("trl", "liger-kernel", "verl", "transformers")


def _versions(meta: dict) -> str:
    """ ", trl 1.16.0, liger-kernel 0.8.5, ..." of the baselines the file's meta records (the
    installed ones), or a note that a file written before they were recorded has none."""
    packages = meta.get("packages")
    if not isinstance(packages, dict):
        return ", baseline versions not recorded"
    return "".join(f", {k} {packages[k]}" for k in BASELINE_PACKAGES if packages.get(k))


def _machine(meta: dict) -> str:
    commit = str(meta.get("git_commit", "?"))[:7]
    note = f" ({meta['peak_bandwidth_note']})" if meta.get("peak_bandwidth_note") else ""
    return (
        f"{meta.get('device_name', meta.get('device'))} ({meta.get('device')}){note}, torch "
        f"{meta.get('torch')}, triton {meta.get('triton')}{_versions(meta)}, commit {commit}, "
        f"{meta.get('time_utc')}"
    )


def _cuda(meta: dict) -> bool:
    return str(meta.get("device", "")).startswith("cuda")


def _label(method: str, meta: dict) -> str:
    """The name a table shows for a results file's row key. The key `trl-eager` (and the rows
    built on it: `matmul+trl-eager`, `trl-eager-compiled`, `trl-eager-padded`) runs TRL's logits
    helpers, selective_log_softmax + entropy_from_logits: eager torch loops on the CPU, but on
    CUDA each dispatches to TRL's own Triton kernel, so a CUDA file's rows show `trl-triton`."""
    return method.replace("trl-eager", "trl-triton") if _cuda(meta) else method


def _verl_heads(rows: list[dict]) -> str:
    """The fused-linear intro's sentence on verl's LM-head rows, where the file has them."""
    names = {r["method"] for r in rows}
    parts = []
    if "verl-fused-linear" in names:
        parts.append("`verl-fused-linear` is what verl 0.9.1's actor runs with use_fused_kernels "
                     "(its default torch backend): `FusedLinearForPPO` as verl's models build it, "
                     "512-row chunks")  # fmt: skip
    if "verl-linear-ce" in names:
        parts.append("`verl-linear-ce` its Triton backend, `linear_cross_entropy`")
    return ("; " + ", ".join(parts) + ", each then verl's own GRPO math") if parts else ""


def _trl_rows(meta: dict) -> str:
    """What the trl-eager rows of a file ran, on its device (an intro's sentence)."""
    if _cuda(meta):
        return (
            "`trl-triton` (results key `trl-eager`) is TRL 1.16's logits helpers "
            "`selective_log_softmax` + `entropy_from_logits` (under no_grad) + TRL's per-token "
            "GRPO math; on CUDA each helper dispatches to TRL's own Triton kernel "
            "(`_fused_logprob_entropy`), one launch for the log-probs and one for the entropy"
        )
    return (
        "`trl-eager` is TRL 1.16's logits helpers `selective_log_softmax` + "
        "`entropy_from_logits` (under no_grad) + TRL's per-token GRPO math; on the CPU both run "
        "their eager torch loops (per-sequence logsumexp / log_softmax, 128-row entropy chunks)"
    )


TRL_TRAINER = (
    "TRL 1.16's GRPOTrainer itself runs neither on logits: it patches the model with its fused, "
    "chunked LM head (`add_fused_lm_head` -> `ChunkedLogProbFunction`), the `trl-chunked` row "
    "of the fused-linear table"
)


def _one_sample(r: dict, key: str) -> str | None:
    """Why a timing has no spread to show: "one sample" when the row records n_samples = 1,
    "no spread recorded" when a file without n_samples has q20 = q80 = median (do_bench timed
    a single call of a row slower than its rep), else None."""
    n = r.get("n_samples") if key in ("total_ms", "median_ms") else None
    lo, hi = r.get(key + "_q20", r.get("q20_ms")), r.get(key + "_q80", r.get("q80_ms"))
    if n == 1:
        return "one sample"
    if n is None and lo is not None and lo == hi == r.get(key):
        return "no spread recorded"
    return None


def _ms(r: dict, key: str = "total_ms", sep: str = "-") -> str:
    """r[key] and its q20 / q80 (r[key + "_q20"], ...): "12.3 (12.0-12.9)"; "65.6 (one
    sample)" where there is no spread to show (_one_sample)."""
    why = _one_sample(r, key)
    if why:
        return f"{_fmt(r[key])} ({why})"
    return f"{_fmt(r[key])} ({_fmt(r.get(key + '_q20'))}{sep}{_fmt(r.get(key + '_q80'))})"


def _x(v, digits=2) -> str:
    return "" if v is None else f"{v:.{digits}f}x"


def _table(
    intro: str, columns: list[str], rows: list[list], notes: dict | None = None
) -> list[str]:
    """Markdown lines: the `intro` paragraph, a table with these column headers and one line per
    list of cells in `rows`, then a "Note: ..." paragraph per value of `notes`."""
    line = lambda cells: "| " + " | ".join(map(str, cells)) + " |"  # noqa: E731
    lines = [intro, "", line(columns), "|" + "---|" * len(columns), *map(line, rows)]
    for why in (notes or {}).values():
        lines += ["", f"Note: {why}"]
    return lines


def _policy_loss(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    if "cases" not in meta:  # results written before the multi-shape benchmark
        return _policy_loss_legacy(data)
    rates = meta.get("machine_rates") or {}
    measured = ""
    if rates.get("copy_GBs"):
        measured = (
            f" Measured on this machine: copy {rates['copy_GBs']:.1f} GB/s, exp "
            f"{rates['exp_per_s'] / 1e9:.2f} G/s ({rates.get('rates_threads')} threads); the "
            "exp floor is one exp per logit, N * V / exp rate."
        )
    base = _label("trl-eager", meta)
    verl = ""
    if any(r["method"] == "verl-eager" for r in rows):
        verl = (  # rows with n_samples: recorded since verl's own functions are called
            " `verl-eager` is verl's `logprobs_from_logits`, then verl's own "
            "`compute_policy_loss_vanilla`, `kl_penalty` and `agg_loss`."
            if any("n_samples" in r for r in rows)
            else " `verl-eager` is verl's `logprobs_from_logits`, then its policy-loss math "
            "re-implemented from verl's functions (recorded before the benchmark called them)."
        )
    intro = (
        _busy_lead(meta) + "**Policy loss on logits, forward + backward** (GRPO: clip 0.2 / 0.2, "
        f"k3 KL with beta 0.04, seq-mean-token-mean). Speed-ups and memory ratios are against "
        f"`{base}`: {_trl_rows(meta)}. {TRL_TRAINER}.{verl} `reference (oracle)` is fastrl's "
        f"readable oracle, shown for context only. Peak memory in MiB. {_machine(meta)}."
        f"{measured}"
    )
    columns = ["method", "shape", "dtype", "median ms (q20-q80)", f"vs {base}", "peak MiB"]
    columns += [f"memory vs {base}", "exp-floor ratio"]
    cells = [
        [
            _label(r["method"], meta),
            f"N={r['N']} (B={r['B']}, T={r['T']}), V={r['V']}",
            r["dtype"],
            _ms(r),
            _x(r.get("speedup_vs_trl_eager")),
            _fmt(r.get("peak_MB"), 0),
            _x(r.get("memory_vs_trl_eager")),
            _fmt(r.get("exp_floor_ratio"), 1),
        ]
        for r in rows
    ]
    return _table(intro, columns, cells, meta.get("notes"))


def _span(values: list[float], fmt: str = ".1f") -> str:
    """'a-bx' (min-max) of ratios in format `fmt`, or 'ax' when they agree at that precision."""
    lo, hi = f"{min(values):{fmt}}", f"{max(values):{fmt}}"
    return f"{lo}x" if lo == hi else f"{lo}-{hi}x"


def _policy_summary(name: str, data: dict) -> list[str]:
    """One bullet from a bench_policy_loss results file: over its cases (shape x dtype), the
    range of each fastrl row's fwd+bwd speed-up over `trl-eager` and over the fastest baseline of
    the case (`trl-eager` or any other row that is neither fastrl's nor the oracle), and of its
    peak memory against `trl-eager`'s. Written from the file, so the prose cannot drift from the
    table."""
    meta, rows = data["meta"], data["rows"]
    busy = meta.get("busy_processes") or 0
    cases: dict[tuple, list[dict]] = {}
    for r in rows:
        cases.setdefault((r["N"], r["V"], r["dtype"]), []).append(r)
    per_method: dict[str, dict[str, list[float]]] = {}
    fastest: set[str] = set()
    behind: list[str] = []  # (method, case) where a baseline was faster
    for (N, V, dtype), case_rows in cases.items():
        baselines = [r for r in case_rows if r["role"] in ("baseline", "other") and r["total_ms"]]
        if not baselines:
            continue
        best = min(baselines, key=lambda r: r["total_ms"])
        fastest.add(best["method"])
        for r in case_rows:
            if r["role"] != "fastrl" or not r["total_ms"] or r.get("speedup_vs_trl_eager") is None:
                continue
            m = per_method.setdefault(r["method"], {"trl": [], "best": [], "mem": []})
            m["trl"].append(r["speedup_vs_trl_eager"])
            m["best"].append(best["total_ms"] / r["total_ms"])
            if best["total_ms"] < r["total_ms"]:
                behind.append(
                    f"`{r['method']}` at N={N}, V={V} {dtype} (`{_label(best['method'], meta)}`)"
                )
            if r.get("memory_vs_trl_eager") is not None:
                m["mem"].append(r["memory_vs_trl_eager"])
    if not per_method:
        return []
    load = f"{busy} other process(es) keeping a core busy" if busy else "idle"
    base = _label("trl-eager", meta)
    parts = []
    for method, m in per_method.items():
        text = (
            f"`{method}` {_span(m['trl'])} over `{base}` and {_span(m['best'])} over the "
            "fastest baseline"
        )
        if m["mem"]:
            text += f", at {_span(m['mem'], '.2g')} of `{base}`'s peak memory"
        parts.append(text)
    names = ", ".join(f"`{_label(n, meta)}`" for n in sorted(fastest))
    slower = f" Slower than it: {', '.join(behind)}." if behind else ""
    return [
        f"- `{name}.json` ({meta.get('device_name', meta.get('device'))}, {load}, commit "
        f"{str(meta.get('git_commit', '?'))[:7]}; {len(cases)} cases: shape x dtype), fwd+bwd "
        f"speed-up, the range over the cases: {'; '.join(parts)} (the fastest baseline of each "
        f"case was {names}).{slower}"
    ]


def _fused_linear(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    if "cases" not in meta:  # results written before the multi-shape benchmark
        return _fused_linear_legacy(data)
    base = _label("matmul+trl-eager", meta)
    intro = (
        "**GRPO loss from hidden states and the LM-head weight, forward + backward** (gradients "
        "of both; LossConfig.grpo()). `gemm-floor` is the three bare GEMMs of the same shape "
        "(h·Wᵀ, g·W, gᵀ·h, outputs preallocated); TFLOP/s counts 6·N·H·V over the valid "
        "positions (a 90 %-masked row's masked positions cost no GEMM: its rate is n/a where the "
        f"file does not record its valid tokens); memory ratios are against `{base}` "
        f"(materialised logits, then the policy-loss table's `{_label('trl-eager', meta)}`: "
        f"{_trl_rows(meta).split(' is ', 1)[1]}). `trl-chunked` is what TRL 1.16's GRPOTrainer "
        "runs: its fused LM head's `ChunkedLogProbFunction`"
        + (" (chunk folds as TRL's Triton kernels on CUDA)" if _cuda(meta) else " (torch tiles "
           "on the CPU)")
        + _verl_heads(rows)
        + f". Peak memory in MiB. {_machine(meta)}."
    )  # fmt: skip
    columns = ["method", "N, H", "dtype", "median ms (q20-q80)", "x GEMM floor", "TFLOP/s"]
    columns += ["peak MiB", f"memory vs {base}"]
    cells = []
    for r in rows:
        if r.get("chunk_size"):  # the chunk-size sweep: its own table below
            continue
        method = _label(r["method"], meta)
        if r.get("vs_unmasked") is not None:
            method += f", {_x(r['vs_unmasked'])} unmasked"
        floor = r.get("role") == "floor"
        cells.append(
            [
                method,
                f"{r['N']}, {r['H']}",
                r["dtype"],
                _ms(r),
                _x(r.get("x_gemm_floor")),
                _tflops(r),
                "n/a (preallocated)" if floor else _fmt(r.get("peak_MB"), 0),
                "" if floor else _x(r.get("memory_vs_matmul_trl_eager")),
            ]
        )
    return _table(intro, columns, cells, meta.get("notes")) + _chunk_sweep(rows, meta)


def _tflops(r: dict) -> str:
    """The row's TFLOP/s, from the FLOPs of its valid positions: as recorded where the row holds
    `valid_tokens` (flops = 6 * valid_tokens * H * V), "n/a (masked)" for a masked row of a file
    that charged it all N positions (rates above the hardware's peak)."""
    if r.get("masked_frac") and "valid_tokens" not in r:
        return "n/a (masked)"
    return _fmt(r.get("TFLOPs"), 3)


# timed calls per row the sweep table needs before it ranks a fastest
MIN_SAMPLES_TO_RANK = 10


def _fastest(group: list[dict]) -> dict | None:
    """The row of `group` with the lowest median when it is faster beyond the spread: its q80
    below every other row's q20, and every row with MIN_SAMPLES_TO_RANK timed calls or more
    (rows without a recorded n_samples are not ranked); else None."""
    best = min(group, key=lambda r: r["total_ms"])
    if any((r.get("n_samples") or 0) < MIN_SAMPLES_TO_RANK for r in group):
        return None
    others = [r for r in group if r is not best]
    if all(best["total_ms_q80"] < r["total_ms_q20"] for r in others):
        return best
    return None


def _chunk_sweep(rows: list[dict], meta: dict | None = None) -> list[str]:
    """The rows of bench_fused_linear --chunk-sizes (chunk_size set), each (case, method) with
    its default-chunk row first (its rows per chunk from meta's cases where they say) and the
    fastest of them marked; [] when the file has none."""
    swept = [r for r in rows if r.get("chunk_size")]
    if not swept:
        return []
    groups: dict[tuple, list[dict]] = {}
    for r in swept:
        base = r["method"].removesuffix(f"[chunk={r['chunk_size']}]")
        groups.setdefault((r["N"], r["H"], r["V"], r["dtype"], base), []).append(r)
    intro = (
        "**Chunk-size sweep** (`--chunk-sizes`): the same rows with `chunk_size` = C rows per "
        "chunk, against the library's default (`chunk_size=None`); of each method and case the "
        "fastest is marked only where it is faster beyond the spread (its q80 below every other "
        f"row's q20) and every row had at least {MIN_SAMPLES_TO_RANK} timed calls; otherwise "
        "none is (the rows of a file that does not record its timed calls are not ranked)."
    )
    columns = ["method", "N, H, V", "dtype", "rows per chunk", "median ms (q20-q80)"]
    columns += ["vs default", "x GEMM floor", "TFLOP/s", "peak MiB", "fastest"]
    defaults = {
        (c["N"], c["H"], c["V"], c["dtype"]): c.get("default_chunk")
        for c in (meta or {}).get("cases", [])
    }
    cells = []
    for (N, H, V, dtype, base), group in groups.items():
        lib = defaults.get((N, H, V, dtype))
        default = next(
            (
                r
                for r in rows
                if r["method"] == base and (r["N"], r["H"], r["V"], r["dtype"]) == (N, H, V, dtype)
            ),
            None,
        )
        group = sorted(group, key=lambda r: r["chunk_size"])
        group = ([default] if default else []) + group
        best = _fastest(group)
        for r in group:
            chunk = r.get("chunk_size")
            cells.append(
                [
                    base,
                    f"{N}, {H}, {V}",
                    dtype,
                    chunk or ("default" if lib is None else f"default ({lib})"),
                    _ms(r),
                    _x(r.get("vs_default_chunk")) if chunk else "1.00x",
                    _x(r.get("x_gemm_floor")),
                    _tflops(r),
                    _fmt(r.get("peak_MB"), 0),
                    "**fastest**" if r is best else "",
                ]
            )
    return ["", *_table(intro, columns, cells)]


def _policy_loss_legacy(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    shape = meta["shape"]
    intro = (
        f"**Policy loss, forward + backward** (GRPO preset; N = {shape['B'] * shape['T']}, "
        f"V = {shape['V']}, {shape['dtype']}); {_machine(meta)}"
    )
    columns = ["method", "median ms (q20 - q80)", "vs eager", "peak MB", "memory vs eager", "GB/s"]
    cells = [
        [
            r["method"],
            _ms(r, sep=" - "),
            f"{_fmt(r.get('speedup_vs_eager'), 2)}x",
            _fmt(r.get("peak_MB"), 0),
            _fmt(r.get("memory_vs_eager"), 2),
            _fmt(r.get("GBs"), 1),
        ]
        for r in rows
    ]
    return _table(intro, columns, cells)


def _fused_linear_legacy(data: dict) -> list[str]:
    meta, rows = data["meta"], data["rows"]
    shape = meta["shape"]
    eager = next((r for r in rows if r["method"] == "linear+eager"), None)
    intro = (
        f"**Fused linear policy loss, forward + backward** (GRPO with token-mean; N = "
        f"{shape['N']}, H = {shape['H']}, V = {shape['V']}, {shape['dtype']}); {_machine(meta)}"
    )
    columns = ["method", "median ms (q20 - q80)", "TFLOP/s (6NHV)", "peak MB", "memory vs eager"]
    cells = [
        [
            r["method"],
            _ms(r, sep=" - "),
            _fmt(r["TFLOPs"], 3),
            _fmt(r["peak_MB"], 0),
            _fmt(r["peak_MB"] / eager["peak_MB"] if eager and eager["peak_MB"] else None, 2),
        ]
        for r in rows
    ]
    return _table(intro, columns, cells)


def _busy_lead(meta: dict) -> str:
    """The lead of a table timed with other processes busy (`--busy K`), else ""."""
    busy = meta.get("busy_processes") or 0
    return (
        f"**With {busy} other process(es) each keeping a core busy** (a pure-Python loop), as "
        "on a shared machine. "
        if busy
        else ""
    )


def _generic(data: dict, title: str, speed_key: str) -> list[str]:
    """One row per method: shape, median time, speed-up (`speed_key`), peak memory, and, where
    the rows carry them (the sampler, GAE), GB/s of their floor traffic and % of the bandwidth."""
    meta, rows = data["meta"], data["rows"]
    traffic = any("GBs" in r for r in rows)
    cells = [
        [
            r["method"],
            ", ".join(f"{k}={r[k]}" for k in ("B", "T", "N", "V", "dtype") if k in r),
            _median(r),
            f"{_fmt(r.get(speed_key), 2)}x",
            *([f"{_fmt(r.get('GBs'))} ({_fmt(r.get('pct_bw'))} %)"] if traffic else []),
            _fmt(r.get("peak_MB"), 0),
        ]
        for r in rows
    ]
    columns = ["method", "shape", "median ms (q20 - q80)", "speed-up"]
    columns += [f"GB/s ({_bandwidth(meta)})"] if traffic else []
    threads = f", {meta['torch_threads']} torch thread(s)" if meta.get("torch_threads") else ""
    intro = f"{_busy_lead(meta)}**{title}**; {_machine(meta)}{threads}"
    return _table(intro, [*columns, "peak MiB"], cells)


def _median(r: dict) -> str:
    """A gae / sampler row's "median (q20 - q80)" ms, or "median (one sample)" (_one_sample)."""
    why = _one_sample(
        {**r, "median_ms_q20": r["q20_ms"], "median_ms_q80": r["q80_ms"]}, "median_ms"
    )
    if why:
        return f"{_fmt(r['median_ms'])} ({why})"
    return f"{_fmt(r['median_ms'])} ({_fmt(r['q20_ms'])} - {_fmt(r['q80_ms'])})"


def _logprobs(data: dict) -> list[str]:
    """bench_logprobs: the no-grad log-probs of each method, entry by entry ("logits": GB/s of
    reading the logits once; "hidden": TFLOP/s of the one GEMM and the time over its floor),
    the speed-up over TRL's method of the entry, peak memory; skipped rows' reasons as notes."""
    meta, rows = data["meta"], data["rows"]
    first = rows[0] if rows else {}
    shape = ", ".join(f"{k} = {first[k]}" for k in ("B", "T", "V", "dtype") if k in first)
    H = next((r["H"] for r in rows if "H" in r), None)
    share = meta.get("counted_share")
    cells = []
    for r in rows:
        if "GBs" in r:
            rate = f"{_fmt(r['GBs'])} GB/s ({_fmt(r.get('pct_bw'))} %)"
        else:
            rate = f"{_fmt(r.get('TFLOPs'), 2)} TFLOP/s ({_x(r.get('x_gemm_floor'))} floor)"
        err = r.get("max_abs_err_logp")
        cells.append([r["method"], _median(r), _x(r.get("speedup_vs_trl")), rate,
                      _fmt(r.get("peak_MB"), 0), "" if err is None else f"{err:.1e}"])  # fmt: skip
    columns = ["method", "median ms (q20 - q80)", "vs TRL's", "rate", "peak MiB above inputs"]
    columns += ["max abs logp error"]
    counted = "" if share is None else f", {100 * share:.0f} % of the positions counted"
    hidden = "" if H is None else f"; H = {H} for the hidden-state entry"
    threads = f", {meta['torch_threads']} torch thread(s)" if meta.get("torch_threads") else ""
    intro = (
        f"**No-grad log-probs of pi_old / pi_ref from a padded batch** ({shape}{counted}{hidden}): "
        "`logits:` rows take the (B, T, V) logits (GB/s: reading them once, "
        f"{_bandwidth(meta)}), `hidden:` rows the last hidden states and the LM-head weight "
        "(TFLOP/s of the one GEMM, 2 N H V; `x floor`: the time over the bare GEMM's); "
        "`vs TRL's`: TRL 1.16's method of the same entry over this one; logp error: the "
        "largest |logp - exact| at counted tokens (exact: fp32 log_softmax of the logits, or "
        f"of the GEMM formed in fp32). {_machine(meta)}"
        f"{threads}"
    )
    return _table(intro, columns, cells, meta.get("notes"))


def _kernel_configs(data: dict) -> list[str]:
    """bench_kernel_configs: per vocabulary, the copy floor, the end-to-end calls and the
    fastest and slowest configuration of each kernel in the table; every row in a folded one."""
    meta, rows = data["meta"], data["rows"]

    def cells(r):
        ms = f"{r['ms']:.3f} ({r['ms_q20']:.3f}-{r['ms_q80']:.3f})"
        return [r["kind"], r["V"], r["config"], ms, _fmt(r["GBs"], 0), _x(r.get("vs_copy"))]

    head = []
    for V in dict.fromkeys(r["V"] for r in rows):
        of_v = [r for r in rows if r["V"] == V]
        for kind in dict.fromkeys(r["kind"] for r in of_v):
            group = sorted((r for r in of_v if r["kind"] == kind), key=lambda r: r["ms"])
            head += group if kind in ("floor", "e2e") else [group[0], group[-1]][: len(group)]
    columns = ["kind", "V", "configuration", "median ms (q20-q80)", "GB/s", "x copy"]
    intro = (
        f"**The logits kernels' launch configurations swept** (N = {meta.get('N')} rows, "
        f"{meta.get('dtype')}; GB/s of the bytes each must move; `x copy` against a device copy "
        f"of the logits, 1 read + 1 write; per kernel its fastest and slowest configuration, "
        f"every row below); {_machine(meta)}"
    )
    lines = _table(intro, columns, [cells(r) for r in head])
    full = _table("", columns, [cells(r) for r in rows])[1:]
    return [*lines, "", "<details><summary>every configuration</summary>", *full, "", "</details>"]


def _bandwidth(meta: dict) -> str:
    """What the % of a GB/s column is against: the device's peak or the CPU's measured copy."""
    rates = meta.get("machine_rates") or {}
    if rates.get("copy_GBs"):
        return f"% of the measured copy bandwidth, {rates['copy_GBs']:.1f} GB/s"
    if meta.get("peak_bandwidth_GBs"):
        return f"% of the {meta['peak_bandwidth_GBs']:.0f} GB/s peak"
    return "% of peak: unknown"


def _packed(data: dict) -> list[str]:
    """bench_packed: each method on the padded (S, T) and the packed (N,) layout; one table per
    dtype (a file holds fp32 and bf16 rows), H given for the fused-linear rows."""
    meta, rows = data["meta"], data["rows"]
    out: list[str] = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        of_dtype = [r for r in rows if r["dtype"] == dtype]
        r0 = of_dtype[0]
        H = next((r["H"] for r in of_dtype if r.get("H")), None)
        intro = (
            f"**Packed vs padded, {dtype}** (S = {r0['S']}, T = {r0['T']}, V = {r0['V']}"
            + (f", H = {H} for fused-linear" if H else "")
            + f", N = {r0['N']} tokens, {100 * r0['pad_frac']:.0f} % padding, fwd+bwd; "
            f"`{_label('trl-eager', meta)}` as in the policy-loss table; peak memory in MiB); "
            f"{_machine(meta)}"
        )
        columns = ["method", "layout", "dtype", "H", "median ms (q20-q80)", "packed / padded time"]
        columns += ["peak MiB above inputs", "packed / padded memory"]
        cells = []
        for r in of_dtype:
            packed = r["layout"] == "packed"
            cells.append(
                [
                    _label(r["family"], meta),
                    r["layout"],
                    r["dtype"],
                    r.get("H") or "",
                    "OOM" if r.get("oom") else _ms(r),
                    _x(1 / r["speedup_packed_vs_padded"])
                    if packed and r.get("speedup_packed_vs_padded")
                    else "",
                    _fmt(r.get("peak_MB"), 0),
                    _x(r.get("memory_packed_vs_padded")) if packed else "",
                ]
            )
        out += [*([""] if out else []), *_table(intro, columns, cells)]
    return out


def _vocab_parallel(data: dict) -> list[str]:
    """bench_vocab_parallel: P ranks with V / P weight rows each against the unsharded op."""
    meta, rows = data["meta"], data["rows"]
    shape = meta["shape"]
    intro = (
        f"**Vocab-parallel LM head** (N = {shape['N']}, H = {shape['H']}, V = {shape['V']}, "
        f"{shape['dtype']}, fwd+bwd, {meta['backend']}); {_machine(meta)}"
    )
    columns = ["op", "method", "median ms (q20-q80)", "peak MiB per rank", "memory vs unsharded"]
    columns += ["MiB communicated", "max rel. diff vs unsharded (loss / d hidden / d weight)"]
    cells = []
    for r in rows:
        sharded = r["method"] == "vocab-parallel"
        keys = ("loss_rel_diff_vs_unsharded", "grad_hidden_rel_diff", "grad_weight_rel_diff")
        diffs = (
            " / ".join("n/a" if r.get(k) is None else f"{r[k]:.1e}" for k in keys)
            if sharded
            else ""
        )
        cells.append(
            [
                r["op"],
                r["label"],
                _ms(r),
                _fmt(r.get("peak_MB"), 0),
                _x(r.get("memory_vs_unsharded")) if sharded else "",
                _fmt(r.get("comm_MB"), 2) if sharded else "",
                diffs,
            ]
        )
    return _table(intro, columns, cells)


def _training(data: dict) -> list[str]:
    """The train table: each algorithm's run as the README writes the command (seed 0), and,
    when the file holds further seeds (bench_train.py --seeds), their final accuracies with
    seed 0's: mean [min, max]."""
    m = data["machine"]
    seeds = data.get("seeds", [0])
    intro = (
        f"**`{data['command']}`** on {m['cpu']} ({m['cores']} cores), torch {data['torch']}, "
        f"commit {data['git_commit'][:7]}"
    )
    columns = ["algo", "wall (warm-up + RL)", "RL steps/s", "eval accuracy, step 0 -> last"]
    if len(seeds) > 1:
        columns += [f"last eval accuracy, seeds {', '.join(map(str, seeds))}: mean [min, max]"]
    columns += ["peak RSS MB"]
    cells = []
    for algo, r in data["runs"].items():
        row = [
            algo,
            f"{r['wall_s_total']:.0f} s",
            f"{r['rl_steps_per_s']:.1f}",
            f"{r['eval_accuracy_step0']:.3f} -> {r['eval_accuracy_final']:.3f}",
        ]
        if len(seeds) > 1:
            finals = [r["eval_accuracy_final"]]
            finals += [o["eval_accuracy_final"] for o in r["by_seed"].values()]
            mean = sum(finals) / len(finals)
            row += [f"{mean:.3f} [{min(finals):.3f}, {max(finals):.3f}]"]
        cells.append([*row, r["peak_rss_mb"]])
    return _table(intro, columns, cells)


# The code each results file measures (git pathspecs): a table whose file was recorded at a commit
# older than the last change to these paths is marked stale. `fastrl/*.py` is the loss library's
# top level (the trainer lives in fastrl/train/), less the ops the loss benchmarks never run (the
# sampler, gae, the advantage estimators, the value loss, the CLI). The smoke tests run each loss
# benchmark under tests/trace_calls.py and check that these paths name every library file it
# executes.
_NOT_LOSS_OPS = ["fastrl/gae.py", "fastrl/sampling.py", "fastrl/value.py", "fastrl/cli.py"]
_NOT_LOSS_OPS += ["fastrl/advantages.py", "kernels/gae.py", "kernels/sampling.py"]


def _library(*keep: str) -> list[str]:
    """The loss library's pathspecs, keeping the modules `keep` of _NOT_LOSS_OPS (a git
    exclude would win over any include of the same path)."""
    drop = [f":(exclude){p}" for p in _NOT_LOSS_OPS if p not in keep]
    return [":(glob)fastrl/*.py", ":(glob)kernels/*.py", *drop]


_LIBRARY = _library()
_TRAINER = ["fastrl", "kernels", ":(exclude)fastrl/integrations"]
# The benchmarks' shared harness: _common.py times every row and measures its memory (time_fn,
# cuda_calls, peak_memory, cpu_rates), _baselines.py is the code of the TRL / verl baselines. A
# change to either marks every table measured through it stale. The rule is by file, so an edit
# to _common's reporting helpers alone (plots, options, results files) marks those tables too:
# the conservative side (a stale mark asks for a rerun, it never hides one); the trainers'
# files (train_summary, learning*) take only device_info / progress from _common, not its
# timing, and are not marked by it.
_HARNESS = ["benchmarks/_common.py"]
_WITH_BASELINES = [*_HARNESS, "benchmarks/_baselines.py"]
MEASURES = {
    "bench_policy_loss": [*_LIBRARY, "benchmarks/bench_policy_loss.py", *_WITH_BASELINES],
    "bench_fused_linear": [*_LIBRARY, "benchmarks/bench_fused_linear.py", *_WITH_BASELINES],
    # (the input checks, the CPU thread pool and the backend choice are shared with the losses)
    "bench_gae": [
        *(f"fastrl/{m}.py" for m in ("_inputs", "config", "chunked", "ops", "advantages", "gae")),
        "kernels/gae.py",
        "benchmarks/bench_gae.py",
        *_HARNESS,
    ],
    "bench_sample": [
        *(f"fastrl/{m}.py" for m in ("_inputs", "config", "ops", "sampling")),
        ":(glob)kernels/s*.py",
        "benchmarks/bench_sample.py",
        *_HARNESS,
    ],
    # the trainer: the whole library but the TRL / verl drop-ins, which it never imports
    # (tests/test_structure.py checks that)
    "train_summary": [*_TRAINER, "benchmarks/bench_train.py"],
    # the trainers it runs (a change to the harness's reporting or its ablation list leaves the
    # side-by-side runs as they were; one to their settings changes settings() in the file)
    "learning_vs_trl": _TRAINER,
    "learning": [*_TRAINER, "benchmarks/bench_learning.py"],
    # (its inputs' advantages come from group_advantages)
    "bench_packed": [
        *_library("fastrl/advantages.py"),
        "benchmarks/bench_packed.py",
        *_WITH_BASELINES,
    ],
    "bench_vocab_parallel": [*_LIBRARY, "benchmarks/bench_vocab_parallel.py", *_HARNESS],
    "bench_kernel_configs": [*_LIBRARY, "benchmarks/bench_kernel_configs.py", *_HARNESS],
    "bench_logprobs": [*_LIBRARY, "benchmarks/bench_logprobs.py", *_WITH_BASELINES],
}


def _git(*args: str) -> str | None:
    import subprocess

    try:
        proc = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except OSError:
        return None
    return proc.stdout.strip() if proc.returncode == 0 else None


# Measures whose CPU recordings run the chunked torch path only: the Triton kernels (kernels/)
# are never imported there (fastrl.ops picks them for CUDA tensors or FASTRL_BACKEND=triton), so
# a kernel-only change leaves those recordings current.
_CPU_WITHOUT_KERNELS = (
    "bench_policy_loss", "bench_fused_linear", "bench_packed", "bench_vocab_parallel",
    "train_summary", "learning_vs_trl", "learning", "bench_logprobs",
)  # fmt: skip


def _recorded_on_cpu(name: str, meta: dict) -> bool:
    """The results file `name` was measured on the CPU: its `device` says so, its name ends in
    _cpu, or its machine (the trainers' files) names a CPU and no GPU."""
    machine = meta.get("machine")
    return (
        meta.get("device") == "cpu"
        or name.endswith("_cpu")
        or (isinstance(machine, dict) and "cpu" in machine and "gpu" not in machine)
    )


# The vocab-parallel path (`group=` or a DTensor lm_head weight) runs in one benchmark only; the
# others are one process with a plain weight, where fastrl.linear calls nothing of that module
# but its `is_dtensor` test.
_VOCAB_PARALLEL = "fastrl/vocab_parallel.py"
# Functions a benchmark may run in a file its MEASURES leave out (checked by the smoke tests'
# traces): a change to them alone is taken not to move its numbers.
CALLED_NOT_MEASURED = {_VOCAB_PARALLEL: ("is_dtensor",)}


def measured_paths(key: str, name: str, meta: dict) -> list[str]:
    """The paths (git pathspecs) whose changes make the results file `name` (of MEASURES `key`)
    stale: MEASURES[key], less the Triton kernels for a CPU recording of a measure that never
    runs them (_CPU_WITHOUT_KERNELS), less the vocab-parallel module for every measure but
    bench_vocab_parallel."""
    paths = MEASURES[key]
    if key in _CPU_WITHOUT_KERNELS and _recorded_on_cpu(name, meta):
        paths = [p for p in paths if p != "kernels" and not p.startswith(":(glob)kernels/")]
    if key != "bench_vocab_parallel":
        paths = [*paths, f":(exclude){_VOCAB_PARALLEL}"]
    return paths


def staleness(name: str, meta: dict) -> str | None:
    """A warning line when the results file `name` (its stem) was recorded before the last
    change to the code it measures (MEASURES), or at a commit this checkout does not know;
    None when it is current (or git is unavailable)."""
    key = next((k for k in MEASURES if name.startswith(k)), None)
    commit = str(meta.get("git_commit") or "")
    dirty = commit.endswith("-dirty")  # recorded with uncommitted edits on top of that commit
    commit = commit.removesuffix("-dirty")
    if key is None or _git("rev-parse", "--git-dir") is None:
        return None
    if not commit or _git("cat-file", "-e", f"{commit}^{{commit}}") is None:
        return (
            f"**Stale?** recorded at commit `{commit[:7] or '?'}`, which this checkout does not "
            "have: rerun the benchmark to trust these numbers."
        )
    changed = _git("rev-list", f"{commit}..HEAD", "--", *measured_paths(key, name, meta))
    if not changed:
        return (
            None
            if not dirty
            else (
                f"(recorded at commit `{commit[:7]}` with uncommitted edits in the checkout; no "
                "later commit changed the code it measures)"
            )
        )
    commits = changed.splitlines()
    return (
        f"**Stale:** recorded at commit `{commit[:7]}`; {len(commits)} later commit(s) changed "
        f"the code it measures (last `{commits[0][:7]}`). Rerun the benchmark to refresh it."
    )


def _with_staleness(name: str, data: dict, lines: list[str]) -> list[str]:
    """`lines` with the staleness warning of the results `data` (its `meta`, or its top level
    where the commit is recorded there) in front."""
    warning = staleness(name, data.get("meta") or data)
    return lines if warning is None else [warning, "", *lines]


def tables(block: str, results: Path | None = None) -> str:
    """The Markdown of one README block: "train" (train_summary.json), "learning"
    (learning.json, the table bench_learning.py wrote beside it), "vs_trl" (the same for each
    learning_vs_trl*.json of bench_learning.py --vs-trl), "policy_summary" (a bullet of ranges
    per bench_policy_loss file: the prose over the tables), "scale" (bench_packed and
    bench_vocab_parallel) or "bench" (the policy-loss, fused-linear, log-probs, GAE and sampler
    files), from
    the results files in `results` (default benchmarks/results/)."""
    results = Path(results or RESULTS)
    out: list[str] = []
    if block == "learning":
        table = results / "learning.md"
        if table.exists():
            data = json.loads((results / "learning.json").read_text())
            out += _with_staleness("learning", data, [table.read_text().rstrip()])
            out += ["", f"(from `{_rel(results / 'learning.json')}`)"]
        return "\n".join(out).rstrip() + "\n"
    if block == "vs_trl":  # the tables bench_learning.py --vs-trl wrote beside each results file
        for path in sorted(results.glob("learning_vs_trl*.json")):
            table = path.with_suffix(".md")
            if table.exists():
                data = json.loads(path.read_text())
                out += _with_staleness(path.stem, data, [table.read_text().rstrip()])
                out += ["", f"(from `{_rel(path)}`, plot `{_rel(path.with_suffix('.png'))}`)", ""]
        return "\n".join(out).rstrip() + "\n"
    if block == "scale":
        for name, render in (("bench_packed", _packed), ("bench_vocab_parallel", _vocab_parallel)):
            for path in sorted(results.glob(f"{name}_*.json")):
                data = json.loads(path.read_text())
                out += _with_staleness(path.stem, data, render(data))
                out += ["", f"(from `{_rel(path)}`)", ""]
        return "\n".join(out).rstrip() + "\n"
    if block == "policy_summary":
        for path in sorted(results.glob("bench_policy_loss_*.json")):
            data = json.loads(path.read_text())
            if "cases" in data.get("meta", {}):  # the multi-shape benchmark's files
                out += _with_staleness(path.stem, data, _policy_summary(path.stem, data))
                out += [""]
        return "\n".join(out).rstrip() + "\n"
    summary = results / "train_summary.json"
    if block == "train":
        if summary.exists():
            data = json.loads(summary.read_text())
            out += _with_staleness("train_summary", data, _training(data))
            out += ["", f"(from `{_rel(summary)}`)", ""]
        return "\n".join(out).rstrip() + "\n"
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or "rows" not in data:
            continue
        name = path.stem
        if name.startswith("bench_policy_loss"):
            lines = _policy_loss(data)
        elif name.startswith("bench_fused_linear"):
            lines = _fused_linear(data)
        elif name.startswith("bench_gae"):
            lines = _generic(
                data,
                "GAE vs the per-step loop (GB/s: reading rewards, values and the mask once and "
                "writing advantages and returns once, 17 bytes a token)",
                "speedup_vs_loop",
            )
        elif name.startswith("bench_kernel_configs"):
            lines = _kernel_configs(data)
        elif name.startswith("bench_logprobs"):
            lines = _logprobs(data)
        elif name.startswith("bench_sample"):
            lines = _generic(
                data,
                "Sampler vs multinomial + log_softmax gather (GB/s: reading the logits once, "
                "N * V * itemsize bytes, the floor of any sampler)",
                "speedup_vs_baseline",
            )
        else:
            continue
        lines = _with_staleness(name, data, lines)
        out += lines + ["", f"(from `{_rel(path)}`)", ""]
    return "\n".join(out).rstrip() + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--readme",
        action="store_true",
        help="replace the text between <!-- NAME:start --> and <!-- NAME:end --> in README.md, "
        f"for NAME in {BLOCKS}, with the tables",
    )
    parser.add_argument(
        "--results",
        default=str(RESULTS),
        help="folder of the results files (default benchmarks/results/)",
    )
    parser.add_argument(
        "--readme-path", default=str(ROOT / "README.md"), help="the README that --readme rewrites"
    )
    parser.add_argument(
        "--blocks",
        default=",".join(BLOCKS),
        help=f"comma list of the blocks to print / rewrite, from {','.join(BLOCKS)} (default: "
        "all); the others are left as they are",
    )
    args = parser.parse_args(argv)
    blocks = [b for b in args.blocks.split(",") if b]
    unknown = sorted(set(blocks) - set(BLOCKS))
    if unknown:
        raise SystemExit(f"--blocks: unknown {unknown}; choose from {list(BLOCKS)}")
    if not args.readme:
        for block in blocks:
            print(tables(block, Path(args.results)))
        return
    readme = Path(args.readme_path)
    body = readme.read_text()
    for block in blocks:
        start, end = f"<!-- {block}:start -->", f"<!-- {block}:end -->"
        if start not in body or end not in body:
            raise SystemExit(f"README.md has no {start} ... {end} block")
        head, rest = body.split(start, 1)
        _, tail = rest.split(end, 1)
        body = f"{head}{start}\n{tables(block, Path(args.results))}{end}{tail}"
    readme.write_text(body)
    print("README.md updated")


if __name__ == "__main__":
    main()
