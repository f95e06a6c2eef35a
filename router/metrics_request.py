"""The router's request-level series, vLLM's under a ``specmesh_`` prefix: token counts and
phase latencies, observed once when a request ends, and TTFT / ITL as its tokens stream.

A request's timeline, in `time.monotonic` seconds:

    arrival ──queue──▶ scheduled ──prefill──▶ first token ──decode──▶ end
       │                   └─────────────── inference ──────────────────┤
       └──────────────────────────────── e2e ───────────────────────────┘

``arrival``, ``first token`` and ``end`` are the `Request`'s own (``arrival_s``,
``first_token_s``, ``finish_s``: the last token of a request that stopped or hit its length, the
abort of one that did not). ``scheduled`` is when a worker first admitted it
(`RouterMetrics.on_admit`), as vLLM's first scheduled timestamp: the replays after a preemption
or a failover stay inside its inference time. ``time_per_output_token`` is per request, decode /
(generated - 1) (vLLM's ``request_time_per_output_token_seconds``); the per-token gap is
``inter_token_latency_seconds``.

Every request that ends is observed once, aborts included (as ``e2e`` always was); a phase it
never reached (an abort while waiting has no prefill) is left out of that phase's histogram.

Prefill and parameters, also once per request that ends: the ``max_tokens`` it ran with (asked,
or the router's default); once its prefill ended, its prompt tokens looked up in its target's
prefix cache and those found there (`Request.cached_tokens`, its last prefill's; a replay
prefills prompt + answer, and only the prompt's part counts), so the router's prefix-cache
counters are its targets' summed over the requests it sent them. ``request_params_n`` observes
each prompt once, when the last of its ``n`` choices ends (`ChoiceGroups`).
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram


@functools.cache
def labelled(metric: Counter | Histogram, *values: str) -> Counter | Histogram:
    """``metric.labels(*values)``, looked up once: what every round records for every request
    (a ``labels`` call takes its lock and checks its values, about 1 us; this a dict lookup).
    No series of the router's is ever removed, so a child stays valid."""
    return metric.labels(*values)


if TYPE_CHECKING:
    from specmesh.router.request import Request

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # 1, 2, 5, ... 500000
N_BUCKETS = (1, 2, 5, 10, 20)  # vLLM's, for the n request parameter


@dataclass
class RequestCursor:
    """What the router's metrics hold for one request while it lives: how much of its record
    is counted already, and when it was first scheduled."""

    rounds: int = 0  # accept_lens entries counted
    tokens: int = 0  # output ids counted
    last_token_s: float | None = None  # when the newest counted tokens were streamed
    scheduled_s: float | None = None  # first admitted to a micro-batch


