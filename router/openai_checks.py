"""Field checks of the HTTP API that pydantic's types cannot say, each a 400 naming the field as
the client wrote it (``param``), before any work: token ids in the vocabulary, ``logit_bias``
keys, chat messages as OpenAI requires them, ``stream_options`` only with ``stream``, and the
sampling fields that depend on each other."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from specmesh.router.openai_errors import OpenAIError

if TYPE_CHECKING:
    from specmesh.router.openai_schema import ChatMessage, SamplingBody

_CANONICAL_ID = re.compile(r"0|[1-9][0-9]*")  # ASCII only: [0-9], not \d


def kind_of(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "text", type(None): "null"}.get(
        type(value), type(value).__name__
    )


def check_token_ids(ids: Any, vocab_size: int, where: str, param: str) -> None:
    """``ids`` is a list of ids in [0, ``vocab_size``): anything else is a 400 naming ``param``
    and the range, before an id reaches a message field it does not fit."""
    if not isinstance(ids, list) or not all(type(t) is int for t in ids):
        raise OpenAIError(
            400, f"{where} must be a list of token ids (integers in [0, {vocab_size})), "
            f"not {kind_of(ids)}", param=param,
        )  # fmt: skip
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise OpenAIError(
            400, f"{where} holds token id {bad}, outside the vocabulary's ids [0, {vocab_size})",
            param=param,
        )  # fmt: skip


def stop_token_ids(ids: list[int] | None, vocab_size: int) -> tuple[int, ...]:
    """``stop_token_ids`` once each is an id of the vocabulary."""
    bad = [t for t in ids or () if t >= vocab_size]
    if bad:
        raise OpenAIError(
            400, f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad[0]}",
            param="stop_token_ids",
        )  # fmt: skip
    return tuple(ids or ())


def logit_bias_pairs(
    bias: dict[str, float] | None, vocab_size: int
) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as (token id, bias) pairs: each key the canonical decimal ASCII form of
    an id in the vocabulary (``"5"``; not ``" 5 "``, ``"05"``, ``"+5"`` or other scripts'
    digits, which ``int`` would take), each bias in [-100, 100]."""
    pairs = []
    for key, value in (bias or {}).items():
        if not _CANONICAL_ID.fullmatch(key):
            raise OpenAIError(
                400, f"logit_bias keys must be token ids in decimal ASCII digits, without sign, "
                f"space or leading zeros (such as \"5\"); got {key[:40]!r}", param="logit_bias",
            )  # fmt: skip
        token_id = int(key) if len(key) < 19 else vocab_size  # past any vocabulary
        if token_id >= vocab_size or not -100 <= value <= 100:
            raise OpenAIError(
                400, f"logit_bias needs token ids in [0, {vocab_size}) and biases in "
                f"[-100, 100], got {key[:40]}: {value}", param="logit_bias",
            )  # fmt: skip
        pairs.append((token_id, float(value)))
    return tuple(pairs)


def check_messages(messages: list[ChatMessage]) -> None:
    """OpenAI's rules (roles are checked by the model): every message carries ``content``, but
    an assistant's that carries ``tool_calls``; a ``tool`` message names the call it answers
    (``tool_call_id``)."""
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            need = "content or tool_calls" if m.role == "assistant" else "content"
            raise OpenAIError(
                400, f"messages[{i}] (role {m.role}) needs {need}",
                param=f"messages[{i}].content", code="missing_required_parameter",
            )  # fmt: skip
        if m.role == "tool" and not m.tool_call_id:
            raise OpenAIError(
                400, f"messages[{i}] (role tool) needs tool_call_id: the id of the call it "
                "answers", param=f"messages[{i}].tool_call_id",
                code="missing_required_parameter",
            )  # fmt: skip


def check_stream_options(body: SamplingBody) -> None:
    """``stream_options`` says how to stream: it is refused without ``stream: true`` (OpenAI,
    vLLM)."""
    if body.stream_options is not None and not body.stream:
        raise OpenAIError(
            400, "stream_options is only allowed with stream: true", param="stream_options"
        )


def check_sampling(body: SamplingBody, max_tokens_param: str, max_tokens: int | None) -> None:
    """The sampling fields that depend on each other, named as the client wrote them (the
    engine would speak of its own ``max_new_tokens``)."""
    if max_tokens is not None and body.min_tokens > max_tokens:
        raise OpenAIError(
            400, f"min_tokens {body.min_tokens} exceeds {max_tokens_param} {max_tokens}",
            param="min_tokens",
        )  # fmt: skip
