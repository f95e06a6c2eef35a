"""Invariant 2 (seed 001): a padded (static-shape) batch returns every output field cut back to the
raw token count, through one generic operation on the output type."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from specmesh.runtime.attention.torch_backend import make_backend
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, run_batch
from specmesh.runtime.models.causal_lm import AuxLayers, ModelOutput, load_causal_lm
from specmesh.runtime.static_shapes import PAD_RID, bucket_size, pad_batch, run_padded, unpad

TENSOR_FIELDS = [f.name for f in dataclasses.fields(ModelOutput)]


def _cache(model) -> KVCache:
    c = model.config
    return KVCache(
        num_layers=c.num_layers, num_slots=256, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        dtype=c.dtype, max_requests=8, max_context=64,
    )  # fmt: skip


def _items(model, cache: KVCache) -> list[BatchItem]:
    """Two requests; the first carries input embeddings (a multimodal prefill), so the batch
    returns every field of `ModelOutput`, ``mm_input_embeds`` included."""
    ids = [torch.tensor([5, 6, 7, 8, 9]), torch.tensor([11, 12, 13])]
    embeds = model.embed(ids[0]) + 0.5  # stand-in for merged image features
    for rid in ("a", "b"):
        cache.add(rid)
    return [BatchItem("a", ids[0], 0, input_embeds=embeds), BatchItem("b", ids[1], 0)]


class _WithHead:
    """The model with the LM head and argmax after its forward, as a target's graph runner
    captures them (`CausalLM.head_outputs`): the output's every field is set."""

    def __init__(self, model) -> None:
        self.model = model

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed(input_ids)

    def __call__(self, **kwargs: object) -> ModelOutput:
        return self.model.head_outputs(self.model(**kwargs), greedy=True)


def test_padded_batch_slices_every_output_field(tiny_dir: Path) -> None:
    base = load_causal_lm(tiny_dir / "target", dtype=torch.float32)
    base.set_aux_layers(AuxLayers.default(base.config.num_layers))
    model = _WithHead(base)
    backend = make_backend("torch")
    cache = _cache(base)
    raw = 8
    num_tokens = bucket_size(raw, [4, 12, 16])
    assert num_tokens == 12
    ref = run_batch(model, cache, backend, _items(model, cache))
    for rid in ("a", "b"):
        cache.release(rid)
    out = run_padded(model, cache, backend, _items(model, cache), num_tokens)
    assert PAD_RID not in cache.requests  # the dummy request's KV is freed
    for name in TENSOR_FIELDS:
        got, want = getattr(out, name), getattr(ref, name)
        assert got is not None, f"{name} missing from the padded run"
        assert got.shape[0] == raw, f"{name} has {got.shape[0]} rows, expected {raw}"
        torch.testing.assert_close(got, want, msg=f"{name} differs after unpadding")


def test_pad_batch_adds_zero_rows_last() -> None:
    hidden = 4
    items = [
        BatchItem("a", torch.tensor([1, 2]), 0, input_embeds=torch.ones(2, hidden)),
        BatchItem("b", torch.tensor([3]), 0),
    ]
    padded = pad_batch(items, 8)
    assert padded[:2] == items and padded[-1].rid == PAD_RID
    assert padded[-1].q_len == 5 and padded[-1].input_embeds.shape == (5, hidden)
    assert not padded[-1].input_embeds.any()
    assert pad_batch(items, 3) == items
    with pytest.raises(ValueError, match="pad a batch of 3 tokens down to 2"):
        pad_batch(items, 2)
    with pytest.raises(ValueError, match="exceed the largest bucket 4"):
        bucket_size(5, [2, 4])


def test_unpad_cuts_every_field_of_a_fully_set_output() -> None:
    """Any field added to `ModelOutput` later is covered: every field is set here, by name."""
    full = ModelOutput(
        **{name: torch.arange(12.0)[:, None] + i for i, name in enumerate(TENSOR_FIELDS)}
    )
    cut = unpad(full, 5)
    for i, name in enumerate(TENSOR_FIELDS):
        torch.testing.assert_close(getattr(cut, name), torch.arange(5.0)[:, None] + i)
