"""A two-rank target process (``specmesh target --tensor-parallel-size 2``, gloo on CPU) behind
a router with an EAGLE-3 draft: greedy output equals transformers; a SIGKILLed worker rank takes
the target down with a precise log line and no rank left behind; a SIGKILLed rank 0 leaves no
worker behind either."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from conftest import PATIENT_DRAFT_FLAGS, assert_accepted
from procs import Services, info

from specmesh.client import GenerationClient
from specmesh.protocol.sampling import SamplingParams
from specmesh.target_service.tp_workers import FATAL_EXIT_CODE

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7], [40, 2, 99, 31], [250, 17]]
MAX_NEW = 16


def worker_ranks(pid: int) -> list[int]:
    """The spawned worker ranks among ``pid``'s children (not multiprocessing's tracker); a
    child is listed under the thread that started it."""
    tasks = Path(f"/proc/{pid}/task").glob("*/children")
    children = [c for task in tasks for c in task.read_text().split()]
    return [int(c) for c in children if b"spawn_main" in _cmdline(int(c))]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return True
    return state == "Z"  # a zombie has exited; only its parent's wait is missing


def wait_until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, copy_dir: Path):
    """The copy pair (`copy_drafts`): its EAGLE-3 draft predicts the target, so rounds accept
    draft tokens and the sharded target keeps accepted paths' KV."""
    services = Services(tmp_path_factory.mktemp("tp-cluster"))
    target_dir, draft_dir = str(copy_dir / "target"), str(copy_dir / "eagle3")
    threads = ("--threads", "1")
    target = services.start(
        "target", "target", "--model", target_dir, "--tensor-parallel-size", "2", *threads
    )
    draft = services.start(
        "draft", "draft", "--kind", "eagle3", "--model", draft_dir, "--target-model", target_dir,
        "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6", *threads,
    )  # fmt: skip
    router = services.start(
        "router", "router", "--target", target, "--draft", draft, *PATIENT_DRAFT_FLAGS
    )
    try:
        for name in services.running:
            services.wait_ready(name)
        yield services, router
    finally:
        services.stop()


def test_sharded_target_generates_transformers_greedy(cluster, copy_dir: Path, oracle) -> None:
    services, router = cluster
    assert len(worker_ranks(services.running["target"].proc.pid)) == 1
    assert info(services.address("target"), "target").tensor_parallel_size == 2
    client = GenerationClient(router)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    stats = []
    try:
        for prompt in PROMPTS:
            responses = list(client.generate(prompt_token_ids=prompt, sampling=params, timeout=120))
            got = [t for r in responses for t in r.token_ids]
            assert got == oracle(copy_dir / "target", prompt, MAX_NEW)
            stats.append(responses[-1].stats)
    finally:
        client.close()
    assert_accepted(stats, min_tokens=len(PROMPTS))
    services.wait_empty("target", "draft")


def test_a_dead_rank_takes_the_whole_target_down(cluster) -> None:
    """Worker killed: rank 0 logs which rank died and exits non-zero. Rank 0 killed (after a
    restart): its worker leaves on its own."""
    services, _ = cluster
    target = services.running["target"].proc
    (worker,) = worker_ranks(target.pid)
    os.kill(worker, signal.SIGKILL)
    assert target.wait(30) == FATAL_EXIT_CODE
    assert f"tensor-parallel rank 1 (pid {worker}) exited with code -9" in services.log("target")
    services.restart("target")
    services.wait_ready("target")
    (worker,) = worker_ranks(services.running["target"].proc.pid)
    services.kill("target")
    assert wait_until(lambda: gone(worker)), "worker rank outlived rank 0"
