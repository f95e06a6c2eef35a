"""Which Step stream owns each request a model service holds (DESIGN.md §3).

A request belongs to the stream whose work created it (a target prefill, a draft's starting
extend). Only that stream can advance or release it; another stream asking for the same id gets
ALREADY_EXISTS (to create) or NOT_FOUND (to use). When a stream ends, for any reason, everything
it owns is freed. The registry is touched only on the service's one worker thread, in stream
order, so a release can never overtake the work that creates the state.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from specmesh.protocol.errors import DuplicateRequestError, SpecmeshError, UnknownRequestError


class Closeable(Protocol):
    def close(self) -> None: ...


@dataclass(eq=False)
class StreamOwner:
    """One open Step stream, as the service sees it."""

    id: int
    peer: str
    requests: set[str] = field(default_factory=set)
    closed: bool = False  # set on the event loop when the stream ends; freed on the worker
    # Its shared-memory rows (`protocol.shared_rows`): the ring a target writes them into, the
    # regions a draft reads them from; closed with the stream.
    shared: Closeable | None = None


class Ownership:
    def __init__(self) -> None:
        self.owner: dict[str, StreamOwner] = {}
        self.streams: dict[int, StreamOwner] = {}
        self._ids = itertools.count(1)

    def open(self, peer: str) -> StreamOwner:
        stream = StreamOwner(next(self._ids), peer)
        self.streams[stream.id] = stream
        return stream

    def check(
        self, stream: StreamOwner, rid: str, *, new: bool, release: Callable[[str], bool]
    ) -> SpecmeshError | None:
        """The error that refuses ``stream``'s work on ``rid``, or None. A request still held
        for a stream that has ended (its cleanup not yet run) is freed first."""
        owner = self.owner.get(rid)
        if owner is not None and owner.closed:
            self._drop(rid, release)
            owner = None
        if new and owner is not None:
            held = "this stream" if owner is stream else "another stream"
            return DuplicateRequestError(f"request {rid!r} is already held by {held}")
        if not new and owner is not stream:
            return UnknownRequestError(f"unknown request id {rid!r} on this stream")
        return None

    def settle(self, stream: StreamOwner, rids: list[str], holds: Callable[[str], bool]) -> None:
        """After a step: ``stream`` owns those of ``rids`` the runtime now holds."""
        for rid in rids:
            if holds(rid):
                self.owner[rid] = stream
                stream.requests.add(rid)
            elif self.owner.get(rid) is stream:
                del self.owner[rid]
                stream.requests.discard(rid)

    def release(self, stream: StreamOwner, rid: str, release: Callable[[str], bool]) -> None:
        """Free ``rid`` if ``stream`` owns it; anything else is a no-op."""
        if self.owner.get(rid) is stream:
            self._drop(rid, release)

    def close(self, stream: StreamOwner, release: Callable[[str], bool]) -> int:
        """Free everything ``stream`` owns; returns how many requests that was."""
        self.streams.pop(stream.id, None)
        if stream.shared is not None:
            stream.shared.close()
        rids = [r for r in stream.requests if self.owner.get(r) is stream]
        for rid in rids:
            self._drop(rid, release)
        return len(rids)

    def _drop(self, rid: str, release: Callable[[str], bool]) -> None:
        owner = self.owner.pop(rid)
        owner.requests.discard(rid)
        release(rid)
