"""A tiny random LLaVA (CLIP vision tower + Llama text model) with its processor, and a matching
EAGLE-3 draft over the language model: seconds on CPU, no download.

The checkpoint is what transformers' ``save_pretrained`` writes for
``LlavaForConditionalGeneration``; the processor is a ``LlavaProcessor`` over the PIL CLIP image
processor (no torchvision) and `specmesh.runtime.tiny.build_tokenizer` plus an ``<image>`` token.
"""

from __future__ import annotations

import io
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from specmesh.runtime.tiny import TINY_DEEPSEEK_DIMS, TINY_DIMS, build_tokenizer, make_tiny_eagle3

IMAGE_TOKEN = "<image>"


def make_tiny_llava(
    out_dir: str | Path,
    *,
    seed: int = 0,
    image_size: int = 16,
    patch_size: int = 4,
    select_strategy: str = "default",
    feature_layer: int | list[int] = -2,
    text: str = "llama",
    **text_overrides: object,
) -> Path:
    """Write a random ``LlavaForConditionalGeneration`` plus processor files. With the defaults an
    image becomes (16 / 4)² = 16 placeholder tokens (CLS dropped by the "default" strategy).
    ``text``: the language model, ``"llama"`` or ``"deepseek"`` (DeepSeek-V3: MLA + MoE, the
    tiny dims of `runtime.tiny.make_tiny_deepseek`); ``text_overrides`` replace its dims."""
    import transformers
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = build_tokenizer(TINY_DIMS["vocab_size"])
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    image_token_id = tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)
    vision = transformers.CLIPVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        image_size=image_size, patch_size=patch_size, projection_dim=32,
    )  # fmt: skip
    text_cls, dims = {
        "llama": (transformers.LlamaConfig, TINY_DIMS),
        "deepseek": (transformers.DeepseekV3Config, TINY_DEEPSEEK_DIMS),
    }[text]
    text_config = text_cls(
        **{**dims, **text_overrides, "vocab_size": len(tokenizer)},
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.1,
    )
    config = transformers.LlavaConfig(
        vision_config=vision,
        text_config=text_config,
        image_token_id=image_token_id,
        vision_feature_layer=feature_layer,
        vision_feature_select_strategy=select_strategy,
    )
    torch.manual_seed(seed)
    out = Path(out_dir)
    transformers.LlavaForConditionalGeneration(config).save_pretrained(out)
    image_processor = CLIPImageProcessorPil(
        size={"shortest_edge": image_size}, crop_size={"height": image_size, "width": image_size}
    )
    transformers.LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy=select_strategy,
        num_additional_image_tokens=1,  # CLIP's CLS position
        image_token=IMAGE_TOKEN,
    ).save_pretrained(out)
    return out


def make_tiny_llava_eagle3(
    out_dir: str | Path,
    llava_dir: str | Path,
    *,
    seed: int = 0,
    aux_layer_ids: Sequence[int] | None = None,
) -> Path:
    """A random EAGLE-3 draft over the LLaVA's language model (its ``text_config`` dims);
    ``aux_layer_ids`` as in `make_tiny_eagle3`."""
    from specmesh.runtime.llava_checkpoint import text_model_config

    raw = json.loads((Path(llava_dir) / "config.json").read_text())
    text = dict(raw["text_config"])
    text["architectures"] = [text_model_config(raw, llava_dir).architecture]
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(text))
        return make_tiny_eagle3(out_dir, tmp, seed=seed, aux_layer_ids=aux_layer_ids)


def tiny_image(seed: int, size: tuple[int, int] = (20, 24), fmt: str = "PNG") -> bytes:
    """Random RGB image bytes (PNG or JPEG) of ``size`` (height, width)."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (*size, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format=fmt)
    return buf.getvalue()
