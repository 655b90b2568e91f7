"""Rollouts for any Hugging Face causal LM: G samples per prompt with a KV cache and fastrl's
sampler, then the log-probs of pi_old and pi_ref from one no-grad forward each.

Also here: loading a local model (`load_model`) and the embedded default, a tiny random-init
Qwen2 decoder over a character-level tokenizer shipped in `fastrl/assets/` (`default_model`,
`default_tokenizer`). Nothing here downloads anything.

Shapes: B prompts, G samples each, N = B * G sequences, P padded prompt length, T generated
length (<= max_new_tokens), V vocabulary.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from .. import chunked
from ..losses import logprobs
from ..sampling import sample, truncate_logits

ASSETS = os.path.join(os.path.dirname(__file__), "assets")
TOKENIZER_FILE = os.path.join(ASSETS, "tokenizer.json")
PAD, EOS, UNK = "<pad>", "<eos>", "<unk>"
CHARS = "0123456789+-*=[]()., ?:abcdefghijklmnopqrstuvwxyz"


# --------------------------------------------------------------------------- tokenizer / models
def build_char_tokenizer(directory: str = ASSETS) -> None:
    """Write the embedded model's tokenizer (tokenizer.json, tokenizer_config.json) into
    `directory`: one token per character of CHARS (ids 3...), after <pad>, <eos>, <unk>.

    It is a Qwen2Tokenizer (byte-level BPE, Qwen's pre-tokenizer, NFC) whose vocabulary holds
    just those characters, in the byte-level alphabet (a space is `Ġ`), and no merges. That is
    deliberate: for a `qwen2` model directory, transformers 5 `AutoTokenizer` always builds a
    Qwen2Tokenizer from the saved vocabulary and ignores any other pipeline in tokenizer.json,
    so an export of the embedded model reloads token for token only with this tokenizer (a
    plain character tokenizer reloaded that way dropped every space). Like every Qwen2Tokenizer
    it has no unknown token: a character outside CHARS is dropped, the same when training and
    after reloading an export (`fastrl train` refuses a task that uses one with the embedded
    model). Needs transformers >= 5; the files ship with the package."""
    from tokenizers import pre_tokenizers
    from transformers import Qwen2Tokenizer

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    chars = [byte_level.pre_tokenize_str(c)[0][0] for c in CHARS]
    vocab = {tok: i for i, tok in enumerate([PAD, EOS, UNK, *chars])}
    tok = Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        unk_token=UNK,
        eos_token=EOS,
        pad_token=PAD,
        bos_token=None,
        padding_side="left",
    )
    tok.save_pretrained(directory)


def default_tokenizer():
    """The embedded character-level tokenizer, loaded the way `AutoTokenizer` loads it from an
    export of the embedded model (offline), so that the two give the same ids for every string.
    """
    from transformers import AutoTokenizer

    if not os.path.isfile(TOKENIZER_FILE):  # pragma: no cover - the files ship with the package
        build_char_tokenizer()
    return AutoTokenizer.from_pretrained(ASSETS, local_files_only=True, padding_side="left")


def default_model(vocab_size: int, seed: int = 0, hidden: int = 64, layers: int = 2):
    """A tiny random-init Qwen2 decoder (built from a config, nothing downloaded)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    return model


def attn_implementation(device: torch.device, compute_dtype: str) -> str:
    """flash_attention_2 for a run on CUDA in bf16 / fp16, on a GPU of compute capability 8.0
    or newer, when transformers finds a usable flash_attn (installed, importable), else sdpa:
    flash_attn has no CPU and no fp32 kernels (an fp32 run on CUDA, or a CPU run on a GPU
    machine, failed at its first forward), it refuses GPUs older than Ampere at the first
    forward (transformers' check does not look at the GPU when flash_attn imports), and an
    installed but unusable flash_attn raised ImportError at load."""
    if device.type != "cuda" or compute_dtype not in ("bf16", "fp16"):
        return "sdpa"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "sdpa"
    from transformers.utils import is_flash_attn_2_available

    return "flash_attention_2" if is_flash_attn_2_available() else "sdpa"


# what AutoTokenizer reads from a model directory (fast, slow sentencepiece / BPE / WordPiece)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def _safetensors_error() -> type[BaseException]:
    """safetensors' error for a corrupt or truncated file (not a ValueError / OSError), or
    OSError when safetensors is absent (transformers then reads no .safetensors at all)."""
    try:
        from safetensors import SafetensorError
    except ImportError:
        return OSError
    return SafetensorError


def load_model(path: str | None, seed: int = 0, dtype: torch.dtype | None = None):
    """(model, tokenizer): the embedded default when `path` is None, else a local HF causal LM
    directory (config.json + weights + tokenizer files). Raises ValueError saying what to fix."""
    if path is None:
        tok = default_tokenizer()
        return default_model(len(tok), seed=seed), tok
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if not os.path.isdir(path) or not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(
            f"--model {path!r} is not a local Hugging Face model directory (no config.json); "
            "pass a directory written by save_pretrained, or omit --model for the embedded one"
        )

    def load(attn: str):
        return AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, attn_implementation=attn, dtype=dtype or torch.float32
        )

    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
        try:  # sdpa; the run's choice is set once its device is known
            model = load("sdpa")
        except ValueError as e:  # an architecture without SDPA (Gemma2, Bloom, GPT-Neo, ...)
            if "scaled_dot_product_attention" not in str(e):
                raise
            model = load("eager")
    except (ValueError, OSError, KeyError, _safetensors_error()) as e:  # (a corrupt weights file)
        raise ValueError(
            f"--model {path!r} is not a causal LM that transformers can load: {e}"
        ) from e
    # without them transformers may build an empty tokenizer from config.json alone
    if not any(os.path.isfile(os.path.join(path, f)) for f in TOKENIZER_FILES):
        raise ValueError(
            f"--model {path!r} has no tokenizer files (none of {', '.join(TOKENIZER_FILES)}); "
            "save the tokenizer beside the model (tokenizer.save_pretrained(path))"
        )
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, padding_side="left")
    except (ValueError, OSError) as e:
        raise ValueError(f"--model {path!r} has no usable tokenizer files: {e}") from e
    rows = model.get_input_embeddings().num_embeddings
    if len(tok) > rows:
        raise ValueError(
            f"--model {path!r}: its tokenizer has {len(tok)} tokens but the model's embedding "
            f"only {rows} rows (token ids >= {rows} would index out of range); save the "
            "tokenizer the model was trained with"
        )
    if tok.eos_token_id is None:
        eos = config.eos_token_id
        if eos is None:
            raise ValueError(f"--model {path!r}: neither the tokenizer nor config has an EOS token")
        tok.eos_token_id = eos if isinstance(eos, int) else eos[0]
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _cache_argument(model) -> str:
    """The forward's name for the KV cache: `cache` (transformers >= 5.2x, which deprecates
    `past_key_values` and will remove it) or `past_key_values` (older releases)."""
    forward = getattr(model, "module", model).forward  # a DDP wrapper's forward takes **kwargs
    return "cache" if "cache" in inspect.signature(forward).parameters else "past_key_values"


