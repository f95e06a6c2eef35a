"""OpenAI / vLLM semantics of the HTTP API's responses (issue 33): usage counts each prompt once
whatever ``n``, ``echo`` offsets match the returned text (a BOS the text omits takes no room),
streamed echo keeps the prompt's logprobs, ``max_tokens: 0`` with ``echo`` scores the prompt,
and probes may use HEAD."""

from __future__ import annotations

import math

import openai
import pytest
from grpc_harness import serve_http_router
from http_raw import request

from specmesh.router.router_config import RouterConfig
from specmesh.router.server import RouterService, RouterSettings
from specmesh.router.tokenizer import load_tokenizer

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
BOS = 0  # the tiny tokenizer's <|bos|>


def _client(router: RouterService) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="-", max_retries=0
    )


@pytest.fixture(scope="module")
def http(stack, tmp_path_factory):
    router = serve_http_router(stack, tmp_path_factory.mktemp("chat"), TEMPLATE)
    stack.port, stack.oa = router.http_port, _client(router)
    stack.tok = load_tokenizer(stack.dirs.target)
    yield stack
    stack.oa.close()
    stack.loop.run(router.stop(0.5))


@pytest.fixture(scope="module")
def bos_oa(stack, tmp_path_factory):
    """A client of a router whose tokenizer starts every text prompt with BOS (the tiny one
    adds none)."""
    from tokenizers.processors import TemplateProcessing

    tok = load_tokenizer(stack.dirs.target)
    tok._tokenizer.post_processor = TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", BOS)]
    )
    path = tmp_path_factory.mktemp("bos_tokenizer")
    tok.save_pretrained(path)
    address = lambda s: (f"127.0.0.1:{s.host.port}",)
    settings = RouterSettings(
        address(stack.target), address(stack.draft), "127.0.0.1:0",
        RouterConfig(draft_cooldown_s=0.2), tokenizer=str(path), http_address="127.0.0.1:0",
    )  # fmt: skip

    async def start() -> RouterService:
        router = RouterService(settings)
        await router.start()
        return router

    router = stack.loop.run(start())
    client = _client(router)
    yield client
    client.close()
    stack.loop.run(router.stop(0.5))


# -- #11: usage ----------------------------------------------------------------------------------
def test_usage_counts_each_prompt_once_whatever_n(http) -> None:
    a, b = [5, 6, 7, 8], [9, 10]
    args = dict(model="target", prompt=[a, b], n=3, max_tokens=2, **GREEDY)
    r = http.oa.completions.create(**args)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (6, 12)
    chunks = list(
        http.oa.completions.create(**args, stream=True, stream_options={"include_usage": True})
    )
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.completion_tokens) == (6, 12)
    messages = [{"role": "user", "content": "hi"}]
    prompt = http.tok.encode("<|user|>hi\n<|assistant|>", add_special_tokens=True)
    # sampled, not greedy (n > 1), but never stopped early: each choice has its 3 tokens
    chat = http.oa.chat.completions.create(
        model="target", messages=messages, n=2, max_tokens=3, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(prompt), 6)


# -- #12: echo ------------------------------------------------------------------------------------
def _assert_offsets_match(text: str, lp, prompt_len: int, shown: str) -> None:
    """Each prompt token sits at its offset in ``text``, BOS (absent from the text) taking no
    room, and the completion starts right after the prompt. (Completion tokens may be byte
    pieces of one character, "\ufffd" alone: their offsets are not checked one by one.)"""
    assert lp.tokens[0] == "<|bos|>" and lp.token_logprobs[0] is None
    assert lp.text_offset[0] == lp.text_offset[1] == 0
    assert lp.text_offset[prompt_len] == len(shown), (lp.text_offset, shown)
    pairs = zip(lp.tokens[1:prompt_len], lp.text_offset[1:prompt_len], strict=True)
    for token, offset in pairs:
        assert text[offset : offset + len(token)] == token, (token, offset, text)


