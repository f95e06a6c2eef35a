"""An HTTP request body, read and checked before it costs anything.

A body can only be as large as what its endpoint may legitimately carry (`BodyBudget`, derived
from the router's limits), and a JSON value costs the parser far more memory than its bytes
(``[],`` is 3 bytes and a 56-byte list), so both are bounded while the body arrives:

    Content-Length     refused (413) before a byte of the body is read
    each piece read    bytes and JSON separators (, : [ {) counted: 413 past the budget;
                       the whole body within ``http_body_timeout_s`` (408)
    parse              the stdlib's C parser on what passed (never pydantic on raw bytes)
    counts             prompts x n, messages, content parts, images: 400 naming the limit
    models             pydantic on the scalar fields and the counted messages only; the
                       prompts' shapes and ids (in the vocabulary) are checked here, in one pass

Separators bound the number of JSON values (every value but the first follows one): the parse
builds at most ~64 bytes of objects per separator (``[[]],`` or ``{"a":{}},`` repeated, measured),
~75 MB for the default chat budget, against ~30 times the bytes of the body without the count.
Counting separators inside strings too over-counts only text, which the prompt limit bounds.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import Request as HttpRequest
from starlette.requests import ClientDisconnect

from specmesh.router.limits import RouterLimits
from specmesh.router.openai_checks import (
    check_messages,
    check_stream_options,
    check_token_ids,
    kind_of,
)
from specmesh.router.openai_errors import ClientGone, OpenAIError, validation_error
from specmesh.router.openai_schema import ChatBody, CompletionBody, refuse_unsupported

SEPARATORS = (b",", b":", b"[", b"{")
OVERHEAD = 64 << 10  # bytes and separators of everything but prompts and messages
JSON_ESCAPE = 6  # JSON bytes per prompt byte at worst (\u00XX)
PER_CHAT_ITEM = 128  # framing bytes of one message or content part ({"role": ..., ...})
SEPARATORS_PER_CHAT_ITEM = 16

Prompt = str | list[int]


@dataclass(frozen=True)
class BodyBudget:
    """What one endpoint's body may hold: bytes, JSON separators, and how they were derived."""

    endpoint: str
    max_bytes: int
    max_separators: int
    bytes_from: str  # how each limit derives from the flags, named in the 413
    separators_from: str


def completion_budget(limits: RouterLimits, max_prompt_tokens: int, vocab: int) -> BodyBudget:
    """One prompt's worth, shared by a batch: the larger of a text prompt (JSON-escaped) and
    a token-id prompt (``, `` after each id), plus the other fields."""
    id_bytes = len(str(max(vocab - 1, 0))) + 2
    prompt_bytes = max(JSON_ESCAPE * limits.max_prompt_bytes, max_prompt_tokens * id_bytes)
    return BodyBudget(
        "/v1/completions", prompt_bytes + OVERHEAD,
        max(limits.max_prompt_bytes, max_prompt_tokens) + OVERHEAD,
        f"{JSON_ESCAPE} x --max-prompt-bytes or the target's max prompt tokens x {id_bytes}, "
        "+ 64 KiB", "--max-prompt-bytes or the target's max prompt tokens, + 64 Ki",
    )  # fmt: skip


def chat_budget(limits: RouterLimits) -> BodyBudget:
    """The prompt's text (JSON-escaped), every image as base64, and each message's or content
    part's framing."""
    items = limits.max_messages + limits.max_content_parts
    image_bytes = limits.max_image_bytes * 4 // 3 + 68  # base64 and its data: URL head
    return BodyBudget(
        "/v1/chat/completions",
        JSON_ESCAPE * limits.max_prompt_bytes + limits.max_images_per_request * image_bytes
        + PER_CHAT_ITEM * items + OVERHEAD,
        limits.max_prompt_bytes + SEPARATORS_PER_CHAT_ITEM * items + OVERHEAD,
        f"{JSON_ESCAPE} x --max-prompt-bytes + --max-images-per-request x --max-image-bytes in "
        f"base64 + {PER_CHAT_ITEM} per message and content part + 64 KiB",
        f"--max-prompt-bytes + {SEPARATORS_PER_CHAT_ITEM} per message and content part "
        "+ 64 Ki",
    )  # fmt: skip


