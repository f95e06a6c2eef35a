"""The fault report's cluster and load (`specmesh.bench.faults`).

`Cluster`: target replicas, an EAGLE-3 draft and a router with its HTTP port, each ``python -m
specmesh <service>`` on a loopback port as ``specmesh up`` starts them, one torch thread each,
logs in files. The report breaks them (`kill`, `signal`, `restart` on the same port) and asks
what they hold: GetInfo occupancy of each model service, the router's requests running / waiting
from its ``/metrics``.

`Load`: greedy gRPC streams (`Req`), one thread each, and what each got (`Outcome`).

`http_post`: raw HTTP/1.1, to send what no well-behaved client library sends (a body announced
at 50 MB, never finished) and to read a refusal that comes before the body's end.
"""

from __future__ import annotations

import select
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc

from specmesh.client import GenerationClient
from specmesh.cluster import Child, free_port, stop_all, wait_ready
from specmesh.defaults import ModelChoice
from specmesh.protocol.sampling import SamplingParams
from specmesh.v1 import common_pb2, draft_pb2_grpc, generation_pb2, target_pb2_grpc

READY_TIMEOUT_S = 120.0
REQUEST_TIMEOUT_S = 120.0
# Every round speculates, so draft steps are always in flight; a frozen draft step fails in 1 s.
ROUTER_FLAGS = ("--speculation", "always", "--draft-timeout-s", "1")
DRAFT_SHAPE = ("--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6")
STUBS = {"target": target_pb2_grpc.TargetStub, "draft": draft_pb2_grpc.DraftStub}
# Router counters whose growth over a scenario the report shows (name in /metrics -> label).
COUNTERS = {
    "specmesh_draft_failures_total": "draft failures",
    "specmesh_request_replays_total": "replays",
    "specmesh_num_preemptions_total": "preemptions",
}


@dataclass(frozen=True)
class Req:
    prompt: tuple[int, ...]
    max_new_tokens: int
    cancel_after: int | None = None  # answers the client reads before it cancels; None: never


@dataclass
class Outcome:
    tokens: list[int]
    status: str = "OK"  # or the gRPC code that ended it ("CANCELLED" for the client's own)
    latency_ms: float = 0.0
    drafted: bool = False  # the target verified draft tokens for it
    cached_tokens: int = 0  # prompt tokens the target's prefix cache had


class Load:
    """One phase: a greedy gRPC stream per request, each in a thread of its own."""

    def __init__(self, router: str, reqs: Sequence[Req]) -> None:
        self.client, self.reqs = GenerationClient(router), list(reqs)
        self.outcomes = [Outcome([]) for _ in reqs]
        self.started = [threading.Event() for _ in reqs]
        self.threads = [threading.Thread(target=self._run, args=(i,)) for i in range(len(reqs))]
        for t in self.threads:
            t.start()

    def _run(self, i: int) -> None:
        req, out, start = self.reqs[i], self.outcomes[i], time.perf_counter()
        params = SamplingParams(max_new_tokens=req.max_new_tokens, ignore_eos=True)
        call = self.client.generate(
            prompt_token_ids=req.prompt, sampling=params, timeout=REQUEST_TIMEOUT_S
        )
        try:
            for n, response in enumerate(call, start=1):
                out.tokens += response.token_ids
                out.drafted |= response.stats.num_draft_tokens > 0
                out.cached_tokens = max(out.cached_tokens, response.stats.cached_tokens)
                self.started[i].set()
                if n == req.cancel_after:
                    call.cancel()
        except grpc.RpcError as e:
            out.status = e.code().name
        finally:
            out.latency_ms = (time.perf_counter() - start) * 1e3
            self.started[i].set()

    def wait_started(self) -> float:
        """Wait until every request has its first tokens (or ended); the share of the phase's
        tokens received by then."""
        for event in self.started:
            event.wait(REQUEST_TIMEOUT_S)
        got = sum(len(o.tokens) for o in self.outcomes)
        return got / sum(r.max_new_tokens for r in self.reqs)

    def join(self) -> list[Outcome]:
        for t in self.threads:
            t.join(REQUEST_TIMEOUT_S + 10)
        self.client.close()
        return self.outcomes


@dataclass(frozen=True)
class ClusterSpec:
    num_targets: int = 1
    model_flags: tuple[str, ...] = ()  # for every target and the draft