def test_echo_text_offsets_skip_the_bos_the_text_omits(http, bos_oa) -> None:
    prompt = [BOS, *http.tok.encode("def f(x):")]
    r = http.oa.completions.create(
        model="target", prompt=prompt, max_tokens=5, echo=True, logprobs=1, **GREEDY
    )
    shown = "def f(x):"
    assert r.choices[0].text.startswith(shown)
    _assert_offsets_match(r.choices[0].text, r.choices[0].logprobs, len(prompt), shown)

    text = bos_oa.completions.create(
        model="target", prompt=shown, max_tokens=5, echo=True, logprobs=1, **GREEDY
    )  # the tokenizer adds the BOS: the same ids, the same answer
    assert text.choices[0].text == r.choices[0].text
    _assert_offsets_match(text.choices[0].text, text.choices[0].logprobs, len(prompt), shown)


def _joined(chunks) -> tuple[str, list, list, list]:
    text, tokens, values, offsets = "", [], [], []
    for c in chunks:
        if not c.choices:
            continue
        choice = c.choices[0]
        text += choice.text
        if choice.logprobs is not None:
            tokens += choice.logprobs.tokens
            values += choice.logprobs.token_logprobs
            offsets += choice.logprobs.text_offset
    return text, tokens, values, offsets


def _same_values(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        (x is None and y is None) or math.isclose(x, y, abs_tol=1e-4)
        for x, y in zip(a, b, strict=True)
    )


@pytest.mark.parametrize("max_tokens", [6, 0])
def test_streamed_echo_keeps_the_prompt_logprobs(http, max_tokens: int) -> None:
    """Streamed echo + logprobs equals the whole response: the prompt's tokens, logprobs and
    offsets come first. ``max_tokens: 0`` (vLLM's scoring) returns the prompt alone."""
    prompt = [BOS, *http.tok.encode("import os\n")]
    args = dict(model="target", prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=2)
    whole = http.oa.completions.create(**args, **GREEDY)
    lp = whole.choices[0].logprobs
    assert len(lp.tokens) == len(prompt) + max_tokens
    assert whole.usage.completion_tokens == max_tokens
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.choices[0].finish_reason == "length"
    if max_tokens == 0:
        assert whole.choices[0].text == "import os\n"
    stream = http.oa.completions.create(
        **args, **GREEDY, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text, tokens, values, offsets = _joined(chunks)
    assert text == whole.choices[0].text
    assert (tokens, offsets) == (lp.tokens, lp.text_offset)
    assert _same_values(values, lp.token_logprobs)
    assert chunks[-1].usage.completion_tokens == max_tokens


def test_max_tokens_0_without_echo_names_max_tokens(http) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        http.oa.completions.create(model="target", prompt=[5, 6], max_tokens=0)
    assert "max_tokens" in e.value.message and "max_new_tokens" not in e.value.message
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        http.oa.chat.completions.create(
            model="target", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=0
        )
    assert e.value.body["param"] == "max_completion_tokens", e.value.body


# -- #16: HEAD ------------------------------------------------------------------------------------
def test_probes_may_use_head(http) -> None:
    for path in ("/health", "/metrics"):
        r = request(http.port, "HEAD", path)
        assert (r.status, r.body) == (200, b""), path
    assert request(http.port, "GET", "/health").json() == {"status": "ok"}


def test_usage_counts_prompt_tokens_from_the_prefix_cache(http) -> None:
    """usage.prompt_tokens_details.cached_tokens: the prompt tokens whose KV the target's
    prefix cache had (two full 16-token blocks of a 40-token shared prefix)."""
    shared = [(11 * i + 5) % 200 + 4 for i in range(40)]
    got = [
        http.oa.completions.create(model="target", prompt=shared + tail, max_tokens=2)
        for tail in ([3, 4], [6, 7, 8])
    ]
    assert [u.usage.prompt_tokens_details.cached_tokens for u in got] == [0, 32]
    assert got[1].usage.prompt_tokens == 43
