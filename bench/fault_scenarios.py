"""The fault report's scenarios (`specmesh.bench.faults`): what each does to the cluster while its
"during" requests stream, and the workloads they run. The cluster and the raw HTTP client they
use are `specmesh.bench.fault_cluster`.

A scenario's ``fault`` runs once every "during" request has its first tokens and returns an
`Effect`: a note for the table and any answer to its own traffic that was not what a healthy
service gives (an HTTP 5xx or a dropped connection where a 4xx was due). ``recover`` runs once
the "during" requests ended (restarting what the fault killed).
"""

from __future__ import annotations

import json
import random
import signal
import socket
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specmesh.bench.fault_cluster import Cluster, ClusterSpec, Outcome, Req, http_post

STOP_S = 3.0  # a frozen draft stays frozen this long: past the router's --draft-timeout-s 1
NUM_IDLE = 300  # idle sockets held open against the router's HTTP port
IDLE_WAIT_S = 15.0  # how long the idle sockets wait for the router to close them
KV_SLOTS = 1024  # the kv-pressure cluster's KV cache (target and draft), in tokens
PREFIX_CACHE_TOKENS = 48  # the prefix-evict cluster's prefix caches (target and draft)
PREFIX_CACHE = ("--prefix-cache-tokens", str(PREFIX_CACHE_TOKENS), "--prefix-block-size", "8")


@dataclass
class Effect:
    note: str
    failures: Counter[str] = field(default_factory=Counter)  # "http 500", "http reset", ...


@dataclass
class FaultContext:
    cluster: Cluster
    expected_text: Callable[[Req], str]  # the greedy completion's text (the oracle's)
    wait_load: Callable[[], list[Outcome]]  # once every "during" request ended: theirs


Workload = Callable[[random.Random], list[Req]]


def ids(rng: random.Random, n: int) -> tuple[int, ...]:
    return tuple(rng.randrange(3, 300) for _ in range(n))  # 0..2 are bos / eos / pad


def standard(rng: random.Random) -> list[Req]:
    """12 requests of 16 prompt tokens, 64 new each."""
    return [Req(ids(rng, 16), 64) for _ in range(12)]


def long_with_cancels(rng: random.Random) -> list[Req]:
    """16 requests of 96 + 96 tokens (3x what KV_SLOTS holds), every 4th cancelled."""
    return [Req(ids(rng, 96), 96, 2 if k % 4 == 3 else None) for k in range(16)]


def shared_prefixes(rng: random.Random) -> list[Req]:
    """24 requests over 6 prefixes of 24, 56 or 88 tokens (the prefix caches hold 48), a short
    tail each, every 4th cancelled after its first answer."""
    prefixes = [ids(rng, rng.choice((24, 56, 88))) for _ in range(6)]
    tail = lambda: ids(rng, rng.randrange(1, 6))
    return [Req(rng.choice(prefixes) + tail(), 16, 1 if k % 4 == 3 else None) for k in range(24)]


@dataclass(frozen=True)
class Scenario:
    name: str
    what: str  # one line for the docs
    fault: Callable[[FaultContext], Effect]
    recover: Callable[[FaultContext], str] | None = None
    cluster: ClusterSpec = field(default_factory=ClusterSpec)
    during: Workload = standard  # before and after run `standard`


# -- the faults ----------------------------------------------------------------------------------
def kill(name: str) -> Callable[[FaultContext], Effect]:
    def fault(ctx: FaultContext) -> Effect:
        ctx.cluster.kill(name)
        return Effect(f"SIGKILL {name}")

    return fault


def restart(name: str) -> Callable[[FaultContext], str]:
    def recover(ctx: FaultContext) -> str:
        return f"restarted, ready in {ctx.cluster.restart(name):.1f} s"

    return recover


def freeze_draft(ctx: FaultContext) -> Effect:
    ctx.cluster.signal("draft", signal.SIGSTOP)
    try:
        time.sleep(STOP_S)
    finally:
        ctx.cluster.signal("draft", signal.SIGCONT)
    return Effect(f"SIGSTOP draft {STOP_S:.0f} s, then SIGCONT")


