"""Lazy compilation of the Triton kernels for the mode active at launch time.

`triton.jit` decides when it decorates a function whether the kernel runs compiled on the GPU
or in the Triton interpreter (`TRITON_INTERPRET=1`, used to test the kernels on the CPU).
`lazy_jit` defers that choice to each launch, so importing the kernel modules never fixes the
mode, and one process can check the kernels on the CPU and run them on a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
from triton import knobs


class LazyKernel:
    """A Triton kernel, jitted on first launch for the current mode (compiled or interpreted).

    Launch it like a `triton.jit` function: `kernel[grid](*args, **meta)`.
    """

    def __init__(self, fn: Callable[..., None]) -> None:
        self.fn = fn
        self._by_mode: dict[bool, Any] = {}

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., Any]:
        interpret = bool(knobs.runtime.interpret)
        kernel = self._by_mode.get(interpret)
        if kernel is None:
            kernel = self._by_mode[interpret] = triton.jit(self.fn)
        return kernel[grid]


def lazy_jit(fn: Callable[..., None]) -> LazyKernel:
    """Decorator: marks `fn` as a Triton kernel, jitted lazily (see `LazyKernel`)."""
    return LazyKernel(fn)
