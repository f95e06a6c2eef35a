"""The HTTP server of the OpenAI API: the FastAPI app (routes, API key, error objects) and
uvicorn on the router's own event loop (`HttpFront`).

Every error leaves as OpenAI's error object from the endpoint itself (`answering_errors`), so
nothing reaches Starlette's last-resort handler (which re-raises, and uvicorn logs "Exception in
ASGI application" with a traceback): refusals are not logged, a client gone while sending its
body or before its answer is one INFO line, 503s one WARNING line, and only an internal error
(a bug) carries a traceback (`openai_schema.reported`). uvicorn logs through the process's own
logging setup (``log_config=None``), without access lines.

Slow clients are cut: a request head must arrive within ``http_header_timeout_s``
(`_TimedH11Protocol`), its body within ``http_body_timeout_s`` (408, `openai_body`); an idle
connection between requests is closed after ``KEEP_ALIVE_S`` (uvicorn's own timer).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket
from collections.abc import Awaitable, Callable

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from specmesh.router.openai_api import OpenAIService, reported
from specmesh.router.openai_schema import OpenAIError

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
    app.add_api_route("/v1/models", answering_errors(api.models), methods=["GET"])
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
    deserves (`openai_schema.reported`)."""

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


class _Config(uvicorn.Config):
    def __init__(self, app: ASGIApp, *, header_timeout_s: float, **kwargs) -> None:
        super().__init__(app, **kwargs)
        self.header_timeout_s = header_timeout_s


class _TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on each request head: a connection that has not
    sent a whole request line and headers ``header_timeout_s`` after it opened (or after its
    previous response) is closed. uvicorn's own keep-alive timer starts only after a response
    and any byte resets it, so without this a connection trickling a header byte now and then,
    or sending nothing, would stay open forever."""

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self._serving():  # a head arrived: its request runs
            self._head_arrived()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request
        if not self.transport.is_closing() and not self._serving():
            self._await_head()  # the rest of an unread body counts against it too

    def _serving(self) -> bool:
        return self.cycle is not None and not self.cycle.response_complete

    def _await_head(self) -> None:
        self._head_arrived()
        timeout_s = self.config.header_timeout_s  # type: ignore[attr-defined]
        self._head_timer = self.loop.call_later(timeout_s, self._head_timed_out)

    def _head_arrived(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            log.info(
                "HTTP client %s sent no request head within %g s: closed",
                self.client, self.config.header_timeout_s,  # type: ignore[attr-defined]
            )  # fmt: skip
            self.transport.close()


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
        sock = listening_socket(host, int(port), self.settings.http_address)
        self.port = sock.getsockname()[1]
        tls, limits = self.settings.tls, self.settings.limits
        config = _Config(
            self.app, log_level="warning", log_config=None, access_log=False, lifespan="off",
            timeout_graceful_shutdown=1, timeout_keep_alive=KEEP_ALIVE_S,
            http=_TimedH11Protocol, header_timeout_s=limits.http_header_timeout_s,
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


def listening_socket(host: str, port: int, address: str) -> socket.socket:
    """Bound with ``SO_REUSEADDR``: a router restarted after a crash binds its port at once,
    whatever its dead connections left in TIME_WAIT (Linux still refuses a port another socket
    listens on, so the port stays exclusive; ``SO_REUSEPORT`` stays off)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ValueError(f"cannot listen on {address} (HTTP): {e.strerror}") from None
    return sock