def workload_only(note: str) -> Callable[[FaultContext], Effect]:
    """The "during" workload is the fault; ``note`` says what it is."""
    return lambda ctx: Effect(note)


def prefix_eviction(ctx: FaultContext) -> Effect:
    """Once every request ended and was released, the target's cache must be within its bound."""
    hits = sum(o.cached_tokens > 0 for o in ctx.wait_load())
    ctx.cluster.wait_empty()
    cached = ctx.cluster.occupancy("target0").prefix_cached_tokens
    effect = Effect(
        f"24 requests over 6 shared prefixes (24-88 tokens) through prefix caches of "
        f"{PREFIX_CACHE_TOKENS} tokens, every 4th cancelled: {hits} prefix hits; the target's "
        f"cache holds {cached} tokens after"
    )
    if cached > PREFIX_CACHE_TOKENS:
        effect.failures[f"prefix cache over its bound ({cached} tokens)"] += 1
    return effect


@dataclass(frozen=True)
class Hostile:
    name: str
    path: str
    body: bytes
    declared: int | None = None  # the Content-Length sent; None: len(body)


def hostile(model: str) -> list[Hostile]:
    """The hostile requests for a router serving ``model``: every one must get a 4xx."""
    m = json.dumps(model)
    completion = lambda fields: f'{{"model": {m}, {fields}}}'.encode()
    bodies = {
        "truncated JSON": completion('"prompt": [1, 2,')[:-1],
        "not JSON": bytes(random.Random(0).randrange(256) for _ in range(4096)),
        "invalid UTF-8": completion('"prompt": "?", "max_tokens": 4').replace(b"?", b"\xff\xfe"),
        "empty body": b"",
        "nested 100k deep": b"[" * 100_000 + b"]" * 100_000,
        "100k-digit number": completion('"prompt": [' + "9" * 100_000 + "]"),
        "token id 2**40": completion('"prompt": [1099511627776], "max_tokens": 4'),
        "token id -5": completion('"prompt": [-5], "max_tokens": 4'),
        "float token id": completion('"prompt": [1.5], "max_tokens": 4'),
        "wrong types": completion('"prompt": {"a": 1}, "max_tokens": "many"'),
        "max_tokens 1e12": completion('"prompt": [5, 6], "max_tokens": 1000000000000'),
        "n 1e6": completion('"prompt": [5, 6], "max_tokens": 4, "n": 1000000'),
        "10k stop strings": completion('"prompt": [5], "stop": ' + json.dumps(["x"] * 10_000)),
        "2 MB text prompt": completion('"prompt": "' + "a" * (2 << 20) + '"'),
        "9 MB of token ids": completion('"prompt": [' + "1, " * 3_000_000 + "1]"),
    }
    jobs = [Hostile(name, "/v1/completions", body) for name, body in bodies.items()]
    chat = f'{{"model": {m}, "messages": [' + '{"role": "user", "content": "hi"}, ' * 100_000
    jobs.append(Hostile("100k chat messages", "/v1/chat/completions", chat.encode()[:-2] + b"]}"))
    start = completion('"prompt": [' + "1, " * 80_000)  # the rest is never sent
    return [*jobs, Hostile("announced 50 MB", "/v1/completions", start, declared=50 << 20)]


def hostile_bodies(ctx: FaultContext) -> Effect:
    port = ctx.cluster.http_port
    jobs = hostile(ctx.cluster.model_name) * 3
    with ThreadPoolExecutor(4) as pool:
        statuses = list(pool.map(lambda j: http_post(port, j.path, j.body, j.declared), jobs))
    effect = Effect(f"{len(jobs)} hostile bodies: {_counts(Counter(statuses))}")
    effect.failures.update(
        f"http {s or 'reset'} ({j.name})" for j, s in zip(jobs, statuses, strict=True)
        if not 400 <= s < 500
    )  # fmt: skip
    _check_health(port, effect)
    return effect


