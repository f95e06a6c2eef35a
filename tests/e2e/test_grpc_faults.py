"""Faults with real processes: SIGKILL a draft or a target replica while requests stream.

The router owns every token, so a dead draft only costs speculation and a dead target replica
means a replay on the other one; either way every request finishes with exactly the tokens
transformers produces (no token lost, none repeated).
"""

from __future__ import annotations

import functools
import threading
from pathlib import Path

import pytest
from procs import Services, start_cluster

from specmesh.client import GenerationClient
from specmesh.protocol.sampling import SamplingParams

pytestmark = pytest.mark.slow

NUM_REQUESTS, MAX_NEW = 8, 64
PROMPTS = [[5 + i, 6 + 2 * i, 7 + 3 * i] for i in range(NUM_REQUESTS)]


@functools.cache
def expected(target_dir: Path) -> list[list[int]]:
    """transformers greedy for every prompt, in one batched call (equal-length prompts, no
    padding; one call instead of eight keeps the test fast)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(
            torch.tensor(PROMPTS), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )  # fmt: skip
    return out[:, len(PROMPTS[0]) :].tolist()


def stream_through_fault(router: str, services: Services, victim: str):
    """Stream NUM_REQUESTS requests; once every one has its first tokens, SIGKILL ``victim``.
    Returns outputs, finish reasons, tokens received before the kill, router info."""
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    reasons = [""] * NUM_REQUESTS
    started = threading.Barrier(NUM_REQUESTS + 1)
    client = GenerationClient(router)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)

    def run(i: int) -> None:
        call = client.generate(prompt_token_ids=PROMPTS[i], sampling=params, timeout=120)
        for n, response in enumerate(call):
            outputs[i] += response.token_ids
            reasons[i] = response.finish_reason
            if n == 0:
                started.wait(60)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    started.wait(60)
    services.kill(victim)
    before_kill = sum(map(len, outputs))
    for t in threads:
        t.join(120)
    info = client.info()
    client.close()
    return outputs, reasons, before_kill, info


@pytest.mark.parametrize(
    ("victim", "num_targets"), [("draft", 1), ("target0", 2)], ids=["draft", "target-replica"]
)
def test_killing_a_service_mid_generation_loses_nothing(
    tmp_path: Path, tiny_dir: Path, oracle, victim: str, num_targets: int
) -> None:
    services, router = start_cluster(tmp_path, tiny_dir, num_targets)
    try:
        outputs, reasons, before_kill, info = stream_through_fault(router, services, victim)
        assert before_kill < NUM_REQUESTS * MAX_NEW  # the kill landed mid-generation
        assert outputs == expected(tiny_dir / "target")
        assert reasons == ["length"] * NUM_REQUESTS
        assert info.num_target_replicas == 1
        assert info.num_draft_replicas == (0 if victim == "draft" else 1)
    finally:
        services.stop()
