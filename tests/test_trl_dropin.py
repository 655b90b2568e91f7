"""fastrl.integrations.trl.GRPOTrainer against the real trl.GRPOTrainer: the same tiny model,
seed and data train to the same parameters and log the same metrics, with fastrl's head and loss
actually running; options SPEC cannot express raise at construction; one step's peak memory is
no higher than TRL's.

Tiny local models (a 2-layer Qwen2 built from a config over the packaged character tokenizer),
CPU, fp32, SGD (an update proportional to the gradient, so every normaliser shows), gradient
accumulation 2 and num_iterations 2."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

import fastrl  # noqa: E402
import fastrl.integrations.trl as fastrl_trl  # noqa: E402
from fastrl.train.rollout import default_model, default_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    tok = default_tokenizer()
    default_model(len(tok), seed=0, hidden=32, layers=2).save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


def reward_chars(completions, **kwargs):
    return [float(c.count("a") + 0.5 * c.count("1") - 0.1 * len(c)) for c in completions]


def grpo_args(out, **kw):
    base = dict(
        output_dir=str(out),
        report_to=[],
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=4,
        num_generations=4,
        gradient_accumulation_steps=2,
        num_iterations=2,
        max_completion_length=8,
        max_steps=2,
        optim="sgd",
        learning_rate=1.0,
        lr_scheduler_type="constant",
        seed=0,
        logging_steps=1,
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    base.update(kw)
    return trl.GRPOConfig(**base)


def train(cls, model_dir, out, **kw):
    """(params before, params after, log history) of `max_steps` optimizer steps."""
    ds = datasets.Dataset.from_dict({"prompt": ["1+1=", "2+3=", "ab", "xyz"] * 4})
    trainer = cls(
        model=model_dir,
        reward_funcs=reward_chars,
        args=grpo_args(out, **kw),
        train_dataset=ds,
        processing_class=default_tokenizer(),
    )
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    after = [p.detach().clone() for p in trainer.model.parameters()]
    return before, after, trainer.state.log_history


def train_ours(monkeypatch, model_dir, out, **kw):
    """`train` with the drop-in, checking that it runs fastrl's head (prompt rows masked out)
    and never TRL's chunked one."""
    calls = []
    real_linear_logprobs = fastrl.linear_logprobs
    real_cast_head = fastrl_trl._cast_head_logprobs  # the head's weight in another dtype

    def counting(*args, **kwargs):
        calls.append(kwargs.get("mask"))
        return real_linear_logprobs(*args, **kwargs)

    def counting_cast(hidden, weight, bias, tokens, mask, *args):
        calls.append(mask)
        return real_cast_head(hidden, weight, bias, tokens, mask, *args)

    class NoTRLHead:
        @staticmethod
        def apply(*args):
            raise AssertionError("the drop-in ran TRL's fused LM head")

    monkeypatch.setattr(fastrl, "linear_logprobs", counting)
    monkeypatch.setattr(fastrl_trl, "_cast_head_logprobs", counting_cast)
    monkeypatch.setattr(trl.trainer.utils, "_ChunkedLogProbFunction", NoTRLHead)
    result = train(fastrl_trl.GRPOTrainer, model_dir, out, **kw)
    assert calls and all(m is not None and not m[:, 0].any() for m in calls)  # prompt skipped
    return result


def relative_update_difference(before, stock, ours) -> float:
    """|ours - stock| / |stock - before| over all parameters (fp32), after checking that the
    stock run moved enough for the comparison to mean something."""
    flat = lambda ps: torch.cat([p.float().flatten().cpu() for p in ps])  # noqa: E731
    update = (flat(stock) - flat(before)).norm()
    assert update > 0.05, f"the stock run barely moved ({update:.3g}): nothing is compared"
    return float((flat(ours) - flat(stock)).norm() / update)


