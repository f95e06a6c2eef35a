"""The static-shape (CUDA-graph) path run eagerly on CPU (``mode="eager-static"``): padded static
buffers give the plain `run_batch` output for decode, tree verify and draft decode steps with
topk > 1 at batch sizes that are not bucket sizes (invariant 2), padding never touches real KV,
sizes come from one function with a run-time check (invariant 5), graphs are never used on CPU."""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import pytest
import torch
from conftest import assert_accepted, reorder_tolerance

from specmesh.draft_service.runtime import load_draft
from specmesh.kernels.testing import cpu_triton
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.features import Feature, FeatureSpec
from specmesh.runtime.attention.torch_backend import make_backend
from specmesh.runtime.graph_runner import (
    GraphRunner,
    capture_batch_sizes,
    graphs_enabled,
)
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, run_batch
from specmesh.runtime.models.causal_lm import AuxLayers, ModelOutput, load_causal_lm
from specmesh.runtime.static_shapes import GraphSizes, decode_sizes, verify_sizes
from specmesh.target_service.verify import Tree

PROMPT_LENS = [5, 3, 7]  # 3 requests: padded to the bucket of 4


@pytest.fixture(scope="module")
def target(tiny_dir: Path):
    model = load_causal_lm(tiny_dir / "target", dtype=torch.float32)
    model.set_aux_layers(AuxLayers.default(model.config.num_layers))  # every output field set
    return model


def _prefilled(model) -> KVCache:
    c = model.config
    cache = KVCache(
        num_layers=c.num_layers, num_slots=256, num_kv_heads=c.num_kv_heads, head_dim=c.head_dim,
        dtype=c.dtype, max_requests=8, max_context=32,
    )  # fmt: skip
    backend = make_backend("torch")
    for i, n in enumerate(PROMPT_LENS):
        cache.add(f"r{i}")
        run_batch(model, cache, backend, [BatchItem(f"r{i}", torch.arange(3, 3 + n), 0)])
        cache.commit(f"r{i}", n)
    return cache


def _tree() -> Tree:
    return Tree.from_parents(torch.tensor([7, 8, 9, 10]), torch.tensor([-1, 0, 0, 1]))


def _verify_items(cache: KVCache) -> list[BatchItem]:
    items = []
    for i, n in enumerate(PROMPT_LENS):
        t = _tree()
        mask = torch.cat([torch.ones(t.num_nodes, n, dtype=torch.bool), t.mask], dim=1)
        items.append(BatchItem(f"r{i}", t.tokens + i, n, n + t.depths, mask))
    return items


def _decode_items() -> list[BatchItem]:
    return [BatchItem(f"r{i}", torch.tensor([20 + i]), n) for i, n in enumerate(PROMPT_LENS)]


def _assert_same(got, want) -> None:
    for f in dataclasses.fields(ModelOutput):
        a, b = getattr(got, f.name), getattr(want, f.name)
        if b is None:
            assert a is None, f.name
            continue
        assert a.shape == b.shape, f"{f.name}: {tuple(a.shape)} rows, expected {tuple(b.shape)}"
        torch.testing.assert_close(a, b, **reorder_tolerance(a.dtype), msg=f"{f.name} differs")


@pytest.mark.parametrize("mode", ["decode", "verify"])
@pytest.mark.parametrize("backend", ["torch", cpu_triton()])
def test_static_path_equals_run_batch(target, mode: str, backend: str) -> None:
    cache = _prefilled(target)
    items = _decode_items() if mode == "decode" else _verify_items(cache)
    want = run_batch(target, cache, make_backend(backend), items)  # same kernel, no padding
    sizes = decode_sizes(8, 32) if mode == "decode" else verify_sizes(8, 4, 32)
    runner = GraphRunner(target, cache, make_backend(backend), sizes, mode="eager-static")
    assert runner.uses_graph_hooks == (backend == "triton")
    runner.capture()  # dry run of the capture path: hooks + padding-only batches
    assert len(items) not in runner.batch_sizes
    _assert_same(runner.run(items), want)


