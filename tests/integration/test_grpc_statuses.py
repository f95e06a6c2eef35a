"""Every bad input to the gRPC services gets its precise status, and the services keep serving:
public API validation, malformed tensors and unknown / duplicate ids on the internal Step
streams, a full KV cache."""

from __future__ import annotations

import grpc
import pytest
from grpc_harness import collect, greedy, serve_router, serve_target, wait_until

from specmesh.client import GenerationClient
from specmesh.protocol.config import TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.runtime.codec import split_hidden_states
from specmesh.target_service.runtime import TargetRuntime
from specmesh.v1 import (
    common_pb2,
    draft_pb2,
    draft_pb2_grpc,
    generation_pb2,
    target_pb2,
    target_pb2_grpc,
)

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [90]]
CODE = grpc.StatusCode


# -- statuses ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "code"),
    [
        ({}, CODE.INVALID_ARGUMENT),  # neither prompt nor ids
        ({"prompt": "x", "prompt_token_ids": [5]}, CODE.INVALID_ARGUMENT),
        ({"prompt_token_ids": [5, 320]}, CODE.INVALID_ARGUMENT),  # out of vocabulary
        ({"prompt_token_ids": [5] * 5000}, CODE.INVALID_ARGUMENT),  # over max_context
        (
            {"prompt_token_ids": [5], "sampling": generation_pb2.SamplingParams(temperature=-1.0)},
            CODE.INVALID_ARGUMENT,
        ),
        (
            {"prompt_token_ids": [5], "sampling": generation_pb2.SamplingParams(top_p=1.5)},
            CODE.INVALID_ARGUMENT,
        ),
        (
            {"prompt_token_ids": [5], "sampling": SamplingParams(max_new_tokens=5000)},
            CODE.INVALID_ARGUMENT,
        ),
        ({"prompt_token_ids": [5], "images": [b"\x89PNG"]}, CODE.INVALID_ARGUMENT),
    ],
    ids=[
        "no-prompt",
        "both-prompts",
        "oov",
        "too-long",
        "temperature",
        "top-p",
        "max-new",
        "images",
    ],
)
def test_bad_public_requests_get_their_status(stack, kwargs: dict, code) -> None:
    with pytest.raises(grpc.RpcError) as e:
        collect(stack.client.generate(**kwargs))
    assert e.value.code() == code, e.value.details()
    assert collect(stack.client.generate(prompt_token_ids=[5, 6], sampling=greedy(3)))[0]


def test_bad_top_k_on_the_wire(stack) -> None:
    from specmesh.v1 import generation_pb2

    with pytest.raises(grpc.RpcError) as e:
        collect(
            stack.client.generate(
                prompt_token_ids=[5], sampling=generation_pb2.SamplingParams(top_k=-2)
            )
        )
    assert e.value.code() == CODE.INVALID_ARGUMENT and "top_k" in e.value.details()


def test_duplicate_request_id_is_already_exists(stack) -> None:
    first = stack.client.generate(prompt_token_ids=[5, 6], sampling=greedy(400), request_id="dup")
    next(iter(first))
    with pytest.raises(grpc.RpcError) as e:
        collect(stack.client.generate(prompt_token_ids=[5], request_id="dup"))
    assert e.value.code() == CODE.ALREADY_EXISTS
    first.cancel()


def _prefill(rid: str, ids: list[int]) -> target_pb2.TargetStepRequest:
    req = target_pb2.PrefillRequest(request_id=rid, input_ids=ids)
    req.sampling.max_new_tokens = 4
    return target_pb2.TargetStepRequest(prefill=target_pb2.PrefillBatch(requests=[req]))


def _verify(rid: str, tokens: list[int]) -> target_pb2.TargetStepRequest:
    tree = {"tokens": tokens, "parents": list(range(-1, len(tokens) - 1))}
    batch = target_pb2.VerifyBatch(requests=[target_pb2.VerifyRequest(request_id=rid, tree=tree)])
    return target_pb2.TargetStepRequest(verify=batch)


def _release(rids: list[str]) -> target_pb2.TargetStepRequest:
    return target_pb2.TargetStepRequest(release=common_pb2.ReleaseBatch(request_ids=rids))


