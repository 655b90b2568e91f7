"""What `fastrl train` writes can be trusted: a checkpoint corrupted in place (same size, still
parseable) is never resumed from silently (SHA256SUMS); an export reloads with the tokenizer the
model was trained with, token for token; checkpoints get the modes of the umask, not owner-only
ones; and old checkpoints are removed only as --save-total-limit says, each removal printed."""

import json
import os
import shutil
import stat
import subprocess

import pytest
import tiny_run
import torch

from fastrl.cli import main
from fastrl.train import checkpoint as ckpt_io
from fastrl.train.config import TrainConfig
from fastrl.train.rollout import load_model
from fastrl.train.trainer import Trainer, read_metrics


def tiny(out, **kw) -> TrainConfig:
    return tiny_run.tiny(out, **{"eval_every": 100, **kw})


def ckpt_dirs(out) -> list[str]:
    return sorted(d for d in os.listdir(out / "checkpoints") if d.startswith("step-"))


@pytest.fixture(scope="module")
def two_step_run(tmp_path_factory):
    """A finished 2-step run with checkpoints at steps 1 and 2 (copied by each test)."""
    out = tmp_path_factory.mktemp("pristine") / "run"
    Trainer(tiny(out, steps=2, save_every=1), log=lambda *a: None).train()
    return out


