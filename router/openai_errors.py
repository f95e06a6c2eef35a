"""Errors of the OpenAI-compatible API: OpenAI's error object ``{"error": {message, type, param,
code}}``, the one table from specmesh's status codes to HTTP statuses, and what the engine
refuses put in the HTTP API's terms: ``param`` is the field the client sent (``max_tokens``,
``messages``; never the engine's ``max_new_tokens``), ``code`` a word of OpenAI's vocabulary,
never a gRPC status name.

    code                         when
    context_length_exceeded      the prompt, or prompt + max_tokens, past max_model_len
    missing_required_parameter   a required field is absent
    invalid_type                 a field of the wrong JSON type
    invalid_value                any other refused value that names its field
    unsupported_parameter        a field OpenAI or vLLM defines that specmesh does not implement
    unsupported_value            a value of a field that specmesh does not implement
    rate_limit_exceeded          429: the queue, the tokenizer queue or the KV cache is full
    model_not_found, invalid_api_key, request_too_large, request_timeout: their own statuses
    null                         the rest: a refusal that names no field, 503s, 500s
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping

import pydantic

from specmesh.protocol.errors import SpecmeshError
from specmesh.router.limits import ContextLengthError

log = logging.getLogger(__name__)

# specmesh / gRPC status -> HTTP status (docs/openai.md "Errors").
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "OUT_OF_RANGE": 400,
    "FAILED_PRECONDITION": 400,  # e.g. text prompts without a tokenizer
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "NOT_FOUND": 404,
    "ALREADY_EXISTS": 409,
    "RESOURCE_EXHAUSTED": 429,  # queue, tokenizer queue or KV cache full
    "CANCELLED": 499,
    "INTERNAL": 500,
    "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503,  # no target replica left, still connecting, shutting down
    "DEADLINE_EXCEEDED": 504,
}
ERROR_TYPE = {
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
    503: "service_unavailable_error",
}
Fields = Mapping[str, str]  # an engine field -> the field of this endpoint's body
_NOT_A_FIELD = re.compile(r"^(str|int|float|bool|dict|list|none)$|[\[(A-Z-]")  # pydantic's tags


class OpenAIError(Exception):
    """An error answered as OpenAI's object; ``close``: the connection is closed after it (a
    body refused before it was all read); ``internal``: a bug, logged with its traceback. A 400
    that names its field and no code is ``invalid_value``."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        close: bool = False, internal: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(message)
        if code is None and status == 400 and param is not None:
            code = "invalid_value"
        self.status, self.message, self.param, self.code = status, message, param, code
        self.close, self.internal = close, internal

    def body(self) -> dict:
        if self.status >= 500 and self.status not in ERROR_TYPE:
            kind = "server_error"
        else:
            kind = ERROR_TYPE.get(self.status, "invalid_request_error")
        error = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        return {"error": error}


class ClientGone(OpenAIError):
    """The client closed the connection (``when``: while sending its body, before its
    response): nobody reads the answer, and it is logged as one line."""

    def __init__(self, when: str) -> None:
        super().__init__(499, f"the client closed the connection {when}")
        self.when = when


def as_openai_error(exc: BaseException, fields: Fields | None = None) -> OpenAIError:
    """A `SpecmeshError` by its ``grpc_code``, any other ``ValueError`` as 400, else 500 (a
    bug). ``fields`` renames the engine's fields (an error's ``param``) to this endpoint's."""
    if isinstance(exc, OpenAIError):
        return exc
    fields = fields or {}
    if isinstance(exc, ContextLengthError):
        return _context_error(exc, fields)
    if isinstance(exc, SpecmeshError):
        status = HTTP_STATUS.get(exc.grpc_code, 500)
    elif isinstance(exc, ValueError):
        status = 400
    else:
        return OpenAIError(500, f"internal error: {type(exc).__name__}", internal=True)
    param = getattr(exc, "param", None)  # `InvalidRequestError`'s field at fault
    code = "rate_limit_exceeded" if status == 429 else None
    return OpenAIError(status, str(exc), param=fields.get(param, param), code=code)


def _context_error(exc: ContextLengthError, fields: Fields) -> OpenAIError:
    """The refusal worded with the endpoint's fields (``prompt`` or ``messages``,
    ``max_tokens`` or ``max_completion_tokens``) and the room there is."""
    prompt = fields.get("prompt", "prompt")
    n, limit, asked = exc.num_prompt_tokens, exc.max_context_len, exc.max_new_tokens
    if asked is None:
        return OpenAIError(
            400, f"{prompt} of {n} tokens exceeds max_model_len {limit} (at most {limit - 1} "
            "prompt tokens)", param=prompt, code="context_length_exceeded",
        )  # fmt: skip
    tokens = fields.get("max_new_tokens", "max_tokens")
    return OpenAIError(
        400, f"{prompt} of {n} tokens + {tokens} {asked} = {n + asked} tokens exceed "
        f"max_model_len {limit}: {tokens} may be at most {limit - n}", param=tokens,
        code="context_length_exceeded",
    )  # fmt: skip


def validation_error(error: pydantic.ValidationError) -> OpenAIError:
    """A body that does not validate, its first error: ``param`` the field as the client wrote
    it (``messages[0].role``), ``code`` by what is wrong with it."""
    first = error.errors()[0]
    param = ""
    for part in first["loc"]:
        if isinstance(part, int):
            param += f"[{part}]"
        elif not _NOT_A_FIELD.search(part):
            param += f".{part}" if param else part
    kind = first["type"]
    if kind == "missing":
        code = "missing_required_parameter"
    elif kind.endswith(("_type", "_parsing")):
        code = "invalid_type"
    else:
        code = "invalid_value"
    message = f"invalid request body: {param or 'body'}: {first['msg']}"
    return OpenAIError(400, message, param=param or None, code=code)


def reported(exc: Exception, where: str, fields: Fields | None = None) -> OpenAIError:
    """``exc`` as the error to answer, logged as it deserves: a refusal (< 500) not at all, a
    client gone one INFO line, an unavailable service one WARNING line, and only an internal
    error (a bug) with its traceback."""
    error = as_openai_error(exc, fields)
    if isinstance(exc, ClientGone):
        log.info("HTTP client went away %s (%s)", exc.when, where)
    elif error.internal:  # not an error raised on purpose
        log.error("%s failed", where, exc_info=exc)
    elif error.status >= 500:
        log.warning("%s answered %d: %s", where, error.status, error.message)
    return error