def idle_connections(ctx: FaultContext) -> Effect:
    """NUM_IDLE sockets that send nothing, held while requests run: /health and greedy HTTP
    completions must still answer (exact); then count the sockets the router closes."""
    port, effect = ctx.cluster.http_port, Effect("")
    health_ms = [_timed_health(port, effect)]
    socks = [socket.create_connection(("127.0.0.1", port), timeout=10) for _ in range(NUM_IDLE)]
    try:
        health_ms.append(_timed_health(port, effect))
        probes = [Req((5 + k, 6, 7, 8), 8) for k in range(4)]
        exact = sum(
            _http_completion(port, ctx.cluster.model_name, r) == ctx.expected_text(r)
            for r in probes
        )
        if exact < len(probes):
            effect.failures["http completion not exact"] += len(probes) - exact
        closed = _closed_within(socks, IDLE_WAIT_S)
    finally:
        for s in socks:
            s.close()
    effect.note = (
        f"{NUM_IDLE} idle sockets: /health in {health_ms[0]:.0f} ms before them, "
        f"{health_ms[1]:.0f} ms with them open; HTTP completions "
        f"{exact}/{len(probes)} exact; router closed {closed}/{NUM_IDLE} within {IDLE_WAIT_S:.0f} s"
    )
    return effect


def _http_completion(port: int, model: str, req: Req) -> str | None:
    body = {"model": model, "prompt": list(req.prompt), "max_tokens": req.max_new_tokens,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    status, data = http_post(port, "/v1/completions", json.dumps(body).encode(), read_body=True)
    return json.loads(data)["choices"][0]["text"] if status == 200 else None


def _check_health(port: int, effect: Effect) -> None:
    status = http_post(port, "/health", b"", method="GET")
    if status != 200:
        effect.failures[f"/health {status or 'reset'}"] += 1


def _timed_health(port: int, effect: Effect) -> float:
    start = time.perf_counter()
    _check_health(port, effect)
    return (time.perf_counter() - start) * 1e3


def _closed_within(socks: list[socket.socket], timeout_s: float) -> int:
    """How many of ``socks`` the server closes (EOF or reset) within ``timeout_s``."""
    deadline, open_ = time.monotonic() + timeout_s, list(socks)
    while open_ and time.monotonic() < deadline:
        for s in list(open_):
            s.setblocking(False)
            try:
                if s.recv(4096) == b"":
                    open_.remove(s)
            except BlockingIOError:
                pass
            except OSError:
                open_.remove(s)
        time.sleep(0.2)
    return len(socks) - len(open_)


def _counts(counter: Counter) -> str:
    return ", ".join(f"{k or 'reset'}×{n}" for k, n in sorted(counter.items(), key=str))


KV_FLAGS = ("--num-kv-slots", str(KV_SLOTS))
SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario(
            "hostile-bodies",
            "a burst of malformed, oversized and out-of-range HTTP bodies "
            "(each must get a 4xx) while gRPC streams run",
            hostile_bodies,
        ),
        Scenario(
            "idle-connections",
            f"{NUM_IDLE} HTTP connections that send nothing, while gRPC "
            "streams and HTTP completions run",
            idle_connections,
        ),
        Scenario(
            "draft-stop",
            f"SIGSTOP the draft for {STOP_S:.0f} s mid-generation, then SIGCONT",
            freeze_draft,
        ),
        Scenario(
            "draft-kill",
            "SIGKILL the draft mid-generation; restart it after",
            kill("draft"),
            restart("draft"),
        ),
        Scenario(
            "target-kill",
            "SIGKILL one of two target replicas mid-generation; restart it after",
            kill("target0"),
            restart("target0"),
            cluster=ClusterSpec(num_targets=2),
        ),
        Scenario(
            "kv-pressure",
            f"16 long requests on {KV_SLOTS} KV slots (3x oversubscribed), every 4th cancelled",
            workload_only(
                f"16 requests of 96+96 tokens on {KV_SLOTS} KV slots, every 4th "
                "cancelled after 2 answers"
            ),
            cluster=ClusterSpec(model_flags=KV_FLAGS),
            during=long_with_cancels,
        ),
        Scenario(
            "prefix-evict",
            "shared prefixes through prefix caches smaller than most prompts, every 4th cancelled",
            prefix_eviction,
            cluster=ClusterSpec(model_flags=PREFIX_CACHE),
            during=shared_prefixes,
        ),
    )
}
