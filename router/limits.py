"""What one public request may ask for, checked before it costs anything (DESIGN.md §3 "Limits").

The order in ``GenerationServicer._make_request`` is the point:

    check_request(msg)        sizes read off the parsed message: prompt bytes, token count,
                              stop strings and ids, images, request id — O(number of fields)
    sampling values, check_stop_rules(params, vocab)
    PromptEncoder.encode      the tokenizer, on its own threads (never on the event loop), at
                              most ``max_queued_prompts`` prompts waiting or running
    token count of the text prompt, then the Request

Every violation is an `InvalidRequestError` (INVALID_ARGUMENT) naming the limit's flag and the
numbers, except a full tokenizer queue: `TokenizerBusyError` (RESOURCE_EXHAUSTED). Image pixels
are the target's to check (it decodes; the router never does): `specmesh.target_service.multimodal`.

The process's own: `raise_fd_limit` at start, `http_connection_cap`, the HTTP connections that
fit under the fd limit with room left for everything else (`specmesh.router.http_gate`), and
`grpc_connection_cap`, the gRPC port's share of that room.
"""

from __future__ import annotations

import asyncio
import logging
import resource
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

from specmesh.protocol.errors import InvalidRequestError, SpecmeshError
from specmesh.protocol.images import (
    MAX_IMAGE_BYTES,
    MAX_IMAGES_PER_REQUEST,
    check_image_sizes,
)
from specmesh.protocol.sampling import SamplingParams
from specmesh.v1 import generation_pb2

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterLimits:
    max_prompt_bytes: int = 1 << 20  # UTF-8 bytes of a text prompt, checked before tokenizing
    max_stop_strings: int = 32
    max_stop_string_len: int = 256  # characters of one stop string
    max_stop_token_ids: int = 64
    max_request_id_len: int = 256  # characters
    max_images_per_request: int = MAX_IMAGES_PER_REQUEST  # the target checks its own, too
    max_image_bytes: int = MAX_IMAGE_BYTES  # encoded bytes of one image
    max_queued_prompts: int = 64  # text prompts tokenizing or waiting to; more: RESOURCE_EXHAUSTED
    tokenizer_threads: int = 2
    # The HTTP API's own (`specmesh.router.openai_body`): counts read off the parsed JSON before
    # any model is built, and how long a client may take to send one request.
    max_choices_per_request: int = 128  # completions: prompts x n; chat: n
    max_messages: int = 2048  # chat messages in one request
    max_content_parts: int = 2048  # chat content parts, all messages together
    http_header_timeout_s: float = 30.0  # connection (or previous response) to end of headers
    http_first_byte_timeout_s: float = 10.0  # the same, for a connection that sent nothing yet
    http_body_timeout_s: float = 60.0  # end of headers to end of body: 408 past it


class TokenizerBusyError(SpecmeshError):
    grpc_code = "RESOURCE_EXHAUSTED"


class ContextLengthError(InvalidRequestError):
    """The prompt (``max_new_tokens`` None), or the prompt and ``max_new_tokens``, do not fit
    the target's context; ``param`` is the field to shorten. The numbers are kept, so an API
    with other field names can word it its own way (`openai_errors`)."""

    def __init__(
        self, rid: str, num_prompt_tokens: int, max_context_len: int,
        max_new_tokens: int | None = None,
    ) -> None:  # fmt: skip
        self.num_prompt_tokens, self.max_context_len = num_prompt_tokens, max_context_len
        self.max_new_tokens = max_new_tokens
        if max_new_tokens is None:
            message = (
                f"request {rid!r}: prompt of {num_prompt_tokens} tokens exceeds the limit of "
                f"{max_context_len - 1} (the target's max_context_len - 1)"
            )
        else:
            message = (
                f"request {rid!r}: prompt of {num_prompt_tokens} tokens + max_new_tokens "
                f"{max_new_tokens} exceed max_context_len {max_context_len}"
            )
        super().__init__(message, param="prompt" if max_new_tokens is None else "max_new_tokens")