class RequestSeries:
    """Per-request series on ``registry``, each labelled by ``model_name``."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        # Counters are named without `_total`: prometheus_client appends it.
        self.prompt_tokens = self._counter("prompt_tokens", "Prompt tokens of the requests served")
        self.generation_tokens = self._counter("generation_tokens", "Tokens streamed to clients")
        self.success = self._counter(
            "request_success",
            "Requests ended, by finish reason (stop, length, abort)",
            ("finished_reason",),
        )
        self._latencies()
        self._prefill_and_params()

    def _counter(self, name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        labels = ("model_name", *labels)
        return Counter(f"specmesh_{name}", doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: tuple) -> Histogram:
        return Histogram(
            f"specmesh_{name}", doc, ("model_name",), buckets=buckets, registry=self.registry
        )

    def _latencies(self) -> None:
        h = self._histogram
        self.ttft = h("time_to_first_token_seconds", "Arrival to first token", TTFT_BUCKETS)
        self.itl = h(
            "inter_token_latency_seconds",
            "Time between streamed tokens (a round's gap spread over the tokens it streamed)",
            ITL_BUCKETS,
        )
        self.e2e = h("e2e_request_latency_seconds", "Arrival to the request's end", REQUEST_BUCKETS)
        self.queue = h(
            "request_queue_time_seconds",
            "Arrival to first scheduled (admitted to a micro-batch)",
            REQUEST_BUCKETS,
        )
        self.prefill = h(
            "request_prefill_time_seconds", "First scheduled to first token", REQUEST_BUCKETS
        )
        self.decode = h(
            "request_decode_time_seconds", "First token to the request's end", REQUEST_BUCKETS
        )
        self.inference = h(
            "request_inference_time_seconds",
            "First scheduled to the request's end (replays included)",
            REQUEST_BUCKETS,
        )
        self.tpot = h(
            "time_per_output_token_seconds",
            "Per request: decode time / (generated tokens - 1)",
            ITL_BUCKETS,
        )

    def _prefill_and_params(self) -> None:
        h, c = self._histogram, self._counter
        self.prompt_hist = h("request_prompt_tokens", "Prompt tokens of one request", TOKEN_BUCKETS)
        self.generation_hist = h(
            "request_generation_tokens", "Tokens one request generated", TOKEN_BUCKETS
        )
        self.prefix_queries = c(
            "prefix_cache_queries",
            "Prompt tokens looked up in the targets' prefix caches (once per request prefilled)",
        )
        self.prefix_hits = c(
            "prefix_cache_hits", "Prompt tokens found in the targets' prefix caches"
        )
        self.prompt_cached = c(
            "prompt_tokens_cached",
            "Prompt tokens of the requests prefilled that were cached (no KV computed)",
        )
        self.kv_computed = h(
            "request_prefill_kv_computed_tokens",
            "Prompt tokens whose KV one request's target computed (cached ones excluded)",
            TOKEN_BUCKETS,
        )
        self.max_tokens = h(
            "request_params_max_tokens",
            "max_tokens one request ran with (asked, or the router's default)",
            TOKEN_BUCKETS,
        )
        self.n = h(
            "request_params_n", "Choices asked of one prompt (OpenAI's n; 1 over gRPC)", N_BUCKETS
        )

    def stream(self, model: str, r: Request, cur: RequestCursor, now: float) -> None:
        """Generation tokens, TTFT at the first one, then each later token's share of its
        round's gap (every token a round streams arrives at once)."""
        new = r.num_generated - cur.tokens
        if new <= 0:
            return
        labelled(self.generation_tokens, model).inc(new)
        if cur.last_token_s is None and r.first_token_s is not None:
            self.ttft.labels(model).observe(r.first_token_s - r.arrival_s)
            cur.last_token_s, new = r.first_token_s, new - 1  # the first token has no gap
        if cur.last_token_s is not None and new > 0:
            gap = max(now - cur.last_token_s, 0.0) / new
            itl = labelled(self.itl, model)
            for _ in range(new):
                itl.observe(gap)
        cur.tokens, cur.last_token_s = r.num_generated, now

    def end(self, model: str, r: Request, scheduled_s: float | None, end_s: float) -> None:
        """The request ended at ``end_s``: its reason, token counts and phase latencies."""
        self.success.labels(model, r.finish_reason or "abort").inc()
        self.e2e.labels(model).observe(end_s - r.arrival_s)
        self.prompt_hist.labels(model).observe(len(r.prompt_ids))
        self.generation_hist.labels(model).observe(r.num_generated)
        self.max_tokens.labels(model).observe(r.params.max_new_tokens)
        first = r.first_token_s
        if scheduled_s is not None:
            self.queue.labels(model).observe(scheduled_s - r.arrival_s)
            self.inference.labels(model).observe(end_s - scheduled_s)
            if first is not None:
                self.prefill.labels(model).observe(first - scheduled_s)
        if first is not None:
            self.decode.labels(model).observe(end_s - first)
            if r.num_generated > 1:
                self.tpot.labels(model).observe((end_s - first) / (r.num_generated - 1))
            self._prefilled(model, r)

    def _prefilled(self, model: str, r: Request) -> None:
        """A request whose prefill ended: its prompt tokens, the cached ones of its last
        prefill (at most the prompt: a replay's context holds the answer too), the rest as
        computed. A request asking for prompt logprobs skips the prefix cache: no lookup."""
        num_prompt = len(r.prompt_ids)
        cached = min(r.cached_tokens, num_prompt)
        if r.params.prompt_logprobs is None:
            self.prefix_queries.labels(model).inc(num_prompt)
            self.prefix_hits.labels(model).inc(cached)
        self.prompt_cached.labels(model).inc(cached)
        self.kv_computed.labels(model).observe(num_prompt - cached)


@dataclass(eq=False)
class _Choices:
    """One prompt's ``n`` choices: a weak reference to each, and those not ended yet."""

    n: int
    requests: dict[str, weakref.ref[Request]]
    pending: set[str]


class ChoiceGroups:
    """Which requests are one prompt's ``n`` choices (the HTTP API's; a request in no group is
    its own, n = 1), so ``request_params_n`` observes each prompt once, when its last choice
    ends (as vLLM's parent request). A choice never submitted (a sibling was refused first, or
    the client went away) never ends: its group is dropped once that request is garbage."""

    def __init__(self) -> None:
        self._groups: dict[str, _Choices] = {}  # request id -> its group

    def add(self, requests: list[Request], n: int) -> None:
        """``requests``: each prompt's ``n`` choices in turn."""
        self._drop_stale()
        for start in range(0, len(requests) if n > 1 else 0, n):
            members = requests[start : start + n]
            refs = {r.rid: weakref.ref(r) for r in members}
            group = _Choices(n, refs, set(refs))
            self._groups.update(dict.fromkeys(refs, group))

    def end(self, rid: str) -> int | None:
        """The n to observe now that ``rid`` ended: 1 for a request of its own, its group's n
        when it was the group's last, else None."""
        group = self._groups.pop(rid, None)
        if group is None:
            return 1
        group.pending.discard(rid)
        return None if group.pending else group.n

    def _drop_stale(self) -> None:
        for rid, group in list(self._groups.items()):
            if any(group.requests[p]() is None for p in group.pending):
                del self._groups[rid]
