"""The target's prefill: admit each input (or the next piece of one), start it with its cached
prefix, extend over the rest, and sample the first token where an input ends.

Prompts that share an uncached prefix with an earlier one of the same call (``n > 1``, users of
one new system prompt) run in a second pass, from the blocks the first left in the prefix cache
(`target_service.prefix`). A batch whose forward raises runs again input by input
(`batching.run_isolated`), so state changes only after every computation.
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import torch

from specmesh.protocol.errors import (
    DuplicateRequestError,
    InvalidRequestError,
    KVCacheFullError,
    SpecmeshError,
)
from specmesh.protocol.features import Feature
from specmesh.protocol.images import ImageLimits
from specmesh.protocol.steps import PrefillInput, StepOutput
from specmesh.runtime.prefix_cache import Match
from specmesh.runtime.sampling import TokenHistory, processed_logprobs, sample_tokens
from specmesh.target_service.batching import (
    extend_chunked,
    ordered_outputs,
    pick_logprobs,
    run_isolated,
)
from specmesh.target_service.grammar import mask_logits, row_masks
from specmesh.target_service.multimodal import merge_images
from specmesh.target_service.state import TargetRequest

if TYPE_CHECKING:
    from specmesh.target_service.runtime import TargetRuntime


def prefill_inputs(rt: TargetRuntime, inputs: list[PrefillInput], feature: Feature) -> StepOutput:
    """`TargetRuntime.prefill`."""
    cfg = rt.cfg
    limits = ImageLimits(cfg.max_images_per_request, cfg.max_image_bytes, cfg.max_image_pixels)
    errors: dict[str, SpecmeshError] = rt.partial.refuse_pieced_images(inputs)
    whole = [i for i in inputs if i.rid not in errors]
    merged = merge_images(whole, rt.mm, rt.model.embed, cfg.model_dir, limits)
    errors.update(merged.errors)
    # Prompts sharing an uncached prefix with an earlier one of this batch (`n > 1`, users
    # of one system prompt) run after it, from the blocks it leaves in the prefix cache.
    leaders, followers = rt.prefixes.split_followers(merged.inputs)
    parts = [_prefill_pass(rt, group, feature, errors) for group in (leaders, followers)]
    out = ordered_outputs(parts, [i.rid for i in merged.inputs])
    out.errors.update(errors)
    for inp in inputs:  # a request refused in the middle of its input is dropped
        if inp.input_start and inp.rid in errors:
            rt.release(inp.rid)
    for inp in merged.inputs:
        if inp.rid in merged.prompt_ids and inp.rid in out.tokens:
            out.prompt_ids[inp.rid] = inp.input_ids
    return out


def _prefill_pass(
    rt: TargetRuntime,
    inputs: list[PrefillInput],
    feature: Feature,
    errors: dict[str, SpecmeshError],
) -> tuple[list[PrefillInput], StepOutput]:
    """Admit ``inputs`` (each with its cached prefix, if any) and run them as one batch."""
    ok: list[PrefillInput] = []
    key = rt.feature_key(feature)
    for inp in inputs:
        try:
            ok.append(_admit(rt, inp, {i.rid: i.input_start + len(i.input_ids) for i in ok}))
            rt.prefixes.attach(ok[-1], key)  # its cached prefix, if any
        except SpecmeshError as e:
            errors[inp.rid] = e
            if inp.input_start:  # a request refused in the middle of its input is dropped
                rt.release(inp.rid)
    return ok, run_isolated(ok, lambda b: _prefill_batch(rt, b, feature), rt.release)


def _prefill_batch(rt: TargetRuntime, ok: list[PrefillInput], feature: Feature) -> StepOutput:
    """Extend over every input (piece); sample where an input ends. State changes only
    after every computation, so `run_isolated` may run a failed batch again."""
    chunk, key, pre = rt.cfg.max_prefill_tokens, rt.feature_key(feature), rt.prefixes
    run = pre.to_run(ok)  # past each cached prefix
    outputs = extend_chunked(rt.model, rt.cache, rt.backend, run, chunk)
    ends = list(itertools.accumulate([len(i.input_ids) for i in run]))
    last = [(inp, end) for inp, end in zip(ok, ends, strict=True) if not inp.more_input]
    final = [inp for inp, _ in last]
    histories = [_history(rt, i, rt.partial.whole_ids(i)) for i in final]
    grammars = [_grammar(rt, i, rt.partial.whole_ids(i)) for i in final]
    feats = rt.select_feature(outputs, feature)
    out = StepOutput(features=pre.whole_rows(ok, feats, pre.cached_features(key)))
    out.mm_input_embeds = pre.whole_rows(
        ok, outputs.mm_input_embeds, lambda inp, m: _embed_cached(rt, inp, m)
    )
    hidden = outputs.hidden[[e - 1 for _, e in last]]
    first = _sample_first(rt, final, hidden, histories, grammars, out)
    entries = rt.partial.prompt_logprobs(rt.model, run, outputs.hidden)
    for inp, end in zip(ok, ends, strict=True):  # rows in batch order
        rt.cache.commit(inp.rid, inp.input_start + len(inp.input_ids))
        out.tokens[inp.rid], out.row_counts[inp.rid] = [], len(inp.input_ids)
        whole = rt.partial.advance(inp, outputs.hidden[end - 1 : end], entries.get(inp.rid))
        if whole is not None:
            out.prompt_logprobs[inp.rid] = whole
    for inp, rows in zip(ok, _per_input(out.features, ok), strict=True):
        pre.insert(inp, key, rows)
        if cached := pre.num_cached_tokens(inp.rid) if not inp.input_start else 0:
            out.cached_tokens[inp.rid] = cached
    for inp, tok, history, grammar in zip(final, first, histories, grammars, strict=True):
        req = TargetRequest(inp.params, inp.sample_offset, tok, history, grammar)
        rt.requests[inp.rid] = req
        rt.advance(inp.rid, [tok], out)
        out.row_counts[inp.rid] = len(inp.input_ids)
    return out


def _sample_first(
    rt: TargetRuntime,
    final: list[PrefillInput],
    hidden: torch.Tensor,  # [len(final), hidden]: each input's last row
    histories: list[TokenHistory | None],
    grammars: list[Any],
    out: StepOutput,
) -> list[int]:
    """The first token of each input that ended (within its grammar's mask, if any), with
    its logprobs when asked."""
    if not final:
        return []
    logits = rt.model.compute_logits(hidden)
    logits = mask_logits(logits, row_masks(grammars, logits.shape[-1]))
    params, offsets = [i.params for i in final], [i.sample_offset for i in final]
    first = sample_tokens(logits, params, offsets, histories, rt.kernel_impl).tolist()
    asked = [b for b, p in enumerate(params) if p.logprobs is not None]
    if asked:
        lp = processed_logprobs(logits[asked], [params[b] for b in asked],
                                [histories[b] for b in asked], [offsets[b] for b in asked])  # fmt: skip
        for row, b in enumerate(asked):
            out.logprobs[final[b].rid] = pick_logprobs(
                lp[row : row + 1], [first[b]], params[b].logprobs
            )
    return first


def _embed_cached(rt: TargetRuntime, inp: PrefillInput, match: Match) -> torch.Tensor:
    """A cached prefix's embedding rows (`mm_input_embeds` of a batch with images): the
    merged rows the input came with (image features included), else its ids' embeddings."""
    if inp.input_embeds is not None:
        return inp.input_embeds[: match.num_tokens]
    ids = torch.tensor(inp.input_ids[: match.num_tokens], device=rt.cache.pools[0].k.device)
    return rt.model.embed(ids)


def _history(rt: TargetRuntime, inp: PrefillInput, ids: list[int]) -> TokenHistory | None:
    """What the request's logit processors read: prompt and output so far, from its whole
    input ``ids`` (a replay's ends with its ``sample_offset`` emitted tokens); None when
    they read nothing."""
    if not inp.params.uses_history:
        return None
    cut = len(ids) - inp.sample_offset
    eos = rt.model_config.eos_token_ids
    return TokenHistory.start(ids[:cut], ids[cut:], inp.params, eos)


def _grammar(rt: TargetRuntime, inp: PrefillInput, ids: list[int]) -> Any:
    """A constrained request's matcher after the tokens it emitted (a replay's input ends
    with its ``sample_offset`` emitted tokens); None for an unconstrained one."""
    if inp.params.constraint is None:
        return None
    emitted = ids[len(ids) - inp.sample_offset :] if inp.sample_offset else []
    return rt.grammars.start(inp.params.constraint, emitted)


def _admit(rt: TargetRuntime, inp: PrefillInput, admitted: dict[str, int]) -> PrefillInput:
    """Validate one request (or a later piece of its input, with its sampling state filled
    in) and reserve its row, if its input so far fits in the KV cache beside the requests
    ``admitted`` before it in this batch (ask first, then act)."""
    rt.check_ids(inp.rid, inp.input_ids, what="prompt")
    if inp.input_start:
        inp = rt.partial.resolve(inp, rt.cache)
    inp.params.check_vocab(rt.model_config.vocab_size)
    if inp.params.constraint is not None and not inp.input_start:
        rt.grammars.compiled(inp.params.constraint)  # refused before any KV is reserved
    end, limit = inp.input_start + len(inp.input_ids), rt.cfg.max_context - 1
    if end > limit:
        raise InvalidRequestError(
            f"request {inp.rid!r}: prompt of {end} tokens exceeds the limit of {limit}"
        )
    if not inp.input_start and inp.rid in rt.cache.requests:
        raise DuplicateRequestError(f"request {inp.rid!r} already has KV state")
    if end + 1 > rt.cache.holds_at_most():  # never fits, however long it waits
        raise InvalidRequestError(
            f"request {inp.rid!r}: prompt of {end} tokens needs more KV than the whole cache "
            f"holds ({rt.cache.holds_at_most()} slots)"
        )
    if not rt.cache.can_allocate({**admitted, inp.rid: end + 1}):
        raise KVCacheFullError(
            f"request {inp.rid!r}: prompt of {end} tokens does not fit; "
            f"{rt.cache.num_free_slots} KV slots free"
        )
    if not inp.input_start:
        rt.cache.add(inp.rid)
    return inp


def _per_input(rows: torch.Tensor | None, inputs: list[PrefillInput]) -> list[torch.Tensor | None]:
    """``rows`` (one per input token, inputs in order) cut per input."""
    if rows is None:
        return [None] * len(inputs)
    return list(rows.split([len(i.input_ids) for i in inputs]))
