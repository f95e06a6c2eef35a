"""The target's static-shape runners: one for decode (1 row per request), one per tree size for
verify (``num_draft_tokens`` rows per request, tree mask). Decode is captured when the runtime is
built, before the service reports ready; the target learns a tree size from its first verify
batch, so that size's graphs are captured then (at most `MAX_VERIFY_SHAPES` sizes)."""

from __future__ import annotations

from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.graph_runner import GraphRunner
from specmesh.runtime.graph_sizes import decode_sizes, verify_sizes
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, ForwardModel

MAX_VERIFY_SHAPES = 4


class TargetGraphs:
    def __init__(
        self,
        model: ForwardModel,
        cache: KVCache,
        backend: AttentionBackend,
        *,
        mode: str,
        max_bs: int,
    ) -> None:
        self.model, self.cache, self.backend, self.mode = model, cache, backend, mode
        self.max_bs = min(max_bs, cache.req_to_slot.shape[0])
        self.decode = self._runner(1)
        self.verify: dict[int, GraphRunner] = {}

    def _runner(self, tokens_per_req: int) -> GraphRunner:
        ctx = self.cache.max_context
        sizes = (
            decode_sizes(self.max_bs, ctx)
            if tokens_per_req == 1
            else verify_sizes(self.max_bs, tokens_per_req, ctx)
        )
        runner = GraphRunner(self.model, self.cache, self.backend, sizes, mode=self.mode)
        runner.capture()
        return runner

    def runner_for(self, items: list[BatchItem]) -> GraphRunner | None:
        """The runner for a batch of equal-width requests, or None (run it eagerly)."""
        q = items[0].q_len
        if q == 1:
            runner = self.decode
        elif q in self.verify or len(self.verify) < MAX_VERIFY_SHAPES:
            runner = self.verify.get(q) or self.verify.setdefault(q, self._runner(q))
        else:
            return None
        return runner if runner.can_run(items) else None

    def recapture(self) -> None:
        """The model's outputs changed shape (EAGLE-3 aux capture on or off): capture again."""
        for runner in [self.decode, *self.verify.values()]:
            runner.capture()
