"""Prefill in pieces: a long input reaches the target over several prefill steps, so that the
router can run the other requests' verify steps between them (chunked prefill).

A piece says where its ids start in the request's whole input (``PrefillInput.input_start``) and
whether more pieces follow (``more_input``). The first piece creates the request with its
sampling parameters and sample offset; every piece extends the KV cache over its ids and returns
their feature rows; only the last one samples, from the same rows a one-shot prefill of the
whole input would have. Between pieces the target keeps a `PartialPrefill`; the KV cache's
committed length (its one owner) is where the next piece must start.

Prompt logprobs: row t of the input predicts token t + 1, so a piece's first token is predicted
by the previous piece's last row. That row waits in the record with its token, the entries
gather there, and the last piece returns them all, cut to the prompt as a one-shot prefill cuts
them (the ``sample_offset`` emitted tokens at the end of a replay's input are no prompt).

A prompt with images is prefilled in one piece: the image placeholders expand to the vision
tower's rows when the target merges the images, which needs the whole prompt at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from specmesh.protocol.errors import InvalidRequestError, SpecmeshError, UnknownRequestError
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import Logprob, PrefillInput, StepOutput
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.models.causal_lm import CausalLM
from specmesh.target_service.batching import prompt_logprobs


@dataclass
class PartialPrefill:
    """What the target keeps for a request between two pieces of its input."""

    params: SamplingParams  # from the first piece
    sample_offset: int  # from the first piece
    ids: list[int] | None  # the input so far, kept only when processors or a grammar read it
    prompt_logprobs: list[Logprob] = field(default_factory=list)  # gathered so far, when asked
    # The last piece's last (token id, hidden row [1, hidden]), when prompt logprobs are asked.
    last_row: tuple[int, torch.Tensor] | None = None


class PartialPrefills:
    """The requests whose input is still arriving, by id."""

    def __init__(self) -> None:
        self.held: dict[str, PartialPrefill] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self.held

    def __len__(self) -> int:
        return len(self.held)

    def pop(self, rid: str) -> None:
        self.held.pop(rid, None)

    # -- before the forward ----------------------------------------------------------------------
    @staticmethod
    def refuse_pieced_images(inputs: list[PrefillInput]) -> dict[str, SpecmeshError]:
        """Pieces that carry images, refused before any image is decoded."""
        return {
            i.rid: InvalidRequestError(
                f"request {i.rid!r}: a prompt with images is prefilled in one piece"
            )
            for i in inputs
            if i.images and (i.input_start or i.more_input)
        }

    def resolve(self, inp: PrefillInput, cache: KVCache) -> PrefillInput:
        """A later piece with its request's sampling state (the first piece's) filled in; a
        piece that does not start where the request's KV ends is refused."""
        rec = self.held.get(inp.rid)
        if rec is None:
            raise UnknownRequestError(
                f"request {inp.rid!r}: no prefill in progress for a piece at token {inp.input_start}"
            )
        held = cache.get(inp.rid).committed_len
        if inp.input_start != held:
            raise InvalidRequestError(
                f"request {inp.rid!r}: piece starts at token {inp.input_start}, the target holds "
                f"{held} tokens of its input"
            )
        return replace(inp, params=rec.params, sample_offset=rec.sample_offset)

    def whole_ids(self, inp: PrefillInput) -> list[int]:
        """The input so far, this piece included, for a request whose processors read it."""
        rec = self.held.get(inp.rid) if inp.input_start else None
        if rec is None or rec.ids is None:
            return inp.input_ids
        return [*rec.ids, *inp.input_ids]

    def prompt_logprobs(
        self, model: CausalLM, ok: list[PrefillInput], hidden: torch.Tensor
    ) -> dict[str, list[Logprob]]:
        """Entries of each asking piece: one per token of the piece a row predicts (every token
        but an input's first). ``hidden`` holds the rows of every piece of ``ok``, in order."""
        entries, start = {}, 0
        for inp in ok:
            rows, start = hidden[start : start + len(inp.input_ids)], start + len(inp.input_ids)
            if inp.params.prompt_logprobs is None:
                continue
            ids, prev = inp.input_ids, self.held[inp.rid].last_row if inp.input_start else None
            if prev is not None:  # the previous piece's last row predicts this piece's first id
                ids, rows = [prev[0], *ids], torch.cat([prev[1], rows])
            whole = replace(inp, input_ids=ids, sample_offset=0, input_start=0)
            out = StepOutput()
            prompt_logprobs(model, [whole], rows, out)
            entries[inp.rid] = out.prompt_logprobs.get(inp.rid, [])
        return entries

    # -- after the forward -----------------------------------------------------------------------
    def advance(
        self, inp: PrefillInput, last_row: torch.Tensor, entries: list[Logprob] | None
    ) -> list[Logprob] | None:
        """Record a piece that ran (``last_row``: its last hidden row ``[1, hidden]``). Before
        the last piece the record keeps what the next piece needs; the last piece drops it and
        returns the prompt logprobs of the whole prompt (None when not asked or empty)."""
        rec = self.held.pop(inp.rid, None) if inp.input_start else None
        if rec is None:
            reads_ids = inp.params.uses_history or inp.params.constraint is not None
            keep_ids = [] if reads_ids else None
            rec = PartialPrefill(inp.params, inp.sample_offset, keep_ids)
        rec.prompt_logprobs += entries or []
        if inp.more_input:
            if rec.ids is not None:
                rec.ids += inp.input_ids
            if inp.params.prompt_logprobs is not None:
                rec.last_row = (inp.input_ids[-1], last_row.clone())
            self.held[inp.rid] = rec
            return None
        prompt_len = inp.input_start + len(inp.input_ids) - inp.sample_offset
        return rec.prompt_logprobs[: max(prompt_len - 1, 0)] or None
