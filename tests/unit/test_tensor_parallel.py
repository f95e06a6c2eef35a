"""Tensor parallelism on CPU with gloo, two ranks (this process is rank 0, one spawned worker):
the sharded model computes the unsharded model's logits, hidden states and EAGLE-3 aux states for
Llama, Qwen2 (qkv bias) and Qwen3 (q/k norm) with grouped-query attention (KV heads split, and
one KV head replicated), an odd vocabulary (padding) and tied embeddings, and DeepSeek-V3 (MLA
heads split over a replicated latent cache, experts split); the target runtime
decodes transformers' greedy tokens; bad splits are refused before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import hf_greedy, reorder_tolerance

from specmesh.protocol.config import TargetConfig
from specmesh.protocol.features import AuxLayers
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput
from specmesh.runtime.config import ModelConfig
from specmesh.runtime.model_runner import BatchItem, run_batch
from specmesh.runtime.parallel import (
    TensorParallel,
    check_tensor_parallel,
    kv_head_range,
    rank_devices,
)
from specmesh.runtime.shard_loader import shard_of
from specmesh.runtime.tiny import make_tiny_deepseek, make_tiny_target
from specmesh.target_service.runtime import TargetRuntime

SMALL = {"num_hidden_layers": 4, "hidden_size": 32, "intermediate_size": 64}
CASES = {
    # name: (arch, overrides); every case has an odd vocabulary (the last rank's rows padded)
    "llama-gqa": ("llama", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen2-bias": ("qwen2", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "qwen3-one-kv-head-tied": ("qwen3", {"num_attention_heads": 4, "num_key_value_heads": 1}),
    # MLA (heads split, the latent replicated), a dense layer then MoE layers (every expert's
    # intermediate split), YaRN
    "deepseek-v3-mla-moe": ("deepseek", {"vocab_size": 321}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory: pytest.TempPathFactory):
    """(unsharded runtime, two-rank runtime) on one tiny checkpoint."""
    arch, dims = CASES[request.param]
    out = tmp_path_factory.mktemp(request.param)
    tied = {"tie_word_embeddings": True} if "tied" in request.param else {}
    if arch == "deepseek":
        model_dir = make_tiny_deepseek(out, **dims)
    else:
        model_dir = make_tiny_target(out, arch=arch, vocab_size=321, **SMALL, **dims, **tied)
    threads = torch.get_num_threads()  # two ranks on CPU split this process's threads
    runtimes = [
        TargetRuntime(TargetConfig(str(model_dir), num_kv_slots=256, tensor_parallel_size=n))
        for n in (1, 2)
    ]
    yield runtimes
    runtimes[1].model.close()
    torch.set_num_threads(threads)


def _forward(rt: TargetRuntime, items: list[BatchItem]):
    res = run_batch(rt.model, rt.cache, rt.backend, items)
    return res, rt.model.compute_logits(res.hidden)


def test_sharded_logits_equal_the_unsharded_model(pair) -> None:
    """Prefill of two ragged requests, then a tree verify on top: every output field equal."""
    tol = reorder_tolerance(torch.float32)
    aux = AuxLayers((0, 2, 3), "input")
    for rt in pair:
        rt.model.set_aux_layers(aux)
        for rid in ("a", "b"):
            rt.cache.add(rid)
    prefill = [BatchItem("a", torch.arange(7, 20), 0), BatchItem("b", torch.tensor([320, 5, 1]), 0)]
    tree_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)
    verify = [
        BatchItem(
            "a", torch.tensor([319, 4, 160]), 13, torch.tensor([13, 14, 14]),
            torch.cat([torch.ones(3, 13, dtype=torch.bool), tree_mask], 1),
        ),
        BatchItem("b", torch.tensor([2]), 3),
    ]  # fmt: skip
    for items in (prefill, verify):
        (res1, logits1), (res2, logits2) = (_forward(rt, items) for rt in pair)
        assert logits2.shape == logits1.shape == (res1.hidden.shape[0], 321)
        torch.testing.assert_close(logits2, logits1, **tol)
        for name in ("hidden", "hidden_pre_norm", "aux_hidden"):
            torch.testing.assert_close(getattr(res2, name), getattr(res1, name), **tol)


def test_sharded_target_decodes_transformers_greedy(pair) -> None:
    rt = pair[1]
    prompt, n = [1, 17, 42, 99, 7, 250], 6
    params = SamplingParams(max_new_tokens=n)
    out = rt.prefill([PrefillInput("g", prompt, params)])
    tokens = list(out.tokens["g"])
    while len(tokens) < n:
        tokens += rt.decode(["g"]).tokens["g"]
    rt.release("g")
    assert tokens == hf_greedy(rt.cfg.model_dir, prompt, n)


def test_shards_cover_every_tensor_once() -> None:
    """The ranks' slices tile each weight in rank order; KV heads follow their query heads; the
    vocabulary slices cover the vocabulary with padding only at the end."""
    cfg = ModelConfig.from_dict({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 11, "hidden_size": 16,
        "intermediate_size": 24, "num_hidden_layers": 1, "num_attention_heads": 8,
        "num_key_value_heads": 2,
    })  # fmt: skip
    widths = {
        "self_attn.q_proj.weight": 16,
        "self_attn.o_proj.weight": 16,
        "mlp.up_proj.weight": 24,
    }
    for n in (2, 4, 8):
        check_tensor_parallel(cfg, n)
        ranks = [TensorParallel(r, n) for r in range(n)]
        for name, full in widths.items():
            parts = [shard_of(f"model.layers.0.{name}", cfg, tp) for tp in ranks]
            assert [(p.start, p.size) for p in parts] == [
                (r * full // n, full // n) for r in range(n)
            ]
        vocab = [shard_of("model.embed_tokens.weight", cfg, tp) for tp in ranks]
        assert [v.start for v in vocab] == [r * vocab[0].size for r in range(n)]
        assert vocab[0].size == -(-11 // n)  # ranks past the vocabulary hold padding only
        group = cfg.num_heads // cfg.num_kv_heads  # query heads per KV head
        for tp in ranks:
            first_q = tp.rank * cfg.num_heads // n
            assert kv_head_range(cfg.num_kv_heads, tp)[0] == first_q // group


@pytest.mark.parametrize(
    ("dims", "n", "message"),
    [
        ({"num_attention_heads": 4, "num_key_value_heads": 4}, 3, "does not divide the 4 attention heads"),
        ({"num_attention_heads": 6, "num_key_value_heads": 2}, 3, "2 KV heads cannot be replicated over"),
        ({"num_attention_heads": 8, "num_key_value_heads": 6}, 4, "does not divide the 6 KV heads"),
        ({"num_attention_heads": 4, "intermediate_size": 66}, 4, "does not divide intermediate_size 66"),
        ({}, 0, "tensor_parallel_size must be >= 1"),
    ],
)  # fmt: skip
def test_bad_splits_are_refused_before_any_rank_starts(tmp_path: Path, dims, n, message) -> None:
    model_dir = make_tiny_target(tmp_path, **{**SMALL, "hidden_size": 48, **dims})
    with pytest.raises(ValueError, match=message):
        TargetRuntime(TargetConfig(str(model_dir), tensor_parallel_size=n))


@pytest.mark.parametrize(
    ("dims", "n", "message"),
    [
        ({}, 3, "does not divide the 4 attention heads"),
        ({"moe_intermediate_size": 30}, 4, "does not divide moe_intermediate_size 30"),
        ({"intermediate_size": 98}, 4, "does not divide intermediate_size 98"),
        ({"attention_bias": True}, 2, "with attention_bias runs with tensor_parallel_size 1"),
    ],
)  # fmt: skip
def test_bad_latent_splits_are_refused(tmp_path: Path, dims, n, message) -> None:
    model_dir = make_tiny_deepseek(tmp_path, **dims)
    with pytest.raises(ValueError, match=message):
        TargetRuntime(TargetConfig(str(model_dir), tensor_parallel_size=n))


def test_more_ranks_than_devices_and_a_launcher_world_are_refused(
    tiny_dir: Path, monkeypatch
) -> None:
    visible = torch.cuda.device_count()
    with pytest.raises(ValueError, match=f"needs CUDA devices 0..{visible}; {visible} visible"):
        rank_devices("cuda", visible + 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="WORLD_SIZE=4"):
        TargetRuntime(TargetConfig(str(tiny_dir / "target"), tensor_parallel_size=2))


def test_sharded_target_reuses_a_cached_prefix(pair) -> None:
    """Prefix caching under tensor parallelism: the slot tables are rank 0's, the cached pages
    every rank's own heads; a prompt sharing two blocks with an earlier one decodes exactly."""
    rt = pair[1]
    shared = [(5 * i + 3) % 300 + 4 for i in range(33)]
    before = rt.prefixes.blocks.num_hit
    for tail in ([9], [11, 12]):
        prompt = shared + tail
        out = rt.prefill([PrefillInput("c", prompt, SamplingParams(max_new_tokens=4))])
        tokens = list(out.tokens["c"])
        while len(tokens) < 4:
            tokens += rt.decode(["c"]).tokens["c"]
        rt.release("c")
        assert tokens == hf_greedy(rt.cfg.model_dir, prompt, 4)
    assert rt.prefixes.blocks.num_hit - before == 32
