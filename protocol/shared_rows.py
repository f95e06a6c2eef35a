"""Feature rows through shared memory, for a cluster on one host (the router's
``--shared-memory``): the target writes a step's rows into a region its stream owns and its
answer carries where they lie (``Tensor.shm``); the router forwards that reference to the draft
instead of the bytes, and the draft copies the rows out. Torch-free.

The region is a ring (`RowRing`): each answer's rows take the next ``n`` bytes, a reservation
never straddles the end (the tail is skipped), and the ring wraps without waiting for anyone.
Its first 8 bytes hold the logical end of the newest reservation, written before the rows are:
a reader that copied rows from logical position ``p`` checks afterwards that the end is still at
most ``p + capacity`` (`intact`), else the rows were overwritten while it read and it
fails the batch. A draft proposal built from them would only have cost speculation (the target
verifies every token), but the check makes such a batch fail with a precise error instead. With
several answers in flight and a ring of `RING_BYTES`, a wrap over unread rows takes a reader
stalled for dozens of rounds.

Ownership: a ring belongs to the target stream that asked for it (``StreamOpen``) and is
unlinked when that stream ends; a reader's mappings (`RegionMaps`) belong to the router client
or the draft stream that made them. Regions are files under /dev/shm named ``specmesh-``, the
creating process's id in 8 hex digits and 8 random ones, created with mode 0600: the router,
the target and the draft must share that directory and run as the same user. A target killed
before its streams ended leaves its rings behind; the next ring any process creates first
removes those whose creator no longer runs (`sweep`), so they cannot pile up. That reads the
process ids of this host's PID namespace: targets sharing one /dev/shm must share it too (one
`specmesh up`, or one target container as docs/deployment.md describes).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import struct
import weakref
from collections import OrderedDict
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NAME_RE = re.compile(r"specmesh-[0-9a-f]{16}")
HEADER_BYTES = 64  # the logical end (u64, little-endian) at 0; rows start after the header
RING_BYTES = 64 << 20  # per target stream
MAX_SHARE = 4  # rows larger than RING_BYTES / MAX_SHARE go on the wire instead
POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: map a region's pages in at once
MAX_MAPPED = 8  # regions a draft stream keeps mapped (least recently used ones dropped first)


class SharedRowsError(ValueError):
    """A shared-memory reference that names no region of this project, lies outside its
    region, or whose rows were overwritten before they were read."""


def intact(region: memoryview, position: int) -> bool:
    """Whether the rows reserved at logical ``position`` in ``region`` (a whole region's view)
    are still unwritten over: call it after copying them out."""
    (end,) = struct.unpack_from("<Q", region, 0)
    return end <= position + len(region) - HEADER_BYTES


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def sweep() -> list[str]:
    """Remove the regions whose creating process has gone (killed before its streams ended);
    returns their names. Only this user's regions can be removed (mode 0600)."""
    gone = []
    for path in SHM_DIR.glob("specmesh-*"):
        if NAME_RE.fullmatch(path.name) and not _alive(int(path.name[9:17], 16)):
            try:
                path.unlink(missing_ok=True)
            except PermissionError:  # another user's, in a shared /dev/shm (sticky): theirs
                continue
            gone.append(path.name)
    return gone


class RowRing:
    """The region one target stream writes its answers' rows into (see the module docstring)."""

    def __init__(self, capacity: int = RING_BYTES) -> None:
        sweep()
        self.name = f"specmesh-{os.getpid():08x}{secrets.token_hex(4)}"
        self.capacity = capacity
        self.end = 0  # logical: bytes reserved so far, skipped tails included
        fd = os.open(SHM_DIR / self.name, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Space taken now (ENOSPC here, not SIGBUS on a later write to a full /dev/shm).
            os.posix_fallocate(fd, 0, HEADER_BYTES + capacity)
            # Its pages allocated now, once, not faulted in by the first rounds' writes.
            self.map = mmap.mmap(fd, HEADER_BYTES + capacity, flags=mmap.MAP_SHARED | POPULATE)
        except OSError:
            _unlink(SHM_DIR / self.name)
            raise
        finally:
            os.close(fd)
        self.view = memoryview(self.map)
        # Unlinked by `close`, or at the latest when the process exits normally.
        self._unlink = weakref.finalize(self, _unlink, SHM_DIR / self.name)

    def reserve(self, n: int) -> int | None:
        """The logical position of ``n`` fresh bytes (announced as reserved before anyone writes
        them), or None when rows that large go on the wire."""
        if n > self.capacity // MAX_SHARE:
            return None
        pos = self.end
        if pos % self.capacity + n > self.capacity:  # never across the end: skip the tail
            pos += self.capacity - pos % self.capacity
        self.end = pos + n
        struct.pack_into("<Q", self.map, 0, self.end)
        return pos

    def offset(self, position: int) -> int:
        """Where logical ``position`` lies in the region, in bytes from its start."""
        return HEADER_BYTES + position % self.capacity

    def close(self) -> None:
        """Unlink the region: readers keep what they mapped until they close it, and its memory
        goes back when the last mapping (and any view on it) is gone."""
        self._unlink()


class RegionMaps:
    """The regions one reader has mapped read-only, by name (see the module docstring)."""

    def __init__(self, limit: int = MAX_MAPPED, populate: bool = True) -> None:
        self.limit = limit  # a router's client maps its target's one live ring: 1
        # A draft reads every row: its mappings' pages are mapped in at once. A router only
        # reads rows it must reorder: it maps pages in as it touches them.
        self.flags = mmap.MAP_SHARED | (POPULATE if populate else 0)
        self.maps: OrderedDict[str, memoryview] = OrderedDict()

    def view(self, name: str) -> memoryview:
        """The whole region ``name``, mapped on first use."""
        if not NAME_RE.fullmatch(name):
            raise SharedRowsError(f"shared memory region {name!r} is not one of specmesh's")
        view = self.maps.get(name)
        if view is None:
            try:
                fd = os.open(SHM_DIR / name, os.O_RDONLY)
            except FileNotFoundError:
                raise SharedRowsError(
                    f"shared memory region {name!r} does not exist on this host (the router, "
                    "target and draft must share /dev/shm)"
                ) from None
            try:
                view = memoryview(mmap.mmap(fd, 0, flags=self.flags, prot=mmap.PROT_READ))
            finally:
                os.close(fd)
            self.maps[name] = view
            while len(self.maps) > self.limit:
                self.maps.popitem(last=False)
        self.maps.move_to_end(name)
        return view

    def locate(self, name: str, offset: int, size: int, position: int) -> memoryview:
        """The region holding ``size`` bytes at ``offset`` that the writer reserved at logical
        ``position``; a reference that does not fit the region raises `SharedRowsError`."""
        view = self.view(name)
        capacity = len(view) - HEADER_BYTES
        if (
            offset < HEADER_BYTES
            or offset + size > len(view)
            or (HEADER_BYTES + position % capacity != offset)
        ):
            raise SharedRowsError(
                f"shared memory reference ({name}, offset {offset}, {size} bytes, position "
                f"{position}) does not fit its region of {len(view)} bytes"
            )
        return view

    def close(self) -> None:
        self.maps.clear()  # each mapping closes when the last view on it is gone
