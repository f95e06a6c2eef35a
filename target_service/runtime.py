"""The target model's runtime: prefill, plain decode and tree verification over a paged KV cache.

Per request the target holds ``committed_len`` cached tokens plus a `TargetRequest`: the *pending*
token (the last token it emitted, not yet forwarded), the sampling parameters and the output
offset of the next sampled token (sent once, at prefill). Decode forwards the pending token;
verify forwards a tree whose root is the pending token. Both end with a new pending token. The
router owns everything else about a request and can rebuild this state by prefilling prompt +
emitted tokens.

A request that fails a step is dropped and the others in the batch are served: rows are checked
before any state changes, and a batch whose forward raises is run again request by request.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch

from specmesh.kernels.common import kernel_impl
from specmesh.protocol.config import TargetConfig
from specmesh.protocol.errors import (
    InvalidRequestError,
    UnknownRequestError,
)
from specmesh.protocol.features import AuxLayers, Feature, FeatureSpec
from specmesh.protocol.steps import PrefillInput, StepOutput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.attention.torch_backend import make_backend
from specmesh.runtime.config import parse_dtype, resolve_max_context
from specmesh.runtime.graph_runner import GraphRunner, graphs_enabled
from specmesh.runtime.kv_budget import kv_slots, rank_kv_slots, slot_bytes
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.llava_checkpoint import is_llava_checkpoint
from specmesh.runtime.model_runner import BatchItem
from specmesh.runtime.models.causal_lm import CausalLM, ModelOutput, load_causal_lm
from specmesh.runtime.models.moe import stack_experts
from specmesh.runtime.static_shapes import GraphSizes, decode_sizes, verify_sizes
from specmesh.target_service.grammar import Grammars, consume
from specmesh.target_service.llava import ImageEncoder, load_llava
from specmesh.target_service.prefill import prefill_inputs
from specmesh.target_service.prefill_pieces import PartialPrefills
from specmesh.target_service.prefix import TargetPrefixes, feature_key
from specmesh.target_service.run_ahead import RunAhead
from specmesh.target_service.state import TargetRequest
from specmesh.target_service.tp_model import start_tensor_parallel
from specmesh.target_service.verify import verify_trees
from specmesh.target_service.warmup import warm_up

log = logging.getLogger(__name__)


_UNKNOWN = "<unknown>"  # no feature key is ever this


class TargetRuntime:
    def __init__(self, cfg: TargetConfig, model: CausalLM | None = None) -> None:
        self.cfg = cfg
        dtype = None if cfg.dtype is None else parse_dtype(cfg.dtype)
        if cfg.kv_cache_memory is not None and cfg.tensor_parallel_size != 1:
            # the ranks size their pools as they start, from the checkpoint's config
            self.cfg = cfg = replace(cfg, num_kv_slots=rank_kv_slots(cfg, dtype),
                                     kv_cache_memory=None)  # fmt: skip
        self.mm: ImageEncoder | None = None  # vision tower + projector of a LLaVA target
        if model is None and cfg.tensor_parallel_size != 1:
            model = start_tensor_parallel(cfg, dtype)
        if model is None and is_llava_checkpoint(cfg.model_dir):
            model, self.mm = load_llava(cfg.model_dir, dtype=dtype, device=cfg.device)
        self.model = model or load_causal_lm(cfg.model_dir, dtype=dtype, device=cfg.device)
        # Fused before the graphs capture the forward; only a model loaded here: a tensor-
        # parallel or LLaVA model (or one passed in) keeps the unfused ops (docs/gpu.md).
        if cfg.fused_kernels and torch.device(cfg.device).type == "cuda" and model is None:
            self.model.fuse_kernels()
        mc = self.model.config
        self.model_config = mc
        limit = resolve_max_context(cfg.max_context, mc.max_position, cfg.model_dir)
        self.cfg = cfg = replace(cfg, max_context=limit)
        # Invariant: None, or layers that fit this model (checked where they are named: here
        # for `TargetConfig.aux_layer_ids`, in `resolve_aux` for a handshake's). The default
        # [2, L//2, L-3] is resolved only for a draft that reads aux states: any depth serves.
        self.aux_layers: AuxLayers | None = None
        self._feature_keys: dict[Feature, str | None] = {}  # `feature_key`'s, until `configure`
        if cfg.aux_layer_ids:
            self.aux_layers = AuxLayers(cfg.aux_layer_ids, cfg.aux_convention)
            self.aux_layers.capture_points(mc.num_layers)  # ValueError names the ids and depth
        heads = self.model.num_local_kv_heads  # this rank's heads under TP
        latent = mc.kv_latent_dim is not None
        per_slot = slot_bytes(mc.num_layers, heads, mc.head_dim, mc.dtype, latent)
        num_slots = kv_slots(cfg.num_kv_slots, cfg.kv_cache_memory, per_slot, cfg.page_size,
                             cfg.device, cfg.max_context)  # fmt: skip
        self.cfg = cfg = replace(cfg, num_kv_slots=num_slots)
        self.cache = KVCache(
            num_layers=mc.num_layers,
            num_slots=cfg.num_kv_slots,
            num_kv_heads=heads,
            head_dim=mc.head_dim,
            dtype=mc.dtype,
            device=cfg.device,
            page_size=cfg.page_size,
            max_requests=cfg.max_requests,
            max_context=cfg.max_context,
            latent_dim=mc.kv_latent_dim,  # MLA: V is K's latent columns
        )
        images = None if self.mm is None else (self.mm.image_token_id, self.mm.tokens_per_image)
        self.prefixes = TargetPrefixes(
            self.cache, cfg.prefix_block_size, cfg.prefix_cache_tokens, images
        )
        self.backend = make_backend(
            cfg.attention_backend, cfg.device, mc.head_dim, mc.dtype, latent=mc.mla is not None
        )
        self.kernel_impl = kernel_impl(cfg.attention_backend)
        self.graphs = self._capture_graphs()
        self.requests: dict[str, TargetRequest] = {}
        self.partial = PartialPrefills()  # requests whose input is still arriving in pieces
        self.grammars = Grammars(cfg.model_dir, mc.vocab_size, mc.eos_token_ids)
        self.ahead = RunAhead()  # plain requests' next steps, decided early (`run_ahead`)
        if cfg.warm_up and torch.device(cfg.device).type == "cuda":
            warm_up(self)

    def _capture_graphs(self) -> TargetGraphs | None:
        cfg = self.cfg
        if not graphs_enabled(cfg.cuda_graph, cfg.device, cfg.attention_backend):
            return None
        if cfg.tensor_parallel_size > 1:  # workers would have to replay their own graphs
            log.warning("CUDA graphs are off at tensor_parallel_size %d: decode and verify run "
                        "eagerly", cfg.tensor_parallel_size)  # fmt: skip
            return None
        return TargetGraphs(
            self.model, self.cache, self.backend, mode="cuda-graph",
            max_bs=cfg.cuda_graph_max_bs, tree_sizes=cfg.cuda_graph_tree_sizes,
            aux=self.aux_layers,
        )  # fmt: skip

    @staticmethod
    def from_dir(model_dir: str | Path, **kw: object) -> TargetRuntime:
        return TargetRuntime(TargetConfig(model_dir=str(model_dir), **kw))  # type: ignore[arg-type]

    def resolve_aux(self, needs: FeatureSpec) -> AuxLayers | None:
        """The aux layers a draft reading ``needs`` makes this target capture: None unless it
        reads `Feature.AUX_HIDDEN`; else its own ids, or the target's (its config's
        ``aux_layer_ids`` or an earlier handshake's), or the default. ValueError, naming the
        ids and the model's depth, when they do not fit; nothing changes."""
        if needs.feature is not Feature.AUX_HIDDEN:
            return None
        n = self.model_config.num_layers
        aux = needs.aux or self.aux_layers or AuxLayers.default(n)
        aux.capture_points(n)
        return aux

    @property
    def aux_points(self) -> tuple[int, ...]:
        """Layer inputs the aux states concatenate (`TargetInfo.aux_layer_ids`); () for none."""
        aux = self.aux_layers
        return () if aux is None else aux.capture_points(self.model_config.num_layers)

    def configure(self, needs: FeatureSpec) -> None:
        """Serve what a draft reads: for EAGLE-3, capture `resolve_aux`'s layers from now on;
        CUDA graphs, which bake the captured layers in, are captured again when they change.
        Other features need no configuration (and resolve no aux layers)."""
        aux = self.resolve_aux(needs)
        if aux is None:
            return
        before = self.aux_points
        self.aux_layers, self._feature_keys = aux, {}
        self.model.set_aux_layers(aux)
        if self.aux_points != before and self.graphs is not None:
            self.graphs = self._capture_graphs()

    def holds(self, rid: str) -> bool:
        return rid in self.requests or rid in self.partial

    @property
    def num_requests(self) -> int:
        """Requests held: running, and prefilled in part (`prefill_pieces`)."""
        return len(self.requests) + len(self.partial)

    # -- validation ----------------------------------------------------------------------------
    def check_ids(self, rid: str, ids: list[int], *, what: str) -> None:
        vocab = self.model_config.vocab_size
        if not ids:
            raise InvalidRequestError(f"request {rid!r}: empty {what}")
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(
                f"request {rid!r}: {what} has ids outside vocab [0, {vocab}): {bad[:5]}"
            )

    # -- prefill -------------------------------------------------------------------------------
    def prefill(self, inputs: list[PrefillInput], feature: Feature = Feature.NONE) -> StepOutput:
        """Start requests: run each input (or its next piece, `prefill_pieces`), sample the
        first token after the whole input ran. Rows of the output's ``feature`` (and of
        ``mm_input_embeds`` when a request has images) follow the ids run (`prefill`)."""
        return prefill_inputs(self, inputs, feature)

    def feature_key(self, feature: Feature) -> str | None:
        """What a prefix block's feature rows are for ``feature`` (`target_service.prefix`);
        kept per feature (every verify asks) until `configure` changes the aux layers."""
        key = self._feature_keys.get(feature, _UNKNOWN)
        if key is _UNKNOWN:
            points = self.aux_points if feature is Feature.AUX_HIDDEN else ()
            key = self._feature_keys[feature] = feature_key(feature, points)
        return key

    # -- decode / verify ------------------------------------------------------------------------
    def decode(self, rids: list[str], feature: Feature = Feature.NONE) -> StepOutput:
        """Plain decoding: one token per request."""
        known = [rid for rid in rids if rid in self.requests]
        out = self.verify(
            [VerifyInput(r, DraftTree.chain([self.requests[r].pending])) for r in known], feature
        )
        for rid in set(rids) - set(known):
            out.errors[rid] = UnknownRequestError(f"unknown request id {rid!r}")
        return out

    def verify(self, inputs: list[VerifyInput], feature: Feature = Feature.NONE) -> StepOutput:
        """Forward every tree, accept a path of each and keep its KV (`verify.verify_trees`)."""
        return verify_trees(self, inputs, feature)

    def advance(self, rid: str, tokens: list[int], out: StepOutput) -> None:
        """Record a step's new tokens: the last is the new pending token."""
        req = self.requests[rid]
        req.pending = tokens[-1]
        req.next_offset += len(tokens)
        if req.history is not None:
            req.history.add(tokens)
        if req.grammar is not None:
            consume(req.grammar, tokens)
        out.tokens[rid], out.row_counts[rid] = tokens, len(tokens)

    @staticmethod
    def select_feature(res: ModelOutput, feature: Feature) -> torch.Tensor | None:
        return {
            Feature.AUX_HIDDEN: res.aux_hidden,
            Feature.HIDDEN: res.hidden,
            Feature.HIDDEN_PRE_NORM: res.hidden_pre_norm,
        }.get(feature)

    def kv_slots(self) -> tuple[int, int]:
        """(used, free) KV slots; unreferenced prefix-cache slots count as free."""
        spare = self.prefixes.num_evictable_slots
        return self.cache.num_used_slots - spare, self.cache.num_free_slots + spare

    def _get(self, rid: str) -> TargetRequest:
        req = self.requests.get(rid)
        if req is None and rid in self.partial:
            raise InvalidRequestError(f"request {rid!r}: its input is still being prefilled")
        if req is None:
            raise UnknownRequestError(f"unknown request id {rid!r}")
        return req

    def release(self, rid: str) -> bool:
        """Free ``rid``'s KV and state; False (a no-op) when the target holds none."""
        self.requests.pop(rid, None)
        self.ahead.drop(rid)
        self.partial.pop(rid)
        self.prefixes.retire(rid)
        if rid not in self.cache.requests:
            return False
        self.cache.release(rid)  # the row first, then its prefix references
        return True


