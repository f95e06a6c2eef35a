"""The OpenAI-compatible API's wire shapes: request bodies (pydantic), the error object and the
one table from specmesh's status codes to HTTP statuses. Responses are built as plain dicts in
`specmesh.router.openai_api`, field for field the OpenAI schema.

Fields accepted beyond OpenAI's are vLLM's (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``guided_json``,
``guided_regex``, ``guided_choice``, ``structured_outputs``). OpenAI fields (and vLLM extras)
specmesh does not implement are refused with a 400 naming them (`refuse_unsupported`), never
silently ignored; fields nobody defines are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from specmesh.protocol.errors import SpecmeshError
from specmesh.protocol.sampling import NUM_SEEDS
from specmesh.router.structured import ResponseFormat, StructuredOutputs
from specmesh.router.tools import NamedToolChoice, Tool

log = logging.getLogger(__name__)

# specmesh / gRPC status -> HTTP status (README "OpenAI-compatible HTTP").
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


class OpenAIError(Exception):
    """An error answered as OpenAI's ``{"error": {message, type, param, code}}``; ``close``:
    the connection is closed after it (a body refused before it was all read)."""

    def __init__(
        self, status: int, message: str, *, param: str | None = None, code: str | None = None,
        close: bool = False,
    ) -> None:  # fmt: skip
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.close = close

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
        super().__init__(499, f"the client closed the connection {when}", code="cancelled")
        self.when = when


def as_openai_error(exc: BaseException) -> OpenAIError:
    """A `SpecmeshError` by its ``grpc_code``, any other ``ValueError`` as 400, else 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, SpecmeshError):
        code = exc.grpc_code
    elif isinstance(exc, ValueError):
        code = "INVALID_ARGUMENT"
    else:
        return OpenAIError(500, f"internal error: {type(exc).__name__}", code="internal_error")
    param = getattr(exc, "param", None)  # `InvalidRequestError`'s field at fault
    return OpenAIError(HTTP_STATUS.get(code, 500), str(exc), param=param, code=code.lower())


def reported(exc: Exception, where: str) -> OpenAIError:
    """``exc`` as the error to answer, logged as it deserves: a refusal (< 500) not at all, a
    client gone one INFO line, an unavailable service one WARNING line, and only an internal
    error (a bug) with its traceback."""
    error = as_openai_error(exc)
    if isinstance(exc, ClientGone):
        log.info("HTTP client went away %s (%s)", exc.when, where)
    elif error.code == "internal_error":  # not an error raised on purpose
        log.error("%s failed", where, exc_info=exc)
    elif error.status >= 500:
        log.warning("%s answered %d: %s", where, error.status, error.message)
    return error


# -- request bodies ----------------------------------------------------------------------------
class StreamOptions(BaseModel):
    """Every field OpenAI documents, and vLLM's; others are ignored, as at the top level."""

    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False
    # OpenAI pads its chunks with an ``obfuscation`` field against length side channels;
    # specmesh sends none, whatever this says.
    include_obfuscation: bool = True
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk (implies include_usage)


# Fields OpenAI or vLLM define that specmesh does not implement -> the values it accepts as
# "not asking for anything" (None always counts as absent).
_UNSUPPORTED_COMMON: dict[str, tuple] = {
    "guided_grammar": (), "guided_decoding_backend": (), "guided_whitespace_pattern": (),
    "structural_tag": (), "service_tier": ("auto", "default"), "store": (False,),
    "metadata": ({},), "prompt_cache_key": (), "safety_identifier": (),
}  # fmt: skip
_UNSUPPORTED_CHAT = {
    **_UNSUPPORTED_COMMON, "audio": (), "modalities": (["text"],), "prediction": (),
    "reasoning_effort": (), "verbosity": (), "web_search_options": (), "functions": (),
    "function_call": ("none",),
}  # fmt: skip


