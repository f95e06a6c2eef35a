"""How many KV slots a memory budget buys (`--kv-cache-memory`), by what a slot really costs.

A slot (one token) costs, in every layer, K and V of each KV head (``2 x kv_heads x head_dim``
values), or with multi-head latent attention one latent vector and its rope key
(``kv_lora_rank + qk_rope_head_dim`` values: V is a view of K's latent columns, `KVCache`):

    Llama-3.1-8B, bf16:   32 layers x 2 x 8 x 128 x 2 B  = 131,072 B per token
    DeepSeek-V3, bf16:    61 layers x (512 + 64) x 2 B   =  70,272 B per token

The budget is a size (``4GiB``, ``512MiB``, ``1.5GB``, bytes) or, on a CUDA device, a fraction of
the device memory free once the weights are loaded (``0.85``), as vLLM's
``--gpu-memory-utilization`` and SGLang's ``--mem-fraction-static`` size theirs. Under tensor
parallelism it is a size per rank (`rank_kv_slots`).
"""

from __future__ import annotations

import logging
import re

import torch

from specmesh.protocol.config import TargetConfig

log = logging.getLogger(__name__)

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_kv_memory(text: str) -> float:
    """Bytes for a size, or the fraction itself for a plain number in (0, 1]. ValueError with
    the accepted forms otherwise."""
    m = _SIZE.match(text)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(
            f"--kv-cache-memory {text!r}: give a size (4GiB, 512MiB, 2GB, bytes) or, on a CUDA "
            "device, a fraction of its free memory (0.85)"
        )
    value = float(m.group(1))
    if not unit and value <= 1:
        if value <= 0:
            raise ValueError(f"--kv-cache-memory {text!r}: must be positive")
        return value
    return value * _UNITS[unit]


def slot_bytes(
    num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, latent: bool
) -> int:
    """Bytes one token slot takes over all layers' pools (latent: one K-only vector)."""
    per_layer = num_kv_heads * head_dim * dtype.itemsize
    return num_layers * per_layer * (1 if latent else 2)


def kv_slots(
    num_slots: int,
    memory: str | None,
    bytes_per_slot: int,
    page_size: int,
    device: str,
    max_context: int,
) -> int:
    """The slots to allocate: ``num_slots`` (`--num-kv-slots`) without a budget, else what
    ``memory`` buys, whole pages, at least ``max_context`` tokens (ValueError naming both)."""
    if memory is None:
        return num_slots
    budget = parse_kv_memory(memory)
    if budget <= 1:
        if not str(device).startswith("cuda"):
            raise ValueError(
                f"--kv-cache-memory {memory}: a fraction of free memory needs a CUDA device; "
                f"give a size on {device} (e.g. 4GiB)"
            )
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        budget *= free
    slots = int(budget // bytes_per_slot) // page_size * page_size
    if slots < max_context:
        raise ValueError(
            f"--kv-cache-memory {memory} holds {slots} tokens at {bytes_per_slot} bytes per token, "
            f"fewer than one request of --max-context {max_context}: give more memory or a "
            "smaller --max-context"
        )
    log.info("KV cache: %d token slots in %.1f MiB (%d bytes per token, --kv-cache-memory %s)",
             slots, slots * bytes_per_slot / 2**20, bytes_per_slot, memory)  # fmt: skip
    return slots


def rank_kv_slots(cfg: TargetConfig, dtype: torch.dtype | None) -> int:
    """`kv_slots` for a tensor-parallel target, from its checkpoint's config before any rank
    loads: each rank caches its share of the KV heads (all of MLA's one latent). A size only: a
    fraction of free memory is known once the weights are loaded, after the ranks sized theirs."""
    from specmesh.runtime.config import load_model_config, resolve_max_context
    from specmesh.runtime.parallel import TensorParallel, kv_head_range

    if parse_kv_memory(str(cfg.kv_cache_memory)) <= 1:
        raise ValueError(
            f"--kv-cache-memory {cfg.kv_cache_memory}: with --tensor-parallel-size "
            f"{cfg.tensor_parallel_size} give a size per rank (e.g. 4GiB), not a fraction"
        )
    mc = load_model_config(cfg.model_dir)
    latent = mc.mla is not None
    heads = (
        1
        if latent
        else kv_head_range(mc.num_kv_heads, TensorParallel(0, cfg.tensor_parallel_size))[1]
    )
    per_slot = slot_bytes(mc.num_layers, heads, mc.head_dim, dtype or mc.dtype, latent)
    max_context = resolve_max_context(cfg.max_context, mc.max_position, cfg.model_dir)
    return kv_slots(cfg.num_kv_slots, cfg.kv_cache_memory, per_slot, cfg.page_size, cfg.device,
                    max_context)  # fmt: skip
