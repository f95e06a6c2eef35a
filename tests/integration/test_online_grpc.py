"""Online learning behind the gRPC draft service (the copy pair: its drafts are accepted): the
trainer thread publishes versions while requests stream, and output stays transformers'; a
cancelled or timed-out stream leaves nothing held in the draft or its learner; the draft's
metrics carry the learner's series."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
from grpc_harness import (
    LoopThread,
    collect,
    generate_all,
    greedy,
    num_accepted,
    serve_draft,
    serve_router,
    serve_target,
    wait_until,
)
from online_traffic import SETTINGS, KeepAll, prompts

from specmesh.client import GenerationClient
from specmesh.draft_service.online import attach_learner
from specmesh.draft_service.online.metrics import OnlineCollector
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.target_service.runtime import TargetRuntime


@pytest.fixture(scope="module")
def online(copy_dir: Path, oracle):
    target_dir, draft_dir = str(copy_dir / "target"), str(copy_dir / "eagle3")
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(target_dir))))
    runtime = load_draft(DraftConfig("eagle3", draft_dir, target_dir, SpecParams(3, 4, 8)))
    learner = attach_learner(runtime, replace(SETTINGS, heldout_every=2), start=False)
    learner.guard = KeepAll()  # every update served: versions change while requests run
    learner.start()
    draft = loop.run(serve_draft(runtime))  # its warm-up: two rows, dropped when it ends
    draft.metrics.registry.register(OnlineCollector(draft))
    router = loop.run(serve_router(target, draft))
    client = GenerationClient(f"127.0.0.1:{router.port}")
    yield SimpleNamespace(
        loop=loop, target=target, draft=draft, learner=learner, client=client,
        expected=lambda prompt, n: oracle(target_dir, prompt, n),
    )  # fmt: skip
    client.close()
    learner.close()
    loop.run(router.stop(0.5))
    for servicer in (target, draft):
        loop.run(servicer.host.shutdown(0.5))
    loop.close()


def test_output_is_the_targets_while_versions_change(online) -> None:
    accepted = num_accepted()
    for seed in range(3):
        batch = prompts(6, seed=seed)
        outputs, errors = generate_all(online.client, batch, greedy(24))
        assert not errors
        for k, prompt in enumerate(batch):
            assert outputs[k] == online.expected(prompt, 24)
        assert online.learner.drain(120)
    stats = online.learner.stats()
    assert stats.num_updates >= 2 and stats.num_swaps >= 1
    assert num_accepted() - accepted > 0
    assert stats.tokens_observed > 0 and online.learner.buffer.open == {}


@pytest.mark.parametrize("how", ["cancel", "deadline"])
def test_an_ended_stream_leaves_nothing_held(online, how: str) -> None:
    call = online.client.generate(
        prompt_token_ids=[5, 6, 7], sampling=greedy(900),
        timeout=0.5 if how == "deadline" else None,
    )  # fmt: skip
    stream = iter(call)
    next(stream), next(stream)
    if how == "cancel":
        call.cancel()
    else:
        with pytest.raises(grpc.RpcError):
            collect(stream)
    runtime = online.draft.runtime
    assert wait_until(lambda: not runtime.drafter.cache.requests and not runtime.live)
    assert online.learner.buffer.open == {}
    train, heldout = online.learner.buffer.sizes()
    assert train <= SETTINGS.train_tokens and heldout <= 16 * SETTINGS.heldout_sequence_tokens


def test_the_drafts_metrics_carry_the_learners_series(online) -> None:
    from prometheus_client import generate_latest

    text = generate_latest(online.draft.metrics.registry).decode()
    version = online.learner.stats().version
    assert f'specmesh_online_weight_version{{service="draft"}} {float(version)}' in text
    assert "specmesh_online_updates_total" in text and "specmesh_online_tokens_observed" in text


def test_a_request_kept_out_of_learning_leaves_no_rows(online) -> None:
    """GenerateRequest.exclude_from_learning reaches the draft on every extend: the learner
    keeps none of that request's rows, and the same request without it is kept."""
    learner, prompt = online.learner, prompts(1, seed=7)[0]

    def served(exclude: bool) -> int:
        before = learner.stats().tokens_observed
        call = online.client.generate(prompt_token_ids=prompt, sampling=greedy(16),
                                      exclude_from_learning=exclude)  # fmt: skip
        assert len(collect(iter(call))[0]) == 16
        assert wait_until(lambda: not online.draft.runtime.live)
        return learner.stats().tokens_observed - before

    assert served(exclude=True) == 0
    assert served(exclude=False) > len(prompt)


def test_getinfo_and_each_requests_stats_name_the_versions(online) -> None:
    """The draft's GetInfo reports the learner (the same figures as `stats()`), and a request's
    RequestStats lists the weight versions its trees were drafted with: each one the draft has
    served, in the order first used, the last no newer than the draft serves now."""
    from specmesh.v1 import draft_pb2_grpc, generation_pb2

    prompt = prompts(1, seed=11)[0]
    _, _, last = collect(online.client.generate(prompt_token_ids=prompt, sampling=greedy(24)))
    assert online.learner.drain(120)
    with grpc.insecure_channel(f"127.0.0.1:{online.draft.host.port}") as channel:
        info = draft_pb2_grpc.DraftStub(channel).GetInfo(generation_pb2.InfoRequest(), timeout=10)
    stats = online.learner.stats()
    assert info.HasField("online_learning")
    got = info.online_learning
    counts = (got.weight_version, got.updates, got.rollbacks, got.resets)
    assert counts == (stats.version, stats.num_updates, stats.num_rollbacks, stats.num_resets)
    assert got.tokens_observed == stats.tokens_observed > 0 and got.train_seconds > 0
    versions = list(last.stats.draft_weight_versions)
    assert versions and versions == sorted(set(versions)) and versions[-1] <= stats.version
