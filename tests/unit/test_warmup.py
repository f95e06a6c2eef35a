"""The target's warm-up request (`target_service.warmup`): it runs a prefill and an eager verify
of a branching tree, and leaves nothing behind: no request, no KV, no cached prefix, and the
next real request still equals transformers."""

from __future__ import annotations

from specmesh.protocol.config import TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput
from specmesh.target_service.runtime import TargetGraphs, TargetRuntime
from specmesh.target_service.warmup import PROMPT, warm_up


def test_warm_up_compiles_the_eager_paths_and_leaves_nothing(tiny_dir, oracle) -> None:
    target = tiny_dir / "target"
    rt = TargetRuntime(TargetConfig(str(target), num_kv_slots=256))
    # Static runners for decode and trees of 3 and 4: the warm-up's verify must miss them.
    rt.graphs = TargetGraphs(rt.model, rt.cache, rt.backend, mode="eager-static", max_bs=2,
                             tree_sizes=(3, 4))  # fmt: skip
    static = [rt.graphs.decode, *rt.graphs.verify.values()]
    seen: list[tuple[int, bool]] = []  # (rows, eager) of each forward
    forward = rt.model.forward

    def spy(positions, kv_pools, backend, *args, **kwargs):
        seen.append((positions.shape[0], backend.meta.custom_mask is not None))
        return forward(positions, kv_pools, backend, *args, **kwargs)

    rt.model.forward = spy
    for runner in static:
        runner.run = lambda *a, **k: (_ for _ in ()).throw(AssertionError("a static runner ran"))
    warm_up(rt)
    # a causal prefill of the prompt, then a 5-node tree (3 and 4 are captured) with its mask
    assert seen == [(len(PROMPT), False), (5, True)]
    assert rt.num_requests == 0 and rt.kv_slots()[0] == 0
    assert not rt.cache.requests and rt.prefixes.num_evictable_slots == 0
    rt.model.forward, rt.graphs = forward, None
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9, 10]
    out = rt.prefill([PrefillInput("r", prompt, params)])
    tokens = out.tokens["r"]
    for _ in range(5):
        tokens += rt.decode(["r"]).tokens["r"]
    assert tokens == oracle(target, prompt, 6)


def test_warm_up_runs_on_cuda_only(tiny_dir, monkeypatch) -> None:
    """On a CPU device nothing compiles at first use: the runtime skips it."""
    calls = []
    monkeypatch.setattr("specmesh.target_service.runtime.warm_up", calls.append)
    TargetRuntime(TargetConfig(str(tiny_dir / "target"), num_kv_slots=64))
    assert calls == []  # the device is the CPU, whatever the machine has
