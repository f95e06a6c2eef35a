"""The OpenAI-compatible HTTP API's endpoint logic (`OpenAIService`), served by uvicorn on the
router's own event loop (`specmesh.router.openai_server`; responses in `openai_views`, streaming
plumbing in `openai_stream`).

    POST /v1/completions, /v1/chat/completions    one `Request` per (prompt, n) choice, built by
                                                 `GenerationServicer._make_request` (the gRPC
                                                 path's limits, tokenizer threads and checks)
    GET  /v1/models, /metrics                    the served model; the router's Prometheus registry
    GET  /health                                 200 once every service answered (no API key)

A choice's chunks come from ``RouterCore.generate``; several choices are merged as they arrive.
Closing the merged stream (the client went away, a streaming response was cancelled, a
non-streaming one saw the disconnect) closes every ``generate`` iterator, which aborts each
request and frees its state in the target and the draft. Errors are OpenAI's error object with
the HTTP status of `openai_schema.HTTP_STATUS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import Logprob
from specmesh.router.chat import ChatRenderer, read_template
from specmesh.router.openai_schema import (
    ChatBody,
    CompletionBody,
    OpenAIError,
    SamplingBody,
    TokenEntry,
    as_openai_error,
)
from specmesh.router.openai_stream import (
    merge,
    read_body,
    sse_event,
    sse_response,
    unless_disconnected,
)
from specmesh.router.openai_views import ChatView, Choice, CompletionView
from specmesh.rpc.security import model_name
from specmesh.v1 import generation_pb2

log = logging.getLogger(__name__)


class OpenAIService:
    """The endpoints' logic over the gRPC servicer's core, tokenizer and request building."""

    def __init__(self, servicer, settings) -> None:
        self.servicer, self.settings, self.host = servicer, settings, servicer.host
        self.template = read_template(settings.chat_template) if settings.chat_template else None
        self._chat: ChatRenderer | None = None
        limits = settings.limits  # JSON escapes, chat framing, base64 images (4/3)
        self.max_body_bytes = (
            6 * limits.max_prompt_bytes
            + limits.max_images_per_request * (limits.max_image_bytes * 4 // 3 + 64)
            + (64 << 10)
        )

    # -- shared steps --------------------------------------------------------------------------
    @property
    def core(self):
        if self.servicer.core is None:
            raise OpenAIError(
                503, "the router is still connecting to its services", code="unavailable"
            )
        return self.servicer.core

    @property
    def model(self) -> str:
        return model_name(self.core.targets[0].info_pb.model_path)

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise OpenAIError(
                404, f"the model {name!r} does not exist; this router serves {self.model!r}",
                param="model", code="model_not_found",
            )  # fmt: skip

    @contextlib.asynccontextmanager
    async def work(self) -> AsyncIterator[None]:
        """Counted as in-flight work, so a draining router waits for it (`ServiceHost.work`)."""
        if self.host.draining:
            raise OpenAIError(503, "the router is shutting down", code="unavailable")
        async with self.host.work(None):  # not draining: the context is never used
            yield

    def sampling(
        self, body: SamplingBody, max_tokens: int | None, logprobs: int | None,
        prompt_logprobs: int | None, seed: int | None,
    ) -> SamplingParams:  # fmt: skip
        if not body.skip_special_tokens:
            raise OpenAIError(
                400, "only skip_special_tokens=true is supported", param="skip_special_tokens"
            )
        try:
            bias = tuple((int(t), float(b)) for t, b in (body.logit_bias or {}).items())
        except ValueError:
            raise OpenAIError(
                400, "logit_bias keys must be token ids", param="logit_bias"
            ) from None
        vocab = self.core.info.vocab_size
        if any(not 0 <= t < vocab or not -100 <= b <= 100 for t, b in bias):
            raise OpenAIError(
                400, f"logit_bias needs token ids in [0, {vocab}) and biases in [-100, 100]",
                param="logit_bias",
            )  # fmt: skip
        return SamplingParams(
            max_new_tokens=self.settings.max_new_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p, top_k=max(body.top_k, 0), seed=seed, stop=tuple(body.stop_list),
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos,
            min_p=body.min_p, repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
            logit_bias=bias, min_tokens=body.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )  # fmt: skip

    async def make_choices(
        self, rid: str, prompts: list[str | list[int]], n: int, params: SamplingParams,
        max_tokens: int | None, images: list[bytes] = (), echo: bool = False,
    ) -> list[Choice]:  # fmt: skip
        """One request per (prompt, n): seeds ``seed + j`` (or fresh ones), the limits checked
        by `_make_request` on a `GenerateRequest` holding the sizes it reads."""
        choices = []
        for i, prompt in enumerate(prompts):
            text, ids = (prompt, []) if isinstance(prompt, str) else ("", prompt)
            for j in range(n):
                index = i * n + j
                seed = None if params.seed is None else params.seed + j
                msg = generation_pb2.GenerateRequest(
                    request_id=f"{rid}-{index}", prompt=text, prompt_token_ids=ids,
                    sampling=generation_pb2.SamplingParams(
                        max_new_tokens=max_tokens or 0, stop=params.stop,
                        stop_token_ids=params.stop_token_ids,
                    ),
                    images=images,
                )  # fmt: skip
                req = await self.servicer._make_request(self.core, msg, replace(params, seed=seed))
                shown = (text or self.decode(ids)) if echo else ""
                choices.append(Choice(index, req, shown))
        return choices

    def decode(self, ids: list[int]) -> str:
        tok = self.servicer.tokenizer
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else ""

    def token_text(self, token_id: int) -> str:
        tok = self.servicer.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    def entries(self, pairs: list[tuple[int, Logprob | None]]) -> list[TokenEntry]:
        return [
            (
                self.token_text(tid),
                lp.logprob if lp is not None else None,
                [(self.token_text(t), v) for t, v in lp.top] if lp is not None else [],
            )
            for tid, lp in pairs
        ]

    @property
    def chat(self) -> ChatRenderer:
        if self.servicer.tokenizer is None:
            raise OpenAIError(
                400, "the router has no tokenizer (--tokenizer): use /v1/completions with token ids"
            )
        if self._chat is None:
            self._chat = ChatRenderer(self.servicer.tokenizer, self.template)
        return self._chat

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, http: HttpRequest) -> Response:
        body = await read_body(http, CompletionBody, self.max_body_bytes)
        async with self.work():
            self.check_model(body.model)
            if body.suffix:
                raise OpenAIError(400, "suffix is not supported", param="suffix")
            if body.best_of not in (None, body.n):
                raise OpenAIError(400, "best_of must equal n", param="best_of")
            prompts = _prompt_list(body.prompt)
            lp = body.logprobs
            params = self.sampling(body, body.max_tokens, lp, lp if body.echo else None, body.seed)
            rid = f"cmpl-{uuid.uuid4().hex}"
            choices = await self.make_choices(
                rid, prompts, body.n, params, body.max_tokens, echo=body.echo
            )
            view = CompletionView(self, rid, body.logprobs is not None)
            if body.stream:
                return sse_response(self.stream(choices, view, body.include_usage))
            await unless_disconnected(http, self.run(choices))
            return JSONResponse(view.response(choices))

    async def chat_completions(self, http: HttpRequest) -> Response:
        body = await read_body(http, ChatBody, self.max_body_bytes)
        async with self.work():
            self.check_model(body.model)
            if body.tools:
                raise OpenAIError(400, "tools are not supported", param="tools")
            if body.chat_template is not None:
                raise OpenAIError(
                    400,
                    "chat_template is set by the router (--chat-template)",
                    param="chat_template",
                )
            messages, images = self.chat.flatten(body.messages)
            prompt = await asyncio.to_thread(self.chat.render, messages)
            lp = (body.top_logprobs or 0) if body.logprobs else None
            params = self.sampling(body, body.max_new_tokens, lp, None, body.seed)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            choices = await self.make_choices(
                rid, [prompt], body.n, params, body.max_new_tokens, images
            )
            view = ChatView(self, rid, body.logprobs)
            if body.stream:
                return sse_response(self.stream(choices, view, body.include_usage))
            await unless_disconnected(http, self.run(choices))
            return JSONResponse(view.response(choices))

    async def run(self, choices: list[Choice]) -> None:
        async for i, chunk in merge([self.core.generate(c.req) for c in choices]):
            choices[i].add(chunk)

    async def stream(self, choices: list[Choice], view, include_usage: bool) -> AsyncIterator[str]:
        """SSE events: the choices' chunks as they come, the usage chunk if asked, [DONE]. An
        error after the headers went out is sent as an error event."""
        try:
            async with self.work():
                for c in choices:
                    if first := view.first_chunk(c):
                        yield sse_event(first, include_usage)
                async for i, chunk in merge([self.core.generate(c.req) for c in choices]):
                    choices[i].add(chunk)
                    yield sse_event(view.chunk(choices[i], chunk), include_usage)
            if include_usage:
                yield sse_event(
                    {**view.header("chunk"), "choices": [], "usage": view.usage(choices)}, True
                )
        except Exception as e:  # the status line is gone: report it in the stream
            error = as_openai_error(e)
            if error.status >= 500:
                log.error("streamed request failed", exc_info=e)
            yield f"data: {json.dumps(error.body())}\n\n"
        yield "data: [DONE]\n\n"

    def models(self) -> dict:
        core = self.core
        card = {
            "id": self.model, "object": "model", "created": int(time.time()),
            "owned_by": "specmesh", "max_model_len": core.targets[0].info_pb.max_context_len,
        }  # fmt: skip
        return {"object": "list", "data": [card]}


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [p if isinstance(p, str) else list(p) for p in prompt]
