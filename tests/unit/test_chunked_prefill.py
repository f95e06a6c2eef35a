"""Chunked prefill: a long prompt reaches the target in pieces, one per round, and the running
requests get a verify round between two pieces; output, logprobs and lifecycle are exactly as
with one-shot prefill."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from pathlib import Path

import pytest
import torch
from conftest import assert_accepted, assert_speculated, reorder_tolerance
from oracle_draft import oracle_engine

from specmesh.protocol.config import SpecParams, TargetConfig
from specmesh.protocol.errors import (
    InvalidRequestError,
    ServiceDownError,
    UnknownRequestError,
)
from specmesh.protocol.features import Feature
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.router.core import RouterCore
from specmesh.router.engine import Engine
from specmesh.router.in_process import InProcessDraft, InProcessTarget
from specmesh.router.prefill_plan import plan_pieces
from specmesh.router.request import Request
from specmesh.router.router_config import RouterConfig
from specmesh.router.slot import Slot
from specmesh.target_service.runtime import TargetRuntime

LONG = list(range(10, 50))  # 40 tokens: 6 pieces of at most 7
PROMPTS = [LONG, [11, 12, 13], list(range(100, 120)), [7] * 9, [90]]


def engine(models: Path, budget: int, *, draft: str | None = "draft", **cfg) -> Engine:
    """``models/target`` with the EAGLE-3 draft ``models/<draft>`` (None: no speculation)."""
    spec = {"draft_model": models / str(draft), "draft_kind": "eagle3", "spec": SpecParams(3, 4, 8)}
    return Engine(
        models / "target",
        **(spec if draft else {}),
        router_config=RouterConfig(prefill_chunk_tokens=budget, **cfg),
    )


def holds_nothing(e: Engine) -> bool:
    draft_used = e.draft.kv_slots()[0] if e.draft else 0
    live = e.draft.live if e.draft else {}
    return e.target.num_requests == 0 and e.target.kv_slots()[0] == 0 and not (live or draft_used)


@pytest.mark.parametrize("draft", [None, "eagle3", "oracle"])
def test_greedy_output_equals_transformers(
    tiny_dir: Path, copy_dir: Path, oracle, draft: str | None
) -> None:
    """Budget 7: long prompts go in pieces, short ones share a round's budget with them. The
    oracle draft proposes from the ids its extends delivered: pieces lost, repeated or paired
    with the wrong rows would show as rounds it no longer gets accepted. The EAGLE-3 draft
    predicts its target (`copy_drafts`): its extends over the pieces feed accepted rounds."""
    cfg = RouterConfig(prefill_chunk_tokens=7, max_batch_size=3, num_micro_batches=2)
    models = copy_dir if draft == "eagle3" else tiny_dir
    if draft == "oracle":
        e = oracle_engine(tiny_dir / "target", router_config=cfg)
    else:
        e = engine(models, 7, draft=draft, max_batch_size=3, num_micro_batches=2)
    results = e.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == oracle(models / "target", prompt, 12)
    if draft is not None:
        assert_speculated(results, min_mean_accept=2.2 if draft == "oracle" else 1.3)
    assert holds_nothing(e)


def test_logprobs_penalties_and_seeded_sampling_equal_one_shot(copy_dir: Path) -> None:
    """Prompt logprobs gathered over the pieces, history-reading processors and the sample
    offset come out as with one-shot prefill, with draft tokens accepted (`copy_drafts`)."""
    params = [
        SamplingParams(max_new_tokens=8, ignore_eos=True, logprobs=2, prompt_logprobs=3,
                       repetition_penalty=1.3),
        SamplingParams(max_new_tokens=8, ignore_eos=True, temperature=0.8, seed=11),
    ]  # fmt: skip
    prompts = [LONG, list(range(60, 93))]
    chunked, whole = (engine(copy_dir, b, draft="eagle3").generate(prompts, params) for b in (5, 0))
    assert_accepted(chunked)
    assert_accepted(whole)
    tol = reorder_tolerance(torch.float32)
    for c, w in zip(chunked, whole, strict=True):
        assert c.token_ids == w.token_ids
    c, w = chunked[0], whole[0]
    assert c.prompt_logprobs[0] is None and len(c.prompt_logprobs) == len(LONG)
    for a, b in zip([*c.prompt_logprobs[1:], *c.logprobs], [*w.prompt_logprobs[1:], *w.logprobs],
                    strict=True):  # fmt: skip
        assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
        assert a.logprob == pytest.approx(b.logprob, abs=tol["atol"])


def test_target_pieces_equal_one_shot_prefill(tiny_dir: Path) -> None:
    """In the target: features of every row, first token, prompt logprobs (cut before the
    replayed output) and the following decode steps."""
    rt = TargetRuntime(TargetConfig(str(tiny_dir / "target")))
    ids = list(range(20, 40))
    params = SamplingParams(max_new_tokens=8, prompt_logprobs=2, repetition_penalty=1.2)
    one = rt.prefill([PrefillInput("one", ids, params, sample_offset=3)], Feature.HIDDEN)
    feats, prompt_lp = [], []
    for start, stop in ((0, 7), (7, 14), (14, 20)):
        piece = PrefillInput("pc", ids[start:stop], params if not start else SamplingParams(),
                             3, input_start=start, more_input=stop < 20)  # fmt: skip
        out = rt.prefill([piece], Feature.HIDDEN)
        assert out.row_counts["pc"] == stop - start and rt.holds("pc")
        feats.append(out.features)
        prompt_lp += out.prompt_logprobs.get("pc", [])
        assert (out.tokens["pc"] == []) == (stop < 20)
    tol = reorder_tolerance(torch.float32)
    torch.testing.assert_close(torch.cat(feats), one.features, **tol)
    assert out.tokens["pc"] == one.tokens["one"]
    assert len(prompt_lp) == len(ids) - 3 - 1  # the prompt only, as one-shot
    for a, b in zip(prompt_lp, one.prompt_logprobs["one"], strict=True):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=tol["atol"])
    for _ in range(4):
        steps = rt.decode(["one", "pc"])
        assert steps.tokens["one"] == steps.tokens["pc"]
    assert rt.release("one") and rt.release("pc") and rt.num_requests == 0


def test_target_refuses_bad_pieces_and_drops_their_request(tiny_dir: Path) -> None:
    rt = TargetRuntime(TargetConfig(str(tiny_dir / "target")))
    start = lambda rid: rt.prefill(
        [PrefillInput(rid, [5, 6, 7], SamplingParams(), more_input=True)]
    )
    cont = lambda rid, at: rt.prefill([PrefillInput(rid, [8], SamplingParams(), input_start=at)])
    start("a")
    assert isinstance(cont("a", 2).errors["a"], InvalidRequestError)  # the target holds 3
    assert not rt.holds("a") and rt.kv_slots()[0] == 0
    assert isinstance(cont("never", 3).errors["never"], UnknownRequestError)
    start("b")
    out = rt.verify([VerifyInput("b", DraftTree.chain([1]))])
    assert "still being prefilled" in str(out.errors["b"]) and not rt.holds("b")
    img = rt.prefill([PrefillInput("c", [5], SamplingParams(), images=[b"x"], more_input=True)])
    assert "one piece" in str(img.errors["c"]) and rt.num_requests == 0


def test_plan_shares_the_budget_in_admission_order() -> None:
    slots = [Slot(Request("a", list(range(30)), SamplingParams())),
             Slot(Request("b", [1, 2], SamplingParams())),
             Slot(Request("c", [3] * 5, SamplingParams(), images=[b"png"]))]  # fmt: skip
    assert plan_pieces(slots, 0) == {"a": 30, "b": 2, "c": 5}
    assert plan_pieces(slots, 8) == {"a": 8}
    slots[0].prefill_sent = 27
    assert plan_pieces(slots, 8) == {"a": 3, "b": 2, "c": 5}  # images: one piece, whole
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        RouterConfig(prefill_chunk_tokens=-1)


class Recording(InProcessTarget):
    """Records the order of its calls. ``faults["armed"]`` (shared by the replicas): the first
    later piece any of them gets drops the connection; ``after_piece``: an async hook run once
    the piece at ``after_piece_at`` returned."""

    def __init__(self, runtime: TargetRuntime, name: str, faults: dict) -> None:
        super().__init__(runtime, name)
        self.calls: list[tuple[str, list]] = []
        self.faults = faults
        self.after_piece, self.after_piece_at = None, 14

    async def prefill(self, inputs):
        self.calls.append(("prefill", [(i.rid, i.input_start, len(i.input_ids)) for i in inputs]))
        if self.faults.get("armed") and any(i.input_start for i in inputs):
            self.faults["armed"] = False
            raise ServiceDownError(f"{self.name}: connection reset")
        out = await super().prefill(inputs)
        if self.after_piece and any(i.input_start == self.after_piece_at for i in inputs):
            await self.after_piece()
        return out

    async def verify(self, inputs, rows=True):
        self.calls.append(("verify", [i.rid for i in inputs]))
        return await super().verify(inputs, rows)


async def _started(
    e: Engine, cfg: RouterConfig, num_targets: int = 1, faults: dict | None = None
) -> RouterCore:
    runtimes = [e.target] + [TargetRuntime(e.target.cfg) for _ in range(num_targets - 1)]
    targets = [Recording(rt, f"target-{i}", faults or {}) for i, rt in enumerate(runtimes)]
    core = RouterCore(targets, [InProcessDraft(e.draft)], cfg)
    await core.start()
    return core


async def _tokens(core: RouterCore, req: Request) -> list[int]:
    return [t async for c in core.generate(req) for t in c.token_ids]


def test_running_requests_get_a_round_between_pieces(tiny_dir: Path, oracle) -> None:
    """Structural: the target's call order shows a verify of the running request between any
    two pieces of the long prompt that arrived while it ran."""
    e = engine(tiny_dir, 7)
    greedy = lambda n: SamplingParams(max_new_tokens=n, ignore_eos=True)

    async def scenario():
        core = await _started(e, RouterConfig(num_micro_batches=1, prefill_chunk_tokens=7))
        running, long = e.make_request([5, 6, 7], greedy(60)), e.make_request(LONG, greedy(6))
        stream = core.generate(running)
        first = (await anext(stream)).token_ids  # running has streamed: now the long one comes
        late = asyncio.create_task(_tokens(core, long))
        rest = [t async for c in stream for t in c.token_ids]
        out = await late
        await core.stop()
        return core.targets[0].calls, first + rest, out, long.rid, running.rid

    calls, out_running, out_long, rid, running_rid = asyncio.run(scenario())
    assert out_running == oracle(tiny_dir / "target", [5, 6, 7], 60)
    assert out_long == oracle(tiny_dir / "target", LONG, 6)
    at = [k for k, (kind, items) in enumerate(calls) if kind == "prefill" and items[0][0] == rid]
    pieces = [calls[k][1][0] for k in at]
    assert [(s, n) for _, s, n in pieces] == [(s, min(7, 40 - s)) for s in range(0, 40, 7)]
    for a, b in itertools.pairwise(at):
        assert ("verify", [running_rid]) in calls[a + 1 : b]


def test_cancel_mid_prefill_leaves_nothing(tiny_dir: Path, oracle) -> None:
    """A client that goes away after the third piece (the draft holds the first two): both
    services end up holding nothing."""
    e = engine(tiny_dir, 7)

    async def scenario() -> list[int]:
        core = await _started(e, RouterConfig(prefill_chunk_tokens=7))
        req = e.make_request(LONG, SamplingParams(max_new_tokens=6, ignore_eos=True))
        client = asyncio.create_task(_tokens(core, req))
        started = asyncio.Event()

        async def cancel_client() -> None:
            core.targets[0].after_piece = None
            client.cancel()  # the client disconnects: its request is aborted, mid-prefill
            with contextlib.suppress(asyncio.CancelledError):
                await client
            started.set()

        core.targets[0].after_piece = cancel_client
        await started.wait()
        assert req.finish_reason == "abort" and not req.output_ids
        after = await _tokens(core, e.make_request([8, 9], SamplingParams(max_new_tokens=4)))
        await core.stop()
        return after

    assert asyncio.run(scenario()) == oracle(tiny_dir / "target", [8, 9], 4)
    assert holds_nothing(e)


def test_target_failover_mid_prefill_replays_the_prompt(tiny_dir: Path, oracle) -> None:
    e = engine(tiny_dir, 7)

    async def scenario():
        cfg = RouterConfig(prefill_chunk_tokens=7)
        core = await _started(e, cfg, num_targets=2, faults={"armed": True})  # its 2nd piece
        req = e.make_request(LONG, SamplingParams(max_new_tokens=10, ignore_eos=True))
        out = await _tokens(core, req)
        await core.stop()
        return out, req.replays, [t.runtime for t in core.targets]

    out, replays, runtimes = asyncio.run(scenario())
    assert out == oracle(tiny_dir / "target", LONG, 10) and replays == 1
    assert all(rt.num_requests == 0 and rt.kv_slots()[0] == 0 for rt in runtimes)
    assert not e.draft.live
