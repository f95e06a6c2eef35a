"""Helpers shared by the kernel families: implementation dispatch and block-size arithmetic."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

F = TypeVar("F", bound=Callable)

IMPLS = ("torch", "triton")


def pick_impl(impl: str, torch_fn: F, triton_fn: F) -> F:
    """The function implementing one contract: ``"torch"`` (reference) or ``"triton"``."""
    if impl == "torch":
        return torch_fn
    if impl == "triton":
        return triton_fn
    raise ValueError(f"unknown kernel impl {impl!r}; choose one of {IMPLS}")


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (and >= 1): Triton block shapes must be powers of two."""
    return 1 << max(int(n) - 1, 0).bit_length()


def kernel_impl(attention_backend: str) -> str:
    """The implementation of the speculative kernels (tree build, tree verify) that
    goes with an attention backend: Triton beside the Triton / FlashInfer backends (on CUDA, or
    under the interpreter on CPU), the torch references beside the torch backend."""
    return "torch" if attention_backend == "torch" else "triton"
