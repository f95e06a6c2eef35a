"""A learning draft killed during an update restarts from its last checkpoint and serves
(issue 52): a process writing its third checkpoint is SIGKILLed halfway through the weights
file; a real `specmesh draft --online-learning --online-learning-dir DIR` started on the same
DIR removes the unfinished write, serves the second checkpoint's weights (its metrics say
version 2) and, behind a real router, gives the target's greedy output."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from procs import start_cluster

from specmesh.client import GenerationClient
from specmesh.cluster import free_port
from specmesh.protocol.sampling import SamplingParams

pytestmark = pytest.mark.slow
TESTS = Path(__file__).resolve().parents[1]
WRITER_TIMEOUT_S = 120.0


def _kill_while_writing(copy_dir: Path, root: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen([sys.executable, str(TESTS / "online_killed_writer.py"), str(copy_dir),
                             str(root)], stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        lines, deadline = [], time.monotonic() + WRITER_TIMEOUT_S
        while not lines or lines[-1] != "WRITING":
            ready, _, _ = select.select(
                [proc.stdout], [], [], max(0.0, deadline - time.monotonic())
            )
            line = proc.stdout.readline() if ready else ""
            assert line, f"the writer ended or hung before writing v3: {lines}"
            lines.append(line.strip())
        assert lines[-2:] == ["SAVED 2", "WRITING"], lines
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    finally:
        proc.kill()


def test_a_draft_killed_during_an_update_resumes_and_serves(
    copy_dir: Path, tmp_path: Path, oracle
) -> None:
    root = tmp_path / "learned"
    _kill_while_writing(copy_dir, root)
    assert (root / "latest").resolve().name == "v000002" and (root / ".v000003.tmp").is_dir()

    pair = tmp_path / "pair"  # start_cluster's layout: <dir>/target and <dir>/draft
    pair.mkdir()
    (pair / "target").symlink_to(copy_dir / "target")
    (pair / "draft").symlink_to(copy_dir / "eagle3")
    port = free_port()
    flags = ("--online-learning", "--online-learning-dir", str(root), "--metrics-port", str(port))
    services, router = start_cluster(tmp_path, pair, draft_flags=flags)
    try:
        prompt, params = [5, 6, 7, 8], SamplingParams(max_new_tokens=16, ignore_eos=True)
        with GenerationClient(router) as client:
            ids = [t for r in client.generate(prompt_token_ids=prompt, sampling=params, timeout=60)
                   for t in r.token_ids]  # fmt: skip
        assert ids == oracle(str(copy_dir / "target"), prompt, 16)
        text = (
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        )
        assert 'specmesh_online_weight_version{service="draft"} 2.0' in text
        assert not (root / ".v000003.tmp").exists()
    finally:
        services.stop()
