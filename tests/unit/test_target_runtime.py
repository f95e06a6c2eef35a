"""Target runtime against transformers: logits, verify, chunked extend, aux states, KV limits,
checkpoint errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import reorder_tolerance
from transformers import AutoModelForCausalLM

from specmesh.protocol.config import TargetConfig
from specmesh.protocol.errors import InvalidRequestError, KVCacheFullError, UnknownRequestError
from specmesh.protocol.features import Feature, FeatureSpec
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput, VerifyInput
from specmesh.protocol.trees import DraftTree
from specmesh.runtime.config import CheckpointError
from specmesh.runtime.models.causal_lm import AuxLayers, load_causal_lm
from specmesh.runtime.tiny import make_tiny_target
from specmesh.target_service.runtime import TargetRuntime
from specmesh.target_service.verify import Tree

LLAMA3_ROPE = {
    "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}  # fmt: skip
VARIANTS = {
    "llama-llama3-rope": {"arch": "llama", "rope_scaling": LLAMA3_ROPE},
    "llama-linear-rope-tied": {
        "arch": "llama",
        "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "tie_word_embeddings": True,
    },
    "llama-mha": {"arch": "llama", "num_key_value_heads": 4},
    "qwen2": {"arch": "qwen2"},
    "qwen3": {"arch": "qwen3"},
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_target(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])


def _runtime(model_dir: Path, **kw: object) -> TargetRuntime:
    return TargetRuntime(
        TargetConfig(model_dir=str(model_dir), num_kv_slots=kw.pop("num_kv_slots", 4096), **kw)
    )


def _hf_logits(model_dir: Path, ids: list[int], output_hidden_states: bool = False):
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids]), output_hidden_states=output_hidden_states)


def test_prefill_and_decode_logits_match_transformers(variant: Path) -> None:
    rt = _runtime(variant)
    prompts = [[5, 9, 17, 33, 4, 8, 100, 7], [12, 13], [250]]
    rt.prefill([PrefillInput(f"r{i}", p, SamplingParams()) for i, p in enumerate(prompts)])
    for i, p in enumerate(prompts):
        ref = _hf_logits(variant, p).logits[0, -1]
        assert rt.requests[f"r{i}"].pending == int(ref.argmax())
    # one decode step for the whole batch; the runtime's logits at the pending token
    hidden = _forward_tree(rt, [Tree.chain([rt.requests[f"r{i}"].pending]) for i in range(3)])
    for i, p in enumerate(prompts):
        ref = _hf_logits(variant, [*p, rt.requests[f"r{i}"].pending]).logits[0, -1]
        mine = rt.model.compute_logits(hidden[i][-1:])[0]
        torch.testing.assert_close(mine, ref, atol=2e-5, rtol=1e-4)


def _forward_tree(rt: TargetRuntime, trees: list[Tree]) -> list[torch.Tensor]:
    """Run the verify forward and return each tree's final hidden rows (no acceptance)."""
    from specmesh.runtime.model_runner import BatchItem, run_batch

    items = []
    for i, tree in enumerate(trees):
        base = rt.cache.get(f"r{i}").committed_len
        mask = torch.cat([torch.ones(tree.num_nodes, base, dtype=torch.bool), tree.mask], 1)
        items.append(BatchItem(f"r{i}", tree.tokens, base, base + tree.depths, mask))
    out = run_batch(rt.model, rt.cache, rt.backend, items)
    return list(out.hidden.split([t.num_nodes for t in trees]))


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_verify_logits_equal_sequential_decoding_along_each_path(
    tiny_dir: Path, shape: str
) -> None:
    target = tiny_dir / "target"
    rt = _runtime(target)
    prompt = [7, 8, 9, 10, 11]
    rt.prefill([PrefillInput("r0", prompt, SamplingParams())])
    root = rt.requests["r0"].pending
    if shape == "chain":
        tree = Tree.chain([root, 40, 41, 42])
    else:  # root -> {40 -> {50, 51 -> 60}, 41 -> 52}
        tree = Tree.from_parents([root, 40, 41, 50, 51, 52, 60], [-1, 0, 0, 1, 1, 2, 4])
    hidden = _forward_tree(rt, [tree])[0]
    logits = rt.model.compute_logits(hidden)
    for node in range(tree.num_nodes):
        path, n = [], node
        while n >= 0:
            path.append(int(tree.tokens[n]))
            n = int(tree.parents[n])
        ref = _hf_logits(target, prompt + path[::-1]).logits[0, -1]
        torch.testing.assert_close(logits[node], ref, atol=2e-5, rtol=1e-4)


