"""Standalone drafting: a small causal LM with the target's tokenizer and its own KV cache.

It needs no target features (`Feature.NONE`). Extend forwards the newly committed ids and,
as one more row, the pending token, which is not committed:

    draft KV row: [ committed ids 0 .. C-1 | pending (root) at C | step 1 nodes | step 2 ... ]
                                                                  ^ spec_base = C + 1

The root's children are the top-k of the pending row's logits; a node at depth j sits at position
C + j. The next extend starts at C again (the pending token is then the first committed id), so
the root row and every speculative row are simply overwritten.
"""

from __future__ import annotations

import torch

from specmesh.draft_service.drafter import RootState, TreeDrafter
from specmesh.protocol.config import SpecParams
from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.features import FeatureSpec
from specmesh.protocol.steps import ExtendInput
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, run_batch
from specmesh.runtime.models.causal_lm import CausalLM


class StandaloneDrafter(TreeDrafter):
    needs = FeatureSpec()
    prefix_lookahead = 0  # row t is token t's alone

    def __init__(
        self,
        model: CausalLM,
        cache: KVCache,
        backend: AttentionBackend,
        spec: SpecParams,
        target_vocab_size: int,
    ) -> None:
        super().__init__(cache, backend, spec)
        self.model = model
        # Same tokenizer, but vocab padding may differ: never propose ids the target lacks.
        self.num_proposable = min(target_vocab_size, model.config.vocab_size)

    @torch.inference_mode()
    def extend(self, inputs: list[ExtendInput]) -> None:
        items = []
        for inp in inputs:
            ids = [*inp.committed_ids, inp.next_token]
            if inp.is_multimodal:
                raise InvalidRequestError(
                    f"request {inp.rid!r}: a standalone draft cannot read image inputs"
                )
            if max(ids) >= self.model.config.vocab_size or min(ids) < 0:
                raise InvalidRequestError(
                    f"request {inp.rid!r}: ids outside the draft vocab "
                    f"[0, {self.model.config.vocab_size})"
                )
            if inp.new:
                self.cache.add(inp.rid)
                if self.prefixes is not None:  # the pending row is always computed
                    self.prefixes.start(inp, ids)
            start = self.cache.get(inp.rid).committed_len
            skip = start if inp.new else 0  # rows the prefix cache had
            items.append(BatchItem(inp.rid, torch.tensor(ids[skip:], dtype=torch.int64), start))
        hidden, logits = self.step_forward(0, items, None)
        last = (torch.tensor([it.q_len for it in items]).cumsum(0) - 1).tolist()
        for it, row, inp in zip(items, last, inputs, strict=True):
            root = it.start + it.q_len - 1  # the pending row: written, not committed
            self.cache.commit(it.rid, root)
            self.roots[it.rid] = RootState(root, root + 1, hidden[row], logits[row])
            if self.prefixes is not None and inp.new:  # committed rows only (not the pending)
                self.prefixes.keep(inp, list(inp.committed_ids))

    def step_forward(
        self, step: int, items: list[BatchItem], hidden_in: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward ``items``; the model's own KV carries the context, ``hidden_in`` is unused."""
        out = run_batch(
            self.model, self.cache, self.backend, items, kv_pools=self.pools_for_step(step)
        )
        logits = self.model.compute_logits(out.hidden)[:, : self.num_proposable]
        return out.hidden, logits
