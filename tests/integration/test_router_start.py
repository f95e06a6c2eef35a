"""A router's start against its services. Without ``--tokenizer`` it takes its targets'
(``Target/GetTokenizer``): it serves text and chat as with a local copy, refuses replicas that
disagree or a reply that does not match its digest, and without any tokenizer serves token ids
and says so once. A draft running another dtype than the target refuses the start."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import grpc
import openai
import pytest
from grpc_harness import (
    SPEC,
    LoopThread,
    collect,
    greedy,
    serve_draft,
    serve_router,
    serve_target,
)

from specmesh.client import GenerationClient
from specmesh.defaults import REPO_MODELS
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, TargetConfig
from specmesh.router.server import RouterService, RouterSettings
from specmesh.router.tokenizer import load_tokenizer
from specmesh.rpc.tokenizer_files import TokenizerFiles, read_tokenizer_files
from specmesh.target_service.runtime import TargetRuntime

DEMO = REPO_MODELS / "target"
SMALL = {"num_kv_slots": 4096, "max_requests": 8}  # the default KV cache is 65536 tokens
FETCH = {"tokenizer": None}  # RouterSettings: fetch from the targets


def _copy(src: Path, dst: Path, names: list[str]) -> str:
    dst.mkdir()
    for name in names:
        shutil.copy(src / name, dst / name)
    return str(dst)


@pytest.fixture(scope="module")
def services(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """The demo target (fp32) behind a router with HTTP and no --tokenizer; three tiny targets:
    its checkpoint, a copy whose tokenizer has a chat template, a copy with no tokenizer."""
    root, tiny = tmp_path_factory.mktemp("fetch"), tiny_dir / "target"
    weights = ["config.json", "model.safetensors"]
    dirs = {
        "tiny": str(tiny),
        "other": _copy(tiny, root / "other", [*weights, "tokenizer.json", "tokenizer_config.json"]),
        "bare": _copy(tiny, root / "bare", weights),
    }
    (root / "other" / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    loop = LoopThread()
    start = lambda d, **kw: loop.run(serve_target(TargetRuntime(TargetConfig(d, **SMALL, **kw))))
    s = SimpleNamespace(loop=loop, dirs=dirs, targets={k: start(d) for k, d in dirs.items()})
    if DEMO.is_dir():
        s.demo = start(str(DEMO), dtype="fp32")
        s.router = loop.run(serve_router(s.demo, http_port=0, settings=FETCH))
    yield s
    if DEMO.is_dir():
        loop.run(s.router.stop(0.5))
    for servicer in [*s.targets.values(), *([s.demo] if DEMO.is_dir() else [])]:
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def _start(s, *names: str, drafts: tuple = ()) -> RouterService:
    """A router over the named tiny targets (and ``drafts``), no --tokenizer; the caller closes
    it."""
    address = lambda servicer: f"127.0.0.1:{servicer.host.port}"
    targets = tuple(address(s.targets[n]) for n in names)
    settings = RouterSettings(
        targets, tuple(map(address, drafts)), address="127.0.0.1:0", tokenizer=None
    )

    async def make() -> RouterService:  # its grpc.aio server belongs to the servers' loop
        return RouterService(settings)

    return s.loop.run(make())


def _refused(s, router: RouterService) -> str:
    try:
        with pytest.raises(ValueError) as e:
            s.loop.run(router.start())
        return str(e.value)
    finally:
        s.loop.run(router.close())


needs_demo = pytest.mark.skipif(not DEMO.is_dir(), reason="no committed demo pair")


@needs_demo
def test_fetched_tokenizer_serves_text_as_transformers(services, oracle) -> None:
    tok = load_tokenizer(DEMO)  # the local copy the router no longer needs
    client = openai.OpenAI(
        base_url=f"http://127.0.0.1:{services.router.http_port}/v1", api_key="x", max_retries=0
    )
    prompt, n = "def fibonacci(n):", 12
    r = client.completions.create(
        model="target", prompt=prompt, max_tokens=n, temperature=0, extra_body={"ignore_eos": True}
    )
    expected = oracle(DEMO, tok.encode(prompt), n)
    assert r.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    fetched = services.router.servicer.tokenizer
    assert not Path(fetched.name_or_path).exists()  # the temporary folder is gone once loaded

    # Chat with the demo's template, which came over GetTokenizer (chat_template.jinja).
    messages = [{"role": "user", "content": "hi"}]
    rendered = "# user:\nhi\n# assistant:\n"
    assert fetched.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|bos|>" + rendered
    )
    ids = tok.encode(rendered)  # the router drops the template's BOS: the tokenizer adds one
    chat = client.chat.completions.create(
        model="target", messages=messages, max_tokens=n, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert chat.usage.prompt_tokens == len(ids)
    assert chat.choices[0].message.content == tok.decode(
        oracle(DEMO, ids, n), skip_special_tokens=True
    )


def test_replicas_serving_different_tokenizers_refuse_to_start(services) -> None:
    message = _refused(services, _start(services, "tiny", "other", "bare"))
    assert "target replicas serve different tokenizers" in message
    ports = {k: t.host.port for k, t in services.targets.items()}
    assert f"target-2@127.0.0.1:{ports['bare']}: no tokenizer" in message
    assert f"target-0@127.0.0.1:{ports['tiny']}: " in message
    assert f"target-1@127.0.0.1:{ports['other']}: " in message and "--tokenizer DIR" in message


def test_a_reply_not_matching_its_digest_refuses_to_start(services, monkeypatch) -> None:
    """The target sends its real digest over files with one bit flipped."""
    good = read_tokenizer_files(services.dirs["other"], 1 << 30)
    files = dict(good.files)
    damaged = bytearray(files["tokenizer.json"])
    damaged[-1] ^= 1
    files["tokenizer.json"] = bytes(damaged)
    bad = TokenizerFiles(tuple(files.items()), good.sha256)
    monkeypatch.setattr(services.targets["other"], "tokenizer_files", bad)  # what it answers
    message = _refused(services, _start(services, "other"))
    assert "do not match their digest" in message and good.sha256 in message


def test_without_any_tokenizer_the_router_serves_token_ids(services, oracle, caplog) -> None:
    router = _start(services, "bare")
    try:
        with caplog.at_level(logging.INFO, logger="specmesh"):
            services.loop.run(router.start())
        said = [r for r in caplog.records if "no tokenizer" in r.getMessage()]
        assert [r.levelno for r in said if r.name == "specmesh.router.tokenizer"] == [
            logging.WARNING
        ]
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            ids, text, _ = collect(client.generate(prompt_token_ids=[5, 6, 7], sampling=greedy(6)))
            assert ids == oracle(services.dirs["tiny"], [5, 6, 7], 6) and text == ""
            with pytest.raises(grpc.RpcError) as e:
                collect(client.generate("def add(a, b):", sampling=greedy(2)))
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "targets serve none" in e.value.details()
    finally:
        services.loop.run(router.close())


def test_a_draft_of_another_dtype_refuses_to_start(services, tiny_dir: Path) -> None:
    """Each service picks its own default dtype: a draft that would refuse every feature row
    the target sends (it never casts them) stops the router at start, each service named."""
    cfg = DraftConfig(
        "eagle3", str(tiny_dir / "draft"), str(tiny_dir / "target"), SPEC, dtype="bf16",
        num_kv_slots=4096,
    )  # fmt: skip
    draft = services.loop.run(serve_draft(load_draft(cfg)))
    try:
        message = _refused(services, _start(services, "tiny", drafts=(draft,)))
    finally:
        services.loop.run(draft.host.shutdown(0.5))
    assert "targets and drafts run different dtypes" in message
    assert f"draft-0@127.0.0.1:{draft.host.port}: bf16" in message
    assert f"target-0@127.0.0.1:{services.targets['tiny'].host.port}: fp32" in message
