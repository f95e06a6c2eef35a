"""The target service's configuration and what it keeps per request between steps."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.protocol.sampling import SamplingParams
from specmesh.runtime.sampling import TokenHistory
from specmesh.target_service.multimodal import (
    MAX_IMAGE_BYTES,
    MAX_IMAGE_PIXELS,
    MAX_IMAGES_PER_REQUEST,
)


@dataclass(frozen=True)
class TargetConfig:
    model_dir: str
    dtype: str | None = None  # None = the checkpoint's dtype
    device: str = "cpu"
    attention_backend: str = "torch"
    num_kv_slots: int = 65536
    page_size: int = 1
    max_requests: int = 256
    max_context: int | None = None  # None = the model's max_position_embeddings
    max_prefill_tokens: int = 8192  # chunk size of one extend
    aux_layer_ids: tuple[int, ...] | None = None  # None = [2, L//2, L-3]
    aux_convention: str = "input"
    cuda_graph: bool = True  # decode / verify in CUDA graphs (CUDA + triton/flashinfer only)
    cuda_graph_max_bs: int = 32  # largest captured batch; bigger batches run eagerly
    # Verify trees captured before ready (the drafts' num_draft_tokens); other sizes run eagerly.
    cuda_graph_tree_sizes: tuple[int, ...] = (8,)
    # Image limits, checked per request before any image is decoded (`multimodal.ImageLimits`).
    max_images_per_request: int = MAX_IMAGES_PER_REQUEST
    max_image_bytes: int = MAX_IMAGE_BYTES  # encoded
    max_image_pixels: int = MAX_IMAGE_PIXELS  # width x height, read from the header
    # Ranks (processes, one device each) the model is split over (`runtime.parallel`); rank 0
    # is this process and owns all request state. CUDA graphs run only at 1.
    tensor_parallel_size: int = 1


@dataclass
class TargetRequest:
    """What the target keeps per request between steps."""

    params: SamplingParams
    next_offset: int  # output index of the next sampled token (seeded sampling)
    pending: int  # the last sampled token, not yet in the KV cache
    # Tokens so far (pending included), kept only when the params' processors read them.
    history: TokenHistory | None = None
