"""Every draft kind behind a real draft service: greedy output through the router equals
transformers, the draft service is actually used (no request falls back to plain) and its tokens
are accepted: each kind's draft predicts its target (`copy_drafts`; the standalone draft is the
target itself, n-gram runs on a target whose output cycles)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import assert_accepted
from grpc_harness import (
    LoopThread,
    collect,
    count_batches,
    greedy,
    serve_draft,
    serve_router,
    serve_target,
)

from specmesh.client import GenerationClient
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.runtime.tiny import make_tiny_target
from specmesh.target_service.runtime import TargetRuntime

PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7], [11, 12, 13], [40, 41, 42, 43]]


@pytest.mark.parametrize("kind", ["eagle", "mtp", "standalone", "ngram"])
def test_draft_kind_over_grpc_matches_transformers(
    copy_dir: Path, tmp_path: Path, oracle, kind: str
) -> None:
    target_dir, draft_dir = str(copy_dir / "target"), str(copy_dir / kind)
    if kind == "standalone":
        draft_dir = target_dir  # the target drafting for itself: every draft token is accepted
    elif kind == "ngram":
        target_dir, draft_dir = str(make_tiny_target(tmp_path, initializer_range=0.1)), None
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(target_dir))))
    spec = (
        SpecParams(3, 1, 4) if kind == "standalone" else SpecParams(3, 2, 5)
    )  # chain: all accepted
    draft = loop.run(serve_draft(load_draft(DraftConfig(kind, draft_dir, target_dir, spec))))
    drafted = count_batches(draft)
    router = loop.run(serve_router(target, draft))
    stats = []
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            for prompt in PROMPTS:
                ids, _, last = collect(
                    client.generate(prompt_token_ids=prompt, sampling=greedy(10))
                )
                assert ids == oracle(target_dir, prompt, 10), kind
                stats.append(last.stats)
                if kind == "standalone":
                    assert max(last.stats.accept_lens) == 4, list(
                        last.stats.accept_lens
                    )  # 3 steps + bonus
    finally:
        loop.run(router.stop(0.5))
        for servicer in (target, draft):
            loop.run(servicer.host.shutdown(0.5))
        loop.close()
    assert drafted["batches"] > 0 and not any(drafted["codes"])
    assert_accepted(stats, min_tokens=len(PROMPTS))
