"""Feature rows through shared memory (`specmesh.protocol.shared_rows`): the target's ring, the
readers' mappings, the references on the wire, and rows written over before they were read."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from specmesh.protocol.codec import CodecError, RowBlock, join_rows, join_state_rows
from specmesh.protocol.shared_rows import (
    HEADER_BYTES,
    SHM_DIR,
    RegionMaps,
    RowRing,
    SharedRowsError,
)
from specmesh.runtime.codec import join_hidden_states, split_hidden_states, tensor_of

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm")
CAPACITY = 64 << 10


@pytest.fixture
def ring():
    ring = RowRing(CAPACITY)
    yield ring
    ring.close()


def rows(n: int, width: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, width, generator=torch.Generator().manual_seed(seed))


def test_a_target_answer_reaches_the_draft_through_the_router_as_references(ring):
    feats, mm = rows(6), rows(6, 16, seed=1).to(torch.bfloat16)
    chunks = split_hidden_states([2, 4], {"aux_hidden": feats, "mm_input_embeds": mm}, ring=ring)
    assert chunks[0].aux_hidden.WhichOneof("payload") == "shm" and not chunks[0].aux_hidden.data
    router = RegionMaps()  # the router cuts per request and joins back, without a copy
    counts, blocks = join_state_rows(chunks, router)
    block = blocks["aux_hidden"]
    assert counts == [2, 4] and block.origin is not None
    joined = join_rows([block[0:2], block[2:6]])
    assert joined.origin == block.origin and joined.buffer is block.buffer
    forwarded = type(chunks[0])()
    joined.write_to(forwarded.aux_hidden)
    blocks["mm_input_embeds"].write_to(forwarded.mm_input_embeds)
    forwarded.row_counts[:] = counts
    counts, tensors = join_hidden_states([forwarded], RegionMaps())  # the draft copies them out
    assert torch.equal(tensors["aux_hidden"], feats)
    assert torch.equal(tensors["mm_input_embeds"], mm)


def test_shared_rows_over_the_message_budget_stay_one_message(ring):
    feats = rows(64)  # 8 KiB of rows against a 1 KiB budget: 8 chunks as bytes
    assert len(split_hidden_states([64], {"hidden": feats}, max_bytes=1024)) == 8
    (chunk,) = split_hidden_states([64], {"hidden": feats}, max_bytes=1024, ring=ring)
    assert torch.equal(join_hidden_states([chunk], RegionMaps())[1]["hidden"], feats)


def test_rows_out_of_order_are_joined_by_a_copy(ring):
    feats = rows(4)
    (chunk,) = split_hidden_states([4], {"hidden": feats}, ring=ring)
    block = join_state_rows([chunk], RegionMaps())[1]["hidden"]
    swapped = join_rows([block[2:4], block[0:2]])
    assert swapped.origin is None
    assert torch.equal(tensor_of(swapped), torch.cat([feats[2:4], feats[0:2]]))


def test_the_ring_wraps_without_splitting_rows_and_reports_what_it_wrote_over(ring):
    reader = RegionMaps()
    first = ring.reserve(CAPACITY // 4)
    (chunk,) = split_hidden_states([1], {"hidden": rows(1, CAPACITY // 16 - 1)}, ring=ring)
    block = join_state_rows([chunk], reader)[1]["hidden"]
    assert first == 0 and block.start == HEADER_BYTES + CAPACITY // 4
    tensor_of(block)  # still whole
    for _ in range(4):  # the ring comes round over it
        position = ring.reserve(CAPACITY // 4 - 8)
        assert ring.offset(position) + CAPACITY // 4 - 8 <= HEADER_BYTES + CAPACITY
    with pytest.raises(CodecError, match="written over"):
        tensor_of(block)
    assert ring.reserve(CAPACITY // 4 + 1) is None  # too large: those rows go on the wire


def test_rows_too_large_for_the_ring_go_inline(ring):
    big = rows(CAPACITY // 4 // 128 + 1)  # 32 fp32 = 128 bytes a row: over a quarter
    (chunk,) = split_hidden_states([len(big)], {"hidden": big}, ring=ring)
    assert chunk.hidden.WhichOneof("payload") == "data"
    assert torch.equal(join_hidden_states([chunk])[1]["hidden"], big)


def test_bad_references_are_refused_with_the_reason(ring):
    (chunk,) = split_hidden_states([2], {"hidden": rows(2)}, ring=ring)
    with pytest.raises(CodecError, match="not accepted"):
        join_state_rows([chunk])  # a stream that did not ask for shared rows
    for field, value, reason in [
        ("region", "../etc/passwd", "not one of specmesh's"),
        ("region", "specmesh-0000000000000000", "does not exist"),
        ("offset", CAPACITY + HEADER_BYTES, "does not fit"),
        ("position", 7, "does not fit"),
    ]:
        bad = type(chunk)()
        bad.CopyFrom(chunk)
        setattr(bad.hidden.shm, field, value)
        with pytest.raises(CodecError, match=reason):
            join_state_rows([bad], RegionMaps())
    with pytest.raises(SharedRowsError):
        RegionMaps().view("specmesh-zz")


def test_a_closed_ring_leaves_nothing_under_dev_shm():
    ring = RowRing(CAPACITY)
    reader = RegionMaps()
    reader.view(ring.name)
    assert (SHM_DIR / ring.name).exists()
    ring.close()
    reader.close()
    assert not (SHM_DIR / ring.name).exists()


def test_a_block_copied_as_bytes_is_checked_too(ring):
    (chunk,) = split_hidden_states([1], {"hidden": rows(1)}, ring=ring)
    block = join_state_rows([chunk], RegionMaps())[1]["hidden"]
    assert isinstance(block, RowBlock) and len(block.tobytes()) == 128
    for _ in range(5):
        ring.reserve(CAPACITY // 4)
    with pytest.raises(CodecError, match="written over"):
        block.tobytes()


def test_rings_of_a_killed_target_are_removed_by_the_next_one():
    code = (  # the process dies without its cleanup, as under SIGKILL
        "import os; from specmesh.protocol.shared_rows import RowRing\n"
        "ring = RowRing(4096); print(ring.name, flush=True); os._exit(0)"
    )
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    assert name and (SHM_DIR / name).exists()  # its process died without closing it
    ring = RowRing(4096)
    try:
        assert not (SHM_DIR / name).exists() and (SHM_DIR / ring.name).exists()
        assert int(ring.name[9:17], 16) == os.getpid()
    finally:
        ring.close()


def test_a_ring_still_open_at_exit_is_unlinked():
    code = "from specmesh.protocol.shared_rows import RowRing; r = RowRing(4096); print(r.name)"
    name = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()  # fmt: skip
    assert name and not (SHM_DIR / name).exists()


def test_a_host_without_room_for_a_ring_answers_on_the_wire(monkeypatch):
    """posix_fallocate refuses (ENOSPC) where /dev/shm is full: the ring's file is gone again,
    and the target serves that stream's rows inline instead of refusing it."""
    import errno

    from specmesh.target_service import server

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    before = set(SHM_DIR.glob("specmesh-*"))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(OSError):
        RowRing(4096)
    assert server._ring() is None
    assert set(SHM_DIR.glob("specmesh-*")) == before
