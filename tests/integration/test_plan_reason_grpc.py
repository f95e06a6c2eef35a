"""Why a request's rounds went plain reaches its client (issue 50): through a real router over
gRPC, `RequestStats` counts the plain rounds and carries the adaptive policy's latest reason
for one, and `specmesh generate --router --json` shows it. The policy's plans are scripted
(its measured choice depends on timing): plain for the first rounds, then full trees."""

from __future__ import annotations

import pytest
from grpc_harness import greedy, serve_router

from specmesh.cli.cmd_generate import router_summary
from specmesh.client import GenerationClient
from specmesh.router.plan_reason import Option, PlanReason
from specmesh.router.policy import Plan, SpeculationPolicy

PLAIN_PLANS = 2
REASON = PlanReason(1, Option(1, 1.0, 0.010, 0.0), Option(8, 2.5, 0.030, 0.012), probe=False)


@pytest.fixture
def scripted(monkeypatch):
    plans = []

    def plan(self, target, draft, batch_size, requests, max_nodes):
        plans.append(max_nodes)
        return Plan(1, REASON) if len(plans) <= PLAIN_PLANS else Plan(max_nodes)

    monkeypatch.setattr(SpeculationPolicy, "plan", plan)
    return plans


def test_the_stats_say_which_rounds_went_plain_and_why(stack, scripted) -> None:
    router = stack.loop.run(serve_router(stack.target, stack.draft, speculation="adaptive"))
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            responses = list(client.generate(prompt_token_ids=[5, 6, 7], sampling=greedy(12)))
    finally:
        stack.loop.run(router.stop(0.5))
    stats = responses[-1].stats
    assert stats.num_plain_rounds == PLAIN_PLANS and len(stats.accept_lens) > PLAIN_PLANS
    assert stats.plain_reason == REASON.describe()
    assert "a plain step: 1.00 tokens in 10.0 ms = 100 tokens/s" in stats.plain_reason
    summary = router_summary(stats, disabled=False)
    assert summary["plain_rounds"] == PLAIN_PLANS
    assert summary["speculative_rounds"] == len(stats.accept_lens) - PLAIN_PLANS
    assert summary["note"].startswith(f"plain decoding in {PLAIN_PLANS} of ")
