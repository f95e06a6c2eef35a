"""OpenAI details of the HTTP API (issue 50), through the real server with the `openai` client:
``stream_options`` fields OpenAI documents, a request that fills ``max_model_len`` under
speculation, strict JSON schemas, and refusals that name the field the client sent.

The stack is the copy pair (a one-layer target and an EAGLE-3 draft built to predict it, so
rounds accept draft tokens) with the target's context cut to `MAX_CONTEXT`."""

from __future__ import annotations

import json
from types import SimpleNamespace

import openai
import pytest
from grpc_harness import (
    SPEC,
    LoopThread,
    num_accepted,
    serve_draft,
    serve_http_router,
    serve_target,
)

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, TargetConfig
from specmesh.router.tokenizer import load_tokenizer
from specmesh.target_service.runtime import TargetRuntime

MAX_CONTEXT = 64
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
COMMA = 14  # the tiny tokenizer's ","


@pytest.fixture(scope="module")
def http(copy_dir, oracle, tmp_path_factory):
    loop = LoopThread()
    target_dir = str(copy_dir / "target")
    target_cfg = TargetConfig(target_dir, max_context=MAX_CONTEXT)
    target = loop.run(serve_target(TargetRuntime(target_cfg)))
    draft_cfg = DraftConfig("eagle3", str(copy_dir / "eagle3"), target_dir, SPEC)
    draft = loop.run(serve_draft(load_draft(draft_cfg)))
    stack = SimpleNamespace(loop=loop, target=target, draft=draft)
    router = serve_http_router(stack, tmp_path_factory.mktemp("chat"), TEMPLATE)
    stack.oa = openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="-", max_retries=0
    )
    stack.tok = load_tokenizer(target_dir)
    stack.expected = lambda prompt, n: oracle(target_dir, prompt, n)
    yield stack
    stack.oa.close()
    loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def _error(e: pytest.ExceptionInfo, status: int) -> dict:
    assert e.value.status_code == status, e.value
    return e.value.response.json()["error"]


# -- stream_options ------------------------------------------------------------------------------
def test_stream_options_fields_openai_documents_are_accepted(http) -> None:
    options = {"include_usage": True, "include_obfuscation": False}
    args = dict(model="target", prompt=[5, 6], max_tokens=4, stream=True, **GREEDY)
    chunks = list(http.oa.completions.create(**args, stream_options=options))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    chat = http.oa.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        stream=True, stream_options=options, **GREEDY,
    )  # fmt: skip
    assert list(chat)[-1].usage.completion_tokens == 3


# -- max_model_len -------------------------------------------------------------------------------
def test_a_request_that_fills_max_model_len_is_served_to_its_end(http) -> None:
    """prompt + max_tokens == max_model_len with speculation on: served to the end (the last
    trees cut to the context left), its text the plain greedy run's."""
    max_model_len = http.oa.models.list().data[0].max_model_len
    assert max_model_len == MAX_CONTEXT
    prompt = [5, 6]
    n = max_model_len - len(prompt)
    accepted = num_accepted()
    r = http.oa.completions.create(model="target", prompt=prompt, max_tokens=n, **GREEDY)
    assert num_accepted() > accepted  # it speculated
    assert r.usage.completion_tokens == n and r.choices[0].finish_reason == "length"
    expected = http.tok.decode(http.expected(prompt, n), skip_special_tokens=True)
    assert r.choices[0].text == expected
    with pytest.raises(openai.BadRequestError):  # one token more does not fit
        http.oa.completions.create(model="target", prompt=prompt, max_tokens=n + 1, **GREEDY)


# -- strict JSON schemas -------------------------------------------------------------------------
LOOSE = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"]}
COMMA_FIRST = {"logit_bias": {str(COMMA): 100}, "max_tokens": 40, "temperature": 0.0}


def _keys(text: str) -> set[str] | None:
    """The keys of ``text`` as a whole JSON object; None when it is none (e.g. cut short)."""
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    return set(obj) if isinstance(obj, dict) else None


def test_a_json_schema_names_every_property_unless_it_opts_out(http) -> None:
    """A schema without ``additionalProperties`` allows only the properties it names: with
    ``,`` pushed up wherever the grammar allows it, the object still closes after ``a``.
    ``strict: false`` (OpenAI's field) or ``additionalProperties: true`` opt out."""
    messages = [{"role": "user", "content": "hi"}]
    strict = lambda **kw: {"type": "json_schema", "json_schema": {"name": "x", **kw}}
    for fmt in (strict(schema=LOOSE), strict(schema=LOOSE, strict=True)):
        r = http.oa.chat.completions.create(
            model="target", messages=messages, response_format=fmt, **COMMA_FIRST
        )
        assert _keys(r.choices[0].message.content) == {"a"}, r.choices[0].message.content
    opened = {**LOOSE, "additionalProperties": True}
    for fmt in (strict(schema=LOOSE, strict=False), strict(schema=opened)):
        r = http.oa.chat.completions.create(
            model="target", messages=messages, response_format=fmt, **COMMA_FIRST
        )
        text = r.choices[0].message.content
        assert text.startswith('{"a":') and "," in text, text  # another property follows
    r = http.oa.completions.create(
        model="target", prompt=[5, 6], extra_body={"guided_json": LOOSE}, **COMMA_FIRST
    )
    assert _keys(r.choices[0].text) == {"a"}, r.choices[0].text


