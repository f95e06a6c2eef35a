"""The benchmark's synthetic Llama-3.1-8B-shaped pair (`bench.synthetic`), built here at small
widths: a real HF checkpoint that transformers loads and greedy-decodes as the engine does, and
an EAGLE-3 head whose every draft token is accepted (forced acceptance)."""

from __future__ import annotations

import pytest
import torch

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine


def test_checkpoint_has_llama_8b_layout_and_repeats_the_last_token(synthetic_pair) -> None:
    from transformers import AutoModelForCausalLM

    from specmesh.runtime.config import load_model_config

    target, _ = synthetic_pair
    rope = load_model_config(target).rope
    assert (rope.kind, rope.theta, rope.factor) == ("llama3", 500000.0, 8.0)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    prompt = [5, 9, 17, 33]
    out = model.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)
    assert out[0, len(prompt) :].tolist() == [33] * 6


@pytest.mark.parametrize("spec", [SpecParams(5, 1, 6), SpecParams(5, 4, 8)])
def test_every_draft_token_is_accepted(synthetic_pair, spec: SpecParams) -> None:
    target, draft = synthetic_pair
    engine = Engine(
        target, draft_model=draft, draft_kind="eagle3", spec=spec,
        target_config={"dtype": "fp32"}, draft_config={"dtype": "fp32"},
    )  # fmt: skip
    (res,) = engine.generate([[5, 9, 17, 33]], SamplingParams(max_new_tokens=25, ignore_eos=True))
    assert res.token_ids == [33] * 25
    # Every round after prefill emits num_steps + 1 tokens: all drafted, plus the bonus token.
    assert res.accept_lens[:-1] == [spec.num_steps + 1] * (len(res.accept_lens) - 1)


TINY_V3 = {  # every V3 width shrunk; the structure kept (dense first, MoE, MLA, YaRN)
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
    "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
    "v_head_dim": 16, "max_position_embeddings": 1024,
}  # fmt: skip


def test_the_v3_slice_is_a_checkpoint_transformers_and_the_mtp_draft_read(tmp_path, oracle) -> None:
    """`bench.synthetic_deepseek` at tiny widths: transformers loads the target and greedy-
    decodes as the engine does, plain and with the NextN layer as the MTP draft in top-4
    trees; the roofline counts the latent cache and only the experts a batch is expected to
    read."""
    from specmesh.bench.roofline import step_bytes, unread_expert_bytes
    from specmesh.bench.synthetic_deepseek import make_v3_slice
    from specmesh.runtime.models.moe import MoE

    target = make_v3_slice(tmp_path / "v3", **TINY_V3)
    prompt = [5, 9, 17, 33, 2, 71]
    want = oracle(target, prompt, 8)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    engine = Engine(target, draft_model=target, draft_kind="mtp", spec=SpecParams(3, 4, 6),
                    target_config={"dtype": "fp32"}, draft_config={"dtype": "fp32"})  # fmt: skip
    for plain in (True, False):
        (res,) = engine.generate([prompt], params, disable_speculation=plain)
        assert res.token_ids == want
    rt = engine.target
    (moe,) = [m for m in rt.model.modules() if isinstance(m, MoE)]  # layer 1 (layer 0 dense)
    experts = sum(p.numel() * 4 for p in moe.experts.parameters())
    assert unread_expert_bytes(moe, 1) == int(experts * 12 / 16)  # 4 of 16 read
    assert 0 < unread_expert_bytes(moe, 8) < unread_expert_bytes(moe, 1)
    latent = 2 * (32 + 8) * 4  # two layers' (kv_lora + rope) fp32 a token
    assert step_bytes(rt, 1, 100) - step_bytes(rt, 1, 0) == 100 * latent
