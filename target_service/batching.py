"""How the target runs a batch: prefill extends in chunks (and the prompt's own logprobs), and a
batch whose forward raises run again request by request, so that one bad request fails alone."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from specmesh.protocol.errors import SpecmeshError, as_specmesh_error
from specmesh.protocol.steps import Logprob, PrefillInput, StepOutput
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, run_batch
from specmesh.runtime.models.causal_lm import CausalLM, ModelOutput

log = logging.getLogger(__name__)


class HasRid(Protocol):
    rid: str


def run_isolated(
    items: Sequence[HasRid],
    run: Callable[[list], StepOutput],
    undo: Callable[[str], object],
) -> StepOutput:
    """``run(items)`` as one batch; if it raises, each item alone, so that a request whose
    forward fails (a bug, or input no check caught) fails by itself. ``undo(rid)`` drops a
    failed request's state. Runs fail before they change any request's state (prefill commits
    and verify accepts only after the forward), so running again is safe."""
    if not items:
        return StepOutput()
    try:
        return run(list(items))
    except Exception as e:
        if len(items) == 1:
            rid = items[0].rid
            if not isinstance(e, SpecmeshError):
                log.exception("target step failed for request %r", rid)
            undo(rid)
            return StepOutput(errors={rid: as_specmesh_error(e, rid)})
    return merge_outputs([run_isolated([i], run, undo) for i in items])


def extend_chunked(
    model: CausalLM,
    cache: KVCache,
    backend: AttentionBackend,
    inputs: list[PrefillInput],
    chunk: int,
) -> ModelOutput:
    """Extend in chunks of ``chunk`` tokens per request; each chunk sits on top of the prefix
    the earlier chunks (and, for a piece of a longer input, the earlier pieces) cached. Outputs
    are re-assembled in request order."""
    per_req: dict[str, list[ModelOutput]] = {i.rid: [] for i in inputs}
    longest = max(len(i.input_ids) for i in inputs)
    for start in range(0, longest, chunk):
        items = [
            BatchItem(
                i.rid,
                torch.tensor(i.input_ids[start : start + chunk]),
                i.input_start + start,  # a later piece of an input sits on the earlier ones
                input_embeds=None
                if i.input_embeds is None
                else i.input_embeds[start : start + chunk],
            )
            for i in inputs
            if start < len(i.input_ids)
        ]
        res = run_batch(model, cache, backend, items)
        for it, rows in zip(items, _split_rows(res, [it.q_len for it in items]), strict=True):
            per_req[it.rid].append(rows)
    return _concat_outputs([p for i in inputs for p in per_req[i.rid]])


def _split_rows(res: ModelOutput, counts: list[int]) -> list[ModelOutput]:
    bounds = [0, *itertools.accumulate(counts)]
    return [res.select(slice(a, b)) for a, b in itertools.pairwise(bounds)]


def _concat_outputs(parts: list[ModelOutput]) -> ModelOutput:
    cat = lambda name: (
        None if getattr(parts[0], name) is None else torch.cat([getattr(p, name) for p in parts])
    )
    return ModelOutput(**{name: cat(name) for name in vars(parts[0])})


def prompt_logprobs(
    model: CausalLM, ok: list[PrefillInput], hidden: torch.Tensor, out: StepOutput
) -> None:
    """Log-softmax of the prompt's own logits (row t predicts token t + 1), for requests that
    ask; over the prompt only (a replay's emitted tokens are not prompt). ``hidden`` holds the
    prefill's rows of every request of ``ok``, in order."""
    starts = [0, *itertools.accumulate(len(i.input_ids) for i in ok)]
    for inp, start in zip(ok, starts, strict=False):
        n = len(inp.input_ids) - inp.sample_offset
        if inp.params.prompt_logprobs is None or n < 2:
            continue
        entries = []
        for a in range(0, n - 1, 1024):  # [chunk, vocab] logits at a time
            b = min(a + 1024, n - 1)
            lp = torch.log_softmax(model.compute_logits(hidden[start + a : start + b]).float(), -1)
            entries += pick_logprobs(lp, inp.input_ids[a + 1 : b + 1], inp.params.prompt_logprobs)
        out.prompt_logprobs[inp.rid] = entries


def merge_outputs(parts: list[StepOutput]) -> StepOutput:
    """One output from the outputs of consecutive sub-batches, rows kept in order."""
    cat = lambda ts: None if any(t is None for t in ts) or not ts else torch.cat(ts)
    out = StepOutput(
        features=cat([p.features for p in parts if p.tokens]),
        mm_input_embeds=cat([p.mm_input_embeds for p in parts if p.tokens]),
    )
    for p in parts:
        out.tokens.update(p.tokens)
        out.prompt_ids.update(p.prompt_ids)
        out.row_counts.update(p.row_counts)
        out.logprobs.update(p.logprobs)
        out.prompt_logprobs.update(p.prompt_logprobs)
        out.errors.update(p.errors)
        out.cached_tokens.update(p.cached_tokens)
    return out


def pick_logprobs(logprobs: torch.Tensor, tokens: list[int], num_top: int) -> list[Logprob]:
    """Row i of ``logprobs`` ``[rows, vocab]`` is the distribution ``tokens[i]`` was drawn
    from: its log-probability and the ``num_top`` most probable alternatives."""
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logprobs.device)[:, None])[:, 0]
    top = logprobs.topk(num_top, -1) if num_top else None
    top_vals, top_ids = (top.values.tolist(), top.indices.tolist()) if top else ([], [])
    return [
        Logprob(t, lp, tuple(zip(top_ids[i], top_vals[i], strict=True)) if num_top else ())
        for i, (t, lp) in enumerate(zip(tokens, chosen.tolist(), strict=True))
    ]


def ordered_outputs(
    parts: list[tuple[Sequence[HasRid], StepOutput]], order: list[str]
) -> StepOutput:
    """One output from passes that ran parts of a batch: dicts merged, feature and embedding rows
    put back in the batch's request ``order`` (each pass's rows follow its own inputs, one block
    of ``row_counts`` rows per request it answered). One pass that ran (the usual case) is
    already in order: its output is returned as it is, nothing copied."""
    ran = [(inputs, part) for inputs, part in parts if inputs]
    if len(ran) <= 1:
        return ran[0][1] if ran else StepOutput()
    rows: dict[str, dict[str, torch.Tensor]] = {"features": {}, "mm_input_embeds": {}}
    out = StepOutput()
    for inputs, part in parts:
        answered = [i.rid for i in inputs if i.rid in part.tokens]
        for name, by_rid in rows.items():
            tensor = getattr(part, name)
            if tensor is not None:
                by_rid.update(
                    zip(answered, tensor.split([part.row_counts[r] for r in answered]), strict=True)
                )
        for name in ("tokens", "prompt_ids", "row_counts", "logprobs", "prompt_logprobs", "errors",
                     "cached_tokens"):  # fmt: skip
            getattr(out, name).update(getattr(part, name))
    for name, by_rid in rows.items():
        if by_rid:
            setattr(out, name, torch.cat([by_rid[r] for r in order if r in by_rid]))
    # in process the rows are cut in row_counts' order (`router.draft_rows.split_rows`)
    out.row_counts = {r: out.row_counts[r] for r in order if r in out.row_counts}
    return out
