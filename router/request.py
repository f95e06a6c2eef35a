"""The router's record of a request: the source of truth the model services can be rebuilt from.

``emit`` is the only way tokens reach the client. It applies every stop rule token by token, so
tokens after an EOS / stop token, a completed stop string or ``max_new_tokens`` are never emitted,
even when they arrive inside one accepted speculative run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specmesh.protocol.sampling import SamplingParams
from specmesh.router.detokenizer import Detokenizer

if TYPE_CHECKING:
    from specmesh.protocol.steps import Logprob
    from specmesh.router.plan_reason import PlanReason


@dataclass
class Chunk:
    """What one emission adds for the client."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    logprobs: list[Logprob] | None = None  # one per token_ids entry, when asked for
    # With the first chunk, when asked for: one per prompt token (None for the first).
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass
class Request:
    """What the client asked for and what it was sent. Where and how far the request runs is
    the scheduler's (`specmesh.router.slot.Slot`)."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams  # seed always resolved, so a replay samples identically
    eos_token_ids: tuple[int, ...] = ()
    speculate: bool = True  # asked for; the scheduler may turn it off (`Slot.speculate`)
    learn: bool = True  # False: kept out of the draft's online learning (client's choice)
    images: list[bytes] = field(default_factory=list)
    detok: Detokenizer | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""  # streamed so far
    _full_text: str = ""  # decoded so far, incl. text held back for stop strings
    finish_reason: str | None = None
    accept_lens: list[int] = field(default_factory=list)
    # Draft tree nodes each verify round checked, roots excluded (0: a plain round), one per
    # accept_lens entry (the HTTP API's per-request speculative figures, `openai_spec`)
    round_drafts: list[int] = field(default_factory=list)
    num_draft_tokens: int = 0  # draft tree nodes its rounds verified, roots excluded
    last_plain: PlanReason | None = None  # why the adaptive policy last planned it plain
    num_predraft_hits: int = 0  # trees its draft had ready (pre-drafted) when asked
    cached_tokens: int = 0  # prompt tokens the target's prefix cache had (its last prefill)
    draft_wait_s: float = 0.0  # time its rounds waited on the draft for a tree
    # A learning draft's weight versions its trees came from, in the order first used
    draft_weight_versions: list[int] = field(default_factory=list)
    replays: int = 0  # times a failed target sent it back to be replayed elsewhere
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    finish_s: float | None = None

    def note_draft_version(self, version: int | None) -> None:
        """A tree drafted with ``version`` of a learning draft's weights (None: no tree)."""
        if version is not None and version not in self.draft_weight_versions[-1:]:
            self.draft_weight_versions.append(version)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def mean_accept_len(self) -> float:
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else 0.0

    def emit(
        self,
        tokens: list[int],
        *,
        tree_size: int | None = None,
        logprobs: list[Logprob] | None = None,
        prompt_logprobs: list[Logprob | None] | None = None,
    ) -> Chunk:
        """Append the tokens a step produced, stopping at the first stop condition; their
        ``logprobs`` (one per token) are cut at the same place.

        Text is held back by ``len(longest stop string) - 1`` characters until the request
        finishes, so a stop string that spans two steps is never partly streamed.
        """
        if tree_size is not None:  # a verify round: its tree had tree_size nodes, root included
            self.accept_lens.append(len(tokens))
            self.round_drafts.append(tree_size - 1)
            self.num_draft_tokens += tree_size - 1
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()
        stop_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        longest = max((len(s) for s in self.params.stop), default=0)
        new_ids: list[int] = []
        cut = False
        for tok in tokens:
            if self.finished:
                break
            self.output_ids.append(tok)
            new_ids.append(tok)
            searched = len(self._full_text)
            self._full_text += self.detok.add(tok) if self.detok else ""
            if (idx := self._stop_string_index(searched - longest + 1)) is not None:
                self._full_text, cut = self._full_text[:idx], True
                self._finish("stop")
            elif tok in stop_ids:
                self._finish("stop")
            elif self.num_generated >= self.params.max_new_tokens:
                self._finish("length")
        if self.finished and self.detok and not cut:
            self._full_text += self.detok.flush()
        holdback = 0 if self.finished else max(longest - 1, 0)
        visible = max(len(self.text), len(self._full_text) - holdback)
        new_text = self._full_text[len(self.text) : visible]
        self.text += new_text
        kept = None if logprobs is None else logprobs[: len(new_ids)]
        return Chunk(new_ids, new_text, self.finish_reason, kept, prompt_logprobs)

    def _stop_string_index(self, start: int) -> int | None:
        """Where the earliest stop string starts in the text, if one occurs at or after
        ``start``. The text is searched after every token, so a match not seen before ends in
        the newest text: it starts at most ``len(longest stop string) - 1`` characters before
        it, and searching from there finds exactly what a search of the whole text would."""
        start = max(start, 0)
        hits = [i for s in self.params.stop if (i := self._full_text.find(s, start)) >= 0]
        return min(hits) if hits else None

    def abort(self) -> Chunk:
        self._finish("abort")
        return Chunk([], "", "abort")

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.finish_s = time.monotonic()

    def context_ids(self) -> list[int]:
        """Prompt plus every emitted token: what a replica prefills to rebuild this request (its
        first sampled token is then the next token to emit, at offset ``num_generated``).
        Image placeholders stay unexpanded (one per image): a replay re-sends ``images`` and the
        target expands them again, deterministically (`specmesh.target_service.multimodal`)."""
        return self.prompt_ids + self.output_ids
