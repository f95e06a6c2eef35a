"""A router process under a low fd limit with more idle HTTP connections than it may keep
(issue 54, item 4): /health still answers, a gRPC Generate still completes, and the log stays a
few lines. Before the connection cap, the idle connections took every descriptor: accept failed
with EMFILE, asyncio logged a traceback per attempt (hundreds of MB in half a minute), /health
timed out and gRPC could not take a connection until the header timeout closed the first ones.

The limit is set by the shell (``ulimit -n``: soft and hard alike, so the router's own raise at
start cannot help); the target serves in this process, so only the router is started."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_harness import LoopThread, collect, greedy, serve_target
from http_raw import request

from specmesh.client import GenerationClient
from specmesh.cluster import free_port
from specmesh.protocol.config import TargetConfig
from specmesh.router.server import SERVICE_NAME
from specmesh.rpc.health import check_health
from specmesh.target_service.runtime import TargetRuntime

MAX_OPEN_FILES = 256
MAX_LOG_LINES = 20  # start-up lines, one per kind of refusal: no line per connection


@pytest.fixture(scope="module")
def target_address(tiny_dir: Path) -> Iterator[str]:
    loop = LoopThread()
    cfg = TargetConfig(str(tiny_dir / "target"), num_kv_slots=4096, max_requests=8)
    servicer = loop.run(serve_target(TargetRuntime(cfg)))
    yield f"127.0.0.1:{servicer.host.port}"
    loop.run(servicer.host.shutdown(0.5))
    loop.close()


def _start_router(target: str, tokenizer: Path, log: Path) -> tuple[subprocess.Popen, int, int]:
    """``specmesh router`` under ``ulimit -n MAX_OPEN_FILES``; returns it, its gRPC and its
    HTTP port once it is ready."""
    port, http_port = free_port(), free_port()
    cmd = [sys.executable, "-m", "specmesh", "--log-level", "INFO", "router", "--target", target]
    cmd += ["--port", str(port), "--http-port", str(http_port), "--tokenizer", str(tokenizer)]
    with open(log, "w") as out:  # the child keeps its own copy
        proc = subprocess.Popen(
            ["/bin/sh", "-c", f'ulimit -n {MAX_OPEN_FILES} && exec "$@"', "sh", *cmd],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    deadline = time.monotonic() + 120
    while not check_health(f"127.0.0.1:{port}", SERVICE_NAME, timeout_s=1.0):
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    return proc, port, http_port


def test_idle_connections_past_the_fd_limit_leave_the_router_serving(
    tmp_path: Path, tiny_dir: Path, target_address: str
) -> None:
    log = tmp_path / "router.log"
    proc, port, http_port = _start_router(target_address, tiny_dir / "target", log)
    idle: list[socket.socket] = []
    try:
        for _ in range(2 * MAX_OPEN_FILES):  # sending nothing
            idle.append(socket.create_connection(("127.0.0.1", http_port), timeout=10))
        assert request(http_port, "GET", "/health", timeout_s=10).status == 200
        with GenerationClient(f"127.0.0.1:{port}") as client:
            tokens, _, last = collect(
                client.generate(prompt_token_ids=[5, 6, 7], sampling=greedy(4), timeout=20)
            )
        assert len(tokens) == 4 and last.finish_reason == "length"
        assert request(http_port, "GET", "/health", timeout_s=10).status == 200
    finally:
        for sock in idle:
            sock.close()
        proc.terminate()
        proc.wait(30)
    text = log.read_text()
    lines = text.splitlines()
    assert len(lines) <= MAX_LOG_LINES, "\n".join(lines[:40])
    assert not any("Traceback" in line or "out of system resource" in line for line in lines)
    # served with its start-up heap out of the collector's passes (`rpc.heap`), handed back
    assert re.search(r"Generation: \d+ start-up objects out of the garbage collector's", text)
    assert "leaked" not in text, text
    cap = re.search(r"at most (\d+) connections \(open files limit (\d+)\)", text)
    assert cap and int(cap.group(1)) < int(cap.group(2)) == MAX_OPEN_FILES, text
