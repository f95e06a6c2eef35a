"""The OpenAI-compatible HTTP API's endpoint logic (`OpenAIService`), served by uvicorn on the
router's own event loop (`specmesh.router.openai_server`; responses in `openai_views`, streaming
plumbing in `openai_stream`).

    POST /v1/completions, /v1/chat/completions    the body read and counted first
                                                 (`openai_body`: size, JSON values, prompts x n,
                                                 messages, images), then one `Request` per
                                                 (prompt, n) choice, built by
                                                 `GenerationServicer._make_request` (the gRPC
                                                 path's limits, tokenizer threads and checks)
    GET  /metrics, /health (and HEAD)            the router's Prometheus registry; 200 once
                                                 every service answered (no API key)

The routes that generate nothing (models, version, tokenize, detokenize) are `openai_info`'s.

A choice's chunks come from ``RouterCore.generate``; several choices are merged as they arrive.
Closing the merged stream (the client went away, a streaming response was cancelled, a
non-streaming one saw the disconnect) closes every ``generate`` iterator, which aborts each
request and frees its state in the target and the draft. Errors are OpenAI's error object with
the HTTP status of `openai_errors.HTTP_STATUS`.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from specmesh.protocol.constraints import Constraint
from specmesh.protocol.errors import SpecmeshError
from specmesh.protocol.sampling import NUM_SEEDS, SamplingParams
from specmesh.protocol.steps import Logprob
from specmesh.router.chat import ChatRenderer, read_template
from specmesh.router.openai_answer import answer
from specmesh.router.openai_body import (
    BodyBudget,
    Prompt,
    chat_budget,
    completion_budget,
    parse_chat,
    parse_completion,
    read_json,
)
from specmesh.router.openai_checks import check_sampling, logit_bias_pairs, stop_token_ids
from specmesh.router.openai_errors import OpenAIError, as_openai_error
from specmesh.router.openai_schema import ChatBody, CompletionBody, SamplingBody, TokenEntry
from specmesh.router.openai_spec import LEVELS
from specmesh.router.openai_views import ChatView, Choice, CompletionView
from specmesh.router.request import Request
from specmesh.router.structured import constraint_of
from specmesh.router.tools import ToolPlan, plan_tools
from specmesh.v1 import generation_pb2


class OpenAIService:
    """The endpoints' logic over the gRPC servicer's core, tokenizer and request building."""

    def __init__(self, servicer, settings) -> None:
        self.servicer, self.settings, self.host = servicer, settings, servicer.host
        self.limits = settings.limits
        self.spec_default = settings.per_request_spec_decode_metrics
        if self.spec_default not in LEVELS:
            raise ValueError(
                f"--per-request-spec-decode-metrics must be one of {LEVELS}, got "
                f"{self.spec_default!r}"
            )
        self.template = read_template(settings.chat_template) if settings.chat_template else None
        self._chat: ChatRenderer | None = None
        self._budgets: dict[str, BodyBudget] = {}  # per endpoint, once the target is known
        self._special_ids: frozenset[int] | None = None

    # -- shared steps --------------------------------------------------------------------------
    @property
    def core(self):
        if self.servicer.core is None:
            raise OpenAIError(
                503, "the router is still connecting to its services", code="unavailable"
            )
        return self.servicer.core

    @property
    def model(self) -> str:
        return self.core.served_model

    def check_model(self, name: str) -> None:
        if name != self.model:
            raise OpenAIError(
                404, f"the model {name!r} does not exist; this router serves {self.model!r}",
                param="model", code="model_not_found",
            )  # fmt: skip

    @property
    def max_model_len(self) -> int:
        """The target's context: prompt + max_tokens fit in it (`openai_info` reports it)."""
        return self.core.targets[0].info_pb.max_context_len

    @property
    def max_prompt_tokens(self) -> int:
        return self.max_model_len - 1

    @property
    def num_spec_tokens(self) -> int:
        """The most draft tokens one round can accept: the draft's num_steps (0 without one)."""
        drafts = self.core.drafts
        return drafts[0].info_pb.num_steps if drafts else 0

    def spec_level(self, body: SamplingBody) -> str:
        """The per-request speculative figures a response carries (`openai_spec`): the
        request's ``spec_decode_metrics``, else the router's flag."""
        return body.spec_decode_metrics or self.spec_default

    def budget(self, endpoint: str) -> BodyBudget:
        """What a body of ``endpoint`` may hold (503 until the target is known)."""
        if not self._budgets:
            vocab = self.core.info.vocab_size
            self._budgets = {
                "completions": completion_budget(self.limits, self.max_prompt_tokens, vocab),
                "chat": chat_budget(self.limits),
            }
        return self._budgets[endpoint]

    async def read(self, http: HttpRequest, endpoint: str) -> dict:
        budget = self.budget(endpoint)
        return await read_json(http, budget, self.limits.http_body_timeout_s)

    @contextlib.asynccontextmanager
    async def work(self) -> AsyncIterator[None]:
        """Counted as in-flight work, so a draining router waits for it (`ServiceHost.work`)."""
        if self.host.draining:
            raise OpenAIError(503, "the router is shutting down", code="unavailable")
        async with self.host.work(None):  # not draining: the context is never used
            yield

    def sampling(
        self, body: SamplingBody, max_tokens: int | None, logprobs: int | None,
        prompt_logprobs: int | None, seed: int | None, constraint: Constraint | None = None,
    ) -> SamplingParams:  # fmt: skip
        if not body.skip_special_tokens:
            raise OpenAIError(
                400, "only skip_special_tokens=true is supported", param="skip_special_tokens",
                code="unsupported_value",
            )  # fmt: skip
        check_sampling(body, body.max_tokens_param, max_tokens)
        vocab = self.core.info.vocab_size
        bias = logit_bias_pairs(body.logit_bias, vocab)
        return SamplingParams(
            max_new_tokens=self.settings.max_new_tokens if max_tokens is None else max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=body.top_p, top_k=max(body.top_k, 0), seed=seed, stop=tuple(body.stop_list),
            stop_token_ids=stop_token_ids(body.stop_token_ids, vocab), ignore_eos=body.ignore_eos,
            min_p=body.min_p, repetition_penalty=body.repetition_penalty,
            frequency_penalty=body.frequency_penalty, presence_penalty=body.presence_penalty,
            logit_bias=bias, min_tokens=body.min_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, constraint=constraint,
        )  # fmt: skip

    async def make_choices(
        self, rid: str, prompts: list[Prompt], body: SamplingBody, params: SamplingParams,
        max_tokens: int | None, images: list[bytes] = (), echo: bool = False,
        score_only: bool = False,
    ) -> list[Choice]:  # fmt: skip
        """One request per (prompt, n): seeds `choice_seed` (or fresh ones), the limits checked
        by `_make_request` on a `GenerateRequest` holding the sizes it reads (its refusals name
        ``body``'s fields). A text prompt is tokenized once: its other choices are built from
        its ids."""
        choices = []
        for i, prompt in enumerate(prompts):
            shown = None
            for j in range(body.n):
                index = i * body.n + j
                seed = None if params.seed is None else choice_seed(params.seed, j)
                msg = _message(f"{rid}-{index}", prompt, params, max_tokens, images)
                msg.exclude_from_learning = body.exclude_from_learning
                req = await self.request(msg, replace(params, seed=seed), body)
                if j == 0:
                    shown = self.shown(msg.prompt, req.prompt_ids) if echo else None
                    if isinstance(prompt, str):
                        prompt = list(req.prompt_ids)
                choices.append(Choice(index, i, req, shown, score_only))
        self.core.metrics.on_choices([c.req for c in choices], body.n)  # request_params_n
        return choices

    async def request(
        self, msg: generation_pb2.GenerateRequest, params: SamplingParams, body: SamplingBody
    ) -> Request:
        """The gRPC path's request building and checks; a refusal names the body's field."""
        try:
            return await self.servicer._make_request(self.core, msg, params)
        except SpecmeshError as e:
            raise as_openai_error(e, body.engine_fields) from None

    def shown(self, text: str, ids: list[int]) -> str:
        """The prompt as ``echo`` returns it: its text, or its ids decoded."""
        return text or self.decode(ids)

    def decode(self, ids: list[int]) -> str:
        tok = self.servicer.tokenizer
        return tok.decode(ids, skip_special_tokens=True) if tok is not None else ""

    def token_text(self, token_id: int) -> str:
        tok = self.servicer.tokenizer
        return tok.decode([token_id]) if tok is not None else f"token_id:{token_id}"

    @property
    def special_ids(self) -> frozenset[int]:
        """Tokens the returned text omits (``skip_special_tokens``)."""
        if self._special_ids is None:
            tok = self.servicer.tokenizer
            self._special_ids = frozenset(getattr(tok, "all_special_ids", None) or ())
        return self._special_ids

    def entries(self, pairs: list[tuple[int, Logprob | None]]) -> list[TokenEntry]:
        return [self.entry(tid, lp) for tid, lp in pairs]

    def entry(self, token_id: int, lp: Logprob | None) -> TokenEntry:
        text = self.token_text(token_id)
        width = 0 if token_id in self.special_ids else len(text)
        if lp is None:
            return TokenEntry(text, width, None, [])
        return TokenEntry(text, width, lp.logprob, [(self.token_text(t), v) for t, v in lp.top])

    @property
    def chat(self) -> ChatRenderer:
        if self.servicer.tokenizer is None:
            raise OpenAIError(
                400, "the router has no tokenizer (--tokenizer): use /v1/completions with token ids"
            )
        if self._chat is None:
            self._chat = ChatRenderer(self.servicer.tokenizer, self.template)
        return self._chat

    # -- endpoints -----------------------------------------------------------------------------
    async def completions(self, http: HttpRequest) -> Response:
        obj = await self.read(http, "completions")
        vocab = self.core.info.vocab_size
        body, prompts = parse_completion(obj, self.limits, self.max_prompt_tokens, vocab)
        async with self.work():
            self.check_model(body.model)
            if body.suffix:
                raise OpenAIError(
                    400, "suffix is not supported", param="suffix", code="unsupported_parameter"
                )
            if body.best_of not in (None, body.n):
                raise OpenAIError(400, "best_of must equal n", param="best_of")
            score_only = _scores_only(body)
            max_tokens = 1 if score_only else body.max_tokens  # vLLM: one token, never shown
            lp = body.logprobs
            structured = constraint_of(body)
            await self.check_schemas([structured] if structured else [])
            constraint = structured[1] if structured else None
            params = self.sampling(
                body, max_tokens, lp, lp if body.echo else None, body.seed, constraint
            )
            rid = f"cmpl-{uuid.uuid4().hex}"
            choices = await self.make_choices(
                rid, prompts, body, params, max_tokens, echo=body.echo, score_only=score_only
            )
            return await answer(
                self, http, choices, CompletionView(self, rid, lp is not None), body
            )

    async def chat_completions(self, http: HttpRequest) -> Response:
        body = parse_chat(await self.read(http, "chat"), self.limits)
        async with self.work():
            self.check_model(body.model)
            if body.chat_template is not None:
                raise OpenAIError(
                    400, "chat_template is set by the router (--chat-template)",
                    param="chat_template", code="unsupported_parameter",
                )  # fmt: skip
            if body.max_new_tokens == 0:
                name = body.max_tokens_param
                raise OpenAIError(400, f"{name} must be at least 1, got 0", param=name)
            tools = self.tool_plan(body)
            structured = constraint_of(body)
            await self.check_schemas([*tools.schemas, *([structured] if structured else [])])
            constraint = _one_constraint(structured, tools)
            messages, images = self.chat.flatten(body.messages)
            prompt = await asyncio.to_thread(self.chat.render, messages, tools.tools)
            lp = (body.top_logprobs or 0) if body.logprobs else None
            params = self.sampling(body, body.max_new_tokens, lp, None, body.seed, constraint)
            rid = f"chatcmpl-{uuid.uuid4().hex}"
            choices = await self.make_choices(
                rid, [prompt], body, params, body.max_new_tokens, images
            )
            view = ChatView(self, rid, body.logprobs, tools)
            return await answer(self, http, choices, view, body)

    def tool_plan(self, body: ChatBody) -> ToolPlan:
        tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
        choice = body.tool_choice
        if choice is not None and not isinstance(choice, str):
            choice = choice.model_dump()
        return plan_tools(tools, choice, body.parallel_tool_calls, self.chat.tool_parser)

    async def check_schemas(self, fields: list[tuple[str, Constraint]]) -> None:
        """Each (field, constraint) compiled as `_make_request` compiles a request's own (the
        same checker and cache), before any work; a refusal's ``param`` names the field."""
        info, checker = self.core.info, self.servicer.constraints
        tokenizer = self.servicer.tokenizer
        await checker.check_fields(fields, tokenizer, info.vocab_size, info.eos_token_ids)


