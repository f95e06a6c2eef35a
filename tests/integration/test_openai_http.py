"""The OpenAI-compatible HTTP API (`specmesh.router.openai_api`) over an in-process stack (tiny
Llama target, EAGLE-3 draft, router with `--http-port`), driven by the official `openai` client:
outputs equal transformers greedy, streaming equals non-streaming, every error is OpenAI's error
object with its HTTP status, and a client that goes away frees the request in both services."""

from __future__ import annotations

import asyncio
import json
import math
import urllib.error
import urllib.request

import openai
import pytest
import torch
from grpc_harness import num_accepted, serve_http_router, serve_router, wait_until
from procs import is_empty, occupancy

from specmesh.router.limits import RouterLimits
from specmesh.router.server import RouterService, RouterSettings
from specmesh.router.tokenizer import load_tokenizer

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
KEY = "sk-test-key"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def http(copy_stack, tmp_path_factory):
    """A router with the HTTP API (and a --chat-template) over a stack whose draft predicts its
    target (`copy_stack`): rounds accept draft tokens, so streamed runs are several tokens."""
    stack = copy_stack
    router = serve_http_router(stack, tmp_path_factory.mktemp("chat"), TEMPLATE)
    base = f"http://127.0.0.1:{router.http_port}"
    stack.tok = load_tokenizer(stack.dirs.target)
    stack.base = base
    stack.oa = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    yield stack
    stack.oa.close()
    stack.loop.run(router.stop(0.5))


def _router(stack, **kwargs) -> RouterService:
    return stack.loop.run(serve_router(stack.target, stack.draft, http_port=0, **kwargs))


def _client(router: RouterService, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key=key, max_retries=0
    )


def _get(url: str, key: str | None = None) -> tuple[int, dict | str]:
    """Status and body (JSON when it is JSON) of a GET."""
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=30) as r:
            status, body = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, body = e.code, e.read().decode()
    return status, json.loads(body) if body.startswith("{") else body


def _assert_error(e: openai.APIStatusError, status: int) -> dict:
    assert e.status_code == status, e
    error = e.response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_models_and_health(http) -> None:
    models = http.oa.models.list()
    assert [m.id for m in models.data] == ["target"]
    assert _get(f"{http.base}/health") == (200, {"status": "ok"})
    status, text = _get(f"{http.base}/metrics")
    assert status == 200 and text.startswith("# HELP")


def test_completion_text_and_token_ids_equal_transformers_greedy(http) -> None:
    accepted = num_accepted()
    prompt = "def fib(n):"
    ids = http.tok.encode(prompt, add_special_tokens=True)
    greedy = http.expected(ids, 12)
    expected = http.tok.decode(greedy, skip_special_tokens=True)
    r = http.oa.completions.create(model="target", prompt=prompt, max_tokens=12, **GREEDY)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == "target"
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 12)
    assert r.usage.total_tokens == len(ids) + 12

    by_ids = http.oa.completions.create(model="target", prompt=ids, max_tokens=12, **GREEDY)
    assert by_ids.choices[0].text == expected
    batch = http.oa.completions.create(
        model="target", prompt=[ids, ids[:3]], max_tokens=5, **GREEDY
    )
    # Greedy output is prefix-stable: 5 tokens are the first 5 of the 12 above.
    head = http.tok.decode(greedy[:5], skip_special_tokens=True)
    short = http.tok.decode(http.expected(ids[:3], 5), skip_special_tokens=True)
    assert head and short  # non-empty, so an empty choice cannot pass
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == [head, short]
    assert [c.finish_reason for c in batch.choices] == ["length", "length"]
    assert batch.usage.completion_tokens == 10
    assert num_accepted() > accepted, "no draft token was accepted"