class Cluster:
    """Services "target0".., "draft" and "router" (HTTP on `http_port`), ready on return."""

    def __init__(self, spec: ClusterSpec, models: ModelChoice, log_dir: Path) -> None:
        self.spec, self.log_dir = spec, log_dir
        self.children: dict[str, Child] = {}
        self.flags: dict[str, list[str]] = {}
        model = ["--threads", "1", *spec.model_flags]
        targets = [
            self._spawn(f"target{i}", "target", ["--model", models.target, *model])
            for i in range(spec.num_targets)
        ]
        draft = self._spawn("draft", "draft", [
            "--kind", "eagle3", "--model", str(models.draft), "--target-model", models.target,
            *DRAFT_SHAPE, *model,
        ])  # fmt: skip
        self.http_port = free_port()
        router = ["--target", ",".join(targets), "--draft", draft, *ROUTER_FLAGS, "--threads", "1"]
        self.router = self._spawn("router", "router", [*router, "--http-port", str(self.http_port)])
        self._wait_ready(*self.children)
        with GenerationClient(self.router) as client:
            self.model_name = client.info().model_name

    def _spawn(self, name: str, kind: str, flags: list[str], port: int = 0) -> str:
        port = port or free_port()
        cmd = [sys.executable, "-m", "specmesh", kind, "--host", "127.0.0.1", "--port", str(port)]
        with open(self.log_dir / f"{name}.log", "a") as log:  # a restart appends
            proc = subprocess.Popen([*cmd, *flags], stdout=log, stderr=subprocess.STDOUT)
        self.children[name], self.flags[name] = Child(kind, f"127.0.0.1:{port}", proc), flags
        return self.children[name].address

    def _wait_ready(self, *names: str) -> None:
        try:
            wait_ready([self.children[n] for n in names], READY_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            tails = "".join(f"\n--- {n}.log\n{self.log_tail(n)}" for n in names)
            raise RuntimeError(f"{e}{tails}") from e

    def log_tail(self, name: str, num_chars: int = 3000) -> str:
        return (self.log_dir / f"{name}.log").read_text(errors="replace")[-num_chars:]

    def kill(self, name: str) -> None:
        self.children[name].proc.kill()
        self.children[name].proc.wait()

    def signal(self, name: str, sig: signal.Signals) -> None:
        self.children[name].proc.send_signal(sig)

    def restart(self, name: str) -> float:
        """Start ``name`` again on its port with its flags; seconds until it was ready."""
        start, child = time.monotonic(), self.children[name]
        self._spawn(name, child.kind, self.flags[name], port=int(child.address.rsplit(":")[1]))
        self._wait_ready(name)
        return time.monotonic() - start

    def stop(self) -> None:
        for child in self.children.values():
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGCONT)  # a frozen process never sees SIGTERM
        stop_all(list(self.children.values()))

    def occupancy(self, name: str) -> common_pb2.Occupancy:
        with grpc.insecure_channel(self.children[name].address) as channel:
            stub = STUBS[self.children[name].kind](channel)
            return stub.GetInfo(generation_pb2.InfoRequest(), timeout=10).occupancy

    def metrics(self) -> dict[str, float]:
        """The router's /metrics, summed over labels per series name."""
        url = f"http://127.0.0.1:{self.http_port}/metrics"
        with urllib.request.urlopen(url, timeout=10) as r:
            text = r.read().decode()
        sums: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
                sums[name] = sums.get(name, 0.0) + value
        return sums

    def held(self) -> dict[str, str]:
        """What each service holds, for those that hold anything."""
        held = {}
        for name, child in self.children.items():
            if child.kind == "router":
                m = self.metrics()
                n = m.get("specmesh_num_requests_running", 0) + m.get(
                    "specmesh_num_requests_waiting", 0
                )
                if n:
                    held[name] = f"{n:.0f} requests"
            elif (o := self.occupancy(name)).num_requests or o.kv_slots_used:
                held[name] = f"{o.num_requests} requests, {o.kv_slots_used} KV slots"
        return held

    def wait_empty(self, timeout_s: float = 15.0) -> dict[str, str]:
        """Poll `held` until nothing is held or ``timeout_s`` passed; what is held then."""
        deadline = time.monotonic() + timeout_s
        while (held := self.held()) and time.monotonic() < deadline:
            time.sleep(0.2)
        return held

    def wait_serving(self, timeout_s: float = 60.0) -> float | None:
        """Seconds until every replica serves again, or None: the router counts them all live,
        and a round of concurrent greedy probes (one more than the targets, distinct prompts)
        was speculated, with every target and the draft holding a Step stream of the router."""
        start, probes = time.monotonic(), [[7 + i, 5, 9] for i in range(self.spec.num_targets + 1)]
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        run = lambda client, prompt: list(client.generate(prompt_token_ids=prompt, sampling=params))
        with GenerationClient(self.router) as client, ThreadPoolExecutor(len(probes)) as pool:
            while time.monotonic() - start < timeout_s:
                info = client.info()
                live = (info.num_target_replicas, info.num_draft_replicas)
                answers = list(pool.map(lambda p: run(client, p)[-1], probes))
                drafted = all(a.stats.num_draft_tokens for a in answers)
                models = [n for n, c in self.children.items() if c.kind != "router"]
                if (
                    live == (self.spec.num_targets, 1)
                    and drafted
                    and all(self.occupancy(n).num_streams for n in models)
                ):
                    return time.monotonic() - start
                time.sleep(0.5)
        return None


def http_post(
    port: int,
    path: str,
    body: bytes,
    declared: int | None = None,
    *,
    method: str = "POST",
    read_body: bool = False,
):  # -> int, or (int, bytes) with read_body
    """One request on a fresh connection: its status, 0 when the connection broke before an
    answer. ``declared``: the Content-Length sent (default ``len(body)``). The body goes out in
    pieces, and an answer that arrives before the last is read (a refusal mid-body)."""
    length = len(body) if declared is None else declared
    head = (
        f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {length}\r\nConnection: close\r\n\r\n"
    )
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        try:
            sock.sendall(head.encode())
            for i in range(0, len(body), 1 << 18):
                if select.select([sock], [], [], 0)[0]:
                    break  # answered before the end of the body
                sock.sendall(body[i : i + (1 << 18)])
            while chunk := sock.recv(1 << 16):
                data += chunk
        except OSError:
            pass  # what arrived before the reset still counts
    status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.") else 0
    return (status, data.partition(b"\r\n\r\n")[2]) if read_body else status
