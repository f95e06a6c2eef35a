"""The speculation policy as pure functions on injected costs and acceptance: it speculates where
that yields more tokens per second, decodes plainly where it does not, trades tree size against
verify cost, and explores deterministically."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from conftest import assert_accepted, make_small_vocab_pair

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.trees import DraftTree
from specmesh.router import policy as policy_module
from specmesh.router.engine import Engine
from specmesh.router.plan_reason import PlanReason
from specmesh.router.policy import (
    Acceptance,
    Cost,
    Plan,
    SpeculationPolicy,
    best_tree_size,
    bucket,
    interpolate_costs,
    tree_options,
)
from specmesh.router.router_config import RouterConfig

N = 8  # the draft's tree size


def _records(policy: SpeculationPolicy, accepted: int, batch: int = 1) -> list[Acceptance]:
    """Requests whose chain trees always had their first ``accepted`` draft nodes accepted, as
    the round reports them (the draft's record grows with them)."""
    chain = DraftTree.chain(list(range(N)))
    records = [Acceptance() for _ in range(batch)]
    for _ in range(30):
        for record in records:
            policy.observe_round("d", record, chain, [*range(1, accepted + 1), 999])
    return records


def _policy(verify: dict[int, float], draft: float, batch: int = 1) -> SpeculationPolicy:
    policy = SpeculationPolicy("adaptive", probe_every=1000)
    for k, seconds in verify.items():
        policy.observe_verify("t", batch, k, seconds)
    policy.observe_draft("d", batch, draft)
    return policy


def test_tree_is_cut_to_its_first_nodes_and_stays_valid() -> None:
    tree = DraftTree.of([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 3])
    cut = tree.cut(4)
    assert cut.tokens == (9, 1, 2, 3) and cut.parents == (-1, 0, 0, 1)
    assert tree.cut(1).num_nodes == 1 and tree.cut(99) is tree


def test_accepted_path_follows_the_output_tokens_down_the_tree() -> None:
    tree = DraftTree.of([9, 1, 2, 3, 4, 5], [-1, 0, 0, 1, 1, 3])
    assert tree.accepted_path([1, 4, 7]) == [1, 4]  # node 4 (token 4) under node 1, bonus 7
    assert tree.accepted_path([1, 3, 5, 8]) == [1, 3, 5]
    assert tree.accepted_path([2, 6]) == [2] and tree.accepted_path([7]) == []


def test_acceptance_counts_what_each_cut_would_have_yielded() -> None:
    record = Acceptance(decay=1.0)
    record.observe([1, 3, 5], 6)  # path nodes 1, 3, 5 of a 6-node tree: 4 tokens in all
    assert [record.expected(k, 0.0, 0.0) for k in range(1, 7)] == [1, 2, 2, 3, 3, 4]
    assert record.expected(7, 5.0, 1.0) == 5.0  # never verified that big: the prior alone


def test_verify_costs_between_measured_sizes_are_interpolated() -> None:
    assert interpolate_costs({1: 1.0, 5: 3.0}, 6) == [1.0, 1.5, 2.0, 2.5, 3.0, None]
    assert interpolate_costs({}, 2) == [None, None]


def test_unmeasured_options_are_tried_full_tree_first_then_plain() -> None:
    gains = [1.0, 1.5, 2.0, 2.5]
    assert best_tree_size(gains, [None] * 4, None) == 4
    assert best_tree_size(gains, [None, None, None, 1.0], 0.5) == 1
    assert best_tree_size(gains, [1.0, 1.2, 1.4, 10.0], 0.1) == 3  # the sizes between, measured


def test_speculates_at_small_batch_with_high_acceptance() -> None:
    policy = _policy({1: 0.010, N: 0.012}, draft=0.008)
    plan = policy.plan("t", "d", 1, _records(policy, accepted=5), N)
    assert plan.speculate and plan.tree_size == 6  # root + the 5 nodes that get accepted


def test_plain_when_acceptance_is_low() -> None:
    policy = _policy({1: 0.010, N: 0.012}, draft=0.008)
    assert not policy.plan("t", "d", 1, _records(policy, accepted=0), N).speculate


def test_plain_at_big_batch_when_verify_is_expensive() -> None:
    """The same acceptance: worth it at batch 1, not where a tree costs 8x a decode."""
    batch = 32
    policy = _policy({1: 0.050, N: 0.400}, draft=0.060, batch=batch)
    records = _records(policy, accepted=3, batch=batch)
    assert policy.plan("t", "d", batch, records, N).tree_size == 1
    small = _policy({1: 0.010, N: 0.012}, draft=0.008)
    assert small.plan("t", "d", 1, _records(small, accepted=3), N).speculate


def test_tree_size_trades_acceptance_for_verify_cost() -> None:
    """Acceptance stops at depth 2: nodes past 3 cost verify time and yield nothing."""
    batch = 16
    policy = _policy({1: 0.020, N: 0.090}, draft=0.005, batch=batch)
    records = _records(policy, accepted=2, batch=batch)
    assert policy.plan("t", "d", batch, records, N).tree_size == 3


def test_new_requests_lean_on_their_drafts_record() -> None:
    policy = _policy({1: 0.010, N: 0.012}, draft=0.008)
    for _ in range(50):
        policy.observe_round("d", Acceptance(), DraftTree.chain(list(range(N))), [0, 9])
    assert not policy.plan("t", "d", 1, [Acceptance()], N).speculate  # the draft never hits


def test_a_request_that_went_plain_speculates_again_as_its_record_ages() -> None:
    """A bad patch sends a request to plain decoding; plain rounds tell nothing of acceptance,
    so its record fades toward its draft's (which accepts 5 of 8 for everyone else) until the
    plan speculates again, instead of staying plain to the end."""
    policy = _policy({1: 0.010, N: 0.012}, draft=0.008)
    unlucky, others = Acceptance(), [Acceptance() for _ in range(4)]
    chain, root = DraftTree.chain(list(range(N))), DraftTree.chain([0])
    for _ in range(30):
        policy.observe_round("d", unlucky, chain, [999])
        for record in others:
            policy.observe_round("d", record, chain, [1, 2, 3, 4, 5, 999])
    assert not policy.plan("t", "d", 1, [unlucky], N).speculate
    assert policy.plan("t", "d", 1, [Acceptance()], N).speculate  # the draft's record is good
    plans = []
    for _ in range(40):
        policy.observe_round("d", unlucky, root, [7])  # a plain round
        plans.append(policy.plan("t", "d", 1, [unlucky], N).speculate)
    first = plans.index(True)
    assert 1 <= first < 30 and all(plans[first:])  # after some plain rounds, then for good


def test_probes_the_other_side_periodically_and_deterministically() -> None:
    def plans() -> list[int]:
        policy = SpeculationPolicy("adaptive", probe_every=4)
        for k, seconds in {1: 0.010, N: 0.012}.items():
            policy.observe_verify("t", 1, k, seconds)
        policy.observe_draft("d", 1, 0.008)
        records = _records(policy, accepted=5)
        return [policy.plan("t", "d", 1, records, N).tree_size for _ in range(17)]

    assert plans() == [6] * 3 + [1] * 3 + [6] * 7 + [1] * 3 + [6] == plans()  # then every 16, ...


def test_a_cost_is_the_median_of_its_latest_measurements() -> None:
    cost = Cost()
    cost.add(0.117)  # a cold first call
    assert cost.seconds == 0.117
    cost.add(0.009)  # of two, the lower: a probe's fresh measurement counts at once
    assert cost.seconds == 0.009
    cost.add(0.010)
    assert cost.seconds == 0.010
    cost.add(0.030)  # one call that shared its core moves nothing
    assert cost.seconds == 0.010
    for seconds in (0.020, 0.021):  # a lasting change wins in two calls
        cost.add(seconds)
    assert cost.seconds == 0.021


def _slow_draft_policy(draft: list[float]) -> tuple[SpeculationPolicy, list[Acceptance]]:
    """Speculation pays at the draft's real cost (9 ms), but its window holds slow steps."""
    policy = SpeculationPolicy("adaptive", probe_every=4)
    policy.observe_verify("t", 1, 1, 0.009)
    policy.observe_verify("t", 1, N, 0.014)
    for seconds in draft:
        policy.observe_draft("d", 1, seconds)
    return policy, _records(policy, accepted=3)


@pytest.mark.parametrize("slow", [[0.117], [0.080, 0.062, 0.056]], ids=["cold", "burst"])
def test_a_probe_measures_a_slow_draft_again(slow: list[float]) -> None:
    """A cold first draft step, or a burst of slow ones (another process on the core), makes
    plain decoding look better. The probe of speculation runs three rounds: the first draft
    step extends over the rounds held back (the replica does not count it), the next two are
    measured, and they outvote what the window held."""
    policy, records = _slow_draft_policy(slow)
    sizes = [policy.plan("t", "d", 1, records, N).tree_size for _ in range(6)]
    assert sizes == [1, 1, 1, N, N, N]  # plain, then the probe
    for _ in range(2):
        policy.observe_draft("d", 1, 0.009)  # its two steady draft steps
    sizes = [policy.plan("t", "d", 1, records, N).tree_size for _ in range(12)]
    assert sizes == [4] * 7 + [1] * 3 + [4] * 2  # root + the 3 accepted; a probe of plain


def test_one_measurement_of_a_probe_would_not_outvote_a_burst() -> None:
    policy, records = _slow_draft_policy([0.080, 0.062, 0.056])
    policy.observe_draft("d", 1, 0.009)
    assert not policy.plan("t", "d", 1, records, N).speculate


def test_a_probe_of_speculation_ends_where_plain_pays() -> None:
    policy, records = _slow_draft_policy([0.117])
    sizes = [policy.plan("t", "d", 1, records, N).tree_size for _ in range(20)]
    assert sizes == [1] * 3 + [N] * 3 + [1] * 7 + [N] * 3 + [1] * 4  # probes after 4, then 8


def test_a_plan_says_what_it_compared_and_a_change_of_side_is_logged(caplog) -> None:
    """A draft with one token accepted per round: 2 tokens in draft 10 + verify 14.3 ms (a
    2-node tree, verify interpolated between 10 and 40 ms) lose to a plain 10 ms step. The
    tally counts the plans and keeps why the latest plain one was plain; the log says it once."""
    policy = _policy({1: 0.010, N: 0.040}, draft=0.010)
    records = _records(policy, accepted=1)
    with caplog.at_level(logging.INFO, logger=policy_module.__name__):
        assert [policy.plan("t", "d", 1, records, N) for _ in range(3)] == [Plan(1)] * 3
    tally = policy.tallies[("t", 1)]
    assert (tally.num_plain, tally.num_speculative) == (3, 0) and tally.speculating is False
    reason = tally.last_plain
    assert reason is not None and not reason.probe and reason.speculative.tree_size == 2
    assert reason.plain.tokens_per_s == pytest.approx(100.0)
    assert reason.speculative.tokens_per_s == pytest.approx(2 / (0.010 + 0.010 + 0.030 / 7))
    assert reason.describe() == (
        "a plain step: 1.00 tokens in 10.0 ms = 100 tokens/s, "
        "against 2-node trees: 2.00 tokens in draft 10.0 + verify 14.3 ms = 82 tokens/s"
    )
    assert [r.getMessage() for r in caplog.records] == [
        f"speculation, target t, batch <= 1: {reason.describe()}"
    ]


def test_a_probe_is_told_apart_and_unmeasured_options_say_so() -> None:
    policy = SpeculationPolicy("adaptive", probe_every=1)
    policy.observe_verify("t", 1, 1, 0.010)  # the full tree never measured: tried first
    assert policy.plan("t", "d", 1, [Acceptance()], N) == Plan(N)
    tally = policy.tallies[("t", 1)]
    assert (tally.num_plain, tally.num_speculative, tally.last_plain) == (0, 1, None)
    reason = PlanReason(1, *tree_options([1.0, 3.0], [0.01, None], None), probe=True)
    assert reason.describe() == (
        "probe of a plain step: 1.00 tokens in 10.0 ms = 100 tokens/s "
        "(the estimates chose 2-node trees (not measured yet))"
    )


def test_modes_always_and_never_ignore_the_measurements() -> None:
    always, never = SpeculationPolicy("always"), SpeculationPolicy("never")
    assert always.plan("t", "d", 64, _records(always, accepted=0), N).tree_size == N
    assert never.plan("t", "d", 1, _records(never, accepted=7), N).tree_size == 1
    with pytest.raises(ValueError, match="adaptive, always, never"):
        SpeculationPolicy("sometimes")


def test_a_call_queued_behind_another_is_charged_only_its_own_time() -> None:
    """Two micro-batches share one target: the second verify, sent while the first ran, began
    when the first ended; replicas are tracked apart."""
    p = SpeculationPolicy()
    assert p.service_time("t0", started=0.0, ended=1.0) == 1.0
    assert p.service_time("t0", started=0.5, ended=1.25) == 0.25  # waited 0.5 s behind it
    assert p.service_time("t0", started=2.0, ended=2.5) == 0.5  # idle in between: all its own
    assert p.service_time("t1", started=2.0, ended=3.0) == 1.0


def test_batch_sizes_share_costs_by_power_of_two() -> None:
    assert [bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 32, 33)] == [1, 2, 4, 4, 8, 8, 16, 32, 64]


