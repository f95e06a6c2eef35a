"""The served model's name, through real servers on loopback: a target loaded from a Hugging
Face cache snapshot (`tests/hub_cache.py`) is served under its Hub id, not its commit, in
GetInfo, /v1/models (the official openai client) and the metrics; ``--served-model-name``
(`RouterConfig.served_model_name`) names it instead, and requests must use that name."""

from __future__ import annotations

import openai
import pytest
from grpc_harness import LoopThread, serve_router, serve_target
from hub_cache import TARGET_ID, make_hub, use_hub

from specmesh.client import GenerationClient
from specmesh.hub import resolve_model
from specmesh.protocol.config import TargetConfig
from specmesh.router.metrics import REGISTRY
from specmesh.target_service.runtime import TargetRuntime


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory):
    """A target loaded from the Hub cache by its id, and one router beside it per name."""
    hub = make_hub(tmp_path_factory.mktemp("hf"))
    with pytest.MonkeyPatch.context() as mp:
        use_hub(mp, hub)
        snapshot = resolve_model(TARGET_ID)
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(snapshot, max_context=64))))
    routers = {
        name: loop.run(serve_router(target, http_port=0, served_model_name=name))
        for name in (None, "tiny-chat")
    }
    yield routers
    for router in routers.values():
        loop.run(router.stop(0.5))
    loop.run(target.host.shutdown(0.5))
    loop.close()


def _openai(router) -> openai.OpenAI:
    base = f"http://127.0.0.1:{router.http_port}/v1"
    return openai.OpenAI(base_url=base, api_key="unused", max_retries=0)


def test_a_hub_snapshot_is_served_under_its_id(served) -> None:
    router = served[None]
    assert [m.id for m in _openai(router).models.list().data] == [TARGET_ID]
    with GenerationClient(f"127.0.0.1:{router.port}") as client:
        info = client.info()
    assert info.model_name == info.model_path == TARGET_ID
    r = _openai(router).completions.create(model=TARGET_ID, prompt=[5, 6], max_tokens=2)
    assert r.model == TARGET_ID and r.usage.completion_tokens >= 1
    assert router.core.metrics.model == TARGET_ID


def test_served_model_name_names_it_everywhere(served) -> None:
    router = served["tiny-chat"]
    client = _openai(router)
    assert [m.id for m in client.models.list().data] == ["tiny-chat"]
    with GenerationClient(f"127.0.0.1:{router.port}") as grpc_client:
        info = grpc_client.info()
    assert (info.model_name, info.model_path) == ("tiny-chat", TARGET_ID)
    r = client.completions.create(model="tiny-chat", prompt=[5, 6], max_tokens=2)
    assert r.model == "tiny-chat"
    with pytest.raises(openai.NotFoundError, match="tiny-chat"):
        client.completions.create(model=TARGET_ID, prompt=[5, 6], max_tokens=2)
    names = {s.labels.get("model_name") for m in REGISTRY.collect() for s in m.samples}
    assert "tiny-chat" in names
