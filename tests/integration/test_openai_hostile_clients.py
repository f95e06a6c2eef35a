"""The HTTP front against hostile or careless clients (issue 33), over real servers on loopback:
huge bodies are refused while they arrive (the router keeps answering, its memory stays flat),
counts are checked before any work, a bad value fails alone, dropped clients free their
requests, and refusals, dropped bodies and slow clients leave clean log lines, no tracebacks."""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import chain, repeat

import openai
import pytest
from conftest import rss_mb
from grpc_harness import serve_http_router, serve_router, wait_until
from http_raw import (
    connect,
    is_closed,
    read_response,
    request,
    send_chunked_until_answered,
    send_head,
)
from procs import is_empty, occupancy

from specmesh.protocol.errors import ServiceDownError
from specmesh.router.limits import RouterLimits
from specmesh.router.metrics import REGISTRY
from specmesh.router.tokenizer import load_tokenizer

TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"
GREEDY = {"temperature": 0.0, "extra_body": {"ignore_eos": True}}
PIECE = 256 << 10  # bytes per chunk of a streamed body


@pytest.fixture(scope="module")
def http(stack, tmp_path_factory):
    router = serve_http_router(stack, tmp_path_factory.mktemp("chat"), TEMPLATE)
    stack.port = router.http_port
    stack.tok = load_tokenizer(stack.dirs.target)
    stack.oa = openai.OpenAI(base_url=f"http://127.0.0.1:{router.http_port}/v1", api_key="-")
    yield stack
    stack.oa.close()
    stack.loop.run(router.stop(0.5))


def _empty(stack) -> bool:
    return is_empty(occupancy(f"127.0.0.1:{stack.target.host.port}", "target")) and is_empty(
        occupancy(f"127.0.0.1:{stack.draft.host.port}", "draft")
    )


def _greedy_text(http, ids: list[int], n: int) -> str:
    return http.tok.decode(http.expected(ids, n), skip_special_tokens=True)


def _stream_body(port: int, path: str, pieces, between) -> tuple[int, object]:
    with connect(port) as sock:
        send_head(sock, "POST", path, {"Transfer-Encoding": "chunked"})
        return send_chunked_until_answered(sock, pieces, between)