# -- through the in-process engine --------------------------------------------------------------
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [90]]
MAX_NEW = [14, 6, 11, 20]


class ScriptedPolicy(SpeculationPolicy):
    """Plans from a fixed cycle of tree sizes (1: plain, with held-back draft extends; cut
    trees; full trees), whatever was measured: every path of the round runs."""

    SIZES = (8, 1, 1, 3, 1, 5, 8, 2)

    def __init__(self, mode: str) -> None:
        super().__init__(mode)
        self.count = 0

    def plan(self, target, draft, batch_size, requests, max_nodes):
        self.count += 1
        return Plan(min(self.SIZES[self.count % len(self.SIZES)], max_nodes))


def _engine(target: Path, draft: Path, mode: str, batch: int) -> Engine:
    return Engine(
        target, draft_model=draft, draft_kind="eagle3", spec=SpecParams(3, 4, 8),
        router_config=RouterConfig(max_batch_size=batch, speculation=mode),
    )  # fmt: skip


@pytest.mark.parametrize("scripted", [False, True], ids=["measured", "scripted"])
def test_adaptive_engine_equals_transformers_greedy(copy_dir: Path, oracle, scripted: bool) -> None:
    """Output equals transformers; the draft sees every committed token once, in order, with
    its feature row, whether its extends were sent each round or held back over plain ones.
    The draft predicts its target (`copy_drafts`), so rounds accept draft tokens."""
    engine = _engine(copy_dir / "target", copy_dir / "eagle3", "adaptive", batch=2)
    if scripted:
        engine.policy = ScriptedPolicy("adaptive")
    seen: dict[str, list[int]] = {}
    step = engine.draft.step

    def record(extends, propose=True):
        for e in extends:
            assert e.features.shape[0] == len(e.committed_ids)
            seen[e.rid] = [*([] if e.new else seen[e.rid]), *e.committed_ids]
        return step(extends, propose)

    engine.draft.step = record
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    results = engine.generate(PROMPTS, params)
    for prompt, n, res in zip(PROMPTS, MAX_NEW, results, strict=True):
        assert res.token_ids == oracle(copy_dir / "target", prompt, n)
        # the rounds' tokens: n - 1 after the prefill's, more when a stop cut the last run
        assert len(res.accept_lens) >= 1 and sum(res.accept_lens) >= n - 1
        context = prompt + res.token_ids
        assert seen[res.request_id] == context[: len(seen[res.request_id])]
    assert_accepted(results, min_tokens=len(PROMPTS))


