"""Multimodal requests on a LLaVA target with an EAGLE-3 draft: lossless against transformers,
``mm_input_embeds`` from target to draft rotated per request, placeholder ids never embedded by
the draft (invariant 1), and bad image requests failing alone with INVALID_ARGUMENT."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_accepted, assert_speculated, llava_greedy
from copy_drafts import make_copy_llava

from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import ExtendInput, PrefillInput
from specmesh.router.engine import Engine
from specmesh.router.router_config import RouterConfig
from specmesh.runtime.tiny_llava import tiny_image
from specmesh.target_service.runtime import TargetRuntime

SPEC = SpecParams(num_steps=3, topk=2, num_draft_tokens=5)
IMAGES = [tiny_image(0), tiny_image(1, (30, 17), "JPEG"), tiny_image(2, (16, 16))]
TOKENS_PER_IMAGE = 16  # (16 px / 4 px patches)², CLS dropped


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny LLaVA with a one-layer language model and an EAGLE-3 draft built to predict it
    (`copy_drafts.make_copy_llava`): rounds accept draft tokens, image rows included."""
    return make_copy_llava(tmp_path_factory.mktemp("llava"))


@pytest.fixture(scope="module")
def engine(llava: Path) -> Engine:
    return Engine(
        llava / "target", draft_model=llava / "draft", draft_kind="eagle3", spec=SPEC,
        router_config=RouterConfig(max_batch_size=4, num_micro_batches=1),
    )  # fmt: skip


def _params(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, ignore_eos=True)


# -- lossless against transformers ----------------------------------------------------------------
def test_image_request_matches_transformers(llava: Path, engine: Engine) -> None:
    prompt = "def <image> add(a, b):"
    res = engine.generate([prompt], _params(10), images=[[IMAGES[0]]])[0]
    assert res.token_ids == llava_greedy(llava / "target", prompt, [IMAGES[0]], 10)
    assert_speculated([res])
    assert_accepted([res], min_tokens=2)


def test_mixed_batch_matches_transformers(llava: Path, engine: Engine) -> None:
    """Text-only and image requests (one and two images) prefilled and verified together."""
    prompts = ["The quick <image> fox <image> jumps", "for i in range", "print(<image>)"]
    images = [IMAGES[:2], [], [IMAGES[2]]]
    results = engine.generate(prompts, _params(8), images=images)
    for prompt, imgs, res in zip(prompts, images, results, strict=True):
        assert res.token_ids == llava_greedy(llava / "target", prompt, imgs, 8), prompt
    assert_speculated(results)
    assert_accepted(results, min_tokens=3)


# -- target: expansion, merged embeddings, replay ------------------------------------------------
@pytest.fixture(scope="module")
def target(llava: Path) -> TargetRuntime:
    return TargetRuntime(TargetConfig(model_dir=str(llava / "target"), max_prefill_tokens=16))


def _ids(engine: Engine, text: str) -> list[int]:
    return engine.tokenizer.encode(text)


def test_prefill_expands_placeholders_and_returns_merged_embeds(
    target: TargetRuntime, engine: Engine
) -> None:
    """Chunked (16 tokens) mixed prefill: expanded ids reported only for the image request; every
    request has mm_input_embeds rows (image features where placeholders were, token embeddings
    elsewhere); a pre-expanded prompt runs unchanged and gives the same result, from the
    prefix cache the first left, with the same merged rows."""
    p_id = target.mm.image_token_id
    img_ids, txt_ids = _ids(engine, "def <image> add"), _ids(engine, "for i in")
    out = target.prefill(
        [PrefillInput("img", img_ids, _params(4), images=[IMAGES[0]]), PrefillInput("txt", txt_ids, _params(4))]
    )  # fmt: skip
    k = img_ids.index(p_id)
    expanded = img_ids[:k] + [p_id] * TOKENS_PER_IMAGE + img_ids[k + 1 :]
    assert out.prompt_ids == {"img": expanded}
    assert out.row_counts == {"img": len(expanded), "txt": len(txt_ids)}
    mm = out.mm_input_embeds
    assert mm.shape == (len(expanded) + len(txt_ids), target.model_config.hidden_size)
    features = target.mm.encode([_pil(IMAGES[0])])[0]
    torch.testing.assert_close(mm[k : k + TOKENS_PER_IMAGE], features)
    text_rows = torch.tensor([*expanded[:k], *expanded[k + TOKENS_PER_IMAGE :], *txt_ids])
    image_rows = torch.zeros(mm.shape[0], dtype=torch.bool)
    image_rows[k : k + TOKENS_PER_IMAGE] = True
    torch.testing.assert_close(mm[~image_rows], target.model.embed(text_rows))
    hit = target.prefixes.blocks.num_hit
    again = target.prefill([PrefillInput("pre", expanded, _params(4), images=[IMAGES[0]])])
    assert again.prompt_ids == {} and again.tokens["pre"] == out.tokens["img"]
    # its image rows came from the prefix cache ("img" left them), and so did its merged rows
    hit = target.prefixes.blocks.num_hit - hit
    assert hit == target.prefixes.blocks.block_size > k  # one block: some of it image rows
    torch.testing.assert_close(again.mm_input_embeds, mm[: len(expanded)])
    for rid in ("img", "txt", "pre"):
        target.release(rid)


