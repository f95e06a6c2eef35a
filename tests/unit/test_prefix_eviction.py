"""The prefix cache's eviction bookkeeping (`runtime/prefix_cache.py`) under a random mix of
requests that share prefixes, releases and evictions: every victim is the least recently used
unreferenced leaf (what a scan of the whole LRU order would pick), the free-slot count the
services report equals a count over every block, and every page is in exactly one place after
every step (`KVCache.check`): a bound smaller than one request evicts a releasing request's own
blocks, whose pages its row listed until the release."""

from __future__ import annotations

import random

import pytest
import torch

from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.prefix_cache import PrefixCache

BLOCK = 4
FAMILIES = [[random.Random(f).randrange(3, 50) for _ in range(5 * BLOCK)] for f in range(6)]


@pytest.mark.parametrize(
    "max_blocks", [2, 24, 400], ids=["under-one-request", "over-the-bound", "asked-to-free"]
)
def test_victims_are_the_least_recently_used_leaves(
    monkeypatch: pytest.MonkeyPatch, max_blocks: int
) -> None:
    """A tight bound evicts on every insert and release; a loose one leaves many idle
    leaves, which only the pool's asks (`evict(n)`) take."""
    cache = KVCache(num_layers=1, num_slots=4096, num_kv_heads=1, head_dim=2,
                    dtype=torch.float32, max_requests=32, max_context=64)  # fmt: skip
    prefixes = PrefixCache(cache, block_size=BLOCK, max_tokens=max_blocks * BLOCK)
    victims = []
    find = PrefixCache._victim

    def checked(self: PrefixCache):
        leaves = [b for b in self.blocks.values() if not b.refs and not b.children]
        victim = find(self)
        assert victim is (leaves[0] if leaves else None)  # the blocks are in LRU order
        victims.append(victim)
        return victim

    monkeypatch.setattr(PrefixCache, "_victim", checked)
    rng, running = random.Random(0), []
    for step in range(600):
        if running and (len(running) >= 24 or rng.random() < 0.45):
            rid = running.pop(rng.randrange(len(running)))
            cache.release(rid)  # the row, then its references (`on_release`)
        else:
            family = rng.choice(FAMILIES)
            ids = family[: rng.randrange(BLOCK, len(family))] + [rng.randrange(3, 50)] * 3
            rid = f"r{step}"
            cache.add(rid)
            prefixes.attach(rid, prefixes.match(ids, None))
            cache.reserve(rid, len(ids))
            prefixes.insert(rid, ids, None, None)
            running.append(rid)
        if rng.random() < 0.15:
            prefixes.evict(rng.randrange(1, 6))
        cache.check()
        unreferenced = sum(len(b.pages) for b in prefixes.blocks.values() if not b.refs)
        assert prefixes.num_evictable_slots == unreferenced
        leaves = [b for b in prefixes.blocks.values() if not b.refs and not b.children]
        assert (
            prefixes.num_tokens <= max_blocks * BLOCK or not leaves
        )  # over only while all are held
    assert sum(v is not None for v in victims) > 50


def test_a_block_joins_only_with_whole_pages_in_order() -> None:
    """Pages of 4 tokens, blocks of 8. A request's prompt filled pages in order; accepting a
    tree path then permuted slot ids past it (`KVCache.accept_paths`: path nodes 0, 1, 5),
    so a page there also holds tokens of rejected nodes. Only the prompt's block joins the
    cache; sharing the mixed pages as a block's would hand another request KV of tokens it
    never had, and free them while this row still lists them."""
    cache = KVCache(num_layers=1, num_slots=64, num_kv_heads=1, head_dim=2,
                    dtype=torch.float32, page_size=4, max_context=32)  # fmt: skip
    prefixes = PrefixCache(cache, block_size=8, max_tokens=64)
    cache.add("r")
    cache.reserve("r", 8 + 8)  # a prompt of 8, then a tree of 8 nodes
    cache.requests["r"].committed_len = 8
    cache.accept_paths([("r", [0, 1, 5, 6], 8)])
    ids = list(range(10, 22))  # prompt + the 4 accepted tokens
    prefixes.insert("r", ids, None, None)
    assert [b.tokens for b in prefixes.blocks.values()] == [tuple(ids[:8])]
    cache.accept_paths([("r", [0, 1, 2, 3], 4)])  # the rest of the page, in order
    prefixes.insert("r", [*ids, 30, 31, 32, 33], None, None)
    assert len(prefixes.blocks) == 1  # positions 8..15 still mix two pages
    cache.release("r")
    cache.check()
    assert cache.num_free_slots == 64 - 8  # the cached prompt block's two pages
