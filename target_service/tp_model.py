"""Rank 0's view of a tensor-parallel target: a model with the `CausalLM` interface whose every
forward, logits and embedding call first commands the worker ranks (`tp_workers`) to run the same
call on their shards, then runs rank 0's shard. The runtime above it cannot tell the difference:
it builds attention metadata from its own KV slot tables, and this class ships that metadata to
the workers with the positions and ids.

Rank 0 alone returns results. EAGLE-3 aux states and MTP pre-norm states come from rank 0's
shard (the residual stream is replicated after every all-reduce); workers never capture them.
"""

from __future__ import annotations

import atexit
import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from specmesh.protocol.features import AuxLayers
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.config import ModelConfig, load_model_config
from specmesh.runtime.llava_checkpoint import is_llava_checkpoint
from specmesh.runtime.loader import load_tensors
from specmesh.runtime.models.causal_lm import CausalLM, ModelOutput, load_causal_lm
from specmesh.runtime.models.layers import KVPair
from specmesh.runtime.parallel import check_tensor_parallel, new_group, rank_devices
from specmesh.target_service.tp_workers import RankSpec, WorkerGroup, free_port

if TYPE_CHECKING:
    from specmesh.protocol.config import TargetConfig

log = logging.getLogger(__name__)
T = TypeVar("T")


class TensorParallelModel:
    """Rank 0's shard plus the worker ranks; the runtime's model when tensor_parallel_size > 1."""

    def __init__(self, local: CausalLM, workers: WorkerGroup, model_dir: str) -> None:
        self.local, self.workers, self.model_dir = local, workers, model_dir
        self.config: ModelConfig = local.config
        self.world_size = local.tp.world_size
        atexit.register(self.close)

    # -- the CausalLM interface ------------------------------------------------------------------
    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        kv_pools: list[KVPair],
        backend: AttentionBackend,
        input_ids: torch.Tensor | None = None,  # [num_tokens]
        input_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]
    ) -> ModelOutput:
        payload = {
            "meta": dict(vars(backend.meta)), "positions": positions, "input_ids": input_ids,
            "input_embeds": input_embeds,
        }  # fmt: skip
        run = lambda: self.local(
            positions=positions, kv_pools=kv_pools, backend=backend, input_ids=input_ids,
            input_embeds=input_embeds,
        )  # fmt: skip
        return self._collective("forward", payload, run)

    __call__ = forward

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[rows, vocab] fp32: each rank's vocabulary slice, gathered once."""
        run = lambda: self.local.compute_logits(hidden)
        return self._collective("logits", {"hidden": hidden}, run)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self._collective(
            "embed", {"input_ids": input_ids}, lambda: self.local.embed(input_ids)
        )

    def set_aux_layers(self, aux: AuxLayers | None) -> None:
        self.local.set_aux_layers(aux)  # rank 0 alone captures

    @property
    def aux_points(self) -> tuple[int, ...]:
        return self.local.aux_points

    @aux_points.setter
    def aux_points(self, points: tuple[int, ...]) -> None:
        self.local.aux_points = points

    @property
    def num_local_kv_heads(self) -> int:
        return self.local.num_local_kv_heads

    def parameters(self) -> Iterator[nn.Parameter]:
        return self.local.parameters()

    # -- whole tensors, for single-device consumers (an in-process draft) --------------------------
    @functools.cached_property
    def embed_tokens(self) -> nn.Embedding:
        """The full token embedding, read from the checkpoint on first use."""
        name = "model.embed_tokens.weight"
        weight = load_tensors(self.model_dir, [name])[name].to(self._device, self.config.dtype)
        return nn.Embedding.from_pretrained(weight, freeze=True)

    @functools.cached_property
    def head_weight(self) -> torch.Tensor:
        """The full LM head ``[vocab, hidden]`` (the embedding when tied)."""
        if self.config.tie_word_embeddings:
            return self.embed_tokens.weight
        weight = load_tensors(self.model_dir, ["lm_head.weight"])["lm_head.weight"]
        return weight.to(self._device, self.config.dtype)

    @property
    def _device(self) -> torch.device:
        return next(self.local.parameters()).device

    # -- lifecycle -------------------------------------------------------------------------------
    def _collective(self, op: str, payload: dict, run: Callable[[], T]) -> T:
        """Command the workers, then run rank 0's part. Once the command is out the ranks must
        finish the step together: rank 0 failing now would leave them waiting in a collective,
        so that is fatal (the service exits; requests are replayed on another replica)."""
        try:
            self.workers.send(op, payload)
            with torch.inference_mode():
                return run()
        except Exception as e:
            log.exception("tensor-parallel %s failed on rank 0", op)
            self.workers.fatal(f"rank 0 failed during a tensor-parallel {op!r}: {e}")
            raise  # not reached: fatal exits

    def close(self) -> None:
        """Stop the worker ranks (idempotent; also run at interpreter exit)."""
        atexit.unregister(self.close)
        self.workers.close()


def start_tensor_parallel(cfg: TargetConfig, dtype: torch.dtype | None) -> TensorParallelModel:
    """Check that the model splits over ``cfg.tensor_parallel_size`` ranks (before any process
    starts), spawn ranks 1..N-1, join the group as rank 0, load rank 0's shard and wait for every
    worker to load its own."""
    n, model_dir = cfg.tensor_parallel_size, cfg.model_dir
    if is_llava_checkpoint(model_dir):
        raise ValueError(
            f"{model_dir}: tensor parallelism serves Llama / Qwen2 / Qwen3 targets; multimodal "
            "(LLaVA) targets run with tensor_parallel_size 1"
        )
    check_tensor_parallel(load_model_config(model_dir), n)
    devices = tuple(rank_devices(cfg.device, n))
    launched = os.environ.get("WORLD_SIZE")
    if launched not in (None, "1"):
        raise ValueError(
            f"specmesh starts its own {n} tensor-parallel ranks; run the target as one process, "
            f"not under a distributed launcher (WORLD_SIZE={launched} in the environment)"
        )
    threads = _split_cpu_threads(devices[0], n)
    spec = RankSpec(
        model_dir, n, devices, free_port(), dtype, cfg.attention_backend, cfg.num_kv_slots,
        cfg.page_size, threads,
    )  # fmt: skip
    workers = WorkerGroup(spec)
    try:
        if devices[0].type == "cuda":
            torch.cuda.set_device(devices[0])
        workers.tp = tp = new_group(0, n, spec.port, devices[0])
        local = load_causal_lm(model_dir, dtype=dtype, device=devices[0], tp=tp)
        workers.wait_ready(local.num_local_kv_heads)
    except BaseException:
        workers.close()
        raise
    return TensorParallelModel(local, workers, model_dir)


def _split_cpu_threads(device: torch.device, world_size: int) -> int:
    """Torch threads per rank. On CPU the ranks share this process's thread budget (ranks in
    lock step that each spin a full set of threads on the same cores slow to a crawl), so rank 0
    gives up its share too; on CUDA every rank keeps this process's count."""
    threads = torch.get_num_threads()
    if device.type == "cuda":
        return threads
    per_rank = max(1, threads // world_size)
    if per_rank != threads:
        log.info("tensor parallel on CPU: %d torch threads per rank (of %d)", per_rank, threads)
        torch.set_num_threads(per_rank)
    return per_rank
