"""The services' configuration, frozen and torch-free: the CLI reads its flags' defaults from
these fields (`specmesh.cli.serve_args`) without loading a model stack, and each runtime is built
from one."""

from __future__ import annotations

from dataclasses import dataclass

from specmesh.protocol.images import MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, MAX_IMAGES_PER_REQUEST

DRAFT_KINDS = ("eagle3", "eagle", "mtp", "standalone", "ngram")


def resolve_dtype(dtype: str | None, device: str) -> str | None:
    """The dtype a service runs when the command line names none (``--dtype`` absent).

    On a CPU: fp32. torch runs this project's small models slower in bf16 on CPUs, even on
    those with native bf16 (AVX512-BF16 / AMX): the demo pair, greedy with EAGLE-3 on 2 cores of
    a Xeon with AMX, took 1.6x as long in bf16 (0.34 s vs 0.22 s for two 64-token requests),
    and plain decoding 9% longer; only large matmuls (4096 wide, 16+ rows) gain from AMX, so
    give a large model ``--dtype bf16`` there. On CUDA (any other device): None, the
    checkpoint's own dtype (bf16 / fp16 run natively there). A named dtype is kept.
    """
    if dtype is not None:
        return dtype
    return "fp32" if device.split(":")[0] == "cpu" else None


@dataclass(frozen=True)
class SpecParams:
    num_steps: int = 3
    topk: int = 1
    num_draft_tokens: int = 4

    def validate(self) -> None:
        if self.num_steps < 1 or self.topk < 1 or self.num_draft_tokens < 2:
            raise ValueError(
                f"need num_steps >= 1, topk >= 1, num_draft_tokens >= 2; got {self.num_steps}, "
                f"{self.topk}, {self.num_draft_tokens}"
            )
        pool = self.topk + (self.num_steps - 1) * self.topk**2
        if self.num_draft_tokens - 1 > pool:
            raise ValueError(
                f"num_draft_tokens {self.num_draft_tokens} needs {self.num_draft_tokens - 1} "
                f"draft nodes but (num_steps={self.num_steps}, topk={self.topk}) proposes {pool}"
            )


@dataclass(frozen=True)
class TargetConfig:
    model_dir: str
    dtype: str | None = None  # None = the checkpoint's dtype
    device: str = "cpu"
    attention_backend: str = "torch"
    num_kv_slots: int = 65536
    # A memory budget for the KV cache instead (`runtime.kv_budget`): "4GiB", or a fraction of
    # the CUDA device's free memory ("0.85"); sizes the slots by what one really costs
    kv_cache_memory: str | None = None
    page_size: int = 1
    # Prefix caching (`runtime.prefix_cache`): cached prompt tokens at most (0 = off), in blocks
    # of this many tokens (a multiple of page_size)
    prefix_cache_tokens: int = 32768
    prefix_block_size: int = 16
    max_requests: int = 256
    max_context: int | None = None  # None = the model's max_position_embeddings
    max_prefill_tokens: int = 8192  # chunk size of one extend
    # None: resolved in the handshake, only for a draft that reads aux states ([2, L//2, L-3]
    # unless the draft names its own).
    aux_layer_ids: tuple[int, ...] | None = None
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
    # Decide a plain request's next decode step while the router handles the one just answered
    # (`target_service.run_ahead`).
    run_ahead: bool = True
    # On CUDA: RMSNorm with the residual add, RoPE with the KV store, SiLU * up in one Triton
    # kernel each, and merged q/k/v and gate/up products (`kernels.fused`).
    fused_kernels: bool = True
    # On CUDA: one pseudo request (prefill, an eager verify) before ready, so kernels that
    # compile at first use (FlashInfer's JIT) do not stall the first real request
    # (`target_service.warmup`).
    warm_up: bool = True


@dataclass(frozen=True)
class DraftConfig:
    kind: str
    draft_dir: str | None  # None for ngram
    target_dir: str  # embeddings / LM head / tokenizer come from the target checkpoint
    spec: SpecParams = SpecParams()
    dtype: str | None = None
    device: str = "cpu"
    attention_backend: str = "torch"
    num_kv_slots: int = 65536
    kv_cache_memory: str | None = None  # as TargetConfig's
    max_requests: int = 256
    max_context: int | None = None  # None = the target's max_position_embeddings
    aux_convention: str = "output"  # how the checkpoint numbers eagle_aux_hidden_state_layer_ids
    cuda_graph: bool = True  # draft decode steps in CUDA graphs (CUDA + triton/flashinfer only)
    cuda_graph_max_bs: int = 32  # largest captured batch; bigger batches run eagerly
    # Outcomes of each verify drafted ahead while the target verifies (0 = off);
    # `specmesh.draft_service.predraft`
    predraft: int = 0
    predraft_steps: int = 3  # search depth of a pre-drafted tree (at most spec.num_steps)
    # Prefix caching of the draft's own rows (EAGLE / EAGLE-3 drafts; `runtime.prefix_cache`)
    prefix_cache_tokens: int = 32768
    prefix_block_size: int = 16
    # Train the EAGLE-3 head on the traffic it serves (`specmesh.draft_service.online`), with
    # its checkpoints in online_learning_dir (None: none kept); a draft started on a directory
    # that holds one resumes from it
    online_learning: bool = False
    online_learning_dir: str | None = None
    online_learning_rate: float | None = None  # AdamW's rate (None: `OnlineSettings.lr`)
