"""The target model's runtime: prefill, plain decode and tree verification over a paged KV cache.

Per request the target holds ``committed_len`` cached tokens plus one *pending* token (the last
token it emitted, not yet forwarded). Decode forwards the pending token; verify forwards a tree
whose root is the pending token. Both end with a new pending token. The router owns everything
else about a request and can rebuild this state by prefilling prompt + emitted tokens.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch

from specmesh.kernels.common import kernel_impl
from specmesh.kernels.compaction import compact_accepted
from specmesh.runtime.attention.torch_backend import make_backend
from specmesh.runtime.config import parse_dtype
from specmesh.runtime.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    KVCacheFullError,
    SpecmeshError,
)
from specmesh.runtime.graph_runner import graphs_enabled
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, run_batch
from specmesh.runtime.models.causal_lm import AuxLayers, CausalLM, ModelOutput, load_causal_lm
from specmesh.runtime.sampling import SamplingParams, sample_tokens
from specmesh.runtime.tree import Tree
from specmesh.target_service.acceptance import accept_trees, padded_row_index
from specmesh.target_service.graphs import TargetGraphs
from specmesh.target_service.llava import ImageEncoder, is_llava_checkpoint, load_llava
from specmesh.target_service.multimodal import merge_images
from specmesh.target_service.steps import PrefillInput, StepOutput, VerifyInput

FEATURES = ("none", "aux", "hidden", "hidden_pre_norm")


@dataclass(frozen=True)
class TargetConfig:
    model_dir: str
    dtype: str | None = None  # None = the checkpoint's dtype
    device: str = "cpu"
    attention_backend: str = "torch"
    num_kv_slots: int = 65536
    page_size: int = 1
    max_requests: int = 256
    max_context: int = 4096
    max_prefill_tokens: int = 8192  # chunk size of one extend
    aux_layer_ids: tuple[int, ...] | None = None  # None = [2, L//2, L-3]
    aux_convention: str = "input"
    cuda_graph: bool = True  # decode / verify in CUDA graphs (CUDA + triton/flashinfer only)
    cuda_graph_max_bs: int = 32  # largest captured batch; bigger batches run eagerly
    # Verify trees captured before ready (the drafts' num_draft_tokens); other sizes run eagerly.
    cuda_graph_tree_sizes: tuple[int, ...] = (8,)


class TargetRuntime:
    def __init__(self, cfg: TargetConfig, model: CausalLM | None = None) -> None:
        self.cfg = cfg
        dtype = None if cfg.dtype is None else parse_dtype(cfg.dtype)
        self.mm: ImageEncoder | None = None  # vision tower + projector of a LLaVA target
        if model is None and is_llava_checkpoint(cfg.model_dir):
            model, self.mm = load_llava(cfg.model_dir, dtype=dtype, device=cfg.device)
        self.model = model or load_causal_lm(cfg.model_dir, dtype=dtype, device=cfg.device)
        mc = self.model.config
        self.model_config = mc
        ids = cfg.aux_layer_ids
        self.aux_layers = (
            AuxLayers(ids, cfg.aux_convention) if ids else AuxLayers.default(mc.num_layers)
        )
        self.feature = "none"
        self.cache = KVCache(
            num_layers=mc.num_layers,
            num_slots=cfg.num_kv_slots,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            dtype=mc.dtype,
            device=cfg.device,
            page_size=cfg.page_size,
            max_requests=cfg.max_requests,
            max_context=cfg.max_context,
        )
        self.backend = make_backend(cfg.attention_backend)
        self.kernel_impl = kernel_impl(cfg.attention_backend)
        self.graphs = self._capture_graphs()
        self.pending: dict[str, int] = {}

    def _capture_graphs(self) -> TargetGraphs | None:
        cfg = self.cfg
        if not graphs_enabled(cfg.cuda_graph, cfg.device, cfg.attention_backend):
            return None
        return TargetGraphs(
            self.model, self.cache, self.backend, mode="cuda-graph",
            max_bs=cfg.cuda_graph_max_bs, tree_sizes=cfg.cuda_graph_tree_sizes,
            aux=self.aux_layers,
        )  # fmt: skip

    @staticmethod
    def from_dir(model_dir: str | Path, **kw: object) -> TargetRuntime:
        return TargetRuntime(TargetConfig(model_dir=str(model_dir), **kw))  # type: ignore[arg-type]

    def set_aux_layers(self, aux: AuxLayers) -> None:
        """Capture the layers an in-process EAGLE-3 draft reads (its own ids); CUDA graphs, which
        bake the captured layers in, are captured again when they change."""
        n = self.model_config.num_layers
        if aux.capture_points(n) == self.aux_layers.capture_points(n):
            return
        self.aux_layers = aux
        self.set_feature(self.feature)
        if self.graphs is not None:
            self.graphs = self._capture_graphs()

    def set_feature(self, feature: str) -> None:
        """What the draft needs per token: EAGLE-3 aux states, the final hidden state, or none."""
        if feature not in FEATURES:
            raise ValueError(f"feature must be one of {FEATURES}, got {feature!r}")
        self.feature = feature
        self.model.set_aux_layers(self.aux_layers if feature == "aux" else None)

    @property
    def feature_dim(self) -> int:
        h = self.model_config.hidden_size
        return {"none": 0, "aux": h * len(self.aux_layers.layer_ids)}.get(self.feature, h)

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
    def prefill(self, inputs: list[PrefillInput]) -> StepOutput:
        merged = merge_images(inputs, self.mm, self.model.embed, self.cfg.model_dir)
        out = StepOutput(errors=merged.errors)
        ok: list[PrefillInput] = []
        for inp in merged.inputs:
            try:
                self._admit(inp, {i.rid: len(i.input_ids) for i in ok})
                ok.append(inp)
            except SpecmeshError as e:
                out.errors[inp.rid] = e
        if not ok:
            return out
        outputs = self._extend_chunked(ok)
        last_rows = torch.tensor(list(itertools.accumulate([len(i.input_ids) for i in ok]))) - 1
        logits = self.model.compute_logits(outputs.hidden[last_rows])
        first = sample_tokens(logits, [i.params for i in ok], [i.sample_offset for i in ok])
        for inp, tok in zip(ok, first.tolist(), strict=True):
            self.cache.commit(inp.rid, len(inp.input_ids))
            self.pending[inp.rid] = tok
            out.tokens[inp.rid] = [tok]
            out.row_counts[inp.rid] = len(inp.input_ids)
            if inp.rid in merged.prompt_ids:
                out.prompt_ids[inp.rid] = inp.input_ids
        out.features = self._features(outputs)
        out.mm_input_embeds = outputs.mm_input_embeds
        return out

    def _admit(self, inp: PrefillInput, admitted: dict[str, int]) -> None:
        """Validate one request and reserve its row, if its whole prompt fits in the KV cache
        beside the requests ``admitted`` before it in this batch (ask first, then act)."""
        self.check_ids(inp.rid, inp.input_ids, what="prompt")
        inp.params.validate()
        limit = self.cfg.max_context - 1
        if len(inp.input_ids) > limit:
            raise InvalidRequestError(
                f"request {inp.rid!r}: prompt of {len(inp.input_ids)} tokens exceeds the limit of {limit}"
            )
        if inp.rid in self.cache.requests:
            raise DuplicateRequestError(f"request {inp.rid!r} already has KV state")
        if not self.cache.can_allocate({**admitted, inp.rid: len(inp.input_ids) + 1}):
            raise KVCacheFullError(
                f"request {inp.rid!r}: prompt of {len(inp.input_ids)} tokens does not fit; "
                f"{self.cache.num_free_slots} KV slots free"
            )
        self.cache.add(inp.rid)

    def _extend_chunked(self, inputs: list[PrefillInput]) -> ModelOutput:
        """Extend in chunks of ``max_prefill_tokens`` per request; each chunk sits on top of the
        prefix the earlier chunks cached. Outputs are re-assembled in request order."""
        chunk = self.cfg.max_prefill_tokens
        per_req: dict[str, list[ModelOutput]] = {i.rid: [] for i in inputs}
        longest = max(len(i.input_ids) for i in inputs)
        try:
            for start in range(0, longest, chunk):
                items = [
                    BatchItem(
                        i.rid,
                        torch.tensor(i.input_ids[start : start + chunk]),
                        start,
                        input_embeds=None
                        if i.input_embeds is None
                        else i.input_embeds[start : start + chunk],
                    )
                    for i in inputs
                    if start < len(i.input_ids)
                ]
                res = run_batch(self.model, self.cache, self.backend, items)
                for it, rows in zip(
                    items, _split_rows(res, [it.q_len for it in items]), strict=True
                ):
                    per_req[it.rid].append(rows)
        except SpecmeshError:
            for i in inputs:
                self.cache.release(i.rid)
            raise
        parts = [p for i in inputs for p in per_req[i.rid]]
        return _concat_outputs(parts)

    # -- decode / verify ------------------------------------------------------------------------
    def decode(
        self, rids: list[str], params: list[SamplingParams], offsets: list[int]
    ) -> StepOutput:
        """Plain decoding: one token per request."""
        trees = [
            VerifyInput(rid, Tree.chain([self._pending(rid)]), p, o)
            for rid, p, o in zip(rids, params, offsets, strict=True)
        ]
        return self.verify(trees)

    def verify(self, inputs: list[VerifyInput]) -> StepOutput:
        """Forward every tree (prefix + ancestors + self mask, positions ``committed + depth``),
        accept a path greedily or by lossless tree sampling, keep the path's KV by length.
        A request that is invalid or whose tree does not fit in the KV cache fails alone (its
        state is kept, so the router can release or retry it)."""
        errors: dict[str, SpecmeshError] = {}
        items, ok, demand = [], [], {}
        for inp in inputs:
            try:
                item = self._verify_item(inp, demand)
            except SpecmeshError as e:
                errors[inp.rid] = e
                continue
            demand[inp.rid] = item.start + item.q_len
            items.append(item)
            ok.append(inp)
        if not ok:
            return StepOutput(errors=errors)
        out = self._verify_batch(ok, items)
        out.errors.update(errors)
        return out

    def _verify_item(self, inp: VerifyInput, demand: dict[str, int]) -> BatchItem:
        pending = self._pending(inp.rid)
        if int(inp.tree.tokens[0]) != pending:
            raise InvalidRequestError(
                f"request {inp.rid!r}: tree root {int(inp.tree.tokens[0])} is not the pending token {pending}"
            )
        self.check_ids(inp.rid, inp.tree.tokens.tolist(), what="draft tree")
        base = self.cache.get(inp.rid).committed_len
        n = inp.tree.num_nodes
        if not self.cache.can_allocate({**demand, inp.rid: base + n}):
            raise KVCacheFullError(
                f"request {inp.rid!r}: a {n}-node tree does not fit; {self.cache.num_free_slots} KV slots free"
            )
        mask = torch.cat([torch.ones(n, base, dtype=torch.bool), inp.tree.mask], dim=1)
        # A one-node tree (plain decode) sees its whole prefix: causal, the decode graph's mode.
        mask = mask if n > 1 else None
        return BatchItem(inp.rid, inp.tree.tokens, base, base + inp.tree.depths, mask)

    def _verify_batch(self, inputs: list[VerifyInput], items: list[BatchItem]) -> StepOutput:
        runner = self.graphs.runner_for(items) if self.graphs is not None else None
        if runner is not None:  # a CUDA graph of this batch's shape
            res = runner.run(items)
        else:
            res = run_batch(self.model, self.cache, self.backend, items)
        logits = self.model.compute_logits(res.hidden)
        if all(i.tree.num_nodes == 1 and i.params.greedy for i in inputs):
            return self._greedy_decode(inputs, res, logits)
        n_max = max(i.tree.num_nodes for i in inputs)
        result = accept_trees(inputs, logits, n_max, self.kernel_impl)
        flat, _ = compact_accepted(result.accept_path, result.accept_len, self.kernel_impl)
        row_of = padded_row_index([i.tree.num_nodes for i in inputs], n_max).to(flat.device)
        out = StepOutput(features=self._features(res.select(row_of[flat])))
        # One device-to-host copy per field; the per-request bookkeeping below is host-side.
        paths, lens = result.accept_path.tolist(), result.accept_len.tolist()
        for inp, full_path, n, bonus in zip(
            inputs, paths, lens, result.bonus.tolist(), strict=True
        ):
            path = full_path[:n]
            self.cache.accept_path(inp.rid, path, inp.tree.num_nodes)
            out.tokens[inp.rid] = [*inp.tree.tokens[path[1:]].tolist(), bonus]
            out.row_counts[inp.rid] = len(path)
            self.pending[inp.rid] = bonus
        return out

    def _greedy_decode(
        self, inputs: list[VerifyInput], res: ModelOutput, logits: torch.Tensor
    ) -> StepOutput:
        """Plain greedy decoding (every tree is its root alone): the tree verifier would pick
        the argmax and keep the one row, so do just that."""
        feats = self._features(res)  # a copy: a graph replay's outputs are overwritten next call
        out = StepOutput(features=None if feats is None else feats.clone())
        for inp, tok in zip(inputs, logits.argmax(-1).tolist(), strict=True):
            self.cache.commit(inp.rid, self.cache.get(inp.rid).committed_len + 1)
            out.tokens[inp.rid], out.row_counts[inp.rid] = [tok], 1
            self.pending[inp.rid] = tok
        return out

    def _features(self, res: ModelOutput) -> torch.Tensor | None:
        return {
            "aux": res.aux_hidden,
            "hidden": res.hidden,
            "hidden_pre_norm": res.hidden_pre_norm,
        }.get(self.feature)

    def _pending(self, rid: str) -> int:
        self.cache.get(rid)  # NOT_FOUND for an unknown id
        return self.pending[rid]

    def release(self, rid: str) -> None:
        self.cache.release(rid)
        self.pending.pop(rid, None)


def _split_rows(res: ModelOutput, counts: list[int]) -> list[ModelOutput]:
    bounds = [0, *itertools.accumulate(counts)]
    return [res.select(slice(a, b)) for a, b in itertools.pairwise(bounds)]


def _concat_outputs(parts: list[ModelOutput]) -> ModelOutput:
    cat = lambda name: (
        None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
    )
    return ModelOutput(**{name: cat(name) for name in vars(parts[0])})