def _cache_of(out):
    """The KV cache of a forward's output, under either name (see `_cache_argument`)."""
    return out["cache"] if "cache" in out else out.past_key_values


def eos_ids(tokenizer, model=None) -> list[int]:
    """Every token id that ends a completion: the tokenizer's EOS first (the one the supervised
    warm-up teaches, e.g. Qwen2.5-Instruct's <|im_end|>), then the generation config's others in
    ascending order."""
    gen = getattr(model, "generation_config", None)
    extra = getattr(gen, "eos_token_id", None) if gen is not None else None
    extra = {extra} if isinstance(extra, int) else set(extra or ())
    first = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return first + sorted(i for i in extra if i is not None and i not in first)


# --------------------------------------------------------------------------- rollout
@dataclass
class Rollout:
    """A batch of N = B * G completions; sequence i answers prompt i // G.

    Row t of the completion tensors is the t-th generated token; positions after the EOS (and
    the whole tail of shorter sequences) hold the pad id and mask 0; the EOS itself counts."""

    prompt_ids: Tensor  # (N, P) int64, left-padded
    prompt_mask: Tensor  # (N, P) int64, 1 = real prompt token
    completion_ids: Tensor  # (N, T) int64
    completion_mask: Tensor  # (N, T) float32, 1 up to and including the EOS
    sampler_logp: Tensor  # (N, T) float32, the sampler's log-prob of each token (0 when masked)
    lengths: Tensor  # (N,) int64, completion lengths (EOS included)
    truncated: Tensor  # (N,) bool, True when no EOS came within max_new_tokens
    group_size: int = 1

    def select(self, idx: Tensor) -> Rollout:
        """The sequences `idx` (N',) as a new Rollout (group_size kept)."""
        kw = {f.name: getattr(self, f.name) for f in fields(self)}
        return Rollout(**{k: (v[idx] if isinstance(v, Tensor) else v) for k, v in kw.items()})

    @staticmethod
    def cat(parts: list[Rollout], pad_id: int = 0) -> Rollout:
        """Concatenate rollouts, re-padding prompts (left) and completions (right) with
        `pad_id` (mask 0)."""
        P = max(r.prompt_ids.shape[1] for r in parts)
        T = max(r.completion_ids.shape[1] for r in parts)

        def lpad(x, n, v):
            return torch.nn.functional.pad(x, (n - x.shape[1], 0), value=v)

        def rpad(x, n, v):
            return torch.nn.functional.pad(x, (0, n - x.shape[1]), value=v)

        return Rollout(
            prompt_ids=torch.cat([lpad(r.prompt_ids, P, pad_id) for r in parts]),
            prompt_mask=torch.cat([lpad(r.prompt_mask, P, 0) for r in parts]),
            completion_ids=torch.cat([rpad(r.completion_ids, T, pad_id) for r in parts]),
            completion_mask=torch.cat([rpad(r.completion_mask, T, 0.0) for r in parts]),
            sampler_logp=torch.cat([rpad(r.sampler_logp, T, 0.0) for r in parts]),
            lengths=torch.cat([r.lengths for r in parts]),
            truncated=torch.cat([r.truncated for r in parts]),
            group_size=parts[0].group_size,
        )


