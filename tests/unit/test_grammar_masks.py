"""Grammar masks on the target (`target_service.grammar`): each tree node's mask is the one
step-by-step constrained decoding computes after that node's path, off-grammar branches roll
back without touching the request's matcher, verify over a handcrafted tree accepts exactly
what constrained plain decoding emits (greedy and seeded), and a replay rebuilds the matcher
from the emitted tokens."""

from __future__ import annotations

import json

import pytest
import torch

from specmesh.defaults import REPO_MODELS
from specmesh.protocol.config import TargetConfig
from specmesh.protocol.constraints import MAX_CONSTRAINT_BYTES, Constraint
from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.target_service.grammar import allowed, tree_masks
from specmesh.target_service.runtime import TargetRuntime

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
    "required": ["name", "n"],
    "additionalProperties": False,
}
PROMPT = "# user:\nDescribe fibonacci as JSON\n# assistant:\n"


@pytest.fixture(scope="module")
def rt() -> TargetRuntime:
    return TargetRuntime(TargetConfig(str(REPO_MODELS / "target"), dtype="float32"))


@pytest.fixture(scope="module")
def tok(rt):
    return rt.grammars.tokenizer()


def _ids(tok, text: str) -> list[int]:
    return tok.tokenize_str(text)


def test_tree_masks_follow_each_path_and_roll_back(rt, tok) -> None:
    vocab = rt.model_config.vocab_size
    matcher = rt.grammars.start(Constraint.json_schema(SCHEMA), _ids(tok, '{"'))
    name, na, brace = _ids(tok, "name")[0], _ids(tok, "n")[0], _ids(tok, "}")[0]
    close = _ids(tok, '":')
    assert len(close) == 1
    # root ─ name ─ '":'        (valid path)
    #      ├ n                  (valid: the key "n")
    #      └ } ─ name           (off the grammar, and its child)
    tokens = [999, name, close[0], na, brace, name]
    parents = [-1, 0, 1, 0, 0, 4]
    before = allowed(matcher, vocab)
    rows = tree_masks(matcher, tokens, parents, vocab)
    for i, path in {0: [], 1: [name], 2: [name, close[0]], 3: [na]}.items():
        fresh = rt.grammars.start(Constraint.json_schema(SCHEMA), _ids(tok, '{"') + path)
        assert torch.equal(rows[i], allowed(fresh, vocab)), i
    assert not rows[0][brace] and rows[4].all() and rows[5].all()  # unreachable: unmasked
    assert torch.equal(allowed(matcher, vocab), before)  # the request's matcher never moved


def _decode(
    rt: TargetRuntime, rid: str, ids: list[int], params: SamplingParams, n: int
) -> list[int]:
    out = rt.prefill([PrefillInput(rid, ids, params)])
    toks = list(out.tokens[rid])
    while len(toks) < n:
        toks += rt.decode([rid]).tokens[rid]
    rt.release(rid)
    return toks


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_verify_accepts_what_constrained_decoding_emits(rt, tok, temperature) -> None:
    params = SamplingParams(64, temperature, seed=5, constraint=Constraint.json_schema(SCHEMA))
    ids = _ids(tok, PROMPT)
    plain = _decode(rt, "plain", ids, params, 12)
    assert plain[0] == _ids(tok, "{")[0]
    # The true continuation as one branch, an off-grammar token and a grammar-valid wrong
    # token beside it at every depth.
    wrong_valid, off = _ids(tok, '"')[0], _ids(tok, "}")[0]
    tokens, parents, prev = [plain[0]], [-1], 0
    for t in plain[1:6]:
        for alt in (off, wrong_valid if t != wrong_valid else off):
            tokens.append(alt)
            parents.append(prev)
        tokens.append(t)
        parents.append(prev)
        prev = len(tokens) - 1
    out = rt.prefill([PrefillInput("spec", ids, params)])
    assert out.tokens["spec"] == plain[:1]
    got = rt.verify([VerifyInput("spec", DraftTree(tokens, parents))]).tokens["spec"]
    assert got == plain[1 : 1 + len(got)] and len(got) == 6  # 5 accepted + the bonus
    while len(got) < 11:
        got += rt.decode(["spec"]).tokens["spec"]
    rt.release("spec")
    assert got[:11] == plain[1:12]


def test_replay_rebuilds_the_matcher(rt, tok) -> None:
    params = SamplingParams(64, 0.9, seed=3, constraint=Constraint.json_schema(SCHEMA))
    ids = _ids(tok, PROMPT)
    plain = _decode(rt, "a", ids, params, 10)
    replay = PrefillInput("b", ids + plain[:4], params, sample_offset=4)
    toks = rt.prefill([replay]).tokens["b"]
    while len(toks) < 6:
        toks += rt.decode(["b"]).tokens["b"]
    rt.release("b")
    assert toks[:6] == plain[4:10]


def test_invalid_constraints_are_refused(rt, tok) -> None:
    c = Constraint.json_schema(SCHEMA)
    for bad in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(InvalidRequestError, match="grammar"):
            SamplingParams(constraint=c, **bad)
    with pytest.raises(InvalidRequestError, match="kind"):
        Constraint("ebnf", "x")
    with pytest.raises(InvalidRequestError, match=str(MAX_CONSTRAINT_BYTES)):
        Constraint("regex", "a" * (MAX_CONSTRAINT_BYTES + 1))
    with pytest.raises(InvalidRequestError, match="choices"):
        Constraint("choice", json.dumps([]))
    # the target refuses what does not compile before it holds anything
    bad = SamplingParams(constraint=Constraint.json_schema({"type": "objectx"}))
    out = rt.prefill([PrefillInput("bad", _ids(tok, PROMPT), bad)])
    assert "objectx" in str(out.errors["bad"]) and not rt.holds("bad")
    assert "bad" not in rt.cache.requests
