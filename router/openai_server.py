"""The HTTP server of the OpenAI API: the FastAPI app (routes, API key, error objects) and
uvicorn on the router's own event loop (`HttpFront`)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import socket

import uvicorn
from fastapi import FastAPI
from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException

from specmesh.router.openai_api import OpenAIService
from specmesh.router.openai_schema import OpenAIError, as_openai_error

log = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics"})  # probes and scrapers need no API key


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
