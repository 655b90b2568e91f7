"""--fsdp: FSDP2 (`fully_shard`) under torchrun, 2 gloo processes on the CPU. One update on a
fixed batch gives the same loss, metrics and weights as one process without sharding; a short
run of each algorithm trains, checkpoints and exports a Hugging Face model that loads."""

import json

import pytest
import torch
from test_trainer import _update_once, torchrun, update_two_ranks


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
def test_fsdp_two_processes_equal_one_process(algo, tmp_path):
    one = _update_once(algo, 2)  # one process, no sharding, 2 micro-batches
    two = update_two_ranks(algo, tmp_path, fsdp=True)  # 2 ranks, FSDP2 shards, 1 micro-batch each
    # the sharded run's LM head goes through fastrl's fused linear path, the other through logits
    assert two["fused_lm_head"] and not one["fused_lm_head"]
    for key in ("loss", "entropy", "kl", "approx_kl", "clipfrac_low", "clipfrac_high"):
        assert one[key] == pytest.approx(two[key], rel=1e-4, abs=1e-7), key
    assert one["grad_norm"] == pytest.approx(two["grad_norm"], rel=1e-4)
    p1, p2 = torch.tensor(one["params"]), torch.tensor(two["params"])
    off = (p1 - p2).abs() > 1e-4  # Adam's first step ~ lr * sign(g): see test_trainer
    assert off.float().mean() < 1e-3, f"{int(off.sum())} of {off.numel()} weights differ"
    assert (p1 - p2).abs().max() < 2.5e-3


@pytest.mark.parametrize("algo,dtype", [("dapo", "fp32"), ("ppo", "fp32"), ("grpo", "bf16")])
def test_fsdp_run_trains_checkpoints_and_exports(algo, dtype, tmp_path):
    """bf16: autocast around fp32 FSDP shards, the LM head through the fused linear path (it
    crashed at the first update with a Float / BFloat16 index_copy_)."""
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    args = [
        "-m", "fastrl.cli", "train", "--fsdp", "--algo", algo, "--steps", "2", "--out", str(out),
        "--model-hidden", "32", "--model-layers", "2", "--batch-size", "4", "--group-size", "4",
        "--sft-steps", "0", "--eval-size", "8", "--max-new-tokens", "4", "--progress", "false",
        "--device", "cpu", "--num-threads", "1", "--max-gen-batches", "2", "--dtype", dtype,
    ]  # fmt: skip
    proc = torchrun(args, tmp_path)
    assert "done:" in proc.stdout
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 2 and "eval_accuracy" in recs[-1]
    hf = out / "checkpoints" / "step-000002" / "hf"
    model = AutoModelForCausalLM.from_pretrained(hf)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    from safetensors.torch import load_file

    saved = load_file(str(out / "checkpoints" / "step-000002" / "policy.safetensors"))
    assert torch.equal(saved["model.embed_tokens.weight"], model.model.embed_tokens.weight)


def test_fsdp_needs_torchrun(tmp_path):
    from fastrl.train.config import TrainConfig
    from fastrl.train.trainer import Trainer

    with pytest.raises(ValueError, match="torchrun"):
        Trainer(TrainConfig(fsdp=True, out=str(tmp_path)))
