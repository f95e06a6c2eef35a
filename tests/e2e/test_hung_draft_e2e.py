"""A hung draft costs the other streams a bounded delay: the router's draft deadline adapts to
the draft's recent step latencies (a multiple of their p99, with a floor), so a draft frozen
with SIGSTOP is given up after about a second, not after the 10 s maximum."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from procs import start_cluster

from specmesh.client import GenerationClient
from specmesh.protocol.sampling import SamplingParams

pytestmark = pytest.mark.slow

MAX_NEW = 160
PROMPTS = [[5 + i, 6 + 2 * i, 7 + 3 * i] for i in range(4)]
BOUND_S = 5.0  # generous: the fixed 10 s deadline would exceed it, the adaptive one is ~0.5-1 s


def stream(client: GenerationClient, prompt: list[int], gaps: list[float], out: list[int]) -> None:
    """Collect the tokens and the longest wait between two responses."""
    last = time.monotonic()
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    for response in client.generate(prompt_token_ids=prompt, sampling=params, timeout=120):
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        out += response.token_ids


@pytest.mark.parametrize("draft_flags", [(), ("--predraft", "4")], ids=["", "predraft"])
def test_hung_draft_costs_a_bounded_delay(
    tiny_dir: Path, tmp_path: Path, oracle, draft_flags: tuple[str, ...]
) -> None:
    """Frozen while it streams (and, with ``--predraft``, while it pre-drafts ahead)."""
    services, router = start_cluster(tmp_path, tiny_dir, draft_flags=draft_flags)
    try:
        with GenerationClient(router) as client:
            for prompt in PROMPTS:  # normal steps: the deadline learns the draft's latency
                stream(client, prompt, [], [])
            gaps: list[list[float]] = [[] for _ in PROMPTS]
            outs: list[list[int]] = [[] for _ in PROMPTS]
            threads = [
                threading.Thread(target=stream, args=(client, p, g, o))
                for p, g, o in zip(PROMPTS, gaps, outs, strict=True)
            ]
            for t in threads:
                t.start()
            while sum(map(len, outs)) < 4 * len(PROMPTS):
                time.sleep(0.01)
            services.pause("draft")  # hung, not dead: its connection stays open
            for t in threads:
                t.join(120)
            services.resume("draft")
        worst = max(max(g[1:], default=0.0) for g in gaps)  # g[0] is the time to first token
        print(f"longest wait between two responses with a hung draft: {worst:.2f} s")
        assert worst < BOUND_S
        for prompt, out in zip(PROMPTS, outs, strict=True):
            assert out == oracle(tiny_dir / "target", prompt, MAX_NEW)
        services.wait_empty("target0", "draft")
    finally:
        services.stop()
