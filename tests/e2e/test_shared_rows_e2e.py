"""Feature rows through shared memory (the router's ``--shared-memory``) with real processes:
output stays exactly transformers', and no ring outlives what owns it. A router SIGKILL ends
the target's stream, which unlinks its ring; a target SIGKILL leaves its ring behind, and the
restarted target removes it when it creates its own (`protocol.shared_rows.sweep`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from grpc_harness import wait_until
from procs import Services, Streams, start_cluster

from specmesh.protocol.shared_rows import SHM_DIR

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not SHM_DIR.is_dir(), reason="no /dev/shm"),
]

PROMPTS = [[5 + i, 6 + 2 * i, 7 + 3 * i, 8 + 5 * i] for i in range(4)]
MAX_NEW = 24


def rings_of(pid: int) -> set[Path]:
    """The shared-memory rings process ``pid`` created (their names carry it)."""
    return set(SHM_DIR.glob(f"specmesh-{pid:08x}*"))


def exact(cluster: Services, tiny_dir: Path, oracle) -> None:
    streams = Streams(cluster.address("router"), PROMPTS, MAX_NEW)
    streams.join()
    assert streams.outputs == [oracle(tiny_dir / "target", p, MAX_NEW) for p in PROMPTS]


def test_rings_end_with_their_streams_and_their_targets(tiny_dir: Path, tmp_path: Path, oracle):
    cluster, _ = start_cluster(tmp_path, tiny_dir, router_flags=["--shared-memory"])
    try:
        target = lambda: cluster.running["target0"].proc.pid
        exact(cluster, tiny_dir, oracle)
        (ring,) = rings_of(target())  # the router's one stream to the target
        cluster.kill("router")
        assert wait_until(lambda: not ring.exists(), 30)  # the stream ended with the router
        cluster.restart("router")
        cluster.wait_ready("router")
        exact(cluster, tiny_dir, oracle)
        (ring,) = rings_of(target())
        cluster.kill("target0")
        assert ring.exists()  # nobody ran the dead target's cleanup
        cluster.restart("target0")
        cluster.wait_ready("target0")
        exact(cluster, tiny_dir, oracle)  # the router reconnects: a new stream, a new ring
        assert wait_until(lambda: not ring.exists(), 30)  # swept when that ring was made
        assert len(rings_of(target())) == 1
    finally:
        cluster.stop()
    assert wait_until(lambda: not rings_of(target()), 30)
