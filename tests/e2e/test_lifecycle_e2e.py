"""Request lifecycle with real processes: whatever ends a request (a cancel, a deadline, a router
SIGKILL, a frozen draft, a bad row in a draft batch), the target and the draft end up holding
nothing, and the cluster keeps serving exactly what transformers produces.

Every request a model service holds belongs to the router's Step stream that created it and is
freed in-band or when that stream ends, so after each case both services report zero requests
and zero used KV slots (GetInfo occupancy), and a later request is exact.
"""

from __future__ import annotations

import functools
import queue
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest
import torch
from procs import Services, Streams, start_cluster

from specmesh.client import GenerationClient
from specmesh.protocol.sampling import SamplingParams
from specmesh.runtime.codec import DTYPES, split_hidden_states
from specmesh.v1 import common_pb2, draft_pb2, draft_pb2_grpc, generation_pb2

pytestmark = pytest.mark.slow

NUM_REQUESTS, MAX_NEW = 16, 48
PROMPTS = [[5 + i, 6 + 2 * i, 7 + 3 * i, 8 + 5 * i] for i in range(NUM_REQUESTS)]
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
# A draft step slower than this is a draft failure: its requests go on without speculation.
ROUTER_FLAGS = ("--draft-timeout-s", "1")
MODEL_SERVICES = ("target0", "draft")


