"""`InlineSteps`: a model service runs a step on its event loop only when that cannot reorder
runtime work or stall the loop: the worker idle, recent steps short; on a GPU only when asked
(``--inline-step-ms``)."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

from specmesh.rpc.inline_steps import InlineSteps
from specmesh.rpc.service_common import ModelServicer, ServiceHost


def test_short_steps_run_inline_only_when_the_worker_is_idle() -> None:
    gate = InlineSteps(max_ms=2.0)
    assert not gate.allow()  # nothing measured yet: the first step goes to the worker
    gate.observe(0.0005)
    assert gate.allow()
    gate.num_submitted = 1  # a job on the worker not yet collected: keep submission order
    assert not gate.allow()
    gate.num_submitted = 0
    for _ in range(10):
        gate.observe(0.010)  # steps got slow: back to the worker
    assert not gate.allow()
    off = InlineSteps(max_ms=0)
    off.observe(0.0)
    assert not off.allow()


class _Servicer(ModelServicer):
    """Records the thread each batch ran on; answers with nothing."""

    def __init__(self, inline_step_ms: float | None = None) -> None:
        super().__init__(ServiceHost("test", "127.0.0.1:0"), inline_step_ms)
        self.threads: list[str] = []

    def run_batch(self, runtime, stream, chunks: list) -> list:
        self.threads.append(threading.current_thread().name)
        return []


def _chunks() -> list:
    from specmesh.v1 import target_pb2

    return [target_pb2.TargetStepRequest(decode=target_pb2.DecodeBatch())]


def test_steps_move_inline_on_cpu_and_stay_on_the_worker_on_a_gpu() -> None:
    async def run(device: str, inline_step_ms: float | None = None) -> list[str]:
        servicer = _Servicer(inline_step_ms)
        runtime = SimpleNamespace(cfg=SimpleNamespace(device=device))
        await servicer.attach(runtime)  # by default a GPU runtime turns it off
        for _ in range(4):
            await servicer._step(runtime, None, _chunks())
        servicer.worker.shutdown()
        return servicer.threads

    main = threading.current_thread().name
    cpu = asyncio.run(run("cpu", 60_000))  # any machine's steps count as short
    assert cpu[0] != main and cpu[1:] == [main] * 3  # measured once on the worker, then inline
    assert main not in asyncio.run(run("cuda"))
    assert main not in asyncio.run(run("cpu", 0))  # --inline-step-ms 0: always the worker


def test_the_budget_defaults_per_device_and_the_flag_sets_it() -> None:
    import argparse

    from specmesh.rpc.inline_steps import DEFAULT_CPU_MS, add_inline_arg, for_device

    assert for_device("cpu", None).max_s == DEFAULT_CPU_MS / 1000
    assert for_device("cuda:0", None).max_s == 0  # off on a GPU unless asked
    assert for_device("cpu", 10.0).max_s == 0.010
    p = argparse.ArgumentParser()
    add_inline_arg(p)
    assert p.parse_args([]).inline_step_ms is None
    assert p.parse_args(["--inline-step-ms", "20"]).inline_step_ms == 20.0
