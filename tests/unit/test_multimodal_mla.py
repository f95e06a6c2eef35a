"""A LLaVA whose language model is DeepSeek-V3 (MLA + MoE), built with transformers: image
prompts give transformers' greedy tokens, plain and with a NextN (MTP) draft that receives the
target's merged ``mm_input_embeds`` and never embeds an image placeholder id itself (invariant
1, seed 000: the MTP draft of a multimodal DeepSeek-class target)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_accepted, llava_greedy
from copy_drafts import make_copy_mla_llava

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.runtime.tiny_llava import tiny_image

IMAGES = [tiny_image(0), tiny_image(1, (30, 17), "JPEG")]
PROMPTS = ["def <image> add(a, b):", "print(<image>, <image>)"]


@pytest.fixture(scope="module")
def mla_llava(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The LLaVA-DeepSeek target (a one-layer language model), and a NextN layer for it in
    SGLang's export layout that copies that layer, so its drafts are accepted
    (`copy_drafts.make_copy_mla_llava`; transformers' LLaVA writes no NextN layer)."""
    root = make_copy_mla_llava(tmp_path_factory.mktemp("mla_llava"))
    return {"target": root / "target", "nextn": root / "nextn"}


def test_plain_and_mtp_image_requests_match_transformers(
    mla_llava: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    target, params = mla_llava["target"], SamplingParams(max_new_tokens=8, ignore_eos=True)
    images = [IMAGES[:1], IMAGES]
    expected = [llava_greedy(target, p, imgs, 8) for p, imgs in zip(PROMPTS, images, strict=True)]
    plain = Engine(target)
    assert [r.token_ids for r in plain.generate(PROMPTS, params, images=images)] == expected
    mtp = Engine(target, draft_model=mla_llava["nextn"], draft_kind="mtp", spec=SpecParams(2, 2, 4))
    net, looked_up = mtp.draft.drafter.net, []
    embed = net.embed

    def recording_embed(ids: torch.Tensor) -> torch.Tensor:
        looked_up.extend(ids.flatten().tolist())
        return embed(ids)

    monkeypatch.setattr(net, "embed", recording_embed)
    results = mtp.generate(PROMPTS, params, images=images)
    assert [r.token_ids for r in results] == expected
    assert all(r.accept_lens for r in results)  # the draft's trees were verified each round
    assert_accepted(results, min_tokens=2)  # over image rows too: accepted paths' latent KV
    p_id = mtp.target.mm.image_token_id
    assert looked_up and p_id not in looked_up  # image rows came from the target's embeds
    assert mtp.target.num_requests == 0 and mtp.draft.kv_slots()[0] == 0
