"""The OpenAI response objects built from a request's chunks: `Choice` accumulates one (prompt,
n) choice; `CompletionView` and `ChatView` turn choices and chunks into ``text_completion`` and
``chat.completion`` objects (whole, or as streamed chunks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specmesh.protocol.steps import Logprob
from specmesh.router.openai_schema import (
    TokenEntry,
    chat_logprobs,
    completion_logprobs,
    usage,
)
from specmesh.router.request import Chunk, Request

if TYPE_CHECKING:
    from specmesh.router.openai_api import OpenAIService
    from specmesh.router.tools import ToolPlan


Pairs = list[tuple[int, "Logprob | None"]]  # (token id, its logprob)


@dataclass
class Choice:
    """One (prompt, n) choice: its request and what it produced so far."""

    index: int  # prompt_index * n + j
    prompt_index: int
    req: Request
    echo: str | None = None  # ``echo``: the prompt's text, returned before the completion
    score_only: bool = False  # ``echo`` with ``max_tokens: 0``: its one token is never shown
    text: str = ""
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    finish_reason: str | None = None
    echoed: bool = False  # streaming: the echo went out (with the first chunk, as vLLM)
    width: int = 0  # streaming: the widths of the completion tokens sent (their text_offset)

    def add(self, chunk: Chunk) -> None:
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        reason = chunk.finish_reason or self.finish_reason
        if self.score_only:  # it asked for no tokens: it ends by length
            self.finish_reason = "length" if reason in ("stop", "length") else reason
            return
        self.finish_reason = reason
        self.text += chunk.text
        self.logprobs += chunk.logprobs or []

    @property
    def output_ids(self) -> list[int]:
        return [] if self.score_only else self.req.output_ids

    @property
    def num_generated(self) -> int:
        return 0 if self.score_only else self.req.num_generated

    def prompt_pairs(self) -> Pairs:
        if self.echo is None or self.prompt_logprobs is None:
            return []
        return list(zip(self.req.prompt_ids, self.prompt_logprobs, strict=False))


class CompletionView:
    """``text_completion`` objects from choices and chunks. With ``echo``, the prompt's text and
    logprobs come first (offsets from 0); the completion's offsets start where its text does
    and grow by each token's width (`TokenEntry.width`), streamed or not."""

    def __init__(self, api: OpenAIService, rid: str, logprobs: bool) -> None:
        self.api, self.rid, self.want_logprobs = api, rid, logprobs
        self.model, self.created = api.model, int(time.time())

    def header(self, _kind: str) -> dict:
        return {
            "id": self.rid,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
        }

    def usage(self, choices: list[Choice]) -> dict:
        return usage_of(choices)

    def entries(self, pairs: Pairs) -> list[TokenEntry]:
        return self.api.entries(pairs) if self.want_logprobs else []

    def logprobs(self, segments: list[tuple[list[TokenEntry], int]]) -> dict | None:
        """OpenAI's shape for consecutive runs of tokens, each run's offsets from its start."""
        if not self.want_logprobs:
            return None
        runs = [completion_logprobs(entries, start) for entries, start in segments]
        return {key: [x for run in runs for x in run[key]] for key in runs[0]}

    def response(self, choices: list[Choice]) -> dict:
        out = []
        for c in choices:
            echo = c.echo or ""
            output = self.entries(list(zip(c.output_ids, c.logprobs, strict=False)))
            prompt = self.entries(c.prompt_pairs())
            out.append({
                "index": c.index, "text": echo + c.text,
                "logprobs": self.logprobs([(prompt, 0), (output, len(echo))]),
                "finish_reason": c.finish_reason,
            })  # fmt: skip
        return {**self.header(""), "choices": out, "usage": self.usage(choices)}

    def first_chunk(self, _c: Choice) -> None:
        return None  # the echo goes with the first chunk, which brings the prompt's logprobs

    def chunk(self, c: Choice, chunk: Chunk) -> dict:
        """The chunk's text and logprobs, offsets continuing the choice's (so the chunks join
        into the whole response); the echo and the prompt's logprobs first."""
        text, pairs = ("", []) if c.score_only else (chunk.text, chunk.token_ids)
        entries = self.entries(list(zip(pairs, chunk.logprobs or [], strict=False)))
        segments = [(entries, len(c.echo or "") + c.width)]
        c.width += sum(e.width for e in entries)
        if c.echo is not None and not c.echoed:
            c.echoed = True
            text, segments = c.echo + text, [(self.entries(c.prompt_pairs()), 0), *segments]
        choice = {
            "index": c.index,
            "text": text,
            "logprobs": self.logprobs(segments),
            "finish_reason": c.finish_reason if chunk.finish_reason else None,
        }
        return {**self.header(""), "choices": [choice]}


