"""DeepSeek-V3-class targets (issue 29): multi-head latent attention over a latent cache of one
vector per token and layer, YaRN, MoE with grouped routing. The oracle is transformers in fp32:
one attention layer with its cache (prefill, then decode), the routing, the layer inputs EAGLE-3
reads, then greedy tokens and logprobs through the Engine plain, with n-gram trees, with the
sibling-last oracle draft and with chunked prefill -- on the torch backend and on the Triton one
(`kernels.mla_attention`, interpreted on CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import _hf_model, assert_accepted, hf_greedy, reorder_tolerance
from oracle_draft import assert_varied, mean_accept, oracle_engine

from specmesh.kernels.testing import cpu_triton
from specmesh.protocol.config import SpecParams, TargetConfig
from specmesh.protocol.features import AuxLayers
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.router.router_config import RouterConfig
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.attention.torch_backend import TorchBackend, make_backend
from specmesh.runtime.config import load_model_config
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.model_runner import BatchItem, build_metadata, reserve_batch, run_batch
from specmesh.runtime.models.causal_lm import load_causal_lm
from specmesh.runtime.models.moe import route
from specmesh.target_service.runtime import TargetRuntime

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]
TOL = reorder_tolerance(torch.float32)  # absorbed vs expanded K/V: same math, another order
BACKENDS = ["torch", cpu_triton()]


def _cache(model_dir: Path, num_layers: int) -> KVCache:
    mc = load_model_config(model_dir)
    return KVCache(num_layers=num_layers, num_slots=64, num_kv_heads=1, head_dim=mc.head_dim,
                   dtype=torch.float32, latent_dim=mc.kv_latent_dim)  # fmt: skip


def _step(cache: KVCache, backend: AttentionBackend, start: int, n: int) -> torch.Tensor:
    item = BatchItem("r", torch.zeros(n, dtype=torch.int64), start)
    reserve_batch(cache, [item])
    backend.prepare(build_metadata(cache, [item]))
    return torch.arange(start, start + n)


@pytest.mark.parametrize("backend_name", BACKENDS)
@torch.inference_mode()
def test_latent_attention_layer_equals_transformers_with_its_cache(
    tiny_deepseek_dir, backend_name: str
) -> None:
    """Prefill 6 tokens, then decode 1, through one layer's MLA and the paged cache: outputs
    equal transformers' attention (expanded K/V, DynamicCache); the cache holds one
    ``kv_lora_rank + qk_rope_head_dim`` vector per token (V a view of its latent columns), equal
    to transformers' normalized latent and rope'd key."""
    d = tiny_deepseek_dir
    ours, hf = load_causal_lm(d), _hf_model(str(d))
    from transformers import DynamicCache

    layer, mc = 1, ours.config
    r = mc.mla.kv_lora_rank
    cache, backend = _cache(d, 1), make_backend(backend_name, latent=True)
    cache.add("r")
    pool = cache.pools[0]
    assert pool.k.shape[1:] == (1, r + mc.mla.qk_rope_head_dim)
    assert pool.v.shape[1:] == (1, r) and pool.v.data_ptr() == pool.k.data_ptr()
    x = torch.randn(7, mc.hidden_size, generator=torch.Generator().manual_seed(0))
    attn, hf_attn = ours.model.layers[layer].self_attn, hf.model.layers[layer].self_attn
    cos, sin = hf.model.rotary_emb(x, torch.arange(7)[None])
    hf_cache = DynamicCache(config=hf.config)
    for start, n in ((0, 6), (6, 1)):
        positions = _step(cache, backend, start, n)
        got = attn(x[start : start + n], positions, ours.rotary, pool, backend)
        pe = (cos[:, start : start + n], sin[:, start : start + n])
        want, _ = hf_attn(x[None, start : start + n], pe, None, past_key_values=hf_cache)
        torch.testing.assert_close(got, want[0], **TOL)
    latent = pool.k[cache.slots("r", 0, 7), 0]  # [7, r + d_rope]
    torch.testing.assert_close(latent[:, :r], hf_cache.layers[layer].keys[0, 0], **TOL)
    torch.testing.assert_close(latent[:, r:], hf_cache.layers[layer].values[0, 0], **TOL)


def test_grouped_routing_equals_transformers(tiny_deepseek_dir) -> None:
    """noaux_tc: the bias steers which experts run (not their weights); experts only from the
    top groups; the routed + shared MoE output equals transformers' module."""
    ours, hf = load_causal_lm(tiny_deepseek_dir), _hf_model(str(tiny_deepseek_dir))
    moe, hf_moe = ours.model.layers[2].mlp, hf.model.layers[2].mlp
    x = torch.randn(32, ours.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        _, hf_weights, hf_ids = hf_moe.gate(x)
        weights, ids = moe.gate(x)
        assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
        order_ours, order_hf = ids.argsort(-1), hf_ids.argsort(-1)
        torch.testing.assert_close(weights.gather(1, order_ours), hf_weights.gather(1, order_hf))
        torch.testing.assert_close(moe(x), hf_moe(x), **TOL)
        bias = moe.gate.e_score_correction_bias
        assert bias.dtype == torch.float32 and bias.abs().sum() > 0
        logits = torch.nn.functional.linear(x, moe.gate.weight)
        unbiased = route(logits, torch.zeros_like(bias), ours.config.moe)[1]
    assert not torch.equal(unbiased.sort(-1).values, ids.sort(-1).values)
    per_group = ours.config.moe.n_routed_experts // ours.config.moe.n_group
    assert ((ids // per_group) == (ids[:, :1] // per_group)).all()  # topk_group = 1


@torch.inference_mode()
def test_layer_inputs_for_eagle3_equal_transformers_hidden_states(tiny_deepseek_dir) -> None:
    """The model records layer inputs like the Llama stack: aux rows are transformers'
    ``hidden_states[i]``, and the final hidden state its last one."""
    d = tiny_deepseek_dir
    ours, hf = load_causal_lm(d), _hf_model(str(d))
    ours.set_aux_layers(AuxLayers((1, 2, 3), "input"))
    cache = _cache(d, ours.config.num_layers)
    cache.add("r")
    ids = torch.tensor(PROMPTS[1])
    out = run_batch(ours, cache, TorchBackend(), [BatchItem("r", ids, 0)])
    want = hf(ids[None], output_hidden_states=True).hidden_states
    h = ours.config.hidden_size
    for k, i in enumerate((1, 2, 3)):
        torch.testing.assert_close(out.aux_hidden[:, k * h : (k + 1) * h], want[i][0], **TOL)
    torch.testing.assert_close(out.hidden, want[-1][0], **TOL)


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_equals_transformers(tiny_deepseek_dir, backend: str) -> None:
    """Two prompts of different lengths in one batch (padded rows), plain decoding on
    ``backend`` (the speculative paths over the latent cache: the tests below)."""
    d = tiny_deepseek_dir
    engine = Engine(d, target_config={"attention_backend": backend})
    assert engine.target.backend.name == backend
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == hf_greedy(d, prompt, 16)
    assert_varied(results[0].token_ids)


@pytest.fixture(scope="module")
def cycling_deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 at a small init scale: its greedy output falls into short cycles."""
    from specmesh.runtime.tiny import make_tiny_deepseek

    return make_tiny_deepseek(tmp_path_factory.mktemp("cycling") / "target", initializer_range=0.05)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ngram_trees_equal_transformers(cycling_deepseek: Path, backend: str) -> None:
    """n-gram trees over the latent cache, accepted where the output cycles: verify runs the
    tree mask on ``backend`` and keeps the accepted paths' latent KV."""
    d = cycling_deepseek
    prompts = [PROMPTS[0], [*PROMPTS[0], *hf_greedy(d, PROMPTS[0], 8), *PROMPTS[0]]]
    engine = Engine(d, draft_kind="ngram", spec=SpecParams(3, 2, 6),
                    target_config={"attention_backend": backend})  # fmt: skip
    results = engine.generate(prompts, SamplingParams(max_new_tokens=14, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == hf_greedy(d, prompt, 14)
    assert_accepted(results, min_tokens=6)


@pytest.mark.parametrize("draft", ["eagle3", "standalone"])
def test_random_drafts_run_over_a_latent_target(tiny_deepseek_dir, tmp_path: Path, draft) -> None:
    """A random EAGLE-3 head drafts from the target's captured layer inputs (``[num_tokens, 3H]``
    rows), a small Llama on the same tokenizer as a standalone draft: their trees reach verify.
    Their tokens are rejected (accepted paths over the latent cache: the n-gram and oracle
    tests, and `test_deepseek_mtp`; a DeepSeek checkpoint as a standalone draft: the test below)."""
    from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target

    d = tiny_deepseek_dir
    if draft == "eagle3":
        draft_dir = make_tiny_eagle3(tmp_path / "eagle3", d)
    else:
        draft_dir = make_tiny_target(tmp_path / "llama", num_hidden_layers=2)
    engine = Engine(d, draft_model=draft_dir, draft_kind=draft, spec=SpecParams(3, 2, 6))
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=8, ignore_eos=True))
    assert all(r.num_draft_tokens > 0 for r in results), "no draft tree was verified"
    assert [r.token_ids for r in results] == [hf_greedy(d, p, 8) for p in PROMPTS]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_latent_checkpoint_drafts_as_a_standalone_draft(tiny_deepseek_dir, backend) -> None:
    """The DeepSeek checkpoint drafting for itself: the standalone drafter keeps its own latent
    cache (V inside K, as the target's) on ``backend``, and every draft token is accepted."""
    d = tiny_deepseek_dir
    engine = Engine(d, draft_model=d, draft_kind="standalone", spec=SpecParams(3, 1, 4),
                    target_config={"attention_backend": backend},
                    draft_config={"attention_backend": backend})  # fmt: skip
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=13, ignore_eos=True))
    assert [r.token_ids for r in results] == [hf_greedy(d, p, 13) for p in PROMPTS]
    assert all(r.accept_lens == [4, 4, 4] for r in results), [r.accept_lens for r in results]


@pytest.mark.parametrize("backend", BACKENDS)
def test_oracle_draft_and_logprobs_equal_transformers(tiny_deepseek_dir, backend: str) -> None:
    """The sibling-last oracle makes verify accept 0..3 tokens along out-of-order tree paths, so
    only the accepted path's latent KV may stay; each token's logprob and top-4 equal
    transformers' fp32 log-softmax (EAGLE-3 feature rows cross too: the oracle asks for them)."""
    d = tiny_deepseek_dir
    engine = oracle_engine(d, target_config={"attention_backend": backend})
    assert engine.target.backend.name == backend
    params = SamplingParams(max_new_tokens=12, ignore_eos=True, logprobs=4)
    (res,) = engine.generate([PROMPTS[0]], params)
    assert res.token_ids == hf_greedy(d, PROMPTS[0], 12)
    assert mean_accept([res]) > 1.5
    with torch.no_grad():
        logits = _hf_model(str(d))(torch.tensor([PROMPTS[0] + res.token_ids])).logits[0]
    rows = torch.log_softmax(logits.float(), -1)[len(PROMPTS[0]) - 1 :]
    for k, (tok, entry) in enumerate(zip(res.token_ids, res.logprobs, strict=True)):
        assert entry.token_id == tok
        assert entry.logprob == pytest.approx(rows[k, tok].item(), abs=1e-4)
        assert [t for t, _ in entry.top] == rows[k].topk(4).indices.tolist()


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_equals_transformers(tiny_deepseek_dir, backend: str) -> None:
    """A prompt of 30 tokens prefilled 4 at a time, each piece on the cached latent prefix."""
    prompt = list(range(60, 90))
    engine = Engine(tiny_deepseek_dir, router_config=RouterConfig(prefill_chunk_tokens=4),
                    target_config={"attention_backend": backend})  # fmt: skip
    (res,) = engine.generate([prompt], SamplingParams(max_new_tokens=10, ignore_eos=True))
    assert res.token_ids == hf_greedy(tiny_deepseek_dir, prompt, 10)


def test_prefix_cache_hit_reads_cached_latent_pages(tiny_deepseek_dir) -> None:
    """A second prompt sharing 48 tokens with the first starts from its cached latent pages."""
    base = list(range(20, 68))
    engine = Engine(tiny_deepseek_dir)
    for tail in ([5, 6], [7, 8, 9]):
        prompt = base + tail
        (res,) = engine.generate([prompt], SamplingParams(max_new_tokens=8, ignore_eos=True))
        assert res.token_ids == hf_greedy(tiny_deepseek_dir, prompt, 8)
    assert engine.target.prefixes.blocks.num_hit >= 48


def test_variant_without_q_lora_or_interleave(tmp_path: Path) -> None:
    """``q_lora_rank: null`` (one q_proj), rope without pair interleaving, and YaRN without
    ``mscale_all_dim``: cos / sin scaled by mscale(factor), the softmax scale left alone."""
    from specmesh.runtime.tiny import make_tiny_deepseek

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
            "original_max_position_embeddings": 128}  # fmt: skip
    d = make_tiny_deepseek(tmp_path / "v", q_lora_rank=None, rope_interleave=False,
                           rope_parameters=yarn, num_hidden_layers=2, seed=3)  # fmt: skip
    engine = Engine(d)
    assert engine.target.model.rotary.attention_factor > 1
    (res,) = engine.generate([PROMPTS[1]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert res.token_ids == hf_greedy(d, PROMPTS[1], 12)


@pytest.mark.parametrize("topk_method", ["greedy", "group_limited_greedy"])
def test_deepseek_v2_routing_and_greedy_equal_transformers(tmp_path: Path, topk_method) -> None:
    """``DeepseekV2ForCausalLM``: MLA as V3 (interleaved rope, YaRN), softmax routing without a
    correction bias, over all experts or the best groups; the gate picks transformers' experts
    and weights, and greedy decoding (plain and with n-gram trees) gives its tokens."""
    from specmesh.runtime.tiny import make_tiny_deepseek

    d = make_tiny_deepseek(tmp_path / topk_method, version=2, topk_method=topk_method,
                           num_hidden_layers=2, seed=4)  # fmt: skip
    ours, hf = load_causal_lm(d), _hf_model(str(d))
    assert ours.config.moe.scoring == "softmax" and ours.config.moe.topk_method == topk_method
    gate, hf_gate = ours.model.layers[1].mlp.gate, hf.model.layers[1].mlp.gate
    assert gate.e_score_correction_bias is None
    x = torch.randn(32, ours.config.hidden_size, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        (_, hf_weights, hf_ids), (weights, ids) = hf_gate(x), gate(x)
    assert torch.equal(ids.sort(-1).values, hf_ids.sort(-1).values)
    torch.testing.assert_close(
        weights.gather(1, ids.argsort(-1)), hf_weights.gather(1, hf_ids.argsort(-1))
    )
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    for engine in (Engine(d), Engine(d, draft_kind="ngram", spec=SpecParams(3, 2, 6))):
        for prompt in PROMPTS[:2]:
            assert engine.generate([prompt], params)[0].token_ids == hf_greedy(d, prompt, 12)


MLA_REFUSED = r"flashinfer.*latent attention.*--attention-backend triton \(or torch\)"


def test_mla_refuses_flashinfer(tiny_deepseek_dir) -> None:
    """FlashInfer has no MLA kernel here yet: refused at startup with the flag to use instead
    (the NextN draft likewise: `test_deepseek_mtp.py`)."""
    cfg = TargetConfig(model_dir=str(tiny_deepseek_dir), attention_backend="flashinfer")
    with pytest.raises(ValueError, match=MLA_REFUSED):
        TargetRuntime(cfg)


def test_yarn_serves_the_llama_family_too(tmp_path: Path) -> None:
    """YaRN, added for DeepSeek, is read from any config: a Llama with it equals transformers."""
    from specmesh.runtime.tiny import make_tiny_target

    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
            "original_max_position_embeddings": 64}  # fmt: skip
    d = make_tiny_target(tmp_path / "llama", num_hidden_layers=2, rope_parameters=yarn)
    (res,) = Engine(d).generate([PROMPTS[1]], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert res.token_ids == hf_greedy(d, PROMPTS[1], 12)


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
def test_make_tiny_deepseek_then_generate(tmp_path: Path, capsys, kind: str) -> None:
    """``specmesh make-tiny --arch deepseek_v3`` with an EAGLE-3 head, or with a NextN layer
    written into the target (which is then the MTP draft), then ``generate`` speculates."""
    import json

    from specmesh.cli.main import main

    make = ["make-tiny", str(tmp_path), "--arch", "deepseek_v3", "--draft-kind", kind]
    assert main(make) == 0
    paths = json.loads(capsys.readouterr().out)
    assert (paths["draft"] == paths["target"]) == (kind == "mtp")
    assert main([
        "generate", "--in-process", "--json", "--target-model", paths["target"],
        "--draft-model", paths["draft"], "--draft-kind", kind, "--speculation", "always",
        "--prompt-ids", "5,6,7,8", "--max-new-tokens", "8", "--ignore-eos",
    ]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == hf_greedy(paths["target"], [5, 6, 7, 8], 8)
    assert out["num_draft_tokens"] > 0
