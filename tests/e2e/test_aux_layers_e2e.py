"""EAGLE-3 heads that name their own aux layers (``eagle_aux_hidden_state_layer_ids``, not the
default), served by ``specmesh target`` + ``specmesh draft`` + ``specmesh router`` started by
hand exactly as the README shows: the router's stream handshake makes the target capture the
draft's layers, and greedy output equals transformers. Plain and LLaVA targets."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
from conftest import PATIENT_DRAFT_FLAGS, assert_speculated, llava_greedy
from procs import Services

from specmesh.client import GenerationClient
from specmesh.protocol.features import AuxLayers
from specmesh.protocol.sampling import SamplingParams
from specmesh.runtime.config import load_model_config
from specmesh.runtime.llava_checkpoint import target_model_config
from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target
from specmesh.runtime.tiny_llava import make_tiny_llava, make_tiny_llava_eagle3, tiny_image
from specmesh.v1 import generation_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

SPEC_FLAGS = ("--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6")


def serve_by_hand(services: Services, target: Path, draft: Path) -> tuple[str, str]:
    """The README's three commands (plus a free port each); returns (router, target)."""
    t = services.start("target", "target", "--model", str(target), "--threads", "1")
    d = services.start(
        "draft", "draft", "--model", str(draft), "--target-model", str(target),
        "--kind", "eagle3", *SPEC_FLAGS, "--threads", "1",
    )  # fmt: skip
    # --speculation always: the random heads are never accepted, so adaptive would stop drafting.
    r = services.start("router", "router", "--target", t, "--draft", d, "--tokenizer", str(target),
                       "--speculation", "always", *PATIENT_DRAFT_FLAGS)  # fmt: skip
    for name in ("target", "draft", "router"):
        services.wait_ready(name)
    return r, t


def captured_layers(target_address: str) -> list[int]:
    with grpc.insecure_channel(target_address) as channel:
        info = target_pb2_grpc.TargetStub(channel).GetInfo(generation_pb2.InfoRequest())
    return list(info.aux_layer_ids)


@pytest.fixture
def services(tmp_path: Path):
    s = Services(tmp_path)
    yield s
    s.stop()


def test_custom_aux_layers_over_grpc(tmp_path: Path, services: Services, oracle) -> None:
    make_tiny_target(tmp_path / "target")
    n = load_model_config(tmp_path / "target").num_layers
    ids = (0, n - 2, 2)  # output numbering, like published heads; the default is 1, n/2-1, n-4
    make_tiny_eagle3(tmp_path / "draft", tmp_path / "target", seed=3, aux_layer_ids=ids)
    router, target = serve_by_hand(services, tmp_path / "target", tmp_path / "draft")
    assert captured_layers(target) == list(AuxLayers(ids, "output").capture_points(n))
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    with GenerationClient(router) as client:
        for prompt in ([5, 6, 7], [40, 41, 42, 43, 44]):
            responses = list(client.generate(prompt_token_ids=prompt, sampling=params))
            got = [t for r in responses for t in r.token_ids]
            assert got == oracle(tmp_path / "target", prompt, 24)
            assert_speculated([responses[-1].stats])


def test_custom_aux_layers_with_a_llava_target(tmp_path: Path, services: Services) -> None:
    make_tiny_llava(tmp_path / "target")
    n = target_model_config(tmp_path / "target").num_layers
    ids = (n - 1, 0)  # two layers, reversed: the order of concatenation is the draft's
    make_tiny_llava_eagle3(tmp_path / "draft", tmp_path / "target", seed=1, aux_layer_ids=ids)
    router, target = serve_by_hand(services, tmp_path / "target", tmp_path / "draft")
    assert captured_layers(target) == list(AuxLayers(ids, "output").capture_points(n))
    prompt, images = "def <image> add(a, b):", [tiny_image(0)]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    with GenerationClient(router) as client:
        responses = list(client.generate(prompt, sampling=params, images=images))
    got = [t for r in responses for t in r.token_ids]
    assert got == llava_greedy(tmp_path / "target", prompt, images, 10)
    assert_speculated([responses[-1].stats])
