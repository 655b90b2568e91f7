"""What a run reports: OUT/metrics.jsonl (always), OUT/tensorboard (--report-to tensorboard)
and OUT/curves.png."""

from __future__ import annotations

import json
import math
import os


def tensorboard_writer_class():
    """torch's SummaryWriter, or ValueError saying how to install the optional dependency."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as e:
        raise ValueError(
            "--report-to tensorboard needs the `tensorboard` package, which is not installed: "
            'pip install tensorboard (or, in a checkout of fastrl, pip install -e ".[tensorboard]")'
        ) from e
    return SummaryWriter


class RunLog:
    """Appends each record to metrics.jsonl (rank 0) and, with a writer, to TensorBoard."""

    def __init__(
        self, path: str, enabled: bool, tb_dir: str | None = None, purge_step: int | None = None
    ):
        """purge_step: a resumed run's first step; the TensorBoard events logged from there on
        by the run it continues are dropped (their records are rewritten)."""
        self.path, self.enabled, self.records, self.tb = path, enabled, [], None
        if enabled and tb_dir is not None:
            self.tb = tensorboard_writer_class()(log_dir=tb_dir, purge_step=purge_step)

    def __call__(self, rec: dict) -> None:
        self.records.append(rec)
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        if self.tb is not None:
            for k, v in rec.items():
                if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(f"{_group(k)}/{k}", v, rec["step"])
            self.tb.flush()

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _group(key: str) -> str:
    if key.startswith(("eval", "reward", "success")):
        return "reward"
    if key.endswith(("_time_s", "_per_s")):
        return "time"
    return "train"


def truncate_metrics(path: str, step: int, log=print) -> None:
    """Keep the records up to `step` (a resumed run rewrites what came after its checkpoint).
    A line that is not a JSON record with a step (e.g. cut short by a crash) is dropped, saying
    so with its file and line number."""
    if not os.path.exists(path):
        return
    keep = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec_step = json.loads(line)["step"]
                if not isinstance(rec_step, int):
                    raise TypeError(f"step {rec_step!r}")
            except (ValueError, KeyError, TypeError) as e:
                log(f"--resume: dropping {path}:{lineno}, not a metrics record ({e})")
                continue
            if rec_step <= step:
                keep.append(line if line.endswith("\n") else line + "\n")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(keep)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


PANELS = (
    ("reward", ("reward_mean",)),
    ("eval accuracy (greedy)", ("eval_accuracy",)),
    ("loss", ("loss",)),
    ("KL", ("kl", "approx_kl")),
    ("entropy", ("entropy",)),
    ("clip fraction", ("clipfrac_low", "clipfrac_high")),
    ("grad norm", ("grad_norm",)),
    ("learning rate", ("lr",)),
    ("response length", ("response_len",)),
    ("value loss", ("value_loss",)),
)


def _smooth(ys: list[float], alpha: float = 0.3) -> list[float]:
    """Exponential moving average (weight `alpha` on the new point), NaN-tolerant."""
    out, s = [], None
    for y in ys:
        if y is not None and math.isfinite(y):
            s = y if s is None else (1 - alpha) * s + alpha * y
        out.append(s if s is not None else float("nan"))
    return out


def plot_curves(metrics_path: str, png_path: str, title: str = "") -> None:
    """One panel per PANELS entry that has data (the raw values faint, an EMA on top; eval
    accuracy and lr unsmoothed), by RL step (matplotlib Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    panels = [(t, ks) for t, ks in PANELS if any(k in r for r in recs for k in ks)]
    cols = min(5, max(1, len(panels)))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(3.6 * cols, 2.9 * rows), squeeze=False)
    for ax in axes.flat[len(panels) :]:
        ax.set_visible(False)
    for ax, (label, keys) in zip(axes.flat, panels):
        for key in keys:
            pts = [(r["step"], r[key]) for r in recs if r.get(key) is not None]
            if not pts:
                continue
            xs, ys = zip(*pts)
            if key in ("eval_accuracy", "lr"):  # not smoothed: measured / set exactly
                ax.plot(xs, ys, marker="o" if key == "eval_accuracy" else None, ms=3, label=key)
                continue
            (line,) = ax.plot(xs, ys, alpha=0.25, lw=1)
            ax.plot(xs, _smooth(list(ys)), color=line.get_color(), lw=1.6, label=key)
        if len(keys) > 1:
            ax.legend(fontsize=7)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
