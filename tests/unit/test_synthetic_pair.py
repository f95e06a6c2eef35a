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
