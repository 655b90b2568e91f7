"""`fastrl train --model` across Hugging Face architectures (from an audit on 19 tiny ones): what
differs between them reaches neither the log-probs nor the update. The fused LM-head path
(--fsdp) is taken only where the model's own logits are its head applied to the hidden states;
FSDP2 shards every architecture's blocks (GPT-2's are not called *DecoderLayer); a model without
SDPA loads with eager attention; the PPO critic reads the width of the last hidden state; and
dropout read from the config at forward time (Falcon) or OPT's layerdrop is switched off."""

import json

import pytest
import torch
import transformers as T
from test_trainer import torchrun

from fastrl.train import rollout
from fastrl.train.algos import ValueModel
from fastrl.train.build import disable_dropout, transformer_blocks
from fastrl.train.rollout import default_model, default_tokenizer, lm_head_fusable

TOK = default_tokenizer()
V = len(TOK)
SMALL = dict(vocab_size=V, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
             num_attention_heads=2, num_key_value_heads=1)  # fmt: skip


def build(name: str):
    torch.manual_seed(0)
    if name == "qwen2":
        return default_model(V, hidden=16, layers=1)
    if name == "granite":  # logits / logits_scaling after the head
        return T.GraniteForCausalLM(T.GraniteConfig(**SMALL, logits_scaling=4.0))
    if name == "gemma2":  # tanh softcap after the head; no SDPA
        return T.Gemma2ForCausalLM(T.Gemma2Config(**SMALL, head_dim=8))
    if name == "cohere":  # logit_scale after the head
        return T.CohereForCausalLM(T.CohereConfig(**SMALL, logit_scale=0.5))
    if name == "gpt2":  # blocks named GPT2Block
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=16, n_layer=2, n_head=2))
    if name == "opt_proj":  # the decoder projects hidden 32 to 16 before the (tied) head
        return T.OPTForCausalLM(T.OPTConfig(vocab_size=V, hidden_size=32, ffn_dim=32,
                                            num_hidden_layers=1, num_attention_heads=2,
                                            word_embed_proj_dim=16))  # fmt: skip
    raise KeyError(name)


@pytest.mark.parametrize(
    "name, fusable",
    [
        ("qwen2", True),
        ("gpt2", True),
        ("opt_proj", True),
        ("granite", False),
        ("gemma2", False),
        ("cohere", False),
    ],  # fmt: skip
)
def test_fused_lm_head_only_where_the_head_gives_the_logits(name, fusable):
    """Granite divides its logits by logits_scaling after the head: a list of config names
    missed it, and an --fsdp run then trained log-probs 2 nats off the sampler's. Top-k /
    top-p always need the logits."""
    model = build(name)
    assert lm_head_fusable(model) is fusable
    assert not lm_head_fusable(model, top_k=3)


def test_the_forward_check_alone_catches_a_scaled_head(monkeypatch):
    """Without the config names the one-forward check still refuses Granite's scaled logits;
    a softcap it cannot see at a fresh model's small logits (so that one keeps its name)."""
    monkeypatch.setattr(rollout, "_LOGIT_TRANSFORMS", ())
    assert not lm_head_fusable(build("granite"))
    assert lm_head_fusable(build("gemma2"))  # tanh(z / 30) 30 ~ z at |z| << 30


def test_completion_hidden_feeds_the_head_on_opt():
    """OPT's causal LM calls its decoder directly (the base model's hook never fired: KeyError
    'h' under --fsdp), and projects the hidden states before the head."""
    model = build("opt_proj").eval()
    r = rollout.generate(model, [[5, 6, 7], [8, 9]], 2, 4, V + 5, TOK.pad_token_id,
                         temperature=0.0)  # fmt: skip
    h, head = rollout.completion_hidden(model, r)
    logits, _ = rollout.forward_completion_logits(model, r)
    torch.testing.assert_close(head(h), logits, rtol=1e-5, atol=1e-5)


