"""``specmesh up`` on the built-in default model, ``specmesh generate --router --json`` and
``specmesh health`` against it, then Ctrl-C (SIGINT) stops every process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

SPECMESH = [sys.executable, "-m", "specmesh"]


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_up_serves_the_default_model_and_stops_on_ctrl_c(tmp_path: Path) -> None:
    from specmesh.protocol.shared_rows import SHM_DIR

    before = set(SHM_DIR.glob("specmesh-*"))
    up = subprocess.Popen(
        [*SPECMESH, "up", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "up.log", "w"),  # noqa: SIM115
        text=True,
    )
    children: list[int] = []
    try:
        line = up.stdout.readline()  # blocks until ready (or until `up` dies)
        assert line.startswith("specmesh router ready on "), (tmp_path / "up.log").read_text()
        address = line.split()[-1]
        children += children_of(up.pid)
        assert len(children) == 3  # target, draft, router

        probe = subprocess.run(
            [*SPECMESH, "health", address, "--service", "specmesh.v1.Generation"]
        )
        assert probe.returncode == 0

        flags = ["--prompt", "def fib(n):", "--max-new-tokens", "16", "--json"]
        remote = subprocess.run(
            [*SPECMESH, "generate", "--router", address, *flags], capture_output=True, text=True
        )
        assert remote.returncode == 0, remote.stderr
        result = json.loads(remote.stdout)
        assert result["completion_tokens"] == len(result["token_ids"]) > 0
        assert result["finish_reason"] in ("length", "stop") and result["prompt_tokens"] > 0
        local = subprocess.run([*SPECMESH, "generate", *flags], capture_output=True, text=True)
        assert json.loads(local.stdout)["token_ids"] == result["token_ids"]  # same as in process
        # the draft's rows came through the target's shared-memory ring (`--shared-memory`)
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in children]
        assert sum(b"--shared-memory" in c for c in cmdlines) == 1  # the router's
        rings = set(SHM_DIR.glob("specmesh-*")) - before
        assert len(rings) == 1

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(alive(pid) for pid in children)
        assert not any(ring.exists() for ring in rings)  # unlinked with its stream
    finally:
        for pid in [up.pid, *children]:  # only what this test started
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        up.wait()