CASES = {
    "grpo": dict(loss_type="grpo", beta=0.04),
    "dapo": dict(loss_type="dapo", epsilon_high=0.28),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "cispo": dict(loss_type="cispo", epsilon_high=5.0),
    # GSPO with beta > 0 under TRL's default use_bias_correction_kl: the KL is weighted by the
    # sequence ratio (LossConfig.kl_bias_ratio="sequence")
    "gspo": dict(
        loss_type="grpo",
        importance_sampling_level="sequence",
        epsilon=3e-4,
        epsilon_high=4e-4,
        beta=0.04,
    ),
    "sapo": dict(loss_type="sapo", beta=0.02),
    # TRL's entropy bonus (its own normaliser) and a generation batch spanning 4 micro-steps
    # (old log-probs recomputed, dapo's window rescaled by steps_per_generation)
    "dapo_entropy_spg4": dict(loss_type="dapo", entropy_coef=0.01, steps_per_generation=4),
    "bnpo_adaptive_entropy": dict(
        loss_type="bnpo", entropy_coef=0.01, use_adaptive_entropy=True, entropy_target=5.0
    ),
}
METRICS = ("kl", "entropy", "cispo_clip_ratio", "policy_loss", "entropy_coef", "loss")


@pytest.mark.parametrize("case", list(CASES))
def test_same_parameters_and_metrics_as_trl(case, model_dir, tmp_path, monkeypatch):
    cfg = CASES[case]
    before, stock, stock_logs = train(trl.GRPOTrainer, model_dir, tmp_path / "stock", **cfg)
    start, ours, our_logs = train_ours(monkeypatch, model_dir, tmp_path / "ours", **cfg)

    assert all(torch.equal(a, b) for a, b in zip(before, start))
    rel = relative_update_difference(before, stock, ours)
    assert rel <= 1e-4, f"{case}: relative update difference {rel:.3g}"

    assert len(stock_logs) == len(our_logs)
    for theirs, mine in zip(stock_logs, our_logs):
        keys = [k for k in theirs if k in METRICS or k.startswith("clip_ratio/")]
        assert sorted(k for k in mine if k in keys) == sorted(keys)
        for k in keys:
            assert mine[k] == pytest.approx(theirs[k], rel=1e-4, abs=1e-6), (case, k)
    if cfg.get("beta"):
        assert any(log.get("kl", 0) > 0 for log in our_logs)


