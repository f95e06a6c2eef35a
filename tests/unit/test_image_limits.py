"""Image limits on the target, checked per request before any image is decoded: count,
encoded bytes, and pixels read from the header (Pillow's bomb warning or error becomes our
precise error). A bad image fails its request alone; a good one beside it is served."""

from __future__ import annotations

import functools
import gc
import struct
import time
import warnings
import zlib
from pathlib import Path

import pytest
from conftest import rss_mb

from specmesh.protocol.config import TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput
from specmesh.runtime.tiny_llava import make_tiny_llava, tiny_image
from specmesh.target_service.runtime import TargetRuntime

FAST_S = 5.0  # generous: a refusal takes milliseconds
MAX_RSS_GROWTH_MB = 200


def png_claiming(width: int, height: int) -> bytes:
    """A valid 1-bit grayscale PNG of ``width`` x ``height`` zero pixels, built row by row (the
    file is a few KB; decoding it to RGB would take 3 bytes per pixel)."""
    chunk = lambda kind, data: (
        struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    )
    z, row, parts = zlib.compressobj(9), bytes(1 + (width + 7) // 8), []
    for _ in range(height):
        parts.append(z.compress(row))
    parts.append(z.flush())
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", b"".join(parts))
        + chunk(b"IEND", b"")
    )


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llava(tmp_path_factory.mktemp("llava") / "target")


@pytest.fixture(scope="module")
def llava(llava_dir: Path) -> TargetRuntime:
    cfg = TargetConfig(str(llava_dir), max_images_per_request=3, max_image_bytes=200_000)
    return TargetRuntime(cfg)


@functools.cache
def _tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _prefill(runtime: TargetRuntime, rid: str, images: list[bytes]) -> PrefillInput:
    ids = _tokenizer(runtime.cfg.model_dir).encode("look: " + "<image> " * len(images))
    return PrefillInput(rid, ids, SamplingParams(max_new_tokens=4, ignore_eos=True), images=images)


def test_image_limits_fail_their_request_alone(llava: TargetRuntime) -> None:
    big = png_claiming(20000, 20000)  # 400 MP: past Pillow's own bomb error
    warned = png_claiming(10000, 10000)  # 100 MP: Pillow would only warn
    over = png_claiming(5000, 5000)  # 25 MP: only our limit
    assert max(len(b) for b in (big, warned, over)) < 100_000
    inputs = [
        _prefill(llava, "count", [tiny_image(0)] * 4),
        _prefill(llava, "bytes", [tiny_image(0), bytes(200_001)]),
        _prefill(llava, "big", [tiny_image(0), big]),
        _prefill(llava, "good", [tiny_image(1)]),
        _prefill(llava, "warned", [warned]),
        _prefill(llava, "over", [over]),
    ]
    gc.collect()
    before = rss_mb()
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = llava.prefill(inputs)
    elapsed = time.perf_counter() - start
    growth = rss_mb() - before
    print(f"\nimage limits: prefill of 6 requests in {elapsed * 1000:.0f} ms, RSS {growth:+.0f} MB")
    assert not [w for w in caught if "DecompressionBomb" in w.category.__name__]
    assert set(out.tokens) == {"good"} and set(out.errors) == {r.rid for r in inputs} - {"good"}
    assert all(e.grpc_code == "INVALID_ARGUMENT" for e in out.errors.values())
    msg = {rid: str(e) for rid, e in out.errors.items()}
    assert "4 images exceed the limit of 3" in msg["count"]
    assert "--max-images-per-request" in msg["count"]
    assert "image 1 of 200001 bytes exceeds the limit of 200000" in msg["bytes"]
    assert "image 1" in msg["big"] and "--max-image-pixels" in msg["big"]
    assert "400000000 pixels" in msg["big"]
    assert "100000000 pixels" in msg["warned"] and "--max-image-pixels" in msg["warned"]
    assert "5000x5000 = 25000000 pixels, over the limit of 16777216" in msg["over"]
    assert elapsed < FAST_S and growth < MAX_RSS_GROWTH_MB
    llava.release("good")


def test_pixel_limit_is_a_setting(llava_dir: Path) -> None:
    runtime = TargetRuntime(TargetConfig(str(llava_dir), max_image_pixels=20 * 24 - 1))
    out = runtime.prefill(
        [_prefill(runtime, "r", [tiny_image(0)]), _prefill(runtime, "s", [tiny_image(1, (16, 16))])]
    )
    assert set(out.tokens) == {"s"}
    assert "24x20 = 480 pixels, over the limit of 479" in str(out.errors["r"])
