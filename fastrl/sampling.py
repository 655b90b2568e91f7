"""Rollout sampler. (Placeholder until issue 4 lands.)"""

import torch


def sample(logits, temperature=1.0, top_k=None, top_p=None, generator=None):
    z = logits.float()
    if temperature == 0:
        tokens = z.argmax(-1)
        logp_all = torch.log_softmax(z, -1)
    else:
        logp_all = torch.log_softmax(z / temperature, -1)
        tokens = torch.multinomial(logp_all.exp(), 1, generator=generator).squeeze(-1)
    logp = logp_all.gather(-1, tokens[:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return tokens, logp, entropy
