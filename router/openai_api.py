"""The OpenAI-compatible HTTP API, served by uvicorn on the router's own event loop.

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
import hmac
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace

import pydantic
import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from specmesh.router.chat import ChatRenderer, read_template
from specmesh.router.openai_schema import (
    ChatBody,
    CompletionBody,
    OpenAIError,
    SamplingBody,
    TokenEntry,
    as_openai_error,
    chat_logprobs,
    completion_logprobs,
    usage,
)
from specmesh.router.request import Chunk, Request, TokenLogprob
from specmesh.rpc.security import model_name
from specmesh.runtime.sampling import SamplingParams
from specmesh.v1 import generation_pb2

log = logging.getLogger(__name__)


@dataclass
class Choice:
    """One (prompt, n) choice: its request and what it produced so far."""

    index: int
    req: Request
    echo: str = ""  # the prompt's text, returned before the completion (``echo``)
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: str | None = None

    def add(self, chunk: Chunk) -> None:
        self.text += chunk.text
        self.logprobs += chunk.logprobs or []
        if chunk.prompt_logprobs is not None:
            self.prompt_logprobs = chunk.prompt_logprobs
        self.finish_reason = chunk.finish_reason or self.finish_reason


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

    def entries(self, pairs: list[tuple[int, TokenLogprob | None]]) -> list[TokenEntry]:
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
                return _sse(self.stream(choices, view, body.include_usage))
            await _unless_disconnected(http, self.run(choices))
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
                return _sse(self.stream(choices, view, body.include_usage))
            await _unless_disconnected(http, self.run(choices))
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
                        yield _event(first, include_usage)
                async for i, chunk in merge([self.core.generate(c.req) for c in choices]):
                    choices[i].add(chunk)
                    yield _event(view.chunk(choices[i], chunk), include_usage)
            if include_usage:
                yield _event(
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
        return _usage(choices)

    def logprobs(
        self, c: Choice, ids: list[int], lps: list[TokenLogprob], offset: int
    ) -> dict | None:
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
        return _usage(choices)

    def logprobs(self, ids: list[int], lps: list[TokenLogprob]) -> dict | None:
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


def _usage(choices: list[Choice]) -> dict:
    prompts = {c.index: len(c.req.prompt_ids) for c in choices}  # every choice counts its prompt
    return usage(sum(prompts.values()), sum(c.req.num_generated for c in choices))


def _prompt_list(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise OpenAIError(400, "prompt is empty", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return [p if isinstance(p, str) else list(p) for p in prompt]


async def merge(streams: list[AsyncIterator[Chunk]]) -> AsyncIterator[tuple[int, Chunk]]:
    """``(stream index, chunk)`` as the streams produce them; the first error raises. Closing
    the merge (or an error) closes every stream, which aborts its request."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: AsyncIterator[Chunk]) -> None:
        try:
            async for chunk in stream:
                queue.put_nowait((i, chunk))
        except Exception as e:
            queue.put_nowait((i, e))
        finally:
            await stream.aclose()
            queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _unless_disconnected(http: HttpRequest, work) -> None:
    """Run ``work``; cancel it if the client goes away first (non-streaming responses)."""
    task = asyncio.ensure_future(work)
    try:
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and await http.is_disconnected():
                raise OpenAIError(499, "the client closed the connection", code="cancelled")
        task.result()
    finally:
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _event(obj: dict, include_usage: bool) -> str:
    if include_usage and "usage" not in obj:
        obj = {**obj, "usage": None}
    return f"data: {json.dumps(obj)}\n\n"


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    return StreamingResponse(events, media_type="text/event-stream", headers=headers)


async def read_body(http: HttpRequest, model: type[pydantic.BaseModel], limit: int):
    """The JSON body as ``model``: 413 past ``limit`` bytes (from Content-Length, else while
    reading), 400 when it does not parse or validate."""
    declared = http.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    data = bytearray()
    async for part in http.stream():
        data += part
        if len(data) > limit:
            raise _too_large(len(data), limit)
    try:
        return model.model_validate_json(bytes(data))
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(x) for x in first["loc"]) or None
        raise OpenAIError(
            400, f"invalid request body: {param}: {first['msg']}", param=param
        ) from None


def _too_large(size: int, limit: int) -> OpenAIError:
    return OpenAIError(
        413, f"request body of {size} bytes exceeds the limit of {limit} (derived from "
        "--max-prompt-bytes, --max-images-per-request and --max-image-bytes)",
        code="request_too_large",
    )  # fmt: skip


# -- the app and its server ----------------------------------------------------------------------
OPEN_PATHS = frozenset({"/health"})


def make_app(api: OpenAIService, api_key: str | None) -> FastAPI:
    app = FastAPI(title="specmesh", docs_url=None, redoc_url=None, openapi_url=None)
    key = api_key.encode() if api_key else None

    @app.middleware("http")
    async def check_api_key(http: HttpRequest, call_next):
        if key is not None and http.url.path not in OPEN_PATHS:
            scheme, _, token = http.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key):
                why = "missing API key" if not token else "invalid API key"
                error = OpenAIError(
                    401, f"{why}: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                return _error_response(error)
        return await call_next(http)

    @app.exception_handler(Exception)
    async def on_error(_http: HttpRequest, exc: Exception) -> JSONResponse:
        error = as_openai_error(exc)
        if error.status >= 500 and not isinstance(exc, OpenAIError):
            log.error("request failed", exc_info=exc)
        return _error_response(error)

    @app.exception_handler(HTTPException)
    async def on_http_error(http: HttpRequest, exc: HTTPException) -> JSONResponse:
        what = f"no route {http.method} {http.url.path}" if exc.status_code == 404 else exc.detail
        return _error_response(OpenAIError(exc.status_code, str(what)))

    for exc_type in (OpenAIError, ValueError):
        app.add_exception_handler(exc_type, on_error)
    app.add_api_route("/v1/completions", api.completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", api.chat_completions, methods=["POST"])
    app.add_api_route("/v1/models", lambda: api.models(), methods=["GET"])
    app.add_api_route("/health", lambda: health(api), methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])
    return app


def health(api: OpenAIService) -> Response:
    ready = api.servicer.core is not None and not api.host.draining
    return JSONResponse(
        {"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503
    )


def metrics() -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from specmesh.router.metrics import REGISTRY

    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def _error_response(error: OpenAIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the router owns SIGTERM / SIGINT (it drains, then stops us)
        yield


class HttpFront:
    """uvicorn serving the app as a task on the router's loop, on a socket bound here (so a
    port in use is a clear error, and port 0 picks a free one)."""

    def __init__(self, servicer, settings) -> None:
        self.settings = settings
        self.app = make_app(OpenAIService(servicer, settings), settings.api_key)
        self.port = 0
        self.server: _Server | None = None
        self.task: asyncio.Task | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.settings.tls and self.settings.tls.cert_file else "http"

    async def start(self) -> None:
        host, _, port = self.settings.http_address.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.bind((host, int(port)))
        except OSError as e:
            sock.close()
            raise ValueError(
                f"cannot listen on {self.settings.http_address} (HTTP): {e.strerror}"
            ) from None
        self.port = sock.getsockname()[1]
        tls = self.settings.tls
        config = uvicorn.Config(
            self.app, log_level="warning", lifespan="off", timeout_graceful_shutdown=1,
            ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
        )  # fmt: skip
        self.server = _Server(config)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info("HTTP API on %s://%s:%d", self.scheme, host, self.port)

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.task, 5.0)
        self.task = None
