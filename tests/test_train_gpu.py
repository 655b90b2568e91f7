"""`fastrl train` end to end on the device the run is given: the tiny run (tests/tiny_run.py)
through the CLI, for each algorithm, on the CPU here and on CUDA under `pytest -m gpu` (bf16,
the CUDA default). The CUDA run never ran before a GPU session found `--device cuda` failing at
once (torch.cuda.set_device refused a device without an index): every CUDA-only line of the
trainer (device choice, bf16, the CUDA sampler generator, checkpoints) runs here."""

from __future__ import annotations

import math

import pytest
from tiny_run import TINY

from fastrl.cli import main
from fastrl.train.trainer import read_metrics

DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.gpu),
    pytest.param("auto", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("algo", ["grpo", "ppo", "dapo"])
def test_fastrl_train_runs_end_to_end(tmp_path, capsys, algo, device):
    if device == "auto" and algo != "grpo":
        pytest.skip("--device auto: one algorithm is enough")
    out = tmp_path / "run"
    argv = ["train", *TINY, "--algo", algo, "--steps", "2", "--save-every", "1",
            "--device", device, "--out", str(out)]  # fmt: skip
    rc = main(argv)
    text, err = capsys.readouterr()
    assert rc == 0, text + err
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        keys = ["loss", "sampler_logp_gap"]
        if algo != "dapo" or r["kept_groups"] > 0:  # (dynamic sampling may keep no group of
            keys += ["grad_norm", "entropy"]  # the untrained tiny model's: no update then)
        for key in keys:
            assert r[key] is not None and math.isfinite(r[key]), (key, r)
        # the sampler's log-prob of a token against the trainer's recomputed one (pi_old):
        # rounding of two forwards, not a different distribution
        assert abs(r["sampler_logp_gap"]) < 0.5, r
    assert (out / "checkpoints" / "step-000002" / "hf").is_dir()
    # and it resumes on the same device
    rc = main(["train", "--resume", str(out), "--steps", "3", "--device", device])
    text, err = capsys.readouterr()
    assert rc == 0, text + err
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl"))] == [0, 1, 2, 3]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_resumed_optimizer_keeps_its_step_on_the_cpu(tmp_path, device):
    """optimizer.pt is loaded on the CPU: load_state_dict moves Adam's moments to the
    parameters' device but leaves `step` where it was loaded, and a CUDA step made AdamW sync
    with the host twice per parameter tensor on every step of a resumed run (found in review)."""
    import tiny_run

    from fastrl.train.trainer import Trainer

    out = tmp_path / "run"
    Trainer(tiny_run.tiny(out, steps=1, save_every=1, device=device), log=lambda *a: None).train()
    resumed = Trainer(tiny_run.tiny(out, steps=2, resume=str(out), device=device),
                      log=lambda *a: None)  # fmt: skip
    resumed.setup()  # (loads the checkpoint: what train() does first)
    states = list(resumed.state.opt.state.values())
    assert states and all(s["step"].device.type == "cpu" for s in states)
    assert all(s["exp_avg"].device.type == device for s in states)