def left_pad(prompts: list[list[int]], pad_id: int, device=None) -> tuple[Tensor, Tensor]:
    """(ids, mask), both (len(prompts), max length) int64, padded on the left."""
    P = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), P), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), P), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, P - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[i, P - len(p) :] = 1
    return ids.to(device), mask.to(device)


# the names of learned absolute position tables (GPT-2's wpe, OPT's / BART's embed_positions,
# GPT-Neo's / BERT-style position_embeddings); rotary / ALiBi models have none
_POSITION_TABLES = ("wpe", "embed_positions", "position_embeddings")


def position_limit(model) -> int | None:
    """How many positions a model with learned absolute positions (a table of `n_positions` /
    `max_position_embeddings` rows) takes; None for rotary / ALiBi models, which extrapolate."""
    learned = any(
        isinstance(m, torch.nn.Embedding) and name.rsplit(".", 1)[-1] in _POSITION_TABLES
        for name, m in model.named_modules()
    )
    config = getattr(model, "config", None)
    limit = getattr(config, "n_positions", None) or getattr(config, "max_position_embeddings", None)
    return limit if learned and isinstance(limit, int) else None


def check_positions(model, prompt_len: int, new_tokens: int, what: str) -> None:
    """ValueError when the longest prompt (`prompt_len` tokens) plus `new_tokens` needs more
    positions than the model's position_limit (it would fail deep in its embedding with an
    IndexError); `what` names the option that sets `new_tokens` and how to stay within it."""
    limit = position_limit(model)
    if limit is not None and prompt_len + new_tokens > limit:
        raise ValueError(
            f"{what}: a prompt of {prompt_len} tokens plus {new_tokens} more needs "
            f"{prompt_len + new_tokens} positions, but the model has {limit} learned positions "
            f"(its config's n_positions / max_position_embeddings)"
        )


