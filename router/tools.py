"""Tool calling in chat completions: ``tools`` + ``tool_choice`` to what the request renders and
how its output is read back.

- ``none`` (or no tools): the tools are not rendered; the output is text.
- ``auto`` (the default with tools): the tools are rendered through the chat template
  (``tools=``); the output is parsed for calls by the router's parser, ``hermes``
  (``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, Qwen / Hermes templates) or
  ``llama3_json`` (``{"name": ..., "parameters": ...}``, several joined by ``;``, an optional
  ``<|python_tag|>`` first: Llama 3.1), picked from the chat template (`parser_for`).
- ``required``: the grammar forces a JSON array of calls, ``[{"name": ..., "arguments":
  {...}}]``, each call's ``arguments`` following its function's ``parameters`` schema (one call
  when ``parallel_tool_calls`` is false).
- a named function: the grammar forces that function's ``arguments`` object alone.

Whatever the mode, every tool's ``parameters`` is compiled as a JSON schema before any work
(`ToolPlan.schemas`, by the API's constraint checker) and two tools may not share a name: each
is a 400 naming the field (``tools[1].function.parameters``, ``tools[2].function.name``).

Calls come back as OpenAI's ``tool_calls`` (ids ``call_<24 hex>``, ``arguments`` a JSON string)
with ``finish_reason: "tool_calls"``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

from specmesh.protocol.constraints import Constraint
from specmesh.protocol.errors import InvalidRequestError
from specmesh.router.structured import strict_schema

PARSERS = ("hermes", "llama3_json")
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
Call = tuple[str, str]  # (function name, arguments as JSON text)


# -- the request fields (pydantic, part of `openai_schema.ChatBody`) -----------------------------
class FunctionDef(BaseModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


def parser_for(template: str | None) -> str:
    """``hermes`` when the chat template writes ``<tool_call>`` tags, else ``llama3_json``."""
    return "hermes" if template and "<tool_call>" in template else "llama3_json"


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "none", "auto", "required" or "named"
    tools: list[dict] | None  # rendered by the chat template (None: not rendered)
    parser: str  # how "auto" output is read (PARSERS)
    named: str | None = None  # the function "named" forces
    constraint: Constraint | None = None  # the grammar "required" / "named" force
    # Every tool's ``parameters`` as a JSON-schema constraint, beside the field that holds it
    # (``tools[i].function.parameters``): the API compiles each, whatever the mode.
    schemas: tuple[tuple[str, Constraint], ...] = ()

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """The assistant message for ``text``, and the finish reason (``tool_calls`` when the
        output is one or more calls; an output cut by length stays text)."""
        calls = self.calls(text) if finish_reason != "length" else []
        if not calls:
            return {"role": "assistant", "content": text}, finish_reason
        content = None if self.mode != "auto" else (_before_calls(text, self.parser) or None)
        message = {"role": "assistant", "content": content, "tool_calls": tool_calls(calls)}
        return message, "tool_calls"

    def calls(self, text: str) -> list[Call]:
        if self.mode == "none":
            return []
        if self.mode == "named":
            return [(self.named or "", text)] if _loads(text) is not None else []
        if self.mode == "required":
            items = _loads(text)
            return [(c["name"], _dumps(c["arguments"])) for c in items or []]
        return parse_hermes(text) if self.parser == "hermes" else parse_llama3_json(text)


def plan_tools(
    tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool, parser: str
) -> ToolPlan:
    """``tools`` (OpenAI's tool objects, already shape-checked) and ``tool_choice`` (a mode or
    ``{"type": "function", "function": {"name": ...}}``) -> what to render and enforce. Two
    tools with one name are refused in every mode; each schema is left for the caller to
    compile (`ToolPlan.schemas`)."""
    tools = tools or []
    params = _parameters_by_name(tools)
    schemas = tuple((field, _schema(schema, field)) for field, schema in params.values())
    choice = tool_choice if tool_choice is not None else ("auto" if tools else "none")
    if choice == "none" or (not tools and choice == "auto"):
        return ToolPlan("none", None, parser, schemas=schemas)
    if not tools:
        raise InvalidRequestError(f"tool_choice {choice!r} needs tools", param="tool_choice")
    if choice == "auto":
        return ToolPlan("auto", tools, parser, schemas=schemas)
    if choice == "required":
        one = [
            {"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
             "required": ["name", "arguments"], "additionalProperties": False}
            for name, (_, schema) in params.items()
        ]  # fmt: skip
        array = {"type": "array", "items": {"anyOf": one}, "minItems": 1}
        if not parallel_tool_calls:
            array["maxItems"] = 1
        return ToolPlan("required", tools, parser, None, _schema(array, "tools"), schemas)
    name = choice["function"]["name"]
    if name not in params:
        raise InvalidRequestError(
            f"tool_choice names {name!r}, which is not among the tools", param="tool_choice"
        )
    forced = _schema(params[name][1], params[name][0])
    return ToolPlan("named", tools, parser, name, forced, schemas)


def _parameters_by_name(tools: list[dict]) -> dict[str, tuple[str, dict]]:
    """Each function's name -> (the field of its parameters, its schema); a name that comes
    twice is refused, naming both tools (the second would otherwise replace the first)."""
    found: dict[str, tuple[str, dict]] = {}
    for i, tool in enumerate(tools):
        function = tool["function"]
        name = function["name"]
        if name in found:
            first = found[name][0].removesuffix(".function.parameters")
            raise InvalidRequestError(
                f"tools[{i}].function.name: {name!r} is already the name of {first}; "
                "tool names must be unique", param=f"tools[{i}].function.name",
            )  # fmt: skip
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        if function.get("strict") is not False:  # OpenAI's opt-out
            schema = strict_schema(schema)
        found[name] = (f"tools[{i}].function.parameters", schema)
    return found


def _schema(schema: dict, field: str) -> Constraint:
    """``schema`` as a constraint, a refusal (its size) naming ``field``."""
    try:
        return Constraint.json_schema(schema)
    except InvalidRequestError as e:
        raise InvalidRequestError(f"{field}: {e}", param=field) from None


def tool_calls(calls: list[Call]) -> list[dict]:
    return [
        {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
         "function": {"name": name, "arguments": arguments}}
        for name, arguments in calls
    ]  # fmt: skip


def parse_hermes(text: str) -> list[Call]:
    """Every ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` block that parses."""
    calls = []
    for block in _HERMES.findall(text):
        obj = _loads(block)
        if isinstance(obj, dict) and isinstance(obj.get("name"), str):
            calls.append((obj["name"], _dumps(obj.get("arguments", {}))))
    return calls


def parse_llama3_json(text: str) -> list[Call]:
    """Llama 3.1's JSON calls: the whole output (after an optional ``<|python_tag|>``) is one
    ``{"name": ..., "parameters": {...}}`` object or several joined by ``;``; anything else is
    text (no calls)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(body):
        try:
            obj, end = decoder.raw_decode(body, i)
        except ValueError:
            return []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return []
        args = obj.get("parameters", obj.get("arguments", {}))
        calls.append((obj["name"], _dumps(args)))
        i = end
        while i < len(body) and body[i] in " \t\r\n;":
            i += 1
    return calls


def _before_calls(text: str, parser: str) -> str:
    """The text an ``auto`` answer wrote before its first call (hermes only; a Llama 3.1 call
    is the whole output)."""
    return text.split("<tool_call>", 1)[0].strip() if parser == "hermes" else ""


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _dumps(obj: Any) -> str:
    return obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)
