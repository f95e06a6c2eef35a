"""Cache-aware placement (`router/placement.py`, `router/prefix_index.py`): with two target
replicas whose prefix caches each hold two of four system prompts, requests that share a system
prompt gather on one replica, so the caches hit far more often than under least-loaded
placement (where each replica sees every prompt and evicts them in turn); outputs are exact
either way."""

from __future__ import annotations

import asyncio
import random

import pytest

from specmesh.protocol.config import TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterConfig, RouterCore
from specmesh.router.engine import Engine
from specmesh.router.in_process import InProcessTarget
from specmesh.router.placement import Balancer
from specmesh.target_service.runtime import TargetRuntime

SYSTEM = [[(31 * s + 7 * i) % 200 + 4 for i in range(48)] for s in range(4)]  # 3 blocks each
WORKLOAD = [(s, u) for s in range(4) for u in range(16)]
PARAMS = SamplingParams(max_new_tokens=2, ignore_eos=True)


def run(tiny_dir, placement: str) -> tuple[int, int, dict]:
    """(prompt tokens the replicas' caches hit, looked up, outputs by (system, user))."""
    cfg = TargetConfig(str(tiny_dir / "target"), prefix_cache_tokens=96, prefix_block_size=16)
    runtimes = [TargetRuntime(cfg) for _ in range(2)]
    order = random.Random(0).sample(WORKLOAD, len(WORKLOAD))
    engine = Engine(tiny_dir / "target", router_config=RouterConfig(placement=placement))

    async def serve() -> dict:
        core = RouterCore([InProcessTarget(rt, f"target-{i}") for i, rt in enumerate(runtimes)],
                          [], RouterConfig(placement=placement))  # fmt: skip
        await core.start()
        out = {}
        try:
            for wave in range(0, len(order), 2):  # two users at a time
                pairs = order[wave : wave + 2]
                reqs = [engine.make_request(SYSTEM[s] + [u + 4, 3], PARAMS) for s, u in pairs]
                done = await asyncio.gather(*(Engine._collect(core, r) for r in reqs))
                out.update({p: r.token_ids for p, r in zip(pairs, done, strict=True)})
        finally:
            await core.stop()
        return out

    outputs = asyncio.run(serve())
    blocks = [rt.prefixes.blocks for rt in runtimes]
    return sum(b.num_hit for b in blocks), sum(b.num_queried for b in blocks), outputs


def test_cache_aware_placement_gathers_shared_prefixes(tiny_dir, oracle) -> None:
    aware_hit, queried, aware = run(tiny_dir, "cache-aware")
    loaded_hit, _, loaded = run(tiny_dir, "least-loaded")
    assert aware == loaded
    for s, u in [(0, 0), (3, 15)]:
        assert aware[s, u] == oracle(tiny_dir / "target", SYSTEM[s] + [u + 4, 3], 2)
    # measured here: 2832 vs 1632 tokens (1.74x; 98 % of what the caches could hit at best)
    assert aware_hit >= 1.6 * loaded_hit, (aware_hit, loaded_hit, queried)


def test_unknown_placement_is_refused() -> None:
    with pytest.raises(ValueError, match="placement 'random'"):
        Balancer([], [], "random")
