"""Logprobs under speculation are exactly plain decoding's: the chosen token's log-probability
and the top alternatives equal transformers' fp32 log-softmax at every position, with and
without an EAGLE-3 draft; prompt logprobs likewise; the router cuts them where it cuts tokens."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from conftest import tiny_engine
from oracle_draft import oracle_engine

from specmesh.protocol.sampling import SamplingParams
from specmesh.router.core import RouterCore
from specmesh.router.engine import Engine
from specmesh.router.in_process import InProcessDraft, InProcessTarget
from specmesh.router.request import Chunk

PROMPT = [5, 6, 7, 8, 9, 10]
ATOL = 1e-4


def run_chunks(engine: Engine, prompt: list[int], params: SamplingParams) -> list[Chunk]:
    """One request through the router core, every chunk kept (the Engine API keeps only ids)."""
    req = engine.make_request(prompt, params)

    async def go() -> list[Chunk]:
        drafts = [InProcessDraft(engine.draft)] if engine.draft else []
        core = RouterCore([InProcessTarget(engine.target)], drafts, engine.router_config)
        await core.start()
        try:
            return [c async for c in core.generate(req)]
        finally:
            await core.stop()

    return asyncio.run(go())


def hf_log_softmax(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """transformers' fp32 log-softmax at every position: row t predicts token t + 1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def assert_matches(entry, token: int, row: torch.Tensor, num_top: int) -> None:
    assert entry.token_id == token
    assert entry.logprob == pytest.approx(row[token].item(), abs=ATOL)
    top = row.topk(num_top)
    assert [t for t, _ in entry.top] == top.indices.tolist()
    assert [v for _, v in entry.top] == pytest.approx(top.values.tolist(), abs=ATOL)


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "eagle3"])
def test_greedy_logprobs_equal_transformers(tiny_dir: Path, oracle, speculate: bool) -> None:
    """With speculation the oracle draft's rounds accept up to 3 tokens along out-of-order
    paths, so each accepted node's row must be the one a logprob is read from."""
    engine = oracle_engine(tiny_dir / "target") if speculate else tiny_engine(tiny_dir, False)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=4, prompt_logprobs=3)
    chunks = run_chunks(engine, PROMPT, params)
    tokens = [t for c in chunks for t in c.token_ids]
    logprobs = [e for c in chunks for e in c.logprobs]
    assert tokens == oracle(tiny_dir / "target", PROMPT, 12)
    assert len(logprobs) == len(tokens)
    rows = hf_log_softmax(tiny_dir / "target", PROMPT + tokens)
    for k, (tok, entry) in enumerate(zip(tokens, logprobs, strict=True)):
        assert_matches(entry, tok, rows[len(PROMPT) - 1 + k], 4)
    prompt_lp = chunks[0].prompt_logprobs
    assert prompt_lp[0] is None and len(prompt_lp) == len(PROMPT)
    assert all(c.prompt_logprobs is None for c in chunks[1:])
    for t in range(1, len(PROMPT)):
        assert_matches(prompt_lp[t], PROMPT[t], rows[t - 1], 3)
    if speculate:  # the path nodes' rows were used, not only the bonus row
        assert max(len(c.token_ids) for c in chunks[1:]) == 4, [len(c.token_ids) for c in chunks]


def test_logprobs_are_cut_with_the_tokens(tiny_dir: Path, oracle) -> None:
    """A stop token inside an accepted run ends the tokens and their logprobs at one place: the
    oracle's first round accepts 3 draft tokens + the bonus (output tokens 1..4), the stop is
    the second of them."""
    engine = oracle_engine(tiny_dir / "target")
    ref = oracle(tiny_dir / "target", PROMPT, 12)
    stop = ref[2]
    assert stop not in ref[:2]
    params = SamplingParams(max_new_tokens=12, stop_token_ids=(stop,), ignore_eos=True, logprobs=0)
    chunks = run_chunks(engine, PROMPT, params)
    tokens = [t for c in chunks for t in c.token_ids]
    assert tokens == ref[:3]
    assert [len(c.token_ids) for c in chunks] == [1, 2]  # the round made 4, the stop kept 2
    assert all(
        len(c.logprobs) == len(c.token_ids) and not any(e.top for e in c.logprobs) for c in chunks
    )
    assert chunks[0].prompt_logprobs is None


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "eagle3"])
def test_sampled_logprobs_are_the_samplers_distribution(tiny_dir: Path, speculate: bool) -> None:
    """Seeded sampling with temperature and top-k: each token's logprob is the log of the
    tempered, top-k renormalised probability it was drawn from (speculation draws other tokens
    than plain decoding with the same seed, from the same distribution)."""
    params = SamplingParams(max_new_tokens=8, temperature=0.7, top_k=20, seed=11, ignore_eos=True,
                            logprobs=2)  # fmt: skip
    chunks = run_chunks(tiny_engine(tiny_dir, speculate), PROMPT, params)
    entries = [e for c in chunks for e in c.logprobs]
    rows = hf_log_softmax(tiny_dir / "target", PROMPT + [e.token_id for e in entries])
    for k, entry in enumerate(entries):
        x = rows[len(PROMPT) - 1 + k] / 0.7
        kth = x.topk(20).values[-1]
        expect = torch.log_softmax(x.masked_fill(x < kth, float("-inf")), -1)
        assert entry.logprob == pytest.approx(expect[entry.token_id].item(), abs=ATOL)
        assert [t for t, _ in entry.top] == expect.topk(2).indices.tolist()


def test_a_replay_does_not_ask_for_prompt_logprobs_again() -> None:
    """Prompt logprobs come with the first emitted tokens: a replay after any token was emitted
    (failover, speculation resumed) prefills without them; one before still asks."""
    from specmesh.router.prefill_plan import prefill_params
    from specmesh.router.request import Request

    req = Request("r", PROMPT, SamplingParams(prompt_logprobs=2, seed=1))
    assert prefill_params(req).prompt_logprobs == 2
    req.emit([3])
    assert prefill_params(req).prompt_logprobs is None
    assert prefill_params(req).seed == 1
