"""The one bytes codec: tensors and per-token rows on the wire, torch-free.

Format (protos/specmesh/v1/tensor.proto): a ``Tensor`` message holds ``dtype`` (one of
``ITEMSIZE``' names), ``shape`` and ``data``, the elements in C order, little-endian (bf16 as its
raw 16-bit patterns, bool as one byte). Never ``repeated float``. Everything that crosses a hop
is rows, ``[rows, width]``: a `RowBlock` is such a message's payload (dtype, width, bytes),
sliced and joined by byte offsets. A ``HiddenStates`` batch (aux hidden states, final hidden
states, ``mm_input_embeds``) travels as chunks of at most ``DEFAULT_MAX_MESSAGE_BYTES``, each
holding the same row range of every field, ``row_counts`` in the first only
(`split_state_rows` / `join_state_rows`).

Who converts. The target's service encodes its tensors into blocks and the draft's decodes them
(`specmesh.runtime.codec`: the only torch on this path); the router forwards the target's blocks
to the draft without decoding (`specmesh.router.draft_rows`). On one host the blocks can be
windows on a shared-memory ring instead (`specmesh.protocol.shared_rows`): they travel as
references (``Tensor.shm``) and only the draft copies their bytes.

Copies. Reading a message's ``data`` yields a fresh ``bytes`` (protobuf's copy); a block's rows
are a window on it, so slicing copies nothing, and joining windows that lie back to back on one
buffer (a micro-batch forwarded whole, in order) copies nothing either. Anything else is joined
with one copy. Writing a block into a message copies its window once (protobuf takes ``bytes``
only) unless the window is the whole buffer.

The in-process path keeps torch tensors; both kinds slice with ``rows[start:stop]`` and join with
`join_rows`, so the round is written once for both.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from specmesh.protocol.shared_rows import RegionMaps, SharedRowsError, intact
from specmesh.v1 import common_pb2, tensor_pb2

# Payload budget per stream message; above it a batch is split into chunks.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024
# gRPC max send/receive message size for every specmesh channel and server (both ends):
# well above the chunk budget so a chunk plus its non-tensor fields always fits.
GRPC_MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def grpc_message_options(max_bytes: int = GRPC_MAX_MESSAGE_BYTES) -> list[tuple[str, int]]:
    """Channel/server options raising gRPC's 4 MiB default on both send and receive."""
    return [
        ("grpc.max_send_message_length", max_bytes),
        ("grpc.max_receive_message_length", max_bytes),
    ]


# Bytes per element of each wire dtype (tensor.proto).
ITEMSIZE = {"bf16": 2, "fp16": 2, "fp32": 4, "int32": 4, "int64": 8, "bool": 1}
# HiddenStates fields that hold per-token rows, in field order (common.proto).
ROW_FIELDS = ("aux_hidden", "hidden", "mm_input_embeds")


class CodecError(ValueError):
    """A tensor or rows message that does not describe ``[rows, width]`` of a known dtype, or
    rows that do not fit a message; the message names the tensor and the numbers (servers map
    it to INVALID_ARGUMENT)."""


