"""The target's feature rows pass through the gRPC router as bytes: the draft receives byte-for-byte
slices of what the target sent, and the router decodes none of them (no torch tensor is built)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
import torch
from conftest import assert_accepted
from grpc_harness import collect, greedy, serve_router

from specmesh.client import GenerationClient
from specmesh.protocol.codec import CodecError, RowBlock, join_rows, join_state_rows
from specmesh.protocol.features import AuxLayers, Feature, FeatureSpec
from specmesh.protocol.steps import DraftInfo, ExtendInput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.router import grpc_clients
from specmesh.router.draft_rows import split_rows
from specmesh.runtime import codec
from specmesh.v1 import common_pb2, target_pb2

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48]]
WIDTH = 12


class FakeStream:
    """A Step stream that answers every batch with ``answer`` and keeps what was written."""

    def __init__(self, answer: list) -> None:
        self.answer, self.written = answer, []

    async def submit(self, messages: list):
        self.written += messages
        return self._answer()

    async def _answer(self) -> list:
        return self.answer


def _target_answer(rows: dict[str, int], chunk_bytes: int) -> tuple[list, torch.Tensor]:
    features = torch.randn(sum(rows.values()), WIDTH, dtype=torch.bfloat16)
    states = codec.split_hidden_states(list(rows.values()), {"aux_hidden": features}, chunk_bytes)
    results = [
        target_pb2.TargetResult(request_id=rid, token_ids=[7] * n) for rid, n in rows.items()
    ]
    answer = [target_pb2.TargetStepResponse(results=results, states=states[0])]
    return answer + [target_pb2.TargetStepResponse(states=s) for s in states[1:]], features


def _through_router(rows: dict[str, int], live: list[str], chunk_bytes: int):
    """A verify answer read by the gRPC target client, cut per request by the round, and the
    extends for ``live`` written by the gRPC draft client, with torch's decoders disabled."""
    answer, features = _target_answer(rows, chunk_bytes)

    async def run():
        target = grpc_clients.GrpcTargetClient("127.0.0.1:1")
        draft = grpc_clients.GrpcDraftClient("127.0.0.1:1", chunk_bytes=chunk_bytes)
        needs = FeatureSpec(Feature.AUX_HIDDEN, AuxLayers((1, 2, 3), "input"))
        draft.info = DraftInfo("eagle3", needs, 3, 1, 4)
        target.stream, draft.stream = FakeStream(answer), FakeStream([SimpleNamespace(
            status=common_pb2.Status(), results=[])])  # fmt: skip
        out = await target.verify([VerifyInput(rid, DraftTree.chain([1])) for rid in rows])
        cut = split_rows(out)
        extends = [ExtendInput(rid, [7] * rows[rid], 7, cut[rid][0]) for rid in live]
        await draft.step(extends)
        await asyncio.gather(target.channel.close(), draft.channel.close())
        return out, draft.stream.written

    with pytest.MonkeyPatch.context() as mp:
        for name in ("frombuffer", "cat"):  # any decode or re-encode in the router would fail
            mp.setattr(torch, name, _forbidden(name))
        out, written = asyncio.run(run())
    return answer, features, out, written


def _forbidden(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"torch.{name} called on the router's feature path")

    return fail


def _payload(chunks: list) -> bytes:
    return b"".join(c.states.aux_hidden.data for c in chunks if c.states.HasField("aux_hidden"))


def test_draft_receives_the_targets_bytes_without_a_decode() -> None:
    rows = {"a": 3, "b": 1, "c": 4}
    answer, features, out, written = _through_router(rows, ["a", "c"], 1 << 20)
    assert isinstance(out.features, RowBlock) and out.features.shape == (8, WIDTH)
    sent = _payload(answer)
    row_bytes = WIDTH * 2
    assert _payload([m.extend for m in written]) == sent[: 3 * row_bytes] + sent[4 * row_bytes :]
    assert written[0].extend.states.row_counts == [3, 4]
    assert sent == features.view(torch.int16).numpy().tobytes()  # the target's own rows


