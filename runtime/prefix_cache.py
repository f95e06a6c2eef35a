"""Prefix caching: the KV of token prefixes a finished prefill computed, kept for later prompts
that start the same way.

The cache owns whole blocks of ``block_size`` tokens (a multiple of the KV page size), keyed by a
hash chained over the block's tokens and every block before it, so a key names a whole prefix:

    prompt:  [ block 0 | block 1 | block 2 | rest ... ]
    keys:      h0 = H(b0), h1 = H(h0, b1), h2 = H(h1, b2)

A request that starts with cached blocks gets their pages at the front of its KV row (the pages
are shared, never written again: a request writes only past its cached length, and rollback
permutes only entries past the committed length) and computes only the rest. A block may also
hold the draft features of its rows (EAGLE-3 aux states, hidden states), by feature kind, so a
speculative request's draft can extend over the whole prompt with rows the target did not
compute again; a block without the features a request needs ends that request's match.

Lifetimes: a block is referenced by every running request whose row lists it; unreferenced
blocks are evicted least recently used first, leaves before their parents (a parent's key is in
its children's), when the KV pool runs short (`KVCache.reclaim`) or the cache exceeds
``max_tokens``. Cached pages belong to the cache, not to a request or a stream: a request's
release drops its references only, and only after its row is gone (`KVCache.release` frees the
row, then calls ``on_release``), so an evicted block's pages are never ones a live row lists. The evictable blocks (unreferenced leaves) wait in a heap by
last use, so finding each victim costs O(log n) however many referenced blocks are older.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specmesh.protocol.prefix_keys import block_key
from specmesh.runtime.kv_cache import KVCache


@dataclass
class Block:
    key: bytes
    parent: bytes | None
    tokens: tuple[int, ...]
    pages: list[int]
    features: dict[str, torch.Tensor] = field(default_factory=dict)  # kind -> [block, dim]
    refs: int = 0
    children: int = 0
    used: int = 0  # the cache's clock at the block's last use (its place in the LRU order)

    @property
    def evictable(self) -> bool:
        return not self.refs and not self.children


@dataclass
class Match:
    """The longest cached prefix of a prompt: its blocks, and the tokens they cover."""

    blocks: list[Block]
    num_tokens: int


class PrefixCache:
    def __init__(
        self, cache: KVCache, block_size: int, max_tokens: int, lookahead: int = 0
    ) -> None:
        if block_size % cache.page_size:
            raise ValueError(
                f"prefix cache block size {block_size} is not a multiple of the KV page size "
                f"{cache.page_size}"
            )
        self.cache, self.block_size, self.max_tokens = cache, block_size, max_tokens
        # Tokens past a block its rows depend on: 0 for the target (row t holds token t); 1 for
        # an EAGLE draft, whose row t pairs the target's feature t with token t + 1.
        self.lookahead = lookahead
        self.blocks: OrderedDict[bytes, Block] = OrderedDict()  # least recently used first
        self.held: dict[str, list[Block]] = {}  # request -> the blocks its row lists
        # (used, key) of every block that became evictable; an entry whose block was used,
        # referenced or evicted since is stale and skipped (`_victim`)
        self.victims: list[tuple[int, bytes]] = []
        self.clock = 0
        self.num_free_pages = 0  # pages of unreferenced blocks
        self.num_queried = self.num_hit = 0  # prompt tokens looked up / found, for metrics
        cache.reclaim = self.evict
        cache.on_release = self._released

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size

    @property
    def num_evictable_slots(self) -> int:
        """Slots of blocks no request lists (free for the taking)."""
        return self.num_free_pages * self.cache.page_size

    # -- lookup --------------------------------------------------------------------------------
    def match(self, ids: list[int], feature: str | None) -> Match:
        """The cached blocks ``ids`` starts with, leaving at least one token to compute (its
        logits sample the first token); with ``feature``, only blocks holding it."""
        blocks, key, span = [], None, self.block_size + self.lookahead
        for start in range(0, len(ids) - span, self.block_size):
            tokens = tuple(ids[start : start + span])
            key = block_key(key, tokens)
            block = self.blocks.get(key)
            if block is None or block.tokens != tokens:
                break
            if feature is not None and feature not in block.features:
                break
            blocks.append(block)
        self.num_queried += len(ids)
        self.num_hit += len(blocks) * self.block_size
        return Match(blocks, len(blocks) * self.block_size)

    def attach(self, rid: str, match: Match) -> None:
        """Give a new request (added to the KV cache, nothing reserved) the matched pages."""
        pages = [p for b in match.blocks for p in b.pages]
        self.cache.attach_shared(rid, pages)
        for b in match.blocks:
            self._ref(b, 1)
            self._use(b)
        self.held[rid] = list(match.blocks)

    def features(self, match: Match, feature: str) -> torch.Tensor:
        """The matched blocks' feature rows ``[num_tokens, dim]``."""
        return torch.cat([b.features[feature] for b in match.blocks])

    # -- insert / release ---------------------------------------------------------------------
    def insert(
        self, rid: str, ids: list[int], feature: str | None, rows: torch.Tensor | None
    ) -> None:
        """After ``rid``'s prefill committed ``ids``: its full blocks join the cache (the
        request keeps them referenced); ``rows`` are the feature rows of all of ``ids``. A
        new block whose tokens do not fill whole pages in order ends it (`_whole_pages`)."""
        held = self.held.setdefault(rid, [])
        table = self.cache.slots(rid, 0, len(ids) - self.lookahead)
        key: bytes | None = None
        ps, span = self.cache.page_size, self.block_size + self.lookahead
        whole = _whole_pages(table, ps)
        for i, start in enumerate(range(0, len(ids) - span + 1, self.block_size)):
            tokens = tuple(ids[start : start + span])
            parent, key = key, block_key(key, tokens)
            block = self.blocks.get(key)
            if block is None or block.tokens != tokens:
                pages_whole = all(whole[start // ps : (start + self.block_size) // ps])
                if block is not None or not pages_whole:  # a hash collision: keep the older
                    break
                slot_ids = table[start : start + self.block_size : ps].tolist()
                block = Block(key, parent, tokens, [s // ps for s in slot_ids])
                self.blocks[key] = block
                self.num_free_pages += len(block.pages)
                self.cache.share(block.pages)
                if parent is not None:
                    self.blocks[parent].children += 1
            if i >= len(held):
                held.append(block)
                self._ref(block, 1)
            if feature is not None and rows is not None and feature not in block.features:
                block.features[feature] = rows[start : start + self.block_size].clone()
            self._use(block)
        self.evict(0)

    def _released(self, rid: str) -> None:
        """``rid``'s row is gone (`KVCache.release`, never called directly): it no longer
        lists its blocks; the cache is brought back within its bound."""
        for b in self.held.pop(rid, ()):
            self._ref(b, -1)
        self.evict(0)

    # -- evict ---------------------------------------------------------------------------------
    def evict(self, num_pages: int) -> int:
        """Free at least ``num_pages`` pages of unreferenced blocks (leaves first, least
        recently used first) if there are, and whatever the cache holds beyond ``max_tokens``;
        returns the pages freed."""
        freed = 0
        while freed < num_pages or self.num_tokens > self.max_tokens:
            victim = self._victim()
            if victim is None:
                break
            del self.blocks[victim.key]
            self.num_free_pages -= len(victim.pages)
            if victim.parent is not None:
                parent = self.blocks[victim.parent]
                parent.children -= 1
                self._maybe_evictable(parent)
            self.cache.unshare(victim.pages)
            freed += len(victim.pages)
        return freed

    # -- bookkeeping ---------------------------------------------------------------------------
    def _use(self, block: Block) -> None:
        self.clock += 1
        block.used = self.clock
        self.blocks.move_to_end(block.key)
        self._maybe_evictable(block)

    def _ref(self, block: Block, delta: int) -> None:
        if not block.refs:
            self.num_free_pages -= len(block.pages)
        block.refs += delta
        if not block.refs:
            self.num_free_pages += len(block.pages)
            self._maybe_evictable(block)

    def _maybe_evictable(self, block: Block) -> None:
        if block.evictable:
            heapq.heappush(self.victims, (block.used, block.key))
            if len(self.victims) > 2 * len(self.blocks) + 64:  # mostly stale: rebuild
                self.victims = [(b.used, b.key) for b in self.blocks.values() if b.evictable]
                heapq.heapify(self.victims)

    def _victim(self) -> Block | None:
        """The least recently used unreferenced leaf, taken off the heap; None if none."""
        while self.victims:
            used, key = heapq.heappop(self.victims)
            block = self.blocks.get(key)
            if block is not None and block.used == used and block.evictable:
                return block
        return None


def _whole_pages(table: torch.Tensor, page_size: int) -> list[bool]:
    """Per page-long run of a row's token indices: whether its slots are one page's, in order.
    A prefill writes whole pages in order; accepting a tree path permutes slot ids
    (`KVCache.accept_paths`), so past a prompt a run may mix pages: such a page also holds
    tokens the block does not, and must not be shared as the block's."""
    if page_size == 1:
        return [True] * len(table)
    runs = table[: len(table) // page_size * page_size].view(-1, page_size).cpu()
    offsets = torch.arange(page_size)
    return ((runs == runs[:, :1] + offsets).all(1) & (runs[:, 0] % page_size == 0)).tolist()
