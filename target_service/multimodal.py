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

Limits (`specmesh.protocol.images.ImageLimits`, flags of ``specmesh target``), per request and before anything is decoded:
the number of images and their encoded bytes, then every image's width x height from its header
(``Image.open`` is lazy). Only then are the images decoded and preprocessed, one at a time, so at
most one full-size decoded image is held. A request over a limit fails alone, INVALID_ARGUMENT.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import torch

from specmesh.protocol.errors import InvalidRequestError, SpecmeshError
from specmesh.protocol.images import (
    IMAGE_FORMATS,
    MAX_IMAGE_PIXELS,
    ImageLimits,
    check_image_sizes,
)

if TYPE_CHECKING:
    from specmesh.protocol.steps import PrefillInput
    from specmesh.target_service.llava import ImageEncoder


@dataclass
class MergedBatch:
    inputs: list[PrefillInput]  # ready to run; input_embeds set on all when any has images
    prompt_ids: dict[str, list[int]] = field(default_factory=dict)  # only where expanded
    errors: dict[str, SpecmeshError] = field(default_factory=dict)


def open_image(rid: str, index: int, data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """A lazily opened PIL image (its header read, nothing decoded) of at most ``max_pixels``,
    or `InvalidRequestError` naming the image. Pillow's own decompression-bomb check
    (``PIL.Image.MAX_IMAGE_PIXELS``, 89 MP, which caps ``max_pixels``) fails the same way,
    never as a warning. (The warning filter is process-wide for the instant of ``open``; the
    target opens images on its one worker thread.)"""
    from PIL import Image

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        why = f"exceeds the limit of {max_pixels} pixels (--max-image-pixels): {e}"
        raise _image_error(rid, index, data, why) from e
    except Exception as e:  # PIL raises many types for corrupt data; all are the client's fault
        raise _image_error(rid, index, data, _undecodable(e)) from e
    width, height = img.size
    if width * height > max_pixels:
        img.close()
        why = f"is {width}x{height} = {width * height} pixels, over the limit of {max_pixels}"
        raise _image_error(rid, index, data, why + " (--max-image-pixels)")
    return img


def decode_image(rid: str, index: int, data: bytes, max_pixels: int = MAX_IMAGE_PIXELS) -> Any:
    """Encoded PNG / JPEG bytes → an RGB PIL image, or `InvalidRequestError` naming the image."""
    with open_image(rid, index, data, max_pixels) as img:
        try:
            return img.convert("RGB")
        except Exception as e:  # truncated or corrupt pixel data
            raise _image_error(rid, index, data, _undecodable(e)) from e


def _image_error(rid: str, index: int, data: bytes, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"request {rid!r}: image {index} ({len(data)} bytes) {why}")


def _undecodable(e: Exception) -> str:
    return f"is not a decodable PNG or JPEG ({type(e).__name__}: {e})"


def merge_images(
    inputs: list[PrefillInput],
    encoder: ImageEncoder | None,
    embed: Callable[[torch.Tensor], torch.Tensor],
    model_name: str = "",
    limits: ImageLimits | None = None,
) -> MergedBatch:
    """Validate every request's images, encode all images of the batch in one vision forward and
    build each request's expanded ids and ``input_embeds``. Bad requests land in ``errors``; the
    others are unaffected."""
    limits = limits or ImageLimits()
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
    pixels: dict[str, list[torch.Tensor]] = {}  # per request, [1, 3, H, W] per image
    for inp in inputs:
        try:
            pixels[inp.rid] = _request_pixels(inp, encoder, limits)
        except InvalidRequestError as e:
            out.errors[inp.rid] = e
    ok = [i for i in inputs if i.rid in pixels]
    if not any(pixels[i.rid] for i in ok):
        out.inputs = ok
        return out
    with torch.inference_mode():
        features = encoder.encode_pixels(torch.cat([p for i in ok for p in pixels[i.rid]]))
        start = 0  # features: [n, tokens_per_image, H]
        for inp in ok:
            n = len(pixels[inp.rid])
            merged = _merge_one(inp, features[start : start + n], encoder.image_token_id, embed)
            start += n
            if len(merged.input_ids) != len(inp.input_ids):
                out.prompt_ids[inp.rid] = merged.input_ids
            out.inputs.append(merged)
    return out


def _request_pixels(
    inp: PrefillInput, encoder: ImageEncoder, limits: ImageLimits
) -> list[torch.Tensor]:
    """Check one request's images, cheapest first (count and bytes, placeholders, every header's
    pixel count), then decode and preprocess them one at a time."""
    check_image_sizes(inp.rid, inp.images, limits.max_images_per_request, limits.max_image_bytes)
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
    for k, data in enumerate(inp.images):
        open_image(inp.rid, k, data, limits.max_image_pixels).close()
    return [
        encoder.pixel_values(decode_image(inp.rid, k, data, limits.max_image_pixels))
        for k, data in enumerate(inp.images)
    ]


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
