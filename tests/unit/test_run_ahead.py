"""Run-ahead decoding on the target (`target_service/run_ahead.py`): a plain request's next
step decided early is used only when the router asks for exactly that step on exactly that
state, and then gives what the step would have given; anything else runs as usual."""

from __future__ import annotations

import pytest
import torch

from specmesh.protocol.config import TargetConfig
from specmesh.protocol.features import Feature
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.target_service.runtime import TargetRuntime

PROMPTS = {"a": [5, 6, 7, 8, 9, 10], "b": [40, 41, 42], "c": [90, 91, 92, 93]}
GREEDY = SamplingParams(max_new_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def rt(tiny_dir) -> TargetRuntime:
    return TargetRuntime(TargetConfig(str(tiny_dir / "target")))


def start(rt: TargetRuntime, params=GREEDY, prompts=PROMPTS, feature=Feature.NONE) -> dict:
    for rid in list(rt.requests):
        rt.release(rid)
    out = rt.prefill([PrefillInput(rid, p, params) for rid, p in prompts.items()], feature)
    return {rid: list(out.tokens[rid]) for rid in prompts}


def plain(rt: TargetRuntime, rids) -> list[VerifyInput]:
    return [VerifyInput(rid, DraftTree.chain([rt.requests[rid].pending])) for rid in rids]


def step(rt: TargetRuntime, rids, tokens: dict, *, ahead: bool, feature=Feature.NONE):
    """One plain decode step of ``rids``, run ahead first when ``ahead``."""
    if ahead:
        rt.ahead.run(rt, list(rids), feature)
    out = rt.verify(plain(rt, rids), feature)
    assert not out.errors
    for rid in rids:
        tokens[rid] += out.tokens[rid]
    return out


def test_plain_decoding_ahead_equals_transformers(tiny_dir, oracle, rt) -> None:
    tokens, hits = start(rt), rt.ahead.num_hits
    for _ in range(11):
        step(rt, PROMPTS, tokens, ahead=True)
    assert rt.ahead.num_hits - hits == 3 * 11  # every step was decided ahead and kept
    for rid, prompt in PROMPTS.items():
        assert tokens[rid] == oracle(tiny_dir / "target", prompt, 12)
    assert rt.cache.get("a").committed_len == len(PROMPTS["a"]) + 11


def test_features_logprobs_and_seeded_samples_are_those_of_the_step(rt) -> None:
    """The kept step's output is the step's own: feature rows, logprobs and a seeded draw."""
    params = SamplingParams(max_new_tokens=32, temperature=0.8, seed=7, logprobs=2)
    runs = []
    for ahead in (False, True):
        tokens, outs = start(rt, params, feature=Feature.HIDDEN), []
        for _ in range(6):
            outs.append(step(rt, PROMPTS, tokens, ahead=ahead, feature=Feature.HIDDEN))
        runs.append((tokens, outs))
    (plain_tokens, plain_outs), (ahead_tokens, ahead_outs) = runs
    assert ahead_tokens == plain_tokens
    for p, a in zip(plain_outs, ahead_outs, strict=True):
        assert a.tokens == p.tokens and a.row_counts == p.row_counts
        torch.testing.assert_close(a.features, p.features, rtol=1e-5, atol=1e-5)
        for rid in PROMPTS:
            assert [x.token_id for x in a.logprobs[rid]] == [x.token_id for x in p.logprobs[rid]]
            assert a.logprobs[rid][0].logprob == pytest.approx(p.logprobs[rid][0].logprob, 1e-5)


def test_a_subset_of_the_batch_keeps_its_steps(tiny_dir, oracle, rt) -> None:
    """Requests that finished drop out; the others' decided steps still answer."""
    tokens, hits = start(rt), rt.ahead.num_hits
    rt.ahead.run(rt, ["a", "b", "c"], Feature.NONE)
    rt.release("b")
    step(rt, ["a"], tokens, ahead=False)  # a alone, from the 3-request decision
    step(rt, ["c"], tokens, ahead=False)  # c later, its state untouched meanwhile
    assert rt.ahead.num_hits - hits == 2 and not rt.ahead.ready
    for _ in range(4):
        step(rt, ["a", "c"], tokens, ahead=True)
    for rid in "ac":
        assert tokens[rid] == oracle(tiny_dir / "target", PROMPTS[rid], 6)


def test_a_request_that_joins_runs_beside_the_decided_ones(tiny_dir, oracle, rt) -> None:
    """a and b were run ahead, c joined after: the verify keeps a's and b's steps, runs c's,
    and returns every row in the batch's order (the same as with nothing run ahead)."""
    joined = {"c": PROMPTS["c"]}
    runs = []
    for ahead in (False, True):
        tokens = start(rt, prompts={"a": PROMPTS["a"], "b": PROMPTS["b"]}, feature=Feature.HIDDEN)
        if ahead:
            rt.ahead.run(rt, ["a", "b"], Feature.HIDDEN)
        out = rt.prefill([PrefillInput("c", joined["c"], GREEDY)], Feature.HIDDEN)
        tokens["c"] = list(out.tokens["c"])
        hits = rt.ahead.num_hits
        out = step(rt, ["c", "a", "b"], tokens, ahead=False, feature=Feature.HIDDEN)
        assert rt.ahead.num_hits - hits == (2 if ahead else 0)
        assert list(out.row_counts) == ["c", "a", "b"]
        runs.append((tokens, out))
    (plain_tokens, plain_out), (ahead_tokens, ahead_out) = runs
    assert ahead_tokens == plain_tokens
    torch.testing.assert_close(ahead_out.features, plain_out.features, rtol=1e-5, atol=1e-5)
    for rid, prompt in PROMPTS.items():
        assert ahead_tokens[rid] == oracle(tiny_dir / "target", prompt, 2)


def test_any_other_step_runs_as_usual_and_keeps_the_right_kv(tiny_dir, oracle, rt) -> None:
    """A drafted tree after a run-ahead is verified afresh: its nodes overwrite the KV the
    run-ahead wrote at the same position (kept, that KV would be for the wrong token or
    missing the tree's), and decoding goes on exactly."""
    tokens, hits = start(rt), rt.ahead.num_hits
    expected = oracle(tiny_dir / "target", PROMPTS["a"], 12)
    rt.ahead.run(rt, ["a"], Feature.NONE)
    # A 3-node tree whose first child is the right token and second a wrong one.
    tree = DraftTree.of([rt.requests["a"].pending, expected[1], 3], [-1, 0, 0])
    out = rt.verify([VerifyInput("a", tree)])
    assert out.tokens["a"] == expected[1:3]  # the child accepted, then the bonus
    tokens["a"] += out.tokens["a"]
    for _ in range(9):
        step(rt, ["a"], tokens, ahead=True)
    assert rt.ahead.num_hits - hits == 9
    assert tokens["a"] == expected


def test_a_restarted_request_never_gets_its_predecessors_step(tiny_dir, oracle, rt) -> None:
    """Released and prefilled again under the same id, on a prompt as long, with the same
    pending token: only the request's identity tells the old decision from the step asked for
    (used, it would attend to the old prompt's KV)."""
    start(rt, prompts={"a": PROMPTS["a"]})
    rt.ahead.run(rt, ["a"], Feature.NONE)
    decided = rt.ahead.ready["a"]
    rt.release("a")
    assert "a" not in rt.ahead.ready
    prompt = [200, 201, 202, 203, 204, 205]
    start(rt, prompts={"a": prompt})
    rt.ahead.ready["a"] = decided  # as if a release had missed it
    pending = rt.requests["a"].pending = decided.request.pending
    hits = rt.ahead.num_hits
    out = rt.verify(plain(rt, ["a"]))
    assert rt.ahead.num_hits == hits
    assert out.tokens["a"] == oracle(tiny_dir / "target", [*prompt, pending], 1)


def test_a_run_ahead_changes_no_request_state(rt) -> None:
    start(rt)
    before = {
        rid: (vars(r).copy(), rt.cache.get(rid).committed_len) for rid, r in rt.requests.items()
    }
    rt.ahead.run(rt, list(PROMPTS), Feature.NONE)
    after = {
        rid: (vars(r).copy(), rt.cache.get(rid).committed_len) for rid, r in rt.requests.items()
    }
    assert after == before and set(rt.ahead.ready) == set(PROMPTS)
    for rid in PROMPTS:
        rt.release(rid)
    assert not rt.ahead.ready and rt.num_requests == 0
