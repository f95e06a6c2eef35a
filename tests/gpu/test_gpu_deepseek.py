"""A DeepSeek-V3 target (MLA + MoE, the latent cache) and its own NextN layer as the MTP draft
on a CUDA device: the torch and Triton backends, eager and in CUDA graphs, greedy against
transformers' fp32 tokens (computed on CPU), the captured runners serving the rounds, and both
caches empty afterwards. Skipped without a CUDA device (``pytest -m gpu``; `scripts/gpu_check.sh`
runs it)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_accepted
from gpu_support import cuda_engine, spy_graph_replays

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two layers (dense, then MoE) and a NextN layer: the model family's every path."""
    from specmesh.runtime.tiny import make_tiny_deepseek

    return make_tiny_deepseek(tmp_path_factory.mktemp("gpu_deepseek") / "target",
                              num_hidden_layers=2, nextn=True)  # fmt: skip


@pytest.fixture(scope="module")
def predictive(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One MoE layer and a NextN layer copying it: its drafts are accepted (a random NextN
    layer's never are, and then no accepted path's latent KV is ever kept)."""
    from specmesh.runtime.tiny import make_tiny_deepseek

    return make_tiny_deepseek(tmp_path_factory.mktemp("gpu_deepseek_mtp") / "target",
                              num_hidden_layers=1, first_k_dense_replace=0,
                              nextn_copies_layer=0)  # fmt: skip


@pytest.mark.parametrize(
    ("backend", "graphs"), [("torch", False), ("triton", False), ("triton", True)]
)
@pytest.mark.parametrize("kind", ["plain", "mtp"])
def test_deepseek_greedy_equals_transformers_on_cuda(
    deepseek: Path, predictive: Path, oracle, backend: str, graphs: bool, kind: str
) -> None:
    """Plain decoding on two layers (dense, then MoE); MTP on one MoE layer whose NextN layer
    copies it, so rounds accept draft tokens."""
    spec = SpecParams(3, 4, 8)  # top-4 trees: the MLA kv-index buffers sized by topk (seed 004)
    model = predictive if kind == "mtp" else deepseek
    draft = model if kind == "mtp" else None
    engine = cuda_engine(model, backend, graphs, "mtp" if draft else None, draft, spec,
                         max_batch_size=4)  # fmt: skip
    assert (engine.target.graphs is not None) == graphs
    used = spy_graph_replays(engine) if graphs else set()
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == oracle(model, prompt, MAX_NEW), (backend, graphs, kind)
    if draft:
        assert_accepted(results, min_tokens=len(PROMPTS))
    if graphs:
        assert ("verify8" if draft else "decode") in used, used
    assert engine.target.num_requests == 0 and engine.target.kv_slots()[0] == 0
    assert engine.draft is None or engine.draft.kv_slots()[0] == 0
