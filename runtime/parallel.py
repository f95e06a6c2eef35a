"""Tensor parallelism (Megatron-style): one model's layers split over ``world_size`` ranks.

Who holds what, for rank r of N (H query heads, KV key/value heads, I = intermediate size):

    q_proj / k_proj / v_proj   column-parallel: query heads [r*H/N, (r+1)*H/N), the KV heads
                               those query heads read (KV >= N: KV/N heads each; KV < N: one head,
                               replicated on N/KV ranks, head r // (N/KV))
    o_proj                     row-parallel over the same query heads, then one all-reduce
    gate_proj / up_proj        column-parallel: I/N columns; down_proj row-parallel + all-reduce
    embed_tokens / lm_head     vocabulary-parallel: ceil(V/N) rows each (the last rank's tail is
                               zero padding); the embedding all-reduces, logits are gathered once
    norms, rotary              replicated

Multi-head latent attention and experts (DeepSeek-V3, `runtime.models.mla` / `moe`):

    q_proj / q_b_proj, kv_b_proj   column-parallel by query heads (each head's rows together)
    q_a_proj, kv_a_proj_with_mqa   replicated: every rank computes (and caches) the same latent
    o_proj                         row-parallel by heads, then one all-reduce
    experts, shared experts        each expert's intermediate split like a dense MLP; the MoE's
                                   weighted sum all-reduces once; the router gate is replicated

After each all-reduce every rank holds the same residual stream, so any rank's hidden states are
the model's. At world size 1 every collective is a no-op and nothing is sharded.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch

from specmesh.runtime.config import ModelConfig

DEFAULT_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group; ``group`` is a torch.distributed
    process group (gloo on CPU, NCCL on CUDA), None at world size 1."""

    rank: int = 0
    world_size: int = 1
    group: Any = None

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place (every rank gets the sum)."""
        if self.enabled:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension, rank order."""
        if not self.enabled:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's ``x`` into every rank's ``x`` (same shape and dtype everywhere)."""
        if self.enabled:
            self.group.broadcast([x]).wait()
        return x


SINGLE = TensorParallel()


def new_group(
    rank: int, world_size: int, port: int, device: torch.device, host: str = "127.0.0.1"
) -> TensorParallel:
    """Join the group rendezvousing at ``host:port`` (rank 0 hosts the store, as torchrun's
    MASTER_ADDR / MASTER_PORT): NCCL on CUDA, gloo on CPU. Blocks until every rank joined."""
    import torch.distributed as dist

    store = dist.TCPStore(host, port, world_size, rank == 0, timeout=DEFAULT_TIMEOUT)
    if device.type == "cuda":
        group = dist.ProcessGroupNCCL(store, rank, world_size)
    else:
        group = dist.ProcessGroupGloo(store, rank, world_size, DEFAULT_TIMEOUT)
    return TensorParallel(rank, world_size, group)


def kv_head_range(num_kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """(first KV head, KV heads) held by ``tp.rank``; replicated when there are fewer KV heads
    than ranks (see the module docstring)."""
    if num_kv_heads >= tp.world_size:
        per = num_kv_heads // tp.world_size
        return tp.rank * per, per
    return tp.rank // (tp.world_size // num_kv_heads), 1


def vocab_range(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows) of the embedding / LM head on ``tp.rank``: ceil(V / N) rows each, so
    the last rank's rows may run past the vocabulary (padding, zero weights)."""
    per = -(-vocab_size // tp.world_size)
    return tp.rank * per, per


def check_tensor_parallel(cfg: ModelConfig, world_size: int) -> None:
    """Refuse a model that cannot be split over ``world_size`` ranks; the message names the
    numbers."""
    n = world_size
    if n < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {n}")
    if cfg.num_heads % n:
        raise ValueError(
            f"tensor_parallel_size {n} does not divide the {cfg.num_heads} attention heads"
        )
    if cfg.mla is not None:
        _check_latent(cfg, n)
        return
    kv = cfg.num_kv_heads
    if kv >= n and kv % n:
        raise ValueError(f"tensor_parallel_size {n} does not divide the {kv} KV heads")
    if kv < n and n % kv:
        raise ValueError(
            f"{kv} KV heads cannot be replicated over tensor_parallel_size {n}: "
            f"{n} must be a multiple of {kv}"
        )
    if cfg.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size {n} does not divide intermediate_size {cfg.intermediate_size}"
        )


def _check_latent(cfg: ModelConfig, n: int) -> None:
    """MLA + MoE: heads, the dense and the expert intermediate sizes must split over ``n``."""
    if cfg.mla.attention_bias and n > 1:  # type: ignore[union-attr]
        raise ValueError(f"{cfg.architecture} with attention_bias runs with tensor_parallel_size 1")
    sizes = {"intermediate_size": cfg.intermediate_size}
    if cfg.moe is not None:
        sizes["moe_intermediate_size"] = cfg.moe.moe_intermediate_size
    for name, size in sizes.items():
        if size % n:
            raise ValueError(f"tensor_parallel_size {n} does not divide {name} {size}")


def rank_devices(device: str, world_size: int) -> list[torch.device]:
    """The device of every rank: CPU for all on CPU; on CUDA consecutive GPUs from ``device``'s
    index (``cuda`` = ``cuda:0``), refused when there are not enough."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return [dev] * world_size
    first = dev.index or 0
    visible = torch.cuda.device_count()
    if first + world_size > visible:
        raise ValueError(
            f"tensor_parallel_size {world_size} from {dev} needs CUDA devices "
            f"{first}..{first + world_size - 1}; {visible} visible"
        )
    return [torch.device("cuda", first + r) for r in range(world_size)]
