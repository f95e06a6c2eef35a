"""DeepSeek-V3's own NextN layers as the MTP draft (issue 29, second milestone): ``--draft-kind
mtp --draft-model <the DeepSeek checkpoint>``. The NextN step (enorm / hnorm / eh_proj, an MLA +
MoE block over its own latent pool, shared_head) against transformers' decoder layer; greedy
top-k trees (torch and Triton backends) and seeded sampling through `Engine` equal plain
decoding (lossless) with speculation accepted; the draft-decode buffers scale with topk and their run-time checks name
the numbers (invariant 5), eagerly and through the static step runners."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_speculated, hf_greedy, record_step_logits

from specmesh.draft_service.mtp_drafter import MTPDrafter
from specmesh.draft_service.runtime import load_draft
from specmesh.kernels.testing import cpu_triton
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.features import Feature
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import ExtendInput, PrefillInput
from specmesh.router.engine import Engine
from specmesh.runtime.config import CheckpointError
from specmesh.runtime.loader import load_tensors
from specmesh.runtime.static_shapes import DraftSizes
from specmesh.runtime.tiny import make_tiny_deepseek
from specmesh.target_service.runtime import TargetRuntime

PROMPTS = [[5, 6, 7, 8, 9, 10], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50]]


@pytest.fixture(scope="module")
def predictive_dir(tmp_path_factory) -> Path:
    """One MLA + MoE layer; the NextN layer copies it and passes the embedding through, so it
    recomputes the target on the context shifted by one token and its trees get accepted."""
    root = tmp_path_factory.mktemp("nextn")
    return make_tiny_deepseek(
        root / "one", num_hidden_layers=1, first_k_dense_replace=0, nextn_copies_layer=0
    )


@pytest.fixture(scope="module")
def random_dir(tmp_path_factory) -> Path:
    """Two layers (dense, MoE) and a random NextN layer 2 (MoE) at the checkpoint's scale."""
    return make_tiny_deepseek(tmp_path_factory.mktemp("nextn") / "two", num_hidden_layers=2,
                              nextn=True)  # fmt: skip


def _drafter(d: Path, spec: SpecParams, target_model=None, **kw) -> MTPDrafter:
    cfg = DraftConfig("mtp", str(d), str(d), spec, max_requests=4, max_context=64, **kw)
    drafter = load_draft(cfg, target_model).drafter
    assert isinstance(drafter, MTPDrafter) and drafter.needs.feature is Feature.HIDDEN_PRE_NORM
    return drafter