@dataclass(frozen=True, eq=False)
class RowBlock:
    """Rows ``[start, stop)`` (in bytes) of ``buffer``, each ``width`` elements of ``dtype``.
    ``origin`` is set when ``buffer`` is a shared-memory region (`specmesh.protocol.
    shared_rows`): its name and ``base``, where the writer's logical position of byte ``i`` of
    the region is ``base + i``. Such a block travels as a reference and reads as a copy."""

    dtype: str
    width: int
    buffer: bytes | memoryview
    start: int = 0
    stop: int | None = None
    origin: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            object.__setattr__(self, "stop", len(self.buffer))

    @property
    def row_bytes(self) -> int:
        return self.width * ITEMSIZE[self.dtype]

    @property
    def num_rows(self) -> int:
        return (self.stop - self.start) // self.row_bytes if self.row_bytes else 0

    @property
    def shape(self) -> tuple[int, int]:
        return (self.num_rows, self.width)

    def __len__(self) -> int:
        return self.num_rows

    def __getitem__(self, rows: slice) -> RowBlock:
        """Rows ``rows.start:rows.stop`` (a step-1 slice), without copying."""
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError(f"a RowBlock is sliced by rows (start:stop), got {rows!r}")
        first, last, _ = rows.indices(self.num_rows)
        last = max(first, last)
        at = lambda r: self.start + r * self.row_bytes
        return RowBlock(self.dtype, self.width, self.buffer, at(first), at(last), self.origin)

    def tobytes(self) -> bytes:
        """The rows' payload: the buffer itself when the block spans it, else one copy (of
        shared rows checked to be whole after copying)."""
        if self.origin is None and self.start == 0 and self.stop == len(self.buffer):
            return self.buffer
        data = bytes(self.buffer[self.start : self.stop])
        self.check_intact()
        return data

    def check_intact(self) -> None:
        """Raise `CodecError` if these are shared rows that the writer has written over."""
        if self.origin is not None and not intact(self.buffer, self.origin[1] + self.start):
            raise CodecError(
                f"shared rows in {self.origin[0]} were written over before they were read"
            )

    def write_to(self, msg: tensor_pb2.Tensor) -> None:
        """Fill a (message field's) Tensor with these rows: the payload is copied once, there,
        or for shared rows, where they lie."""
        msg.dtype = self.dtype
        msg.shape[:] = self.shape
        if self.origin is None:
            msg.data = self.tobytes()
            return
        name, base = self.origin
        ref = msg.shm
        ref.region, ref.offset, ref.byte_size = name, self.start, self.stop - self.start
        ref.position = base + self.start

    @staticmethod
    def from_pb(
        msg: tensor_pb2.Tensor, *, name: str = "rows", regions: RegionMaps | None = None
    ) -> RowBlock:
        """A ``[rows, width]`` Tensor message's payload, its size checked against its shape;
        shared rows only where ``regions`` maps them (a reader on the writer's host)."""
        if msg.dtype not in ITEMSIZE:
            raise CodecError(
                f"tensor '{name}': unknown dtype '{msg.dtype}' (one of {list(ITEMSIZE)})"
            )
        shape = list(msg.shape)
        if len(shape) != 2 or shape[0] < 0 or shape[1] < 1:
            raise CodecError(f"tensor '{name}': shape {shape}, expected [rows, width]")
        needed = shape[0] * shape[1] * ITEMSIZE[msg.dtype]
        if msg.WhichOneof("payload") == "shm":
            return _shared_block(msg, name, needed, regions)
        data = msg.data
        if len(data) != needed:
            raise CodecError(
                f"tensor '{name}': {len(data)} bytes but shape {shape} of {msg.dtype} needs {needed}"
            )
        return RowBlock(msg.dtype, shape[1], data)

    @staticmethod
    def join(blocks: Sequence[RowBlock], *, name: str = "rows") -> RowBlock:
        """Rows of ``blocks`` in order: a window when they lie back to back on one buffer, else
        one copy. Every block must share dtype and width."""
        first = blocks[0]
        for b in blocks[1:]:
            if (b.dtype, b.width) != (first.dtype, first.width):
                raise CodecError(
                    f"tensor '{name}': cannot join rows of {b.dtype} x {b.width} to rows of "
                    f"{first.dtype} x {first.width}"
                )
        adjacent = all(
            b.buffer is a.buffer and b.start == a.stop and b.origin == a.origin
            for a, b in itertools.pairwise(blocks)
        )
        if adjacent:
            return RowBlock(first.dtype, first.width, first.buffer, first.start,
                            blocks[-1].stop, first.origin)  # fmt: skip
        data = b"".join(memoryview(b.buffer)[b.start : b.stop] for b in blocks)
        for b in blocks:
            b.check_intact()
        return RowBlock(first.dtype, first.width, data)


def _shared_block(
    msg: tensor_pb2.Tensor, name: str, needed: int, regions: RegionMaps | None
) -> RowBlock:
    """The rows a ``Tensor.shm`` reference points at, as a window on its region."""
    ref = msg.shm
    if regions is None:
        raise CodecError(f"tensor '{name}': shared-memory rows are not accepted on this stream")
    if ref.byte_size != needed:
        raise CodecError(
            f"tensor '{name}': {ref.byte_size} shared bytes but shape {list(msg.shape)} of "
            f"{msg.dtype} needs {needed}"
        )
    try:
        view = regions.locate(ref.region, ref.offset, ref.byte_size, ref.position)
    except SharedRowsError as e:
        raise CodecError(f"tensor '{name}': {e}") from None
    stop = ref.offset + ref.byte_size
    return RowBlock(msg.dtype, msg.shape[1], view, ref.offset, stop,
                    (ref.region, ref.position - ref.offset))  # fmt: skip


