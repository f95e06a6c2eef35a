"""The router's Prometheus metrics, on `REGISTRY` (served at ``/metrics`` on its HTTP port).

Names follow vLLM's under a ``specmesh:`` prefix; what the split adds (prefill and step latency
as the router sees it, Step bytes on the wire, circuit breakers, replays) is labelled by replica.
The byte counters are fed by the gRPC clients' serializers (`step_stream.CountingChannel`), so
they count exactly what went over each stream, handshakes and releases included.

One registry per process. Every metric object is created once, here, at import, so any number
of `RouterCore`s share them without registering twice: counters and histograms add up over the
cores of the process, and the gauges (requests running / waiting, breaker state) are read at
scrape time from every live core (`_LiveCores`), never kept twice. The router process runs one
core, so `REGISTRY` is exactly its view; an `Engine` or a test stack in the same process adds to
the same series (tests compare deltas).

Exactness. The speculative counters are read off `Request.accept_lens`, the record the client's
`RequestStats` come from, one entry at a time (a cursor per request, advanced after each round
and flushed when the request ends): once a request has ended, ``num_accepted_tokens_total`` has
grown by exactly sum(accept_len - 1) over its rounds, ``num_accepted_tokens_per_pos_total
{position=i}`` by the number of its rounds that accepted more than i draft tokens, and the prompt
/ generation token counters by its ``prompt_tokens`` / ``completion_tokens``. Drafts and draft
tokens count the trees the target verified (root excluded).
"""

from __future__ import annotations

import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily

if TYPE_CHECKING:
    from specmesh.protocol.steps import StepOutput, VerifyInput
    from specmesh.router.core import RouterCore
    from specmesh.router.request import Request
    from specmesh.router.slot import Slot

REGISTRY = CollectorRegistry()  # the router's own: never prometheus_client's global one

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
                0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)  # fmt: skip


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(f"specmesh:{name}", doc, labels, registry=REGISTRY)


def _histogram(name: str, doc: str, buckets, labels: tuple[str, ...] = ()) -> Histogram:
    return Histogram(f"specmesh:{name}", doc, labels, buckets=buckets, registry=REGISTRY)


# Counters are named without `_total`: prometheus_client appends it (specmesh:..._total).
NUM_DRAFTS = _counter("spec_decode_num_drafts", "Verify steps of a request with a draft tree")
NUM_DRAFT_TOKENS = _counter(
    "spec_decode_num_draft_tokens", "Draft tree nodes verified (root excluded)"
)
NUM_ACCEPTED = _counter(
    "spec_decode_num_accepted_tokens", "Draft tokens accepted: sum of (accept length - 1)"
)
ACCEPTED_PER_POS = _counter(
    "spec_decode_num_accepted_tokens_per_pos",
    "Rounds whose accepted path reached this draft depth (0 = first draft token)",
    ("position",),
)
PROMPT_TOKENS = _counter("prompt_tokens", "Prompt tokens of the requests served")
GENERATION_TOKENS = _counter("generation_tokens", "Tokens streamed to clients")
REQUEST_SUCCESS = _counter(
    "request_success",
    "Requests ended, by finish reason (stop, length, abort)",
    ("finished_reason",),
)
REPLAYS = _counter(
    "request_replays", "Requests sent back for replay because this target replica failed",
    ("replica",),
)  # fmt: skip
STEP_BYTES_SENT = _counter(
    "step_bytes_sent", "Serialized bytes of the Step messages written to this replica",
    ("replica",),
)  # fmt: skip
STEP_BYTES_RECEIVED = _counter(
    "step_bytes_received", "Serialized bytes of the Step messages read from this replica",
    ("replica",),
)  # fmt: skip
PLANNED_ROUNDS = _counter(
    "spec_decode_planned_rounds",
    "Draft steps the speculation policy planned for a micro-batch, by the tree size it chose "
    "(nodes incl. the root; 1 = no speculation: plain decoding next round)",
    ("replica", "tree_size"),
)
DRAFT_FAILURES = _counter(
    "draft_failures", "Draft steps that failed or missed their deadline", ("replica",)
)
TTFT = _histogram("time_to_first_token_seconds", "Arrival to first token", _TTFT_BUCKETS)
ITL = _histogram(
    "inter_token_latency_seconds",
    "Time between streamed tokens (a round's gap spread over the tokens it streamed)",
    _ITL_BUCKETS,
)
E2E = _histogram("e2e_request_latency_seconds", "Arrival to the request's end", _E2E_BUCKETS)
TARGET_STEP = _histogram(
    "target_step_latency_seconds",
    "Verify step latency as the router sees it (wire and queueing included)",
    STEP_BUCKETS,
    ("replica",),
)
TARGET_PREFILL = _histogram(
    "target_prefill_latency_seconds",
    "Prefill step latency as the router sees it (wire and queueing included)",
    STEP_BUCKETS,
    ("replica",),
)
DRAFT_STEP = _histogram(
    "draft_step_latency_seconds",
    "Draft step (extend + propose) latency as the router sees it; failed steps excluded",
    STEP_BUCKETS,
    ("replica",),
)