def choice_seed(seed: int, j: int) -> int:
    """The seed of choice ``j`` of a request with ``seed``: ``seed + j``, wrapped into the
    seed range (``(2**63 - 1) + 1`` is 0), so every seed is valid whatever ``n``."""
    return (seed + j) % NUM_SEEDS


def _one_constraint(
    structured: tuple[str, Constraint] | None, tools: ToolPlan
) -> Constraint | None:
    """The request's one grammar: a structured output's or a forced tool call's."""
    if structured is not None and tools.constraint is not None:
        raise OpenAIError(
            400, f"{structured[0]} cannot be combined with tool_choice {tools.mode!r}",
            param=structured[0],
        )  # fmt: skip
    return tools.constraint if structured is None else structured[1]


def _scores_only(body: CompletionBody) -> bool:
    """``max_tokens: 0`` asks for the prompt's logprobs alone: only with ``echo`` (vLLM)."""
    if body.max_tokens != 0:
        return False
    if not body.echo:
        raise OpenAIError(
            400, "max_tokens must be at least 1, got 0 (0 only with echo: the prompt and its "
            "logprobs, no completion)", param="max_tokens",
        )  # fmt: skip
    return True


def _message(
    rid: str, prompt: Prompt, params: SamplingParams, max_tokens: int | None, images: list[bytes]
) -> generation_pb2.GenerateRequest:
    text, ids = (prompt, []) if isinstance(prompt, str) else ("", prompt)
    sampling = generation_pb2.SamplingParams(
        max_new_tokens=max_tokens or 0, stop=params.stop, stop_token_ids=params.stop_token_ids
    )
    return generation_pb2.GenerateRequest(
        request_id=rid, prompt=text, prompt_token_ids=ids, sampling=sampling, images=images
    )
