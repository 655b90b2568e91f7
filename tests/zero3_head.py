"""One ZeRO-3 step of a tiny Qwen2 through a fused LM head, in a single process (world size 1,
gloo, DeepSpeed's CPU accelerator): run by tests/test_deepspeed.py as
`python zero3_head.py {trl|fastrl} OUT.pt STEPS`. Under ZeRO-3 every parameter is partitioned to
numel 0 outside a gather; a fused head reads lm_head.weight directly, so it must gather it for
the forward and again in its backward (TRL's `maybe_gather_lm_head_ctx`). Saves the log-probs,
entropies, loss and the full gradients of lm_head.weight and embed_tokens.weight to OUT.pt."""

import os
import sys

import torch

HEAD, OUT, STEPS = sys.argv[1], sys.argv[2], int(sys.argv[3])
for key, value in dict(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0").items():
    os.environ.setdefault(key, value)

import deepspeed  # noqa: E402
from deepspeed.utils import safe_get_full_grad  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from transformers.integrations import HfDeepSpeedConfig  # noqa: E402

deepspeed.init_distributed(dist_backend="gloo")
ds_config = {
    "train_batch_size": 2,
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,  # (even a tiny head is partitioned)
        "stage3_max_live_parameters": 0,  # (nothing fetched ahead of its module)
        "stage3_prefetch_bucket_size": 0,
    },
    "zero_allow_untested_optimizer": True,
    "steps_per_print": 1_000_000,
}
ds_ref = HfDeepSpeedConfig(ds_config)  # (held: transformers keeps a weak reference to it)
torch.manual_seed(0)
cfg = Qwen2Config(
    vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    tie_word_embeddings=False,
)  # fmt: skip
with deepspeed.zero.Init(config_dict_or_path=ds_config):
    model = Qwen2ForCausalLM(cfg)
if HEAD == "trl":
    from trl.trainer.utils import add_fused_lm_head

    add_fused_lm_head(model, 0.7, cast_lm_head_to_fp32=False, outputs=("log_probs", "entropy"))
else:
    from fastrl.integrations.trl import add_fastrl_lm_head

    add_fastrl_lm_head(model, 0.7, False, entropy=True)
opt = torch.optim.SGD(model.parameters(), lr=0.0)
engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
head = engine.module.lm_head.weight
assert head.numel() == 0, "lm_head.weight is not partitioned: not a ZeRO-3 run"
g = torch.Generator().manual_seed(1)
input_ids = torch.randint(0, 96, (2, 10), generator=g)
labels = input_ids.clone()
labels[0, :3] = -100  # a prompt, not scored
weights = torch.randn(2, 9, generator=g)
engine.train()
for step in range(STEPS):  # (ZeRO-3 fetches in the order the first step traced)
    if step:
        engine.step()  # (lr 0: the weights stay)
    out = engine(input_ids=input_ids, labels=labels, fused_lm_head=True)
    loss = (out.log_probs * weights).sum() + 0.3 * (out.entropy * weights.flip(0)).sum()
    engine.backward(loss)
torch.save(
    {
        "log_probs": out.log_probs.detach(),
        "entropy": out.entropy.detach(),
        "loss": loss.detach(),
        "d_lm_head": safe_get_full_grad(head).clone(),
        "d_embed": safe_get_full_grad(engine.module.model.embed_tokens.weight).clone(),
    },
    OUT,
)
