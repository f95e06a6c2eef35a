"""Structured outputs and tool calls through the HTTP API (issue 32), driven by the `openai`
client against a real router over real target and EAGLE-3 draft services on the demo pair
(fp32), its outputs checked with `jsonschema`: ``json_schema`` output validates and equals the
same request on a router that never speculates (greedy and seeded), ``json_object`` parses,
``guided_choice`` / ``guided_regex`` hold, a schema the engine cannot compile is a 400 naming
the problem with nothing held afterwards, ``tool_choice: required`` / named return calls whose
arguments validate, streamed calls arrive as ``tool_calls`` deltas, ``continuous_usage_stats``
puts usage on every chunk, and unsupported OpenAI fields are 400s naming them. Over the gRPC
API the draft gets the grammar with each request's starting extend and proposes within it
(constrained rounds accept >= 2 tokens), compiles it while the target does (the router's
PrepareBatch), and no matcher outlives its request, cancelled or not. The draft's Step stream
alone: `test_draft_step_grammar.py`."""

from __future__ import annotations

import json
import re
import threading
from types import SimpleNamespace

import jsonschema
import openai
import pytest
from grpc_harness import (
    LoopThread,
    block_compiles,
    collect,
    num_accepted,
    serve_draft,
    serve_router,
    serve_target,
    wait_until,
)
from procs import is_empty, occupancy

from specmesh.client import GenerationClient
from specmesh.defaults import REPO_MODELS
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.constraints import Constraint
from specmesh.protocol.sampling import SamplingParams
from specmesh.target_service.runtime import TargetRuntime

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "line": {"type": "integer"},
        "kind": {"enum": ["function", "class"]},
    },
    "required": ["name", "line", "kind"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "symbol", "schema": SCHEMA}}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 16},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "Describe the function fibonacci as JSON"}]
MAX_TOKENS = 120  # the demo model finishes these documents well within it


@pytest.fixture(scope="module")
def demo():
    """Demo target + EAGLE-3 draft services; one router that always speculates and one that
    never does, both serving HTTP with the demo's chat template, and gRPC clients of both."""
    target_dir, draft_dir = str(REPO_MODELS / "target"), str(REPO_MODELS / "draft")
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(target_dir, dtype="float32"))))
    spec = SpecParams(num_steps=4, topk=4, num_draft_tokens=8)
    draft = loop.run(
        serve_draft(load_draft(DraftConfig("eagle3", draft_dir, target_dir, spec, dtype="float32")))
    )
    routers = {
        mode: loop.run(serve_router(target, draft, http_port=0, speculation=mode))
        for mode in ("always", "never")
    }
    clients = {
        mode: openai.OpenAI(
            base_url=f"http://127.0.0.1:{r.http_port}/v1", api_key="-", max_retries=0
        )
        for mode, r in routers.items()
    }
    services = {"target": f"127.0.0.1:{target.host.port}", "draft": f"127.0.0.1:{draft.host.port}"}
    grpcs = {mode: GenerationClient(f"127.0.0.1:{r.port}") for mode, r in routers.items()}
    yield SimpleNamespace(clients=clients, services=services, grpc=grpcs, draft=draft.runtime,
                          target=target.runtime)  # fmt: skip
    for client in [*clients.values(), *grpcs.values()]:
        client.close()
    for router in routers.values():
        loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def _chat(client: openai.OpenAI, **kw):
    args = {"model": "target", "messages": ASK, "max_tokens": MAX_TOKENS, **kw}
    return client.chat.completions.create(**args)


def _empty(services: dict) -> bool:
    return all(is_empty(occupancy(addr, kind)) for kind, addr in services.items())