def test_plain_rounds_age_the_requests_records(tiny_dir: Path, oracle, monkeypatch) -> None:
    """Through the engine, every plain round a drafting request takes fades its record (and
    only those rounds do): a request that went plain can come back to speculation."""
    engine = _engine(tiny_dir / "target", tiny_dir / "draft", "adaptive", batch=2)
    engine.policy = ScriptedPolicy("adaptive")
    sizes, fades = [], []
    observe = engine.policy.observe_round
    engine.policy.observe_round = lambda d, r, tree, t: (
        sizes.append(tree.num_nodes) or observe(d, r, tree, t)
    )
    monkeypatch.setattr(Acceptance, "fade", lambda self: fades.append(self))
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    for prompt, n, res in zip(PROMPTS, MAX_NEW, engine.generate(PROMPTS, params), strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, n)
    assert sizes.count(1) > 0 and len(fades) == sizes.count(1)


def test_the_engine_measures_the_draft_again_after_a_slow_first_step(tiny_dir: Path) -> None:
    """Through the engine's real rounds: a draft step estimate far above the real one (a
    cold first step) sends the request to plain decoding; a probe measures the draft again.
    With one-round probes it never was: their draft steps extend over the rounds held back,
    which the replica does not count."""
    engine = _engine(tiny_dir / "target", tiny_dir / "draft", "adaptive", batch=1)
    engine.policy.observe_verify("target-0", 1, 1, 0.001)
    engine.policy.observe_verify("target-0", 1, N, 0.001)
    engine.policy.observe_draft("draft-0", 1, 10.0)
    res = engine.generate([PROMPTS[0]], SamplingParams(max_new_tokens=24, ignore_eos=True))[0]
    assert engine.policy.draft_costs["draft-0", 1].seconds < 1.0
    assert res.accept_lens[:3] == [1, 1, 1]  # plain, as the estimates said


