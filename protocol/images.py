"""Image limits, checked before anything is decoded: by the router at its public API (count and
encoded bytes) and by a multimodal target (also width x height, read from each header;
`specmesh.target_service.multimodal`). Torch-free."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from specmesh.protocol.errors import InvalidRequestError

IMAGE_FORMATS = ("PNG", "JPEG")
# Limits, all checked before an image is decoded (the router checks count and bytes too).
MAX_IMAGES_PER_REQUEST = 8
MAX_IMAGE_BYTES = 10 << 20  # encoded
MAX_IMAGE_PIXELS = 4096 * 4096  # width x height, read from the header


@dataclass(frozen=True)
class ImageLimits:
    max_images_per_request: int = MAX_IMAGES_PER_REQUEST
    max_image_bytes: int = MAX_IMAGE_BYTES
    max_image_pixels: int = MAX_IMAGE_PIXELS


def check_image_sizes(rid: str, images: Sequence[bytes], max_images: int, max_bytes: int) -> None:
    """The limits readable without opening an image: how many, how many encoded bytes each."""
    if len(images) > max_images:
        raise InvalidRequestError(
            f"request {rid!r}: {len(images)} images exceed the limit of {max_images} per "
            f"request (--max-images-per-request)"
        )
    for k, data in enumerate(images):
        if len(data) > max_bytes:
            raise InvalidRequestError(
                f"request {rid!r}: image {k} of {len(data)} bytes exceeds the limit of "
                f"{max_bytes} (--max-image-bytes)"
            )