def test_padding_never_touches_real_kv(target) -> None:
    cache = _prefilled(target)
    rows_before = len(cache.free_rows)
    runner = GraphRunner(target, cache, make_backend("torch"), verify_sizes(8, 4, 32))
    pad = runner.pad_slot
    assert len(cache.free_rows) == rows_before  # no request row taken for padding
    before = [p.k.clone() for p in cache.pools]
    runner.capture()  # every bucket full of padding requests
    items = _verify_items(cache)
    runner.run(items)
    written = torch.cat([cache.slots(it.rid, it.start, it.start + it.q_len) for it in items])
    untouched = torch.ones(cache.pools[0].k.shape[0], dtype=torch.bool)
    untouched[written] = False
    untouched[pad] = False
    for b, p in zip(before, cache.pools, strict=True):
        assert torch.equal(b[untouched], p.k[untouched])
        assert not torch.equal(b[pad], p.k[pad])  # padding rows wrote their own slot only
    # The padding slot is the cache's scratch slot: no request owns it, the allocator never
    # hands it out, and the cache reports only what its requests hold.
    assert pad == cache.scratch_slot and all(pad not in r.pages for r in cache.requests.values())
    held = sum(len(r.pages) for r in cache.requests.values()) * cache.page_size
    assert pad not in cache.free_pages and cache.num_used_slots == held


def test_can_run_and_bucket_sizes(target) -> None:
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_batch_sizes(3) == [1, 2, 3]
    cache = _prefilled(target)
    runner = GraphRunner(target, cache, make_backend("torch"), decode_sizes(2, 32))
    items = _decode_items()
    assert not runner.can_run(items)  # 3 requests > max_bs 2
    assert runner.can_run(items[:2])
    assert not runner.can_run(_verify_items(cache)[:2])  # 4 rows per request, and masks
    with pytest.raises(ValueError, match="decode graph cannot run this batch"):
        runner.run(items)


def test_sizes_are_checked_with_the_numbers() -> None:
    sizes = verify_sizes(4, 8, 100)
    assert (sizes.kv_indices_capacity, sizes.mask_capacity) == (400, 3200)
    with pytest.raises(ValueError, match=r"verify graph: bs=4 \(max 4\).*needs 401 kv entries"):
        sizes.check(4, 401, 8)
    with pytest.raises(ValueError, match="tokens_per_req must be >= 1"):
        GraphSizes("x", 1, 0, 1, False, 1, 0)


def test_cuda_graphs_are_never_used_on_cpu(target) -> None:
    assert not graphs_enabled(True, "cpu", "triton")
    assert not graphs_enabled(False, "cuda", "triton")
    assert not graphs_enabled(True, "cuda", "torch")
    assert graphs_enabled(True, "cuda:0", "flashinfer")
    cache = _prefilled(target)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        GraphRunner(target, cache, make_backend("triton"), decode_sizes(2, 32), mode="cuda-graph")


