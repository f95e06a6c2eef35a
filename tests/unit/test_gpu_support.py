"""The GPU suites' helpers (`tests/gpu_support.py`) on CPU: the graph spy watches the runners the
engine uses, and the bf16 rounding check passes a bf16 engine's greedy tokens but not a token far
below the best."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import _hf_model
from gpu_support import assert_greedy_up_to_rounding, spy_graph_replays

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.target_service.runtime import TargetGraphs

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42]]


def test_spy_watches_the_runners_captured_again_at_the_handshake(tiny_dir: Path, monkeypatch):
    """As on a GPU: the target captures its graphs before the handshake, and again when the
    EAGLE-3 draft names its aux layers; the spy sees the verify rounds the new runners serve."""
    engine = Engine(tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
                    spec=SpecParams(2, 2, 4))  # fmt: skip
    t = engine.target
    captures: list[TargetGraphs] = []

    def capture() -> TargetGraphs:
        captures.append(TargetGraphs(t.model, t.cache, t.backend, mode="eager-static",
                                     max_bs=4, tree_sizes=(4,), aux=t.aux_layers))  # fmt: skip
        return captures[-1]

    monkeypatch.setattr(t, "_capture_graphs", capture)
    t.graphs = capture()  # at construction: no aux layers yet
    used = spy_graph_replays(engine)
    assert len(captures) == 2 and t.graphs is captures[1]  # the handshake captured again
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=4, ignore_eos=True))
    assert len(captures) == 2  # the engine's own handshake captured nothing
    assert "verify4" in used, used


def test_greedy_up_to_rounding_passes_bf16_tokens_not_far_ones(tiny_dir: Path) -> None:
    target = tiny_dir / "target"
    engine = Engine(target, target_config={"dtype": "bf16"})
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert_greedy_up_to_rounding(target, prompt, res.token_ids)
    prompt = PROMPTS[0]
    with torch.no_grad():
        row = _hf_model(str(target))(torch.tensor([prompt])).logits[0, -1]
    with pytest.raises(AssertionError):  # the fp32 model's worst token
        assert_greedy_up_to_rounding(target, prompt, [row.argmin().item()])