def join_rows(parts: Sequence[Any]) -> Any:
    """Concatenate rows: `RowBlock`s by bytes (`RowBlock.join`), torch tensors (the in-process
    path) with ``torch.cat``; ``None`` when any part is missing."""
    if not parts or any(p is None for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    if isinstance(parts[0], RowBlock):
        return RowBlock.join(parts)
    import torch  # the in-process path only: its parts are tensors, torch is loaded already

    return torch.cat(list(parts))


# -- HiddenStates ------------------------------------------------------------------------------
def join_state_rows(
    chunks: Sequence[common_pb2.HiddenStates], regions: RegionMaps | None = None
) -> tuple[list[int], dict[str, RowBlock]]:
    """A HiddenStates batch's chunks as ``(row_counts, {field: RowBlock})`` (fields present only),
    each field's rows checked to total ``sum(row_counts)``. Nothing is decoded; shared rows are
    accepted where ``regions`` maps them."""
    if not chunks:
        raise CodecError("hidden states: no chunks to join")
    row_counts = list(chunks[0].row_counts)
    if any(c.row_counts for c in chunks[1:]):
        raise CodecError("hidden states: row_counts set after chunk 0")
    blocks = {}
    for key in ROW_FIELDS:
        parts = [
            RowBlock.from_pb(getattr(c, key), name=f"{key}[part {i}]", regions=regions)
            for i, c in enumerate(chunks)
            if c.HasField(key)
        ]
        if parts:
            blocks[key] = RowBlock.join(parts, name=key)
            if blocks[key].num_rows != sum(row_counts):
                raise CodecError(
                    f"tensor '{key}': {blocks[key].num_rows} rows but row_counts {row_counts} "
                    f"sum to {sum(row_counts)}"
                )
    return row_counts, blocks


def split_state_rows(
    row_counts: Sequence[int], blocks: Mapping[str, RowBlock | None], max_bytes: int
) -> list[common_pb2.HiddenStates]:
    """HiddenStates chunks of at most ``max_bytes`` of payload each, every chunk holding the same
    row range of every block; ``row_counts`` in the first chunk only."""
    present = {k: b for k, b in blocks.items() if b is not None}
    num_rows = sum(row_counts)
    for key, b in present.items():
        if key not in ROW_FIELDS or b.num_rows != num_rows:
            raise CodecError(
                f"tensor '{key}': {b.num_rows} rows for row_counts summing to {num_rows} "
                f"(fields: {ROW_FIELDS})"
            )
    # Shared rows travel as references: only bytes on the wire count against the budget.
    row_bytes = sum(b.row_bytes for b in present.values() if b.origin is None)
    write = lambda field, _key, rows: rows.write_to(field)
    return _chunk_rows(row_counts, present, row_bytes, max_bytes, write)


def _chunk_rows(
    row_counts: Sequence[int],
    present: Mapping[str, RowBlock],
    row_bytes: int,
    max_bytes: int,
    write: Callable[[tensor_pb2.Tensor, str, RowBlock], None],
) -> list[common_pb2.HiddenStates]:
    """HiddenStates chunks of at most ``max_bytes`` of payload each (``row_bytes`` per row over
    all fields), every chunk holding the same row range of every field; ``row_counts`` in the
    first chunk only. A single row over the budget raises `CodecError`."""
    if row_bytes > max_bytes:
        raise CodecError(
            f"hidden states: one row of {sorted(present)} is {row_bytes} bytes, over the message "
            f"budget of {max_bytes} bytes"
        )
    num_rows = sum(row_counts)
    per_chunk = max(1, max_bytes // row_bytes) if row_bytes else max(1, num_rows)
    chunks = []
    for start in range(0, max(num_rows, 1), per_chunk):
        msg = common_pb2.HiddenStates(row_counts=row_counts if start == 0 else ())
        for key, rows in present.items():
            write(getattr(msg, key), key, rows[start : start + per_chunk])
        chunks.append(msg)
    return chunks