def test_ppo_critic_reads_the_last_hidden_states_width():
    """OPT-350m's last hidden state has word_embed_proj_dim columns, not hidden_size: the value
    head was sized from hidden_size and the first PPO step crashed."""
    model = build("opt_proj")
    critic = ValueModel(model)
    r = rollout.generate(model.eval(), [[5, 6, 7]], 2, 3, V + 5, TOK.pad_token_id,
                         temperature=0.0)  # fmt: skip
    assert critic.head.in_features == 16
    assert critic(r).shape == r.completion_ids.shape


def test_a_model_without_sdpa_loads_with_eager_attention(tmp_path):
    """Gemma2 (like Bloom and GPT-Neo) has no SDPA attention: --model refused it, telling the
    user to pass attn_implementation="eager", which the CLI cannot."""
    build("gemma2").save_pretrained(tmp_path)
    TOK.save_pretrained(tmp_path)
    model, tok = rollout.load_model(str(tmp_path))
    assert type(model).__name__ == "Gemma2ForCausalLM"
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("kind", ["falcon", "opt_layerdrop"])
def test_dropout_read_from_the_config_or_layerdrop_is_switched_off(kind):
    """Falcon reads config.hidden_dropout / attention_dropout in its forward, OPT skips layers
    at random (layerdrop): after disable_dropout two train-mode forwards were 0.42 / 0.26
    apart. Now equal; the configs' rates are kept for the export."""
    torch.manual_seed(0)
    if kind == "falcon":
        config = T.FalconConfig(vocab_size=V, hidden_size=16, num_hidden_layers=2,
                                num_attention_heads=2, hidden_dropout=0.5,
                                attention_dropout=0.5)  # fmt: skip
        model, kept = T.FalconForCausalLM(config), {"hidden_dropout", "attention_dropout"}
    else:
        config = T.OPTConfig(vocab_size=V, hidden_size=16, ffn_dim=32, num_hidden_layers=4,
                             num_attention_heads=2, word_embed_proj_dim=16, layerdrop=0.5,
                             dropout=0.0, attention_dropout=0.0)  # fmt: skip
        model, kept = T.OPTForCausalLM(config), {"layerdrop"}
    disable_dropout(model)
    model.train()
    ids = torch.randint(0, V, (2, 6))
    torch.manual_seed(1)
    a = model(ids).logits
    for seed in (2, 3):
        torch.manual_seed(seed)
        torch.testing.assert_close(model(ids).logits, a, rtol=0, atol=0)
    ((cfg, rates),) = model._fastrl_config_dropout
    assert cfg is model.config and set(rates) == kept


def test_transformer_blocks_of_every_naming():
    assert [type(m).__name__ for m in transformer_blocks(build("gpt2"))] == ["GPT2Block"] * 2
    assert len(transformer_blocks(build("qwen2"))) == 1


def test_fsdp_trains_gpt2(tmp_path):
    """--fsdp on GPT-2 (blocks named GPT2Block): sharded as one root group, the fused LM-head
    loss never ran FSDP2's reduce-scatter, so every weight stayed as loaded while a gradient
    norm was logged. Now 2 gloo ranks move every weight."""
    from safetensors.torch import load_file

    path = tmp_path / "gpt2"
    build("gpt2").save_pretrained(path)
    TOK.save_pretrained(path)
    (tmp_path / "digits.py").write_text(  # a reward that differs within a group
        "def reward(completion, answer):\n    return sum(c.isdigit() for c in completion) / 4\n"
    )
    out = tmp_path / "run"
    args = [
        "-m", "fastrl.cli", "train", "--fsdp", "--model", str(path), "--algo", "grpo",
        "--reward", "digits:reward", "--steps", "2", "--out", str(out), "--batch-size", "4",
        "--group-size", "4", "--eval-size", "8", "--max-new-tokens", "4", "--progress", "false",
        "--device", "cpu", "--num-threads", "1", "--lr", "0.01",
    ]  # fmt: skip
    torchrun(args, tmp_path)
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert recs[-1]["step"] == 2
    before = load_file(str(path / "model.safetensors"))
    after = load_file(str(out / "checkpoints" / "step-000002" / "hf" / "model.safetensors"))
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(moved) == len(before), sorted(set(before) - set(moved))
