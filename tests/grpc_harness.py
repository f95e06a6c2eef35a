"""In-process gRPC stacks for tests: real `grpc.aio` servers on loopback in a background event
loop, so the tests stay synchronous."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
from conftest import PATIENT_DRAFT

from specmesh.client import GenerationClient
from specmesh.draft_service import server as draft_server
from specmesh.draft_service.runtime import DraftRuntime, load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.router_config import RouterConfig
from specmesh.router.server import RouterService, RouterSettings
from specmesh.rpc.inline_steps import InlineSteps
from specmesh.rpc.security import TlsFiles
from specmesh.rpc.service_common import start_model
from specmesh.target_service import server as target_server
from specmesh.target_service.runtime import TargetRuntime
from specmesh.v1 import draft_pb2_grpc, target_pb2_grpc


class LoopThread:
    """An event loop in a daemon thread: the servers live there, the tests stay synchronous."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()

    def run(self, coro, timeout: float = 60.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


def _mtls(tls: TlsFiles | None):
    """A model service's credentials: TLS requiring client certificates signed by the CA."""
    return tls.server_credentials(require_client_auth=True) if tls else None


async def serve_target(
    runtime: TargetRuntime, *, tls: TlsFiles | None = None, port: int = 0
) -> target_server.TargetServicer:
    servicer = target_server.make_servicer(f"127.0.0.1:{port}", 64 << 20)
    add = target_pb2_grpc.add_TargetServicer_to_server
    await start_model(servicer, add, runtime, target_server.warm_up, _mtls(tls))
    return servicer


async def serve_draft(
    runtime: DraftRuntime, port: int = 0, *, tls: TlsFiles | None = None
) -> draft_server.DraftServicer:
    servicer = draft_server.make_servicer(f"127.0.0.1:{port}", 64 << 20)
    add = draft_pb2_grpc.add_DraftServicer_to_server
    await start_model(servicer, add, runtime, None, _mtls(tls))
    return servicer


async def serve_router(
    target, draft=None, *, tls: TlsFiles | None = None, api_key: str | None = None,
    http_port: int | None = None, settings: dict | None = None, **core,
) -> RouterService:  # fmt: skip
    """A router over in-process servicers (``target``: one, or a list of replicas); its
    tokenizer is the target's checkpoint (as ``--tokenizer``; ``settings={"tokenizer": None}``
    fetches it from the target instead). ``http_port``: serve the OpenAI HTTP API too (0: any
    free port, `RouterService.http_port`); ``settings``: more `RouterSettings` fields."""
    targets = list(target) if isinstance(target, list | tuple) else [target]
    addr = lambda s: (f"127.0.0.1:{s.host.port}",) if s is not None else ()
    cfg = RouterConfig(**{"draft_cooldown_s": 0.2, **PATIENT_DRAFT, **core})
    http = {"http_address": f"127.0.0.1:{http_port}"} if http_port is not None else {}
    settings = {"tokenizer": targets[0].runtime.cfg.model_dir, **http, **(settings or {})}
    settings = RouterSettings(
        tuple(a for t in targets for a in addr(t)), addr(draft), "127.0.0.1:0", cfg, tls=tls,
        api_key=api_key, **settings,
    )  # fmt: skip
    service = RouterService(settings)
    await service.start()
    return service


def serve_http_router(stack, template_dir: Path, template: str, **core):
    """A router with the HTTP API over ``stack``'s target and draft, its chat template
    ``template`` written under ``template_dir`` (``--chat-template``)."""
    path = template_dir / "template.jinja"
    path.write_text(template)
    settings = {"chat_template": str(path)}
    return stack.loop.run(
        serve_router(stack.target, stack.draft, http_port=0, settings=settings, **core)
    )


def count_batches(servicer) -> dict:
    """Count the Step batches a servicer runs and the status codes of their results (wraps its
    hook on the instance)."""
    counter, inner = {"batches": 0, "codes": []}, servicer.run_batch

    def run_batch(*args):
        counter["batches"] += 1
        answer = inner(*args)
        counter["codes"] += [answer[0].status.code, *(r.status.code for r in answer[0].results)]
        return answer

    servicer.run_batch = run_batch
    return counter


@contextlib.contextmanager
def held_worker(servicer) -> Iterator[None]:
    """Every Step batch of ``servicer`` waits until the block ends: its steps go to its worker
    thread (never inline on the event loop, `rpc.inline_steps`), whose next job is a wait."""
    inline, servicer.inline = servicer.inline, InlineSteps(max_ms=0)
    gate = threading.Event()
    servicer.worker.submit(gate.wait)
    try:
        yield
    finally:
        gate.set()
        servicer.inline = inline


def wait_until(predicate, timeout_s: float = 10.0) -> bool:
    """Poll ``predicate`` until it holds (a service frees a stream's state on its own thread)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def collect(responses) -> tuple[list[int], str, object]:
    ids, text, last = [], "", None
    for r in responses:
        ids += r.token_ids
        text += r.text
        last = r
    return ids, text, last


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


SPEC = SpecParams(3, 2, 6)


def open_stack(models: Path, oracle: Callable, draft: str = "draft") -> Iterator[SimpleNamespace]:
    """Target (``models/target``), EAGLE-3 draft (``models/<draft>``) and router servers, plus a
    client; torn down after."""
    target_dir, draft_dir = str(models / "target"), str(models / draft)
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(target_dir))))
    eagle3 = load_draft(DraftConfig("eagle3", draft_dir, target_dir, SPEC))
    draft = loop.run(serve_draft(eagle3))
    router = loop.run(serve_router(target, draft))
    client = GenerationClient(f"127.0.0.1:{router.port}")
    s = SimpleNamespace(loop=loop, target=target, draft=draft, router=router, client=client)
    s.dirs = SimpleNamespace(target=target_dir, draft=draft_dir)
    s.expected = lambda prompt, n: oracle(target_dir, prompt, n)
    yield s
    client.close()
    loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def num_accepted() -> float:
    """Draft tokens accepted so far by every router in this process (`router.metrics` counts
    in one registry per process): read it before and after a request to see what it accepted."""
    from specmesh.router.metrics import REGISTRY

    name = "specmesh_spec_decode_num_accepted_tokens_total"
    return sum(s.value for m in REGISTRY.collect() for s in m.samples if s.name == name)


def generate_all(
    client: GenerationClient, prompts: list[list[int]], params: SamplingParams, **kw
) -> tuple[dict[int, list[int]], dict[int, str]]:
    """Every prompt at once, one thread each (``kw``: more `GenerationClient.generate`
    arguments): the tokens of each that finished, and the status of each that failed."""
    outputs: dict[int, list[int]] = {}
    errors: dict[int, str] = {}

    def run(k: int) -> None:
        call = client.generate(prompt_token_ids=prompts[k], sampling=params, timeout=60, **kw)
        try:
            outputs[k] = collect(call)[0]
        except grpc.RpcError as e:
            errors[k] = f"{e.code().name}: {e.details()}"

    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(90)
    return outputs, errors


def block_compiles(grammars, monkeypatch, timeout_s: float = 15.0) -> threading.Event:
    """Every compile of ``grammars`` (a service's `runtime.grammar.Grammars`) waits until the
    returned event is set, at most ``timeout_s`` (a safety net, not a measure)."""
    go, compile_ = threading.Event(), grammars._compile

    def blocked(constraint):
        go.wait(timeout_s)
        return compile_(constraint)

    monkeypatch.setattr(grammars, "_compile", blocked)
    return go