@pytest.mark.parametrize("topk", [1, 3])
def test_draft_step_through_static_buffers(tiny_dir: Path, topk: int) -> None:
    """EAGLE-3 draft decode steps (topk rows per request, tree mask): the step runner's outputs
    equal the eager step, and a whole proposal is unchanged."""
    from specmesh.protocol.steps import ExtendInput

    spec = SpecParams(num_steps=3, topk=topk, num_draft_tokens=4)
    cfg = DraftConfig("eagle3", str(tiny_dir / "draft"), str(tiny_dir / "target"), spec,
                      dtype="fp32", num_kv_slots=512, max_requests=8, max_context=64)  # fmt: skip
    drafter = load_draft(cfg).drafter
    feat_dim = 3 * drafter.net.config.base.hidden_size
    g = torch.Generator().manual_seed(0)
    rids = [f"d{i}" for i in range(3)]
    drafter.extend([
        ExtendInput(rid, list(range(4, 4 + n)), 30 + i, torch.randn(n, feat_dim, generator=g), new=True)
        for i, (rid, n) in enumerate(zip(rids, PROMPT_LENS, strict=True))
    ])  # fmt: skip
    roots = [30, 31, 32]
    want = drafter.propose(rids, roots)
    states = [drafter.roots[r] for r in rids]
    tokens = torch.arange(topk) + 40
    width = 2 * topk  # the search's speculative columns
    own = torch.eye(width, dtype=torch.bool)[:topk]  # step 1: each node sees itself
    items = [drafter.step_item(1, r, s, tokens, own) for r, s in zip(rids, states, strict=True)]
    hidden = torch.stack([s.hidden for s in states]).repeat_interleave(topk, 0)
    want_h, want_logits = drafter.step_forward(1, items, hidden)

    drafter.enable_step_graphs("eager-static", max_bs=8)
    batch = drafter.step_graphs.batch(drafter, rids, states, 3, hidden)
    assert batch is not None and batch.runners[1] is batch.runners[2]
    assert batch.runners[1].sizes.kv_indices_capacity == 8 * drafter.sizes.max_kv_per_req
    got_h, got_logits = batch.forward(1, tokens.expand(3, topk), hidden, own.expand(3, -1, -1))
    assert got_h.shape[0] == got_logits.shape[0] == 3 * topk  # unpadded
    torch.testing.assert_close(got_h, want_h, **reorder_tolerance(got_h.dtype))
    torch.testing.assert_close(got_logits, want_logits, **reorder_tolerance(got_logits.dtype))
    got = drafter.propose(rids, roots)
    for a, b in zip(got, want, strict=True):
        assert a == b  # tokens and parents


def test_engine_through_static_paths_equals_transformers(copy_dir: Path, oracle) -> None:
    """Target decode / verify, the draft's extend and its whole search routed through eager-static
    runners (the runtime
    wiring a GPU uses with mode="cuda-graph") still generate the transformers greedy tokens,
    with draft tokens accepted (the EAGLE-3 draft predicts its target: `copy_drafts`)."""
    from specmesh.protocol.sampling import SamplingParams
    from specmesh.router.engine import Engine
    from specmesh.target_service.runtime import TargetGraphs

    engine = Engine(copy_dir / "target", draft_model=copy_dir / "eagle3", draft_kind="eagle3",
                    spec=SpecParams(2, 2, 4))  # fmt: skip
    t = engine.target
    assert t.graphs is None and t.cfg.cuda_graph  # enabled, but never on CPU
    assert t.cfg.cuda_graph_tree_sizes == (4,)  # the engine's num_draft_tokens
    t.configure(engine.draft.info().needs)  # the handshake first: it names the aux layers
    t.graphs = TargetGraphs(t.model, t.cache, t.backend, mode="eager-static", max_bs=4,
                            tree_sizes=t.cfg.cuda_graph_tree_sizes, aux=t.aux_layers)  # fmt: skip
    drafter = engine.draft.drafter
    drafter.enable_step_graphs("eager-static", max_bs=4)
    runners = {"decode": t.graphs.decode, "verify": t.graphs.verify[4],
               "draft extend": drafter.extend_graph.runner, "draft search": drafter.search_graphs}  # fmt: skip
    used: set[str] = set()
    for name, runner in runners.items():  # every forward of a runner is a replay
        run = runner.replay
        runner.replay = lambda *a, _run=run, _name=name, **k: used.add(_name) or _run(*a, **k)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42]]
    params = SamplingParams(max_new_tokens=5, ignore_eos=True)
    for plain in (False, True):
        results = engine.generate(prompts, params, disable_speculation=plain)
        for prompt, res in zip(prompts, results, strict=True):
            assert res.token_ids == oracle(copy_dir / "target", prompt, 5)
        if not plain:
            assert_accepted(results, min_tokens=2)
    assert used == set(runners)  # every runner served batches
    # Graph padding owns no KV: with every request done, both caches hold nothing.
    assert t.cache.num_used_slots == 0 and drafter.cache.num_used_slots == 0


