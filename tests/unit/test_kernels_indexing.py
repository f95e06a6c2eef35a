"""Index kernels: KV index gathering, Triton against reference."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from specmesh.kernels.kv_indices import gather_kv_indices
from specmesh.kernels.testing import kernel_devices


def kv_case(device: str):
    gen = torch.Generator().manual_seed(0)
    req_to_slot = torch.randint(0, 10_000, (6, 300), generator=gen)
    rows = torch.tensor([4, 0, 2])
    prefix_lens = torch.tensor([0, 290, 7])  # a fresh prefill, a long prefix crossing blocks
    new_slots = torch.randint(0, 10_000, (3, 10), generator=gen)
    new_lens = torch.tensor([10, 1, 0])
    return [t.to(device) for t in (req_to_slot, rows, prefix_lens, new_slots, new_lens)]


@pytest.mark.parametrize("device", kernel_devices())
def test_gather_kv_indices(device: str) -> None:
    args = kv_case(device)
    indptr, indices = gather_kv_indices(*args, impl="torch")
    req_to_slot, _, _, new_slots, _ = (t.cpu() for t in args)
    assert indptr.tolist() == [0, 10, 301, 308]
    expected = [new_slots[0], req_to_slot[0, :290], new_slots[1, :1], req_to_slot[2, :7]]
    assert torch.equal(indices.cpu(), torch.cat(expected))
    out = gather_kv_indices(*args, impl="triton")
    assert all(torch.equal(a, b) for a, b in zip(out, (indptr, indices), strict=True))
    one = [t[1:2] for t in args[1:]]  # batch of one (decode of a single token)
    ref = gather_kv_indices(args[0], *one, impl="torch")
    out = gather_kv_indices(args[0], *one, impl="triton")
    assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))


@pytest.mark.parametrize("impl", ["torch", "triton"])
def test_gather_kv_indices_buffer_too_small(impl: str) -> None:
    with pytest.raises(ValueError, match="need 308 entries, buffer holds 300"):
        gather_kv_indices(*kv_case("cpu"), max_total=300, impl=impl)