@torch.no_grad()
def generate(
    model,
    prompts: list[list[int]],
    group_size: int,
    max_new_tokens: int,
    eos_token_id: int | list[int],
    pad_token_id: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
    sync_stop: bool = False,
    check_every: int | None = None,
) -> Rollout:
    """Sample `group_size` completions for each prompt (token id lists) with a KV cache.

    Every step draws the next token of all unfinished sequences with `fastrl.sample` on the last
    logits row (temperature 0 = greedy) and records its log-prob under the sampling distribution.
    A sequence stops at its first EOS or after `max_new_tokens` tokens; the loop stops when all
    have stopped (with `sync_stop`, when they have on every rank: a sharded model's forwards are
    collectives, so every rank must make the same number). Positions are counted from the first
    real prompt token, as in HF `generate`.

    check_every: the steps between the host's looks at whether all have stopped (each look
    waits for the device); None: 8 on a GPU with a `generator` or greedy (temperature 0, which
    draws nothing), so that the host queues the next steps' kernels while the device runs,
    else 1. Steps run past the one where all had stopped are dropped and the generator is put
    back as it was after that step: the rollout and the generator's next draws are the same
    for every value (at most check_every - 1 decode forwards more)."""
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    device = next(model.parameters()).device
    eos = torch.tensor(
        [eos_token_id] if isinstance(eos_token_id, int) else eos_token_id, device=device
    )
    longest = max(map(len, prompts), default=0)
    check_positions(model, longest, max_new_tokens, f"--max-new-tokens {max_new_tokens}")
    ids, attn = left_pad([p for p in prompts for _ in range(group_size)], pad_token_id, device)
    N = ids.shape[0]
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(
        input_ids=ids, attention_mask=attn, position_ids=positions, use_cache=True, logits_to_keep=1
    )
    cache_arg = _cache_argument(model)
    past, logits = _cache_of(out), out.logits[:, -1]  # (N, V)
    next_pos = positions[:, -1] + 1  # (N,)
    done = torch.zeros(N, dtype=torch.bool, device=device)
    toks, logps, masks = [], [], []
    # draws from the default generator (no `generator`, not greedy) could not be put back
    restorable = generator is not None or (not isinstance(temperature, Tensor) and temperature == 0)
    if check_every is None:
        check_every = 8 if device.type == "cuda" and restorable else 1
    if check_every < 1 or (check_every > 1 and not restorable):
        raise ValueError(
            f"check_every must be >= 1, and 1 when sampling without a generator (the default "
            f"one's draws could not be put back), got {check_every}"
        )
    stopped, states = [], []  # since the last look: done.all() (device) and generator states
    for step in range(max_new_tokens):
        tok, logp, _ = sample(
            logits.float(), temperature=temperature, top_k=top_k, top_p=top_p, generator=generator
        )
        alive = ~done
        tok = torch.where(alive, tok, torch.full_like(tok, pad_token_id))
        toks.append(tok)
        logps.append(torch.where(alive, logp.float(), 0.0))
        masks.append(alive.float())
        done = done | torch.isin(tok, eos)
        last = step == max_new_tokens - 1  # (then no forward for a next token)
        if last and check_every == 1:
            break
        stopped.append(done.all())
        if check_every > 1 and generator is not None:
            states.append(generator.get_state())
        if last or len(stopped) == check_every:
            flags = torch.stack(stopped).to(torch.int32)  # (k,)
            if sync_stop and torch.distributed.is_initialized():  # stopped on every rank
                torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MIN)
            hit = flags.nonzero()  # the look: one host sync
            if hit.numel():
                first = int(hit[0, 0])  # the step all had stopped at, in this window
                end = step - (len(stopped) - 1) + first + 1
                del toks[end:], logps[end:], masks[end:]
                if first < len(stopped) - 1 and generator is not None:
                    generator.set_state(states[first])
                break
            if last:
                break
            stopped.clear()
            states.clear()
        attn = torch.cat([attn, torch.ones_like(attn[:, :1])], dim=1)
        out = model(
            input_ids=tok[:, None],
            attention_mask=attn,
            position_ids=next_pos[:, None],
            use_cache=True,
            **{cache_arg: past},
        )
        past, logits = _cache_of(out), out.logits[:, -1]
        next_pos = next_pos + 1
    completion_mask = torch.stack(masks, 1)
    return Rollout(
        prompt_ids=ids,
        prompt_mask=attn[:, : ids.shape[1]],
        completion_ids=torch.stack(toks, 1),
        completion_mask=completion_mask,
        sampler_logp=torch.stack(logps, 1),
        lengths=completion_mask.sum(1).long(),
        truncated=~done,
        group_size=group_size,
    )