class TargetGraphs:
    """The target's static-shape runners: one for decode (1 row per request) and one per declared tree
    size for verify (``num_draft_tokens`` rows per request, tree mask). All of them are captured when
    the runtime is built, before the service reports ready; a batch of another shape runs eagerly.

    CUDA graphs are captured with the target's EAGLE-3 aux layers switched on when it has them
    (``TargetConfig.aux_layer_ids``, or a handshake's), so one capture serves every feature the
    drafts ask for (aux states, final hidden, or none): the replay fills ``aux_hidden`` and the
    runtime picks what a batch needs. A target with none captures without them (any depth: no
    default layers are guessed); the runtime captures again only when a handshake changes them.
    """

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        backend: AttentionBackend,
        *,
        mode: str,
        max_bs: int,
        tree_sizes: tuple[int, ...] = (),
        aux: AuxLayers | None = None,
    ) -> None:
        self.model, self.cache, self.backend, self.mode = model, cache, backend, mode
        self.max_bs = min(max_bs, cache.req_to_slot.shape[0])
        ctx = cache.max_context
        for n in tree_sizes:
            if not 2 <= n <= ctx:
                raise ValueError(f"CUDA-graph tree size {n} must be in 2..max_context ({ctx})")
        stack_experts(model)  # a mixture of experts captured reads only its chosen experts
        restore = model.aux_points
        model.set_aux_layers(aux)
        try:
            self.decode = self._runner(decode_sizes(self.max_bs, ctx), greedy=True)
            self.verify = {n: self._runner(verify_sizes(self.max_bs, n, ctx)) for n in tree_sizes}
        finally:
            model.aux_points = restore

    def _runner(self, sizes: GraphSizes, greedy: bool = False) -> GraphRunner:
        # The LM head (and for plain decoding the argmax) runs in the graph too (graphs are
        # off under tensor parallelism: no gather across ranks is captured).
        head = partial(self.model.head_outputs, greedy=greedy)
        runner = GraphRunner(self.model, self.cache, self.backend, sizes, mode=self.mode, head=head)
        runner.capture()
        return runner

    def runner_for(self, items: list[BatchItem]) -> GraphRunner | None:
        """The runner for a batch of equal-width requests, or None (run it eagerly)."""
        q = items[0].q_len
        runner = self.decode if q == 1 else self.verify.get(q)
        return runner if runner is not None and runner.can_run(items) else None