def check_request(
    msg: generation_pb2.GenerateRequest, rid: str, limits: RouterLimits, max_prompt_tokens: int
) -> None:
    """Every size limit of a parsed request, from lengths alone (nothing tokenized or built)."""
    if len(msg.request_id) > limits.max_request_id_len:
        raise InvalidRequestError(
            f"request_id of {len(msg.request_id)} characters exceeds the limit of "
            f"{limits.max_request_id_len} (--max-request-id-len)"
        )
    prompt = msg.prompt
    num_bytes = len(prompt) if prompt.isascii() else len(prompt.encode())
    if num_bytes > limits.max_prompt_bytes:
        raise InvalidRequestError(
            f"request {rid!r}: prompt of {num_bytes} bytes exceeds the limit of "
            f"{limits.max_prompt_bytes} (--max-prompt-bytes)",
            param="prompt",
        )
    check_prompt_tokens(rid, len(msg.prompt_token_ids), max_prompt_tokens)
    sampling = msg.sampling
    if len(sampling.stop) > limits.max_stop_strings:
        raise InvalidRequestError(
            f"request {rid!r}: {len(sampling.stop)} stop strings exceed the limit of "
            f"{limits.max_stop_strings} (--max-stop-strings)",
            param="stop",
        )
    longest = max((len(s) for s in sampling.stop), default=0)
    if longest > limits.max_stop_string_len:
        raise InvalidRequestError(
            f"request {rid!r}: a stop string of {longest} characters exceeds the limit of "
            f"{limits.max_stop_string_len} (--max-stop-string-len)",
            param="stop",
        )
    if len(sampling.stop_token_ids) > limits.max_stop_token_ids:
        raise InvalidRequestError(
            f"request {rid!r}: {len(sampling.stop_token_ids)} stop_token_ids exceed the limit "
            f"of {limits.max_stop_token_ids} (--max-stop-token-ids)",
            param="stop_token_ids",
        )
    check_image_sizes(rid, msg.images, limits.max_images_per_request, limits.max_image_bytes)


def check_prompt_tokens(rid: str, num_tokens: int, max_prompt_tokens: int) -> None:
    if num_tokens > max_prompt_tokens:
        raise ContextLengthError(rid, num_tokens, max_prompt_tokens + 1)


def check_stop_rules(params: SamplingParams, vocab_size: int) -> None:
    """Stop rules that could never be meant: an empty stop string (it would match at once) and
    stop token ids the model cannot produce."""
    if any(not s for s in params.stop):
        raise InvalidRequestError(
            "an empty stop string would end the request at once", param="stop"
        )
    bad = [t for t in params.stop_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            f"stop_token_ids outside vocab [0, {vocab_size}): {bad[:5]}", param="stop_token_ids"
        )


class PromptEncoder:
    """Tokenizes text prompts on its own ``tokenizer_threads`` threads, so the event loop keeps
    serving (health checks, other streams) while a long prompt is tokenized. At most
    ``max_queued_prompts`` wait or run at once (each holds its prompt in memory); a cancelled
    call's prompt is dropped if it has not started, else finishes on its thread, which bounds
    the work in flight by the thread count either way."""

    def __init__(self, limits: RouterLimits) -> None:
        self.limits = limits
        self.queued = 0
        self._pool = ThreadPoolExecutor(limits.tokenizer_threads, thread_name_prefix="tokenize")

    async def encode(
        self, tokenizer: Any, rid: str, prompt: str, add_special_tokens: bool = True
    ) -> list[int]:
        return await self.run(rid, tokenizer.encode, prompt, add_special_tokens=add_special_tokens)

    async def run(self, rid: str, work: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``work(*args, **kwargs)`` on the tokenizer threads, under the same queue limit (the
        HTTP API's /tokenize and /detokenize go through here too)."""
        if self.queued >= self.limits.max_queued_prompts:
            raise TokenizerBusyError(
                f"request {rid!r}: {self.queued} prompts are already being tokenized, the "
                f"limit (--max-queued-prompts); try again later"
            )
        self.queued += 1
        try:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._pool, partial(work, *args, **kwargs))
        finally:
            self.queued -= 1


def raise_fd_limit() -> int:
    """Raise this process's soft limit of open files (RLIMIT_NOFILE) to its hard limit, once at
    start, and log the result; returns the soft limit now. Each HTTP or gRPC connection holds
    a descriptor, and many systems start processes at a soft limit of 1024."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == hard:
        log.info("open files: at the hard limit of %d", soft)
        return soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (ValueError, OSError) as e:
        log.warning("open files: soft limit %d, not raised to the hard limit %d: %s", soft, hard, e)
        return soft
    log.info("open files: soft limit raised from %d to the hard limit of %d", soft, hard)
    return hard


def grpc_connection_cap(max_open_files: int) -> int:
    """How many connections the public gRPC port holds at once: half of what
    `http_connection_cap` leaves (the other half: the clients to targets and drafts, and files).
    One gRPC connection carries any number of concurrent calls."""
    if max_open_files == resource.RLIM_INFINITY:
        max_open_files = 1 << 20
    return max(1, (max_open_files - http_connection_cap(max_open_files)) // 2)


def http_connection_cap(max_open_files: int) -> int:
    """How many HTTP sockets (connections, and those being shut) fit under ``max_open_files``:
    the rest stays for the gRPC port, the clients to targets and drafts, and files; a quarter
    of it, or 64 where that is more (but never more than half)."""
    if max_open_files == resource.RLIM_INFINITY:
        max_open_files = 1 << 20
    reserved = max(min(64, max_open_files // 2), max_open_files // 4)
    return max(1, max_open_files - reserved)