@pytest.fixture(scope="module")
def cluster(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    services, _ = start_cluster(
        tmp_path_factory.mktemp("lifecycle"), tiny_dir, router_flags=ROUTER_FLAGS
    )
    yield services
    services.stop()


@pytest.fixture(scope="module")
def expected(tiny_dir: Path, oracle):
    """transformers greedy for PROMPTS[i], computed once per prompt."""
    return functools.cache(lambda i: oracle(tiny_dir / "target", PROMPTS[i], MAX_NEW))


def run_all(cluster: Services, request) -> list[list[int] | None]:
    """``request(client, i)`` for every prompt at once: the tokens of each that finished."""
    with (
        GenerationClient(cluster.address("router")) as client,
        ThreadPoolExecutor(NUM_REQUESTS) as pool,
    ):
        return list(pool.map(lambda i: request(client, i), range(NUM_REQUESTS)))


def assert_finished_exact(outputs: list[list[int] | None], expected) -> None:
    assert None in outputs  # some request did end early
    for i, tokens in enumerate(outputs):
        assert tokens is None or tokens == expected(i), f"request {i}"


def assert_exact(streams: Streams, expected) -> None:
    """Every request of ``streams`` (PROMPTS[0], PROMPTS[1], ...) finished, exact."""
    streams.join()
    n = len(streams.outputs)
    assert streams.errors == [None] * n
    assert streams.outputs == [expected(i) for i in range(n)]


def assert_clean_and_exact(
    cluster: Services, expected, request_ids: tuple[str, ...] = ("", "")
) -> None:
    """Both model services hold nothing; then requests (ids ``request_ids``, "" = the router
    picks) are exact, and leave nothing behind either."""
    cluster.wait_empty(*MODEL_SERVICES)
    router = cluster.address("router")
    assert_exact(Streams(router, PROMPTS[: len(request_ids)], MAX_NEW, request_ids), expected)
    cluster.wait_empty(*MODEL_SERVICES)


def cancel_after(client: GenerationClient, i: int, num_responses: int | None) -> list[int] | None:
    """Cancel request i after reading ``num_responses`` responses (0: right after sending,
    during prefill; None: never). Returns the tokens of a request that finished, else None."""
    call = client.generate(prompt_token_ids=PROMPTS[i], sampling=GREEDY, timeout=120)
    tokens: list[int] = []
    if num_responses == 0:
        call.cancel()
        return None
    for n, response in enumerate(call, start=1):
        tokens += response.token_ids
        if n == num_responses:
            call.cancel()
            return None
    return tokens


def test_concurrent_cancels_free_everything(cluster: Services, expected) -> None:
    rng = random.Random(0)
    plan = [rng.choice([0, 0, 1, 2, 3, 5, None, None]) for _ in range(NUM_REQUESTS)]
    outputs = run_all(cluster, lambda client, i: cancel_after(client, i, plan[i]))
    assert any(tokens is not None for tokens in outputs), plan  # some were left to finish
    assert_finished_exact(outputs, expected)
    assert_clean_and_exact(cluster, expected)


def finish_before(client: GenerationClient, i: int, timeout_s: float) -> list[int] | None:
    """Request i with a deadline: its tokens, or None when the deadline passed."""
    try:
        call = client.generate(prompt_token_ids=PROMPTS[i], sampling=GREEDY, timeout=timeout_s)
        return [t for response in call for t in response.token_ids]
    except grpc.RpcError as e:
        assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED, e
        return None


def test_deadlines_during_prefill_free_everything(cluster: Services, expected) -> None:
    rng = random.Random(1)
    timeouts = [rng.uniform(0.001, 0.05) for _ in range(NUM_REQUESTS)]
    outputs = run_all(cluster, lambda client, i: finish_before(client, i, timeouts[i]))
    assert_finished_exact(outputs, expected)
    assert_clean_and_exact(cluster, expected)


def test_router_sigkill_frees_its_requests(cluster: Services, expected) -> None:
    ids = tuple(f"kill-{i}" for i in range(8))
    streams = Streams(cluster.address("router"), PROMPTS[: len(ids)], MAX_NEW, ids)
    streams.wait_started()
    held = cluster.occupancy("target0")
    cluster.kill("router")
    streams.join()
    num_cut = sum(e is not None for e in streams.errors)
    assert num_cut, "the kill landed after every request finished"
    # a request cut by the kill was prefilled and unfinished when `held` was read
    assert held.num_requests >= num_cut and held.kv_slots_used > 0, held
    cluster.wait_empty(*MODEL_SERVICES)  # no router at all: the dead one's streams ended
    cluster.restart("router")
    cluster.wait_ready("router")
    assert_clean_and_exact(cluster, expected, request_ids=ids)


def test_router_sigkill_with_cached_prefixes(cluster: Services, tiny_dir: Path, oracle) -> None:
    """Requests running on cached prefix blocks when their router is killed: their references
    go with their streams, the cache stays (it belongs to the service) and serves the next
    router's request exactly."""
    shared = [(7 * i + 3) % 200 + 4 for i in range(40)]
    prompts = [[*shared, 50 + i] for i in range(6)]
    router = cluster.address("router")
    want = lambda p: oracle(tiny_dir / "target", p, MAX_NEW)
    warm = Streams(router, prompts[:1], MAX_NEW)  # fills the cache with the shared blocks
    warm.join()
    assert warm.outputs[0] == want(prompts[0])
    streams = Streams(router, prompts[1:], MAX_NEW)
    streams.wait_started()
    cluster.kill("router")
    streams.join()
    assert any(e is not None for e in streams.errors), "the kill landed after every request"
    cluster.wait_empty(*MODEL_SERVICES)
    assert cluster.occupancy("target0").prefix_cached_tokens >= 32
    cluster.restart("router")
    cluster.wait_ready("router")
    with GenerationClient(cluster.address("router")) as client:
        ids, last = [], None
        for response in client.generate(prompt_token_ids=prompts[-1], sampling=GREEDY):
            ids += response.token_ids
            last = response
    assert ids == want(prompts[-1]) and last.stats.cached_tokens == 32
    cluster.wait_empty(*MODEL_SERVICES)


def test_frozen_draft_past_its_timeout_changes_nothing(cluster: Services, expected) -> None:
    n = 8
    streams = Streams(cluster.address("router"), PROMPTS[:n], MAX_NEW)
    before = streams.wait_started()
    cluster.pause("draft")
    try:
        time.sleep(3.0)  # well past --draft-timeout-s
    finally:
        cluster.resume("draft")
    assert_exact(streams, expected)
    assert before < n * MAX_NEW  # the freeze landed mid-generation
    assert_clean_and_exact(cluster, expected)


class StepStream:
    """A raw Draft.Step stream driven by hand: `send` a batch and read its answer, `close`."""

    def __init__(self, address: str) -> None:
        self.channel = grpc.insecure_channel(address)
        self.outbox: queue.Queue = queue.Queue()  # None = half-close
        stub = draft_pb2_grpc.DraftStub(self.channel)
        self.call = stub.Step(iter(self.outbox.get, None), timeout=60)

    def send(self, request: draft_pb2.DraftStepRequest) -> draft_pb2.DraftStepResponse:
        self.outbox.put(request)
        return next(self.call)

    def close(self) -> None:
        """Half-close; the service ends the stream."""
        self.outbox.put(None)
        assert list(self.call) == []
        self.channel.close()


def extend_batch(info: draft_pb2.DraftInfo, rows: dict[str, list[int]]) -> draft_pb2.ExtendBatch:
    """Starting extends of ``rows`` (request id -> prompt ids) with random EAGLE-3 features,
    proposing after."""
    width = len(info.aux_layer_ids) * info.hidden_size
    row_counts = [len(ids) for ids in rows.values()]
    features = torch.randn(sum(row_counts), width).to(DTYPES[info.dtype])
    (states,) = split_hidden_states(row_counts, {"aux_hidden": features})
    requests = [
        draft_pb2.ExtendRequest(request_id=rid, token_ids=ids, starts_request=True, next_token_id=9)
        for rid, ids in rows.items()
    ]
    return draft_pb2.ExtendBatch(requests=requests, states=states, propose_after=True)


def test_bad_row_in_a_draft_batch_fails_alone(cluster: Services, expected) -> None:
    address = cluster.address("draft")
    with grpc.insecure_channel(address) as channel:
        info = draft_pb2_grpc.DraftStub(channel).GetInfo(generation_pb2.InfoRequest(), timeout=10)
    assert info.feature == common_pb2.FEATURE_AUX_HIDDEN
    rows = {"good-0": [5, 6, 7], "bad": [5, info.vocab_size + 3, 7], "good-1": [8, 9]}
    stream = StepStream(address)
    answer = stream.send(draft_pb2.DraftStepRequest(batch_id=1, extend=extend_batch(info, rows)))
    assert answer.batch_id == 1 and answer.status.code == 0, answer.status
    results = {r.request_id: r for r in answer.results}
    assert list(results) == list(rows)
    assert results["bad"].status.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    for rid in ("good-0", "good-1"):
        assert results[rid].status.code == 0, results[rid].status
        assert results[rid].tree.tokens[0] == 9  # root = next_token_id
    held = cluster.occupancy("draft")
    # the bad row was dropped, the good ones are held
    assert held.num_requests == 2 and held.kv_slots_used > 0, held
    stream.close()
    assert_clean_and_exact(cluster, expected)
