"""The router's record of a request: the source of truth the model services can be rebuilt from.

``emit`` is the only way tokens reach the client. It applies every stop rule token by token, so
tokens after an EOS / stop token, a completed stop string or ``max_new_tokens`` are never emitted,
even when they arrive inside one accepted speculative run.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from specmesh.router.detokenizer import Detokenizer
from specmesh.runtime.sampling import SamplingParams


class Phase(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Chunk:
    """What one emission adds for the client."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams  # seed always resolved, so a replay samples identically
    eos_token_ids: tuple[int, ...] = ()
    speculate: bool = True
    images: list[bytes] = field(default_factory=list)
    detok: Detokenizer | None = None
    phase: Phase = Phase.WAITING
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    accept_lens: list[int] = field(default_factory=list)
    # Placement, owned by the router core: pinned replicas, the next tree, failovers so far.
    target: Any = None
    draft: Any = None
    tree: Any = None
    replays: int = 0
    worker: int | None = None  # the micro-batch worker running it
    arrival_s: float = field(default_factory=time.monotonic)
    first_token_s: float | None = None
    finish_s: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_generated(self) -> int:
        return len(self.output_ids)

    @property
    def mean_accept_len(self) -> float:
        return sum(self.accept_lens) / len(self.accept_lens) if self.accept_lens else 0.0

    def emit(self, tokens: list[int], *, accepted_round: bool = False) -> Chunk:
        """Append the tokens a step produced, stopping at the first stop condition."""
        if accepted_round:
            self.accept_lens.append(len(tokens))
        if self.first_token_s is None:
            self.first_token_s = time.monotonic()
        stop_ids = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        new_ids: list[int] = []
        new_text = ""
        for tok in tokens:
            if self.finished:
                break
            self.output_ids.append(tok)
            new_ids.append(tok)
            piece = self.detok.add(tok) if self.detok else ""
            hit = self._stop_string_cut(self.text + new_text + piece)
            if hit is not None:
                new_text = hit[len(self.text) :]
                self._finish("stop")
            else:
                new_text += piece
                if tok in stop_ids:
                    self._finish("stop")
                elif self.num_generated >= self.params.max_new_tokens:
                    self._finish("length")
        if self.finished and self.detok and self.finish_reason != "stop":
            new_text += self.detok.flush()
        self.text += new_text
        return Chunk(new_ids, new_text, self.finish_reason)

    def _stop_string_cut(self, text: str) -> str | None:
        """The text up to the earliest stop string, if one now occurs."""
        cuts = [i for s in self.params.stop if (i := text.find(s)) >= 0]
        return text[: min(cuts)] if cuts else None

    def abort(self) -> Chunk:
        self._finish("abort")
        return Chunk([], "", "abort")

    def _finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.phase = Phase.FINISHED
        self.finish_s = time.monotonic()

    def context_ids(self) -> list[int]:
        """Prompt plus every emitted token: what a replica prefills to rebuild this request (its
        first sampled token is then the next token to emit, at offset ``num_generated``)."""
        return self.prompt_ids + self.output_ids