def test_streaming_text_equals_non_streaming(http) -> None:
    args = dict(model="target", prompt="import os\n", max_tokens=16, **GREEDY)
    whole = http.oa.completions.create(**args)
    accepted = num_accepted()
    chunks = list(
        http.oa.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert num_accepted() > accepted, "no draft token was accepted while streaming"
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and set(finals[:-1]) <= {None}
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16


def test_chat_applies_the_template_then_greedy(http) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    ids = http.tok.apply_chat_template(
        messages, chat_template=TEMPLATE, tokenize=True, add_generation_prompt=True
    )
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    expected = http.tok.decode(http.expected(ids, 10), skip_special_tokens=True)
    r = http.oa.chat.completions.create(model="target", messages=messages, max_tokens=10, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 10

    stream = http.oa.chat.completions.create(
        model="target", messages=messages, max_tokens=10, stream=True, **GREEDY
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


def test_n_choices_and_seeds(http) -> None:
    args = dict(model="target", prompt="class A:", max_tokens=8, extra_body={"ignore_eos": True})
    greedy = http.oa.completions.create(**args, temperature=0.0, n=2)
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].text == greedy.choices[1].text
    assert greedy.usage.completion_tokens == 16
    sampled = http.oa.completions.create(**args, temperature=1.5, n=2, seed=7)
    again = http.oa.completions.create(**args, temperature=1.5, n=2, seed=7)
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]
    single = http.oa.completions.create(**args, temperature=1.5, seed=8)  # choice 1 = seed + 1
    assert sampled.choices[1].text == single.choices[0].text


def test_echo_returns_the_prompt_first(http) -> None:
    r = http.oa.completions.create(
        model="target", prompt="x = 1", max_tokens=4, echo=True, **GREEDY
    )
    plain = http.oa.completions.create(model="target", prompt="x = 1", max_tokens=4, **GREEDY)
    assert r.choices[0].text == "x = 1" + plain.choices[0].text


def test_errors_are_openai_error_objects(http, stack) -> None:
    with pytest.raises(openai.BadRequestError) as e:  # 400: a bad sampling value
        http.oa.completions.create(model="target", prompt="a", temperature=-1)
    assert "temperature" in _assert_error(e.value, 400)["message"]
    with pytest.raises(openai.BadRequestError) as e:  # 400: a body that does not validate
        http.oa.completions.create(model="target", prompt="a", extra_body={"n": 0})
    assert _assert_error(e.value, 400)["param"] == "n"
    with pytest.raises(openai.BadRequestError) as e:  # 400: out-of-vocabulary ids
        http.oa.completions.create(model="target", prompt=[10**6], max_tokens=2)
    _assert_error(e.value, 400)
    with pytest.raises(openai.NotFoundError) as e:  # 404: unknown model
        http.oa.completions.create(model="gpt-4", prompt="a")
    assert _assert_error(e.value, 404)["code"] == "model_not_found"
    status, body = _get(f"{http.base}/v1/nothing")  # 404: unknown route
    assert status == 404 and set(body["error"]) == {"message", "type", "param", "code"}

    limits = RouterLimits(
        max_prompt_bytes=100, max_images_per_request=1, max_image_bytes=100, max_queued_prompts=0
    )
    small = _router(stack, settings={"limits": limits})
    keyed = _router(stack, api_key=KEY)
    try:
        client = _client(small)
        with pytest.raises(openai.APIStatusError) as e:  # 413: body past the derived limit
            client.completions.create(model="target", prompt="x" * 200_000)
        assert _assert_error(e.value, 413)["code"] == "request_too_large"
        with pytest.raises(openai.BadRequestError) as e:  # 400: prompt bytes
            client.completions.create(model="target", prompt="x" * 200)
        assert "--max-prompt-bytes" in _assert_error(e.value, 400)["message"]
        with pytest.raises(openai.RateLimitError) as e:  # 429: tokenizer queue full
            client.completions.create(model="target", prompt="x")
        assert _assert_error(e.value, 429)["type"] == "rate_limit_error"

        with pytest.raises(openai.AuthenticationError) as e:  # 401: wrong key
            _client(keyed, "wrong").completions.create(model="target", prompt="a", max_tokens=1)
        _assert_error(e.value, 401)
        ok = _client(keyed, KEY).completions.create(model="target", prompt="a", max_tokens=2)
        assert ok.usage.completion_tokens >= 1
        base = f"http://127.0.0.1:{keyed.http_port}"
        assert _get(f"{base}/health")[0] == 200  # open without the key
        assert _get(f"{base}/metrics")[0] == 200  # scrapers need no key either
        assert _get(f"{base}/v1/models")[0] == 401
        assert _get(f"{base}/v1/models", KEY)[0] == 200
    finally:
        for router in (small, keyed):
            stack.loop.run(router.stop(0.5))


def test_no_target_is_503(stack) -> None:
    """A router whose target never answers serves HTTP at once, with 503 until it is ready."""
    settings = RouterSettings(
        ("127.0.0.1:1",), address="127.0.0.1:0", http_address="127.0.0.1:0", connect_timeout_s=30
    )

    async def make() -> RouterService:  # its grpc.aio server belongs to the stack's loop
        return RouterService(settings)

    router = stack.loop.run(make())
    starting = asyncio.run_coroutine_threadsafe(router.start(), stack.loop.loop)
    try:
        assert wait_until(lambda: router.http_port != 0)
        with pytest.raises(openai.APIStatusError) as e:
            _client(router).completions.create(model="target", prompt=[1, 2], max_tokens=2)
        assert _assert_error(e.value, 503)["type"] == "service_unavailable_error"
        assert _get(f"http://127.0.0.1:{router.http_port}/health")[0] == 503
    finally:
        starting.cancel()
        stack.loop.run(router.stop(0.1))


def test_client_disconnect_frees_state_in_both_services(http) -> None:
    target = f"127.0.0.1:{http.target.host.port}"
    draft = f"127.0.0.1:{http.draft.host.port}"
    stream = http.oa.completions.create(
        model="target", prompt="def main():", max_tokens=1000, stream=True, **GREEDY
    )
    first = next(iter(stream))
    assert first.choices[0].text is not None
    assert occupancy(target, "target").num_requests == 1
    stream.close()
    assert wait_until(lambda: is_empty(occupancy(target, "target")), 20)
    assert wait_until(lambda: is_empty(occupancy(draft, "draft")), 20)


def test_logprobs_equal_transformers_log_softmax(http) -> None:
    from conftest import _hf_model

    prompt = http.tok.encode("def f(x):", add_special_tokens=True)
    accepted = num_accepted()
    r = http.oa.completions.create(
        model="target", prompt=prompt, max_tokens=6, logprobs=2, **GREEDY
    )
    assert num_accepted() > accepted, "no draft token was accepted"
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs) == 6 and len(lp.text_offset) == 6
    output = http.expected(prompt, 6)
    with torch.no_grad():
        logits = _hf_model(http.dirs.target)(torch.tensor([prompt + output])).logits[0].float()
    ref = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)
    for i, tok in enumerate(output):
        assert math.isclose(lp.token_logprobs[i], ref[i, tok].item(), abs_tol=1e-3)
        # Text -> logprob of the chosen token and the top 2: ids that decode to the same text
        # (byte pieces of one character, all "\ufffd") share one key.
        ranked = [tok, *ref[i].topk(2).indices.tolist()]
        texts = [http.tok.decode([t]) for t in ranked]
        assert set(lp.top_logprobs[i]) == set(texts), (i, lp.top_logprobs[i], ranked)
        for text, value in lp.top_logprobs[i].items():
            shared = [t for t, x in zip(ranked, texts, strict=True) if x == text]
            assert any(math.isclose(value, ref[i, t].item(), abs_tol=1e-3) for t in shared)
    chat = http.oa.chat.completions.create(
        model="target", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2, **GREEDY,
    )  # fmt: skip
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)


def test_bench_http_client_counts_the_tokens(http) -> None:
    from specmesh.bench.http_client import format_results, run_http

    result = run_http(http.base, [[1, 2, 3], [4, 5, 6]], max_new_tokens=5, batch_size=2)
    assert (result.num_requests, result.completion_tokens) == (2, 10)
    assert result.tokens_per_s > 0 and 0 < result.ttft_p50_s <= result.latency_p50_s
    assert "tokens/s" in format_results(http.base, [result])
