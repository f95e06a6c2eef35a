"""Structured outputs at the router's public API: the OpenAI / vLLM fields that ask for one
(``response_format``, vLLM's ``structured_outputs`` and ``guided_json`` / ``guided_regex`` /
``guided_choice``) mapped to one `Constraint`, and the compile check that refuses what the
grammar engine cannot compile (400 naming the problem) before any work.

The check compiles with the router's tokenizer, off the event loop, within
`COMPILE_TIMEOUT_S`; a constraint that compiled is remembered (`MAX_CHECKED`), so the ``n``
choices of a request and repeated schemas compile once. The request fields' pydantic models
(`ResponseFormat`, `StructuredOutputs`) live here too; `openai_schema`'s bodies use them. The target compiles again for itself
(it trusts no router), from its own cache.
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from specmesh.protocol.constraints import Constraint, check_compiles, llg_tokenizer
from specmesh.protocol.errors import InvalidRequestError

COMPILE_TIMEOUT_S = 10.0  # the most one constraint may take to compile on the router
MAX_CHECKED = 256  # constraints remembered as compiling
# Schema keywords whose value is one subschema, a list of them, or a map of names to them.
_ONE = ("items", "additionalItems", "additionalProperties", "contains", "not", "if", "then",
        "else", "propertyNames", "unevaluatedItems")  # fmt: skip
_MANY = ("anyOf", "oneOf", "prefixItems", "items")  # "items" as a list: draft 4's tuples
_BY_NAME = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


# -- the request fields (pydantic, part of `openai_schema`'s bodies) -----------------------------
class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs`` (one key set); its ``grammar`` and ``structural_tag`` are
    refused by name (extra keys are errors)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_: dict | bool | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    json_object: bool | None = None


def constraint_of(body: Any) -> tuple[str, Constraint] | None:
    """The body's one structured-output request as (the field that set it, its constraint);
    None when it asks for none. Two set at once is a 400 naming both."""
    found: list[tuple[str, Constraint]] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        found.append(("response_format", Constraint("json_object")))
    elif rf is not None and rf.type == "json_schema":
        js = rf.json_schema
        if js is None or js.schema_ is None:
            raise InvalidRequestError("response_format json_schema needs json_schema.schema")
        schema = js.schema_ if js.strict is False else strict_schema(js.schema_)
        found.append(("response_format", Constraint.json_schema(schema)))
    if body.guided_json is not None:
        found.append(("guided_json", _schema(body.guided_json, "guided_json")))
    if body.guided_regex is not None:
        found.append(("guided_regex", Constraint("regex", body.guided_regex)))
    if body.guided_choice is not None:
        found.append(("guided_choice", Constraint.choice(body.guided_choice)))
    so = body.structured_outputs
    if so is not None:
        for key, make in (
            ("json", lambda v: _schema(v, "structured_outputs.json")),
            ("regex", lambda v: Constraint("regex", v)),
            ("choice", Constraint.choice),
        ):
            value = getattr(so, key + "_" if key == "json" else key)
            if value is not None:
                found.append((f"structured_outputs.{key}", make(value)))
        if so.json_object:
            found.append(("structured_outputs.json_object", Constraint("json_object")))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise InvalidRequestError(f"set one structured output at a time, got {names}")
    return found[0] if found else None


def _schema(value: Any, field: str) -> Constraint:
    if isinstance(value, str):  # vLLM takes the schema as JSON text too
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequestError(f"{field} is not valid JSON: {e}") from None
    if not isinstance(value, dict | bool):
        raise InvalidRequestError(f"{field} must be a JSON schema (an object)")
    return Constraint.json_schema(strict_schema(value))


def strict_schema(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object schema, at any depth,
    that does not say what other properties may be (``additionalProperties`` as ``true`` or a
    schema, or ``unevaluatedProperties``): the grammar then allows only the properties the
    schema names, as OpenAI's strict structured outputs do. Without it the grammar lets a model
    open property after property, and a small one runs to ``max_tokens`` inside the object.
    The members of an ``allOf`` stay open at their own level (each closed would refuse the
    others' properties), and so does the schema that holds it. Returns a new object."""
    return _strict(schema, close=True)


def _strict(schema: Any, close: bool) -> Any:
    if not isinstance(schema, dict):
        return schema  # a boolean schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = _strict(out[key], True)
    for key in _MANY:
        if isinstance(out.get(key), list):
            out[key] = [_strict(s, True) for s in out[key]]
    for key in _BY_NAME:
        if isinstance(out.get(key), dict):
            out[key] = {name: _strict(s, True) for name, s in out[key].items()}
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_strict(s, False) for s in out["allOf"]]
        close = False
    says = "additionalProperties" in out or "unevaluatedProperties" in out
    if close and not says and _is_object(out):
        out["additionalProperties"] = False
    return out


def _is_object(schema: dict) -> bool:
    """Whether ``schema`` describes objects: its type says so, or it has none and names
    properties."""
    kind = schema.get("type")
    if kind is None:
        return any(k in schema for k in ("properties", "required", "patternProperties"))
    return kind == "object" or (isinstance(kind, list) and "object" in kind)


class ConstraintChecker:
    """Compile checks for one router: the engine's tokenizer built once (lazily), the
    constraints that compiled remembered."""

    def __init__(self) -> None:
        self._tokenizer: Any = None
        self._ok: OrderedDict[Constraint, None] = OrderedDict()

    async def check(
        self, constraint: Constraint, hf_tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]
    ) -> None:
        """InvalidRequestError naming the problem unless ``constraint`` compiles (in a thread,
        within `COMPILE_TIMEOUT_S`)."""
        if constraint in self._ok:
            self._ok.move_to_end(constraint)
            return
        if hf_tokenizer is None:
            raise InvalidRequestError(
                "grammar constraints need the router's tokenizer (its targets serve none and no "
                "--tokenizer was given)"
            )
        if self._tokenizer is None:
            self._tokenizer = await asyncio.to_thread(
                llg_tokenizer, hf_tokenizer, vocab_size, eos_ids
            )
        work = asyncio.to_thread(check_compiles, constraint, self._tokenizer)
        try:
            await asyncio.wait_for(work, COMPILE_TIMEOUT_S)
        except TimeoutError:
            raise InvalidRequestError(
                f"the {constraint.kind} constraint did not compile within {COMPILE_TIMEOUT_S} s"
            ) from None
        self._ok[constraint] = None
        if len(self._ok) > MAX_CHECKED:
            self._ok.popitem(last=False)

    async def check_fields(
        self, fields: Iterable[tuple[str, Constraint]], hf_tokenizer: Any, vocab_size: int,
        eos_ids: tuple[int, ...],
    ) -> None:  # fmt: skip
        """`check` on each (field, constraint) in turn; a refusal names its field (``param``:
        ``tools[1].function.parameters``)."""
        for field, constraint in fields:
            try:
                await self.check(constraint, hf_tokenizer, vocab_size, eos_ids)
            except InvalidRequestError as e:
                raise InvalidRequestError(f"{field}: {e}", param=field) from None
