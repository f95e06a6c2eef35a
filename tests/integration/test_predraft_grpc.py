"""Pre-drafting behind a real draft service (``--predraft 4``, the demo EAGLE-3 pair in fp32): a
hit is answered before its extend runs (which then runs, with the next pre-draft, after the
answer), output equals transformers, the stats count the hits, and a cancel, a miss or a draft
that dies while pre-drafting leaves nothing held in either service."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
from grpc_harness import LoopThread, collect, greedy, serve_draft, serve_router, serve_target
from procs import is_empty, occupancy

from specmesh.client import GenerationClient
from specmesh.defaults import REPO_MODELS
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.router.tokenizer import load_tokenizer
from specmesh.target_service.runtime import TargetRuntime

TARGET, DRAFT = str(REPO_MODELS / "target"), str(REPO_MODELS / "draft")
SPEC = SpecParams(5, 4, 8)
CODE = [
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "import os\nimport sys\n\n\ndef main():\n    args = sys.argv[1:]\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n",
]


@pytest.fixture(scope="module")
def cluster(oracle):
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(TARGET, dtype="float32"))))
    runtime = load_draft(DraftConfig("eagle3", DRAFT, TARGET, SPEC, dtype="float32", predraft=4))
    draft = loop.run(serve_draft(runtime))
    router = loop.run(serve_router(target, draft, speculation="always"))
    tokenizer = load_tokenizer(TARGET)
    s = SimpleNamespace(loop=loop, target=target, draft=draft, router=router)
    s.prompts = [tokenizer.encode(text) for text in CODE]
    s.expected = lambda prompt, n: oracle(TARGET, prompt, n)
    s.client = GenerationClient(f"127.0.0.1:{router.port}")
    yield s
    s.client.close()
    loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def holds_nothing(s) -> bool:
    return all(
        is_empty(occupancy(f"127.0.0.1:{servicer.host.port}", kind))
        for servicer, kind in ((s.target, "target"), (s.draft, "draft"))
    )


def test_predrafted_trees_over_grpc_are_exact_and_counted(cluster) -> None:
    results, n = {}, 40

    def run(i: int) -> None:
        call = cluster.client.generate(prompt_token_ids=cluster.prompts[i], sampling=greedy(n))
        results[i] = collect(call)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cluster.prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    stats = []
    for i, prompt in enumerate(cluster.prompts):
        ids, _, last = results[i]
        assert ids == cluster.expected(prompt, n), i
        stats.append(last.stats)
    hits = sum(st.num_predraft_hits for st in stats)
    rounds = sum(st.num_rounds for st in stats)
    assert 0 < hits < rounds, f"{hits} pre-drafted trees in {rounds} rounds"
    assert all(st.draft_wait_s > 0 for st in stats)
    assert not any(st.draft_weight_versions for st in stats)  # this draft does not learn
    assert wait_until_empty(cluster)
    assert not cluster.draft.runtime.ahead.trees and not cluster.draft.runtime.ahead.outcomes


def test_a_cancel_between_verify_and_hit_frees_everything(cluster) -> None:
    """Cancelled while its draft holds pre-drafted trees: both services end up empty, and a
    request running beside it is untouched."""
    beside = {}
    other = threading.Thread(target=lambda: beside.update(
        out=collect(cluster.client.generate(prompt_token_ids=cluster.prompts[1],
                                            sampling=greedy(40)))))  # fmt: skip
    other.start()
    call = cluster.client.generate(prompt_token_ids=cluster.prompts[0], sampling=greedy(400))
    stream = iter(call)
    for _ in range(4):
        next(stream)
    assert cluster.draft.runtime.ahead.outcomes or cluster.draft.runtime.ahead.trees
    call.cancel()
    other.join(120)
    assert beside["out"][0] == cluster.expected(cluster.prompts[1], 40)
    assert wait_until_empty(cluster)


def test_a_draft_lost_while_predrafting_leaves_output_exact(cluster, oracle) -> None:
    """A second draft service, pre-drafting, stops mid-request: the request finishes without
    speculation, exact, and the target holds nothing."""
    runtime = load_draft(DraftConfig("eagle3", DRAFT, TARGET, SPEC, dtype="float32", predraft=4))
    draft = cluster.loop.run(serve_draft(runtime))
    router = cluster.loop.run(serve_router(cluster.target, draft, speculation="always"))
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            stream = iter(client.generate(prompt_token_ids=cluster.prompts[2], sampling=greedy(60)))
            ids = [*next(stream).token_ids, *next(stream).token_ids]
            cluster.loop.run(draft.host.server.stop(None))  # gone at once, streams cut
            ids += collect(stream)[0]
        assert ids == cluster.expected(cluster.prompts[2], 60)
    finally:
        cluster.loop.run(router.stop(0.5))
    assert wait_until_empty(cluster)


def wait_until_empty(s) -> bool:
    from grpc_harness import wait_until

    return wait_until(lambda: holds_nothing(s), 20)
