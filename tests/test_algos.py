"""fastrl.train.algos: what differs between grpo / dapo / ppo, checked piece by piece against
SPEC 7 / 9 and the plain-PyTorch oracle (fastrl.reference), without running a trainer.

ppo_batch (terminal reward on the last counted token, KL shaping, GAE, whitening over counted
tokens), the critic's alignment (V_t from the state that predicts token t, left padding read
through the attention mask) and which rows an update may skip (`signal_rows`)."""

import contextlib

import torch

from fastrl import reference as ref
from fastrl.train import algos
from fastrl.train.config import TrainConfig, loss_config
from fastrl.train.rollout import Rollout

TOL = dict(rtol=1e-5, atol=1e-6)


def _rollout(lengths, truncated, T, prompt_ids=None, prompt_mask=None, completion_ids=None):
    """A Rollout whose completion mask is 1 on the first `lengths[i]` tokens of row i."""
    n = len(lengths)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).float()
    return Rollout(
        torch.ones(n, 1, dtype=torch.long) if prompt_ids is None else prompt_ids,
        torch.ones(n, 1, dtype=torch.long) if prompt_mask is None else prompt_mask,
        torch.zeros(n, T, dtype=torch.long) if completion_ids is None else completion_ids,
        mask,
        torch.zeros(n, T),
        torch.tensor(lengths),
        torch.tensor(truncated),
    )


class _FixedCritic:
    """A critic returning fixed values (N, T), whatever the rollout."""

    def __init__(self, values):
        self.values = values

    def __call__(self, rollout, idx=None):
        return self.values.clone()


# ----------------------------------------------------------------------------- ppo_batch
def test_ppo_batch_is_spec_gae_of_the_terminal_reward_with_kl_shaping():
    """SPEC 7 / algos docstring: the reward sits on the last counted token (lengths - 1), minus
    kl_coef * (old - ref) on every counted token; GAE with (gamma, lam) in that order; advantages
    whitened over the counted tokens only; returns = A + V, and advantages, returns and the
    critic's values are 0 at masked tokens (a NaN value there stays out). The expected numbers
    are the oracle's GAE and whitening of rewards placed by hand."""
    g = torch.Generator().manual_seed(0)
    lengths, T = [3, 5, 1], 5
    r = _rollout(lengths, [False, True, False], T)
    mask = r.completion_mask
    values = torch.randn(3, T, generator=g)
    values = torch.where(mask > 0, values, float("nan"))  # the critic's junk past the EOS
    old = 0.3 * torch.randn(3, T, generator=g)
    ref_logp = old + 0.2 * torch.randn(3, T, generator=g)
    rewards = torch.tensor([1.0, -0.5, 2.0])
    cfg = TrainConfig(algo="ppo", gamma=0.9, lam=0.7, kl_coef=0.1)

    batch = algos.ppo_batch(_FixedCritic(values), cfg, r, rewards, old, ref_logp,
                            contextlib.nullcontext)  # fmt: skip

    token_rewards = torch.zeros(3, T)
    for i, n in enumerate(lengths):
        token_rewards[i, n - 1] = rewards[i]  # the terminal reward on the last counted token
    token_rewards -= 0.1 * (old - ref_logp) * mask  # KL shaping (SPEC: reward - beta * KL)
    v0 = torch.where(mask > 0, values, 0.0)
    adv, ret = ref.gae(token_rewards, v0, mask, gamma=0.9, lam=0.7, whiten_advantages=False)
    want_adv = torch.where(mask > 0, ref.whiten(adv, mask), 0.0)
    want_ret = torch.where(mask > 0, ret, 0.0)
    torch.testing.assert_close(batch.advantages, want_adv, **TOL)
    torch.testing.assert_close(batch.returns, want_ret, **TOL)
    torch.testing.assert_close(batch.old_values, v0, rtol=0, atol=0)
    assert batch.old_logp is old and batch.ref_logp is ref_logp


