"""Prefix caching on the target (`runtime/prefix_cache.py`, `target_service/prefix.py`): prompts
that share a prefix reuse its KV (and its draft feature rows), output is identical with the
cache on and off, evictions under KV pressure and the size bound keep everything exact, and no
request's state outlives it."""

from __future__ import annotations

import pytest
import torch
from conftest import assert_speculated

from specmesh.kernels.testing import cpu_triton
from specmesh.protocol.config import SpecParams, TargetConfig
from specmesh.protocol.features import Feature
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput
from specmesh.router.engine import Engine
from specmesh.target_service.runtime import TargetRuntime

SHARED = [(7 * i + 3) % 200 + 4 for i in range(40)]  # a 40-token "system prompt"
PROMPTS = [SHARED + tail for tail in ([5, 6, 7], [9, 8], [11, 12, 13, 14])]
GREEDY = SamplingParams(max_new_tokens=12, ignore_eos=True)


def engine(
    tiny_dir, *, cache_tokens: int, speculate: bool, draft_cache: int = 4096, **target
) -> Engine:
    """The tiny target (and its EAGLE-3 draft) with blocks of 8 tokens."""
    draft = {
        "draft_model": tiny_dir / "draft",
        "draft_kind": "eagle3",
        "draft_config": {"prefix_cache_tokens": draft_cache, "prefix_block_size": 8},
    }
    cfg = {"prefix_cache_tokens": cache_tokens, "prefix_block_size": 8, **target}
    return Engine(tiny_dir / "target", spec=SpecParams(3, 2, 6), target_config=cfg,
                  **(draft if speculate else {}))  # fmt: skip


def one_by_one(e: Engine, prompts: list[list[int]], params=GREEDY) -> list:
    return [e.generate([p], params)[0] for p in prompts]


TRITON = cpu_triton()  # Triton on CPU tensors: the interpreter (conftest turns it on)


@pytest.mark.parametrize(
    "speculate,backend",
    [(False, "torch"), (True, "torch"), pytest.param(True, "triton", marks=TRITON.marks)],
    ids=["plain", "eagle3", "eagle3-triton"],
)
def test_shared_prefix_is_reused_and_output_unchanged(tiny_dir, oracle, speculate, backend) -> None:
    e = engine(tiny_dir, cache_tokens=4096, speculate=speculate, attention_backend=backend)
    results = one_by_one(e, PROMPTS)
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, 12)
    blocks = e.target.prefixes.blocks
    assert blocks.num_hit == 2 * 40  # the 5 full blocks of the shared prefix, twice
    if speculate:  # the draft reused its own rows of the prefix too (lookahead: 32, not 40)
        assert_speculated(results)
        assert e.draft.drafter.prefixes.num_hit == 2 * 32
        assert e.draft.kv_slots()[0] == 0
    assert e.target.kv_slots()[0] == 0 and not e.target.cache.requests
    assert e.target.prefixes.num_tokens >= 40


def test_features_are_cached_by_kind(tiny_dir) -> None:
    """Blocks filled by a prefill that computed no draft features serve plain requests only: a
    prefill that needs features misses them (and fills them in), the next one hits and gets the
    rows a cold prefill computes."""
    rt = TargetRuntime(TargetConfig(str(tiny_dir / "target"), prefix_block_size=8))
    blocks = rt.prefixes.blocks

    def prefill(rid: str, prompt: list[int], feature: Feature) -> torch.Tensor | None:
        out = rt.prefill([PrefillInput(rid, prompt, GREEDY)], feature)
        rt.release(rid)
        return out.features

    assert prefill("plain", PROMPTS[0], Feature.NONE) is None
    hit = blocks.num_hit
    cold = prefill("miss", PROMPTS[1], Feature.HIDDEN)  # blocks hold no hidden rows yet
    assert blocks.num_hit == hit
    warm = prefill("hit", PROMPTS[1], Feature.HIDDEN)
    assert blocks.num_hit == hit + 40 and warm.shape == cold.shape == (len(PROMPTS[1]), 64)
    torch.testing.assert_close(warm, cold, rtol=1e-4, atol=1e-5)
    assert prefill("plain-again", PROMPTS[2], Feature.NONE) is None
    assert blocks.num_hit == hit + 80  # a plain prefill uses any block
    assert rt.kv_slots()[0] == 0


def test_eviction_under_kv_pressure_keeps_output_exact(tiny_dir, oracle) -> None:
    """A pool barely larger than one request: cached blocks are given back as requests need
    slots (never those a running request lists), and every slot comes back at the end."""
    prompts = [[(p * 13 + i * 5) % 200 + 4 for i in range(30)] for p in range(5)]
    e = engine(tiny_dir, cache_tokens=4096, speculate=False, num_kv_slots=64)
    results = e.generate(prompts, GREEDY)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, 12)
    assert e.target.kv_slots() == (0, 64)


def test_size_bound_and_cache_off(tiny_dir, oracle) -> None:
    bounded = engine(tiny_dir, cache_tokens=16, speculate=False)
    off = engine(tiny_dir, cache_tokens=0, speculate=False)
    for e in (bounded, off):
        results = one_by_one(e, PROMPTS)
        assert [r.token_ids for r in results] == [
            oracle(tiny_dir / "target", p, 12) for p in PROMPTS
        ]
    assert bounded.target.prefixes.num_tokens <= 16
    assert off.target.prefixes.blocks is None and off.target.prefixes.num_tokens == 0


def test_seeded_sampling_is_the_same_with_a_cached_prefix(tiny_dir) -> None:
    params = SamplingParams(max_new_tokens=16, temperature=0.9, seed=5, ignore_eos=True)
    cold = engine(tiny_dir, cache_tokens=0, speculate=True)
    warm = engine(tiny_dir, cache_tokens=4096, speculate=True)
    want = [r.token_ids for r in one_by_one(cold, PROMPTS, params)]
    assert [r.token_ids for r in one_by_one(warm, PROMPTS, params)] == want
    assert warm.target.prefixes.blocks.num_hit > 0


