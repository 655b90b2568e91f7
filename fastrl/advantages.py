"""Advantages and DAPO helpers. (Placeholder: delegates to the reference until issue 4 lands.)"""

from .reference import dynamic_sampling_filter, group_advantages, overlong_penalty, whiten
from .reference import gae as _gae


def gae(rewards, values, mask, gamma=1.0, lam=1.0, whiten=True):
    return _gae(rewards, values, mask, gamma, lam, whiten)


__all__ = ["dynamic_sampling_filter", "gae", "group_advantages", "overlong_penalty", "whiten"]
