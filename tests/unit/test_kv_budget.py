"""`--kv-cache-memory` (`runtime/kv_budget.py`): a memory budget buys the KV slots one slot really
costs (K and V per KV head, or MLA's one latent vector), the pools allocated fit in it, the
services run exactly on what it bought, and budgets that cannot work are refused by name."""

from __future__ import annotations

import pytest
import torch

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.runtime.kv_budget import parse_kv_memory, slot_bytes
from specmesh.target_service.runtime import TargetRuntime


def test_sizes_and_fractions_parse() -> None:
    assert parse_kv_memory("4GiB") == 4 * 2**30
    assert parse_kv_memory("512 MiB") == 512 * 2**20
    assert parse_kv_memory("1.5GB") == 1.5e9
    assert parse_kv_memory("123456") == 123456
    assert parse_kv_memory("0.85") == 0.85
    for bad in ("4 parsecs", "", "-1GiB", "0"):
        with pytest.raises(ValueError, match="kv-cache-memory"):
            parse_kv_memory(bad)


def test_slot_bytes_of_real_models() -> None:
    bf16 = torch.bfloat16
    assert slot_bytes(32, 8, 128, bf16, latent=False) == 131_072  # Llama-3.1-8B
    assert slot_bytes(61, 1, 512 + 64, bf16, latent=True) == 70_272  # DeepSeek-V3's latent


def _pool_bytes(rt_cache) -> int:
    """Bytes the pools really hold (a latent pool's V is a view of its K)."""
    storages = {}
    for pool in rt_cache.pools:
        for t in (pool.k, pool.v):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


@pytest.mark.parametrize("model", ["llama", "deepseek"])
def test_the_budget_buys_the_slots_it_can_hold(tiny_dir, tiny_deepseek_dir, oracle, model) -> None:
    target = tiny_dir / "target" if model == "llama" else tiny_deepseek_dir
    rt = TargetRuntime(TargetConfig(str(target), kv_cache_memory="256KiB", max_context=96))
    mc, cache = rt.model_config, rt.cache
    per_slot = slot_bytes(mc.num_layers, mc.num_kv_heads, mc.head_dim, mc.dtype,
                          mc.kv_latent_dim is not None)  # fmt: skip
    assert cache.num_slots == rt.cfg.num_kv_slots == 256 * 1024 // per_slot
    assert _pool_bytes(cache) == (cache.num_slots + 1) * per_slot  # + the scratch slot
    engine = Engine(target, target_config={"kv_cache_memory": "256KiB", "max_context": 96})
    prompt = [5, 6, 7, 8, 9, 10]
    res = engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))[0]
    assert res.token_ids == oracle(target, prompt, 8)


def test_budgets_that_cannot_work_are_refused(tiny_dir) -> None:
    target = str(tiny_dir / "target")
    with pytest.raises(ValueError, match="fraction of free memory needs a CUDA device"):
        TargetRuntime(TargetConfig(target, kv_cache_memory="0.5"))
    with pytest.raises(ValueError, match=r"holds \d+ tokens at \d+ bytes per token, fewer than"):
        TargetRuntime(TargetConfig(target, kv_cache_memory="16KiB", max_context=512))
    with pytest.raises(ValueError, match="give a size per rank"):
        TargetRuntime(TargetConfig(target, kv_cache_memory="0.5", tensor_parallel_size=2))


def test_tensor_parallel_ranks_size_their_share(tiny_dir, oracle) -> None:
    """Two gloo ranks: each caches half the KV heads, so the same budget per rank buys slots at
    half the bytes per token, sized from the checkpoint before the worker starts."""
    target = tiny_dir / "target"
    one = TargetRuntime(TargetConfig(str(target), kv_cache_memory="256KiB", max_context=96))
    rt = TargetRuntime(TargetConfig(str(target), kv_cache_memory="256KiB", max_context=96,
                                    tensor_parallel_size=2))  # fmt: skip
    try:
        assert rt.model.num_local_kv_heads * 2 == one.model.num_local_kv_heads
        per_one = _pool_bytes(one.cache) // (one.cache.num_slots + 1)  # + the scratch slot
        per_rank = _pool_bytes(rt.cache) // (rt.cache.num_slots + 1)
        assert 2 * per_rank == per_one
        assert rt.cache.num_slots == rt.cfg.num_kv_slots == 256 * 1024 // per_rank
        prompt = [5, 6, 7, 8, 9, 10]
        engine = Engine(target, target_config={"kv_cache_memory": "256KiB", "max_context": 96,
                                               "tensor_parallel_size": 2})  # fmt: skip
        res = engine.generate([prompt], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
        assert res.token_ids == oracle(target, prompt, 6)
        engine.target.model.close()
    finally:
        rt.model.close()


def test_the_draft_sizes_its_own_cache(tiny_dir) -> None:
    cfg = DraftConfig("eagle3", str(tiny_dir / "draft"), str(tiny_dir / "target"),
                      SpecParams(3, 2, 6), kv_cache_memory="64KiB", max_context=64)  # fmt: skip
    draft = load_draft(cfg)
    cache = draft.drafter.cache
    per_slot = _pool_bytes(cache) // (cache.num_slots + 1)
    assert cache.num_slots == 64 * 1024 // per_slot