# ----------------------------------------------------------------------------- the critic
def _gpt2(seed=0):
    """A tiny GPT-2 (learned absolute position embeddings: a wrong position id shows)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=16, n_positions=32, n_embd=16, n_layer=1, n_head=2,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPT2LMHeadModel(config)
    critic = algos.ValueModel(model).eval()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        torch.nn.init.normal_(critic.head.weight, std=1.0)  # zeros at init: every V would be 0
    return critic


def test_value_of_token_t_is_read_from_the_state_that_predicts_it():
    """V_t is the value of the state before token t (the hidden state at position P - 1 + t):
    changing completion token t changes V_{t+1} and later, never V_0..V_t. Reading the state
    after token t (one position late) lets V_t see the token it is supposed to judge."""
    critic = _gpt2()
    prompt = torch.tensor([[3, 4, 5]])
    c1 = torch.tensor([[6, 7, 8, 9]])
    c2 = c1.clone()
    c2[0, 2] = 12  # a different token 2
    r1 = _rollout([4], [False], 4, prompt, torch.ones_like(prompt), c1)
    r2 = _rollout([4], [False], 4, prompt, torch.ones_like(prompt), c2)
    with torch.no_grad():
        v1, v2 = critic(r1), critic(r2)
    assert v1.shape == (1, 4)
    torch.testing.assert_close(v2[:, :3], v1[:, :3], rtol=0, atol=0)  # V_0..V_2 before token 2
    assert (v2[:, 3] - v1[:, 3]).abs().item() > 1e-4


def test_value_model_reads_a_left_padded_prompt_as_the_unpadded_one():
    """Prompts are left-padded: position ids come from the attention mask (the first real token
    is position 0), so a padded prompt gets the same values as the same prompt unpadded. Plain
    0..P+T-1 positions shift every real token by the padding (a model with absolute position
    embeddings then gives other values)."""
    critic = _gpt2()
    completion = torch.tensor([[6, 7, 8]])
    plain = _rollout([3], [False], 3, torch.tensor([[3, 4]]), torch.ones(1, 2, dtype=torch.long),
                     completion)  # fmt: skip
    padded = _rollout([3], [False], 3, torch.tensor([[0, 0, 3, 4]]), torch.tensor([[0, 0, 1, 1]]),
                      completion)  # fmt: skip
    with torch.no_grad():
        want, got = critic(plain), critic(padded)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- signal rows
def test_ppo_trains_every_row_with_a_counted_token_whatever_its_advantages():
    """ppo: the value loss moves the critic wherever a token counts, so a sequence whose
    advantages are all 0 is still trained; only a sequence with no counted token is not.
    (The advantage-zero skip is grpo / dapo's, for (N,) per-sequence advantages.)"""
    cfg = TrainConfig(algo="ppo")
    mask = torch.tensor([[1.0, 1, 0], [1, 0, 0], [0, 0, 0], [1, 1, 1]])
    adv = torch.tensor([[0.0, 0, 0], [0.5, 0, 0], [0, 0, 0], [0, -1, 0]])  # (N, T), N != T
    rows = algos.signal_rows(cfg, loss_config(cfg), adv, mask, False)
    assert rows.device.type == "cpu" and rows.tolist() == [True, True, False, True]


# ----------------------------------------------------------------------------- grpo / dapo
def test_group_rows_are_spec_group_advantages_by_group_size():
    """grpo / dapo advantages (SPEC 7): per group of cfg.group_size responses,
    (R - mean) / (unbiased std + 1e-6), by hand; and with no KL / entropy term the trained rows
    are those with a counted token and a non-zero advantage (an all-equal group trains nothing).
    Groups of 4: [1, 0, 0, 0] (mean 1/4, std 1/2), [1, 1, 0, 0] (mean 1/2, std sqrt(1/3)) and
    [1, 1, 1, 1] (all equal: 0)."""
    cfg = TrainConfig(algo="dapo", group_size=4)
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0, 1, 1, 1, 1])
    mask = torch.ones(12, 3)
    mask[1] = 0  # a response with nothing counted
    adv, trained = algos.group_rows(cfg, loss_config(cfg), rewards, mask, False)
    s1, s2 = 0.5 + 1e-6, (1 / 3) ** 0.5 + 1e-6
    want = [0.75 / s1, -0.25 / s1, -0.25 / s1, -0.25 / s1, 0.5 / s2, 0.5 / s2, -0.5 / s2,
            -0.5 / s2, 0, 0, 0, 0]  # fmt: skip
    torch.testing.assert_close(adv, torch.tensor(want), **TOL)
    assert trained.tolist() == [True, False] + [True] * 6 + [False] * 4


def test_group_advantages_scale_follows_scale_rewards():
    """--loss dr_grpo trained on Dr.GRPO's aggregation with the std-scaled advantages of GRPO
    (an audit helper's find): --scale-rewards (auto: none for dr_grpo, group otherwise) picks
    SPEC 7's scale, against the plain-PyTorch oracle."""
    rewards = torch.tensor([1.0, 0.0, 0.0, 3.0, 2.0, 2.0, 2.0, 2.0])
    mask = torch.ones(8, 3)
    cases = [
        (dict(), "group"),
        (dict(loss="dr_grpo"), "none"),
        (dict(scale_rewards="none"), "none"),
        (dict(loss="dr_grpo", scale_rewards="group"), "group"),
        (dict(algo="dapo"), "group"),
    ]
    for fields, scale in cases:
        cfg = TrainConfig(group_size=4, **fields)
        cfg.validate()
        adv, _ = algos.group_rows(cfg, loss_config(cfg), rewards, mask, ref=False)
        want = ref.group_advantages(rewards, group_size=4, scale=scale)
        torch.testing.assert_close(adv, want, **TOL, msg=str(fields))
    assert not torch.allclose(*(ref.group_advantages(rewards, group_size=4, scale=s)
                                for s in ("group", "none")))  # fmt: skip
