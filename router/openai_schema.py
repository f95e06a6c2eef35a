"""The OpenAI-compatible API's wire shapes: request bodies (pydantic) and the pieces of responses
(usage, logprobs); responses are built as plain dicts in `specmesh.router.openai_views`, field
for field the OpenAI schema. Errors: `specmesh.router.openai_errors`.

Fields accepted beyond OpenAI's are vLLM's (``top_k``, ``min_p``, ``repetition_penalty``,
``min_tokens``, ``ignore_eos``, ``stop_token_ids``, ``skip_special_tokens``, ``guided_json``,
``guided_regex``, ``guided_choice``, ``structured_outputs``). OpenAI fields (and vLLM extras)
specmesh does not implement are refused with a 400 naming them (`refuse_unsupported`), never
silently ignored; fields nobody defines are ignored, as OpenAI and vLLM do.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt

from specmesh.protocol.sampling import NUM_SEEDS
from specmesh.router.openai_errors import OpenAIError
from specmesh.router.structured import ResponseFormat, StructuredOutputs
from specmesh.router.tools import NamedToolChoice, Tool


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
            raise OpenAIError(
                400, f"{name} is not supported by specmesh", param=name,
                code="unsupported_parameter",
            )  # fmt: skip


class SamplingBody(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="ignore")
    unsupported: ClassVar[dict[str, tuple]] = _UNSUPPORTED_COMMON

    model: str
    n: int = Field(1, ge=1, le=128)
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=100.0)  # None: OpenAI's default, 1.0
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=0, lt=NUM_SEEDS)  # choice j: `openai_api.choice_seed`
    user: str | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # vLLM's extras
    top_k: int = Field(0, ge=-1, lt=2**31)  # 0 or -1 = off
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
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
    # specmesh's: this request's speculative figures in the response (`openai_spec`); None:
    # the router's --per-request-spec-decode-metrics
    spec_decode_metrics: Literal["none", "summary", "detailed"] | None = None
    # specmesh's: keep this request out of the draft's online learning (GenerateRequest's field)
    exclude_from_learning: bool = False

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

    @property
    def max_tokens_param(self) -> str:
        """The field that sets the completion's length."""
        return "max_tokens"

    @property
    def engine_fields(self) -> dict[str, str]:
        """The engine's field names -> this body's: an error the engine raises names the field
        the client sent (`openai_errors.as_openai_error`)."""
        return {"prompt_token_ids": "prompt", "max_new_tokens": self.max_tokens_param}


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

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # None only beside an assistant's tool_calls
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

    @property
    def engine_fields(self) -> dict[str, str]:
        prompt = dict.fromkeys(("prompt", "prompt_token_ids", "images"), "messages")
        return {**prompt, "max_new_tokens": self.max_tokens_param}


class TokenizeBody(BaseModel):
    """vLLM's ``/tokenize``: a ``prompt`` (text) or chat ``messages``, one of them."""

    model_config = ConfigDict(extra="ignore")
    unsupported: ClassVar[dict[str, tuple]] = {
        "continue_final_message": (False,), "chat_template": (), "chat_template_kwargs": ({},),
        "mm_processor_kwargs": ({},), "media_io_kwargs": ({},),
    }  # fmt: skip

    model: str | None = None  # vLLM's is optional; checked when given
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # None: true for a prompt, false for messages (vLLM)
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    tools: list[Tool] | None = Field(None, max_length=128)


class DetokenizeBody(BaseModel):
    """vLLM's ``/detokenize``; its ``tokens`` are counted and checked before this model is
    built (`openai_info.detokenize`)."""

    model_config = ConfigDict(extra="ignore")
    unsupported: ClassVar[dict[str, tuple]] = {}

    model: str | None = None


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
