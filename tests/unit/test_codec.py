"""The one wire codec: `specmesh.protocol.codec` (rows as bytes, torch-free) and its torch edge
`specmesh.runtime.codec` (tensors in and out): round trips, validation messages, chunking."""

from __future__ import annotations

import pytest
import torch

from specmesh.protocol.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    GRPC_MAX_MESSAGE_BYTES,
    CodecError,
    RowBlock,
    grpc_message_options,
)
from specmesh.runtime.codec import (
    DTYPES,
    all_finite,
    join_hidden_states,
    rows_of,
    split_hidden_states,
    tensor_of,
)
from specmesh.v1 import common_pb2, tensor_pb2


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g, dtype=dtype)


def _wire(block: RowBlock) -> tensor_pb2.Tensor:
    """Written into a message, serialized and parsed, as the network does."""
    msg = tensor_pb2.Tensor()
    block.write_to(msg)
    return tensor_pb2.Tensor.FromString(msg.SerializeToString())


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (0, 4)])
def test_round_trip_every_dtype_and_shape(dtype_name: str, shape: tuple[int, int]) -> None:
    t = _sample(DTYPES[dtype_name], shape)
    msg = _wire(rows_of(t))
    assert msg.dtype == dtype_name and list(msg.shape) == list(shape)
    out = tensor_of(RowBlock.from_pb(msg))
    assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)


def test_encoding_is_row_major_little_endian() -> None:
    block = rows_of(torch.tensor([[1, 2], [3, 256]], dtype=torch.int32))
    assert block.tobytes() == bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 1, 0, 0])
    assert rows_of(torch.tensor([[1.0]], dtype=torch.bfloat16)).tobytes() == b"\x80\x3f"
    assert rows_of(torch.tensor([[True, False]])).tobytes() == b"\x01\x00"


def test_non_contiguous_input_is_encoded_in_logical_order() -> None:
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    assert torch.equal(tensor_of(rows_of(t.T)), t.T.contiguous())
    assert torch.equal(tensor_of(rows_of(t[:, 1::2])), t[:, 1::2].contiguous())


def test_a_window_decodes_without_copying_and_writable_owns_its_memory() -> None:
    block = rows_of(torch.arange(12, dtype=torch.float32).reshape(6, 2))
    window = block[2:5]
    view = tensor_of(window)
    assert torch.equal(view, torch.arange(4, 10, dtype=torch.float32).reshape(3, 2))
    owned = tensor_of(window, writable=True)
    owned += 1
    assert torch.equal(tensor_of(window), view) and view.data_ptr() % 4 == 0


def test_unsupported_dtype_and_rank_on_encode() -> None:
    with pytest.raises(CodecError, match=r"'x'.*torch\.float64"):
        rows_of(torch.zeros(2, 2, dtype=torch.float64), name="x")
    with pytest.raises(CodecError, match=r"'x': shape \[2, 2, 2\], expected \[rows, width\]"):
        rows_of(torch.zeros(2, 2, 2), name="x")


def test_wrong_byte_length_names_the_numbers() -> None:
    msg = tensor_pb2.Tensor(dtype="fp32", shape=[10, 32], data=bytes(1000))
    with pytest.raises(CodecError) as err:
        RowBlock.from_pb(msg, name="aux_hidden")
    assert str(err.value) == "tensor 'aux_hidden': 1000 bytes but shape [10, 32] of fp32 needs 1280"


@pytest.mark.parametrize(
    ("msg", "pattern"),
    [
        (tensor_pb2.Tensor(dtype="fp64", shape=[1, 1], data=bytes(8)), r"unknown dtype 'fp64'"),
        (tensor_pb2.Tensor(dtype="", shape=[1, 1], data=bytes(4)), r"unknown dtype ''"),
        (tensor_pb2.Tensor(dtype="fp32", shape=[2, -3]), r"shape \[2, -3\], expected \[rows"),
        (tensor_pb2.Tensor(dtype="fp32", shape=[4]), r"shape \[4\], expected \[rows, width\]"),
        (tensor_pb2.Tensor(dtype="fp32", shape=[4, 0]), r"shape \[4, 0\], expected \[rows"),
        (tensor_pb2.Tensor(dtype="bf16", shape=[1, 3], data=bytes(8)), r"8 bytes but .* needs 6"),
        (tensor_pb2.Tensor(dtype="int64", shape=[1, 2]), r"0 bytes but shape \[1, 2\] of int64"),
        (tensor_pb2.Tensor(dtype="bool", shape=[0, 1], data=b"\x01"), r"1 bytes but .* needs 0"),
        (
            tensor_pb2.Tensor(
                dtype="fp16", shape=[1, 1], shm=tensor_pb2.SharedMemoryRef(region="r")
            ),
            r"shared-memory",
        ),
    ],
)
def test_malformed_messages(msg: tensor_pb2.Tensor, pattern: str) -> None:
    with pytest.raises(CodecError, match=pattern):
        RowBlock.from_pb(tensor_pb2.Tensor.FromString(msg.SerializeToString()), name="t")


