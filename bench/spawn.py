"""Run one side of the benchmark in a fresh process and read back its JSON result.

The job travels as a JSON file (``--json-config FILE``); the process prints its result as the
last JSON line of its stdout. Every process gets the same thread budget, through the
environment (OpenMP / MKL pools sized before torch loads) and ``torch.set_num_threads``.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
STDERR_TAIL_CHARS = 4000


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_worker(command: list[str], job: dict[str, Any], threads: int, timeout_s: float) -> dict:
    """Run ``command --json-config FILE`` with ``job`` in FILE; its result as a dict."""
    env = {**os.environ, **dict.fromkeys(THREAD_VARS, str(threads))}
    with tempfile.TemporaryDirectory(prefix="specmesh-bench-") as tmp:
        path = Path(tmp) / "job.json"
        path.write_text(json.dumps(job))
        try:
            proc = subprocess.run(
                [*command, "--json-config", str(path)],
                capture_output=True, text=True, env=env, timeout=timeout_s,
            )  # fmt: skip
        except subprocess.TimeoutExpired as e:
            raise RuntimeError(f"{_what(command)} ran past {timeout_s:.0f} s") from e
    if proc.returncode != 0:
        tail = proc.stderr[-STDERR_TAIL_CHARS:]
        raise RuntimeError(f"{_what(command)} exited with code {proc.returncode}:\n{tail}")
    return last_json_object(proc.stdout, _what(command))


def last_json_object(stdout: str, what: str) -> dict[str, Any]:
    for line in reversed(stdout.splitlines()):
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"{what} printed no JSON result; its stdout ended: {stdout[-500:]!r}")


def _what(command: list[str]) -> str:
    return " ".join(command[:3])