def test_replay_treats_emitted_placeholder_ids_as_text(
    target: TargetRuntime, engine: Engine
) -> None:
    """A replay sends the original prompt + emitted tokens + the images again; an emitted token
    equal to image_token_id is text, not an image slot."""
    p_id = target.mm.image_token_id
    prompt = _ids(engine, "x <image> y")
    ctx = [*prompt, 7, p_id, 9]
    out = target.prefill([PrefillInput("r", ctx, _params(8), sample_offset=3, images=[IMAGES[1]])])
    assert not out.errors
    assert out.prompt_ids["r"].count(p_id) == TOKENS_PER_IMAGE + 1
    assert out.prompt_ids["r"][-3:] == [7, p_id, 9]
    target.release("r")


def _pil(data: bytes):
    from specmesh.target_service.multimodal import decode_image

    return decode_image("t", 0, data)


# -- draft: invariant 1 ----------------------------------------------------------------------------
def test_draft_never_embeds_placeholder_ids(
    llava: Path, engine: Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    net = engine.draft.drafter.net
    looked_up: list[int] = []
    embed = net.embed

    def recording_embed(ids: torch.Tensor) -> torch.Tensor:
        looked_up.extend(ids.flatten().tolist())
        return embed(ids)

    monkeypatch.setattr(net, "embed", recording_embed)
    p_id = engine.target.mm.image_token_id
    results = engine.generate(
        ["a <image> b <image>", "c <image>"], _params(6), images=[IMAGES[:2], IMAGES[2:]]
    )
    assert all(p_id not in r.token_ids for r in results)  # else the model emitted it as text
    assert looked_up, "the recorder saw no lookups: it is not on the draft's path"
    assert p_id not in looked_up, "the draft embedded an image placeholder id"


def test_draft_rotates_mm_embeds_per_request(
    llava: Path, target: TargetRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two image requests in ONE extend: each request's rows are its own embeds[1:] followed by
    the embedding of its own next token (a whole-batch rotation gets the boundary rows wrong)."""
    cfg = DraftConfig("eagle3", str(llava / "draft"), str(llava / "target"), spec=SPEC)
    drafter = load_draft(cfg, target_model=target.model).drafter
    seen: dict[str, torch.Tensor] = {}
    forward = drafter.net.forward

    def recording_forward(**kw: object):
        seen["input_embeds"] = kw["input_embeds"]
        return forward(**kw)

    monkeypatch.setattr(drafter.net, "forward", recording_forward)
    g = torch.Generator().manual_seed(0)
    h = target.model_config.hidden_size
    p_id = target.mm.image_token_id
    inputs = [
        ExtendInput(
            rid,
            [3, p_id, p_id, 5][:n],
            nxt,
            torch.randn(n, 3 * h, generator=g),
            torch.randn(n, h, generator=g),
            is_multimodal=True,
            new=True,
        )
        for rid, n, nxt in (("a", 4, 40), ("b", 3, 41))
    ]
    drafter.extend(inputs)
    expected = torch.cat(
        [torch.cat([i.mm_input_embeds[1:], target.model.embed(torch.tensor([i.next_token]))]) for i in inputs]
    )  # fmt: skip
    torch.testing.assert_close(seen["input_embeds"], expected)
    missing = ExtendInput(
        "c", [3, p_id], 42, torch.zeros(2, 3 * h), None, is_multimodal=True, new=True
    )
    with pytest.raises(InvalidRequestError, match="no mm_input_embeds"):
        drafter.extend([missing])


# -- errors ----------------------------------------------------------------------------------------
def test_bad_image_requests_fail_alone(target: TargetRuntime, engine: Engine) -> None:
    good = PrefillInput("good", _ids(engine, "a <image> b"), _params(4), images=[IMAGES[0]])
    text = PrefillInput("text", _ids(engine, "for i in"), _params(4))
    bad = [
        PrefillInput("too-few", _ids(engine, "a <image> <image>"), _params(4), images=[IMAGES[0]]),
        PrefillInput("too-many", _ids(engine, "a b"), _params(4), images=[IMAGES[0]]),
        PrefillInput("garbage", _ids(engine, "a <image>"), _params(4), images=[b"not an image"]),
        PrefillInput(
            "gif", _ids(engine, "a <image>"), _params(4), images=[tiny_image(3, fmt="GIF")]
        ),
    ]
    out = target.prefill([bad[0], good, bad[1], text, bad[2], bad[3]])
    assert set(out.errors) == {b.rid for b in bad}
    assert all(isinstance(e, InvalidRequestError) for e in out.errors.values())
    assert all(e.grpc_code == "INVALID_ARGUMENT" for e in out.errors.values())
    assert "2 image placeholder(s) ('<image>', id 320) but 1 image(s)" in str(out.errors["too-few"])
    assert "0 image placeholder(s)" in str(out.errors["too-many"])
    assert "not a decodable PNG or JPEG" in str(out.errors["garbage"])
    assert "image 0" in str(out.errors["gif"])
    assert set(out.tokens) == {"good", "text"}
    alone = target.prefill([PrefillInput("good2", good.input_ids, _params(4), images=[IMAGES[0]])])
    assert out.tokens["good"] == alone.tokens["good2"]
    for rid in ("good", "text", "good2"):
        target.release(rid)


def test_image_on_text_only_target_is_invalid_argument(tiny_dir: Path) -> None:
    runtime = TargetRuntime(TargetConfig(model_dir=str(tiny_dir / "target")))
    out = runtime.prefill(
        [PrefillInput("img", [5, 6, 7], _params(4), images=[IMAGES[0]]), PrefillInput("txt", [5, 6, 7], _params(4))]
    )  # fmt: skip
    assert set(out.errors) == {"img"} and set(out.tokens) == {"txt"}
    assert isinstance(out.errors["img"], InvalidRequestError)
    assert "text-only target" in str(out.errors["img"])


def test_engine_surfaces_image_errors(engine: Engine) -> None:
    with pytest.raises(InvalidRequestError, match="placeholder"):
        engine.generate(["no placeholder here"], _params(3), images=[[IMAGES[0]]])


# -- checkpoint layouts ----------------------------------------------------------------------------
LAYOUTS = {  # how other transformers versions name the tensors save_pretrained wrote here
    "prefixed": {"language_model.model.": "model.language_model.", "language_model.lm_head.": "lm_head.",
                 "vision_tower.": "model.vision_tower.", "multi_modal_projector.": "model.multi_modal_projector."},
    "hub-v4": {"vision_tower.": "vision_tower.vision_model."},
}  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llava_tensor_layouts_load_the_same_model(
    llava: Path, target: TargetRuntime, engine: Engine, tmp_path: Path, layout: str
) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    from specmesh.runtime.llava_checkpoint import language_model_tensors, target_model_config

    src = llava / "target"
    shutil.copytree(src, tmp_path / "ckpt")
    renames = LAYOUTS[layout]
    tensors = load_file(src / "model.safetensors")
    renamed = {
        next((new + k[len(old) :] for old, new in renames.items() if k.startswith(old)), k): v
        for k, v in tensors.items()
    }
    save_file(renamed, tmp_path / "ckpt" / "model.safetensors")
    other = TargetRuntime(TargetConfig(model_dir=str(tmp_path / "ckpt")))
    ids = _ids(engine, "a <image> b")
    want = target.prefill([PrefillInput("w", ids, _params(2), images=[IMAGES[0]])])
    got = other.prefill([PrefillInput("g", ids, _params(2), images=[IMAGES[0]])])
    target.release("w")
    assert got.tokens["g"] == want.tokens["w"]
    torch.testing.assert_close(got.mm_input_embeds, want.mm_input_embeds)
    assert target_model_config(tmp_path / "ckpt") == target.model_config
    embed = language_model_tensors(tmp_path / "ckpt", ["model.embed_tokens.weight"])
    torch.testing.assert_close(embed["model.embed_tokens.weight"], target.model.embed_tokens.weight)


# -- prefix caching keyed by the images ------------------------------------------------------------
def test_image_prompts_reuse_cached_prefixes_keyed_by_their_images(llava: Path) -> None:
    """A prompt's image rows are cached under its image's bytes: the same image at the same
    place hits (past the image), another image there matches only the text before it; every
    output equals transformers', with the EAGLE-3 draft on."""
    engine = Engine(
        llava / "target", draft_model=llava / "draft", draft_kind="eagle3", spec=SPEC,
        target_config={"prefix_block_size": 4},
    )  # fmt: skip
    head = "def f(a, b): return a + b # the <image> shows"
    asks = [
        (head + " x = 1", IMAGES[0]),
        (head + " y = 2", IMAGES[0]),
        (head + " x = 1", IMAGES[1]),
    ]
    blocks, results, hits = engine.target.prefixes.blocks, [], []
    for prompt, img in asks:
        before = blocks.num_hit
        results.append(engine.generate([prompt], _params(6), images=[[img]])[0])
        hits.append(blocks.num_hit - before)  # prompt tokens the cache served
    for (prompt, img), res in zip(asks, results, strict=True):
        assert res.token_ids == llava_greedy(llava / "target", prompt, [img], 6), prompt
    assert_speculated(results)
    ids = engine.tokenizer.encode(head)
    before_image = ids.index(engine.target.mm.image_token_id)
    assert hits[0] == 0
    assert hits[1] >= before_image + TOKENS_PER_IMAGE  # past the image
    assert 0 < hits[2] <= before_image  # the text before the other image
