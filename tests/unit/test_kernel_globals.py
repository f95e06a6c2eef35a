"""Every global a Triton kernel reads is a `tl.constexpr` instance. The interpreter (which the CPU
tests run) reads any global; a compiled kernel refuses a plain one, or one only annotated
``tl.constexpr``, at its first launch on a GPU (seeded sampling failed on every GPU so until the
Gumbel kernels' constants were made instances). This catches it here, without a GPU."""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import triton.language as tl

import specmesh.kernels


def _jit_functions():
    for info in pkgutil.iter_modules(specmesh.kernels.__path__):
        module = importlib.import_module(f"specmesh.kernels.{info.name}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # JITFunction and the interpreter's wrapper keep it
            if callable(fn) and getattr(fn, "__module__", None) == module.__name__:
                yield pytest.param(fn, id=f"{info.name}.{name}")


@pytest.mark.parametrize("fn", list(_jit_functions()))
def test_kernel_globals_are_constexpr(fn) -> None:
    plain = [
        name
        for name in fn.__code__.co_names
        if isinstance(fn.__globals__.get(name), (bool, int, float))
    ]
    assert not plain, (
        f"{fn.__name__} reads globals a compiled kernel refuses: {plain} (use tl.constexpr(value))"
    )


def test_the_scan_sees_kernels() -> None:
    names = {p.id for p in _jit_functions()}
    assert "gumbel._race_kernel" in names and "gumbel._mix32" in names, sorted(names)
    assert isinstance(importlib.import_module("specmesh.kernels.gumbel")._MASK32, tl.constexpr)
