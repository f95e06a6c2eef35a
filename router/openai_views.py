"""The OpenAI response objects built from a request's chunks: `Choice` accumulates one (prompt,
n) choice; `CompletionView` and `ChatView` turn choices and chunks into ``text_completion`` and
``chat.completion`` objects (whole, or as streamed chunks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specmesh.protocol.steps import Logprob
from specmesh.router.openai_schema import chat_logprobs, completion_logprobs, usage
from specmesh.router.request import Chunk, Request

if TYPE_CHECKING:
    from specmesh.router.openai_api import OpenAIService


@dataclass
class Choice:
    """One (prompt, n) choice: its request and what it produced so far."""

    index: int
    req: Request
    echo: str = ""  # the prompt's text, returned before the completion (``echo``)
    text: str = ""
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    finish_reason: str | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.logprobs += chunk.logprobs or []
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.finish_reason = chunk.finish_reason or self.finish_reason


class CompletionView:
    """``text_completion`` objects from choices and chunks."""

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

    def logprobs(self, c: Choice, ids: list[int], lps: list[Logprob], offset: int) -> dict | None:
        if not self.want_logprobs:
            return None
        pairs = list(zip(ids, lps, strict=False))
        if c.echo and offset == 0 and c.prompt_logprobs is not None:
            pairs = list(zip(c.req.prompt_ids, c.prompt_logprobs, strict=False)) + pairs
        return completion_logprobs(self.api.entries(pairs), offset)

    def response(self, choices: list[Choice]) -> dict:
        out = [
            {
                "index": c.index, "text": c.echo + c.text,
                "logprobs": self.logprobs(c, c.req.output_ids, c.logprobs, 0),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]  # fmt: skip
        return {**self.header(""), "choices": out, "usage": self.usage(choices)}

    def first_chunk(self, c: Choice) -> dict | None:
        if not c.echo:
            return None
        choice = {"index": c.index, "text": c.echo, "logprobs": None, "finish_reason": None}
        return {**self.header(""), "choices": [choice]}

    def chunk(self, c: Choice, chunk: Chunk) -> dict:
        lps = self.logprobs(
            c, chunk.token_ids, chunk.logprobs or [], len(c.echo) + len(c.text) - len(chunk.text)
        )
        choice = {
            "index": c.index,
            "text": chunk.text,
            "logprobs": lps,
            "finish_reason": chunk.finish_reason,
        }
        return {**self.header(""), "choices": [choice]}


class ChatView:
    """``chat.completion`` / ``chat.completion.chunk`` objects from choices and chunks."""

    def __init__(self, api: OpenAIService, rid: str, logprobs: bool) -> None:
        self.api, self.rid, self.want_logprobs = api, rid, logprobs
        self.model, self.created = api.model, int(time.time())

    def header(self, kind: str) -> dict:
        obj = "chat.completion.chunk" if kind == "chunk" else "chat.completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.model}

    def usage(self, choices: list[Choice]) -> dict:
        return usage_of(choices)

    def logprobs(self, ids: list[int], lps: list[Logprob]) -> dict | None:
        if not self.want_logprobs:
            return None
        return chat_logprobs(self.api.entries(list(zip(ids, lps, strict=False))))

    def response(self, choices: list[Choice]) -> dict:
        out = [
            {
                "index": c.index, "message": {"role": "assistant", "content": c.text},
                "logprobs": self.logprobs(c.req.output_ids, c.logprobs),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ]  # fmt: skip
        return {**self.header(""), "choices": out, "usage": self.usage(choices)}

    def first_chunk(self, c: Choice) -> dict:
        delta = {"role": "assistant", "content": ""}
        choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": None}
        return {**self.header("chunk"), "choices": [choice]}

    def chunk(self, c: Choice, chunk: Chunk) -> dict:
        delta = {"content": chunk.text} if chunk.text or not chunk.finish_reason else {}
        choice = {
            "index": c.index, "delta": delta,
            "logprobs": self.logprobs(chunk.token_ids, chunk.logprobs or []),
            "finish_reason": chunk.finish_reason,
        }  # fmt: skip
        return {**self.header("chunk"), "choices": [choice]}


def usage_of(choices: list[Choice]) -> dict:
    prompts = {c.index: len(c.req.prompt_ids) for c in choices}  # every choice counts its prompt
    return usage(sum(prompts.values()), sum(c.req.num_generated for c in choices))
