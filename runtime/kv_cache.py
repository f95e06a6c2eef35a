"""Paged KV cache: a token-slot pool per layer, a request-to-slot table and a page allocator.

    req_to_slot[row] = [ committed tokens ........ | speculative tokens ... | unused capacity ]
                         0                 committed_len            capacity (pages * page_size)

One slot past the last page, ``scratch_slot``, belongs to no request and is never allocated:
CUDA-graph padding rows write and read it (`runtime.graph_runner`), so a cache with graphs holds
exactly what its requests hold.

Every token index of a request maps to a slot id of the pool; pages are the unit of allocation,
slot ids (not pages) are what attention reads, so a row may list any slots in any order. That is
what makes rollback structural: verification writes tree nodes at token indices
``committed_len .. committed_len + N - 1``; accepting a path permutes those row entries so the
accepted nodes come first and moves ``committed_len``. Rejected slots stay reserved by the request
for its next round; no K/V is copied and nothing is freed per round.

A page is free in exactly one place. Every page of the pool is, at any time, exactly one of:

    free        on ``free_pages``, once, listed by no row
    a row's     listed by one request's row, not shared: freed by that request's release
    shared      owned by a prefix cache (``shared``): any number of rows list it, releases
                skip it; the cache frees it (``unshare``) only once no row lists it

so a release frees its row's own pages first and only then lets the prefix cache drop the row's
references (``on_release``): a block the cache evicts then can never be one a live row lists.
`check` asserts the picture; with ``SPECMESH_CHECK_KV=1`` it runs after every release and
eviction (the tests turn it on; cheap enough for a production debug run: O(pages)).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from specmesh.protocol.errors import DuplicateRequestError, KVCacheFullError, UnknownRequestError
from specmesh.runtime.models.layers import KVPair


def _pools(
    shape: tuple[int, int, int],
    dtype: torch.dtype,
    device: str | torch.device,
    latent_dim: int | None,
) -> KVPair:
    k = torch.zeros(shape, dtype=dtype, device=device)
    if latent_dim is not None:
        return KVPair(k, k[..., :latent_dim])  # [slots, 1, latent_dim], K's latent columns
    return KVPair(k, torch.zeros(shape, dtype=dtype, device=device))


@dataclass
class RequestSlots:
    row: int
    pages: list[int] = field(default_factory=list)
    committed_len: int = 0


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device = "cpu",
        page_size: int = 1,
        max_requests: int = 256,
        max_context: int = 4096,
        latent_dim: int | None = None,
    ) -> None:
        """``latent_dim`` (multi-head latent attention, `runtime.models.mla`): each layer stores
        one pool, K ``[slots, 1, head_dim]`` = [latent c_kv | rope key] per token, and V is a view
        of K's first ``latent_dim`` columns (the latent itself), so nothing is stored twice."""
        if num_slots % page_size:
            raise ValueError(f"num_slots {num_slots} is not a multiple of page_size {page_size}")
        shape = (num_slots + 1, num_kv_heads, head_dim)  # + scratch_slot
        self.pools = [_pools(shape, dtype, device, latent_dim) for _ in range(num_layers)]
        self.page_size, self.max_context = page_size, max_context
        self.num_slots = self.scratch_slot = num_slots
        self.req_to_slot = torch.zeros(max_requests, max_context, dtype=torch.int64, device=device)
        self.free_pages = list(range(num_slots // page_size - 1, -1, -1))
        self.free_rows = list(range(max_requests - 1, -1, -1))
        self.requests: dict[str, RequestSlots] = {}
        # Pages a prefix cache owns (`runtime.prefix_cache`): rows list them, releases skip them;
        # ``reclaim(n)`` asks it to free n pages when the pool runs short (returns pages freed).
        self.shared: set[int] = set()
        self.reclaim: Callable[[int], int] | None = None
        # Called with a request's id once its row is gone: the prefix cache drops its references.
        self.on_release: Callable[[str], None] | None = None
        self.checked = os.environ.get("SPECMESH_CHECK_KV", "") not in ("", "0")

    # -- ask ----------------------------------------------------------------------------------
    def pages_needed(self, rid: str | None, num_tokens: int) -> int:
        """Extra pages request ``rid`` (or a new request) needs to hold ``num_tokens`` tokens."""
        have = len(self.requests[rid].pages) if rid in self.requests else 0
        return max(0, -(-num_tokens // self.page_size) - have)

    def holds_at_most(self) -> int:
        """The most tokens one request can ever hold: the whole pool."""
        return self.num_slots // self.page_size * self.page_size

    def can_allocate(self, demands: dict[str | None, int]) -> bool:
        """Whether ``demands`` fit; unreferenced prefix-cache pages are given back for them if
        needed (they are a cache: taking them changes no request)."""
        pages = sum(self.pages_needed(rid, n) for rid, n in demands.items())
        new_rows = sum(1 for rid in demands if rid not in self.requests)
        return self.can_take(pages) and new_rows <= len(self.free_rows)

    def can_take(self, num_pages: int) -> bool:
        """Whether ``num_pages`` more pages fit (unreferenced prefix-cache pages given back for
        them if needed): a batch admitted one request at a time sums its pages as it goes."""
        self._make_room(num_pages)
        return num_pages <= len(self.free_pages)

    def _make_room(self, num_pages: int) -> None:
        short = num_pages - len(self.free_pages)
        if short > 0 and self.reclaim is not None:
            self.reclaim(short)

    @property
    def num_free_slots(self) -> int:
        return len(self.free_pages) * self.page_size

    @property
    def num_used_slots(self) -> int:
        return self.num_slots - self.num_free_slots

    # -- act ----------------------------------------------------------------------------------
    def add(self, rid: str) -> None:
        if rid in self.requests:
            raise DuplicateRequestError(f"request {rid!r} already has KV state")
        if not self.free_rows:
            raise KVCacheFullError(f"all {self.req_to_slot.shape[0]} request rows are in use")
        self.requests[rid] = RequestSlots(self.free_rows.pop())

    def reserve(self, rid: str, num_tokens: int) -> None:
        """Make sure ``rid`` owns slots for token indices ``[0, num_tokens)``."""
        self.reserve_all({rid: num_tokens})

    def reserve_all(self, demands: dict[str, int]) -> None:
        """`reserve` for every request of ``demands`` (rid -> tokens): all checked first, then
        the new slot ids written to the table (their places and values: one copy to the
        device)."""
        needs = {}
        for rid, num_tokens in demands.items():
            self.get(rid)
            if num_tokens > self.max_context:
                raise KVCacheFullError(
                    f"request {rid!r} needs {num_tokens} tokens, above max_context "
                    f"{self.max_context}"
                )
            needs[rid] = self.pages_needed(rid, num_tokens)
        self._make_room(sum(needs.values()))
        if sum(needs.values()) > len(self.free_pages):
            raise KVCacheFullError(
                f"requests {list(needs)} need {sum(needs.values())} more KV pages of "
                f"{self.page_size} tokens, {len(self.free_pages)} free"
            )
        ps, flat_index, pages = self.page_size, [], []
        width = self.req_to_slot.shape[1]
        for rid, need in needs.items():
            req = self.requests[rid]
            start = req.row * width + len(req.pages) * ps  # flat index of the first new entry
            flat_index.extend(range(start, start + need * ps))
            new_pages = [self.free_pages.pop() for _ in range(need)]
            req.pages.extend(new_pages)
            pages.extend(new_pages)
        if not pages:
            return
        slots = [page * ps + i for page in pages for i in range(ps)]
        both = torch.tensor([flat_index, slots], dtype=torch.int64).to(self.req_to_slot.device)
        self.req_to_slot.view(-1).index_copy_(0, both[0], both[1])

    def release(self, rid: str) -> None:
        """Free ``rid``'s row and its own pages, then drop its prefix references."""
        req = self.requests.pop(rid, None)
        if req is None:
            raise UnknownRequestError(f"unknown request id {rid!r}")
        self.free_pages.extend(p for p in reversed(req.pages) if p not in self.shared)
        self.free_rows.append(req.row)
        if self.on_release is not None:
            self.on_release(rid)
        if self.checked:
            self.check()

    # -- pages shared with a prefix cache -------------------------------------------------------
    def attach_shared(self, rid: str, pages: list[int]) -> None:
        """Start ``rid``'s row (new, nothing reserved) with the cache's ``pages``: their tokens
        are committed, never written again."""
        req = self.get(rid)
        if req.pages:
            raise ValueError(f"request {rid!r} already holds pages")
        req.pages = list(pages)
        ps = self.page_size
        slots = (torch.tensor(pages, dtype=torch.int64)[:, None] * ps + torch.arange(ps)).flatten()
        self.req_to_slot[req.row, : len(slots)] = slots.to(self.req_to_slot.device)
        req.committed_len = len(slots)

    def share(self, pages: list[int]) -> None:
        """The prefix cache takes ``pages`` (listed by a request's row): releases skip them."""
        self.shared.update(pages)

    def unshare(self, pages: list[int]) -> None:
        """The prefix cache evicted ``pages``, which no row lists any more: free them."""
        self.shared.difference_update(pages)
        self.free_pages.extend(pages)
        if self.checked:
            self.check()

    def check(self) -> None:
        """Raise unless every page is in exactly one place (the module's picture): free once and
        in no row, a row's own in one row only, or shared; none lost."""
        free = set(self.free_pages)
        if len(free) != len(self.free_pages):
            raise AssertionError(f"{len(self.free_pages) - len(free)} pages are free twice")
        own: set[int] = set()
        for rid, req in self.requests.items():
            pages = set(req.pages)
            if len(pages) != len(req.pages) or pages & free or (pages - self.shared) & own:
                raise AssertionError(
                    f"request {rid!r} lists a page twice, a free page or another row's page: "
                    f"{sorted(pages & free)[:8]} free, {sorted((pages - self.shared) & own)[:8]}"
                )
            own |= pages - self.shared
        if free & self.shared:
            raise AssertionError(f"pages both free and shared: {sorted(free & self.shared)[:8]}")
        lost = self.num_slots // self.page_size - len(free) - len(own) - len(self.shared)
        if lost:
            raise AssertionError(f"{lost} pages are neither free, nor a row's, nor shared")

    def get(self, rid: str) -> RequestSlots:
        req = self.requests.get(rid)
        if req is None:
            raise UnknownRequestError(f"unknown request id {rid!r}")
        return req

    def slots(self, rid: str, start: int, end: int) -> torch.Tensor:
        return self.req_to_slot[self.get(rid).row, start:end]

    def commit(self, rid: str, length: int) -> None:
        self.get(rid).committed_len = length

    def accept_paths(self, paths: list[tuple[str, list[int], int]]) -> None:
        """For each ``(rid, path, num_nodes)``: keep the tree nodes on ``path`` (indices into
        the request's ``num_nodes`` speculative tokens, root first) as committed tokens, by
        permuting slot ids; the rest stay reserved. The batch's permutations are one gather and
        one scatter of the slot table (their indices built on the host, one copy)."""
        reqs = [self.get(rid) for rid, _, _ in paths]  # all known before anything changes
        width, dst, src = self.req_to_slot.shape[1], [], []
        for req, (_, path, num_nodes) in zip(reqs, paths, strict=True):
            first = req.row * width + req.committed_len
            on_path = set(path)
            order = [*path, *(i for i in range(num_nodes) if i not in on_path)]
            dst.extend(range(first, first + num_nodes))
            src.extend(first + i for i in order)
            req.committed_len += len(path)
        if dst:
            flat = self.req_to_slot.view(-1)
            index = torch.tensor([dst, src], dtype=torch.int64).to(flat.device)
            flat[index[0]] = flat[index[1]]

    def move_entries(self, rid: str, src: int, dst: int, num: int) -> None:
        """Move ``rid``'s token indices ``[src, src + num)`` to ``[dst, dst + num)`` by permuting
        its row (no K/V moves): the slots displaced from the destination take the source's
        places, in order, so the row still lists each of its slots once."""
        row = self.req_to_slot[self.get(rid).row]
        lo, hi = min(src, dst), max(src, dst) + num
        idx = torch.arange(hi - lo)
        moved = (idx >= src - lo) & (idx < src - lo + num)
        landing = (idx >= dst - lo) & (idx < dst - lo + num)
        seg = row[lo:hi].clone()
        out = torch.empty_like(seg)
        out[landing.to(seg.device)] = seg[moved.to(seg.device)]
        out[(~landing).to(seg.device)] = seg[(~moved).to(seg.device)]
        row[lo:hi] = out
