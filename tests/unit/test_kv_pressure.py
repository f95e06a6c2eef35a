"""A KV cache too small for every request at once: requests wait or are preempted and replayed,
never lost, and every output still equals transformers."""

from __future__ import annotations

from pathlib import Path

from specmesh.draft_service.drafter import SpecParams
from specmesh.router.core import RouterConfig
from specmesh.router.engine import Engine
from specmesh.runtime.errors import KVCacheFullError
from specmesh.runtime.sampling import SamplingParams
from specmesh.runtime.tree import Tree
from specmesh.target_service.runtime import TargetConfig, TargetRuntime
from specmesh.target_service.steps import VerifyInput


def test_small_kv_cache_preempts_and_replays(tiny_dir: Path, oracle) -> None:
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12] for i in range(6)]
    engine = Engine(
        tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
        spec=SpecParams(3, 2, 6), target_config={"num_kv_slots": 64},
        router_config=RouterConfig(max_batch_size=6, num_micro_batches=1),
    )  # fmt: skip
    results = engine.generate(prompts, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.finish_reason == "length"
        assert res.token_ids == oracle(tiny_dir / "target", prompt, 16)
    assert not engine.target.cache.requests and engine.target.cache.num_free_slots == 64


def test_verify_that_does_not_fit_fails_alone(tiny_dir: Path) -> None:
    from specmesh.target_service.steps import PrefillInput

    rt = TargetRuntime(TargetConfig(str(tiny_dir / "target"), num_kv_slots=24))
    rt.prefill([PrefillInput("a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], SamplingParams()),
                PrefillInput("b", [1, 2, 3], SamplingParams())])  # fmt: skip
    big = Tree.chain(
        [rt.requests["a"].pending, *range(20, 32)]
    )  # 13 nodes: more than the 11 slots left
    small = Tree.chain([rt.requests["b"].pending, 20])
    out = rt.verify([VerifyInput("a", big), VerifyInput("b", small)])
    assert isinstance(out.errors["a"], KVCacheFullError) and "13-node tree" in str(out.errors["a"])
    assert len(out.tokens["b"]) >= 1 and "a" not in rt.requests  # a failed request is dropped
    assert "a" not in rt.cache.requests