def _overwrite_4k_in_the_middle(path) -> None:
    """Zero 4 KiB in the middle of `path` (weights): same size, still parseable, finite."""
    size = path.stat().st_size
    assert size > 3 * 4096, size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        assert f.read(4096) != b"\0" * 4096  # the bytes change
        f.seek(size // 2)
        f.write(b"\0" * 4096)
    assert path.stat().st_size == size


# ----------------------------------------------------------------------- checksums
def test_a_same_size_corruption_is_never_resumed_from(two_step_run, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    _overwrite_4k_in_the_middle(out / "checkpoints" / "step-000002" / "policy.safetensors")
    rc = main(["train", "--resume", str(out), "--steps", "3", "--progress", "false"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "step-000002/policy.safetensors: SHA-256 mismatch" in text, text
    assert "fell back to" in text and "step-000001 at step 1" in text
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl"))] == [0, 1, 2, 3]
    # the list is sha256sum's format (`sha256sum -c` checks a copy by hand), of every file
    step3 = out / "checkpoints" / "step-000003"
    if shutil.which("sha256sum"):
        subprocess.run(["sha256sum", "-c", "--quiet", "SHA256SUMS"], cwd=step3, check=True)
    listed = (step3 / "SHA256SUMS").read_text().splitlines()
    assert {line.split("  ", 1)[1] for line in listed} >= {
        "state.json",
        "optimizer.pt",
        "policy.safetensors",
        "ref.safetensors",
        "hf/model.safetensors",
        "hf/config.json",
        "hf/tokenizer.json",
    }


def test_no_intact_checkpoint_refuses_and_a_missing_list_is_corruption(
    two_step_run, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    _overwrite_4k_in_the_middle(out / "checkpoints" / "step-000002" / "ref.safetensors")
    (out / "checkpoints" / "step-000001" / "SHA256SUMS").unlink()  # state.json says it had one
    rc = main(["train", "--resume", str(out), "--steps", "3", "--progress", "false"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "no intact checkpoint to resume from" in err
    assert "step-000002/ref.safetensors: SHA-256 mismatch" in err
    assert "step-000001/SHA256SUMS: missing" in err


def test_a_corrupt_export_is_called_out_but_the_training_state_resumes(
    two_step_run, tmp_path, capsys
):
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    _overwrite_4k_in_the_middle(out / "checkpoints" / "step-000002" / "hf" / "model.safetensors")
    rc = main(["train", "--resume", str(out), "--steps", "3", "--progress", "false"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "step-000002 at step 2" in text  # resuming does not read the export
    assert "warning: " in text and "step-000002/hf/model.safetensors: SHA-256 mismatch" in text


def _as_if_sampled_on_cuda(ckpt, record_device: bool) -> None:
    """Make `ckpt`'s sampler generator state what a CUDA run saves (16 bytes: Philox seed and
    offset), with or without the device an older fastrl did not record, and re-list the sums."""
    path = ckpt / "state.json"
    state = json.loads(path.read_text())
    rng = state["rng"]
    assert len(rng["generators"]["sample"]) == 5056  # saved on the CPU
    rng["generators"]["sample"] = list(range(16))
    if record_device:
        rng["generator_devices"]["sample"] = "cuda"
    else:
        rng.pop("generator_devices", None)
    path.write_text(json.dumps(state))
    ckpt_io.write_checksums(str(ckpt))


@pytest.mark.parametrize("record_device", [True, False], ids=["recorded", "older"])
def test_a_checkpoint_sampled_on_another_device_type_resumes_and_says_so(
    two_step_run, tmp_path, capsys, record_device
):
    """A GPU run resumed on the CPU (or back): the sampler's generator state cannot be set on
    the other device type. It used to make every checkpoint "bad RNG state" (and the resume
    fail); now the run resumes at the newest checkpoint with a reseeded sampler and says so,
    and two such resumes draw alike."""
    steps = []
    for copy in ("a", "b"):
        out = tmp_path / copy
        shutil.copytree(two_step_run, out)
        for d in ckpt_dirs(out):
            _as_if_sampled_on_cuda(out / "checkpoints" / d, record_device)
        rc = main(["train", "--resume", str(out), "--steps", "3", "--progress", "false"])
        text = capsys.readouterr().out
        assert rc == 0, text
        assert "step-000002 at step 2" in text and "skipping" not in text, text
        assert "sample generator" in text and "saved on cuda and this run's is on cpu" in text
        steps.append(tiny_run.untimed(read_metrics(str(out / "metrics.jsonl"))[-1]))
    assert steps[0]["step"] == 3 and steps[0] == steps[1]


def test_a_resume_in_another_dtype_says_so(two_step_run, tmp_path, capsys):
    """Each checkpoint records the dtype the run computed in (what --dtype auto resolved to on
    its device). A GPU run's bf16 resumed on the CPU computes in fp32 under auto: the resume
    says so, and --dtype may be given with --resume to choose (here bf16 over a saved fp32)."""
    out = tmp_path / "run"
    shutil.copytree(two_step_run, out)
    state = json.loads((out / "checkpoints" / "step-000002" / "state.json").read_text())
    assert state["compute_dtype"] == "fp32"  # --dtype auto on the CPU
    rc = main(["train", "--resume", str(out), "--steps", "3", "--progress", "false"])
    text = capsys.readouterr().out
    assert rc == 0 and "at step 2" in text and "computing in" not in text, text
    argv = ["train", "--resume", str(out), "--steps", "4", "--dtype", "bf16"]
    rc = main([*argv, "--progress", "false"])
    text, err = capsys.readouterr()
    assert rc == 0, text + err
    assert "--dtype" not in err  # taken, not "ignoring --dtype"
    assert "step-000003 was trained computing in fp32; this run computes in bf16" in text, text
    state = json.loads((out / "checkpoints" / "step-000004" / "state.json").read_text())
    assert state["compute_dtype"] == "bf16"


@pytest.mark.parametrize("which", ["--task", "--eval-file"])
def test_a_resume_whose_data_file_changed_is_refused(tmp_path, capsys, which):
    """A checkpoint records the SHA-256 of the .jsonl task and --eval-file it read: after the
    file is edited, --resume is refused naming it (it split, shuffled and held out the new lines
    with no word: held-out lines could be trained on), and resumes once it is restored."""
    lines = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) for a in range(4)
             for b in range(3)]  # fmt: skip
    task, evals = tmp_path / "t.jsonl", tmp_path / "e.jsonl"
    task.write_text("\n".join(lines) + "\n")
    evals.write_text("\n".join(lines[:4]) + "\n")
    out = tmp_path / "run"
    args = ["--task", str(task), "--save-every", "1", "--progress", "false"]
    args += ["--eval-file", str(evals)] if which == "--eval-file" else ["--eval-split", "0.3"]
    assert main(["train", "--steps", "1", "--out", str(out), *tiny_run.TINY, *args]) == 0
    state = json.loads((out / "checkpoints" / "step-000001" / "state.json").read_text())
    assert set(state["data_sha256"]) == {"--task"} | ({which} if which == "--eval-file" else set())
    path = task if which == "--task" else evals
    original = path.read_text()
    path.write_text(original.replace("0+1=", "1+0="))
    capsys.readouterr()
    rc = main(["train", "--resume", str(out), "--steps", "2", "--progress", "false"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"--resume: {which} {path} changed since" in err and "--model" in err, err
    path.write_text(original)
    assert main(["train", "--resume", str(out), "--steps", "2", "--progress", "false"]) == 0


def test_the_resume_docs_name_every_option_a_resume_may_change():
    """--resume's help lists the options that may be given anew (RESUME_OVERRIDABLE)."""
    from fastrl.train.cli_args import RESUME_OVERRIDABLE, field_docs

    doc = field_docs(TrainConfig)["resume"]
    named = {w.strip(",.()").removeprefix("--").replace("-", "_") for w in doc.split()}
    assert set(RESUME_OVERRIDABLE) <= named, set(RESUME_OVERRIDABLE) - named


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_run_moves_between_cpu_and_cuda(tmp_path, capsys):
    """The real thing of the test above: 2 steps on the CPU, one more on CUDA, one more back."""
    out = tmp_path / "run"
    Trainer(tiny(out, steps=2, save_every=1, device="cpu"), log=lambda *a: None).train()
    for steps, device, saved in (("3", "cuda", "cpu"), ("4", "cpu", "cuda")):
        argv = ["train", "--resume", str(out), "--steps", steps, "--device", device]
        rc = main([*argv, "--progress", "false"])
        text, err = capsys.readouterr()
        assert rc == 0, text + err
        assert f"saved on {saved} and this run's is on {device}" in text, text
    assert [r["step"] for r in read_metrics(str(out / "metrics.jsonl"))] == [0, 1, 2, 3, 4]


# ----------------------------------------------------------------------- the export's tokenizer
def test_the_export_reloads_the_training_tokenizer_token_for_token(tmp_path):
    from transformers import AutoTokenizer

    task = tmp_path / "spaced.jsonl"
    rows = [
        {"prompt": f"what is {a} + {b} ? ", "answer": f"{a + b} ."}
        for a in range(6)
        for b in (7, 30)
    ]
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    t = Trainer(tiny(out, task=str(task), steps=1, eval_split=0.25), log=lambda *a: None)
    t.train()
    hf = str(out / "checkpoints" / "step-000001" / "hf")
    auto = AutoTokenizer.from_pretrained(hf)
    _, own = load_model(hf)  # what `fastrl train --model` loads
    unknown = "Q: 3 + 4 = ?\tÉté!\n"  # upper case, a tab, accents, '!' and a newline: not in it
    strings = [s for r in rows for s in (r["prompt"], r["answer"], r["prompt"] + r["answer"])]
    for s in [*strings, "3 + 4 = ", "  ", unknown]:
        ids = t.tok(s).input_ids
        assert auto(s).input_ids == ids, (s, auto.convert_ids_to_tokens(auto(s).input_ids))
        assert own(s).input_ids == ids, s
        assert auto.decode(ids) == own.decode(ids) == t.tok.decode(ids)
    assert len(t.tok("3 + 4 = ").input_ids) == 8  # spaces are tokens
    for s in strings:  # every task string round-trips through the export
        assert auto.decode(auto(s).input_ids) == s
    assert (auto.pad_token_id, auto.eos_token_id, auto.padding_side) == (
        t.tok.pad_token_id,
        t.tok.eos_token_id,
        "left",
    )
    # --model of the export trains on the same ids
    again = Trainer(
        tiny(tmp_path / "again", model=hf, task=str(task), steps=1), log=lambda *a: None
    )
    assert [again.tok(s).input_ids for s in strings] == [t.tok(s).input_ids for s in strings]


def test_the_embedded_model_refuses_a_task_character_its_tokenizer_lacks(tmp_path):
    task = tmp_path / "t.jsonl"
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(80)]
    rows[70]["prompt"] = "Seventy+1="  # past the first 50 lines: every line is checked
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"characters \['S'\] are missing"):
        Trainer(tiny(tmp_path / "run", task=str(task), eval_split=0.0), log=lambda *a: None)


def test_a_held_out_eval_line_with_a_character_the_tokenizer_lacks_is_named_as_such(tmp_path):
    """The message names what holds the character: the held-out eval lines (--eval-split), not
    an --eval-file that was never given ("--eval-file None")."""
    from fastrl.train.tasks import JsonlTask

    task = tmp_path / "t.jsonl"
    rows = [{"prompt": f"{a}+1=", "answer": str(a + 1)} for a in range(40)]
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = tiny(tmp_path / "run", task=str(task), eval_split=0.1)
    probe = JsonlTask(str(task))
    held = probe.hold_out(cfg.eval_split, cfg.eval_size, cfg.seed)[0]
    rows[[f"{a}+1=" for a in range(40)].index(held.prompt)]["prompt"] = "é+1="
    task.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"the eval lines held out of task .*: characters"):
        Trainer(cfg, log=lambda *a: None)


# ----------------------------------------------------------------------- file modes
def test_checkpoints_get_the_modes_of_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        Trainer(tiny(out, steps=1), log=lambda *a: None).train()
    finally:
        os.umask(old)
    root = out / "checkpoints"
    seen = {"dirs": 0, "files": 0}
    for parent, _, files in os.walk(root):
        assert stat.S_IMODE(os.stat(parent).st_mode) == 0o755, parent
        seen["dirs"] += 1
        for f in files:
            path = os.path.join(parent, f)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o644, path
            seen["files"] += 1
    assert seen["dirs"] >= 3 and seen["files"] >= 8
    assert stat.S_IMODE(os.stat(root / "step-000001" / "hf" / "model.safetensors").st_mode) == 0o644
    assert stat.S_IMODE(os.stat(out / "config.json").st_mode) == 0o644


def test_a_restrictive_umask_is_kept(tmp_path):
    model = torch.nn.Linear(3, 2)
    old = os.umask(0o077)
    try:
        ckpt = ckpt_io.save_checkpoint(
            str(tmp_path / "c"), 1, {"policy": model}, {"optimizer": {}, "scheduler": {}}, {}
        )
    finally:
        os.umask(old)
    modes = {stat.S_IMODE(os.stat(os.path.join(ckpt, f)).st_mode) for f in os.listdir(ckpt)}
    assert modes == {0o600} and stat.S_IMODE(os.stat(ckpt).st_mode) == 0o700


# ----------------------------------------------------------------------- --save-total-limit
def test_save_total_limit_keeps_the_newest_and_says_what_it_removes(tmp_path, capsys):
    out = tmp_path / "run"
    args = ["--steps", "3", "--save-every", "1", "--out", str(out), *tiny_run.TINY]
    assert main(["train", "--save-total-limit", "1", *args]) == 0
    text = capsys.readouterr().out
    assert ckpt_dirs(out) == ["step-000003"]
    removed = [line for line in text.splitlines() if line.startswith("removed checkpoint")]
    assert len(removed) == 2, text
    assert "step-000001" in removed[0] and "step-000002" in removed[1]
    assert "keeping the newest 1" in removed[0]
    # None and 0 keep every checkpoint, silently; the default keeps 2
    for limit, kept in ((None, 3), (0, 3), (2, 2)):
        lines = []
        run = tmp_path / f"run-{limit}"
        Trainer(tiny(run, steps=3, save_every=1, save_total_limit=limit), log=lines.append).train()
        assert ckpt_dirs(run) == [f"step-00000{i}" for i in range(4 - kept, 4)], limit
        assert sum(line.startswith("removed checkpoint") for line in lines) == 3 - kept
    assert TrainConfig().save_total_limit == 2
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="--save-total-limit="):
            TrainConfig(save_total_limit=bad).validate()


def test_pruning_spares_checkpoints_newer_than_the_one_saved(tmp_path):
    """After a resume fell back past a corrupt newer checkpoint, saving step 3 removes the
    oldest of steps 1-3 only: the leftover step 9 is not counted (it is replaced when the run
    reaches step 9), so the intact step 2 is not pruned in its favour."""
    root = tmp_path / "c"
    model = torch.nn.Linear(3, 2)
    optim = {"optimizer": {}, "scheduler": {}}
    for step in (1, 2, 9):
        ckpt_io.save_checkpoint(str(root), step, {"policy": model}, optim, {}, keep=None)
    removed = []
    ckpt_io.save_checkpoint(str(root), 3, {"policy": model}, optim, {}, keep=2, log=removed.append)
    assert sorted(os.listdir(root)) == ["latest", "step-000002", "step-000003", "step-000009"]
    assert len(removed) == 1 and "step-000001" in removed[0]


def test_cuda_rng_states_restore_on_as_many_devices_as_this_process_sees(monkeypatch):
    """A checkpoint saved by a run that saw 2 GPUs, resumed where 1 is visible: one state per
    visible device is restored (set_rng_state_all of both raised IndexError, which made every
    checkpoint "bad RNG state"). CUDA is faked here: device_count 1, set_rng_state recorded."""
    from fastrl.train import checkpoint as ckpt_io

    state = ckpt_io.rng_state({}, {})
    state["cuda"] = [[1] * 16, [2] * 16]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    calls = []

    def set_one(s, i):  # as torch's: an index past the visible devices raises
        if i >= 1:
            raise IndexError(f"CUDA device {i} of 1")
        calls.append((s.tolist(), i))

    monkeypatch.setattr(torch.cuda, "set_rng_state", set_one)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all",
                        lambda states: [set_one(s, i) for i, s in enumerate(states)])  # fmt: skip
    assert ckpt_io.set_rng_state(state, {}, {}) == {}
    assert calls == [([1] * 16, 0)]


def test_flash_attention_only_where_it_can_run(monkeypatch):
    """flash_attention_2 for a CUDA run in bf16 / fp16 with a usable flash_attn, else sdpa: it
    has no CPU and no fp32 kernels (a --device cpu run on a GPU machine, or --dtype fp32 on CUDA,
    failed at its first forward) and transformers' own check says whether it is usable."""
    import transformers.utils

    from fastrl.train.rollout import attn_implementation

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for usable in (True, False):
        monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda u=usable: u)
        want = "flash_attention_2" if usable else "sdpa"
        assert [attn_implementation(cuda, d) for d in ("bf16", "fp16")] == [want, want]
        assert attn_implementation(cuda, "fp32") == "sdpa"
        assert attn_implementation(cpu, "bf16") == "sdpa"
    # a GPU older than Ampere (V100 7.0, T4 7.5): flash-attn 2 refuses it at the first forward
    monkeypatch.setattr(transformers.utils, "is_flash_attn_2_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert attn_implementation(cuda, "bf16") == "sdpa"


def test_dtype_auto_is_bf16_only_where_the_gpu_has_it(monkeypatch):
    """--dtype auto: bf16 on a CUDA GPU of compute capability >= 8.0, fp32 on older ones (a
    V100 or T4 emulates bf16: torch.cuda.is_bf16_supported() says yes there) and on the CPU."""
    from fastrl.train.build import native_bf16

    cuda = torch.device("cuda", 0)
    for major, want in ((7, False), (8, True), (9, True), (12, True)):
        capability = lambda device=None, m=major: (m, 0)  # noqa: E731
        monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
        assert native_bf16(cuda) is want
    assert native_bf16(torch.device("cpu")) is False