def test_forced_tool_calls_name_only_the_parameters_unless_the_function_opts_out(http) -> None:
    messages = [{"role": "user", "content": "hi"}]
    tool = lambda **kw: {"type": "function", "function": {"name": "f", "parameters": LOOSE, **kw}}
    named = {"type": "function", "function": {"name": "f"}}
    for choice in (named, "required"):
        r = http.oa.chat.completions.create(
            model="target", messages=messages, tools=[tool()], tool_choice=choice,
            parallel_tool_calls=False, **COMMA_FIRST,
        )  # fmt: skip
        calls = r.choices[0].message.tool_calls
        assert calls and _keys(calls[0].function.arguments) == {"a"}, r.choices[0].message
    r = http.oa.chat.completions.create(
        model="target", messages=messages, tools=[tool(strict=False)], tool_choice=named,
        **COMMA_FIRST,
    )  # fmt: skip
    assert r.choices[0].finish_reason == "length"  # an open object, cut by max_tokens
    assert r.choices[0].message.content.startswith('{"a":')


# -- refusals name what the client sent ----------------------------------------------------------
GRPC_NAMES = {"invalid_argument", "out_of_range", "failed_precondition", "resource_exhausted"}


@pytest.mark.parametrize(
    ("prompt", "message"),
    [("", "prompt is empty"), ([], "prompt is empty"), (["a", ""], "prompt 1 is empty"),
     ([[5], []], "prompt 1 is empty")],
)  # fmt: skip
def test_an_empty_prompt_is_called_empty(http, prompt, message: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        http.oa.completions.create(model="target", prompt=prompt, max_tokens=2)
    error = _error(e, 400)
    assert (error["message"], error["param"], error["code"]) == (message, "prompt", "invalid_value")


CHAT_REFUSALS = {  # a message OpenAI refuses -> the param it names, the code
    "unknown role": ({"role": "wizard", "content": "hi"}, "messages[0].role", "invalid_value"),
    "no content": ({"role": "user"}, "messages[0].content", "missing_required_parameter"),
    "null content": (
        {"role": "system", "content": None}, "messages[0].content", "missing_required_parameter"
    ),
    "assistant with neither": ({"role": "assistant"}, "messages[0].content", "missing_required_parameter"),
    "tool without its call": (
        {"role": "tool", "content": "42"}, "messages[0].tool_call_id", "missing_required_parameter"
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CHAT_REFUSALS))
def test_chat_messages_are_checked_as_openai_checks_them(http, case: str) -> None:
    message, param, code = CHAT_REFUSALS[case]
    with pytest.raises(openai.BadRequestError) as e:
        http.oa.chat.completions.create(model="target", messages=[message], max_tokens=2)
    error = _error(e, 400)
    assert (error["param"], error["code"]) == (param, code), error


def test_an_assistant_turn_of_tool_calls_needs_no_content(http) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]
    r = http.oa.chat.completions.create(model="target", messages=messages, max_tokens=2)
    assert r.usage.completion_tokens == 2


def test_stream_options_need_stream(http) -> None:
    options = {"include_usage": True}
    calls = (
        lambda: http.oa.completions.create(
            model="target", prompt=[5], max_tokens=2, stream_options=options
        ),
        lambda: http.oa.chat.completions.create(
            model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
            stream=False, stream_options=options,
        ),
    )  # fmt: skip
    for call in calls:
        with pytest.raises(openai.BadRequestError) as e:
            call()
        assert _error(e, 400)["param"] == "stream_options"


def _refusal(create, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        create(model="target", **kwargs)
    error = _error(e, 400)
    assert error["code"] not in GRPC_NAMES and "max_new_tokens" not in error["message"], error
    return error


def test_engine_refusals_name_the_field_the_client_sent(http) -> None:
    """What the engine refuses (context length, stop rules, sampling values) comes back with
    ``param`` the client's field, an OpenAI ``code``, and the client's field names."""
    cmpl, chat = http.oa.completions.create, http.oa.chat.completions.create
    hi = [{"role": "user", "content": "hi"}]
    context = "context_length_exceeded"
    error = _refusal(cmpl, prompt=[5, 6], max_tokens=MAX_CONTEXT - 1)
    assert (error["param"], error["code"]) == ("max_tokens", context)
    assert "max_tokens 63" in error["message"] and "at most 62" in error["message"], error
    for field in ("max_tokens", "max_completion_tokens"):
        error = _refusal(chat, messages=hi, **{field: MAX_CONTEXT})
        assert (error["param"], error["code"]) == (field, context)
    error = _refusal(cmpl, prompt="x" * 200, max_tokens=1)  # tokenized past the context
    assert (error["param"], error["code"]) == ("prompt", context)
    error = _refusal(chat, messages=[{"role": "user", "content": "x" * 200}], max_tokens=1)
    assert (error["param"], error["code"]) == ("messages", context)
    error = _refusal(cmpl, prompt=[5] * 100, max_tokens=1)  # ids past the context
    assert (error["param"], error["code"]) == ("prompt", context)
    for kwargs, param, code in (
        ({"stop": ["x"] * 33}, "stop", "invalid_value"),
        ({"stop": ["ok", ""]}, "stop", "invalid_value"),
        ({"temperature": 150.0}, "temperature", "invalid_value"),
        ({"top_p": 0.0}, "top_p", "invalid_value"),
        ({"n": "two"}, "n", "invalid_type"),
    ):
        error = _refusal(cmpl, prompt=[5], max_tokens=4, **kwargs)
        assert (error["param"], error["code"]) == (param, code), error
    error = _refusal(cmpl, prompt=[5], max_tokens=4, extra_body={"min_tokens": 9})
    assert error["param"] == "min_tokens" and "max_tokens 4" in error["message"], error
