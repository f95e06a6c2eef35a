"""How per-token rows are cut into HiddenStates messages under a byte budget, for tensors
(`runtime.codec`) and for undecoded bytes (`rpc.rows`) alike. Torch-free: the router uses it."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from specmesh.v1 import common_pb2

Rows = TypeVar("Rows")  # anything cut by rows with [start:stop]: a tensor, a RowBlock
# Writes ``rows`` (a row range of field ``key``) into the message's field of that name.
WriteRows = Callable[[Any, str, Any], None]


def chunk_rows(
    row_counts: Sequence[int],
    present: Mapping[str, Rows],
    row_bytes: int,
    max_bytes: int,
    write: WriteRows,
    error: type[Exception],
) -> list[common_pb2.HiddenStates]:
    """HiddenStates chunks of at most ``max_bytes`` of payload each (``row_bytes`` per row over
    all fields), every chunk holding the same row range of every field; ``row_counts`` in the
    first chunk only. A single row over the budget raises ``error``."""
    if row_bytes > max_bytes:
        raise error(
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
