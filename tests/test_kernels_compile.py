"""Ready for the GPU without one (issue 18): every Triton kernel compiles ahead of time for sm_80
and sm_90a at every launch configuration its launcher can choose, without register spills and
within the architecture's shared memory per block; and the launchers launch exactly what their
`*_configs` functions return (one table of launch configurations).

No GPU is needed: `triton.compile` targets an architecture by name and triton's bundled ptxas
assembles. conftest.py sets TRITON_INTERPRET=1 for this session, under which `@triton.jit`
makes interpreted functions that cannot be compiled, so the compile runs in a subprocess
without it (`python -m fastrl.kernels.compile_check --json`). Results are kept between runs in
~/.cache/fastrl/compile_check, keyed by triton's version, the kernels' sources and the
specialization: a warm run takes seconds, a cold one a few minutes of CPU.
"""

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from bench_run import load_bench
from fastrl.kernels import gae as G
from fastrl.kernels import policy_loss as PL
from fastrl.kernels import sampling as S

ROOT = Path(__file__).resolve().parents[1]
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
needs_interpreter = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")
SHARED_LIMITS = {"sm_80": 163 * 1024, "sm_90a": 227 * 1024}


def _env() -> dict:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _compile_check(*args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "fastrl.kernels.compile_check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout)


@pytest.fixture(scope="module")
def report() -> dict:
    proc = _compile_check("--json")
    assert proc.stdout.strip(), proc.stderr[-4000:]
    out = json.loads(proc.stdout)
    assert proc.returncode == (0 if out["ok"] else 1), proc.stderr[-4000:]
    return out


def _entry_kernels_in_source() -> dict[str, str]:
    """{name: module} of every `@triton.jit` function named `*_kernel` in kernels/*.py, read
    from the source (independently of the check's own discovery by import)."""
    found = {}
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef) or not node.name.endswith("_kernel"):
                continue
            for dec in node.decorator_list:
                target = dec.func if isinstance(dec, ast.Call) else dec
                if ast.unparse(target) in ("triton.jit", "jit"):
                    found[node.name] = f"fastrl.kernels.{path.stem}"
    return found


def test_every_kernel_has_a_launch_config(report):
    """A kernel added to kernels/ without a launch config in the enumeration fails here."""
    in_source = _entry_kernels_in_source()
    assert len(in_source) >= 9
    assert report["kernels"] == in_source
    assert report["uncovered"] == []
    assert set(report["covered"]) == set(in_source)


def test_every_config_compiles_without_spills(report):
    rows = report["results"]
    assert report["archs"] == ["sm_80", "sm_90a"]
    assert len(rows) == 2 * report["unique_configs"] and report["launcher_calls"] > len(rows)
    failed = [
        f"{r['kernel']} {r['arch']} {r['constexprs']} warps={r['num_warps']} "
        f"(e.g. {r['example_launch']}): {r['error']}"
        for r in rows
        if not r["ok"]
    ]
    assert not failed, "\n".join(failed)
    for r in rows:
        assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0, r
        assert 0 < r["registers"] <= 255, r
        assert r["shared"] <= SHARED_LIMITS[r["arch"]] == r["shared_limit"], r


def test_every_config_rounds_every_product(report):
    """No launch contracts a product and a sum into one fused multiply-add
    (launch.EXACT_PRODUCTS): fused, z' - max z' at a row's maximum is the product's rounding
    error instead of 0, exp(+1e23) = inf at a temperature of 1e-30 (an H200 run; the
    interpreter rounds every operation and never showed it)."""
    for r in report["results"]:
        assert r["options"] == {"enable_fp_fusion": False}, r
        assert r["ptx_fma"] == 0, r


