"""runtime/codec.py: tensor round trips, validation messages, row chunking."""

from __future__ import annotations

import pytest
import torch

from specmesh.runtime.codec import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DTYPES,
    GRPC_MAX_MESSAGE_BYTES,
    TensorError,
    concat_rows,
    decode_tensor,
    encode_tensor,
    grpc_message_options,
    join_hidden_states,
    split_hidden_states,
    split_rows,
)
from specmesh.v1 import common_pb2, tensor_pb2


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**30), 2**30, shape, generator=g, dtype=dtype)


def _wire(msg: tensor_pb2.Tensor) -> tensor_pb2.Tensor:
    """Serialize and parse, as the network does."""
    return tensor_pb2.Tensor.FromString(msg.SerializeToString())


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("shape", [(), (1,), (3, 5), (2, 3, 4), (0,), (4, 0, 2)])
def test_round_trip_every_dtype_and_shape(dtype_name: str, shape: tuple[int, ...]) -> None:
    t = _sample(DTYPES[dtype_name], shape)
    msg = _wire(encode_tensor(t))
    assert msg.dtype == dtype_name
    assert list(msg.shape) == list(shape)
    out = decode_tensor(msg, expected_dtype=dtype_name, expected_rank=len(shape))
    assert out.dtype == t.dtype and out.shape == t.shape
    assert torch.equal(out, t)


def test_encoding_is_row_major_little_endian() -> None:
    msg = encode_tensor(torch.tensor([[1, 2], [3, 256]], dtype=torch.int32))
    assert msg.data == bytes([1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 1, 0, 0])
    assert encode_tensor(torch.tensor([1.0], dtype=torch.bfloat16)).data == b"\x80\x3f"
    assert encode_tensor(torch.tensor([True, False])).data == b"\x01\x00"


def test_non_contiguous_input_is_encoded_in_logical_order() -> None:
    t = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    assert torch.equal(decode_tensor(encode_tensor(t.T)), t.T.contiguous())
    assert torch.equal(decode_tensor(encode_tensor(t[:, 1::2])), t[:, 1::2].contiguous())


def test_decode_writable_owns_its_memory() -> None:
    msg = encode_tensor(torch.zeros(4, dtype=torch.float32))
    out = decode_tensor(msg, writable=True)
    out += 1
    assert torch.equal(decode_tensor(msg), torch.zeros(4))
    assert decode_tensor(msg).data_ptr() % 4 == 0


def test_unsupported_dtype_on_encode() -> None:
    with pytest.raises(TensorError, match=r"'x'.*torch\.float64"):
        encode_tensor(torch.zeros(2, dtype=torch.float64), name="x")


def test_wrong_byte_length_names_the_numbers() -> None:
    msg = tensor_pb2.Tensor(dtype="fp32", shape=[10, 32], data=bytes(1000))
    with pytest.raises(TensorError) as err:
        decode_tensor(msg, name="aux_hidden")
    assert str(err.value) == "tensor 'aux_hidden': 1000 bytes but shape [10, 32] of fp32 needs 1280"


@pytest.mark.parametrize(
    ("msg", "pattern"),
    [
        (tensor_pb2.Tensor(dtype="fp64", shape=[1], data=bytes(8)), r"unknown dtype 'fp64'"),
        (tensor_pb2.Tensor(dtype="", shape=[1], data=bytes(4)), r"unknown dtype ''"),
        (
            tensor_pb2.Tensor(dtype="fp32", shape=[2, -3], data=b""),
            r"negative dimension.*\[2, -3\]",
        ),
        (
            tensor_pb2.Tensor(dtype="bf16", shape=[3], data=bytes(8)),
            r"8 bytes but .*\[3\].*needs 6",
        ),
        (tensor_pb2.Tensor(dtype="int64", shape=[2]), r"0 bytes but shape \[2\] of int64 needs 16"),
        (tensor_pb2.Tensor(dtype="bool", shape=[0], data=b"\x01"), r"1 bytes but .* needs 0"),
        (tensor_pb2.Tensor(dtype="bool", shape=[2], data=b"\x01\x02"), r"other than 0 and 1"),
        (
            tensor_pb2.Tensor(dtype="fp16", shape=[1], shm=tensor_pb2.SharedMemoryRef(region="r")),
            r"shared-memory",
        ),
    ],
)
def test_malformed_messages(msg: tensor_pb2.Tensor, pattern: str) -> None:
    with pytest.raises(TensorError, match=pattern):
        decode_tensor(_wire(msg), name="t")