class ChatView:
    """``chat.completion`` / ``chat.completion.chunk`` objects from choices and chunks. With
    tools in play (`ToolPlan`), a streamed choice's text is held back and sent whole with its
    last chunk: as ``tool_calls`` (the whole call in one delta) or, if it is no call, as
    content."""

    def __init__(
        self, api: OpenAIService, rid: str, logprobs: bool, tools: ToolPlan | None = None
    ) -> None:
        self.api, self.rid, self.want_logprobs = api, rid, logprobs
        self.model, self.created = api.model, int(time.time())
        self.tools = tools if tools is not None and tools.mode != "none" else None

    def header(self, kind: str) -> dict:
        obj = "chat.completion.chunk" if kind == "chunk" else "chat.completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def usage(self, choices: list[Choice]) -> dict:
        return usage_of(choices)

    def logprobs(self, ids: list[int], lps: list[Logprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        return chat_logprobs(self.api.entries(list(zip(ids, lps, strict=False))))

    def message(self, c: Choice) -> tuple[dict, str | None]:
        if self.tools is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        return self.tools.message(c.text, c.finish_reason)

    def response(self, choices: list[Choice]) -> dict:
        out = []
        for c in choices:
            message, finish_reason = self.message(c)
            out.append({
                "index": c.index, "message": message,
                "logprobs": self.logprobs(c.req.output_ids, c.logprobs),
                "finish_reason": finish_reason,
            })  # fmt: skip
        return {**self.header(""), "choices": out, "usage": self.usage(choices)}

    def first_chunk(self, c: Choice) -> dict:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self.header("chunk"), "choices": [choice]}

    def chunk(self, c: Choice, chunk: Chunk) -> dict | None:
        if self.tools is not None:
            return self.tool_chunk(c, chunk)
        delta = {"content": chunk.text} if chunk.text or not chunk.finish_reason else {}
        choice = {
            "index": c.index, "delta": delta,
            "logprobs": self.logprobs(chunk.token_ids, chunk.logprobs or []),
            "finish_reason": chunk.finish_reason,
        }  # fmt: skip
        return {**self.header("chunk"), "choices": [choice]}

    def tool_chunk(self, c: Choice, chunk: Chunk) -> dict | None:
        """None until the choice ends; then its whole message as one delta (tool calls with an
        ``index`` each, as OpenAI streams them)."""
        if not chunk.finish_reason:
            return None
        message, finish_reason = self.message(c)
        delta = {k: v for k, v in message.items() if k != "role" and v is not None}
        for i, call in enumerate(delta.get("tool_calls", [])):
            call["index"] = i
        choice = {
            "index": c.index, "delta": delta,
            "logprobs": self.logprobs(c.req.output_ids, c.logprobs),
            "finish_reason": finish_reason,
        }  # fmt: skip
        return {**self.header("chunk"), "choices": [choice]}


def usage_of(choices: list[Choice]) -> dict:
    """Each prompt's tokens once, whatever ``n`` (as vLLM); every choice's completion tokens."""
    prompts = {c.prompt_index: len(c.req.prompt_ids) for c in choices}
    cached = {c.prompt_index: c.req.cached_tokens for c in choices}
    return usage(sum(prompts.values()), sum(c.num_generated for c in choices),
                 sum(cached.values()))  # fmt: skip