def test_every_launcher_choice_is_compiled(report):
    """The enumeration reaches every choice the launchers make: both values of each flag, the
    three logits dtypes, every block size, split-V and its merge at 2 to 32 splits."""
    seen: dict[str, set] = {}
    for r in report["results"]:
        key = (
            tuple(sorted(r["constexprs"].items())),
            r["num_warps"],
            r["signature"].get("logits_ptr"),
        )
        seen.setdefault(r["kernel"], set()).add(key)

    def values(kernel, name):
        return {dict(k[0])[name] for k in seen[kernel]}

    def dtypes(kernel):
        return {k[2] for k in seen[kernel]}

    logits = {"*fp32", "*bf16", "*fp16"}
    for kernel in ("_token_stats_fwd_kernel", "_token_stats_split_fwd_kernel",
                   "_token_stats_merge_fwd_kernel", "_token_stats_bwd_kernel",
                   "_policy_loss_fwd_kernel", "_sample_fwd_kernel",
                   "_sample_split_fwd_kernel"):  # fmt: skip
        assert dtypes(kernel) == logits, kernel
    for kernel in ("_token_stats_bwd_kernel", "_policy_loss_fwd_kernel"):
        assert values(kernel, "HAS_GRAD_ENTROPY") == {False, True}
        assert values(kernel, "ROW_TEMP") == {False, True}
    # the reduction sweeps' blocks stop at 2048 (policy_loss._launch_config, measured on an H200)
    assert values("_policy_loss_fwd_kernel", "BLOCK_V") == {1024, 2048}
    assert values("_sample_fwd_kernel", "GREEDY") == values("_sample_split_fwd_kernel", "GREEDY")
    assert values("_sample_fwd_kernel", "GREEDY") == {False, True}
    # one program per row: blocks of 1024, 1 warp (policy_loss._stats_launch_config, measured)
    assert values("_token_stats_fwd_kernel", "BLOCK_V") == {1024}
    assert values("_token_stats_bwd_kernel", "BLOCK_V") == {1024, 4096, 8192}
    assert values("_sample_fwd_kernel", "BLOCK_V") == {1024, 4096}
    assert values("_token_stats_merge_fwd_kernel", "BLOCK_S") == {2, 4, 8, 16, 32}
    assert values("_sample_merge_fwd_kernel", "BLOCK_S") == {2, 4, 8, 16, 32}
    assert values("_gae_fwd_kernel", "BLOCK_T") == {16, 32, 64, 128, 256, 512, 1024}
    assert {
        r["signature"]["grad_ptr"] for r in report["results"] if "grad_ptr" in r["signature"]
    } >= logits


def test_the_check_sees_spills(tmp_path):
    """Negative control: a configuration that must spill (512 fp32 values per thread) is
    reported as failing, so a passing check is not vacuous."""
    code = (
        "from fastrl.kernels import compile_check as C, policy_loss as P\n"
        "import json, torch\n"
        "(cfg,) = P.scale_configs(4, 1 << 20, torch.float32)\n"
        "cfg = cfg._replace(constexprs=(('BLOCK', 16384),), num_warps=1)\n"
        "print(json.dumps(C.compile_one(cfg, 90)))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not row["ok"] and row["spill_stores"] > 0 and "spill" in row["error"], row


# --------------------------------------------------------------------------- the committed report
def _kernel_report():
    return load_bench("kernel_report.py")


def _committed() -> dict:
    return json.loads((ROOT / "benchmarks" / "results" / "kernels_sm90.json").read_text())


def test_readme_shows_the_committed_report():
    """README's kernels_sm90 block and kernels_sm90.md are generated from kernels_sm90.json."""
    kr, data = _kernel_report(), _committed()
    readme = (ROOT / "README.md").read_text()
    block = readme.split("<!-- kernels_sm90:start -->\n", 1)[1].split("<!-- kernels_sm90:end -->")[
        0
    ]
    md_path = ROOT / "benchmarks" / "results" / "kernels_sm90.md"
    assert block == kr.readme_block(data, md_path), (
        "run python benchmarks/kernel_report.py --readme"
    )
    assert md_path.read_text() == kr.markdown(data, root="../../")
    assert "not measurements" in block and data["meta"]["all_ok"]


def test_committed_report_matches_the_kernels(report):
    """kernels_sm90.json describes today's kernels and launchers: the same configurations with the
    same registers, spills and shared memory (after changing a kernel or a launcher, rerun
    `python benchmarks/kernel_report.py --readme`)."""
    data = _committed()
    if data["meta"]["triton"] != report["triton"]:
        pytest.skip(f"report made with triton {data['meta']['triton']}, not {report['triton']}")
    fields = ("registers", "spill_stores", "spill_loads", "shared", "launches", "example_launch")

    def table(rows):
        return {
            (r["kernel"], r["arch"], json.dumps(r["constexprs"]), r["num_warps"],
             json.dumps(r["signature"])): {f: r.get(f) for f in fields}
            for r in rows
        }  # fmt: skip

    assert table(data["kernels"]) == table(report["results"]), (
        "run python benchmarks/kernel_report.py --readme"
    )


# --------------------------------------------------------------------------- one source of truth
def _as_launched(cfgs):
    """LaunchConfigs as the `launched` fixture (conftest.py) records their launches."""
    return [(c.name, c.grid, c.constexprs, c.num_warps) for c in cfgs]


@needs_interpreter
@pytest.mark.parametrize("split_chunk", [0, 64])
def test_row_stats_launches_its_configs(launched, split_chunk):
    logits, tokens = torch.randn(2, 3, 300).to(torch.bfloat16), torch.randint(0, 300, (2, 3))
    logp, entropy, lse = PL.row_stats(logits, tokens, 0.7, split_chunk=split_chunk)
    expected = PL.row_stats_configs(6, 300, torch.bfloat16, 132, split_chunk)
    assert launched == _as_launched(expected) and len(expected) == (1 if split_chunk == 0 else 2)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float() / 0.7, -1))
    launched.clear()
    g, h = torch.randn(2, 3), torch.randn(2, 3)
    PL.row_grad_(logits, tokens, logp, lse, entropy, g, h, 0.7, torch.empty_like(logits))
    assert launched == _as_launched(PL.row_grad_configs(6, 300, torch.bfloat16, True))
    launched.clear()
    grad = torch.randn(4, 5000)
    PL.scale_(grad, torch.tensor([2.0]))
    assert launched == _as_launched(PL.scale_configs(4, 5000, torch.float32))