def forward_completion_logits(model, rollout: Rollout, idx: Tensor | None = None):
    """The model's logits over the completion: a (n, T, V) VIEW `logits[:, P-1:-1]` of one
    forward over [prompt | completion] (rows `idx` of the rollout, all when None)."""
    p_ids, p_mask, c_ids = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids
    if idx is not None:
        p_ids, p_mask, c_ids = p_ids[idx], p_mask[idx], c_ids[idx]
    P = p_ids.shape[1]
    input_ids = torch.cat([p_ids, c_ids], dim=1)
    attn = torch.cat([p_mask, torch.ones_like(c_ids)], dim=1)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions, use_cache=False)
    return out.logits[:, P - 1 : -1], out


def truncate_like_sampler(
    logits: Tensor,
    tokens: Tensor,
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
) -> Tensor:
    """`logits` (n, T, V) with -inf outside the top-k / top-p support of softmax(logits / T)
    (`fastrl.sampling.truncate_logits`, the sampler's rule), the token of each row always kept:
    log-probs of the result are under the truncated, renormalised distribution the rollout
    sampled from (for the model that sampled), and always finite. Unchanged (the same tensor)
    without top-k / top-p. Differentiable (a masked copy)."""
    V = logits.shape[-1]
    if (top_k is None or top_k >= V) and (top_p is None or top_p >= 1):
        return logits
    flat = logits.detach().reshape(-1, V)
    keep = torch.empty(flat.shape, dtype=torch.bool, device=flat.device)
    # rows in the torch path's chunks (chunked.chunk_rows: 32 MB of fp32): the truncation holds
    # a sorted copy, its order (int64) and masks, ~25 bytes a logit (16 x 512 rows of
    # V = 151936 at once: ~30 GB)
    rows = chunked.chunk_rows(V)
    for r0 in range(0, flat.shape[0], rows):
        z = flat[r0 : r0 + rows].float() / temperature
        keep[r0 : r0 + rows] = torch.isfinite(truncate_logits(z, top_k, top_p))
    keep.scatter_(1, tokens.reshape(-1, 1), True)
    return logits.masked_fill(~keep.view(logits.shape), float("-inf"))


def completion_hidden(model, rollout: Rollout, idx: Tensor | None = None):
    """(hidden, lm_head): the last hidden states over the completion, a (n, T, H) view
    `h[:, P-1:-1]`, and the model's output embedding module, from one forward that computes the
    logits of the last position only (`logits_to_keep=1`): the caller applies the LM head
    through `fastrl.linear_logprobs` / `fused_linear_policy_loss`, never holding (n, T, V).
    Under FSDP2 the forward leaves the root's parameters (the LM head) unsharded, so
    `lm_head.weight` is then the full weight and its gradient is reduce-scattered as usual."""
    captured = {}
    handle = _capture_hidden(model, captured)
    try:
        p_ids, p_mask, c_ids = rollout.prompt_ids, rollout.prompt_mask, rollout.completion_ids
        if idx is not None:
            p_ids, p_mask, c_ids = p_ids[idx], p_mask[idx], c_ids[idx]
        P = p_ids.shape[1]
        attn = torch.cat([p_mask, torch.ones_like(c_ids)], dim=1)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        model(
            input_ids=torch.cat([p_ids, c_ids], dim=1),
            attention_mask=attn,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=1,
        )
    finally:
        handle.remove()
    return captured["h"][:, P - 1 : -1], model.get_output_embeddings()


