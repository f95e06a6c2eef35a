"""smg.worker.v1 <-> the router's messages (`specmesh.router.smg_wire`): what each SMG field
becomes, what is refused, how chunks and the final GenerateComplete are cut, and the health
state of each router state."""

from __future__ import annotations

import pytest
from google.protobuf import struct_pb2

from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import Logprob
from specmesh.router.request import Chunk
from specmesh.router.smg_wire import (
    Completion,
    Liveness,
    UnsupportedError,
    generation_request,
    matched_stop,
)
from specmesh.smg import worker_control_pb2 as control_pb2
from specmesh.smg import worker_inference_pb2 as smg_pb2

EOS = (2,)
States = control_pb2.WorkerHealthState


def _request(**sampling) -> smg_pb2.GenerateRequest:
    return smg_pb2.GenerateRequest(
        request_id="r1",
        tokenized=smg_pb2.TokenizedInput(input_ids=[5, 6, 7], original_text="abc"),
        sampling_params=smg_pb2.SamplingParams(**sampling),
        stream=True,
    )


def test_unset_fields_are_the_engines_defaults() -> None:
    msg = generation_request(_request(), EOS)
    assert msg.request_id == "r1" and list(msg.prompt_token_ids) == [5, 6, 7] and not msg.prompt
    s = msg.sampling
    assert s.temperature == 1.0  # SMG's unset temperature is 1, specmesh's 0 would be greedy
    assert (s.max_new_tokens, s.top_p, s.top_k, s.repetition_penalty) == (0, 0, 0, 0)
    assert not s.HasField("seed") and not s.HasField("logprobs")
    assert not s.HasField("constraint") and not msg.disable_speculation


def test_every_served_field_is_carried() -> None:
    msg = _request(
        temperature=0.0, top_p=0.5, top_k=-1, min_p=0.25, frequency_penalty=0.5,
        presence_penalty=-0.5, repetition_penalty=1.5, max_new_tokens=9, min_new_tokens=2,
        stop=["\n"], stop_token_ids=[11], ignore_eos=True, logit_bias={"17": -3.0},
        regex="[a-z]+", sampling_seed=42, eos_token_id=99,
        engine_parameters=struct_pb2.Struct(fields={"disable_speculation": struct_pb2.Value(
            bool_value=True)}),
    )  # fmt: skip
    msg.return_logprob, msg.top_logprobs_num = True, 3
    out = generation_request(msg, EOS)
    s = out.sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.min_tokens) == (0, 0.5, -1, 9, 2)
    assert (s.min_p, s.frequency_penalty, s.presence_penalty, s.repetition_penalty) == (
        0.25, 0.5, -0.5, 1.5
    )  # fmt: skip
    assert list(s.stop) == ["\n"] and list(s.stop_token_ids) == [11]  # ignore_eos: no 99
    assert s.ignore_eos and dict(s.logit_bias) == {17: -3.0} and s.seed == 42 and s.logprobs == 3
    assert (s.constraint.kind, s.constraint.text) == ("regex", "[a-z]+")
    assert out.disable_speculation


def test_the_gateways_eos_stops_when_the_target_does_not_know_it() -> None:
    assert list(generation_request(_request(eos_token_id=99), EOS).sampling.stop_token_ids) == [99]
    assert not generation_request(_request(eos_token_id=2), EOS).sampling.stop_token_ids


def test_text_is_the_prompt_only_without_ids() -> None:
    msg = _request()
    msg.tokenized.Clear()
    msg.tokenized.original_text = "hello"
    out = generation_request(msg, EOS)
    assert out.prompt == "hello" and not out.prompt_token_ids


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda m: setattr(m.sampling_params, "n", 2), UnsupportedError),
        (lambda m: setattr(m, "data_parallel_rank", 0), UnsupportedError),
        (lambda m: m.token_ids_logprob.append(3), UnsupportedError),
        (lambda m: setattr(m.sampling_params, "ebnf_grammar", "root ::= 'a'"), UnsupportedError),
        (lambda m: setattr(m.sampling_params, "structural_tag", "{}"), UnsupportedError),
        (lambda m: m.sampling_params.engine_parameters.update({"lora": "x"}), UnsupportedError),
        (
            lambda m: m.sampling_params.engine_parameters.update({"disable_speculation": 1}),
            InvalidRequestError,
        ),
        (lambda m: m.sampling_params.logit_bias.update({"-1": 1.0}), InvalidRequestError),
        (lambda m: m.sampling_params.logit_bias.update({"4294967296": 1.0}), InvalidRequestError),
        (lambda m: m.sampling_params.logit_bias.update({"²": 1.0}), InvalidRequestError),
        (lambda m: (setattr(m, "return_logprob", True), setattr(m, "top_logprobs_num", -1)),
         InvalidRequestError),
        (lambda m: (setattr(m, "return_logprob", True), setattr(m, "logprob_start_len", 0)),
         UnsupportedError),
        (lambda m: m.ClearField("tokenized"), InvalidRequestError),
    ],
)  # fmt: skip
def test_what_specmesh_cannot_serve_is_refused(change, error) -> None:
    msg = _request()
    change(msg)
    with pytest.raises(error):
        generation_request(msg, EOS)


