"""The engine on a CUDA device: every attention backend, eager and in CUDA graphs, every draft
kind, against transformers' greedy output (fp32, computed on CPU), plus losslessness of
speculative sampling and logprobs. Skipped without a CUDA device (``pytest -m gpu``)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from conftest import assert_accepted
from gpu_support import assert_greedy_up_to_rounding, cuda_engine, spy_graph_replays

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import StepOutput, VerifyInput
from specmesh.router.engine import Engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

HAS_FLASHINFER = importlib.util.find_spec("flashinfer") is not None
# (attention backend, CUDA graphs); the torch backend has no graph hooks, so it is eager only.
VARIANTS = [
    ("torch", False),
    ("triton", False),
    ("triton", True),
    pytest.param("flashinfer", False, marks=pytest.mark.skipif(not HAS_FLASHINFER, reason="no flashinfer")),
    pytest.param("flashinfer", True, marks=pytest.mark.skipif(not HAS_FLASHINFER, reason="no flashinfer")),
]  # fmt: skip
KINDS = ("plain", "eagle3", "eagle", "mtp", "standalone", "ngram")
COPY_KINDS = ("eagle3", "eagle", "mtp", "standalone")
PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46], [200, 13, 77, 13, 77, 13]]
MAX_NEW = 12


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path | None]:
    """A one-layer tiny target with head_dim 64 (FlashInfer's kernels take 64, 128 and 256) and
    a draft of every kind built to predict it (`copy_drafts`: rounds accept draft tokens);
    n-gram drafting (no checkpoint) runs on ``cycling``, a target whose output repeats."""
    from copy_drafts import make_copy_pair

    from specmesh.runtime.tiny import make_tiny_target

    root = make_copy_pair(tmp_path_factory.mktemp("gpu_pair"), hidden_size=256,
                          num_attention_heads=4)  # fmt: skip
    out: dict[str, Path | None] = {k: root / k for k in ("target", *COPY_KINDS)}
    out["ngram"] = None
    out["cycling"] = make_tiny_target(root / "cycling", hidden_size=256, num_attention_heads=4,
                                      initializer_range=0.05)  # fmt: skip
    return out


def spy_tree_sizes(engine: Engine) -> list[int]:
    """Node counts of the trees the target verified (plain decoding verifies one-node trees)."""
    sizes: list[int] = []
    verify = engine.target.verify

    def spy(inputs: list[VerifyInput], *args: object, **kwargs: object) -> StepOutput:
        sizes.extend(inp.tree.num_nodes for inp in inputs)
        return verify(inputs, *args, **kwargs)

    engine.target.verify = spy  # type: ignore[method-assign]
    return sizes


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(("backend", "graphs"), VARIANTS)
def test_greedy_equals_transformers_on_cuda(
    pair, oracle, backend: str, graphs: bool, kind: str
) -> None:
    """Greedy output on the GPU equals transformers' (fp32) token for token, plain and with each
    draft kind, whose trees (more than the root) the target verified; with graphs on, the
    captured runners (not an eager fallback) served the rounds.
    FlashInfer runs only fp16 / bf16, so its tokens are checked as greedy up to bf16 rounding:
    each is within bf16's error of the fp32 model's best at its position
    (`assert_greedy_up_to_rounding`)."""
    spec = SpecParams(3, 2, 6)
    draft_kind = None if kind == "plain" else kind
    dtype = "bf16" if backend == "flashinfer" else "fp32"
    target = pair["cycling" if kind == "ngram" else "target"]
    engine = cuda_engine(target, backend, graphs, draft_kind, pair.get(kind), spec, dtype)
    assert engine.target.cache.req_to_slot.device.type == "cuda"
    assert (engine.target.graphs is not None) == graphs
    used = spy_graph_replays(engine) if graphs else set()
    sizes = spy_tree_sizes(engine)
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    results = engine.generate(PROMPTS, params)
    for prompt, res in zip(PROMPTS, results, strict=True):
        if dtype == "fp32":
            assert res.token_ids == oracle(target, prompt, MAX_NEW), (backend, kind)
        else:
            assert_greedy_up_to_rounding(target, prompt, res.token_ids)
    if draft_kind is not None:
        assert_accepted(results, min_tokens=len(PROMPTS))
    # The draft was consulted: trees beyond the root were verified exactly when there is one;
    # every tree draft fills its trees (n-gram trees vary in size with the matches).
    assert sizes and (max(sizes) > 1) == (draft_kind is not None), sizes
    if draft_kind not in (None, "ngram"):
        assert max(sizes) == spec.num_draft_tokens, sizes
    if graphs:
        if draft_kind is None:  # plain decoding replays the decode graph
            assert "decode" in used, used
        if draft_kind not in (None, "ngram"):
            assert "verify6" in used, used
        if draft_kind is not None and draft_kind != "ngram":  # the search in one graph, where
            # the backend needs no host metadata per batch; FlashInfer's steps replay per step
            assert ("draft search" if backend == "triton" else "draft step1") in used, used
        if kind in ("eagle3", "eagle"):  # feature drafts also extend in a graph
            assert "draft extend" in used, used
    # Nothing held after the batch, in either service.
    assert engine.target.num_requests == 0 and engine.target.kv_slots()[0] == 0
    assert engine.draft is None or engine.draft.kv_slots()[0] == 0


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_speculative_sampling_is_lossless_on_cuda(tmp_path: Path, backend: str) -> None:
    """Sampling through tree speculation on the GPU (in CUDA graphs with triton) follows the
    target's distribution (chi-square at 0.001 on tokens 2 and 3, 3000 samples), as on CPU.
    The small-vocabulary pair has head_dim 8, which FlashInfer does not take."""
    from conftest import make_small_vocab_pair
    from unit.test_engine import assert_follows_target

    pair = make_small_vocab_pair(tmp_path, vocab_size=8, num_layers=6, seed=3)
    n, temp, prompt = 3000, 0.8, [1, 2, 3]
    engine = cuda_engine(pair / "target", backend, backend != "torch", "eagle3", pair / "draft",
                         SpecParams(3, 4, 8), max_batch_size=256)  # fmt: skip
    params = [
        SamplingParams(max_new_tokens=3, temperature=temp, seed=s, ignore_eos=True)
        for s in range(n)
    ]
    results = engine.generate([prompt] * n, params)
    assert_follows_target([r.token_ids for r in results], pair / "target", prompt, temp)
    accepted = sum(1 for r in results if r.accept_lens and r.accept_lens[0] > 1)
    assert accepted > n // 3, f"only {accepted} of {n} rounds accepted a draft token"


def test_logprobs_equal_transformers_log_softmax_on_cuda(pair, oracle) -> None:
    from conftest import _hf_model

    engine = cuda_engine(pair["target"], "triton", True, "eagle3", pair["eagle3"],
                         SpecParams(3, 2, 6))  # fmt: skip
    prompt, n = [5, 6, 7, 8, 9], 8
    (res,) = engine.generate(
        [prompt], SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=2)
    )
    assert res.token_ids == oracle(pair["target"], prompt, n)
    assert_accepted([res])
    with torch.no_grad():
        logits = _hf_model(str(pair["target"]))(torch.tensor([prompt + res.token_ids])).logits
    rows = torch.log_softmax(logits[0].float(), -1)
    for k, e in enumerate(res.logprobs):
        row = rows[len(prompt) - 1 + k]
        assert e.logprob == pytest.approx(row[e.token_id].item(), abs=1e-4)
        assert [t for t, _ in e.top] == row.topk(2).indices.tolist()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_bf16_static_runners_equal_bf16_eager_on_cuda(pair, backend: str) -> None:
    """In bf16 there is no fp32 oracle to equal, but at batch size 1 the static-shape runners
    run the same kernels on the same shapes as the eager path: their greedy tokens agree. For
    triton these are its CUDA graphs (target and draft); the torch backend has no graph hooks,
    so the target's runners run eagerly on their static buffers ("eager-static", the path a
    graph replays). (FlashInfer's graph path uses other kernels than its eager one; it is
    checked above.)"""
    from specmesh.target_service.runtime import TargetGraphs

    prompts = PROMPTS[:2]
    params = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True)
    spec = SpecParams(3, 2, 6)
    outs = []
    for static in (False, True):
        engine = cuda_engine(pair["target"], backend, static and backend == "triton", "eagle3",
                             pair["eagle3"], spec, dtype="bf16", max_batch_size=1)  # fmt: skip
        t = engine.target
        if static and backend == "torch":
            t.configure(engine.draft.info().needs)  # the handshake first: it names the layers
            # (the spy's and the engine's handshakes, with the same needs, then keep these)
            t.graphs = TargetGraphs(
                t.model, t.cache, t.backend, mode="eager-static",
                max_bs=t.cfg.cuda_graph_max_bs, tree_sizes=(spec.num_draft_tokens,), aux=t.aux_layers,
            )  # fmt: skip
        assert (t.graphs is not None) == static
        used = spy_graph_replays(engine) if static else set()
        outs.append([r.token_ids for r in engine.generate(prompts, params)])
        assert len(outs[-1][0]) == MAX_NEW
        if static:  # the static runners served the verify rounds
            assert "verify6" in used, used
    assert outs[0] == outs[1]
