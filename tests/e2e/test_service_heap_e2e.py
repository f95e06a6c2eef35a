"""A model service's process serves with its start-up heap out of the garbage collector's passes
(`specmesh.rpc.heap.frozen_startup_heap`, entered once the service is ready): its log says how
many objects were frozen, it answers, and on SIGTERM it stops cleanly with nothing reported
leaked. The router's process entry is checked in `test_router_fd_limit`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from procs import Services, occupancy

pytestmark = pytest.mark.slow

FROZEN = r"specmesh\.v1\.Target: (\d+) start-up objects out of the garbage collector's passes"


def test_a_model_service_serves_with_its_startup_heap_frozen(tmp_path: Path, tiny_dir: Path):
    services = Services(tmp_path, log_level="INFO")
    try:
        address = services.start("target", "target", "--model", str(tiny_dir / "target"))
        services.wait_ready("target")
        held = occupancy(address, "target")
        assert held.num_requests == 0 and held.kv_slots_used == 0
        proc = services.running["target"].proc
    finally:
        services.stop()
    log = services.log("target")
    assert proc.returncode == 0, log
    frozen = re.search(FROZEN, log)
    assert frozen and int(frozen.group(1)) > 10_000, log  # torch, grpc, the model: start-up
    assert "Traceback" not in log and "leaked" not in log, log