def _capture_hidden(model, captured: dict):
    """A forward hook putting the last hidden states of `model`'s decoder (the module that
    `get_decoder()` names, OPT's `model.decoder` included; else its base model) into
    captured["h"]; returns its handle."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, model.base_model_prefix)

    def hook(module, args, out):
        captured["h"] = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    return decoder.register_forward_hook(hook)


# config fields of a transform between the LM head and the logits (Gemma2 / 3's softcap;
# Cohere's, Granite's and Falcon-H1's scales, which the forward check below catches as well)
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling",
                     "lm_head_multiplier")  # fmt: skip


@torch.no_grad()
def lm_head_fusable(model, top_k=None, top_p=None) -> bool:
    """Whether log-probs can go through `completion_hidden` + the fused LM-head path: a plain
    nn.Linear output embedding, no top-k / top-p truncation (that needs the logits), and the
    model's own logits equal to that head applied to the hidden states `completion_hidden`
    takes, checked on one short forward: a model that scales or caps its logits after the
    head (Gemma2's softcap, Cohere's logit_scale, Granite's logits_scaling, ...) or whose
    decoder output is not the head's input does not take the fused path (a list of config
    names missed Granite, whose sampled and trained log-probs then differed by 2 nats). A
    softcap (tanh(z / c) c) is refused by its config field: at the small logits of a fresh
    model it is invisible to the check and grows with training."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or top_k is not None or top_p is not None:
        return False
    config = getattr(model, "config", None)
    if any(getattr(config, k, None) is not None for k in _LOGIT_TRANSFORMS):
        return False
    ids = torch.arange(min(4, head.weight.shape[0]), device=head.weight.device)[None]
    captured = {}
    handle = _capture_hidden(model, captured)
    try:
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()
    except (TypeError, ValueError):  # e.g. a forward without logits_to_keep
        return False
    finally:
        handle.remove()
    h = captured.get("h")
    if h is None or h.shape[-1] != head.weight.shape[1]:
        return False
    bias = None if head.bias is None else head.bias.float()
    mine = torch.nn.functional.linear(h[:, -1].float(), head.weight.float(), bias)
    return mine.shape == logits.shape and bool(torch.allclose(mine, logits, rtol=1e-4, atol=1e-4))


@torch.no_grad()
def sequence_logprobs(
    model,
    rollout: Rollout,
    temperature: float = 1.0,
    chunk: int | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    lm_head: bool = False,
) -> Tensor:
    """Log-probs (N, T) fp32 of the completion tokens under `model` (pi_old or pi_ref): one
    no-grad forward through `fastrl.logprobs` (in chunks of `chunk` sequences when given), under
    the top-k / top-p truncation of the rollout when given (`truncate_like_sampler`). With
    `lm_head`: from the last hidden states through `fastrl.linear_logprobs` (never (N, V)).

    This is always recomputed rather than taken from the sampler: the sampler's numbers come from
    incremental KV-cache forwards, which agree with a full forward only up to rounding (and not
    at all under a different inference engine or dtype), so the trainer uses these as pi_old and
    the sampler's only for metrics (and rollout IS when enabled)."""
    N = rollout.completion_ids.shape[0]
    chunk = chunk or N
    parts = []
    for s in range(0, N, chunk):
        idx = torch.arange(s, min(s + chunk, N), device=rollout.completion_ids.device)
        tokens = rollout.completion_ids[idx]
        if lm_head:
            from ..linear import linear_logprobs

            hidden, head = completion_hidden(model, rollout, idx)
            w = head.weight
            parts.append(
                linear_logprobs(
                    hidden.to(w.dtype),
                    w,
                    tokens,
                    bias=head.bias,
                    temperature=temperature,
                    mask=rollout.completion_mask[idx],
                ).float()
            )
            continue
        logits, _ = forward_completion_logits(model, rollout, idx)
        logits = truncate_like_sampler(logits, tokens, temperature, top_k, top_p)
        mask = rollout.completion_mask[idx]  # (padding rows are not read)
        parts.append(logprobs(logits, tokens, temperature=temperature, mask=mask).float())
    return torch.cat(parts) * rollout.completion_mask