@pytest.mark.parametrize("target_cache,draft_cache", [(4096, 0), (0, 4096)],
                         ids=["target-hit-draft-miss", "target-miss-draft-hit"])  # fmt: skip
def test_one_side_hits_the_other_misses(tiny_dir, oracle, target_cache, draft_cache) -> None:
    """A hit on one service with a miss on the other: the missing side computes what it lacks
    from whole feature rows (never rows of an empty or stale cache: SGLang #19796's NaNs); the
    output is exact and the draft's trees are still accepted."""
    e = engine(tiny_dir, cache_tokens=target_cache, speculate=True, draft_cache=draft_cache)
    results = one_by_one(e, PROMPTS)
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, 12)
    assert_speculated(results)
    hits = [e.target.prefixes.num_tokens, e.draft.drafter.prefixes]
    assert (hits[0] > 0) == bool(target_cache) and (hits[1] is not None) == bool(draft_cache)


def test_a_batch_sharing_a_new_prefix_computes_it_once(tiny_dir, oracle) -> None:
    """Prompts that arrive together with a prefix the cache does not hold yet (n > 1, users of
    one new system prompt): the first runs, the others follow from its blocks, in one prefill
    call; rows come back in the batch's order and every output is exact, speculating too."""
    e = engine(tiny_dir, cache_tokens=4096, speculate=True)
    prompts = [*PROMPTS, PROMPTS[0]]  # the same prompt twice as well
    results = e.generate(prompts, GREEDY)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, 12)
    assert_speculated(results)
    assert e.target.prefixes.blocks.num_hit == 3 * 40  # three followers of the first


def test_draft_rows_are_keyed_past_the_block(tiny_dir, oracle) -> None:
    """EAGLE's shifted pairing (SGLang #10846 / #39150): draft row t pairs the target's feature
    at t with token t + 1, so two prompts that agree on a whole block but not on the token right
    after it share the target's block and not the draft's; outputs stay exact."""
    e = engine(tiny_dir, cache_tokens=4096, speculate=True)
    base = SHARED[:16]
    prompts = [[*base, 20, 21, 22], [*base, 30, 31, 32]]  # differ at token 16
    results = one_by_one(e, prompts)
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, 12)
    assert e.target.prefixes.blocks.num_hit == 16  # two target blocks of 8
    assert e.draft.drafter.prefixes.num_hit == 8  # the draft's second block needs token 16


def test_multi_turn_reuse_is_the_same_with_speculation(tiny_dir) -> None:
    """A chat resent whole each turn (SGLang #32459: reuse collapsed with EAGLE on): each turn
    reuses the previous turn's prompt and answer (a released request's committed sequence joins
    the cache, its draft feature rows with it), as many tokens with the draft on as off."""
    hits = []
    for speculate in (False, True):
        e = engine(tiny_dir, cache_tokens=4096, speculate=speculate)
        blocks, chat, reused, want = e.target.prefixes.blocks, list(SHARED), [], [0]
        for turn in range(4):
            chat += [100 + turn, 101, 102]
            before = blocks.num_hit
            answer = e.generate([chat], GREEDY)[0].token_ids
            reused.append(blocks.num_hit - before)
            committed = len(chat) + len(answer) - 1  # the last token is pending: no KV yet
            want.append(committed // 8 * 8)  # the next turn reuses every full block of it
            chat += answer
        assert reused == want[:-1] and reused[-1] > len(chat) // 2
        hits.append(reused)
    assert hits[0] == hits[1]


def test_a_chunked_prompt_joins_the_cache_when_released(tiny_dir, oracle) -> None:
    """A prompt prefilled in pieces (here 12 tokens a round) is looked up by its first piece and
    joins the cache, answer included, when its request ends: the next one hits it."""
    from specmesh.router.router_config import RouterConfig

    e = Engine(tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
               spec=SpecParams(3, 2, 6), router_config=RouterConfig(prefill_chunk_tokens=12),
               target_config={"prefix_cache_tokens": 4096, "prefix_block_size": 8})  # fmt: skip
    results = one_by_one(e, PROMPTS[:2])
    for prompt, res in zip(PROMPTS[:2], results, strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, 12)
    assert e.target.prefixes.blocks.num_hit == 8  # the second's first piece: one whole block
    assert e.target.kv_slots()[0] == 0


def test_a_paged_cache_reuses_an_answer_exactly(copy_dir, oracle) -> None:
    """KV pages of 4 tokens, drafts the target accepts (paths that skip tree nodes permute the
    answer's slots across pages): the next turn, resent whole, hits the cache and its output is
    still transformers'. Sharing an answer's mixed pages as blocks gave it wrong tokens."""
    target = copy_dir / "target"
    e = Engine(target, draft_model=copy_dir / "eagle3", draft_kind="eagle3",
               spec=SpecParams(3, 4, 8), target_config={"page_size": 4,
               "prefix_cache_tokens": 256, "prefix_block_size": 8})  # fmt: skip
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    first = e.generate([prompt], SamplingParams(max_new_tokens=40, ignore_eos=True))[0]
    assert_speculated([first])
    chat = prompt + first.token_ids + [20, 21, 22]
    before = e.target.prefixes.blocks.num_hit
    again = e.generate([chat], SamplingParams(max_new_tokens=20, ignore_eos=True))[0]
    assert again.token_ids == oracle(target, chat, 20)
    assert e.target.prefixes.blocks.num_hit - before >= 8  # the prompt's block at least
    assert e.target.kv_slots()[0] == 0
