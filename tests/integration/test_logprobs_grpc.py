"""Logprobs and sampling controls travel the wire: client -> router -> target and back.

The draft predicts its target (`copy_stack`), so rounds accept runs of tokens and a request's
last run is cut at ``max_new_tokens``: its logprobs must be cut at the same place."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_accepted
from grpc_harness import collect

from specmesh.protocol.sampling import SamplingParams

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6]
LENGTHS = range(4, 12)  # where each request stops: inside a run of accepted tokens, for some


def test_logprobs_and_penalty_over_grpc(copy_stack) -> None:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(copy_stack.dirs.target, dtype=torch.float32).eval()
    stats, cut = [], 0
    for n in LENGTHS:
        params = SamplingParams(
            max_new_tokens=n, repetition_penalty=1.5, ignore_eos=True, logprobs=3,
            prompt_logprobs=2,
        )  # fmt: skip
        call = copy_stack.client.generate(prompt_token_ids=PROMPT, sampling=params, timeout=60)
        responses = list(call)
        ids, _, last = collect(responses)
        assert last.finish_reason == "length"
        _check_logprobs(hf, responses, ids, n)
        stats.append(last.stats)
        cut += 1 + sum(last.stats.accept_lens) > len(ids)  # the last round emitted past n
    assert_accepted(stats, min_tokens=len(LENGTHS))
    assert cut, "no request stopped inside a run of accepted tokens"


def _check_logprobs(hf, responses, ids: list[int], n: int) -> None:
    """One logprob entry per token, each transformers' (penalized) log-softmax there, the
    prompt's entries the raw log-softmax."""
    with torch.no_grad():
        prompt = torch.tensor([PROMPT])
        expect = hf.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=n, do_sample=False,
            repetition_penalty=1.5, eos_token_id=None, pad_token_id=0,
        )[0, len(PROMPT):].tolist()  # fmt: skip
        logits = hf(torch.tensor([PROMPT + ids])).logits[0].float()
    assert ids == expect
    logprobs = [e for r in responses for e in r.logprobs]
    assert len(logprobs) == len(ids), f"{len(logprobs)} logprob entries for {len(ids)} tokens"
    assert [e.token_id for e in logprobs] == ids
    for k, (tok, e) in enumerate(zip(ids, logprobs, strict=True)):
        x = logits[len(PROMPT) - 1 + k].clone()
        seen = torch.tensor(sorted(set(PROMPT + ids[:k])))
        x[seen] = torch.where(x[seen] > 0, x[seen] / 1.5, x[seen] * 1.5)
        row = torch.log_softmax(x, -1)
        assert e.logprob == pytest.approx(row[tok].item(), abs=1e-4)
        assert [t.token_id for t in e.top] == row.topk(3).indices.tolist()
    prompt_lp = responses[0].prompt_logprobs
    assert [e.token_id for e in prompt_lp] == PROMPT[1:]
    assert all(not r.prompt_logprobs for r in responses[1:])
    raw = torch.log_softmax(logits, -1)
    for t, e in enumerate(prompt_lp, start=1):
        assert e.logprob == pytest.approx(raw[t - 1, PROMPT[t]].item(), abs=1e-4)
        assert len(e.top) == 2


def test_out_of_range_control_is_invalid_argument(copy_stack) -> None:
    import grpc

    from specmesh.v1 import generation_pb2

    for params in (  # wire messages: a SamplingParams out of range cannot be made
        generation_pb2.SamplingParams(presence_penalty=3.0),
        generation_pb2.SamplingParams(logit_bias={10**6: 1.0}),
    ):
        with pytest.raises(grpc.RpcError) as err:
            list(copy_stack.client.generate(prompt_token_ids=PROMPT, sampling=params, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