def test_target_step_statuses_keep_the_stream_alive(stack) -> None:
    batches = [
        _verify("ghost", [5]),  # unknown id
        _prefill("a", [5, 6, 7]),
        _prefill("a", [5, 6]),  # duplicate
        _prefill("b", [5, 999]),  # out of vocabulary
        _prefill("c", []),  # empty
        target_pb2.TargetStepRequest(),  # no work
        _prefill("d", [9, 10]),  # still serving
        _verify("a", [5, 6]),  # root is not the pending token: "a" fails and is dropped
        _release(["d", "a", "ghost"]),  # in-band; unknown ids are no-ops
        _prefill("e", [9, 10]),  # held until the stream ends
    ]
    for i, b in enumerate(batches):
        b.batch_id = i + 1
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.host.port}") as channel:
        stub = target_pb2_grpc.TargetStub(channel)
        out = list(stub.Step(iter(batches), timeout=30))
        assert [o.batch_id for o in out] == [b.batch_id for b in batches]
        codes = [o.status.code or o.results[0].status.code for o in out]
        assert codes == [5, 0, 6, 3, 3, 3, 0, 3, 0, 0]
        assert "pending token" in out[7].results[0].status.message
        assert out[6].results[0].token_ids and list(out[6].states.row_counts) == [2]
        assert [r.request_id for r in out[8].results] == ["d", "a", "ghost"]
        # a broken framing ends that stream only
        bad = target_pb2.TargetStepRequest(batch_id=9, chunk_index=1)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Step(iter([bad]), timeout=10))
        assert e.value.code() == CODE.INVALID_ARGUMENT and "chunk 1" in e.value.details()
    runtime = stack.target.runtime  # the ended stream's "e" is freed with it
    assert wait_until(lambda: not runtime.requests and not runtime.cache.requests)


def _extend(rid: str, ids: list[int], nxt: int, width: int, *, start: bool = True, mm=False):
    import torch

    feats = torch.randn(len(ids), width)
    states = split_hidden_states([len(ids)], {"aux_hidden": feats})[0]
    req = draft_pb2.ExtendRequest(
        request_id=rid, token_ids=ids, next_token_id=nxt, starts_request=start, multimodal=mm
    )
    batch = draft_pb2.ExtendBatch(requests=[req], states=states, propose_after=True)
    return draft_pb2.DraftStepRequest(extend=batch)


def test_draft_step_statuses_and_malformed_tensors(stack) -> None:
    mc = stack.target.runtime.model_config
    width = 3 * mc.hidden_size
    short, bad_dtype, bad_rank = (_extend("m", [5, 6], 7, width) for _ in range(3))
    short.extend.states.aux_hidden.data = short.extend.states.aux_hidden.data[:-4]
    bad_dtype.extend.states.aux_hidden.dtype = "fp8"
    del bad_rank.extend.states.aux_hidden.shape[:]
    bad_rank.extend.states.aux_hidden.shape.extend([2, 3, mc.hidden_size])
    propose = draft_pb2.ProposeBatch(requests=[draft_pb2.ProposeRequest(request_id="ghost")])
    release = common_pb2.ReleaseBatch(request_ids=["x", "ghost"])
    batches = [
        short,
        bad_dtype,
        bad_rank,
        draft_pb2.DraftStepRequest(propose=propose),  # unknown id
        _extend("ghost", [5], 6, width, start=False),  # unknown id
        _extend("x", [5, 6, 7], 8, width),  # good: extends and proposes
        _extend("x", [8], 9, width),  # starts a request it holds
        _extend("y", [5, 400], 6, width),  # out of vocabulary
        _extend("img", [5, 6], 7, width, mm=True),  # images but no mm_input_embeds (invariant 1)
        _extend("x", [8, 9], 10, width, start=False),  # good
        draft_pb2.DraftStepRequest(release=release),  # in-band; unknown ids are no-ops
        _extend("z", [5, 6], 7, width),  # held until the stream ends
    ]
    for i, b in enumerate(batches):
        b.batch_id = i + 1
    with grpc.insecure_channel(f"127.0.0.1:{stack.draft.host.port}") as channel:
        stub = draft_pb2_grpc.DraftStub(channel)
        out = list(stub.Step(iter(batches), timeout=30))
        codes = [o.status.code or o.results[0].status.code for o in out]
        assert codes == [3, 3, 3, 5, 5, 0, 6, 3, 3, 0, 0, 0]
        assert "bytes but shape" in out[0].status.message
        assert "unknown dtype 'fp8'" in out[1].status.message
        assert "shape [2, 3, 64], expected [rows, width]" in out[2].status.message
        assert "mm_input_embeds" in out[8].results[0].status.message
        assert out[5].results[0].tree.tokens[0] == 8 and out[9].results[0].tree.tokens[0] == 10
    runtime = stack.draft.runtime  # the ended stream's "z" is freed with it
    assert wait_until(lambda: not runtime.live and not runtime.drafter.cache.requests)