def test_bool_rows_hold_only_zero_and_one() -> None:
    block = RowBlock.from_pb(tensor_pb2.Tensor(dtype="bool", shape=[1, 2], data=b"\x01\x02"))
    with pytest.raises(CodecError, match="other than 0 and 1"):
        tensor_of(block, name="t")


def test_codec_error_is_value_error() -> None:
    assert issubclass(CodecError, ValueError)


def test_hidden_states_chunking_round_trip() -> None:
    row_counts = [30, 0, 50]
    aux = _sample(torch.bfloat16, (80, 24))  # 48 bytes per row
    embeds = _sample(torch.bfloat16, (80, 8))  # 16 bytes per row
    chunks = split_hidden_states(
        row_counts, {"aux_hidden": aux, "mm_input_embeds": embeds, "hidden": None}, max_bytes=1024
    )
    assert len(chunks) == 5  # 16 rows * 64 bytes per chunk
    assert list(chunks[0].row_counts) == row_counts
    assert all(not c.row_counts for c in chunks[1:])
    assert all(c.ByteSize() < 1024 + 128 for c in chunks)
    wire = [common_pb2.HiddenStates.FromString(c.SerializeToString()) for c in chunks]
    got_counts, tensors = join_hidden_states(wire)
    assert got_counts == row_counts
    assert sorted(tensors) == ["aux_hidden", "mm_input_embeds"]
    assert torch.equal(tensors["aux_hidden"], aux)
    assert torch.equal(tensors["mm_input_embeds"], embeds)


def test_hidden_states_errors() -> None:
    with pytest.raises(CodecError, match=r"'hidden': 5 rows for row_counts summing to 6"):
        split_hidden_states([3, 3], {"hidden": torch.zeros(5, 4)})
    with pytest.raises(CodecError, match=r"one row of .* is 1600 bytes, over the message budget"):
        split_hidden_states([1], {"hidden": torch.zeros(1, 400)}, max_bytes=1000)
    with pytest.raises(CodecError, match=r"'logits'.*\(fields: "):
        split_hidden_states([1], {"logits": torch.zeros(1, 4)})
    bad = common_pb2.HiddenStates(row_counts=[2, 2])
    rows_of(torch.zeros(3, 4)).write_to(bad.hidden)
    with pytest.raises(CodecError, match=r"'hidden': 3 rows but row_counts \[2, 2\] sum to 4"):
        join_hidden_states([bad])
    late = common_pb2.HiddenStates(row_counts=[1])
    with pytest.raises(CodecError, match="row_counts set after chunk 0"):
        join_hidden_states([late, late])


def test_empty_hidden_states_is_one_chunk() -> None:
    chunks = split_hidden_states([0, 0], {"aux_hidden": torch.zeros(0, 12)})
    assert len(chunks) == 1
    counts, tensors = join_hidden_states(chunks)
    assert counts == [0, 0] and tensors["aux_hidden"].shape == (0, 12)


def test_limits() -> None:
    assert DEFAULT_MAX_MESSAGE_BYTES == 4 * 1024 * 1024
    assert GRPC_MAX_MESSAGE_BYTES > DEFAULT_MAX_MESSAGE_BYTES
    assert dict(grpc_message_options()) == {
        "grpc.max_send_message_length": GRPC_MAX_MESSAGE_BYTES,
        "grpc.max_receive_message_length": GRPC_MAX_MESSAGE_BYTES,
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_finite_finds_every_nan_and_inf_and_nothing_else(dtype: torch.dtype) -> None:
    """The draft's check of the feature rows it receives: exactly the non-finite values, the
    largest finite ones (whose fp32 sum would overflow) and an empty tensor passing."""
    t = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).to(dtype)
    assert all_finite(t) and all_finite(t[:0])
    assert all_finite(torch.full((64, 64), torch.finfo(dtype).max, dtype=dtype))
    for bad in (float("nan"), float("inf"), float("-inf")):
        u = t.clone()
        u[3, 7] = bad
        assert not all_finite(u)
        assert not all_finite(u[2:4, 5:9])  # a view that is not contiguous
