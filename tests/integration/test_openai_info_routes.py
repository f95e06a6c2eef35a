"""The HTTP routes that generate nothing (issue 51): ``GET /v1/models/{id}`` (through the
`openai` client), and vLLM's ``GET /version``, ``POST /tokenize`` and ``POST /detokenize``
(raw HTTP: the client has no call for them), shaped as vLLM shapes them; tokenizing keeps the
router's limits and its tokenizer threads."""

from __future__ import annotations

import threading
import time

import openai
import pytest
from grpc_harness import serve_http_router, serve_router, wait_until
from http_raw import request

from specmesh import __version__
from specmesh.router.limits import RouterLimits
from specmesh.router.tokenizer import load_tokenizer

TEMPLATE = "<|bos|>{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}" + (
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def http(stack, tmp_path_factory):
    router = serve_http_router(stack, tmp_path_factory.mktemp("chat"), TEMPLATE)
    stack.port = router.http_port
    stack.oa = openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="-", max_retries=0
    )
    stack.tok = load_tokenizer(stack.dirs.target)
    yield stack
    stack.oa.close()
    stack.loop.run(router.stop(0.5))


def _post(http, path: str, body: dict) -> tuple[int, dict]:
    r = request(http.port, "POST", path, body)
    return r.status, r.json()


def test_a_model_is_retrieved_by_its_id(http) -> None:
    listed = http.oa.models.list().data[0]
    model = http.oa.models.retrieve("target")
    assert (model.id, model.object, model.owned_by) == ("target", "model", "specmesh")
    assert model.max_model_len == listed.max_model_len == 1024
    for missing in ("nope", "org/nope"):  # ids may hold "/": still the model route
        with pytest.raises(openai.NotFoundError) as e:
            http.oa.models.retrieve(missing)
        error = e.value.response.json()["error"]
        assert (error["code"], error["param"]) == ("model_not_found", "model"), error


def test_version(http) -> None:
    r = request(http.port, "GET", "/version")
    assert (r.status, r.json()) == (200, {"version": __version__})


def test_tokenize_a_prompt_as_a_completion_gets_it(http) -> None:
    text = "def fib(n):"
    status, out = _post(http, "/tokenize", {"model": "target", "prompt": text})
    ids = http.tok.encode(text, add_special_tokens=True)
    assert status == 200 and out == {
        "count": len(ids), "max_model_len": 1024, "tokens": ids, "token_strs": None
    }  # fmt: skip
    r = http.oa.completions.create(model="target", prompt=text, max_tokens=1)
    assert r.usage.prompt_tokens == out["count"]
    body = {"prompt": text, "add_special_tokens": False, "return_token_strs": True}
    status, out = _post(http, "/tokenize", body)
    ids = http.tok.encode(text, add_special_tokens=False)
    assert out["tokens"] == ids and out["token_strs"] == http.tok.convert_ids_to_tokens(ids)


def test_tokenize_messages_as_a_chat_completion_gets_them(http) -> None:
    messages = [{"role": "user", "content": "hi"}]
    status, out = _post(http, "/tokenize", {"model": "target", "messages": messages})
    r = http.oa.chat.completions.create(model="target", messages=messages, max_tokens=1)
    assert status == 200 and out["count"] == r.usage.prompt_tokens == len(out["tokens"])
    rendered = http.tok.encode("<|bos|><|user|>hi\n<|assistant|>", add_special_tokens=False)
    assert out["tokens"] == rendered
    _, bare = _post(http, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert bare["tokens"] == rendered[: -len(http.tok.encode("<|assistant|>"))]


@pytest.mark.parametrize(
    ("body", "param"),
    [({"model": "nope", "prompt": "x"}, "model"), ({"prompt": "x", "messages": []}, "prompt"),
     ({}, "prompt"), ({"prompt": "x", "continue_final_message": True}, "continue_final_message"),
     ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
     ({"prompt": "é" * 600_000}, "prompt")],
)  # fmt: skip
def test_tokenize_refusals_name_their_field(http, body: dict, param: str) -> None:
    status, out = _post(http, "/tokenize", body)
    assert status in (400, 404) and out["error"]["param"] == param, out


def test_detokenize(http) -> None:
    ids = http.tok.encode("import os\n", add_special_tokens=True)
    status, out = _post(http, "/detokenize", {"model": "target", "tokens": ids})
    assert (status, out) == (200, {"prompt": http.tok.decode(ids)})
    for tokens in ([5, 320], [5] * 1025, "5", None):
        status, out = _post(http, "/detokenize", {"tokens": tokens})
        assert status == 400 and out["error"]["param"] == "tokens", out


def test_tokenizing_runs_on_the_tokenizer_threads_under_their_limit(stack) -> None:
    """One long prompt tokenizing holds the one queue slot: /health answers meanwhile, and the
    next /tokenize is refused at once (429), as a text prompt of a completion would be."""
    limits = RouterLimits(max_queued_prompts=1, tokenizer_threads=1)
    settings = {"limits": limits}
    router = stack.loop.run(serve_router(stack.target, stack.draft, http_port=0, settings=settings))
    port = router.http_port
    try:
        long = {"prompt": "x = 1\n" * ((1 << 20) // 6)}
        threading.Thread(
            target=lambda: request(port, "POST", "/tokenize", long), daemon=True
        ).start()
        assert wait_until(lambda: router.servicer.prompts.queued == 1, 30)
        start = time.perf_counter()
        assert request(port, "GET", "/health").status == 200
        assert time.perf_counter() - start < 1.0
        r = request(port, "POST", "/tokenize", {"prompt": "x = 1"})
        assert r.status == 429 and r.json()["error"]["code"] == "rate_limit_exceeded", r.json()
        assert wait_until(lambda: router.servicer.prompts.queued == 0, 30)
        assert request(port, "POST", "/tokenize", {"prompt": "x = 1"}).status == 200
    finally:
        stack.loop.run(router.stop(0.5))