def test_target_graphs_are_captured_up_front_with_aux_states(tiny_dir: Path) -> None:
    """Decode and every declared tree size are captured when the graphs are built (before the
    service reports ready), with the aux layers on whatever feature is current; a tree size that
    was not declared runs eagerly instead of capturing on the request path."""
    from specmesh.target_service.runtime import TargetGraphs, TargetRuntime

    t = TargetRuntime.from_dir(tiny_dir / "target", dtype="fp32", max_context=32)
    seen: list[tuple] = []
    forward = t.model.forward
    t.model.forward = lambda *a, **k: seen.append(t.model.aux_points) or forward(*a, **k)
    aux = AuxLayers.default(t.model_config.num_layers)
    graphs = TargetGraphs(t.model, t.cache, t.backend, mode="eager-static", max_bs=2,
                          tree_sizes=(4, 6), aux=aux)  # fmt: skip
    assert sorted(graphs.verify) == [4, 6]
    assert len(seen) == 3 * 2 and all(points for points in seen)  # 3 runners x buckets {1, 2}
    assert t.model.aux_points == ()  # the feature in force before is back
    cache = _prefilled(t.model)
    items = _verify_items(cache)[:2]  # 4-node trees
    assert graphs.runner_for(items) is graphs.verify[4]
    five = [dataclasses.replace(it, input_ids=torch.arange(5)) for it in items]
    assert graphs.runner_for(five) is None
    with pytest.raises(ValueError, match=r"tree size 1 must be in 2\.\.max_context"):
        TargetGraphs(t.model, t.cache, t.backend, mode="eager-static", max_bs=2, tree_sizes=(1,))


@pytest.mark.parametrize("kind", ["eagle", "mtp", "standalone"])
def test_every_draft_kind_proposes_the_same_through_step_runners(tmp_path: Path, kind: str) -> None:
    """One runner per step network: EAGLE-1 and standalone share one across steps, MTP has one per
    layer (each over its own pool, invariant 4); the search through them in one graph
    (`SearchGraphs`) proposes the ragged path's trees (topk > 1), padded bucket or full."""
    from specmesh.protocol.steps import ExtendInput
    from specmesh.runtime.tiny import make_tiny_target
    from specmesh.runtime.tiny_drafts import make_tiny_draft

    target = make_tiny_target(tmp_path / "target", seed=0)
    draft = make_tiny_draft(tmp_path / kind, target, kind, seed=1)
    spec = SpecParams(num_steps=3, topk=2, num_draft_tokens=5)
    cfg = DraftConfig(kind, str(draft), str(target), spec, dtype="fp32", num_kv_slots=512,
                      max_requests=8, max_context=64)  # fmt: skip
    drafter = load_draft(cfg).drafter
    hidden = load_causal_lm(target).config.hidden_size
    g = torch.Generator().manual_seed(0)
    rids = [f"d{i}" for i in range(3)]
    drafter.extend([
        ExtendInput(rid, list(range(4, 4 + n)), 30 + i,
                    None if kind == "standalone" else torch.randn(n, hidden, generator=g), new=True)
        for i, (rid, n) in enumerate(zip(rids, PROMPT_LENS, strict=True))
    ])  # fmt: skip
    want = drafter.propose(rids, [30, 31, 32])
    drafter.enable_step_graphs("eager-static", max_bs=4)
    runners = drafter.step_graphs.runners
    assert len({id(r) for r in runners.values()}) == (2 if kind == "mtp" else 1)
    search, buckets = drafter.search_graphs, []
    replay = search.replay
    search.replay = lambda bucket: buckets.append(bucket) or replay(bucket)
    for n in (3, 1):  # bucket 4 with a padding request, then a full bucket
        got = drafter.propose(rids[:n], [30, 31, 32][:n])
        for a, b in zip(got, want[:n], strict=True):
            assert a == b  # tokens and parents
    assert buckets == [4, 1]  # the whole search, one graph each