@pytest.mark.parametrize("sampling", [{"temperature": 0.0}, {"temperature": 0.8, "seed": 7}])
def test_json_schema_validates_and_equals_no_speculation(demo, sampling) -> None:
    clients = demo.clients
    outputs = {}
    for mode, client in clients.items():
        accepted = num_accepted()
        r = _chat(client, response_format=FORMAT, **sampling)
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        outputs[mode] = r.choices[0].message.content
        jsonschema.validate(json.loads(outputs[mode]), SCHEMA)
        if mode == "always":  # equal output says nothing unless draft tokens were accepted
            assert num_accepted() > accepted, "the constrained rounds accepted no draft token"
    assert outputs["always"] == outputs["never"]
    outside_strings = re.sub(r'"(\\.|[^"\\])*"', '""', outputs["always"])
    assert not re.search(r"\s", outside_strings), outputs["always"]  # no free whitespace


def test_completions_guided_json_and_json_object(demo) -> None:
    client = demo.clients["always"]
    r = client.completions.create(
        model="target", prompt="import json\n\nDEFAULTS = ", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"guided_json": SCHEMA},
    )  # fmt: skip
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMA)
    r = client.completions.create(
        model="target", prompt="import json\n\nDEFAULTS = ", max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )  # fmt: skip
    assert isinstance(json.loads(r.choices[0].text), dict)


def test_guided_choice_and_regex(demo) -> None:
    client = demo.clients["always"]
    choices = ["yes", "no way", "maybe (later)"]
    for seed in range(3):
        r = _chat(client, temperature=1.0, seed=seed, extra_body={"guided_choice": choices})
        assert r.choices[0].message.content in choices
    pattern = r"def [a-z_]{1,12}\(\):"
    r = _chat(client, temperature=0, extra_body={"structured_outputs": {"regex": pattern}})
    assert re.fullmatch(pattern, r.choices[0].message.content)


def test_invalid_schema_is_a_400_naming_it_and_holds_nothing(demo) -> None:
    clients, services = demo.clients, demo.services
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}
    with pytest.raises(openai.BadRequestError) as e:
        _chat(clients["always"], response_format=bad)
    assert "objectx" in e.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:
        _chat(clients["always"], extra_body={"guided_regex": "(("})
    assert "regex" in e.value.response.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError) as e:  # two structured outputs at once
        _chat(clients["always"], response_format=FORMAT, extra_body={"guided_choice": ["a"]})
    assert "guided_choice" in e.value.response.json()["error"]["message"]
    assert wait_until(lambda: _empty(services))


def test_tool_choice_required_and_named_validate(demo) -> None:
    client = demo.clients["always"]
    params_schema = WEATHER["function"]["parameters"]
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        r = _chat(client, temperature=0, tools=[WEATHER], tool_choice=choice)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        for call in c.message.tool_calls:
            assert call.id.startswith("call_") and call.function.name == "get_weather"
            jsonschema.validate(json.loads(call.function.arguments), params_schema)


def test_streamed_tool_calls_and_continuous_usage(demo) -> None:
    client = demo.clients["always"]
    chunks = list(
        _chat(client, temperature=0, tools=[WEATHER], tool_choice="required", stream=True,
              stream_options={"include_usage": True, "continuous_usage_stats": True})
    )  # fmt: skip
    calls = [tc for ch in chunks for c in ch.choices for tc in c.delta.tool_calls or []]
    assert calls and calls[0].function.name == "get_weather" and calls[0].index == 0
    jsonschema.validate(json.loads(calls[0].function.arguments), WEATHER["function"]["parameters"])
    assert [c.finish_reason for ch in chunks for c in ch.choices][-1] == "tool_calls"
    assert all(ch.usage is not None for ch in chunks[1:])  # the role chunk is sent before any
    counts = [ch.usage.completion_tokens for ch in chunks[1:]]
    assert counts == sorted(counts) and counts[-1] > 0


def test_text_stream_has_usage_on_every_chunk(demo) -> None:
    client = demo.clients["always"]
    chunks = list(
        client.completions.create(
            model="target", prompt="def f():\n", max_tokens=8, temperature=0, stream=True,
            stream_options={"continuous_usage_stats": True},
        )
    )  # fmt: skip
    assert chunks and all(ch.usage is not None for ch in chunks)
    assert chunks[-1].usage.completion_tokens == 8