def test_never_runs_no_draft_step(tiny_dir: Path, oracle) -> None:
    engine = _engine(tiny_dir / "target", tiny_dir / "draft", "never", batch=4)
    calls = []
    step = engine.draft.step
    engine.draft.step = lambda *a: calls.append(a) or step(*a)
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    for prompt, n, res in zip(PROMPTS, MAX_NEW, engine.generate(PROMPTS, params), strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, n)
        assert res.accept_lens == [1] * (n - 1)
    assert calls == []


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_small_vocab_pair(tmp_path_factory.mktemp("vocab8"), 8, num_layers=6, seed=3)


@pytest.mark.slow
def test_cut_trees_and_plain_rounds_sample_the_targets_distribution(small_vocab: Path) -> None:
    """Tokens 2 and 3 under scripted plans (cut trees, plain rounds, full trees, per micro-batch)
    are distributed as direct sampling from the target: chi-square at significance 0.001."""
    from unit.test_engine import sample_and_check

    target, n, temp, prompt = small_vocab / "target", 2000, 0.8, [1, 2, 3]
    engine = _engine(target, small_vocab / "draft", "adaptive", batch=64)
    engine.policy = ScriptedPolicy("adaptive")
    accepted = sample_and_check(engine, target, prompt, temp, n)
    assert accepted > n // 10, f"only {accepted} of {n} first rounds accepted a draft token"