def refuse_unsupported(obj: dict, unsupported: dict[str, tuple]) -> None:
    """A 400 naming the first field of ``obj`` that asks for what specmesh does not do."""
    for name, accepted in unsupported.items():
        value = obj.get(name)
        if value is not None and value not in accepted:
            raise OpenAIError(400, f"{name} is not supported by specmesh", param=name)


class SamplingBody(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")
    unsupported: ClassVar[dict[str, tuple]] = _UNSUPPORTED_COMMON

    model: str
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None  # None: OpenAI's default, 1.0
    top_p: float = 1.0
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=NUM_SEEDS)  # choice j: `openai_api.choice_seed`
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extras
    top_k: int = Field(0, ge=-1)  # 0 or -1 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: NonNegativeInt = 0
    ignore_eos: bool = False
    stop_token_ids: list[NonNegativeInt] | None = None
    skip_special_tokens: bool = True
    # structured outputs (`specmesh.router.structured`): OpenAI's, then vLLM's
    response_format: ResponseFormat | None = None
    guided_json: dict | bool | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: StructuredOutputs | None = None

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        so = self.stream_options
        return so is not None and (so.include_usage or so.continuous_usage_stats)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionBody(SamplingBody):
    # ``prompt`` (text, token ids, or a list of either) is counted and shape-checked without
    # pydantic, before this model is built: `specmesh.router.openai_body.parse_completion`.
    max_tokens: int | None = Field(16, ge=0, lt=2**31)  # OpenAI's; None: the router's default
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: str | None = None  # refused (no insertion)
    best_of: int | None = None  # only best_of == n
    unsupported: ClassVar[dict[str, tuple]] = {
        **_UNSUPPORTED_COMMON,
        "tools": (),
        "tool_choice": (),
    }


class ImageUrl(BaseModel):
    url: str


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict] | None = None  # an assistant turn's calls, for the chat template
    tool_call_id: str | None = None  # a tool turn's answer to that call


class ChatBody(SamplingBody):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=0, lt=2**31)  # None: the router's --max-new-tokens
    max_completion_tokens: int | None = Field(None, ge=0, lt=2**31)  # wins over max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template: str | None = None  # refused: the router's template (--chat-template) only
    unsupported: ClassVar[dict[str, tuple]] = _UNSUPPORTED_CHAT

    @property
    def max_tokens_param(self) -> str:
        """The field that sets the completion's length (``max_completion_tokens`` wins)."""
        return "max_tokens" if self.max_completion_tokens is None else "max_completion_tokens"

    @property
    def max_new_tokens(self) -> int | None:
        return getattr(self, self.max_tokens_param)


# -- response pieces ---------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; ``cached_tokens``: prompt tokens the target's prefix cache had."""
    total = prompt_tokens + completion_tokens
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": total,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


@dataclass(frozen=True)
class TokenEntry:
    """One token's logprobs as text."""

    text: str  # the token alone, decoded (a special token by its name)
    width: int  # characters it adds to the returned text: 0 for a special token it omits
    logprob: float | None  # None: the first prompt token under ``echo``
    top: list[tuple[str, float]]  # alternatives: (text, logprob)


def completion_logprobs(entries: list[TokenEntry], text_offset: int) -> dict:
    """OpenAI's legacy completions shape, ``text_offset`` counted from ``text_offset`` by each
    token's width; ``top_logprobs`` maps token text to logprob and includes the chosen token,
    as vLLM does."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for e in entries:
        tokens.append(e.text)
        offsets.append(text_offset)
        text_offset += e.width
        token_logprobs.append(e.logprob)
        top_logprobs.append(None if e.logprob is None else {e.text: e.logprob, **dict(e.top)})
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(entries: list[TokenEntry]) -> dict:
    """Chat's shape: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    item = lambda text, logprob: {
        "token": text,
        "logprob": logprob,
        "bytes": list(text.encode("utf-8")),
    }
    content = [
        {**item(e.text, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]} for e in entries
    ]
    return {"content": content}