class _LiveCores:
    """Gauges read at scrape time from every live core (weakly held: a stopped `Engine` core
    disappears with it). Scrapes may run on another thread: each core's dicts are copied with
    one C-level call before they are read."""

    def __init__(self) -> None:
        self.cores: weakref.WeakSet[RouterCore] = weakref.WeakSet()

    def collect(self):
        running = GaugeMetricFamily("specmesh:num_requests_running", "Requests in a micro-batch")
        waiting = GaugeMetricFamily(
            "specmesh:num_requests_waiting", "Requests waiting for admission (new or to replay)"
        )
        breaker = GaugeMetricFamily(
            "specmesh:circuit_breaker_open", "Replica breaker: 0 closed, 1 open", labels=["replica"]
        )
        tree_size = GaugeMetricFamily(
            "specmesh:spec_decode_tree_size",
            "Tree size (nodes incl. the root) the speculation policy chose last for this target "
            "replica's micro-batches; 1 = not speculating",
            labels=["replica"],
        )
        phases: dict[str, int] = {}
        opened: dict[str, int] = {}
        sizes: dict[str, int] = {}
        for core in list(self.cores):
            for slot in list(core.slots.values()):
                if not slot.request.finished:  # admitted to a worker, or waiting for one
                    phase = "waiting" if slot.worker is None else "running"
                    phases[phase] = phases.get(phase, 0) + 1
            for replica in core.replicas.all:
                opened[replica.name] = max(opened.get(replica.name, 0), int(not replica.live))
            sizes.update(dict(core.metrics.tree_sizes))
        running.add_metric([], phases.get("running", 0))
        waiting.add_metric([], phases.get("waiting", 0))
        for name, value in sorted(opened.items()):
            breaker.add_metric([name], value)
        for name, value in sorted(sizes.items()):
            tree_size.add_metric([name], value)
        return [running, waiting, breaker, tree_size]


_LIVE = _LiveCores()
REGISTRY.register(_LIVE)


@dataclass
class _Cursor:
    """How much of a request's record is counted already."""

    rounds: int = 0  # accept_lens entries
    tokens: int = 0  # output ids
    last_token_s: float | None = None  # when the newest counted tokens were streamed


class RouterMetrics:
    """The recording API of one core. Hooks: `on_prefill` / `on_verify` (a target step that
    answered) and `on_draft_step` / `on_draft_failure` (fed by the `Replica`s), `on_round`
    (after a round's emit), `on_plan`, `on_target_down`, `on_finish` (when the request's client
    side ends: every admitted request passes there once)."""

    def __init__(self, core: RouterCore) -> None:
        self.core = core
        self._cursors: dict[str, _Cursor] = {}
        self.tree_sizes: dict[str, int] = {}  # per target replica: the policy's latest choice

    def watch(self) -> None:
        """Let the gauges read the core (once it is built)."""
        _LIVE.cores.add(self.core)

    def on_prefill(self, replica: str, seconds: float) -> None:
        TARGET_PREFILL.labels(replica).observe(seconds)

    def on_verify(self, replica: str, seconds: float) -> None:
        TARGET_STEP.labels(replica).observe(seconds)

    def on_round(self, slots: list[Slot], trees: list[VerifyInput], out: StepOutput) -> None:
        """After a verify round's emit: the trees verified, and what each request streamed."""
        now = time.monotonic()
        for s, verified in zip(slots, trees, strict=True):
            nodes = verified.tree.num_nodes
            if s.rid in out.tokens and nodes > 1:
                NUM_DRAFTS.inc()
                NUM_DRAFT_TOKENS.inc(nodes - 1)
            if self.core.slots.get(s.rid) is s:  # else on_finish counted it already
                self._advance(s.request, now)

    def on_plan(self, target: str, tree_size: int) -> None:
        """The speculation policy's plan for a micro-batch verified by ``target``."""
        PLANNED_ROUNDS.labels(target, str(tree_size)).inc()
        self.tree_sizes[target] = tree_size

    def on_draft_step(self, replica: str, seconds: float) -> None:
        DRAFT_STEP.labels(replica).observe(seconds)

    def on_draft_failure(self, replica: str) -> None:
        DRAFT_FAILURES.labels(replica).inc()

    def on_target_down(self, replica: str, reqs: list[Request]) -> None:
        """Before the failover: the requests that will be replayed (not those giving up)."""
        REPLAYS.labels(replica).inc(sum(r.replays < self.core.cfg.max_replays for r in reqs))

    def on_finish(self, req: Request) -> None:
        """The request's end: the rest of its record, then its latencies."""
        self._advance(req, req.finish_s or time.monotonic())
        del self._cursors[req.rid]
        REQUEST_SUCCESS.labels(req.finish_reason or "abort").inc()
        if req.finish_s is not None:
            E2E.observe(req.finish_s - req.arrival_s)

    def _advance(self, r: Request, now: float) -> None:
        cur = self._cursors.get(r.rid)
        if cur is None:
            cur = self._cursors[r.rid] = _Cursor()
            PROMPT_TOKENS.inc(len(r.prompt_ids))
        for accept_len in r.accept_lens[cur.rounds :]:
            NUM_ACCEPTED.inc(accept_len - 1)
            for pos in range(accept_len - 1):
                ACCEPTED_PER_POS.labels(str(pos)).inc()
        cur.rounds = len(r.accept_lens)
        self._tokens(r, cur, now)

    def _tokens(self, r: Request, cur: _Cursor, now: float) -> None:
        """Generation tokens, TTFT at the first one, then each later token's share of its
        round's gap (every token a round streams arrives at once)."""
        new = r.num_generated - cur.tokens
        if new <= 0:
            return
        GENERATION_TOKENS.inc(new)
        if cur.last_token_s is None and r.first_token_s is not None:
            TTFT.observe(r.first_token_s - r.arrival_s)
            cur.last_token_s, new = r.first_token_s, new - 1  # the first token has no gap
        if cur.last_token_s is not None and new > 0:
            gap = max(now - cur.last_token_s, 0.0) / new
            for _ in range(new):
                ITL.observe(gap)
        cur.tokens, cur.last_token_s = r.num_generated, now
