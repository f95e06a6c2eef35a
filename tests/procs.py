"""Real service processes for end-to-end tests: start (again, on the same port), wait until
ready, freeze, kill; what a model service holds (GetInfo occupancy); requests streaming in the
background while a test breaks something.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from specmesh.client import GenerationClient
from specmesh.cluster import SERVICES, free_port
from specmesh.protocol.sampling import SamplingParams
from specmesh.rpc.health import check_health
from specmesh.v1 import common_pb2, draft_pb2_grpc, generation_pb2, target_pb2_grpc

# Flags of every target and draft that start_cluster starts (conftest: ``--device cuda``).
MODEL_FLAGS: tuple[str, ...] = ()
INFO_STUBS = {"target": target_pb2_grpc.TargetStub, "draft": draft_pb2_grpc.DraftStub}


@dataclass
class Service:
    kind: str  # "target", "draft" or "router"
    flags: tuple[str, ...]
    port: int  # kept across restarts
    proc: subprocess.Popen

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


class Services:
    """Child processes ``python -m specmesh <kind>``, logs (at ``log_level``) in ``log_dir`` (a
    restarted service appends to its predecessor's log), all stopped at the end."""

    def __init__(self, log_dir: Path, log_level: str = "WARNING") -> None:
        self.log_dir, self.log_level = log_dir, log_level
        self.running: dict[str, Service] = {}

    def start(self, name: str, kind: str, *flags: str, port: int | None = None) -> str:
        port = port or free_port()
        cmd = [sys.executable, "-m", "specmesh", "--log-level", self.log_level, kind]
        cmd += ["--host", "127.0.0.1", "--port", str(port)]
        with open(self.log_dir / f"{name}.log", "a") as log:  # the child keeps its own copy
            proc = subprocess.Popen([*cmd, *flags], stdout=log, stderr=subprocess.STDOUT)
        self.running[name] = Service(kind, flags, port, proc)
        return self.running[name].address

    def restart(self, name: str) -> str:
        """Start ``name`` again with its flags, on its port (after `kill`)."""
        s = self.running[name]
        return self.start(name, s.kind, *s.flags, port=s.port)

    def address(self, name: str) -> str:
        return self.running[name].address

    def log(self, name: str) -> str:
        return (self.log_dir / f"{name}.log").read_text()

    def wait_ready(self, name: str, timeout_s: float = 120.0) -> None:
        s = self.running[name]
        deadline = time.monotonic() + timeout_s
        while not check_health(s.address, SERVICES[s.kind], timeout_s=1.0):
            assert s.proc.poll() is None, self.log(name)
            assert time.monotonic() < deadline, f"{name} not ready:\n{self.log(name)}"
            time.sleep(0.2)

    def pause(self, name: str) -> None:
        os.kill(self.running[name].proc.pid, signal.SIGSTOP)

    def resume(self, name: str) -> None:
        os.kill(self.running[name].proc.pid, signal.SIGCONT)

    def kill(self, name: str) -> None:
        self.running[name].proc.kill()
        self.running[name].proc.wait()

    def stop(self) -> None:
        live = [s.proc for s in self.running.values() if s.proc.poll() is None]
        for proc in live:
            proc.send_signal(signal.SIGCONT)  # a frozen process would never see the SIGTERM
            proc.terminate()
        for proc in live:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()

    def occupancy(self, name: str) -> common_pb2.Occupancy:
        s = self.running[name]
        return occupancy(s.address, s.kind)

    def wait_empty(self, *names: str, timeout_s: float = 60.0) -> None:
        """Poll GetInfo until every model service in ``names`` holds no request and no KV slot."""
        deadline = time.monotonic() + timeout_s
        while held := self._held(names):
            if time.monotonic() > deadline:
                logs = "\n".join(f"--- {n}.log\n{self.log(n)[-4000:]}" for n in held)
                raise AssertionError(f"still held after {timeout_s} s: {held}\n{logs}")
            time.sleep(0.2)

    def _held(self, names: Sequence[str]) -> dict[str, str]:
        occupancies = {n: self.occupancy(n) for n in names}
        return {n: str(o).replace("\n", " ") for n, o in occupancies.items() if not is_empty(o)}


def info(address: str, kind: str):
    """A target's or draft's GetInfo answer (``kind`` is "target" or "draft")."""
    with grpc.insecure_channel(address) as channel:
        return INFO_STUBS[kind](channel).GetInfo(generation_pb2.InfoRequest(), timeout=10)


def occupancy(address: str, kind: str) -> common_pb2.Occupancy:
    """What a target or draft service holds now."""
    return info(address, kind).occupancy


def is_empty(o: common_pb2.Occupancy) -> bool:
    return o.num_requests == 0 and o.kv_slots_used == 0


def start_cluster(
    log_dir: Path,
    tiny_dir: Path,
    num_targets: int = 1,
    router_flags: Sequence[str] = (),
    model_flags: Sequence[str] | None = None,
    draft_flags: Sequence[str] = (),
) -> tuple[Services, str]:
    """Targets ("target0", ...), an EAGLE-3 "draft" and a "router" on the tiny checkpoints, one
    torch thread each; returns once all are ready (stopping them if one is not). The router
    speculates every round (``--speculation always``, which ``router_flags`` may override), so
    the fault tests always have draft steps in flight. ``model_flags`` (default MODEL_FLAGS) go
    to target and draft alike (``--device cuda``, ``--attention-backend``); ``draft_flags`` to the
    draft only."""
    services = Services(log_dir)
    target_dir, draft_dir = str(tiny_dir / "target"), str(tiny_dir / "draft")
    threads = ("--threads", "1", *(MODEL_FLAGS if model_flags is None else model_flags))
    targets = [
        services.start(f"target{i}", "target", "--model", target_dir, *threads)
        for i in range(num_targets)
    ]
    draft = services.start(
        "draft", "draft", "--kind", "eagle3", "--model", draft_dir, "--target-model", target_dir,
        "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6", *threads, *draft_flags,
    )  # fmt: skip
    router = services.start(
        "router",
        "router",
        "--target",
        ",".join(targets),
        "--draft",
        draft,
        "--speculation",
        "always",
        *router_flags,
    )
    try:
        for name in services.running:
            services.wait_ready(name)
    except BaseException:
        services.stop()
        raise
    return services, router


class Streams:
    """Greedy requests streaming in background threads, one per prompt: the tokens each got
    and the status code of each that failed. `wait_started` returns once every request has its
    first tokens (or has ended)."""

    def __init__(
        self,
        router: str,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        request_ids: Sequence[str] = (),
    ) -> None:
        self.client = GenerationClient(router)
        self.params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        self.outputs: list[list[int]] = [[] for _ in prompts]
        self.errors: list[grpc.StatusCode | None] = [None] * len(prompts)
        self.started = [threading.Event() for _ in prompts]
        ids = list(request_ids) or [""] * len(prompts)
        self.threads = [
            threading.Thread(target=self._run, args=(i, p, rid), daemon=True)
            for i, (p, rid) in enumerate(zip(prompts, ids, strict=True))
        ]
        for t in self.threads:
            t.start()

    def _run(self, i: int, prompt: Sequence[int], request_id: str) -> None:
        call = self.client.generate(
            prompt_token_ids=prompt, sampling=self.params, request_id=request_id, timeout=120
        )
        try:
            for response in call:
                self.outputs[i] += response.token_ids
                self.started[i].set()
        except grpc.RpcError as e:
            self.errors[i] = e.code()
        finally:
            self.started[i].set()

    def wait_started(self, timeout_s: float = 60.0) -> int:
        """Wait for every request's first tokens; returns the tokens received so far."""
        for event in self.started:
            assert event.wait(timeout_s), "a request got no tokens"
        return sum(map(len, self.outputs))

    def join(self, timeout_s: float = 120.0) -> None:
        for t in self.threads:
            t.join(timeout_s)
            assert not t.is_alive(), "a request never ended"
        self.client.close()
