"""`router.structured.strict_schema`: every object schema that does not say what other
properties may be is closed, at every depth, and nothing else changes."""

from __future__ import annotations

from specmesh.router.structured import strict_schema

OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}
CLOSED = {**OBJ, "additionalProperties": False}


def test_objects_are_closed_at_every_depth() -> None:
    schema = {
        "type": "object",
        "properties": {"inner": OBJ, "list": {"type": "array", "items": OBJ}},
        "$defs": {"d": OBJ},
        "anyOf": [OBJ, {"type": "string"}],
    }
    out = strict_schema(schema)
    assert out["additionalProperties"] is False
    assert out["properties"]["inner"] == CLOSED == out["properties"]["list"]["items"]
    assert out["$defs"]["d"] == CLOSED and out["anyOf"] == [CLOSED, {"type": "string"}]
    assert "additionalProperties" not in schema  # the caller's schema is left alone
    untyped = {"properties": {"a": {}}}
    assert strict_schema(untyped)["additionalProperties"] is False
    nullable = {"type": ["object", "null"], "properties": {}}
    assert strict_schema(nullable)["additionalProperties"] is False


def test_what_a_schema_says_is_kept() -> None:
    for opened in (True, {"type": "string"}):
        assert strict_schema({**OBJ, "additionalProperties": opened})["additionalProperties"] == (
            opened
        )
    assert "additionalProperties" not in strict_schema({**OBJ, "unevaluatedProperties": False})
    assert strict_schema({"type": "string"}) == {"type": "string"}
    assert strict_schema(True) is True


def test_all_of_members_stay_open_at_their_own_level() -> None:
    """Each member closed would refuse the others' properties."""
    inner = {"type": "object", "properties": {"x": OBJ}}
    out = strict_schema({"allOf": [OBJ, inner]})
    assert "additionalProperties" not in out and out["allOf"][0] == OBJ
    assert out["allOf"][1]["properties"]["x"] == CLOSED  # deeper objects are closed
