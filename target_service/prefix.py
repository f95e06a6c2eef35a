"""The target's prefix cache around its prefill (`runtime.prefix_cache` holds the blocks).

A prompt's first piece looks its prefix up as it is admitted; the request's row starts with the
matched pages and the forward runs only the rest. Its draft still gets a feature row for every
prompt token: the cached rows come from the blocks (each block keeps the features of the kind
the stream asked for when it was filled, EAGLE-3 aux states by their capture points), so a
draft extends over the whole prompt exactly as for a cold request (its own KV, the shifted
pairing, is computed by the draft as always). After a one-shot prefill the prompt's full blocks
join the cache.

A prompt with images is keyed by its images too: each image position's key token is drawn from
a hash of that image's bytes (`image_key_ids`), so a prefix matches only with the same images at
the same places, and the KV of an image's rows is reused like a text token's. Not cached:
requests that ask for prompt logprobs (they need every row's logits). A chunked prompt is looked
up by its first piece only and joins the cache when its request is released, as every
request's whole committed sequence does.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from specmesh.protocol.features import Feature
from specmesh.protocol.prefix_keys import block_key
from specmesh.protocol.steps import PrefillInput
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.prefix_cache import Match, PrefixCache


@dataclass
class _Committed:
    """A running request's committed tokens and their feature rows (of kind ``key``), so that
    its whole sequence, answer included, joins the cache when it is released."""

    ids: list[int]
    rows: list[torch.Tensor] | None
    key: str | None


class TargetPrefixes:
    def __init__(
        self,
        cache: KVCache,
        block_size: int,
        max_tokens: int,
        images: tuple[int, int] | None = None,
    ) -> None:
        """``images``: a multimodal target's (image_token_id, tokens_per_image)."""
        self.blocks = PrefixCache(cache, block_size, max_tokens) if max_tokens > 0 else None
        self.images = images
        self.matched: dict[str, Match] = {}  # requests whose row starts with cached pages
        self.committed: dict[str, _Committed] = {}

    def cacheable(self, inp: PrefillInput) -> bool:
        return inp.params.prompt_logprobs is None and (not inp.images or self.images is not None)

    def key_ids(self, inp: PrefillInput) -> list[int]:
        """The ids the cache keys ``inp``'s rows by: its input ids, image positions keyed by
        their images (`image_key_ids`)."""
        if not inp.images or self.images is None:
            return inp.input_ids
        return image_key_ids(inp.input_ids, inp.images, inp.sample_offset, *self.images)

    def attach(self, inp: PrefillInput, key: str | None) -> None:
        """A first piece just admitted (its row added, empty): start it with its cached
        prefix (at most all but the piece's last token)."""
        if self.blocks is None or inp.input_start or not self.cacheable(inp):
            return
        match = self.blocks.match(self.key_ids(inp), key)
        if match.num_tokens:
            self.blocks.attach(inp.rid, match)
            self.matched[inp.rid] = match

    def to_run(self, ok: list[PrefillInput]) -> list[PrefillInput]:
        """The inputs as the forward runs them: past their cached tokens."""
        return [self._rest(i) for i in ok]

    def _rest(self, inp: PrefillInput) -> PrefillInput:
        match = self.matched.get(inp.rid) if not inp.input_start else None
        if match is None:
            return inp
        n = match.num_tokens
        embeds = None if inp.input_embeds is None else inp.input_embeds[n:]
        return replace(inp, input_ids=inp.input_ids[n:], input_start=n, input_embeds=embeds)

    def whole_rows(
        self,
        ok: list[PrefillInput],
        rows: torch.Tensor | None,
        cached: Callable[[PrefillInput, Match], torch.Tensor],
    ) -> torch.Tensor | None:
        """``rows`` (of the inputs as run) with each cached prefix's rows (``cached(inp,
        match)``) in front: one row per input token, as a cold prefill returns them."""
        if rows is None or not any(i.rid in self.matched and not i.input_start for i in ok):
            return rows
        parts, start = [], 0
        for inp, run in zip(ok, self.to_run(ok), strict=True):
            match = self.matched.get(inp.rid) if not inp.input_start else None
            if match is not None:
                parts.append(cached(inp, match).to(rows.device, rows.dtype))
            parts.append(rows[start : start + len(run.input_ids)])
            start += len(run.input_ids)
        return torch.cat(parts)

    def cached_features(self, key: str | None) -> Callable[[PrefillInput, Match], torch.Tensor]:
        """A matched prefix's feature rows of kind ``key`` (a match needing features has them:
        `PrefixCache.match`)."""

        def rows(_inp: PrefillInput, match: Match) -> torch.Tensor:
            if self.blocks is None or key is None:
                raise RuntimeError("feature rows asked of a prefill that computes none")
            return self.blocks.features(match, key)

        return rows

    def insert(self, inp: PrefillInput, key: str | None, rows: torch.Tensor | None) -> None:
        """After a prefill (piece) committed (``rows``: its feature rows, one per input token):
        a one-shot prompt's full blocks join the cache now; every prompt's are recorded, with
        the answer's, to join when the request is released (a chunked prompt's then)."""
        if self.blocks is None or not self.cacheable(inp):
            return
        if inp.input_start:  # a later piece of a chunked prompt
            self.extend(inp.rid, list(inp.input_ids), rows, key)
            return
        ids = self.key_ids(inp)
        if not inp.more_input:
            self.blocks.insert(inp.rid, ids, key, rows)
        kept = None if rows is None else [rows.clone()]
        self.committed[inp.rid] = _Committed(list(ids), kept, key)

    def extend(self, rid: str, ids: list[int], rows: torch.Tensor | None, key: str | None) -> None:
        """A step committed ``ids`` (the tree's root and accepted nodes) for ``rid``."""
        rec = self.committed.get(rid)
        if rec is None:
            return
        rec.ids += ids
        if rec.rows is not None and rows is not None and key == rec.key:
            rec.rows.append(rows.clone())
        else:  # the stream's feature changed: the answer's blocks keep no rows
            rec.rows, rec.key = None, None

    def split_followers(
        self, inputs: list[PrefillInput]
    ) -> tuple[list[PrefillInput], list[PrefillInput]]:
        """(leaders, followers): a follower is a whole prompt whose first block an earlier
        prompt of the batch also starts with and the cache does not hold yet; it runs after
        its leader filled the cache, so a shared prefix is computed once per batch."""
        if self.blocks is None:
            return inputs, []
        size, seen = self.blocks.block_size, set()
        leaders, followers = [], []
        for inp in inputs:
            one_shot = not inp.input_start and not inp.more_input and self.cacheable(inp)
            ids = self.key_ids(inp) if one_shot else inp.input_ids
            first = block_key(None, ids[:size]) if len(ids) > size else None
            if one_shot and first in seen and first not in self.blocks.blocks:
                followers.append(inp)
                continue
            leaders.append(inp)
            if one_shot and first is not None:
                seen.add(first)
        return leaders, followers

    def retire(self, rid: str) -> None:
        """Before the request's KV goes: its committed sequence's full blocks (prompt and
        answer: a chat's next turn resends both) join the cache. Its references go with its
        row (`KVCache.release`)."""
        self.matched.pop(rid, None)
        rec = self.committed.pop(rid, None)
        if self.blocks is not None and rec is not None and rid in self.blocks.cache.requests:
            rows = None if rec.rows is None else torch.cat(rec.rows)
            self.blocks.insert(rid, rec.ids, rec.key, rows)

    @property
    def num_tokens(self) -> int:
        return 0 if self.blocks is None else self.blocks.num_tokens

    @property
    def num_evictable_slots(self) -> int:
        return 0 if self.blocks is None else self.blocks.num_evictable_slots

    def num_cached_tokens(self, rid: str) -> int:
        match = self.matched.get(rid)
        return 0 if match is None else match.num_tokens