def test_disable_cuda_graph_flags() -> None:
    import argparse

    from specmesh.cli import cmd_generate, cmd_serve

    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    cmd_serve.add_parser(sub)
    cmd_generate.add_parser(sub)
    for argv in (["target", "--model", "m"], ["draft", "--kind", "ngram", "--target-model", "m"]):
        assert cmd_serve._runtime_kwargs(p.parse_args(argv))["cuda_graph"] is True
        off = p.parse_args([*argv, "--disable-cuda-graph"])
        assert cmd_serve._runtime_kwargs(off)["cuda_graph"] is False
    assert p.parse_args(["generate", "--prompt", "x", "--disable-cuda-graph"]).disable_cuda_graph
    args = p.parse_args(["target", "--model", "m", "--cuda-graph-tree-sizes", "8,16",
                         "--cuda-graph-max-bs", "48"])  # fmt: skip
    assert args.cuda_graph_tree_sizes == (8, 16)
    assert cmd_serve._runtime_kwargs(args)["cuda_graph_max_bs"] == 48
    assert p.parse_args(["target", "--model", "m"]).cuda_graph_tree_sizes == (8,)
    with pytest.raises(SystemExit):
        p.parse_args(["target", "--model", "m", "--cuda-graph-tree-sizes", "eight"])


def test_new_aux_layers_capture_the_target_graphs_again(tiny_dir: Path, monkeypatch) -> None:
    """An in-process EAGLE-3 draft with its own aux layer ids: the eager path captures them at
    once and CUDA graphs (which bake the layers in) are captured again, only when they change.
    A draft that reads no aux states resolves no layers and captures nothing again."""
    from specmesh.target_service.prefix import feature_key
    from specmesh.target_service.runtime import TargetRuntime

    t = TargetRuntime.from_dir(tiny_dir / "target", dtype="fp32", max_context=32)
    captured: list[AuxLayers] = []
    monkeypatch.setattr(t, "_capture_graphs", lambda: captured.append(t.aux_layers) or "graphs")
    t.graphs = "graphs"  # as on a GPU
    t.configure(FeatureSpec(Feature.HIDDEN))
    assert captured == [] and t.aux_layers is None and t.aux_points == ()
    n = t.model_config.num_layers
    t.configure(FeatureSpec(Feature.AUX_HIDDEN))  # no ids: the default, resolved now
    assert captured == [AuxLayers.default(n)]
    default_key = t.feature_key(Feature.AUX_HIDDEN)  # kept per feature until the layers change
    same = AuxLayers((1, n // 2 - 1, n - 4), "output")  # the default's points, other numbering
    t.configure(FeatureSpec(Feature.AUX_HIDDEN, same))
    assert len(captured) == 1  # the same capture points: nothing to do
    new = AuxLayers((0, 1), "input")
    t.configure(FeatureSpec(Feature.AUX_HIDDEN, new))
    assert captured[1:] == [new] and t.model.aux_points == new.capture_points(n)
    # prefix blocks' feature rows are keyed by the capture points: the new ones, not the kept key
    key = t.feature_key(Feature.AUX_HIDDEN)
    assert key == feature_key(Feature.AUX_HIDDEN, new.capture_points(n)) != default_key


@pytest.mark.parametrize("mode", ["decode", "verify"])
def test_a_target_runner_runs_the_lm_head_in_its_graph(target, mode: str) -> None:
    """A target's runners compute the logits inside the forward they capture (and in decode
    their argmax), equal to the LM head run after it, every other field unchanged."""
    cache = _prefilled(target)
    items = _decode_items() if mode == "decode" else _verify_items(cache)
    want = run_batch(target, cache, make_backend("torch"), items)
    sizes = decode_sizes(8, 32) if mode == "decode" else verify_sizes(8, 4, 32)
    head = functools.partial(target.head_outputs, greedy=mode == "decode")
    runner = GraphRunner(
        target, cache, make_backend("torch"), sizes, mode="eager-static", head=head
    )
    runner.capture()
    got = runner.run(items)
    logits = target.compute_logits(want.hidden)
    torch.testing.assert_close(got.logits, logits, **reorder_tolerance(logits.dtype))
    if mode == "decode":
        assert got.greedy.tolist() == logits.argmax(-1).tolist()
    else:
        assert got.greedy is None
    _assert_same(dataclasses.replace(got, logits=None, greedy=None), want)