def test_verify_keeps_accepted_path_kv_by_length(tiny_dir: Path, oracle) -> None:
    """Accept a branch that is not the first: later decoding still matches transformers."""
    target = tiny_dir / "target"
    prompt = [3, 4, 5, 6]
    ref = oracle(target, prompt, 6)
    rt = _runtime(target)
    rt.prefill([PrefillInput("r0", prompt, SamplingParams())])
    wrong = (ref[1] + 1) % 300
    tree = DraftTree.of([ref[0], wrong, ref[1], ref[2], 7], [-1, 0, 0, 2, 1])
    out = rt.verify([VerifyInput("r0", tree)])
    assert out.tokens["r0"] == ref[1:4]
    assert rt.cache.get("r0").committed_len == len(prompt) + 3
    out = rt.decode(["r0"])
    assert out.tokens["r0"] == [ref[4]]


def test_verify_answers_the_feature_rows_of_each_accepted_path(tiny_dir: Path, oracle) -> None:
    """The rows a verify answers (what the draft extends over) are the accepted nodes' own, in
    request order: against transformers' hidden states of prompt + path, for a batch whose
    first request accepts a branch that is not the first."""
    target, ids = tiny_dir / "target", (2, 3, 1)
    rt = TargetRuntime(
        TargetConfig(str(target), num_kv_slots=512, aux_layer_ids=ids, aux_convention="input")
    )
    rt.configure(FeatureSpec(Feature.AUX_HIDDEN))
    prompts = {"r0": [3, 4, 5, 6], "r1": [9, 8, 7]}
    refs = {rid: oracle(target, p, 4) for rid, p in prompts.items()}
    params = SamplingParams()
    rt.prefill([PrefillInput(rid, p, params) for rid, p in prompts.items()], Feature.AUX_HIDDEN)
    r0, r1 = refs["r0"], refs["r1"]
    wrong = (r0[1] + 1) % 300
    trees = [
        VerifyInput("r0", DraftTree.of([r0[0], wrong, r0[1], r0[2]], [-1, 0, 0, 2])),
        VerifyInput("r1", DraftTree.chain([r1[0], r1[1]])),
    ]
    out = rt.verify(trees, Feature.AUX_HIDDEN)
    assert out.tokens == {"r0": r0[1:4], "r1": r1[1:3]}
    expected = []
    for rid, accepted in (("r0", 3), ("r1", 2)):
        seq = prompts[rid] + refs[rid][:accepted]
        hs = _hf_logits(target, seq, output_hidden_states=True).hidden_states
        expected.append(torch.cat([hs[i][0] for i in ids], -1)[len(prompts[rid]) :])
    torch.testing.assert_close(
        out.features, torch.cat(expected), **reorder_tolerance(torch.float32)
    )


def test_chunked_prefill_on_cached_prefix_equals_full_prefill(tiny_dir: Path) -> None:
    target = tiny_dir / "target"
    prompt = list(range(20, 57))
    full = _runtime(target)
    aux = Feature.AUX_HIDDEN
    full.configure(FeatureSpec(aux))
    a = full.prefill([PrefillInput("r0", prompt, SamplingParams())], aux)
    chunked = _runtime(target, max_prefill_tokens=5)
    chunked.configure(FeatureSpec(aux))
    b = chunked.prefill([PrefillInput("r0", prompt, SamplingParams())], aux)
    assert a.tokens == b.tokens
    torch.testing.assert_close(a.features, b.features, **reorder_tolerance(torch.float32))


