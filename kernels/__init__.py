"""Triton kernels and their launchers (installed as `fastrl.kernels`). No autograd here."""

if __name__ == "kernels":  # imported as a top-level package (e.g. `python` run from the repo root)
    raise ImportError(
        "this folder is fastrl's Triton code and installs as `fastrl.kernels`; it is not the "
        "top-level `kernels` package (import fastrl.kernels instead)"
    )
