"""Tool calls read back from model output (`specmesh.router.tools`): the Hermes and Llama-3.1
JSON formats for ``tool_choice: auto``, the parser picked from the chat template, the grammar
``required`` / a named function force, and OpenAI's ``tool_calls`` shape."""

from __future__ import annotations

import json

import jsonschema
import pytest

from specmesh.protocol.errors import InvalidRequestError
from specmesh.router.openai_schema import ChatBody
from specmesh.router.structured import constraint_of
from specmesh.router.tools import parse_hermes, parse_llama3_json, parser_for, plan_tools

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CLOSED = {**PARAMS, "additionalProperties": False}  # strict by default (`strict_schema`)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}},
    {"type": "function", "function": {"name": "now"}},
]


def test_hermes_calls_and_the_text_before_them() -> None:
    text = (
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n'
        '</tool_call>\n<tool_call>{"name": "now", "arguments": {}}</tool_call>'
    )
    calls = parse_hermes(text)
    assert [(n, json.loads(a)) for n, a in calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("now", {}),
    ]
    message, reason = plan_tools(TOOLS, "auto", True, "hermes").message(text, "stop")
    assert reason == "tool_calls" and message["content"] == "Let me look."
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_weather", "now"]
    assert all(
        c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"]
    )
    assert parse_hermes("<tool_call>{not json}</tool_call>") == []
    assert parse_hermes("no calls here") == []


def test_llama3_json_calls() -> None:
    one = '{"name": "get_weather", "parameters": {"city": "Lima"}}'
    assert parse_llama3_json(one) == [("get_weather", '{"city": "Lima"}')]
    two = '<|python_tag|>{"name": "now", "parameters": {}}; ' + one
    assert [n for n, _ in parse_llama3_json(two)] == ["now", "get_weather"]
    assert parse_llama3_json("The weather is fine.") == []
    assert parse_llama3_json('{"name": "now"} and then text') == []  # not a call alone
    message, reason = plan_tools(TOOLS, "auto", True, "llama3_json").message("Hi there", "stop")
    assert reason == "stop" and message == {"role": "assistant", "content": "Hi there"}


def test_parser_follows_the_chat_template() -> None:
    assert parser_for("{% for t in tools %}<tool_call>{{ t }}</tool_call>{% endfor %}") == "hermes"
    assert parser_for("{{ messages }}") == "llama3_json" == parser_for(None)


def test_required_and_named_force_valid_calls() -> None:
    plan = plan_tools(TOOLS, "required", False, "hermes")
    schema = json.loads(plan.constraint.text)
    output = '[{"name":"get_weather","arguments":{"city":"Rome"}}]'
    jsonschema.validate(json.loads(output), schema)
    with pytest.raises(jsonschema.ValidationError):  # one call only without parallel calls
        jsonschema.validate(
            json.loads(output.replace("]", ',{"name":"now","arguments":{}}]')), schema
        )
    message, reason = plan.message(output, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Rome"}
    assert plan.message(output[:-5], "length") == (
        {"role": "assistant", "content": output[:-5]},
        "length",
    )
    named = plan_tools(
        TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, "hermes"
    )
    assert json.loads(named.constraint.text) == CLOSED
    message, _ = named.message('{"city":"Oslo"}', "stop")
    assert message["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city":"Oslo"}',
    }
    assert plan_tools(TOOLS, "none", True, "hermes").tools is None
    with pytest.raises(InvalidRequestError, match="nope"):
        plan_tools(TOOLS, {"type": "function", "function": {"name": "nope"}}, True, "hermes")
    with pytest.raises(InvalidRequestError, match="needs tools"):
        plan_tools([], "required", True, "hermes")


def test_structured_output_fields_map_to_one_constraint() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    body = ChatBody.model_validate({**base, "response_format": {"type": "json_object"}})
    assert constraint_of(body)[1].kind == "json_object"
    body = ChatBody.model_validate({**base, "guided_json": json.dumps(PARAMS)})
    assert json.loads(constraint_of(body)[1].text) == CLOSED
    body = ChatBody.model_validate({**base, "structured_outputs": {"choice": ["a", "b"]}})
    assert constraint_of(body)[1].kind == "choice"
    assert (
        constraint_of(ChatBody.model_validate({**base, "response_format": {"type": "text"}}))
        is None
    )
    body = ChatBody.model_validate({**base, "guided_regex": "a+", "guided_choice": ["a"]})
    with pytest.raises(InvalidRequestError, match="guided_regex, guided_choice"):
        constraint_of(body)
