"""The HTTP routes that answer about the server and its tokenizer instead of generating, shaped as
OpenAI and vLLM shape them:

    GET  /v1/models             {"object": "list", "data": [model]}
    GET  /v1/models/{model}     the model object, or 404 ``model_not_found`` (ids may hold "/")
    GET  /version               {"version"} (vLLM)
    POST /tokenize              {"model"?, "prompt" | "messages", "add_special_tokens"?, ...}
                                -> {"count", "max_model_len", "tokens", "token_strs"} (vLLM)
    POST /detokenize            {"model"?, "tokens"} -> {"prompt"} (vLLM)

Tokenizing and detokenizing keep the router's limits: the body is read against the chat (or
completions) budget, messages are counted before pydantic sees them, the text against
``--max-prompt-bytes``, token ids against the vocabulary and ``max_model_len``, and the work runs
on the tokenizer threads under their queue limit (`limits.PromptEncoder.run`), never on the
event loop.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response

from specmesh import __version__
from specmesh.router.openai_body import check_chat_counts, validate
from specmesh.router.openai_checks import check_messages, check_token_ids, kind_of
from specmesh.router.openai_errors import OpenAIError
from specmesh.router.openai_schema import DetokenizeBody, TokenizeBody

if TYPE_CHECKING:
    from specmesh.router.openai_api import OpenAIService


def model_card(api: OpenAIService) -> dict:
    return {
        "id": api.model, "object": "model", "created": int(time.time()), "owned_by": "specmesh",
        "max_model_len": api.max_model_len,
    }  # fmt: skip


async def models(api: OpenAIService, _http: HttpRequest) -> Response:
    return JSONResponse({"object": "list", "data": [model_card(api)]})


async def model(api: OpenAIService, http: HttpRequest) -> Response:
    api.check_model(http.path_params["model"])
    return JSONResponse(model_card(api))


async def version(_api: OpenAIService, _http: HttpRequest) -> Response:
    return JSONResponse({"version": __version__})


async def tokenize(api: OpenAIService, http: HttpRequest) -> Response:
    """A prompt's ids as a completion's prompt gets them (``add_special_tokens`` defaults to
    true), or chat messages' as a chat completion's prompt gets them (``add_special_tokens``
    defaults to false; true adds the tokenizer's own special tokens on top of the template's)."""
    obj = await api.read(http, "chat")
    if isinstance(obj.get("messages"), list):
        check_chat_counts(obj["messages"], api.limits)
    body = validate(TokenizeBody, obj)
    async with api.work():
        if body.model is not None:
            api.check_model(body.model)
        tokenizer = _tokenizer(api)
        text, add_special = await _text(api, body)
        rid = f"tokenize-{uuid.uuid4().hex}"
        ids, strs = await api.servicer.prompts.run(
            rid, _encode, tokenizer, text, add_special, body.return_token_strs
        )
        out = {"count": len(ids), "max_model_len": api.max_model_len, "tokens": ids}
        return JSONResponse({**out, "token_strs": strs})


async def _text(api: OpenAIService, body: TokenizeBody) -> tuple[str, bool]:
    """The text to tokenize and whether the tokenizer adds its special tokens."""
    if (body.prompt is None) == (body.messages is None):
        raise OpenAIError(400, "set one of prompt and messages", param="prompt")
    if body.prompt is not None:
        _check_bytes(api, body.prompt, "prompt")
        return body.prompt, body.add_special_tokens is not False
    check_messages(body.messages)
    messages, images = api.chat.flatten(body.messages)
    if images:
        raise OpenAIError(
            400, "/tokenize counts text: image placeholders are expanded by the target",
            param="messages", code="unsupported_value",
        )  # fmt: skip
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] or None
    on_top = bool(body.add_special_tokens)  # a chat completion's prompt: the template's own
    render = api.chat.render
    text = await asyncio.to_thread(render, messages, tools, body.add_generation_prompt, not on_top)
    _check_bytes(api, text, "messages")
    return text, True


def _check_bytes(api: OpenAIService, text: str, param: str) -> None:
    num_bytes = len(text.encode())
    if num_bytes > api.limits.max_prompt_bytes:
        raise OpenAIError(
            400, f"{param} of {num_bytes} bytes exceeds the limit of "
            f"{api.limits.max_prompt_bytes} (--max-prompt-bytes)", param=param,
        )  # fmt: skip


def _encode(
    tokenizer: Any, text: str, add_special: bool, strs: bool
) -> tuple[list[int], list[str] | None]:
    ids = tokenizer.encode(text, add_special_tokens=add_special)
    return ids, tokenizer.convert_ids_to_tokens(ids) if strs else None


async def detokenize(api: OpenAIService, http: HttpRequest) -> Response:
    """The text of ``tokens``, special tokens included (as vLLM decodes them)."""
    obj = await api.read(http, "completions")
    if "tokens" not in obj:
        raise OpenAIError(
            400, "invalid request body: tokens: Field required", param="tokens",
            code="missing_required_parameter",
        )  # fmt: skip
    tokens = obj.pop("tokens")
    body = validate(DetokenizeBody, obj)
    async with api.work():
        if body.model is not None:
            api.check_model(body.model)
        tokenizer = _tokenizer(api)
        limit = api.max_model_len
        if not isinstance(tokens, list):
            raise OpenAIError(400, f"tokens must be a list, not {kind_of(tokens)}", param="tokens")
        if len(tokens) > limit:
            raise OpenAIError(
                400, f"tokens holds {len(tokens)} ids; at most max_model_len {limit}",
                param="tokens",
            )  # fmt: skip
        check_token_ids(tokens, api.core.info.vocab_size, "tokens", "tokens")
        rid = f"detokenize-{uuid.uuid4().hex}"
        text = await api.servicer.prompts.run(rid, tokenizer.decode, tokens)
        return JSONResponse({"prompt": text})


def _tokenizer(api: OpenAIService) -> Any:
    if api.servicer.tokenizer is None:
        raise OpenAIError(
            400, "the router has no tokenizer (its targets serve none and no --tokenizer was "
            "given)",
        )  # fmt: skip
    return api.servicer.tokenizer
