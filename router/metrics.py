"""The router's Prometheus metrics, on `REGISTRY` (served at ``/metrics`` on its HTTP port).

Names are vLLM's under a ``specmesh_`` prefix (docs/metrics.md lists them, and where they
differ from vLLM's). Every series carries ``model_name``, the served model as ``/v1/models``
names it, except the Step byte counters: the gRPC clients count those from their first
handshake, before they know the model. What the split adds (prefill and step latency as the
router sees it, Step bytes on the wire, circuit breakers, replays) is labelled by replica. The
byte counters are fed by the gRPC clients' serializers (`step_stream.CountingChannel`), so they
count exactly what went over each stream, handshakes and releases included.

Four modules: this one (speculative decoding, the replicas' steps, and `RouterMetrics`, the
recording API of a core), `metrics_request` (per-request token counts, latencies, prefix-cache
tokens and parameters), `metrics_live` (gauges read at scrape time, the services' KV usage and
cache config) and `metrics_admission` (requests refused before they run, by reason).

No counter or histogram exports a ``_created`` sample (as vLLM): `disable_created_metrics` at
import, which holds for every prometheus_client registry of the process.

One registry per process. Every metric object is created once, at import, so any number of
`RouterCore`s share them without registering twice: counters and histograms add up over the
cores of the process, and the gauges (requests running / waiting, breaker state, KV usage) are
read at scrape time from every live core (`metrics_live.LiveCores`), never kept twice. The router
process runs one core, so `REGISTRY` is exactly its view; an `Engine` or a test stack in the
same process adds to the same series (tests compare deltas).

Exactness. The speculative counters are read off `Request.accept_lens`, the record the client's
`RequestStats` come from, one entry at a time (a cursor per request, advanced after each round
and flushed when the request ends): once a request has ended, ``num_accepted_tokens_total`` has
grown by exactly sum(accept_len - 1) over its rounds, ``num_accepted_tokens_per_pos_total
{position=i}`` by the number of its rounds that accepted more than i draft tokens, and the prompt
/ generation token counters by its ``prompt_tokens`` / ``completion_tokens``. Drafts and draft
tokens count the trees the target verified (root excluded); ``iteration_tokens`` the tokens
each verify step produced (sum(accept_len) over the rounds).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics

from specmesh.router.metrics_admission import REASONS, rejection_reason
from specmesh.router.metrics_admission import counts_rejections as counts_rejections  # for core
from specmesh.router.metrics_live import KvOccupancy, LiveCores
from specmesh.router.metrics_request import ChoiceGroups, RequestCursor, RequestSeries, labelled

if TYPE_CHECKING:
    from specmesh.protocol.steps import StepOutput, VerifyInput
    from specmesh.router.core import RouterCore
    from specmesh.router.request import Request
    from specmesh.router.slot import Slot

REGISTRY = CollectorRegistry()  # the router's own: never prometheus_client's global one
disable_created_metrics()

STEP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0)  # fmt: skip
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def _counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
    return Counter(f"specmesh_{name}", doc, ("model_name", *labels), registry=REGISTRY)


def _histogram(name: str, doc: str, buckets, labels: tuple[str, ...] = ()) -> Histogram:
    labels = ("model_name", *labels)
    return Histogram(f"specmesh_{name}", doc, labels, buckets=buckets, registry=REGISTRY)


# Counters are named without `_total`: prometheus_client appends it (specmesh_..._total).
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
NUM_PREEMPTIONS = _counter(
    "num_preemptions",
    "Requests a target dropped for KV space others held: they wait and are replayed",
)
REPLAYS = _counter(
    "request_replays", "Requests sent back for replay because this target replica failed",
    ("replica",),
)  # fmt: skip
# Without model_name: a client counts from its first handshake, before the model is known.
STEP_BYTES_SENT = Counter(
    "specmesh_step_bytes_sent", "Serialized bytes of the Step messages written to this replica",
    ("replica",), registry=REGISTRY,
)  # fmt: skip
STEP_BYTES_RECEIVED = Counter(
    "specmesh_step_bytes_received", "Serialized bytes of the Step messages read from this replica",
    ("replica",), registry=REGISTRY,
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
REJECTIONS = _counter(
    "admission_rejections", "Requests refused before they ran, by reason", ("reason",)
)
ITERATION_TOKENS = _histogram(
    "iteration_tokens",
    "Tokens one target verify step produced for its micro-batch (accepted + bonus)",
    ITERATION_BUCKETS,
)
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
REQUESTS = RequestSeries(REGISTRY)
_LIVE = LiveCores()
REGISTRY.register(_LIVE)


class RouterMetrics:
    """The recording API of one core. Hooks: `on_prefill` / `on_verify` (a target step that
    answered) and `on_draft_step` / `on_draft_failure` (fed by the `Replica`s), `on_admit`
    (a worker takes the request), `on_round` (after a round's emit), `on_plan`,
    `on_preempted`, `on_target_down`, `on_finish` (when the request's client side ends: every
    admitted request passes there once), `on_rejected` (a check refused a request:
    `metrics_admission.counts_rejections`), `on_choices` (the HTTP API's ``n`` choices of each
    prompt). `start` / `stop` run with the core: the KV poll."""

    def __init__(self, core: RouterCore | None) -> None:
        self.core = core
        # The served model, as /v1/models names it (`RouterCore.served_model`).
        self.model = core.served_model if core is not None else ""
        self._cursors: dict[str, RequestCursor] = {}
        self.tree_sizes: dict[str, int] = {}  # per target replica: the policy's latest choice
        self.kv = KvOccupancy()  # per replica: KV slots as its service last reported them
        self.choices = ChoiceGroups()  # which requests are one prompt's n choices
        self._poll: asyncio.Task | None = None
        for reason in REASONS if core is not None else ():  # exported from the start, at 0
            REJECTIONS.labels(self.model, reason)

    def watch(self) -> None:
        """Let the gauges read the core (once it is built)."""
        _LIVE.cores.add(self.core)

    def start(self) -> None:
        """With the core's start: the KV occupancy seen at connect, then polled."""
        replicas = self.core.replicas.all
        self.kv.seed(replicas)
        if any(hasattr(r.client, "get_info") for r in replicas):
            self._poll = asyncio.create_task(self.kv.poll(replicas))

    async def stop(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poll
            self._poll = None

    def on_prefill(self, replica: str, seconds: float) -> None:
        TARGET_PREFILL.labels(self.model, replica).observe(seconds)

    def on_verify(self, replica: str, seconds: float) -> None:
        TARGET_STEP.labels(self.model, replica).observe(seconds)

    def on_admit(self, req: Request) -> None:
        """A worker took the request (the first time: its queue time ends)."""
        cur = self._cursor(req)
        if cur.scheduled_s is None:
            cur.scheduled_s = time.monotonic()

    def on_round(self, slots: list[Slot], trees: list[VerifyInput], out: StepOutput) -> None:
        """After a verify round's emit: the trees verified, and what each request streamed."""
        now = time.monotonic()
        labelled(ITERATION_TOKENS, self.model).observe(sum(map(len, out.tokens.values())))
        drafts = draft_tokens = 0
        for s, verified in zip(slots, trees, strict=True):
            nodes = verified.tree.num_nodes
            if s.rid in out.tokens and nodes > 1:
                drafts, draft_tokens = drafts + 1, draft_tokens + nodes - 1
            if self.core.slots.get(s.rid) is s:  # else on_finish counted it already
                self._advance(s.request, now)
        if drafts:
            labelled(NUM_DRAFTS, self.model).inc(drafts)
            labelled(NUM_DRAFT_TOKENS, self.model).inc(draft_tokens)

    def on_plan(self, target: str, tree_size: int) -> None:
        """The speculation policy's plan for a micro-batch verified by ``target``."""
        PLANNED_ROUNDS.labels(self.model, target, str(tree_size)).inc()
        self.tree_sizes[target] = tree_size

    def on_draft_step(self, replica: str, seconds: float) -> None:
        DRAFT_STEP.labels(self.model, replica).observe(seconds)

    def on_draft_failure(self, replica: str) -> None:
        DRAFT_FAILURES.labels(self.model, replica).inc()

    def on_preempted(self) -> None:
        """A target dropped a request for KV space others held: it waits to be replayed."""
        NUM_PREEMPTIONS.labels(self.model).inc()

    def on_target_down(self, replica: str, reqs: list[Request]) -> None:
        """Before the failover: the requests that will be replayed (not those giving up)."""
        replayed = sum(r.replays < self.core.cfg.max_replays for r in reqs)
        REPLAYS.labels(self.model, replica).inc(replayed)

    def on_finish(self, req: Request) -> None:
        """The request's end: the rest of its record, then its latencies and parameters."""
        end_s = req.finish_s or time.monotonic()
        self._advance(req, end_s)
        cur = self._cursors.pop(req.rid)
        REQUESTS.end(self.model, req, cur.scheduled_s, end_s)
        n = self.choices.end(req.rid)
        if n is not None:  # the last of its prompt's choices
            REQUESTS.n.labels(self.model).observe(n)

    def on_rejected(self, error: Exception) -> None:
        """A check refused a request before it ran (`metrics_admission`)."""
        REJECTIONS.labels(self.model, rejection_reason(error)).inc()

    def on_choices(self, reqs: list[Request], n: int) -> None:
        """The HTTP API built ``reqs``: each prompt's ``n`` choices in turn."""
        self.choices.add(reqs, n)

    def scheduled(self, rid: str) -> bool:
        """Whether a worker admitted the request before (a waiting one waits to be replayed)."""
        cur = self._cursors.get(rid)
        return cur is not None and cur.scheduled_s is not None

    def _cursor(self, r: Request) -> RequestCursor:
        """The request's cursor; made (and its prompt counted) the first time it is seen."""
        cur = self._cursors.get(r.rid)
        if cur is None:
            cur = self._cursors[r.rid] = RequestCursor()
            REQUESTS.prompt_tokens.labels(self.model).inc(len(r.prompt_ids))
        return cur

    def _advance(self, r: Request, now: float) -> None:
        cur = self._cursor(r)
        for accept_len in r.accept_lens[cur.rounds :]:
            labelled(NUM_ACCEPTED, self.model).inc(accept_len - 1)
            for pos in range(accept_len - 1):
                labelled(ACCEPTED_PER_POS, self.model, str(pos)).inc()
        cur.rounds = len(r.accept_lens)
        REQUESTS.stream(self.model, r, cur, now)
