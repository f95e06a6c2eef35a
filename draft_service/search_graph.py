"""A whole draft search as one graph per batch bucket: on a GPU one CUDA graph replay runs every
step's forward, the top-k expansions between them and the tree's selection, and the host reads
the trees back once.

A search (`TreeDrafter.grow`) reads nothing from the host between its steps, and its layout
stops changing once laid out (`StepBatch`), so all of it can be captured. What differs from
one search to the next is written into static inputs before the replay:

    logits, hidden, roots    each request's root row (its last extend) and root token
    positions, out_slots     the nodes' positions and KV slots (`StepBatch`'s, per search)
    mask_at                  where each node's speculative mask columns sit
    pad                      which requests of the bucket are padding

and each step runner's KV indices, indptrs and prefix mask are laid out in its buffers as for a
per-step search (`StepBatch.layout`). Inside the graph every step forwards the whole bucket;
padding requests write their KV to the scratch slot, see only it, and write their mask columns
into their own (all-visible) mask rows, so nothing they compute reaches a real request.

Eager-static (off a GPU, and in every CPU test) runs the same body over the same buffers
eagerly. Backends that need host-side metadata per batch (FlashInfer's plan) keep the
per-step graphs: a captured search could not re-plan between its steps.
"""

from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING

import torch

from specmesh.draft_service.drafter import host_trees
from specmesh.draft_service.step_batch import StepBatch
from specmesh.runtime.attention.base import AttentionMetadata
from specmesh.runtime.graph_runner import GraphRunner, capture_graph

if TYPE_CHECKING:
    from specmesh.draft_service.drafter import RootState, TreeDrafter
    from specmesh.draft_service.step_graphs import DraftStepGraphs
    from specmesh.protocol.trees import DraftTree


class SearchGraphs:
    """The draft's own search (its ``num_steps``) per batch bucket; module docstring."""

    def __init__(self, drafter: TreeDrafter, steps: DraftStepGraphs, mode: str) -> None:
        spec, dev = drafter.spec, drafter.cache.req_to_slot.device
        self.drafter, self.mode, self.runners = drafter, mode, steps.runners
        self.batch_sizes = self.runners[1].batch_sizes
        k, n = spec.topk, max(self.batch_sizes) * spec.topk
        self.width = k * (spec.num_steps - 1)
        first = self.runners[1]
        hidden, logits = first.forward_static(first.pad_batch(1), 1)  # the network's widths
        buf = first.buffers
        self.logits = torch.zeros(max(self.batch_sizes), logits.shape[-1], device=dev)  # fp32
        self.hidden = hidden.new_zeros(max(self.batch_sizes), hidden.shape[-1])
        self.roots = torch.zeros(max(self.batch_sizes), dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=buf.positions.dtype, device=dev)
        self.out_slots = buf.out_slots.new_full((spec.num_steps - 1, n), first.pad_slot)
        self.mask_at = torch.zeros(n * self.width, dtype=torch.int64, device=dev)
        self.pad = torch.zeros(max(self.batch_sizes), 1, 1, dtype=torch.bool, device=dev)
        self.pad_rows = torch.arange(max(self.batch_sizes), device=dev) * k * k  # mask rows
        self.metas: dict[int, AttentionMetadata] = {}  # by id of runner: its bucket's layout
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture()

    def run(
        self, rids: list[str], states: list[RootState], roots: list[int]
    ) -> list[DraftTree] | None:
        """The trees of one search (the draft's ``num_steps``) of ``rids``; None where the
        batch exceeds the largest bucket (the caller then searches step by step)."""
        bs, k = len(rids), self.drafter.spec.topk
        if bs > max(self.batch_sizes):
            return None
        batch = StepBatch(self.drafter, rids, states, self.drafter.spec.num_steps, self.runners)
        for step, runner in self.runners.items():
            self.metas[id(runner)], bucket = batch.layout(runner, step)
        n = bs * k
        torch.stack([s.logits for s in states], out=self.logits[:bs])
        torch.stack([s.hidden for s in states], out=self.hidden[:bs])
        self.roots[:bs].copy_(torch.tensor(roots))
        self.positions[:n].copy_(batch.positions)
        self.out_slots[:, :n].copy_(batch.out_slots)
        self.mask_at[: n * self.width].copy_(batch.mask_at)
        self.pad[:bs] = False
        if bucket > bs:
            self._pad(bs, bucket, sum(batch.kv_lens) * k)
        tokens, parents = self.replay(bucket)
        return host_trees(tokens[:bs], parents[:bs])

    def replay(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The bucket's search over the static inputs as written: (tokens, parents)."""
        if self.mode == "cuda-graph":
            self.graphs[bucket].replay()
            return self.outputs[bucket]
        return self._search(bucket)

    @torch.inference_mode()
    def capture(self) -> None:
        """Per bucket (largest first), a search of padding requests only: captured on CUDA (two
        warm-up runs first, for lazy initialisation and autotuning), run once eager-static."""
        pool = torch.cuda.graph_pool_handle() if self.mode == "cuda-graph" else None
        for bucket in sorted(self.batch_sizes, reverse=True):
            for runner in self.runners.values():
                self.metas[id(runner)] = runner.pad_batch(bucket)
            self._pad(0, bucket, 0)
            if self.mode != "cuda-graph":
                self._search(bucket)
                continue
            graph, self.outputs[bucket] = capture_graph(partial(self._search, bucket), pool)
            self.graphs[bucket], pool = graph, graph.pool()

    def _pad(self, bs: int, bucket: int, mask_raw: int) -> None:
        """Requests ``bs .. bucket`` are padding: KV writes to the scratch slot, mask columns into
        the first entry of each one's own mask rows (``mask_raw`` on, `fill_padding`'s layout)."""
        k, cols = self.drafter.spec.topk, self.drafter.spec.topk * self.width
        self.pad[bs:bucket] = True
        self.out_slots[:, bs * k : bucket * k].fill_(self.runners[1].pad_slot)
        at = (self.pad_rows[: bucket - bs] + mask_raw).repeat_interleave(cols)
        self.mask_at[bs * cols : bucket * cols].copy_(at)

    def _search(self, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
        steps = _BucketSteps(self, bucket)
        tree, _ = self.drafter.grow(
            self.logits[:bucket],
            self.hidden[:bucket],
            self.roots[:bucket],
            self.drafter.spec.num_steps,
            lambda _hidden: steps.forward,
        )
        return tree


class _BucketSteps(StepBatch):
    """A search's steps inside its graph: `StepBatch`'s per-search tensors are the graph's static
    inputs, each step forwards the whole bucket, and runs its runner's forward (not its graph:
    one graph cannot replay another)."""

    def __init__(self, graphs: SearchGraphs, bucket: int) -> None:  # no layout of its own
        k = graphs.drafter.spec.topk
        self.drafter, self.runners, self.bucket = graphs.drafter, graphs.runners, bucket
        self.positions = graphs.positions[: bucket * k]
        self.out_slots = graphs.out_slots[:, : bucket * k]
        self.mask_at = graphs.mask_at[: bucket * k * graphs.width]
        self.pad, self.metas = graphs.pad[:bucket], graphs.metas

    def forward(
        self, step: int, tokens: torch.Tensor, hidden_in: torch.Tensor, seen: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        runner: GraphRunner = self.runners[step]
        self.write(runner, step, tokens, hidden_in, seen | self.pad)
        hidden, logits = runner.forward_static(self.metas[id(runner)], self.bucket)
        return hidden, logits
