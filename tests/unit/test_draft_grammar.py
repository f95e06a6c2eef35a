"""The draft proposes only grammar-valid tokens (issue 32, `draft_service.grammar`).

Every node of every tree proposed for a constrained request lies on its grammar along its path,
checked with a fresh matcher of the target's engine over the request's output so far plus the
path: on the demo pair (EAGLE-3, fp32) and on the tiny pair (a 200-of-320 draft vocabulary,
``d2t``), with prompts prefilled in pieces and requests preempted and replayed. The output is
unchanged (greedy and seeded equal the same requests without speculation); constrained rounds
on the demo pair accept far more than with an unmasked draft (1.28 tokens per round); and the
draft holds no matcher once a request is finished, released or failed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_speculated

from specmesh.defaults import REPO_MODELS
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.constraints import Constraint
from specmesh.protocol.errors import InvalidRequestError, KVCacheFullError
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import ExtendInput, StepOutput
from specmesh.router.chat import ChatRenderer
from specmesh.router.engine import Engine
from specmesh.router.round import Batch
from specmesh.router.router_config import RouterConfig
from specmesh.runtime.grammar import Grammars

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0},
        "kind": {"enum": ["function", "class", "module"]},
    },
    "required": ["name", "age", "kind"],
    "additionalProperties": False,
}
JSON = Constraint.json_schema(SCHEMA)
ASKS = ["Describe the function fibonacci", "Describe the class Path", "Describe os.walk",
        "Describe the module json", "Describe the function sorted", "Describe dict.get"]  # fmt: skip


@pytest.fixture(scope="module")
def demo() -> Engine:
    fp32 = {"dtype": "float32"}
    target, draft = REPO_MODELS / "target", REPO_MODELS / "draft"
    return Engine(target, draft_model=draft, draft_kind="eagle3", spec=SpecParams(5, 4, 8),
                  target_config=fp32, draft_config=fp32)  # fmt: skip


def _chat(engine: Engine) -> list[str]:
    chat = ChatRenderer(engine.tokenizer)
    return [chat.render([{"role": "user", "content": a + " as JSON"}]) for a in ASKS]


def _tiny(tiny_dir: Path, **router) -> Engine:
    return Engine(
        tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
        spec=SpecParams(3, 4, 8), target_config={"num_kv_slots": 96},
        router_config=RouterConfig(**router),
    )  # fmt: skip


@pytest.fixture
def proposals(monkeypatch: pytest.MonkeyPatch) -> list:
    """Each draft tree the target verifies, with its request's constraint and output so far
    (the root, the pending token, last), taken as the round takes the tree."""
    seen: list = []
    take = Batch.take_trees

    def spy(self, slots):
        seen.extend((s.request.params.constraint, list(s.request.output_ids), s.tree)
                    for s in slots if s.tree is not None)  # fmt: skip
        return take(self, slots)

    monkeypatch.setattr(Batch, "take_trees", spy)
    return seen


def _check_on_grammar(grammars: Grammars, proposals: list) -> int:
    """Walk every node of every constrained tree with a fresh matcher; the nodes checked."""
    checked = 0
    for constraint, output, tree in proposals:
        assert tree.tokens[0] == output[-1]
        if constraint is None:
            continue
        paths: list[list[int]] = [[]]
        for i in range(1, tree.num_nodes):
            paths.append([*paths[tree.parents[i]], tree.tokens[i]])
            grammars.start(constraint, output + paths[i])  # raises off the grammar
            checked += 1
    return checked


def _generate_both(engine: Engine, prompts: list, params: list[SamplingParams]):
    spec = engine.generate(prompts, params)
    plain = engine.generate(prompts, params, disable_speculation=True)
    assert [r.token_ids for r in spec] == [r.token_ids for r in plain]
    assert engine.draft.grammars.tracks == {} and engine.draft.live == {}
    return spec


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_demo_pair_trees_stay_on_the_grammar(demo, proposals, temperature) -> None:
    prompts = _chat(demo)[:3]
    params = [SamplingParams(48, temperature, seed=s, constraint=JSON) for s in range(3)]
    results = _generate_both(demo, prompts, params)
    assert _check_on_grammar(demo.target.grammars, proposals) >= 5 * len(proposals)
    assert_speculated(results, min_mean_accept=1.5)


def test_tiny_pair_chunked_and_replayed_trees_stay_on_the_grammar(tiny_dir, proposals) -> None:
    """Prompts in pieces of 4 tokens (the output starts past the starting extend) and a KV cache
    too small for all six requests (preempted ones are replayed with their output so far)."""
    engine = _tiny(tiny_dir, prefill_chunk_tokens=4, max_batch_size=6, num_micro_batches=1)
    prompts = [[5 + i, 6, 7, 8, 9, 10, 11, 12, 13, 14] for i in range(6)]
    regex = Constraint("regex", r"[a-z ]{1,12}\.")
    params = [SamplingParams(20, 0.8 * (i % 2), seed=i, constraint=[JSON, regex][i % 2])
              for i in range(6)]  # fmt: skip
    refused = []
    verify = engine.target.verify

    def counted(*args: object) -> StepOutput:
        out = verify(*args)
        refused.extend(e for e in out.errors.values() if isinstance(e, KVCacheFullError))
        return out

    engine.target.verify = counted
    results = engine.generate(prompts, params)
    assert refused, "no request was preempted (and replayed)"
    engine.target.verify = verify
    plain = engine.generate(prompts, params, disable_speculation=True)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]
    assert engine.draft.grammars.tracks == {} and engine.draft.live == {}
    assert len(proposals) >= sum(len(r.accept_lens) for r in results)  # a tree every round
    assert _check_on_grammar(engine.target.grammars, proposals) >= 3 * len(proposals)


def test_in_process_the_draft_compiles_no_constraint(tiny_dir, monkeypatch) -> None:
    """The in-process draft shares the target's compiled constraints: the target's prefill
    compiles each once, and the draft's starting extend finds it compiled (nothing compiled on
    its step thread); output unchanged, trees on the grammar."""
    engine = _tiny(tiny_dir)
    assert engine.draft.grammars.grammars is engine.target.grammars
    compiled: list[Constraint] = []
    compile_ = Grammars._compile
    monkeypatch.setattr(Grammars, "_compile",
                        lambda self, c: compiled.append(c) or compile_(self, c))  # fmt: skip
    regex = Constraint("regex", r"[a-z ]{1,12}\.")
    params = [SamplingParams(12, 0.0, constraint=c) for c in (JSON, regex, JSON)]
    prompts = [[5 + i, 6, 7, 8] for i in range(3)]
    results = _generate_both(engine, prompts, params)
    assert sorted(c.kind for c in compiled) == ["json_schema", "regex"]  # each once
    assert_speculated(results)


def test_constrained_acceptance_on_the_demo_pair(demo) -> None:
    """bench_results/HISTORY.md "Grammar masks": 2.75 tokens per round (an unmasked draft: 1.28)."""
    params = SamplingParams(64, 0.0, constraint=JSON)
    results = demo.generate(_chat(demo), params)
    assert_speculated(results, min_mean_accept=2.2)


def test_constrained_requests_are_not_predrafted() -> None:
    """With pre-drafting on, the unconstrained request of a batch hits pre-drafted trees and
    the constrained one is never pre-drafted (an outcome's tree would need grammar states);
    both outputs are exact."""
    fp32 = {"dtype": "float32"}
    engine = Engine(REPO_MODELS / "target", draft_model=REPO_MODELS / "draft",
                    draft_kind="eagle3", spec=SpecParams(5, 4, 8), target_config=fp32,
                    draft_config={**fp32, "predraft": 2})  # fmt: skip
    prompt = _chat(engine)[2]
    params = [SamplingParams(48, 0.0, constraint=JSON), SamplingParams(48, 0.0)]
    constrained, free = _generate_both(engine, [prompt, prompt], params)
    assert constrained.num_predraft_hits == 0 < free.num_predraft_hits
    assert not engine.draft.ahead.trees and not engine.draft.ahead.outcomes


# -- the runtime's matchers ------------------------------------------------------------------------
def _extend(rid: str, ids: list[int], nxt: int, **kw) -> ExtendInput:
    return ExtendInput(rid, ids, nxt, torch.randn(len(ids), 3 * 64), **kw)


def test_matchers_follow_extends_and_die_with_their_requests(tiny_dir, monkeypatch) -> None:
    cfg = DraftConfig("eagle3", str(tiny_dir / "draft"), str(tiny_dir / "target"),
                      SpecParams(3, 4, 8))  # fmt: skip
    rt = load_draft(cfg)
    grammars = Grammars(cfg.target_dir, rt.target.vocab_size, rt.target.eos_token_ids)
    brace, quote, n = (grammars.tokenizer().tokenize_str(t)[0] for t in ("{", '"', "n"))
    prompt = [5, 6, 7, 8]
    res = rt.step([
        _extend("whole", prompt, brace, new=True, constraint=JSON, output_start=4),
        _extend("piece", prompt[:2], prompt[2], new=True, constraint=JSON, output_start=4),
        _extend("replay", [*prompt, brace, quote], n, new=True, constraint=JSON, output_start=4),
        _extend("free", prompt, brace, new=True),
        _extend("bad", prompt, brace, new=True, constraint=Constraint.json_schema({"type": "x"})),
    ])  # fmt: skip
    assert "does not compile" in str(res.errors.pop("bad")) and not res.errors
    assert set(rt.grammars.tracks) == {"whole", "piece", "replay"}
    res = rt.step([_extend("piece", prompt[2:], brace), _extend("whole", [brace], quote)])
    for rid, output in {"piece": [brace], "whole": [brace, quote]}.items():
        _check_on_grammar(grammars, [(JSON, output, res.trees[rid])])
    assert res.trees["whole"].num_nodes > 1
    # after '{' only '"' is allowed, and the draft's 200-token vocabulary lacks it: a bare root
    assert res.trees["piece"].num_nodes == 1 and not rt.drafter.net.d2t.add(
        torch.arange(200)).eq(quote).any()  # fmt: skip
    assert grammars.start(JSON, [brace, quote, n])  # "replay" consumed its emitted output
    res = rt.step([_extend("whole", [quote], brace), _extend("replay", [n], n, constraint=JSON)])
    assert isinstance(res.errors["whole"], InvalidRequestError)  # '"{' leaves the grammar
    assert "starting extend" in str(res.errors["replay"])
    assert set(rt.grammars.tracks) == {"piece"} and set(rt.live) == {"piece", "free"}
    rt.release("piece")
    monkeypatch.setattr(rt.drafter, "propose", lambda *a: 1 / 0)
    res = rt.step([_extend("fails", prompt, brace, new=True, constraint=JSON)])
    assert "fails" in res.errors and rt.grammars.tracks == {} and set(rt.live) == {"free"}


def test_ngram_trees_are_cut_to_the_grammar(tiny_dir) -> None:
    """The n-gram draft's continuation stops where the grammar does: after "ab." the regex
    allows only EOS, so the looked-up "c" is cut."""
    rt = load_draft(DraftConfig("ngram", None, str(tiny_dir / "target"), SpecParams(5, 1, 6)))
    tok = Grammars(str(tiny_dir / "target"), rt.target.vocab_size, ()).tokenizer()
    x, a, b, dot, c = (tok.tokenize_str(ch)[0] for ch in "xab.c")
    regex = Constraint("regex", r"[a-z]+\.")
    prompt = [x, a, b, dot, c, x]
    free = ExtendInput("free", prompt, a, new=True)
    res = rt.step(
        [ExtendInput("regex", prompt, a, new=True, constraint=regex, output_start=6), free]
    )
    assert res.trees["free"].tokens == (a, b, dot, c, x, a)  # the continuation of "x a"
    assert res.trees["regex"].tokens == (a, b, dot)
