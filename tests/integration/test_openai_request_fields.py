"""Request fields the HTTP API once took on trust (issue 54 #6 and its notes), through a real
router over real target and draft services with the `openai` client: every tool's schema is
compiled whatever ``tool_choice`` says and two tools may not share a name, ``logit_bias`` keys
are canonical decimal token ids, token-id prompts (and ``stop_token_ids``) are checked against
the vocabulary before anything else, and ``seed`` takes its whole range whatever ``n`` (choice
j samples with ``(seed + j) mod 2**63``). Each refusal is a 400 whose ``param`` names the
field."""

from __future__ import annotations

import openai
import pytest
from grpc_harness import serve_http_router

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
ASK = [{"role": "user", "content": "the weather in Paris"}]
GOOD = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHOICES = [None, "none", "auto", "required", {"type": "function", "function": {"name": "a"}}]


def _tool(name: str, parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or GOOD}}


@pytest.fixture(scope="module")
def oa(stack, tmp_path_factory):
    router = serve_http_router(stack, tmp_path_factory.mktemp("fields"), TEMPLATE)
    base = f"http://127.0.0.1:{router.http_port}/v1"
    client = openai.OpenAI(base_url=base, api_key="-", max_retries=0)
    client.vocab_size = stack.target.runtime.model_config.vocab_size
    yield client
    client.close()
    stack.loop.run(router.stop(0.5))


def _refused(call, **kwargs) -> dict:
    with pytest.raises(openai.BadRequestError) as e:
        call(model="target", max_tokens=2, **kwargs)
    return e.value.body


def _chat_refused(oa: openai.OpenAI, tools: list[dict], choice) -> dict:
    extra = {} if choice is None else {"tool_choice": choice}
    return _refused(oa.chat.completions.create, messages=ASK, tools=tools, **extra)


# -- #6: tool schemas --------------------------------------------------------------------------
@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: str(c)[:12])
@pytest.mark.parametrize(
    ("bad", "words"), [({"type": "objectx"}, "objectx"), ({"type": "object", "required": 5}, "5")]
)
def test_every_tool_schema_is_compiled_whatever_the_tool_choice(
    oa: openai.OpenAI, choice, bad: dict, words: str
) -> None:
    error = _chat_refused(oa, [_tool("a"), _tool("b", bad)], choice)
    assert error["param"] == "tools[1].function.parameters", error
    assert "tools[1].function.parameters" in error["message"] and words in error["message"]


@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: str(c)[:12])
def test_two_tools_may_not_share_a_name(oa: openai.OpenAI, choice) -> None:
    other = {"type": "object", "properties": {"day": {"type": "integer"}}}
    error = _chat_refused(oa, [_tool("a"), _tool("b"), _tool("a", other)], choice)
    assert error["param"] == "tools[2].function.name", error
    assert "'a'" in error["message"] and "tools[0]" in error["message"], error


def test_good_tools_are_served_in_every_mode(oa: openai.OpenAI) -> None:
    for choice in CHOICES:
        extra = {} if choice is None else {"tool_choice": choice}
        r = oa.chat.completions.create(
            model="target", messages=ASK, tools=[_tool("a"), _tool("b")], max_tokens=2, **extra
        )
        assert r.choices[0].finish_reason in ("length", "stop", "tool_calls"), choice


# -- notes: logit_bias, token ids, seeds -------------------------------------------------------
@pytest.mark.parametrize("key", [" 5 ", "\u0663", "05", "+5", "5.0", "-1", "", "1" * 5000])
def test_logit_bias_keys_are_canonical_decimal_ids(oa: openai.OpenAI, key: str) -> None:
    error = _refused(oa.completions.create, prompt=[5, 6], logit_bias={key: 1.0})
    assert error["param"] == "logit_bias", error
    assert "decimal" in error["message"] or "[0," in error["message"], error


def test_logit_bias_in_range_ids_are_taken(oa: openai.OpenAI) -> None:
    last = str(oa.vocab_size - 1)
    r = oa.completions.create(
        model="target", prompt=[5, 6], max_tokens=2, logit_bias={"5": 1.0, "0": -2.0, last: 3.0}
    )
    assert r.choices[0].text is not None
    error = _refused(oa.completions.create, prompt=[5, 6], logit_bias={str(oa.vocab_size): 1.0})
    assert error["param"] == "logit_bias" and f"[0, {oa.vocab_size})" in error["message"]


@pytest.mark.parametrize("bad", [2**40, -1, "vocab"])
def test_token_ids_past_the_vocabulary_name_prompt_and_the_range(
    oa: openai.OpenAI, bad: int | str
) -> None:
    bad = oa.vocab_size if bad == "vocab" else bad
    for prompt in ([[5], [6, bad]], [5, bad]):
        error = _refused(oa.completions.create, prompt=prompt)
        assert error["param"] == "prompt", error
        assert f"[0, {oa.vocab_size})" in error["message"], error
        assert "Value out of range" not in error["message"], error


def test_stop_token_ids_past_the_vocabulary_name_the_field(oa: openai.OpenAI) -> None:
    for bad in (2**40, oa.vocab_size):
        error = _refused(oa.completions.create, prompt=[5], extra_body={"stop_token_ids": [bad]})
        assert error["param"] == "stop_token_ids", error
        assert f"[0, {oa.vocab_size})" in error["message"], error


def test_every_seed_works_with_any_n(oa: openai.OpenAI) -> None:
    """The largest seed with ``n=2`` is served: choice 1 samples with seed 0 (the derivation
    wraps), so it equals the one choice of a request with seed 0."""
    args = dict(model="target", prompt=[5, 6, 7], max_tokens=6, temperature=1.0)
    r = oa.completions.create(**args, n=2, seed=2**63 - 1)
    wrapped = oa.completions.create(**args, n=1, seed=0)
    assert [c.index for c in r.choices] == [0, 1] and r.choices[0].text != r.choices[1].text
    assert r.choices[1].text == wrapped.choices[0].text
    for seed in (2**63, -1):
        error = _refused(oa.completions.create, prompt=[5], seed=seed, n=2)
        assert error["param"] == "seed", error
        bound = "less than 9223372036854775808" if seed > 0 else "greater than or equal to 0"
        assert bound in error["message"], error


# -- exclude_from_learning ---------------------------------------------------------------------
@pytest.mark.parametrize("exclude", [True, False])
def test_exclude_from_learning_reaches_every_extend(oa: openai.OpenAI, stack, exclude) -> None:
    """specmesh's body field travels router -> draft on each of the request's extends (the
    learner keeps no row of an extend marked so: tests/integration/test_online_grpc.py)."""
    runtime, seen = stack.draft.runtime, []
    step = runtime.step

    def spy(extends, *args, **kwargs):
        seen.extend(e.learn for e in extends)
        return step(extends, *args, **kwargs)

    runtime.step = spy
    try:
        out = oa.completions.create(model="target", prompt=[5, 6, 7], max_tokens=8,
                                    extra_body={"exclude_from_learning": exclude})  # fmt: skip
    finally:
        runtime.step = step
    assert out.choices[0].text is not None
    assert seen and set(seen) == {not exclude}