async def read_json(http: HttpRequest, budget: BodyBudget, timeout_s: float) -> dict:
    """The body as a JSON object, or the error that refuses it (413, 408, 400; `ClientGone`
    when the client leaves first)."""
    declared = http.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > budget.max_bytes:
        raise _too_large_bytes(budget, f"{int(declared)} bytes")
    try:
        data = await asyncio.wait_for(_read(http, budget), timeout_s)
    except TimeoutError:  # asyncio's timeouts raise the builtin one since Python 3.11
        raise OpenAIError(
            408, f"the request body did not arrive within {timeout_s:g} s "
            "(http_body_timeout_s)", code="request_timeout", close=True,
        ) from None  # fmt: skip
    except ClientDisconnect:
        raise ClientGone("while sending its body") from None
    try:
        text = data.decode()  # JSON over HTTP is UTF-8 (RFC 8259)
        data.clear()  # the bytes' copy goes before the parse builds its objects
        obj = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, UnicodeDecodeError
        raise OpenAIError(400, f"the request body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise OpenAIError(400, f"the request body must be a JSON object, not {kind_of(obj)}")
    return obj


async def _read(http: HttpRequest, budget: BodyBudget) -> bytearray:
    data, separators = bytearray(), 0
    async for piece in http.stream():
        data += piece
        separators += sum(piece.count(s) for s in SEPARATORS)
        if len(data) > budget.max_bytes:
            raise _too_large_bytes(budget, f"{len(data)}+ bytes")
        if separators > budget.max_separators:
            what = f"{separators}+ JSON separators (, : [ {{)"
            limit = f"{budget.max_separators} separators"
            raise _too_large(budget, what, limit, budget.separators_from)
    return data


def _too_large_bytes(budget: BodyBudget, size: str) -> OpenAIError:
    return _too_large(budget, size, f"{budget.max_bytes} bytes", budget.bytes_from)


def _too_large(budget: BodyBudget, size: str, limit: str, derivation: str) -> OpenAIError:
    return OpenAIError(
        413, f"request body of {size} exceeds the limit of {limit} of {budget.endpoint} "
        f"({derivation})", code="request_too_large", close=True,
    )  # fmt: skip


# -- counts and models ---------------------------------------------------------------------------
def parse_completion(
    obj: dict, limits: RouterLimits, max_prompt_tokens: int, vocab_size: int
) -> tuple[CompletionBody, list[Prompt]]:
    """The body's fields, and its prompts once counted (prompts x n, token ids) and checked
    for shape and for ids in the vocabulary (before anything reads them)."""
    if "prompt" not in obj:
        raise OpenAIError(
            400, "invalid request body: prompt: Field required", param="prompt",
            code="missing_required_parameter",
        )  # fmt: skip
    raw = obj.pop("prompt")
    body = validate(CompletionBody, obj)
    prompts = _as_prompt_list(raw)
    _check_choices(len(prompts), body.n, limits)
    for i, p in enumerate(prompts):
        which = "prompt" if len(prompts) == 1 else f"prompt {i}"
        if not p:  # "" or []: a prompt must hold something
            raise OpenAIError(400, f"{which} is empty", param="prompt")
        if isinstance(p, list) and len(p) > max_prompt_tokens:
            raise OpenAIError(
                400, f"{which} of {len(p)} tokens exceeds max_model_len {max_prompt_tokens + 1} "
                f"(at most {max_prompt_tokens} prompt tokens)", param="prompt",
                code="context_length_exceeded",
            )  # fmt: skip
        if not isinstance(p, str):
            check_token_ids(p, vocab_size, which, "prompt")
    check_stream_options(body)
    return body, prompts


def parse_chat(obj: dict, limits: RouterLimits) -> ChatBody:
    """The body, its messages, content parts and images counted before pydantic sees them."""
    messages = obj.get("messages")
    images = check_chat_counts(messages, limits) if isinstance(messages, list) else 0
    body = validate(ChatBody, obj)
    check_messages(body.messages)
    check_stream_options(body)
    _check_choices(1, body.n, limits)
    if images * body.n > limits.max_images_per_request:  # each choice holds its own copy
        raise OpenAIError(
            400, f"n={body.n} choices x {images} images exceed the limit of "
            f"{limits.max_images_per_request} images per request (--max-images-per-request)",
            param="n",
        )  # fmt: skip
    return body


def validate(model: type[pydantic.BaseModel], obj: dict) -> Any:
    try:
        refuse_unsupported(obj, model.unsupported)
        return model.model_validate(obj)
    except pydantic.ValidationError as e:
        raise validation_error(e) from None


def _as_prompt_list(raw: Any) -> list:
    if isinstance(raw, str):
        return [raw]
    if not isinstance(raw, list) or not raw:
        what = "empty" if raw == [] else f"{kind_of(raw)}, not text or token ids"
        raise OpenAIError(400, f"prompt is {what}", param="prompt")
    return [raw] if type(raw[0]) is int else raw  # one prompt of ids, or a batch


def _check_choices(num_prompts: int, n: int, limits: RouterLimits) -> None:
    if num_prompts * n > limits.max_choices_per_request:
        raise OpenAIError(
            400, f"{num_prompts * n} choices ({num_prompts} prompts x n={n}) exceed the limit "
            f"of {limits.max_choices_per_request} (max_choices_per_request)", param="n",
        )  # fmt: skip


def check_chat_counts(messages: list, limits: RouterLimits) -> int:
    """Messages, content parts and image parts, counted on the parsed JSON; the image count."""
    if len(messages) > limits.max_messages:
        raise OpenAIError(
            400, f"{len(messages)} messages exceed the limit of {limits.max_messages} "
            "(max_messages)", param="messages",
        )  # fmt: skip
    contents = [m["content"] for m in messages if isinstance(m, dict) and "content" in m]
    lists = [c for c in contents if isinstance(c, list)]
    num_parts = sum(len(c) for c in lists)
    if num_parts > limits.max_content_parts:
        raise OpenAIError(
            400, f"{num_parts} content parts exceed the limit of {limits.max_content_parts} "
            "(max_content_parts)", param="messages",
        )  # fmt: skip
    images = sum(isinstance(p, dict) and p.get("type") == "image_url" for c in lists for p in c)
    if images > limits.max_images_per_request:
        raise OpenAIError(
            400, f"{images} images exceed the limit of {limits.max_images_per_request} per "
            "request (--max-images-per-request)", param="messages",
        )  # fmt: skip
    return images