def test_checkpoint_layout_and_target_ignores_it(random_dir: Path) -> None:
    """The NextN layer sits at ``model.layers.{num_hidden_layers}`` in the published names; the
    target reads only its stack, the draft only that layer (in one latent pool per layer)."""
    tensors = load_tensors(random_dir)
    p, h = "model.layers.2.", 64
    assert json.loads((random_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert tensors[p + "eh_proj.weight"].shape == (h, 2 * h)
    for name in ("enorm", "hnorm", "shared_head.norm"):
        assert tensors[f"{p}{name}.weight"].shape == (h,)
    assert torch.equal(tensors[p + "shared_head.head.weight"], tensors["lm_head.weight"])
    assert torch.equal(tensors[p + "embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    assert {p + "mlp.experts.7.down_proj.weight", p + "self_attn.q_a_proj.weight"} <= set(tensors)
    target = TargetRuntime.from_dir(random_dir)
    assert not any(k.startswith("model.layers.2.") for k in target.model.state_dict())
    drafter = _drafter(random_dir, SpecParams(3, 2, 6))  # embedding and head read from the dir
    assert len(drafter.cache.pools) == 1 and drafter.cache.pools[0].k.shape[1:] == (1, 32 + 8)
    layer = drafter.net.layers[0]
    assert type(layer.mlp).__name__ == "MoE" and type(layer.self_attn).__name__ == "MLAttention"


@torch.inference_mode()
def test_nextn_chain_equals_transformers_layer(random_dir: Path) -> None:
    """topk 1, 3 steps over the one NextN layer (reused every step, its KV in one pool): the
    root's and each step's logits equal a re-computation with transformers' DeepSeek decoder
    layer ``N`` (MLA + MoE) over the rows (prompt rotated by one, then the greedy chain):
    ``head(shared_head.norm(layer(eh_proj(cat(enorm(e), hnorm(h))))))``."""
    from transformers import AutoModelForCausalLM

    prompt, d = PROMPTS[1], random_dir
    target = TargetRuntime.from_dir(d)
    out = target.prefill([PrefillInput("r", prompt, SamplingParams())], Feature.HIDDEN_PRE_NORM)
    first, feats = out.tokens["r"][0], out.features
    drafter = _drafter(d, SpecParams(3, 1, 4), target.model)
    drafter.extend([ExtendInput("r", prompt, first, feats, new=True)])
    logits_seen = record_step_logits(drafter, "r")  # step 0's logits, then each forward's
    tree = drafter.propose(["r"], [first])[0]

    hf = AutoModelForCausalLM.from_pretrained(d, num_hidden_layers=3, dtype=torch.float32,
                                              attn_implementation="sdpa").eval()  # fmt: skip
    t, p = load_tensors(d), "model.layers.2."
    norm = lambda x, w: w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    ids, hidden, chain = [*prompt[1:], first], feats, []
    for step in range(3):
        e = target.model.embed(torch.tensor(ids))
        u = torch.cat([norm(e, t[p + "enorm.weight"]), norm(hidden, t[p + "hnorm.weight"])], -1)
        u = (u @ t[p + "eh_proj.weight"].t())[None]
        pos = torch.arange(len(ids))[None]
        h = hf.model.layers[2](u, position_ids=pos, position_embeddings=hf.model.rotary_emb(u, pos))
        want = norm(h[0, -1], t[p + "shared_head.norm.weight"]) @ t["lm_head.weight"].t()
        torch.testing.assert_close(logits_seen[step], want, rtol=1e-4, atol=1e-4)
        chain.append(int(want.argmax()))
        ids, hidden = [*ids, chain[-1]], torch.cat([hidden, h[0, -1:]])
    assert list(tree.tokens) == [first, *chain]


@pytest.mark.parametrize("backend", ["torch", cpu_triton()])
@pytest.mark.parametrize("spec", [SpecParams(3, 1, 4), SpecParams(3, 4, 8)], ids=["k1", "k4"])
def test_greedy_trees_equal_transformers(predictive_dir: Path, spec: SpecParams, backend: str):
    """Two prompts of different lengths in one batch, chains and top-4 trees: transformers'
    fp32 greedy tokens, with the NextN layer's proposals accepted (more than one token per
    round on average). Target and draft on ``backend`` (Triton: `kernels.mla_attention` for
    target verify and the draft's tree decode steps alike)."""
    d = predictive_dir
    cfg = {"attention_backend": backend}
    engine = Engine(d, draft_model=d, draft_kind="mtp", spec=spec, target_config=cfg,
                    draft_config=cfg)  # fmt: skip
    assert engine.draft.drafter.backend.name == backend
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=16, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == hf_greedy(d, prompt, 16)
    assert_speculated(results, min_mean_accept=1.5)


def test_seeded_sampling_equals_plain_decoding(predictive_dir: Path) -> None:
    """The sampling contract: a seed fixes the output whatever speculates, so MTP trees under
    temperature sampling give plain decoding's tokens seed for seed (lossless), and the trees
    were accepted (a draw matched a proposal) often enough for that to mean something."""
    d = predictive_dir
    params = [SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.95, seed=s,
                             ignore_eos=True) for s in (1, 2)]  # fmt: skip
    plain = Engine(d).generate(PROMPTS, params)
    spec = Engine(d, draft_model=d, draft_kind="mtp", spec=SpecParams(3, 4, 8))
    out = spec.generate(PROMPTS, params)
    assert [r.token_ids for r in out] == [r.token_ids for r in plain]
    assert_speculated(out, min_mean_accept=1.2)


def _extended(d: Path, spec: SpecParams) -> tuple[MTPDrafter, list[str]]:
    """A drafter (embedding and head read from the checkpoint) holding three requests of 20, 21
    and 22 committed tokens."""
    drafter = _drafter(d, spec)
    g = torch.Generator().manual_seed(0)
    rids = [f"r{i}" for i in range(3)]
    drafter.extend([ExtendInput(rid, list(range(4, 24 + i)), 30 + i,
                                torch.randn(20 + i, 64, generator=g), new=True)
                    for i, rid in enumerate(rids)])  # fmt: skip
    return drafter, rids


@pytest.mark.parametrize("topk", [1, 4, 8])
def test_buffer_checks_scale_with_topk_and_name_the_numbers(random_dir: Path, topk: int) -> None:
    """Invariant 5 on the MLA draft path. Eager: `DraftSizes` for 2-token contexts (buffers too
    small for these requests) stop the search before its first step, checking its deepest one,
    with the used and the available kv and mask entries. Step runners (eager-static: the CUDA-graph path's buffers, run on CPU) sized
    ``max_bs x (max_context + tree)`` kv ids and ``topk`` times that many mask entries propose
    the trees the eager path does; sized for 2-token contexts, they stop the batch with their
    own numbers."""
    spec = SpecParams(3, topk, 1 + 2 * topk)
    drafter, rids = _extended(random_dir, spec)
    roots, seq_lens_sum = [30, 31, 32], 20 + 21 + 22
    want = drafter.propose(rids, roots)
    real, small = drafter.sizes, DraftSizes(4, topk, 3, 2)
    per_req = 2 + 1 + 2 * topk  # max_context + root row + topk nodes per decode step
    cap = 4 * per_req
    drafter.sizes = small
    used = seq_lens_sum + 3 * (1 + 2 * topk)  # step 2: prefixes, root rows, 2 topk nodes each
    with pytest.raises(ValueError) as err:
        drafter.propose(rids, roots)
    assert str(err.value) == (
        f"draft decode step 2: bs=3 (max 4), topk={topk}, seq_lens_sum={seq_lens_sum} needs "
        f"{used} kv entries and {used * topk} mask entries; buffers hold {cap} and "
        f"{cap * topk} (max_context_len=2, num_steps=3)"
    )

    drafter.sizes = real
    drafter.enable_step_graphs("eager-static", max_bs=4)
    runner = drafter.step_graphs.runners[1]
    assert runner.sizes.kv_indices_capacity == 4 * (64 + 1 + 2 * topk)
    assert runner.sizes.mask_capacity == topk * runner.sizes.kv_indices_capacity
    assert runner.kv_pools[0].k.data_ptr() == drafter.cache.pools[0].k.data_ptr()
    got = drafter.propose(rids, roots)
    for a, b in zip(got, want, strict=True):
        assert a == b  # tokens and parents

    drafter.sizes = small
    drafter.enable_step_graphs("eager-static", max_bs=4)  # runners sized for 2-token contexts
    drafter.sizes = real  # the eager check passes: the runner's own check must fire
    # 3 requests' speculative regions (2 steps of topk) and 1 padding request's topk rows
    kv = seq_lens_sum + 3 * 2 * topk + topk
    with pytest.raises(ValueError) as err:
        drafter.propose(rids, roots)
    assert str(err.value) == (
        f"draft-step graph: bs=4 (max 4), tokens_per_req={topk} needs {kv} kv entries and "
        f"{kv * topk} mask entries; buffers hold {cap} and {cap * topk} (max_kv_per_req={per_req})"
    )


def test_sglang_export_of_the_nextn_layer_drafts_the_same(random_dir: Path, tmp_path: Path):
    """``--draft-model`` at SGLang's NextN export (``DeepseekV3ForCausalLMNextN``, the layer
    stored as ``model.layers.0`` with one hidden layer in its config): still the MoE block,
    the same trees as the checkpoint's own layer."""
    from specmesh.runtime.tiny_nextn import export_nextn

    exported = export_nextn(random_dir, tmp_path / "nextn")
    spec = SpecParams(3, 4, 9)
    trees = []
    for draft_dir in (random_dir, exported):
        cfg = DraftConfig("mtp", str(draft_dir), str(random_dir), spec, max_requests=4,
                          max_context=64)  # fmt: skip
        drafter = load_draft(cfg).drafter
        assert type(drafter.net.layers[0].mlp).__name__ == "MoE"
        feats = torch.randn(11, 64, generator=torch.Generator().manual_seed(0))
        drafter.extend([ExtendInput("r", PROMPTS[1], 30, feats, new=True)])
        trees.append(drafter.propose(["r"], [30])[0])
    assert list(trees[0].tokens) == list(trees[1].tokens)
    assert list(trees[0].parents) == list(trees[1].parents)


def test_flashinfer_is_refused_for_the_nextn_draft(random_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"flashinfer.*latent attention.*--attention-backend tr"):
        _drafter(random_dir, SpecParams(3, 1, 4), attention_backend="flashinfer")


def test_checkpoint_without_nextn_weights_is_refused(tiny_deepseek_dir: Path) -> None:
    """transformers writes ``num_nextn_predict_layers: 1`` into every DeepSeek-V3 config, with
    no weights: the draft says what is missing instead of a tensor-name error."""
    with pytest.raises(CheckpointError, match=r"no NextN layer model\.layers\.4\.\*"):
        _drafter(tiny_deepseek_dir, SpecParams(3, 1, 4))


def test_half_precision_keeps_routing_bias_and_rope_in_fp32(random_dir: Path) -> None:
    net = _drafter(random_dir, SpecParams(3, 1, 4), dtype="bf16").net
    gate = net.layers[0].mlp.gate
    assert gate.weight.dtype == torch.bfloat16
    assert gate.e_score_correction_bias.dtype == torch.float32
    assert net.rotary.inv_freq.dtype == torch.float32