def test_what_is_served_though_it_looks_unusual() -> None:
    generation_request(_request(n=1), EOS)
    msg = _request(skip_special_tokens=False, no_stop_trim=True)  # the gateway detokenizes
    msg.return_logprob, msg.logprob_start_len = True, -1  # -1: output logprobs only
    assert generation_request(msg, EOS).sampling.logprobs == 0


def _lp(token: int) -> Logprob:
    return Logprob(token, -0.5, ((token, -0.5), (1, -2.0)))


def test_streaming_sends_deltas_then_the_whole_output() -> None:
    c = Completion("r1", prompt_tokens=3, stream=True)
    first = c.answer(Chunk([4, 5], "", None, [_lp(4), _lp(5)]), cached_tokens=1)
    assert [r.WhichOneof("response") for r in first] == ["chunk"]
    assert list(first[0].chunk.token_ids) == [4, 5] and first[0].chunk.completion_tokens == 2
    assert list(first[0].chunk.output_logprobs.token_ids) == [4, 5]
    last = c.answer(Chunk([6], "", "length", [_lp(6)]), cached_tokens=1)
    assert [r.WhichOneof("response") for r in last] == ["chunk", "complete"]
    assert list(last[0].chunk.token_ids) == [6] and last[0].chunk.completion_tokens == 3
    done = last[1].complete
    assert list(done.output_ids) == [4, 5, 6] and done.finish_reason == "length"
    assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (3, 3, 1)
    assert list(done.output_logprobs.token_ids) == [4, 5, 6]  # the whole output's
    assert list(done.output_logprobs.top_logprobs[2].token_ids) == [6, 1]
    assert all(r.request_id == "r1" for r in [*first, *last])


def test_without_stream_only_the_complete_is_sent() -> None:
    c = Completion("r1", prompt_tokens=3, stream=False)
    assert c.answer(Chunk([4], ""), 0) == []
    (only,) = c.answer(Chunk([5], "", "stop"), 0, {"matched_token_id": 5})
    assert list(only.complete.output_ids) == [4, 5] and only.complete.matched_token_id == 5
    assert not only.complete.HasField("output_logprobs")


def test_an_abort_completes_with_what_was_sent() -> None:
    c = Completion("r1", prompt_tokens=3, stream=True)
    c.answer(Chunk([4], ""), 0)
    (done,) = c.answer(Chunk([], "", "abort"), 0)
    assert list(done.complete.output_ids) == [4] and done.complete.finish_reason == "abort"


@pytest.mark.parametrize(
    ("ids", "params", "text", "expected"),
    [
        ([4, 2], SamplingParams(), None, {"matched_token_id": 2}),  # EOS
        ([4, 2], SamplingParams(ignore_eos=True, stop_token_ids=(9,)), None, {}),
        ([4, 9], SamplingParams(stop_token_ids=(9,)), None, {"matched_token_id": 9}),
        ([4, 5], SamplingParams(stop=("xy",)), None, {"matched_stop_str": "xy"}),
        ([4, 5], SamplingParams(stop=("b", "ab")), "zzabc", {"matched_stop_str": "ab"}),
        ([4, 5], SamplingParams(stop=("b", "ab")), None, {}),
    ],
)
def test_matched_stop(ids, params, text, expected) -> None:
    assert matched_stop(ids, params, EOS, text) == expected


@pytest.mark.parametrize(
    ("liveness", "state"),
    [
        (Liveness(False, False, 0, 1, 0, 1), States.WORKER_HEALTH_STATE_STARTING),
        (Liveness(True, False, 1, 1, 1, 1), States.WORKER_HEALTH_STATE_SERVING),
        (Liveness(True, False, 1, 1, 0, 0), States.WORKER_HEALTH_STATE_SERVING),
        (Liveness(True, False, 1, 1, 0, 1), States.WORKER_HEALTH_STATE_DEGRADED),
        (Liveness(True, False, 1, 2, 1, 1), States.WORKER_HEALTH_STATE_DEGRADED),
        (Liveness(True, False, 0, 2, 1, 1), States.WORKER_HEALTH_STATE_NOT_SERVING),
        (Liveness(True, True, 1, 1, 1, 1), States.WORKER_HEALTH_STATE_DRAINING),
        (Liveness(False, True, 0, 1, 0, 1), States.WORKER_HEALTH_STATE_DRAINING),
    ],
)
def test_health_states(liveness: Liveness, state: int) -> None:
    assert liveness.state()[0] == state