def image_key_ids(
    ids: list[int],
    images: list[bytes],
    sample_offset: int,
    image_token_id: int,
    tokens_per_image: int,
) -> list[int]:
    """``ids`` (expanded: ``tokens_per_image`` placeholders per image, in image order) with
    each image position's id replaced by a key token: 31 bits of a hash stream of that image's
    bytes, one draw per position, with the top bit set so no key token is a vocabulary id. Two
    images share a block's keys only if every one of its image positions' draws collides.
    Emitted tokens (the last ``sample_offset``) are text even if one equals the placeholder."""
    draws = [
        hashlib.shake_128(data).digest(4 * tokens_per_image) for data in images
    ]  # fmt: skip
    keys, seen = list(ids), 0
    for pos in range(len(ids) - sample_offset):
        if ids[pos] != image_token_id:
            continue
        image, j = divmod(seen, tokens_per_image)
        if image >= len(draws):
            break
        draw = int.from_bytes(draws[image][4 * j : 4 * j + 4], "little")
        keys[pos] = 0x80000000 | (draw & 0x7FFFFFFF)
        seen += 1
    return keys


def feature_key(feature: Feature, aux_points: tuple[int, ...]) -> str | None:
    """What a block's feature rows are: the feature kind, and for aux states their layers."""
    if feature is Feature.NONE:
        return None
    return f"{feature.value}:{','.join(map(str, aux_points))}" if aux_points else feature.value