@pytest.mark.parametrize(
    ("kwargs", "pattern"),
    [
        ({"expected_dtype": "bf16"}, r"'h': dtype fp32, expected bf16"),
        ({"expected_dtype": torch.int64}, r"dtype fp32, expected int64"),
        ({"expected_rank": 3}, r"rank 2 \(shape \[4, 6\]\), expected rank 3"),
        ({"expected_shape": (4, 7)}, r"shape \[4, 6\], expected \[4, 7\]"),
        ({"expected_shape": (None, 8)}, r"shape \[4, 6\], expected \['\*', 8\]"),
        ({"expected_shape": (4,)}, r"shape \[4, 6\], expected \[4\]"),
    ],
)
def test_expectations(kwargs: dict, pattern: str) -> None:
    msg = encode_tensor(torch.zeros(4, 6))
    with pytest.raises(TensorError, match=pattern):
        decode_tensor(msg, name="h", **kwargs)


def test_expectations_that_match() -> None:
    msg = encode_tensor(torch.zeros(4, 6, dtype=torch.bfloat16))
    out = decode_tensor(
        msg, expected_dtype=torch.bfloat16, expected_rank=2, expected_shape=(None, 6)
    )
    assert out.shape == (4, 6)


def test_tensor_error_is_value_error() -> None:
    assert issubclass(TensorError, ValueError)


def test_split_and_concat_larger_than_budget() -> None:
    t = _sample(torch.bfloat16, (100, 48))  # 96 bytes per row, 9600 in all
    parts = split_rows(t, 1000, name="aux_hidden")
    assert len(parts) == 10  # 10 rows (960 bytes) per part
    assert all(p.numel() * 2 <= 1000 for p in parts)
    msgs = [_wire(encode_tensor(p)) for p in parts]
    assert all(len(m.data) <= 1000 for m in msgs)
    out = concat_rows(msgs, name="aux_hidden", expected_dtype="bf16", expected_shape=(100, 48))
    assert torch.equal(out, t)


def test_split_fits_in_one_part() -> None:
    t = torch.zeros(4, 4)
    assert len(split_rows(t, 64)) == 1
    assert len(split_rows(torch.zeros(0, 4), 8)) == 1
    assert len(split_rows(torch.tensor(3.0), 4)) == 1


def test_split_oversized_single_row() -> None:
    with pytest.raises(TensorError) as err:
        split_rows(torch.zeros(3, 300, dtype=torch.float16), 512, name="hidden")
    assert str(err.value) == (
        "tensor 'hidden': one row of shape [300] of fp16 is 600 bytes, over the message budget "
        "of 512 bytes"
    )


def test_concat_rejects_inconsistent_parts() -> None:
    a = encode_tensor(torch.zeros(2, 4))
    with pytest.raises(TensorError, match=r"part 1 is bf16 \[2, 4\] but part 0 is fp32 \[2, 4\]"):
        concat_rows([a, encode_tensor(torch.zeros(2, 4, dtype=torch.bfloat16))], name="h")
    with pytest.raises(TensorError, match=r"part 2 is fp32 \[1, 5\] but part 0 is fp32 \[2, 4\]"):
        concat_rows([a, a, encode_tensor(torch.zeros(1, 5))], name="h")
    with pytest.raises(TensorError, match=r"'h\[part 1\]': 3 bytes"):
        concat_rows([a, tensor_pb2.Tensor(dtype="fp32", shape=[1, 4], data=b"abc")], name="h")
    with pytest.raises(TensorError, match=r"shape \[4, 4\], expected \[5, 4\]"):
        concat_rows([a, a], name="h", expected_shape=(5, 4))
    with pytest.raises(TensorError, match="no parts"):
        concat_rows([], name="h")


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
    with pytest.raises(TensorError, match=r"'hidden': shape \[5, 4\] but row_counts sum to 6"):
        split_hidden_states([3, 3], {"hidden": torch.zeros(5, 4)})
    with pytest.raises(TensorError, match=r"one row of .* is 1600 bytes, over the message budget"):
        split_hidden_states([1], {"hidden": torch.zeros(1, 400)}, max_bytes=1000)
    with pytest.raises(TensorError, match="not a HiddenStates field"):
        split_hidden_states([1], {"logits": torch.zeros(1, 4)})
    bad = common_pb2.HiddenStates(row_counts=[2, 2], hidden=encode_tensor(torch.zeros(3, 4)))
    with pytest.raises(TensorError, match=r"shape \[3, 4\] but row_counts \[2, 2\] sum to 4 rows"):
        join_hidden_states([bad])
    late = common_pb2.HiddenStates(row_counts=[1])
    with pytest.raises(TensorError, match="row_counts set in chunk 1"):
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
