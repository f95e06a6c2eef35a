"""Multimodal prefill: encoded images → expanded prompt ids + merged input embeddings.

A prompt carries one placeholder (the processor's ``<image>`` token, ``image_token_id``) per
image, in image order. The target expands each to ``tokens_per_image`` placeholders, as the
checkpoint's processor does, and scatters that image's projected features into those rows:

    prompt ids     [ t0   <image>           t2   ]      images [img0]
    expanded ids   [ t0   P    P    P    P  t2   ]      P = image_token_id, tokens_per_image = 4
    input_embeds   [ E(t0) f0  f1   f2   f3 E(t2) ]     [T, H]; returned as mm_input_embeds

A prompt that is already expanded (tokens_per_image placeholders per image) is run as it is.
Only the prompt part is scanned: on a replay (``sample_offset > 0``) the emitted tokens after the
prompt are text even if one equals image_token_id.

Replay after a failover: the router keeps the ORIGINAL prompt (one placeholder per image) and
re-sends the images with it; expansion is deterministic, so any replica rebuilds the same rows.
When one request of a batch has images, every request gets ``input_embeds`` (text-only ones their
token embeddings), so ``mm_input_embeds`` covers the whole batch and splits by row counts.
"""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from specmesh.runtime.errors import InvalidRequestError, SpecmeshError

if TYPE_CHECKING:
    from specmesh.target_service.llava import ImageEncoder
    from specmesh.target_service.steps import PrefillInput

IMAGE_FORMATS = ("PNG", "JPEG")


@dataclass
class MergedBatch:
    inputs: list[PrefillInput]  # ready to run; input_embeds set on all when any has images
    prompt_ids: dict[str, list[int]] = field(default_factory=dict)  # only where expanded
    errors: dict[str, SpecmeshError] = field(default_factory=dict)


def decode_image(rid: str, index: int, data: bytes) -> Any:
    """Encoded PNG / JPEG bytes → an RGB PIL image, or `InvalidRequestError` naming the image."""
    from PIL import Image

    try:
        with Image.open(io.BytesIO(data), formats=IMAGE_FORMATS) as img:
            return img.convert("RGB")
    except Exception as e:  # PIL raises many types for corrupt data; all are the client's fault
        raise InvalidRequestError(
            f"request {rid!r}: image {index} ({len(data)} bytes) is not a decodable PNG or "
            f"JPEG ({type(e).__name__}: {e})"
        ) from e


def merge_images(
    inputs: list[PrefillInput],
    encoder: ImageEncoder | None,
    embed: Callable[[torch.Tensor], torch.Tensor],
    model_name: str = "",
) -> MergedBatch:
    """Validate every request's images, encode all images of the batch in one vision forward and
    build each request's expanded ids and ``input_embeds``. Bad requests land in ``errors``; the
    others are unaffected."""
    if encoder is None:
        bad = {
            i.rid: InvalidRequestError(
                f"request {i.rid!r}: {len(i.images)} image(s) sent to the text-only target "
                f"{model_name!r}; images need a multimodal (LLaVA) target"
            )
            for i in inputs
            if i.images
        }
        return MergedBatch([i for i in inputs if i.rid not in bad], errors=bad)
    out = MergedBatch([])
    decoded: dict[str, list[Any]] = {}
    for inp in inputs:
        try:
            decoded[inp.rid] = _check_request(inp, encoder)
        except InvalidRequestError as e:
            out.errors[inp.rid] = e
    ok = [i for i in inputs if i.rid in decoded]
    if not any(decoded[i.rid] for i in ok):
        out.inputs = ok
        return out
    with torch.inference_mode():
        features = encoder.encode([img for i in ok for img in decoded[i.rid]])  # [n, N, H]
        start = 0
        for inp in ok:
            n = len(decoded[inp.rid])
            merged = _merge_one(inp, features[start : start + n], encoder.image_token_id, embed)
            start += n
            if len(merged.input_ids) != len(inp.input_ids):
                out.prompt_ids[inp.rid] = merged.input_ids
            out.inputs.append(merged)
    return out


def _check_request(inp: PrefillInput, encoder: ImageEncoder) -> list[Any]:
    prompt = inp.input_ids[: len(inp.input_ids) - inp.sample_offset]
    count = sum(t == encoder.image_token_id for t in prompt)
    n = len(inp.images)
    if count not in (n, n * encoder.tokens_per_image):
        token = encoder.image_token
        raise InvalidRequestError(
            f"request {inp.rid!r}: the prompt has {count} image placeholder(s) ({token!r}, id "
            f"{encoder.image_token_id}) but {n} image(s) were sent; put one {token!r} per image "
            f"in the prompt"
        )
    return [decode_image(inp.rid, k, data) for k, data in enumerate(inp.images)]


def _merge_one(
    inp: PrefillInput,
    features: torch.Tensor,  # [num_images, tokens_per_image, hidden]
    image_token_id: int,
    embed: Callable[[torch.Tensor], torch.Tensor],
) -> PrefillInput:
    ids = torch.tensor(inp.input_ids, dtype=torch.int64, device=features.device)
    is_image = ids == image_token_id
    is_image[len(ids) - inp.sample_offset :] = False  # emitted tokens are text
    num_images, per_image, hidden = features.shape
    if num_images and int(is_image.sum()) == num_images:  # one placeholder per image: expand
        reps = torch.where(is_image, per_image, 1)
        ids, is_image = ids.repeat_interleave(reps), is_image.repeat_interleave(reps)
    embeds = embed(torch.where(is_image, 0, ids)).clone()  # [T, hidden]; image rows replaced
    embeds[is_image] = features.reshape(-1, hidden).to(embeds.dtype)
    return replace(inp, input_ids=ids.tolist(), input_embeds=embeds)
