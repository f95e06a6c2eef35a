"""LLaVA-style targets (`LlavaForConditionalGeneration`, llava-hf layout): the language model on
specmesh's own runtime and KV cache, the vision tower and projector from transformers.

    image bytes ─► processor (the checkpoint's own files, PIL backend) ─► pixel_values [1, 3, H, W]
                   (image by image: only one decoded full-size image is held at a time)
    pixel_values ─► vision tower ─► hidden_states[vision_feature_layer] (drop CLS if "default")
                 ─► multi-modal projector ─► features [n, tokens_per_image, H]

Tensor names differ by the transformers version that wrote the checkpoint; all of them load
(`specmesh.runtime.llava_checkpoint` maps them, and reads the text config).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from specmesh.protocol.errors import SpecmeshError
from specmesh.runtime.config import (
    CheckpointError,
    ModelConfig,
    read_config_json,
)
from specmesh.runtime.llava_checkpoint import split_llava_tensors, text_model_config
from specmesh.runtime.loader import assign_parameters, load_tensors
from specmesh.runtime.models.causal_lm import CausalLM, causal_lm_class


class ImageEncoder(nn.Module):
    """Vision tower + projector + the checkpoint's processor: images → placeholder features."""

    def __init__(self, hf_config: Any, processor: Any) -> None:
        from transformers import AutoModel
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        super().__init__()
        self.vision_tower = AutoModel.from_config(hf_config.vision_config)
        self.multi_modal_projector = LlavaMultiModalProjector(hf_config)
        self.processor = processor
        token_id = getattr(hf_config, "image_token_id", None)
        self.image_token_id = int(token_id if token_id is not None else hf_config.image_token_index)
        self.image_token = getattr(processor, "image_token", "<image>")
        self.feature_layer = hf_config.vision_feature_layer  # int or list of ints
        self.select_strategy = hf_config.vision_feature_select_strategy
        self.tokens_per_image = self._tokens_per_image()

    def _tokens_per_image(self) -> int:
        """Placeholders per image, as the checkpoint's processor expands them."""
        p, vision = self.processor, self.vision_tower.config
        patch = p.patch_size or vision.patch_size
        n = (vision.image_size // patch) ** 2 + (p.num_additional_image_tokens or 0)
        return n - 1 if self.select_strategy == "default" else n

    def pixel_values(self, image: Any) -> torch.Tensor:
        """One PIL image → its ``[1, 3, H, W]`` pixel values (the checkpoint's processor, which
        treats each image alone): the full-size decoded image can be dropped at once."""
        return self.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]

    def encode(self, images: list[Any]) -> torch.Tensor:
        """PIL images → ``[n, tokens_per_image, hidden]`` features in the model's dtype."""
        return self.encode_pixels(torch.cat([self.pixel_values(img) for img in images]))

    @torch.inference_mode()
    def encode_pixels(self, pixels: torch.Tensor) -> torch.Tensor:
        """``[n, 3, H, W]`` pixel values → ``[n, tokens_per_image, hidden]`` features."""
        weight = self.multi_modal_projector.linear_1.weight
        out = self.vision_tower(pixels.to(weight.device, weight.dtype), output_hidden_states=True)
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        states = [out.hidden_states[i] for i in layers]
        if self.select_strategy == "default":
            states = [s[:, 1:] for s in states]  # drop the CLS position
        features = self.multi_modal_projector(torch.cat(states, -1))  # [n, tokens, H]
        if features.shape[1] != self.tokens_per_image:
            raise SpecmeshError(
                f"the vision tower yields {features.shape[1]} features per image but the "
                f"checkpoint's processor expands {self.tokens_per_image} placeholders"
            )
        return features


def load_llava(
    model_dir: str | Path, *, dtype: torch.dtype | None = None, device: str = "cpu"
) -> tuple[CausalLM, ImageEncoder]:
    """The language model (specmesh runtime) and the image encoder of a LLaVA checkpoint."""
    from transformers import AutoConfig, AutoProcessor

    raw = read_config_json(model_dir)
    cfg = text_model_config(raw, model_dir)
    if dtype is not None:
        cfg = replace(cfg, dtype=dtype)
    parts = split_llava_tensors(load_tensors(model_dir))
    lm = _language_model(cfg, parts["lm"], device, what=f"{model_dir} (language model)")
    try:  # PIL backend: deterministic, and no torchvision needed
        processor = AutoProcessor.from_pretrained(
            str(model_dir), local_files_only=True, backend="pil"
        )
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{model_dir}: cannot load the image processor: {e}") from e
    encoder = ImageEncoder(
        AutoConfig.from_pretrained(str(model_dir), local_files_only=True), processor
    )
    vision = parts["vision"]
    if not any(k.startswith("vision_model.") for k in encoder.vision_tower.state_dict()):
        vision = {k.removeprefix("vision_model."): v for k, v in vision.items()}
    assign_parameters(encoder.vision_tower, vision, what=f"{model_dir} (vision tower)")
    assign_parameters(
        encoder.multi_modal_projector, parts["projector"], what=f"{model_dir} (projector)"
    )
    encoder = encoder.to(device=device, dtype=cfg.dtype).requires_grad_(False).eval()
    return lm, encoder


def _language_model(
    cfg: ModelConfig, tensors: dict[str, torch.Tensor], device: str, *, what: str
) -> CausalLM:
    with torch.device("meta"):
        model = causal_lm_class(cfg)(cfg)  # the Llama family, or DeepSeek-V3 (MLA + MoE)
    model = model.to_empty(device=device).to(cfg.dtype)
    model.reset_fp32_buffers(device)
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    assign_parameters(model, tensors, what=what)
    return model.requires_grad_(False).eval()