def test_a_prompt_larger_than_the_whole_kv_cache_is_invalid_argument(stack) -> None:
    """It could never fit, so it fails at once rather than wait (or come back as a "try
    later"); the target serves the next request."""
    small = TargetRuntime(TargetConfig(stack.dirs.target, num_kv_slots=16, max_context=64))
    target = stack.loop.run(serve_target(small))
    router = stack.loop.run(serve_router(target))
    try:
        with GenerationClient(f"127.0.0.1:{router.port}") as client:
            with pytest.raises(grpc.RpcError) as e:
                collect(client.generate(prompt_token_ids=list(range(5, 25)), sampling=greedy(4)))
            assert e.value.code() == CODE.INVALID_ARGUMENT, e.value.details()
            assert "more KV than the whole cache holds (16 slots)" in e.value.details()
            ids = collect(client.generate(prompt_token_ids=[5, 6, 7], sampling=greedy(6)))[0]
            assert ids == stack.expected([5, 6, 7], 6)
    finally:
        stack.loop.run(router.stop(0.5))
        stack.loop.run(target.host.shutdown(0.5))


def test_a_request_over_the_draft_context_fails_alone(stack) -> None:
    """A draft with max_context 16 and SPEC (3 steps, topk 2: a tree writes 4 KV tokens past the
    committed ones) gets one batch of four new requests: "near" (14 tokens) fits its extend but
    not its tree, "over" (17) not even its extend. Only those two get RESOURCE_EXHAUSTED naming
    the numbers; the others get trees (issue 33 #9: the whole batch failed), and the draft holds
    nothing once released."""
    import torch
    from grpc_harness import SPEC, serve_draft

    from specmesh.draft_service.runtime import load_draft
    from specmesh.protocol.config import DraftConfig

    cfg = DraftConfig("eagle3", stack.dirs.draft, stack.dirs.target, SPEC, max_context=16)
    draft = stack.loop.run(serve_draft(load_draft(cfg)))
    width = 3 * stack.target.runtime.model_config.hidden_size
    lens = {"a": 3, "near": 14, "over": 17, "b": 12}
    requests = [
        draft_pb2.ExtendRequest(
            request_id=rid, token_ids=[5 + i for i in range(n)], next_token_id=4,
            starts_request=True,
        )
        for rid, n in lens.items()
    ]  # fmt: skip
    feats = torch.randn(sum(lens.values()), width)
    states = split_hidden_states(list(lens.values()), {"aux_hidden": feats})[0]
    step = draft_pb2.ExtendBatch(requests=requests, states=states, propose_after=True)
    release = common_pb2.ReleaseBatch(request_ids=list(lens))
    batches = [
        draft_pb2.DraftStepRequest(batch_id=1, extend=step),
        draft_pb2.DraftStepRequest(batch_id=2, release=release),
    ]
    try:
        with grpc.insecure_channel(f"127.0.0.1:{draft.host.port}") as channel:
            out = list(draft_pb2_grpc.DraftStub(channel).Step(iter(batches), timeout=30))
            results = {r.request_id: r for r in out[0].results}
            runtime = draft.runtime
            assert wait_until(lambda: not runtime.live and not runtime.drafter.cache.requests)
            info = draft_pb2_grpc.DraftStub(channel).GetInfo(generation_pb2.InfoRequest())
        assert info.occupancy.num_requests == 0 and info.occupancy.kv_slots_used == 0
        assert not info.HasField("online_learning")  # a draft that does not learn
        assert not any(r.HasField("weight_version") for r in out[0].results)
    finally:
        stack.loop.run(draft.host.shutdown(0.5))
    codes = {rid: r.status.code for rid, r in results.items()}
    assert codes == {"a": 0, "near": CODE.RESOURCE_EXHAUSTED.value[0], "over": 8, "b": 0}, codes
    assert results["a"].tree.tokens[0] == 4 and results["b"].tree.tokens[0] == 4
    assert len(results["a"].tree.tokens) == len(results["b"].tree.tokens) == SPEC.num_draft_tokens
    assert "needs 18 draft tokens" in results["near"].status.message, results["near"].status.message
    assert "max_context 16" in results["over"].status.message, results["over"].status.message
