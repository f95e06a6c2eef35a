"""One draft search's decode steps through the static-shape runners, laid out once per search.

Every step of a search forwards ``topk`` rows per request, and each request reads the same KV
whatever the step: its prefix and the whole speculative region of the search (``S = topk *
(num_steps - 1)`` token indices from ``spec_base``), the columns a node may not see yet masked
off. So the search lays out, once, in each runner it uses:

    kv_indptr, kv_indices     each request's ``spec_base + S`` slots (reserved here, once)
    mask_indptr, custom_mask  each request's ``[topk, spec_base + S]`` block: its prefix columns
                              (`TreeDrafter.prefix_columns`), the speculative ones cleared
    padding requests          up to the runner's bucket (`GraphRunner.fill_padding`)

(every index it needs computed in numpy on the host and copied to the device at once)

and a step writes only what changes (a few device copies, no host arithmetic per request):

    input_ids    the frontier's tokens            positions   base + `position_offset(step)`
    out_slots    the step's ``topk`` slots each   hidden_in   the frontier's input hidden
    custom_mask  the speculative columns, from ``seen`` (one indexed write)

then replays the runner's graph (eager-static: calls its forward on the buffers). Reading a
few masked-off slots more than the step's own nodes costs nothing a step notices, and the
layout the graph reads stops changing between steps: the step is a graph replay and a handful
of copies, as a round's device work should be.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from specmesh.runtime.attention.base import AttentionMetadata
from specmesh.runtime.graph_runner import GraphRunner
from specmesh.runtime.model_runner import reserve_tokens
from specmesh.runtime.static_shapes import bucket_size

if TYPE_CHECKING:
    from specmesh.draft_service.drafter import RootState, TreeDrafter


class StepBatch:
    """The layout of one search's steps (module docstring); `forward` runs one step."""

    def __init__(
        self,
        drafter: TreeDrafter,
        rids: list[str],
        states: list[RootState],
        num_steps: int,
        runners: dict[int, GraphRunner],
    ) -> None:
        cache, k = drafter.cache, drafter.spec.topk
        self.drafter, self.states, self.runners = drafter, states, runners
        width = k * (num_steps - 1)
        self.kv_lens = [st.spec_base + width for st in states]
        reserve_tokens(cache, dict(zip(rids, self.kv_lens, strict=True)))
        # Every index the layout needs, computed on the host and copied to the device at once.
        bs, table = len(rids), cache.req_to_slot
        row = np.array([cache.get(rid).row for rid in rids]) * table.shape[1]  # flat row start
        kv_lens = np.array(self.kv_lens)
        kv_indptr = np.concatenate([[0], np.cumsum(kv_lens)])
        spec = np.array([st.spec_base for st in states])
        cols = np.arange(width)
        parts = {
            # each request's table row, 0 .. kv_len (flat indices into the table)
            "kv": np.repeat(row - kv_indptr[:-1], kv_lens) + np.arange(kv_indptr[-1]),
            "kv_indptr": kv_indptr,
            "mask_indptr": kv_indptr * k,  # [k, kv_len] per request
            # step s's node i of request b: table slot ``spec_base + s * k + i``: [S - 1, bs, k]
            "out": (row + spec)[None, :, None] + cols.reshape(num_steps - 1, 1, k),
            # node i's speculative columns in the flat mask: [bs, k, S]
            "mask_at": (k * kv_indptr[:-1] + spec)[:, None, None]
            + (kv_lens[:, None] * np.arange(k))[:, :, None]
            + cols,
            "positions": np.repeat([st.last_pos for st in states], k),
        }
        flat = torch.from_numpy(np.concatenate([a.ravel() for a in parts.values()]))
        sizes = [a.size for a in parts.values()]
        dev = dict(zip(parts, flat.to(table.device).split(sizes), strict=True))
        self.kv_indices = table.view(-1)[dev["kv"]]
        self.kv_indptr, self.mask_indptr = dev["kv_indptr"], dev["mask_indptr"]
        self.out_slots = table.view(-1)[dev["out"]].view(num_steps - 1, bs * k)
        self.mask_at, self.positions = dev["mask_at"], dev["positions"]
        self.laid_out: dict[int, tuple[AttentionMetadata, int]] = {}  # by runner: (meta, bucket)

    def forward(
        self, step: int, tokens: torch.Tensor, hidden_in: torch.Tensor, seen: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Step ``step`` of the frontier ``tokens [bs, k]`` with input ``hidden_in [bs * k, H]``,
        each node seeing the speculative columns of ``seen [bs, k, S]``."""
        runner = self.runners[step]
        meta, bucket = self.layout(runner, step)
        self.write(runner, step, tokens, hidden_in, seen)
        hidden, logits = runner.replay(meta, bucket, tokens.numel())
        return hidden, logits

    def write(
        self,
        runner: GraphRunner,
        step: int,
        tokens: torch.Tensor,
        hidden_in: torch.Tensor,
        seen: torch.Tensor,
    ) -> None:
        """What changes between the steps of a search, into ``runner``'s buffers."""
        buf, raw = runner.buffers, tokens.numel()
        buf.input_ids[:raw].copy_(tokens.reshape(-1))
        torch.add(self.positions, self.drafter.position_offset(step), out=buf.positions[:raw])
        buf.out_slots[:raw].copy_(self.out_slots[step - 1])
        buf.custom_mask.index_put_((self.mask_at,), seen.reshape(-1))
        if buf.hidden_in is not None:
            buf.hidden_in[:raw].copy_(hidden_in)

    def layout(self, runner: GraphRunner, step: int) -> tuple[AttentionMetadata, int]:
        """The search's constant layout in ``runner``'s buffers, written at its first step."""
        key = id(runner)
        if key in self.laid_out:
            return self.laid_out[key]
        q, buf = runner.sizes.tokens_per_req, runner.buffers
        bs = len(self.states)
        bucket = bucket_size(bs, runner.batch_sizes)
        num_pad, kv_raw = bucket - bs, sum(self.kv_lens)
        runner.sizes.check(bucket, kv_raw + num_pad * q, (kv_raw + num_pad * q) * q)
        buf.kv_indptr[: bs + 1].copy_(self.kv_indptr)
        buf.kv_indices[:kv_raw].copy_(self.kv_indices)
        buf.mask_indptr[: bs + 1].copy_(self.mask_indptr)
        prefix = [np.tile(self.drafter.prefix_columns(step, st, n), q)
                  for st, n in zip(self.states, self.kv_lens, strict=True)]  # fmt: skip
        buf.custom_mask[: kv_raw * q].copy_(torch.from_numpy(np.concatenate(prefix)))
        if num_pad:
            runner.fill_padding(bs, num_pad, kv_raw, kv_raw * q)
        cpu = [*self.kv_lens, *[q] * num_pad] if runner.backend.needs_cpu_metadata else None
        self.laid_out[key] = (buf.metadata(bucket, q, cpu), bucket)
        return self.laid_out[key]
