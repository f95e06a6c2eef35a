"""The static-shape (CUDA-graph) paths of a DeepSeek-V3 target and its NextN draft on the Triton
backend, run eagerly on CPU (``mode="eager-static"``, `kernels.mla_attention` interpreted):
target decode and verify and the draft's whole search (`SearchGraphs`) read their metadata from the runners'
static buffers through `TritonBackend`'s graph hooks, padding rows included, and still give
transformers' fp32 greedy tokens. On a GPU the same runners capture CUDA graphs (not run here:
these tests have no GPU)."""

from __future__ import annotations

from pathlib import Path

from conftest import hf_greedy

from specmesh.kernels.testing import cpu_triton
from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.runtime.tiny import make_tiny_deepseek
from specmesh.target_service.runtime import TargetGraphs

pytestmark = list(cpu_triton().marks)
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42]]


def test_target_and_nextn_draft_through_static_paths(tmp_path: Path, monkeypatch) -> None:
    """Three requests (bucket 4: one padding row writing only the scratch slot), plain decoding
    and MTP trees; every runner served batches through the MLA kernel and no KV is left held.
    The MoE takes the path a CUDA graph captures (no host sync): a decode step's (token,
    expert) pairs on the experts the runners stacked, a verify's every expert on every row."""
    from specmesh.runtime.attention import triton_backend
    from specmesh.runtime.models import moe

    mla_calls, pair_calls = [], []
    mla, pairs = triton_backend.mla_attention, moe.routed_experts
    monkeypatch.setattr(triton_backend, "mla_attention",
                        lambda *a, **k: mla_calls.append(1) or mla(*a, **k))  # fmt: skip
    monkeypatch.setattr(moe, "routed_experts", lambda *a: pair_calls.append(1) or pairs(*a))
    monkeypatch.setattr(moe, "dense_experts", lambda x: True)
    d = make_tiny_deepseek(tmp_path / "one", num_hidden_layers=1, first_k_dense_replace=0,
                           nextn_copies_layer=0)  # fmt: skip
    cfg = {"attention_backend": "triton"}
    engine = Engine(d, draft_model=d, draft_kind="mtp", spec=SpecParams(3, 2, 6),
                    target_config=cfg, draft_config=cfg)  # fmt: skip
    t, drafter = engine.target, engine.draft.drafter
    assert t.backend.name == drafter.backend.name == "triton"
    assert t.graphs is None  # never captured on CPU: routed by hand below
    t.configure(engine.draft.info().needs)  # the handshake first: it names the features
    t.graphs = TargetGraphs(t.model, t.cache, t.backend, mode="eager-static", max_bs=4,
                            tree_sizes=t.cfg.cuda_graph_tree_sizes, aux=t.aux_layers)  # fmt: skip
    drafter.enable_step_graphs("eager-static", max_bs=4)
    runners = {"decode": t.graphs.decode, "verify": t.graphs.verify[6],
               "draft search": drafter.search_graphs}  # fmt: skip
    used: set[str] = set()
    for name, runner in runners.items():  # every forward of a runner is a replay
        run = runner.replay
        runner.replay = lambda *a, _run=run, _name=name, **k: used.add(_name) or _run(*a, **k)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    for plain in (True, False):
        results = engine.generate(PROMPTS, params, disable_speculation=plain)
        for prompt, res in zip(PROMPTS, results, strict=True):
            assert res.token_ids == hf_greedy(d, prompt, 6)
    assert sum(n > 1 for res in results for n in res.accept_lens) > 0, "no tree was accepted"
    assert used == set(runners) and mla_calls and pair_calls
    assert t.cache.num_used_slots == 0 and drafter.cache.num_used_slots == 0
