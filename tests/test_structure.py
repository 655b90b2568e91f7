"""The house rules that keep fastrl readable: the eager oracle (`fastrl/reference.py`) is imported
by tests and benchmarks only, never by a production module (production shares the per-token math
through `fastrl/terms.py`)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> set[str]:
    """Dotted names a module imports (relative imports resolved against fastrl's layout)."""
    pkg = ["fastrl", *path.relative_to(ROOT / "fastrl").parent.parts]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join([*base, *([node.module] if node.module else [])])
            names.add(mod)
            names |= {f"{mod}.{a.name}" for a in node.names}
    return names


def test_no_production_module_imports_the_oracle():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "fastrl").rglob("*.py")
        if p.name != "reference.py" and "fastrl.reference" in _imports(p)
    ]
    assert not offenders, f"production modules importing fastrl.reference: {offenders}"


def test_the_library_never_imports_the_trainer():
    """The loss library (top level of fastrl/, kernels/, integrations/) is imported by the
    trainer (fastrl/train/, fastrl/cli.py), never the reverse."""
    library = [p for p in (ROOT / "fastrl").glob("*.py") if p.name != "cli.py"]
    library += list((ROOT / "fastrl" / "integrations").glob("*.py"))
    offenders = {
        str(p.relative_to(ROOT)): sorted(m for m in _imports(p) if m.startswith("fastrl.train"))
        for p in library
    }
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, f"library modules importing the trainer: {offenders}"


def test_the_trainer_lives_in_its_house():
    """Rollout, tasks, rewards, checkpoints and the Trainer are in fastrl/train/ only."""
    for name in ("rollout", "tasks", "rewards", "checkpoint", "trainer"):
        assert not (ROOT / "fastrl" / f"{name}.py").exists(), name
        assert (ROOT / "fastrl" / "train" / f"{name}.py").exists(), name


def test_the_trainer_never_imports_the_drop_ins():
    """fastrl/train/, the CLI and the loss library never import the TRL / verl drop-ins
    (fastrl/integrations/), nor do the trainer's benchmarks: benchmarks/report.py leaves
    fastrl/integrations out of the code the trainer tables measure."""
    modules = [p for p in (ROOT / "fastrl").rglob("*.py") if "integrations" not in p.parts]
    offenders = [
        str(p.relative_to(ROOT)) for p in modules
        if any(m.startswith("fastrl.integrations") for m in _imports(p))
    ]  # fmt: skip
    benches = ["bench_train.py", "bench_learning.py", "_trl_learning.py", "_common.py"]
    offenders += [b for b in benches if "integrations" in (ROOT / "benchmarks" / b).read_text()]
    assert not offenders, f"importing fastrl.integrations: {offenders}"


def test_design_lists_every_loss_config_field():
    """docs/DESIGN.md's list of LossConfig fields names each field of the class, and nothing
    else (it missed seq_ratio_grad, kl_bias_ratio and rollout_is_floor)."""
    import dataclasses
    import re

    import fastrl

    design = (ROOT / "docs" / "DESIGN.md").read_text()
    start = design.index("LossConfig fields use the SPEC names:")
    paragraph = design[start : design.index("(tests/test_structure.py checks", start)]
    listed = set(re.findall(r"`(\w+)`", paragraph))
    assert listed == {f.name for f in dataclasses.fields(fastrl.LossConfig)}
