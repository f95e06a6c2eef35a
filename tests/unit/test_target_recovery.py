"""A target replica that failed is left alone for a cooldown, then used again (it may have
restarted or the connection may have been reset): it is never written off for good."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from specmesh.protocol.errors import ServiceDownError
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterCore
from specmesh.router.engine import Engine
from specmesh.router.in_process import InProcessTarget
from specmesh.router.router_config import RouterConfig


class FlakyTarget(InProcessTarget):
    """Drops its connection once, on the first verify after ``armed`` is set."""

    armed = False

    async def verify(self, inputs, rows=True):
        if self.armed:
            self.armed = False
            for i in inputs:
                self.runtime.release(i.rid)  # a restarted replica has lost its KV
            raise ServiceDownError(f"{self.name}: connection reset")
        return await super().verify(inputs, rows)


def test_failed_target_is_used_again_after_cooldown(tiny_dir: Path, oracle) -> None:
    engine = Engine(tiny_dir / "target")
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)

    async def scenario() -> list[list[int]]:
        flaky = FlakyTarget(engine.target, name="flaky")
        core = RouterCore([flaky], [], RouterConfig(target_cooldown_s=0.3, max_replays=3))
        await core.start()

        async def one(prompt: list[int]) -> list[int]:
            req = engine.make_request(prompt, params)
            return [t async for c in core.generate(req) for t in c.token_ids]

        flaky.armed = True
        with pytest.raises(ServiceDownError, match="no target replica"):
            await one([5, 6, 7])  # the only replica is cooling down: UNAVAILABLE, not a hang
        assert core.replicas.targets[0].breaker.failures == 1 and core.num_live_targets == 0
        await asyncio.sleep(0.35)
        assert core.num_live_targets == 1
        second = await one([8, 9])  # the same replica serves again
        await core.stop()
        return second

    assert asyncio.run(scenario()) == oracle(tiny_dir / "target", [8, 9], 8)
