"""The wire contract: checked-in generated code is fresh, and the public names exist."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import re
from importlib.metadata import version
from pathlib import Path

import pytest
from google.protobuf import descriptor_pool

PROTOS = Path(__file__).resolve().parents[2] / "protos"
REGENERATE = "python protos/generate.py"


def _load_generator():
    spec = importlib.util.spec_from_file_location("specmesh_proto_generate", PROTOS / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = _load_generator()
GENERATED = generator.generated_files(PROTOS)
MODULES = [f"specmesh.v1.{p.name.removesuffix('.py')}" for p in GENERATED if p.suffix == ".py"]


def _generated_with() -> str:
    """The grpcio-tools version that wrote the checked-in code."""
    text = (PROTOS / "specmesh" / "v1" / "generation_pb2_grpc.py").read_text()
    return re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", text).group(1)


def _descriptor_bytes(path: Path) -> bytes:
    """The serialized FileDescriptorProto embedded in a generated *_pb2.py."""
    match = re.search(r"AddSerializedFile\((b'.*?')\)\n", path.read_text())
    return ast.literal_eval(match.group(1))


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = generator.generate(tmp_path)
    assert [p.relative_to(tmp_path) for p in fresh] == [p.relative_to(PROTOS) for p in GENERATED]
    missing = [str(p.relative_to(PROTOS)) for p in GENERATED if not p.exists()]
    assert not missing, f"generated code is missing: {missing}; run: {REGENERATE}"
    installed = version("grpcio-tools")
    if installed != _generated_with():
        # Another protoc writes other boilerplate; compare what the protos mean instead.
        stale = [
            str(old.relative_to(PROTOS))
            for old, new in zip(GENERATED, fresh, strict=True)
            if old.name.endswith("_pb2.py") and _descriptor_bytes(old) != _descriptor_bytes(new)
        ]
        assert not stale, f"generated code is stale: {stale}; run: {REGENERATE}"
        pytest.skip(f"byte comparison needs grpcio-tools {_generated_with()}, have {installed}")
    stale = [
        str(old.relative_to(PROTOS))
        for old, new in zip(GENERATED, fresh, strict=True)
        if old.read_bytes() != new.read_bytes()
    ]
    assert not stale, f"generated code is stale: {stale}; run: {REGENERATE}"


@pytest.mark.parametrize("module", MODULES)
def test_every_generated_module_imports(module: str) -> None:
    importlib.import_module(module)


def test_generate_request_response_round_trip() -> None:
    from specmesh.v1 import generation_pb2

    request = generation_pb2.GenerateRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=generation_pb2.SamplingParams(
            max_new_tokens=16,
            temperature=0.7,
            top_p=0.9,
            top_k=20,
            seed=0,
            stop=["\n\n"],
            stop_token_ids=[7],
            ignore_eos=True,
        ),
        disable_speculation=True,
        images=[b"\x89PNG"],
    )
    parsed = generation_pb2.GenerateRequest.FromString(request.SerializeToString())
    assert parsed == request
    assert parsed.sampling.HasField("seed") and parsed.sampling.seed == 0
    assert not generation_pb2.SamplingParams().HasField("seed")

    stats = generation_pb2.RequestStats(
        prompt_tokens=3,
        completion_tokens=4,
        num_rounds=2,
        accept_lens=[3, 1],
        mean_accept_len=2.0,
        time_to_first_token_s=0.05,
        total_time_s=0.2,
    )
    response = generation_pb2.GenerateResponse(
        request_id="r1", token_ids=[5, 6], text="hi", finish_reason="stop", stats=stats
    )
    assert generation_pb2.GenerateResponse.FromString(response.SerializeToString()) == response


PUBLIC_FIELDS = {
    "GenerateRequest": {
        "request_id",
        "prompt",
        "prompt_token_ids",
        "sampling",
        "disable_speculation",
        "images",
    },
    "SamplingParams": {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
    },
    "GenerateResponse": {"request_id", "token_ids", "text", "finish_reason", "stats"},
    "RequestStats": {
        "prompt_tokens",
        "completion_tokens",
        "num_rounds",
        "accept_lens",
        "mean_accept_len",
        "time_to_first_token_s",
        "total_time_s",
    },
    "InfoResponse": {
        "model_name",
        "model_path",
        "vocab_size",
        "max_context_len",
        "draft_kind",
        "num_steps",
        "topk",
        "num_draft_tokens",
        "num_target_replicas",
        "num_draft_replicas",
        "version",
    },
}


def test_public_api_names() -> None:
    importlib.import_module("specmesh.v1.generation_pb2")
    pool = descriptor_pool.Default()
    service = pool.FindServiceByName("specmesh.v1.Generation")
    generate = service.FindMethodByName("Generate")
    assert generate.input_type.full_name == "specmesh.v1.GenerateRequest"
    assert generate.output_type.full_name == "specmesh.v1.GenerateResponse"
    assert not generate.client_streaming and generate.server_streaming
    get_info = service.FindMethodByName("GetInfo")
    assert get_info.output_type.full_name == "specmesh.v1.InfoResponse"
    for message, fields in PUBLIC_FIELDS.items():
        names = set(pool.FindMessageTypeByName(f"specmesh.v1.{message}").fields_by_name)
        assert fields <= names, f"{message} lacks {fields - names}"
    request = pool.FindMessageTypeByName("specmesh.v1.GenerateRequest")
    ids = request.fields_by_name["prompt_token_ids"]
    assert ids.is_repeated and ids.type == ids.TYPE_UINT32
    sampling = pool.FindMessageTypeByName("specmesh.v1.SamplingParams")
    assert sampling.fields_by_name["seed"].has_presence


@pytest.mark.parametrize(
    ("service", "methods"),
    [
        # release travels in-band on Step; GetTokenizer is the router's start-up fetch
        ("specmesh.v1.Target", {"GetInfo", "GetTokenizer", "Step"}),
        ("specmesh.v1.Draft", {"GetInfo", "Step"}),
    ],
)
def test_internal_services_are_bidi_step(service: str, methods: set[str]) -> None:
    importlib.import_module("specmesh.v1.target_pb2")
    importlib.import_module("specmesh.v1.draft_pb2")
    desc = descriptor_pool.Default().FindServiceByName(service)
    assert set(desc.methods_by_name) == methods
    step = desc.methods_by_name["Step"]
    assert step.client_streaming and step.server_streaming


def test_step_messages_share_framing() -> None:
    from specmesh.v1 import draft_pb2, target_pb2

    for cls in (
        target_pb2.TargetStepRequest,
        target_pb2.TargetStepResponse,
        draft_pb2.DraftStepRequest,
        draft_pb2.DraftStepResponse,
    ):
        fields = cls.DESCRIPTOR.fields_by_name
        assert [fields[n].number for n in ("batch_id", "chunk_index", "more_chunks")] == [1, 2, 3]
    work = {
        target_pb2.TargetStepRequest: ("prefill", "decode", "verify", "release", "open"),
        draft_pb2.DraftStepRequest: ("extend", "propose", "release", "prepare"),
    }
    for cls, names in work.items():
        got = {f.name for f in cls.DESCRIPTOR.oneofs_by_name["work"].fields}
        assert got == set(names)
