"""`scripts/soak.py` (a randomized soak of the gRPC cluster against transformers) passes on one
drawn configuration, and fails when a known bug is planted: a prefix cache that shares an
answer's KV pages as blocks although accepted paths mixed them (seed 13: EAGLE-3, pages of 4)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "soak.py"
ARGS = ["--seeds", "13", "--requests", "40", "--threads", "6", "--timeout", "5"]


@pytest.fixture(scope="module")
def soak():
    spec = importlib.util.spec_from_file_location("soak", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["soak"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    del sys.modules["soak"]


def test_a_drawn_configuration_passes(soak, copy_dir: Path, capsys) -> None:
    assert soak.draw(13, False).target["page_size"] == 4
    assert soak.main([*ARGS, "--sample", "--pair", str(copy_dir)]) == 0
    assert "seed 13: ok: " in capsys.readouterr().out


def test_a_planted_bug_fails_it(soak, copy_dir: Path, monkeypatch, capsys) -> None:
    import specmesh.runtime.prefix_cache as prefix_cache

    monkeypatch.setattr(prefix_cache, "_whole_pages", lambda table, size: [True] * len(table))
    assert soak.main([*ARGS, "--pair", str(copy_dir)]) == 1
    assert "seed 13: FAILED: " in capsys.readouterr().out