@pytest.mark.parametrize("convention", ["input", "output"])
def test_aux_hidden_states_are_the_named_layers(tiny_dir: Path, convention: str) -> None:
    target = tiny_dir / "target"
    prompt = [11, 12, 13, 14, 15]
    ids = (2, 3, 1)
    rt = TargetRuntime(
        TargetConfig(str(target), num_kv_slots=512, aux_layer_ids=ids, aux_convention=convention)
    )
    rt.configure(FeatureSpec(Feature.AUX_HIDDEN))
    out = rt.prefill([PrefillInput("r0", prompt, SamplingParams())], Feature.AUX_HIDDEN)
    hs = _hf_logits(target, prompt, output_hidden_states=True).hidden_states
    shift = 0 if convention == "input" else 1
    ref = torch.cat([hs[i + shift][0] for i in ids], -1)  # hidden_states[i] = input of layer i
    torch.testing.assert_close(out.features, ref, atol=2e-5, rtol=1e-4)
    assert out.features.shape == (len(prompt), 3 * rt.model_config.hidden_size)
    assert AuxLayers.default(32).layer_ids == (2, 16, 29)


def test_full_kv_cache_is_a_specific_error_and_leaves_others_intact(tiny_dir: Path, oracle) -> None:
    target = tiny_dir / "target"
    rt = _runtime(target, num_kv_slots=16)
    rt.prefill([PrefillInput("small", [1, 2, 3], SamplingParams())])
    out = rt.prefill([PrefillInput("big", list(range(3, 16)), SamplingParams())])
    assert isinstance(out.errors["big"], KVCacheFullError)  # it would fit alone: it may wait
    out = rt.prefill([PrefillInput("huge", list(range(3, 20)), SamplingParams())])
    assert isinstance(out.errors["huge"], InvalidRequestError)  # more than the whole cache
    assert "big" not in rt.cache.requests and "huge" not in rt.cache.requests
    assert rt.decode(["small"]).tokens["small"] == oracle(target, [1, 2, 3], 2)[1:]
    assert rt.release("nope") is False  # releasing is idempotent
    assert isinstance(rt.decode(["nope"]).errors["nope"], UnknownRequestError)


def test_seeded_sampling_is_independent_of_batch(tiny_dir: Path) -> None:
    target = tiny_dir / "target"
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=50, seed=1234)

    def run(batch: list[str]) -> list[int]:
        rt = _runtime(target)
        rt.prefill(
            [
                PrefillInput(
                    r,
                    [5, 6, 7] if r == "me" else [9, 9],
                    params if r == "me" else SamplingParams(temperature=1.0, seed=5),
                )
                for r in batch
            ]
        )
        toks = [rt.requests["me"].pending]
        for _ in range(1, 6):
            toks += rt.decode(batch).tokens["me"]
        return toks

    assert run(["me"]) == run(["other", "me"])


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_bad_checkpoints_give_clear_errors(tiny_dir: Path, tmp_path: Path) -> None:
    target = tiny_dir / "target"
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_causal_lm(tmp_path)
    arch = _copy(target, tmp_path / "arch")
    cfg = json.loads((arch / "config.json").read_text())
    (arch / "config.json").write_text(json.dumps({**cfg, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(CheckpointError, match="unsupported architecture 'GPT2LMHeadModel'"):
        load_causal_lm(arch)
    missing = _copy(target, tmp_path / "missing")
    from safetensors.torch import load_file, save_file

    tensors = load_file(missing / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, missing / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_causal_lm(missing)
    pickle = _copy(target, tmp_path / "pickle")
    (pickle / "model.safetensors").rename(pickle / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="only pickle weights"):
        load_causal_lm(pickle)


def test_sharded_checkpoint_and_bf16(tmp_path: Path) -> None:
    hf = AutoModelForCausalLM.from_pretrained(
        make_tiny_target(tmp_path / "one"), dtype=torch.float32
    )
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    model = load_causal_lm(tmp_path / "sharded")
    ref = load_causal_lm(tmp_path / "one")
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert (
        load_causal_lm(tmp_path / "one", dtype=torch.bfloat16).head_weight.dtype == torch.bfloat16
    )


def test_max_context_comes_from_the_model_config(tiny_dir: Path, caplog) -> None:
    target = tiny_dir / "target"
    assert TargetRuntime.from_dir(target, num_kv_slots=64).cfg.max_context == 1024
    with caplog.at_level("WARNING"):
        longer = TargetRuntime.from_dir(target, num_kv_slots=64, max_context=2048)
    assert longer.cfg.max_context == 2048
    assert "exceeds the model's max_position_embeddings 1024" in caplog.text