def _repeat_to(head: bytes, item: bytes, total: int) -> Iterator[bytes]:
    """``head`` then ``item`` repeated, in ``PIECE``-sized chunks, ``total`` bytes in all."""
    piece = item * (PIECE // len(item))
    return chain([head], repeat(piece, total // len(piece)))


# -- #2: bodies ----------------------------------------------------------------------------------
def test_a_huge_declared_body_is_refused_before_it_is_sent(http) -> None:
    """50 MB of token ids announced by Content-Length: 413 after the first bytes, naming the
    endpoint's limit (derived from the prompt limits), while the router keeps answering."""
    with connect(http.port) as sock:
        send_head(sock, "POST", "/v1/completions", {"Content-Length": str(50_000_000)})
        sock.sendall(b'{"model": "target", "prompt": [' + b"1, " * 20_000)
        r = read_response(sock)
    assert r.status == 413, r
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and "50000000 bytes" in error["message"], error
    limit = int(re.search(r"limit of (\d+)", error["message"]).group(1))
    assert limit < 8 << 20 and "--max-prompt-bytes" in error["message"], error
    assert request(http.port, "GET", "/health").status == 200


def test_a_streamed_huge_token_id_body_is_cut_while_the_router_answers(http) -> None:
    """50 MB of token ids without Content-Length: refused once it passes the limit, long
    before its end; between its pieces /health answers and a greedy request is exact; the
    router's memory does not grow with the body."""
    before = rss_mb()
    healths, texts = [], []

    def between(sent: int) -> None:
        healths.append(request(http.port, "GET", "/health").status)
        if len(texts) < 2:
            r = http.oa.completions.create(model="target", prompt=[5, 6, 7], max_tokens=6, **GREEDY)
            texts.append(r.choices[0].text)

    head = b'{"model": "target", "max_tokens": 1, "prompt": ['
    sent, r = _stream_body(
        http.port, "/v1/completions", _repeat_to(head, b"1, ", 50 << 20), between
    )
    assert r is not None and r.status == 413, (sent, r)
    assert r.json()["error"]["code"] == "request_too_large"
    assert sent < 16 << 20, f"refused only after {sent} bytes"
    assert healths and set(healths) == {200}
    assert texts == [_greedy_text(http, [5, 6, 7], 6)] * 2
    assert rss_mb() - before < 200


@pytest.mark.parametrize(
    "item",
    [
        b'{"role": "user", "content": "hi"}, ',  # a million messages
        b'{"role": "user", "content": [{"type": "image_url", "image_url": {"url": '
        b'"data:image/png;base64,AAAA"}}]}, ',  # 200k+ image parts
    ],
    ids=["messages", "image_parts"],
)
def test_a_streamed_huge_chat_body_is_cut_while_the_router_answers(http, item: bytes) -> None:
    before = rss_mb()
    healths = []
    pieces = _repeat_to(b'{"model": "target", "messages": [', item, 40 << 20)
    sent, r = _stream_body(
        http.port, "/v1/chat/completions", pieces,
        lambda _: healths.append(request(http.port, "GET", "/health").status),
    )  # fmt: skip
    assert r is not None and r.status == 413, (sent, r)
    assert sent < 20 << 20, f"refused only after {sent} bytes"
    assert healths and set(healths) == {200}
    assert rss_mb() - before < 200
    assert _empty(http)


def test_chat_counts_are_checked_before_any_work(http) -> None:
    """Messages, content parts and images are counted on the parsed JSON, before anything is
    decoded or rendered: the first image here is not base64, yet the count is what is refused."""
    chat = lambda messages: http.oa.chat.completions.create(
        model="target", messages=messages, max_tokens=1
    )
    with pytest.raises(openai.BadRequestError) as e:
        chat([{"role": "user", "content": "a"}] * 3000)
    assert re.search(r"3000 messages exceed the limit of \d+", e.value.message), e.value
    part = {"type": "text", "text": "a"}
    with pytest.raises(openai.BadRequestError) as e:
        chat([{"role": "user", "content": [part] * 3000}])
    assert re.search(r"3000 content parts exceed the limit of \d+", e.value.message), e.value
    images = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,@@"}}]
    images += [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}] * 999
    with pytest.raises(openai.BadRequestError) as e:
        chat([{"role": "user", "content": images}])
    assert "1000 images exceed the limit of 8" in e.value.message, e.value
    assert "--max-images-per-request" in e.value.message


def test_completion_batches_are_counted_before_any_work(http) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        http.oa.completions.create(model="target", prompt=["a"] * 1000, max_tokens=1)
    assert re.search(r"1000 choices \(1000 prompts x n=1\) exceed the limit of \d+", str(e.value))
    with pytest.raises(openai.BadRequestError) as e:
        http.oa.completions.create(model="target", prompt=[[1, 2]] * 100, n=3, max_tokens=1)
    assert "300 choices (100 prompts x n=3)" in e.value.message
    with pytest.raises(openai.BadRequestError) as e:  # a prompt that is not ids nor text
        http.oa.completions.create(model="target", prompt=[[1, "a"]], max_tokens=1)
    assert e.value.body["param"] == "prompt"
    assert _empty(http)


# -- #3: one bad value fails alone ---------------------------------------------------------------
def test_top_k_past_int32_is_refused_while_8_requests_run_exactly(http) -> None:
    prompts = [[5 + i, 6, 7] for i in range(8)]
    create = http.oa.completions.create
    bad_body = {"ignore_eos": True, "top_k": 2**31}
    with ThreadPoolExecutor(9) as pool:
        good = [
            pool.submit(create, model="target", prompt=p, max_tokens=8, **GREEDY) for p in prompts
        ]
        bad = pool.submit(
            create, model="target", prompt=prompts[0], max_tokens=8, extra_body=bad_body
        )
        with pytest.raises(openai.BadRequestError) as e:
            bad.result()
        texts = [f.result().choices[0].text for f in good]
    error = e.value.body
    assert "top_k" in error["message"] and error["type"] == "invalid_request_error", error
    assert texts == [_greedy_text(http, p, 8) for p in prompts]
    assert wait_until(lambda: _empty(http), 20)


# -- #4: dropped non-streaming clients -----------------------------------------------------------
@pytest.mark.parametrize("api_key", [None, "sk-test"], ids=["open", "api_key"])
def test_dropped_non_streaming_clients_abort_their_requests(http, api_key: str | None) -> None:
    """Three clients drop their non-streaming requests mid-generation: each is aborted (not run
    to its 1000 tokens) and the services hold nothing; with an API key too (its check must not
    hide the disconnect)."""
    router = None
    if api_key is not None:
        router = http.loop.run(serve_router(http.target, http.draft, http_port=0, api_key=api_key))
    port = router.http_port if router is not None else http.port
    aborts = lambda: REGISTRY.get_sample_value(
        "specmesh_request_success_total", {"model_name": "target", "finished_reason": "abort"}
    ) or 0.0  # fmt: skip
    before = aborts()
    target = f"127.0.0.1:{http.target.host.port}"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    socks = []
    try:
        for i in range(3):
            body = {"model": "target", "prompt": [5 + i, 6, 7], "max_tokens": 1000}
            data = json.dumps({**body, "temperature": 0, "ignore_eos": True}).encode()
            sock = connect(port)
            send_head(
                sock, "POST", "/v1/completions", {**headers, "Content-Length": str(len(data))}
            )
            sock.sendall(data)
            socks.append(sock)
        assert wait_until(lambda: occupancy(target, "target").num_requests == 3, 20)
        for sock in socks:
            sock.close()
        assert wait_until(lambda: aborts() - before == 3, 20), aborts() - before
        assert wait_until(lambda: _empty(http), 20)
    finally:
        if router is not None:
            http.loop.run(router.stop(0.5))
    r = http.oa.completions.create(model="target", prompt=[5, 6, 7], max_tokens=6, **GREEDY)
    assert r.choices[0].text == _greedy_text(http, [5, 6, 7], 6)


# -- #10: clean refusals, timeouts ---------------------------------------------------------------
@contextlib.contextmanager
def captured_logs() -> Iterator[list[logging.LogRecord]]:
    """Every record of the specmesh and uvicorn loggers (INFO and up) while the block runs."""
    seen: dict[int, logging.LogRecord] = {}

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen[id(record)] = record

    handler, records = Keep(logging.INFO), []
    loggers = [logging.getLogger(n) for n in ("", "specmesh", "uvicorn", "uvicorn.error")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
    logging.getLogger("specmesh").setLevel(logging.INFO)
    try:
        yield records
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
        records += seen.values()


def test_refusals_dropped_bodies_and_slow_clients_log_no_traceback(stack) -> None:
    limits = RouterLimits(max_queued_prompts=0, http_header_timeout_s=1, http_body_timeout_s=1)
    router = stack.loop.run(
        serve_router(stack.target, stack.draft, http_port=0, settings={"limits": limits})
    )
    port = router.http_port
    oa = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    make_request = router.servicer._make_request

    async def unavailable(core, msg, params=None):
        if list(msg.prompt_token_ids) == [9, 9]:
            raise ServiceDownError("no target replica left")
        return await make_request(core, msg, params)

    router.servicer._make_request = unavailable
    try:
        with captured_logs() as records:
            with pytest.raises(openai.RateLimitError):  # 429: the tokenizer queue is full
                oa.completions.create(model="target", prompt="x", max_tokens=1)
            with pytest.raises(openai.InternalServerError) as e:  # 503
                oa.completions.create(model="target", prompt=[9, 9], max_tokens=1)
            assert e.value.status_code == 503
            with connect(port) as sock:  # a body dropped halfway
                send_head(sock, "POST", "/v1/completions", {"Content-Length": "1000"})
                sock.sendall(b'{"model": "tar')
            with connect(port) as sock:  # a body that stops coming: 408, then closed
                send_head(sock, "POST", "/v1/completions", {"Content-Length": "1000"})
                sock.sendall(b'{"model": "target"')
                r = read_response(sock)
                assert r.status == 408 and "http_body_timeout_s" in r.json()["error"]["message"]
                assert is_closed(sock, 20)
            with connect(port) as sock:  # headers that never end: closed
                sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
                assert is_closed(sock, 20)
            with connect(port) as sock:  # a connection that never sends anything: closed
                assert is_closed(sock, 20)
            assert request(port, "GET", "/health").status == 200
            ok = oa.completions.create(model="target", prompt=[5, 6], max_tokens=2,
                                       extra_body={"ignore_eos": True})  # fmt: skip
            assert ok.usage.completion_tokens == 2
        messages = [r.getMessage() for r in records]
        assert any("while sending its body" in m for m in messages), messages
        tracebacks = [r for r in records if r.exc_info or "Exception in ASGI" in r.getMessage()]
        assert not tracebacks, [r.getMessage() for r in tracebacks]
    finally:
        oa.close()
        stack.loop.run(router.stop(0.5))