def test_a_whole_batch_in_order_is_forwarded_without_a_copy() -> None:
    rows = {"a": 2, "b": 5}
    answer, _, out, written = _through_router(rows, ["a", "b"], 1 << 20)
    assert _payload([m.extend for m in written]) == answer[0].states.aux_hidden.data
    joined = join_rows([out.features[0:2], out.features[2:7]])
    assert joined.buffer is out.features.buffer and joined.tobytes() is out.features.buffer


def test_rows_chunked_on_both_hops_arrive_whole() -> None:
    """Chunked answers from the target, re-chunked to the draft's budget: same bytes."""
    rows = {"a": 9, "b": 6, "c": 1}
    budget = 4 * WIDTH * 2  # four rows per message
    answer, _, _, written = _through_router(rows, ["a", "b", "c"], budget)
    assert len(answer) == 4 and len(written) == 4
    assert _payload([m.extend for m in written]) == _payload(answer)


def test_malformed_rows_are_refused_with_the_numbers() -> None:
    bad = common_pb2.HiddenStates(row_counts=[2])
    codec.rows_of(torch.zeros(3, WIDTH)).write_to(bad.aux_hidden)
    with pytest.raises(CodecError, match="3 rows but row_counts"):
        join_state_rows([bad])
    short = common_pb2.HiddenStates(row_counts=[2])
    short.aux_hidden.dtype, short.aux_hidden.data = "fp32", b"\0" * 7
    short.aux_hidden.shape[:] = [2, WIDTH]
    with pytest.raises(CodecError, match="7 bytes but shape"):
        join_state_rows([short])


# -- real services ------------------------------------------------------------------------------
def test_greedy_through_the_split_with_captured_bytes(stack) -> None:
    """Over real services: every feature row the draft receives is a byte-identical slice of a
    target answer, and output still equals transformers greedy."""
    sent, received = _capture(stack.target, "states"), _capture(stack.draft, "extend")
    for prompt, n in zip(PROMPTS, [12, 9, 15], strict=True):
        ids, _, _ = collect(stack.client.generate(prompt_token_ids=prompt, sampling=greedy(n)))
        assert ids == stack.expected(prompt, n)
    target_rows = {r for answer in sent for r in _per_request(answer)}
    draft_rows = [r for batch in received for r in _per_request(batch)]
    assert draft_rows and all(r in target_rows for r in draft_rows)


def test_adaptive_router_over_grpc_equals_transformers(copy_stack) -> None:
    """The adaptive policy over a draft that predicts its target (`copy_stack`): it keeps
    speculating, and the rounds it runs accept draft tokens."""
    stack = copy_stack
    router = stack.loop.run(serve_router(stack.target, stack.draft, speculation="adaptive"))
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            calls = [client.generate(prompt_token_ids=p, sampling=greedy(16)) for p in PROMPTS]
            stats = []
            for prompt, call in zip(PROMPTS, calls, strict=True):
                ids, _, last = collect(call)
                assert ids == stack.expected(prompt, 16)
                stats.append(last.stats)
        assert_accepted(stats, min_tokens=len(PROMPTS))
    finally:
        stack.loop.run(router.stop(0.5))


def _capture(servicer, kind: str) -> list[list]:
    """The HiddenStates chunks of every batch a servicer answers (``states``) or receives
    (``extend``), captured around its hook on the instance."""
    batches, inner = [], servicer.run_batch

    def run_batch(*args):
        answer, chunks = inner(*args), args[-1]
        if kind == "extend" and chunks[0].WhichOneof("work") == "extend":
            batches.append([c.extend for c in chunks])
        elif kind == "states":
            batches.append(answer)
        return answer

    servicer.run_batch = run_batch
    return batches


def _per_request(chunks: list) -> list[bytes]:
    """Each request's feature bytes in one batch's HiddenStates chunks."""
    row_counts, blocks = join_state_rows([c.states for c in chunks])
    block = blocks.get("aux_hidden")
    if block is None:
        return []
    starts = [sum(row_counts[:i]) for i in range(len(row_counts))]
    return [bytes(block[s : s + n].tobytes()) for s, n in zip(starts, row_counts, strict=True)]
