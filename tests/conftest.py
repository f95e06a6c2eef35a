"""Shared fixtures: tiny checkpoints built once per session, and the transformers oracle."""

from __future__ import annotations

import os
import sys
from functools import cache
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
sys.path.insert(0, str(Path(__file__).parent))  # test helpers: grpc_harness
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama target and a matching random EAGLE-3 draft (reduced draft vocab)."""
    from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target

    root = tmp_path_factory.mktemp("tiny")
    make_tiny_target(root / "target")
    make_tiny_eagle3(root / "draft", root / "target", draft_vocab_size=200)
    return root


@cache
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(
    model_dir: str | Path, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()
) -> list[int]:
    """transformers greedy generation, cut after the first stop id (inclusive)."""
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids),  # never infer padding from the ids
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


@pytest.fixture(scope="session")
def oracle():
    return hf_greedy


@pytest.fixture(scope="module")
def stack(tiny_dir: Path, oracle):
    """In-process gRPC stack (target, EAGLE-3 draft, router) shared by a test module."""
    from grpc_harness import open_stack

    yield from open_stack(tiny_dir, oracle)
