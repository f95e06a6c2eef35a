"""The prefix caches of target and draft driven past their bounds with requests running (the
first prefix cache freed evicted pages a live row still listed: two requests then wrote the same
KV slots, and outputs went wrong for everyone).

Both caches hold fewer tokens than one request's prompt, so every release evicts. Twelve prompt
prefixes of 24 to 88 tokens with short tails run eight streams at a time, and every fourth
stream is cancelled after its first answer. Every finished output equals transformers' greedy
continuation, each service's free list holds each page once after every release and eviction
(`KVCache.check`, on in the tests), and both services end holding nothing.

Then chats resent whole each turn over KV pages of 4 tokens, with drafts the target accepts: an
accepted path permutes an answer's slots across pages, and a cache that shared such pages as
an answer's blocks gave the next turns wrong outputs.
"""

from __future__ import annotations

import random
import threading

import pytest
from grpc_harness import (
    SPEC,
    LoopThread,
    collect,
    greedy,
    serve_draft,
    serve_router,
    serve_target,
    wait_until,
)
from procs import is_empty, occupancy

from specmesh.client import GenerationClient
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, TargetConfig
from specmesh.target_service.runtime import TargetRuntime

CACHE = {"prefix_cache_tokens": 24, "prefix_block_size": 8}  # three blocks, under any prompt
NUM_NEW = 10


def workload(seed: int) -> list[tuple[list[int], bool]]:
    """(prompt, cancel after the first answer) for 48 requests over 12 shared prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(4, 250) for _ in range(rng.choice((24, 56, 88)))] for _ in range(12)]
    out = []
    for k in range(48):
        tail = [rng.randrange(4, 250) for _ in range(rng.randrange(1, 6))]
        out.append((rng.choice(prefixes) + tail, k % 4 == 3))
    return out


@pytest.fixture(scope="module")
def cluster(tiny_dir):
    target_dir, draft_dir = str(tiny_dir / "target"), str(tiny_dir / "draft")
    draft_cfg = DraftConfig("eagle3", draft_dir, target_dir, SPEC, **CACHE)
    yield from _serve(TargetConfig(target_dir, **CACHE), draft_cfg)


def _serve(target_cfg: TargetConfig, draft_cfg: DraftConfig):
    """Target, draft and router servers on loopback: (target, draft, client), torn down after."""
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(target_cfg)))
    draft = loop.run(serve_draft(load_draft(draft_cfg)))
    router = loop.run(serve_router(target, draft))
    client = GenerationClient(f"127.0.0.1:{router.port}")
    yield target, draft, client
    client.close()
    loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def run(client: GenerationClient, prompt: list[int], cancel: bool) -> list[int] | None:
    call = client.generate(prompt_token_ids=prompt, sampling=greedy(NUM_NEW), timeout=120)
    if not cancel:
        return collect(call)[0]
    next(iter(call))
    call.cancel()
    return None


def test_outputs_stay_exact_while_both_caches_evict(cluster, oracle, tiny_dir) -> None:
    target, draft, client = cluster
    requests = workload(0)
    outputs: dict[int, list[int] | None] = {}
    slots = threading.Semaphore(8)

    def one(k: int) -> None:
        with slots:
            outputs[k] = run(client, *requests[k])

    threads = [threading.Thread(target=one, args=(k,)) for k in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(outputs) == len(requests)
    wrong = [
        k
        for k, (prompt, cancel) in enumerate(requests)
        if not cancel and outputs[k] != oracle(str(tiny_dir / "target"), prompt, NUM_NEW)
    ]
    assert not wrong, f"{len(wrong)} of {len(requests)} outputs differ from transformers: {wrong}"
    caches = {"target": target.runtime.prefixes.blocks, "draft": draft.runtime.drafter.prefixes}
    for servicer, kind in ((target, "target"), (draft, "draft")):
        address = f"127.0.0.1:{servicer.host.port}"
        assert wait_until(lambda a=address, k=kind: is_empty(occupancy(a, k)), 30), kind
        caches[kind].cache.check()
        assert caches[kind].num_hit > 0, f"the {kind}'s cache was never hit"
        assert caches[kind].num_tokens <= CACHE["prefix_cache_tokens"]


@pytest.fixture(scope="module")
def paged(copy_dir):
    """The copy pair (drafts the target accepts: accepted paths permute slots across pages)
    with KV pages of 4 tokens and a target cache of 32 blocks of 8."""
    target_dir, draft_dir = str(copy_dir / "target"), str(copy_dir / "eagle3")
    cfg = TargetConfig(target_dir, page_size=4, prefix_cache_tokens=256, prefix_block_size=8)
    for target, _, client in _serve(cfg, DraftConfig("eagle3", draft_dir, target_dir, SPEC)):
        yield target, client, target_dir


def test_chats_resent_whole_stay_exact_with_paged_kv(paged, oracle) -> None:
    """Six chats of three turns at once, each turn resending the last one's prompt and answer
    (whose blocks the cache holds, as far as their pages are whole): every answer equals
    transformers', and the target ends holding nothing."""
    target, client, target_dir = paged
    rng = random.Random(1)
    firsts = [[rng.randrange(4, 250) for _ in range(rng.randrange(9, 20))] for _ in range(6)]
    wrong: list[tuple[int, int]] = []

    def chat(c: int) -> None:
        turn_ids = firsts[c]
        for turn in range(3):
            answer = collect(client.generate(prompt_token_ids=turn_ids, sampling=greedy(24),
                                             timeout=120))[0]  # fmt: skip
            if answer != oracle(target_dir, turn_ids, 24):
                wrong.append((c, turn))
            turn_ids = turn_ids + answer + [100 + turn, 101]

    threads = [threading.Thread(target=chat, args=(c,)) for c in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not wrong, f"answers unlike transformers' (chat, turn): {wrong}"
    address = f"127.0.0.1:{target.host.port}"
    assert wait_until(lambda: is_empty(occupancy(address, "target")), 30)
    target.runtime.prefixes.blocks.cache.check()
    assert target.runtime.prefixes.blocks.num_hit > 0
