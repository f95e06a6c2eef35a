"""The HTTP server of the OpenAI API: the FastAPI app (routes, API key, error objects) and
uvicorn on the router's own event loop (`HttpFront`).

Every error leaves as OpenAI's error object from the endpoint itself (`answering_errors`), so
nothing reaches Starlette's last-resort handler (which re-raises, and uvicorn logs "Exception in
ASGI application" with a traceback): refusals are not logged, a client gone while sending its
body or before its answer is one INFO line, 503s one WARNING line, and only an internal error
(a bug) carries a traceback (`openai_errors.reported`). uvicorn logs through the process's own
logging setup (``log_config=None``), without access lines.

Connections (`http_protocol`, `http_gate`): at most as many as the fd limit leaves room for; a
first byte within ``http_first_byte_timeout_s``, a request head within ``http_header_timeout_s``,
a body within ``http_body_timeout_s`` (408, `openai_body`); an idle connection between requests
is closed after ``KEEP_ALIVE_S`` (uvicorn's own timer); a refusal sent while a body is still
coming ends in a staged close, so the client reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import resource
from collections.abc import Awaitable, Callable
from functools import partial

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from specmesh.router import openai_info as info
from specmesh.router.http_gate import ConnectionGate, listening_socket, quiet_accept_errors
from specmesh.router.http_protocol import ServerConfig
from specmesh.router.limits import http_connection_cap
from specmesh.router.openai_api import OpenAIService
from specmesh.router.openai_errors import OpenAIError, reported

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers need no API key
KEEP_ALIVE_S = 5  # an idle connection between requests (uvicorn's timeout_keep_alive)

Endpoint = Callable[[HttpRequest], Awaitable[Response]]


def make_app(api: OpenAIService, api_key: str | None) -> FastAPI:
    app = FastAPI(title="specmesh", docs_url=None, redoc_url=None, openapi_url=None)
    if api_key:
        app.add_middleware(ApiKeyCheck, key=api_key.encode())

    @app.exception_handler(HTTPException)
    async def on_http_error(http: HttpRequest, exc: HTTPException) -> JSONResponse:
        what = f"no route {http.method} {http.url.path}" if exc.status_code == 404 else exc.detail
        return error_response(OpenAIError(exc.status_code, str(what)))

    app.add_api_route("/v1/completions", answering_errors(api.completions), methods=["POST"])
    chat = answering_errors(api.chat_completions)
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    for path, method, route in (
        ("/v1/models", "GET", info.models), ("/v1/models/{model:path}", "GET", info.model),
        ("/version", "GET", info.version), ("/tokenize", "POST", info.tokenize),
        ("/detokenize", "POST", info.detokenize),
    ):  # fmt: skip
        app.add_api_route(path, answering_errors(partial(route, api)), methods=[method])
    app.add_api_route("/health", lambda: health(api), methods=["GET", "HEAD"])
    app.add_api_route("/metrics", metrics, methods=["GET", "HEAD"])
    return app


class ApiKeyCheck:
    """``Authorization: Bearer KEY`` on every path but `OPEN_PATHS`, compared in constant time.
    Pure ASGI: Starlette's ``BaseHTTPMiddleware`` would hide a client's disconnect from the
    endpoint, so an abandoned non-streaming request would run to its end."""

    def __init__(self, app: ASGIApp, key: bytes) -> None:
        self.app, self.key = app, key

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            auth = Headers(scope=scope).get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                token.strip().encode(), self.key
            ):
                why = "missing API key" if not token else "invalid API key"
                error = OpenAIError(
                    401, f"{why}: send 'Authorization: Bearer <key>'", code="invalid_api_key"
                )
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def answering_errors(endpoint: Endpoint) -> Endpoint:
    """``endpoint`` with every exception answered as OpenAI's error object and logged as it
    deserves (`openai_errors.reported`)."""

    async def answer(http: HttpRequest) -> Response:
        try:
            return await endpoint(http)
        except Exception as e:
            return error_response(reported(e, f"{http.method} {http.url.path}"))

    return answer


def health(api: OpenAIService) -> Response:
    ready = api.servicer.core is not None and not api.host.draining
    return JSONResponse(
        {"status": "ok" if ready else "unavailable"}, status_code=200 if ready else 503
    )


def metrics() -> Response:
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    from specmesh.router.metrics import REGISTRY

    return Response(generate_latest(REGISTRY), media_type=CONTENT_TYPE_LATEST)


def error_response(error: OpenAIError) -> JSONResponse:
    headers = {"Connection": "close"} if error.close else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


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
        self._undo_quiet: Callable[[], None] | None = None

    @property
    def scheme(self) -> str:
        return "https" if self.settings.tls and self.settings.tls.cert_file else "http"

    async def start(self) -> None:
        host, _, port = self.settings.http_address.rpartition(":")
        host = host.strip("[]") or "127.0.0.1"
        max_open_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        gate = ConnectionGate(http_connection_cap(max_open_files))
        sock = listening_socket(host, int(port), self.settings.http_address, gate)
        self.port = sock.getsockname()[1]
        tls, limits = self.settings.tls, self.settings.limits
        config = ServerConfig(
            self.app, limits=limits, gate=gate, log_level="warning", log_config=None,
            access_log=False, lifespan="off", timeout_graceful_shutdown=1,
            timeout_keep_alive=KEEP_ALIVE_S,
            ssl_certfile=tls.cert_file if tls else None, ssl_keyfile=tls.key_file if tls else None,
        )  # fmt: skip
        self.server = _Server(config)
        self._undo_quiet = quiet_accept_errors(asyncio.get_running_loop(), gate)
        self.task = asyncio.create_task(self.server.serve(sockets=[sock]))
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        log.info(
            "HTTP API on %s://%s:%d, at most %d connections (open files limit %d)",
            self.scheme, host, self.port, gate.max_connections, max_open_files,
        )  # fmt: skip

    async def stop(self) -> None:
        if self.task is None:
            return
        self.server.should_exit = True
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(self.task, 5.0)
        self.task = None
        if self._undo_quiet is not None:
            self._undo_quiet()
            self._undo_quiet = None