@pytest.mark.parametrize(
    ("field", "value"),
    [("audio", {"voice": "alloy", "format": "wav"}), ("prediction", {"type": "content", "content": "x"}),
     ("reasoning_effort", "low"), ("functions", [{"name": "f"}]), ("store", True),
     ("guided_grammar", "start: 'a'"), ("modalities", ["text", "audio"])],
)  # fmt: skip
def test_unsupported_fields_are_400_naming_them(demo, field, value) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _chat(demo.clients["always"], extra_body={field: value})
    error = e.value.response.json()["error"]
    assert error["param"] == field and field in error["message"]


# -- the draft within the grammar (gRPC) ------------------------------------------------------------
PROMPT = "# user:\nDescribe the function fibonacci as JSON\n# assistant:\n"


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_draft_proposes_within_the_grammar_over_grpc(demo, monkeypatch, temperature) -> None:
    """The starting extend carries the constraint over the wire; output equals the router that
    never speculates; greedy rounds accept >= 2 tokens (an unmasked draft: ~1.3)."""
    starts = []
    advance = demo.draft.grammars.advance
    monkeypatch.setattr(demo.draft.grammars, "advance",
                        lambda inp: (inp.new and starts.append(inp)) or advance(inp))  # fmt: skip
    params = SamplingParams(
        MAX_TOKENS, temperature, seed=3, constraint=Constraint.json_schema(SCHEMA)
    )
    out = {m: collect(c.generate(PROMPT, sampling=params)) for m, c in demo.grpc.items()}
    ids, text, last = out["always"]
    assert ids == out["never"][0] and last.finish_reason == "stop"
    jsonschema.validate(json.loads(text), SCHEMA)
    assert last.stats.num_draft_tokens >= last.stats.num_rounds  # a tree every round
    if temperature == 0.0:
        assert last.stats.mean_accept_len >= 2.0, list(last.stats.accept_lens)
    (start,) = starts
    assert start.constraint == params.constraint
    assert start.output_start == last.stats.prompt_tokens == len(start.committed_ids)
    assert wait_until(lambda: not demo.draft.grammars.tracks and _empty(demo.services))


def test_a_cancelled_request_leaves_no_matcher(demo) -> None:
    params = SamplingParams(MAX_TOKENS, 0.0, constraint=Constraint.json_schema(SCHEMA))
    call = demo.grpc["always"].generate(PROMPT, sampling=params)
    next(call)
    assert wait_until(lambda: demo.draft.grammars.tracks)  # its draft holds its matcher
    call.cancel()
    assert wait_until(lambda: not demo.draft.grammars.tracks and _empty(demo.services))


def test_the_draft_compiles_a_new_grammar_while_the_target_does(demo, monkeypatch) -> None:
    """As the router sends a constrained request's prefill to the target it sends the draft a
    PrepareBatch: the draft's compile starts while the target's is still running (blocked here
    on an event), not after the prefill's answer, and the request is served."""
    go = block_compiles(demo.target.grammars, monkeypatch)
    schema = {"type": "object", "properties": {"prepared": {"type": "integer"}}}
    constraint = Constraint.json_schema(schema)
    params = SamplingParams(16, 0.0, constraint=constraint)
    done: list = []
    call = threading.Thread(target=lambda: done.append(collect(demo.grpc["always"].generate(
        PROMPT, sampling=params))))  # fmt: skip
    call.start()
    try:
        compiles = demo.draft.grammars.grammars._compiled  # the draft's, started or done
        assert wait_until(lambda: constraint in compiles)
        assert not done  # the target still compiles: no prefill answer yet
    finally:
        go.set()
        call.join(60)
    (_, text, last) = done[0]
    assert last.finish_reason in ("stop", "length") and text.startswith("{")
