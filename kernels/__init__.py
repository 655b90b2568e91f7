"""Triton kernels and their launchers, installed as `fastrl.kernels`. No autograd here.

This package must stay cheap and side-effect free to import, and must not define `__version__`:
when Python runs from the repository root, transformers' probe for the unrelated top-level
`kernels` project finds this folder, imports it, sees no version and (correctly) moves on.
"""