@needs_interpreter
@pytest.mark.parametrize("shape", [(1030, 3), (2, 4096 * 600 + 7), (5, 9000)])
def test_scale_grad_covers_every_element_with_a_capped_grid(shape):
    """_scale_grad_kernel runs at most _SCALE_PROGRAMS programs, each looping over rows and column
    blocks: more rows than programs, one long row pair, a few rows; every element is scaled
    (x 2 is exact), and a scale of 1 leaves the gradient untouched."""
    from fastrl.kernels import scale as SC

    (cfg,) = SC.scale_configs(*shape, torch.float32)
    assert cfg.grid[0] * cfg.grid[1] <= SC._SCALE_PROGRAMS
    grad = torch.randn(shape)
    want = grad * 2
    PL.scale_(grad, torch.tensor([2.0]))
    assert torch.equal(grad, want)
    PL.scale_(grad, torch.tensor([1.0]))
    assert torch.equal(grad, want)


@needs_interpreter
@pytest.mark.parametrize("split_chunk", [0, 64])
@pytest.mark.parametrize("greedy", [False, True])
def test_sample_rows_launches_its_configs(launched, split_chunk, greedy):
    logits = torch.randn(3, 200)
    S.sample_rows(logits, torch.tensor([5]), 0.9, greedy, split_chunk=split_chunk)
    expected = S.sample_rows_configs(3, 200, torch.float32, greedy, 132, split_chunk)
    assert launched == _as_launched(expected)


@needs_interpreter
def test_gae_scan_launches_its_config(launched):
    rewards, values = torch.randn(2, 40), torch.randn(2, 40).to(torch.bfloat16)
    G.gae_scan(rewards, values, torch.ones(2, 40), 0.9, 0.8)
    expected = G.gae_scan_configs(2, 40, torch.float32, values_dtype=torch.bfloat16)
    assert launched == _as_launched(expected)


def test_row_sweeps_issue_few_instructions_per_logit(report):
    """The hot loops of the row sweeps, compiled for sm_90a at the byte budget's shape (bf16,
    V = 151936), stay within a per-logit instruction budget and take at most two barriers a
    block (the row max). Reducing each block to scalars, as the sweeps did before 2026-11-27,
    cost about 30 instructions a logit in the statistics sweep, 18 in the gradient sweep and
    180 in the sampler, with 12-15 barriers a block: such a loop fails here. So do the sampler's
    48 (Philox's products as two multiplies each, a select of z and a -inf mask a logit) and 43
    (Gumbel noise for every logit: a quarter of a Philox call and two log2 each); drawing a group
    of 8 columns first, then a column inside the one group that wins, it takes about 17, with
    no barrier (its group noise is laid out per thread)."""
    rows = _kernel_report().sweep_costs(report)
    launches = {r["launch"] for r in rows}
    assert len(launches) == len(_kernel_report().SWEEP_LAUNCHES), launches
    for r in rows:
        sampler = r["kernel"].startswith("_sample")
        budget = 20 if sampler else 16
        if r["sweep"] == "statistics" and not sampler:
            budget = 14
        assert r["hot_per_logit"] <= budget, r
        assert r["barriers_per_block"] <= (0 if sampler else 2), r
        # one exp2 a logit (and the rare rescale); the sampler adds, per group of 8 columns, a
        # log2 of its sum, two log2 for its noise and an exp2 to merge it: 1.5
        mufu = 1.6 if sampler else 1.25
        assert r["mufu_per_logit"] <= mufu, r
