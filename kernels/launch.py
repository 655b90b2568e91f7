"""Launch configurations: what a launcher runs, in a form that can also be compiled ahead of time.

Every launcher in kernels/ gets its launches from one `*_configs` function of its module (e.g.
policy_loss.row_stats_configs(N, V, dtype, ...)) and runs them; the AOT compile check
(`python -m fastrl.kernels.compile_check`) calls the same functions over a grid of shapes and
compiles each config for sm_80 and sm_90a. So the table of launch configurations exists once.

A `LaunchConfig` names the `@triton.jit` entry kernel, its grid, its constexprs, num_warps and
example values of its other arguments for the shape it was made for: a `Ptr` (a tensor's element
dtype and whether its data pointer is 16-byte aligned), an int or a float. The examples describe
the canonical layout of that shape (contiguous inputs; see each `*_configs` function): the
launcher passes its real arguments, whose strides may differ (Triton then specializes its integer
arguments differently: 16-divisible or not, 1 or not). Nothing here imports triton.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch


class Ptr(NamedTuple):
    """A tensor argument of a kernel: its element dtype, and whether its data pointer is a
    multiple of 16 bytes (a fresh allocation is; a view at an offset may not be)."""

    dtype: torch.dtype
    aligned: bool = True


class LaunchConfig(NamedTuple):
    """One kernel launch: `kernel[grid](*args, **constexprs, num_warps=num_warps, **options)`.

    kernel: the @triton.jit entry (a JITFunction; an InterpretedFunction under TRITON_INTERPRET);
    grid: the launch grid for the shape the config was made for;
    constexprs: ((name, value), ...) the tl.constexpr arguments;
    num_warps: warps per program;
    args: ((name, example), ...) every other argument in the kernel's order, with a `Ptr`, int
    or float example (what `compile_check` specializes and compiles it with);
    options: ((name, value), ...) other compile options of the launch (e.g. EXACT_PRODUCTS)."""

    kernel: Any
    grid: tuple[int, ...]
    constexprs: tuple[tuple[str, Any], ...]
    num_warps: int
    args: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, Any], ...] = ()

    @property
    def name(self) -> str:
        return self.kernel.__name__

    def constexpr(self, name: str):
        """The value of constexpr `name`."""
        return dict(self.constexprs)[name]

    def arg(self, name: str):
        """The example value of argument `name` (e.g. a split-V config's CHUNK)."""
        return dict(self.args)[name]

    def __call__(self, *args) -> None:
        """Launch on the real arguments (positional, in the kernel's order, constexprs left
        out)."""
        self.kernel[self.grid](
            *args, **dict(self.constexprs), num_warps=self.num_warps, **dict(self.options)
        )


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (triton.cdiv costs microseconds per call on the launch path)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


# Compile options of the kernels that read logits: no contraction of a product and a sum into
# one fused multiply-add. z' = z * (1 / tau) is formed, rounded, then has the row max m' (itself
# such a rounded product) subtracted: fused, fma(z, 1 / tau, -m') is the exact product minus
# the rounded one, about eps |z'| away from the 0 it should be at the row's maximum, and
# exp(z' - m') there is exp(+1e23) = inf at tau = 1e-30 (seen on an H200: an inf gradient that
# the interpreter, which rounds every operation, never shows). Without contraction the GPU
# computes what the interpreter and the torch path compute, operation by operation. Every
# fastrl kernel takes it (also the ones without such a difference: one rule, and triton 3.9
# warns that its default turns to this in 3.10).
EXACT_PRODUCTS = (("enable_fp_fusion", False),)


def config(kernel, grid, num_warps: int, args: dict, *, options=(), **constexprs) -> LaunchConfig:
    """A LaunchConfig from keyword constexprs, a dict of example arguments and `options`
    ((name, value) pairs of compile options, e.g. EXACT_PRODUCTS)."""
    return LaunchConfig(
        kernel, tuple(grid), tuple(constexprs.items()), int(num_warps), tuple(args.items()),
        tuple(options),
    )  # fmt: skip
