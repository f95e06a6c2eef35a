"""The torch edge of the wire codec (`specmesh.protocol.codec`): a model service turns its
per-token tensors into rows once when it answers, and rows into tensors once when it reads.

``rows_of`` copies once into a ``bytes`` object (after a device-to-host move and
``.contiguous()`` when needed); protobuf copies that into the message. ``tensor_of`` adds no copy
to protobuf's own (reading ``data`` yields a fresh ``bytes``): the result views the block's
window through ``torch.frombuffer``. The buffer is immutable, so the tensor is read-only by
contract (``.to(device)``, ``.to(dtype)`` and ``torch.cat`` copy anyway); ``writable=True``
copies once into memory the tensor owns. A window whose address is not a multiple of the element
size is copied too (CPython's bytes are 16-byte aligned and rows are whole elements, so it does
not happen). A zero-size tensor is allocated fresh. The host is assumed little-endian.
Through shared memory (`specmesh.protocol.shared_rows`) the target writes its rows straight
into the ring (``shared_rows_of``: one copy from the device), and the draft copies them out
before it checks that the ring has not come round over them.

Measured (2-core shared CPU VM, torch 2.13, protobuf 7.36 upb): encode + decode of a [4096, 12288]
bf16 tensor (96 MiB) takes ~150 ms (~0.65 GB/s; three memcpy: tobytes, upb's copy on assignment,
upb's copy on reading ``data``), ~260 ms (~0.4 GB/s) as 4 MiB chunks with serialize + parse.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from specmesh.protocol.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    ITEMSIZE,
    CodecError,
    RowBlock,
    join_state_rows,
    split_state_rows,
)
from specmesh.protocol.shared_rows import RegionMaps, RowRing
from specmesh.v1 import common_pb2

DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "int32": torch.int32,
    "int64": torch.int64,
    "bool": torch.bool,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}
assert set(DTYPES) == set(ITEMSIZE), "every wire dtype has a torch dtype"

# A float is NaN or Inf exactly when its exponent bits are all set: (the same-width int view,
# the exponent's bits) per float dtype.
_EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
}


def all_finite(t: torch.Tensor) -> bool:
    """Whether a host float tensor holds no NaN or Inf: one pass over its bits (numpy), a
    third of what summing it in fp32 costs and free of that sum's overflow."""
    view, bits = _EXPONENT_BITS[t.dtype]
    if not t.numel():
        return True
    return int(np.bitwise_and(t.contiguous().view(view).numpy(), bits).max()) != bits


# tensor_of views immutable bytes on purpose (see the module docstring). torch warns about that
# once per process (TORCH_WARN_ONCE); spend the warning here, silenced, without touching the
# global warning filters.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


def _wire_dtype(t: torch.Tensor, name: str) -> str:
    """The wire name of ``t``'s dtype, once ``t`` is checked to be ``[rows, width]``."""
    dtype = DTYPE_NAMES.get(t.dtype)
    if dtype is None:
        raise CodecError(f"tensor '{name}': dtype {t.dtype} is not one of {', '.join(DTYPES)}")
    if t.dim() != 2 or t.shape[1] < 1:
        raise CodecError(f"tensor '{name}': shape {list(t.shape)}, expected [rows, width]")
    return dtype


def rows_of(t: torch.Tensor, *, name: str = "rows") -> RowBlock:
    """``t`` ``[rows, width]`` (any device, any strides) as row-major little-endian bytes."""
    dtype = _wire_dtype(t, name)
    flat = t.detach().to("cpu").contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return RowBlock(dtype, t.shape[1], data)


def tensor_of(block: RowBlock, *, name: str = "rows", writable: bool = False) -> torch.Tensor:
    """The block's rows as a CPU tensor ``[rows, width]``, viewing its bytes unless
    ``writable`` or shared (shared rows are copied out, then checked whole). Bool rows must
    hold only bytes 0 and 1."""
    dtype, shape = DTYPES[block.dtype], block.shape
    count = shape[0] * shape[1]
    if count == 0:
        return torch.empty(shape, dtype=dtype)
    window = memoryview(block.buffer)[block.start : block.stop]
    if dtype == torch.bool and bytes(window).translate(None, b"\x00\x01"):
        raise CodecError(f"tensor '{name}': bool payload holds bytes other than 0 and 1")
    if writable or block.origin is not None:
        window = bytearray(window)
        block.check_intact()
    t = torch.frombuffer(window, dtype=dtype, count=count)
    if t.data_ptr() % dtype.itemsize:  # misaligned view: copy into an aligned allocation
        t = t.clone()
    return t.view(shape)


def shared_rows_of(ring: RowRing, t: torch.Tensor, *, name: str = "rows") -> RowBlock:
    """``t`` as `rows_of` gives it, written into ``ring`` (one copy from its device) when it
    fits there, else as bytes."""
    dtype = _wire_dtype(t, name)
    nbytes = t.numel() * t.element_size()
    position = ring.reserve(nbytes) if nbytes else None
    if position is None:
        return rows_of(t, name=name)
    start = ring.offset(position)
    dest = torch.frombuffer(ring.view[start : start + nbytes], dtype=torch.uint8)
    dest.copy_(t.detach().contiguous().reshape(-1).view(torch.uint8))
    origin = (ring.name, position - start)
    return RowBlock(dtype, t.shape[1], ring.view, start, start + nbytes, origin)


def split_hidden_states(
    row_counts: Sequence[int],
    tensors: Mapping[str, torch.Tensor | None],
    max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    ring: RowRing | None = None,
) -> list[common_pb2.HiddenStates]:
    """Per-token tensors (``None`` = absent) as HiddenStates chunks (`split_state_rows`), through
    ``ring`` when given (`shared_rows_of`)."""
    encode = rows_of if ring is None else functools.partial(shared_rows_of, ring)
    blocks = {k: None if t is None else encode(t, name=k) for k, t in tensors.items()}
    return split_state_rows(row_counts, blocks, max_bytes)


def join_hidden_states(
    chunks: Sequence[common_pb2.HiddenStates], regions: RegionMaps | None = None
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """HiddenStates chunks as ``(row_counts, {field: [sum(row_counts), width] tensor})``, fields
    present only (`join_state_rows` checks every size); shared rows where ``regions`` maps
    them, copied out."""
    row_counts, blocks = join_state_rows(chunks, regions)
    return row_counts, {k: tensor_of(b, name=k) for k, b in blocks.items()}
