"""The target's static-shape runners: one for decode (1 row per request) and one per declared tree
size for verify (``num_draft_tokens`` rows per request, tree mask). All of them are captured when
the runtime is built, before the service reports ready; a batch of another shape runs eagerly.

CUDA graphs are captured with the target's EAGLE-3 aux layers switched on when it has them
(``TargetConfig.aux_layer_ids``, or a handshake's), so one capture serves every feature the
drafts ask for (aux states, final hidden, or none): the replay fills ``aux_hidden`` and the
runtime picks what a batch needs. A target with none captures without them (any depth: no
default layers are guessed); the runtime captures again only when a handshake changes them.
"""

from __future__ import annotations

from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.graph_runner import GraphRunner
from specmesh.runtime.graph_sizes import GraphSizes, decode_sizes, verify_sizes
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem
from specmesh.runtime.models.causal_lm import AuxLayers, CausalLM


class TargetGraphs:
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
        restore = model.aux_points
        model.set_aux_layers(aux)
        try:
            self.decode = self._runner(decode_sizes(self.max_bs, ctx))
            self.verify = {n: self._runner(verify_sizes(self.max_bs, n, ctx)) for n in tree_sizes}
        finally:
            model.aux_points = restore

    def _runner(self, sizes: GraphSizes) -> GraphRunner:
        runner = GraphRunner(self.model, self.cache, self.backend, sizes, mode=self.mode)
        runner.capture()
        return runner

    def runner_for(self, items: list[BatchItem]) -> GraphRunner | None:
        """The runner for a batch of equal-width requests, or None (run it eagerly)."""
        q = items[0].q_len
        runner = self.decode if q == 1 else self.verify.get(q)
        return runner if runner is not None and runner.can_run(items) else None
