"""Draft-decode buffer sizes (`runtime/static_shapes.py`, DESIGN.md §4 invariant 5; SGLang PR
#27460, where a kv-indices buffer sized without topk overflowed once topk > 1)."""

from __future__ import annotations

import pytest

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.steps import ExtendInput
from specmesh.runtime.static_shapes import DraftSizes
from specmesh.runtime.tiny import make_tiny_target

MAX_BS, STEPS, CONTEXT = 4, 3, 100


@pytest.mark.parametrize("topk", [1, 2, 4, 8])
def test_capacities_scale_with_topk(topk):
    s = DraftSizes(MAX_BS, topk, STEPS, CONTEXT)
    spec_tokens = 1 + topk * (STEPS - 1)  # root row + topk nodes per decode step
    assert s.spec_tokens_per_req == spec_tokens
    assert s.max_query_rows == MAX_BS * topk
    assert s.kv_indices_capacity == MAX_BS * (CONTEXT + spec_tokens)
    assert s.mask_capacity == MAX_BS * topk * (CONTEXT + spec_tokens)
    if topk > 1:  # a topk-agnostic size is too small
        flat = DraftSizes(MAX_BS, 1, STEPS, CONTEXT)
        assert s.kv_indices_capacity > flat.kv_indices_capacity
        assert s.mask_capacity > topk * flat.mask_capacity


def test_kv_entries_count_prefix_once_and_topk_nodes_per_step():
    assert DraftSizes.kv_entries(seq_lens_sum=50, bs=3, topk=4, step=2) == 50 + 3 * (1 + 4 * 2)


@pytest.mark.parametrize("topk", [1, 4])
def test_worst_case_fits_and_one_more_entry_does_not(topk):
    s = DraftSizes(MAX_BS, topk, STEPS, CONTEXT)
    s.check_kv_entries(MAX_BS * CONTEXT, MAX_BS, STEPS - 1)  # every request at max context
    with pytest.raises(ValueError) as err:
        s.check_kv_entries(MAX_BS * CONTEXT + 1, MAX_BS, STEPS - 1)
    used = MAX_BS * CONTEXT + 1 + MAX_BS * (1 + topk * (STEPS - 1))
    msg = str(err.value)
    for number in (used, used * topk, s.kv_indices_capacity, s.mask_capacity):
        assert str(number) in msg
    assert f"topk={topk}" in msg and f"seq_lens_sum={MAX_BS * CONTEXT + 1}" in msg


def test_batch_above_max_bs_is_refused():
    with pytest.raises(ValueError, match=rf"bs={MAX_BS + 1} \(max {MAX_BS}\)"):
        DraftSizes(MAX_BS, 2, STEPS, CONTEXT).check_kv_entries(10, MAX_BS + 1, 1)


@pytest.mark.parametrize("field", ["max_bs", "topk", "num_steps", "max_context_len"])
def test_sizes_must_be_positive(field):
    args = {"max_bs": 1, "topk": 1, "num_steps": 1, "max_context_len": 1, field: 0}
    with pytest.raises(ValueError, match=field):
        DraftSizes(**args)


def test_propose_checks_sizes_at_run_time(tmp_path):
    """The drafter's propose runs the check with the real numbers before its first decode step,
    for its deepest one (every step reads the search's whole speculative region)."""
    target = make_tiny_target(tmp_path / "t", num_hidden_layers=1)
    spec = SpecParams(3, 2, 5)
    cfg = DraftConfig("standalone", str(target), str(target), spec, max_requests=2)
    runtime = load_draft(cfg)
    drafter = runtime.drafter
    assert runtime.cfg.max_context == 1024  # the tiny target's max_position_embeddings
    assert drafter.sizes == DraftSizes(2, 2, 3, runtime.cfg.max_context)
    drafter.extend([ExtendInput("r", list(range(3, 40)), 7, new=True)])
    drafter.propose(["r"], [7])  # fits
    drafter.sizes = DraftSizes(1, 2, 3, 8)  # as if the buffers were sized for 8 tokens
    with pytest.raises(ValueError, match=r"step 2: .* seq_lens_sum=38 needs 43 kv entries"):
        drafter.propose(["r"], [7])
