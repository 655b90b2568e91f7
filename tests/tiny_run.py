"""A tiny `fastrl train` run for the trainer tests: 1-layer hidden-32 model, batch 4, no
warm-up, 4 new tokens (seconds on a CPU). Imported by the test modules (pytest puts tests/ on
sys.path)."""

from fastrl.train.config import TrainConfig

TINY_FIELDS = dict(
    model_hidden=32,
    model_layers=1,
    batch_size=4,
    group_size=2,
    sft_steps=0,
    eval_size=8,
    max_new_tokens=4,
    progress=False,
    num_threads=1,
    device="cpu",  # (auto would put the CPU tests on a GPU in bf16; CUDA runs ask for it)
)


def cli_args(fields: dict) -> list[str]:
    """TrainConfig fields as `fastrl train` flags."""
    return [a for k, v in fields.items() for a in ("--" + k.replace("_", "-"), str(v).lower())]


TINY = cli_args(TINY_FIELDS)

TIMING = {
    "tokens_per_s",
    "step_time_s",
    "gen_time_s",
    "reward_time_s",
    "update_time_s",
    "elapsed_s",
}
"""The metrics that time the run (they differ between two runs that compute alike)."""


def untimed(row: dict) -> dict:
    """A metrics row without its timings."""
    return {k: v for k, v in row.items() if k not in TIMING}  # the same as `fastrl train` flags


def tiny(out=None, **kw) -> TrainConfig:
    """A TrainConfig of the tiny run (2 steps) writing to `out`, with `kw` overriding."""
    base = dict(TINY_FIELDS, steps=2, **({} if out is None else {"out": str(out)}))
    if kw.get("model") is not None:  # the embedded model's size does not apply to --model
        del base["model_hidden"], base["model_layers"]
    base.update(kw)
    return TrainConfig(**base)