# bf16: TRL's usual mixed precision (autocast over fp32 master weights) and a model loaded in
# bf16. Three optimizer steps on one generation (num_iterations 3, no accumulation): both runs
# sample the same completions from the same initial weights, so what differs is only the head and
# the loss. bf16 rounds at ~4e-3; measured on the 2-core CPU: 6e-3 relative update difference
# (autocast) and 0 (bf16 weights). On CUDA this is the GPU run's drop-in check.
BF16_RUNS = {
    "autocast": {},
    "bf16-weights": dict(model_init_kwargs={"dtype": torch.bfloat16}),
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("run", list(BF16_RUNS))
def test_bf16_three_steps_as_trl(device, run, model_dir, tmp_path, monkeypatch):
    kw = dict(
        BF16_RUNS[run], bf16=True, use_cpu=device == "cpu", max_steps=3,
        gradient_accumulation_steps=1, num_iterations=3, loss_type="grpo", beta=0.04,
    )  # fmt: skip
    before, stock, stock_logs = train(trl.GRPOTrainer, model_dir, tmp_path / "stock", **kw)
    _, ours, our_logs = train_ours(monkeypatch, model_dir, tmp_path / "ours", **kw)
    assert stock[0].device.type == device and ours[0].device.type == device
    assert (stock[0].dtype == torch.bfloat16) == (run == "bf16-weights")
    rel = relative_update_difference(before, stock, ours)
    assert rel <= 3e-2, f"{run} on {device}: relative update difference {rel:.3g}"
    assert len(stock_logs) == len(our_logs) == 4  # 3 steps + the summary
    for theirs, mine in zip(stock_logs[:3], our_logs[:3]):
        for k in ("loss", "kl", "entropy"):
            assert mine[k] == pytest.approx(theirs[k], rel=2e-2, abs=2e-3), (run, device, k)
    assert our_logs[2]["kl"] > 0


@pytest.mark.parametrize(
    "fields, option",
    [
        (dict(loss_type="vespo"), "loss_type"),
        (dict(top_entropy_quantile=0.2), "top_entropy_quantile"),
        (dict(top_entropy_quantile=0.0), "top_entropy_quantile"),  # TRL: the top token only
        (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold"),
        (dict(loss_type="cispo", epsilon_high=0.28), "epsilon_high"),
    ],
)
def test_refused_at_construction_before_loading(fields, option, tmp_path):
    # a model path that does not exist: the option is refused before anything is loaded
    with pytest.raises(ValueError, match=option):
        fastrl_trl.GRPOTrainer(
            model=str(tmp_path / "no-such-model"),
            reward_funcs=reward_chars,
            args=grpo_args(tmp_path, **fields),
        )


def test_is_a_trl_grpo_trainer():
    assert issubclass(fastrl_trl.GRPOTrainer, trl.GRPOTrainer)
    from fastrl.integrations.trl import GRPOTrainer

    assert GRPOTrainer is fastrl_trl.GRPOTrainer


# ------------------------------------------------------------------------------ peak memory
_CHILD = textwrap.dedent(
    """
    import sys, torch, datasets, trl
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, TrainerCallback
    import fastrl.integrations.trl as fastrl_trl

    which, out = sys.argv[1], sys.argv[2]
    V = 32768  # a large vocabulary: the (B, S, V) logits dominate a step's transient memory
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *"0123456789abcxyz+="])}
    vocab.update({f"w{i}": i for i in range(len(vocab), V)})
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>",
                                  unk_token="<unk>", padding_side="left")
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=V, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True,
                         pad_token_id=0, eos_token_id=1, bos_token_id=None)
    model = Qwen2ForCausalLM(config)
    args = trl.GRPOConfig(output_dir=out, report_to=[], use_cpu=True, bf16=False,
                          per_device_train_batch_size=8, num_generations=8,
                          max_completion_length=16, max_steps=2, optim="sgd",
                          learning_rate=0.1, save_strategy="no", disable_tqdm=True,
                          dataloader_num_workers=0, loss_type="dapo")
    ds = datasets.Dataset.from_dict({"prompt": ["1+1=", "abc"] * 8})
    cls = trl.GRPOTrainer if which == "trl" else fastrl_trl.GRPOTrainer
    reward = lambda completions, **kw: [float(c.count("7")) for c in completions]
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=ds,
                  processing_class=tok)

    class Peak(TrainerCallback):
        def on_step_begin(self, *a, **k):  # reset the peak RSS (VmHWM) for this step
            open("/proc/self/clear_refs", "w").write("5")

        def on_step_end(self, *a, **k):
            rss = {l.split(":")[0]: int(l.split()[1]) for l in open("/proc/self/status")
                   if l.startswith(("VmHWM", "VmRSS"))}
            print("PEAK_KB", rss["VmHWM"], flush=True)

    trainer.add_callback(Peak())
    trainer.train()
    """
)


def _peak_kb(which: str, out) -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, which, str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    peaks = [int(line.split()[1]) for line in proc.stdout.splitlines() if line.startswith("PEAK")]
    assert len(peaks) == 2, proc.stdout[-2000:]
    return peaks[-1]  # the second step: allocator pools warmed up in both runs


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")
def test_peak_memory_of_a_step_not_above_trl(tmp_path):
    ours = _peak_kb("fastrl", tmp_path / "ours")
    stock = _peak_kb("trl", tmp_path / "stock")
    # the logits of one micro-batch are 8 x 19 x 32768 fp32 = 20 MB: TRL (on CPU its head
    # scores every position in one 32768-row chunk) holds them, fastrl never does
    assert ours <= stock, f"peak RSS of a step: fastrl {ours} kB > TRL {stock} kB"


# ------------------------------------------------------------------------------ the head's dtypes
def _saved_bytes_beyond_parameters(model, run):
    """(result of run(), bytes of the tensors autograd saves during run() for the backward,
    each storage once, the model's parameters left out: what the graph holds between the
    forward and the backward beyond what the model holds anyway)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = run()
    return out, sum(saved.values())


# TRL's usual mixed precision (fp32 master weights under bf16 autocast) and a bf16 model with
# cast_lm_head_to_fp32: the head's weight is not in the GEMM dtype. TRL's ChunkedLogProbFunction
# casts it per chunk; casting it whole (and saving the copy for the backward) held 4 MiB (bf16
# copy of the fp32 weight) / 8 MiB (fp32 copy of the bf16 weight) here beyond TRL's ~0.2 MiB.
@pytest.mark.parametrize("setting", ["autocast-fp32-weights", "bf16-cast_lm_head_to_fp32"])
def test_head_saves_no_weight_copy_and_matches_trl(setting):
    import copy

    from transformers import Qwen2Config, Qwen2ForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    V, H = 32768, 64
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4,
                         tie_word_embeddings=False)  # fmt: skip
    model = Qwen2ForCausalLM(config)
    cast = setting == "bf16-cast_lm_head_to_fp32"
    if cast:
        model = model.to(torch.bfloat16)
    stock, ours = copy.deepcopy(model), copy.deepcopy(model)
    add_fused_lm_head(stock, 0.7, cast_lm_head_to_fp32=cast, outputs=("log_probs", "entropy"))
    fastrl_trl.add_fastrl_lm_head(ours, 0.7, cast, entropy=True)
    ids = torch.randint(0, V, (2, 24), generator=torch.Generator().manual_seed(1))
    labels = ids.clone()
    labels[:, :8] = -100

    results = {}
    for name, m in (("trl", stock), ("fastrl", ours)):
        ctx = torch.autocast("cpu", dtype=torch.bfloat16, enabled=not cast)

        def run(m=m, ctx=ctx):
            with ctx:
                return m(input_ids=ids, labels=labels, fused_lm_head=True)

        out, held = _saved_bytes_beyond_parameters(m, run)
        (out.log_probs.sum() + 0.3 * out.entropy.sum()).backward()
        results[name] = (out, held, m.lm_head.weight.grad)

    (out_t, held_t, grad_t), (out_f, held_f, grad_f) = results["trl"], results["fastrl"]
    weight_copy = V * H * (4 if cast else 2)  # the weight in the GEMM dtype
    assert held_f <= held_t + weight_copy // 16, (
        f"{setting}: the drop-in head holds {held_f} B for the backward, TRL {held_t} B "
        f"(a copy of the weight is {weight_copy} B)"
    )
    assert grad_f.dtype == grad_t.dtype == model.lm_head.weight.dtype
    mask = labels[:, 1:] != -100
    # dW whole in fp32 (the fp32 master weights' too, as TRL's): it was rounded to bf16 by the op
    # before the cast back (2.9e-3 of the largest entry away from TRL's; now 1.5e-7)
    tol = dict(rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out_f.log_probs[mask], out_t.log_probs[mask], **tol)
    torch.testing.assert_close(out_f.entropy[mask], out_t.entropy[mask], **tol)
    scale = grad_t.float().abs().max()
    torch.testing.assert_close(grad_f.float() / scale, grad_t.float() / scale, **tol)


def _loss_trainers(model_dir, tmp_path, **fields):
    """(stock trl.GRPOTrainer, fastrl's drop-in) on the tiny model with GRPOConfig `fields`,
    ready for `_compute_loss` on hand-made inputs (train mode, no accumulation)."""
    trainers = []
    for i, cls in enumerate((trl.GRPOTrainer, fastrl_trl.GRPOTrainer)):
        args = grpo_args(tmp_path / f"{cls.__module__}{i}", gradient_accumulation_steps=1,
                         **fields)  # fmt: skip
        ds = datasets.Dataset.from_dict({"prompt": ["ab"] * 8})
        t = cls(model=model_dir, reward_funcs=reward_chars, args=args, train_dataset=ds,
                processing_class=default_tokenizer())  # fmt: skip
        t.current_gradient_accumulation_steps = 1
        t.model.train()
        trainers.append(t)
    return trainers


@pytest.mark.parametrize("level", ["sequence", "token"])
def test_clip_metrics_with_a_masked_first_token_as_trl(level, model_dir, tmp_path):
    """A tool_mask (or a rollout_func's env_mask) can mask a completion's first token while
    later ones count. Under sequence-level ratios the clip metrics read the ratio of that masked
    token (1) instead of the sequence's: clip_ratio/low_mean 0 where TRL logs 0.25."""
    import collections

    stock, ours = _loss_trainers(model_dir, tmp_path, importance_sampling_level=level,
                                 loss_type="grpo", max_completion_length=6)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    V = stock.model.config.vocab_size
    inputs = dict(
        prompt_ids=torch.randint(3, V, (4, 3), generator=g),
        prompt_mask=torch.ones(4, 3, dtype=torch.long),
        completion_ids=torch.randint(3, V, (4, 6), generator=g),
        completion_mask=torch.ones(4, 6, dtype=torch.long),
        advantages=torch.tensor([1.0, -1.0, 1.0, -1.0]),
    )
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    with torch.no_grad():
        logp = stock._get_per_token_logps_and_entropies(stock.model, ids, torch.ones_like(ids), 6)[
            0
        ]
    old = logp.clone()
    old[3] += 1.0  # row 3: ratio e^-1 < 1 - epsilon with A < 0: clipped low
    tool_mask = torch.ones(4, 6, dtype=torch.long)
    tool_mask[3, 0] = 0  # row 3's first token is not the model's
    tool_mask[1] = 0  # and row 1 counts no token
    inputs.update(old_per_token_logps=old, tool_mask=tool_mask)
    logged = []
    for t in (stock, ours):
        t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
        loss = t._compute_loss(t.model, dict(inputs))
        logged.append((loss.item(), dict(t._metrics["train"])))
    (loss_trl, trl_metrics), (loss_ours, our_metrics) = logged
    assert loss_ours == pytest.approx(loss_trl, rel=1e-5)
    keys = [k for k in trl_metrics if k.startswith("clip_ratio/")]
    assert len(keys) >= 5
    for k in keys:
        assert our_metrics[k] == pytest.approx(trl_metrics[k], abs=1e-6), k
    assert trl_metrics["clip_ratio/low_mean"][0] > 0  # the case the test is about


def test_one_token_completions_log_the_metrics_of_the_counted_tokens(model_dir, tmp_path):
    """Completions one token long (T = 1) with a masked row: TRL takes any (B, 1) tensor for
    one value per sequence and averages kl and the clip fractions over every row, the masked
    one's too. fastrl logs the counted tokens' means: what stock TRL logs for the same batch
    with one more, masked, column (T = 2), where its shape rule does not apply."""
    import collections

    stock, ours = _loss_trainers(model_dir, tmp_path, loss_type="grpo", beta=0.5,
                                 max_completion_length=2)  # fmt: skip
    g = torch.Generator().manual_seed(0)
    V = stock.model.config.vocab_size
    prompt = torch.randint(3, V, (4, 3), generator=g)
    completion = torch.randint(3, V, (4, 2), generator=g)
    ids = torch.cat([prompt, completion], 1)
    with torch.no_grad():
        logp = stock._get_per_token_logps_and_entropies(stock.model, ids, torch.ones_like(ids), 2)
    logp = logp[0]
    # row 3 is masked; its ratio e^-1 (A < 0: clipped low) and its KL large would show in a mean
    # that counted it; row 1's ratio is clipped high and counts
    old = logp + torch.tensor([[0.0], [-1.0], [0.0], [1.0]])
    ref = logp + torch.tensor([[0.0], [0.5], [0.0], [3.0]])
    mask = torch.tensor([[1, 0], [1, 0], [1, 0], [0, 0]])

    def inputs(T):
        return dict(
            prompt_ids=prompt, prompt_mask=torch.ones(4, 3, dtype=torch.long),
            completion_ids=completion[:, :T], completion_mask=mask[:, :T],
            advantages=torch.tensor([1.0, 1.0, 1.0, -1.0]), old_per_token_logps=old[:, :T],
            ref_per_token_logps=ref[:, :T], num_items_in_batch=torch.tensor(3.0),
        )  # fmt: skip

    def logged(t, T):
        t._metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
        loss = t._compute_loss(t.model, inputs(T))
        return loss.item(), {k: v[0] for k, v in t._metrics["train"].items()}

    loss_trl, want = logged(stock, 2)
    for T in (1, 2):
        loss, got = logged(ours, T)
        assert loss == pytest.approx(loss_trl, rel=1e-5)
        keys = ["kl", "entropy"] + [k for k in want if k.startswith("clip_ratio/")]
        for k in keys:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), (T, k)
    assert want["kl"] > 0 and want["clip_ratio/high_mean"] > 0  # the metrics the test is about
