"""Test helpers for the kernel tests (imported by ``tests/unit/test_kernels_*.py`` only).

Triton kernels run on CPU tensors only under ``TRITON_INTERPRET=1``, which must be set before
the first kernel module is imported (``triton.jit`` reads it at decoration time): each test
module sets it at its top when no CUDA device is present.
"""

from __future__ import annotations

import os

import torch


def kernel_devices() -> list:
    """``pytest.param`` per device the Triton kernels can run on here, the others skipped."""
    import pytest

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return [
        pytest.param(
            "cpu", marks=pytest.mark.skipif(not interpret, reason="CPU needs TRITON_INTERPRET=1")
        ),
        pytest.param(
            "cuda",
            marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
        ),
    ]


def cpu_triton(value: str = "triton"):
    """``pytest.param(value)`` for a test that runs Triton kernels on CPU tensors: skipped unless
    the interpreter is on (on a CUDA machine the tests leave it off, so Triton compiles)."""
    import pytest

    interpret = os.environ.get("TRITON_INTERPRET") == "1"
    return pytest.param(
        value, marks=pytest.mark.skipif(not interpret, reason="CPU Triton needs TRITON_INTERPRET=1")
    )
