"""SMG's smg.worker.v1 contract: the checked-in generated code is fresh, and the contract is
still SMG's (the descriptors are pinned: a field renamed, renumbered or retyped fails here)."""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.util
import re
from importlib.metadata import version
from pathlib import Path

import pytest

PROTOS = Path(__file__).resolve().parents[2] / "protos"
REGENERATE = "python protos/generate_smg.py"

# sha256 of each file's serialized FileDescriptorProto (no comments in it: only the contract).
# They were checked equal to the descriptors of smg-project/smg's
# crates/grpc_client/proto/worker_{inference,control}.proto compiled under the same names.
# Change them only to follow a change of SMG's contract (docs/smg.md).
CONTRACT = {
    "worker_inference": "b88acd2b3782e74560b229d8de4696ed45b4443530b65818ac5b1885e9bcc9f5",
    "worker_control": "7d9405728396c5873654de37dd25f6e54110ba11303b2a1f3a21cf41b4091c55",
}


def _load_generator():
    spec = importlib.util.spec_from_file_location("smg_proto_generate", PROTOS / "generate_smg.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


generator = _load_generator()
GENERATED = generator.generated_files(PROTOS)


def _descriptor_bytes(path: Path) -> bytes:
    match = re.search(r"AddSerializedFile\((b'.*?')\)\n", path.read_text())
    return ast.literal_eval(match.group(1))


def test_generated_code_is_fresh(tmp_path: Path) -> None:
    fresh = generator.generate(tmp_path)
    assert [p.relative_to(tmp_path) for p in fresh] == [p.relative_to(PROTOS) for p in GENERATED]
    missing = [str(p.relative_to(PROTOS)) for p in GENERATED if not p.exists()]
    assert not missing, f"generated code is missing: {missing}; run: {REGENERATE}"
    grpc_module = next(p for p in GENERATED if p.name.endswith("_pb2_grpc.py")).read_text()
    written_with = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_module).group(1)
    pairs = list(zip(GENERATED, fresh, strict=True))
    if version("grpcio-tools") != written_with:  # other boilerplate: compare the contracts
        stale = [
            str(old.relative_to(PROTOS))
            for old, new in pairs
            if old.name.endswith("_pb2.py") and _descriptor_bytes(old) != _descriptor_bytes(new)
        ]
        assert not stale, f"generated code is stale: {stale}; run: {REGENERATE}"
        pytest.skip(f"byte comparison needs grpcio-tools {written_with}")
    stale = [str(o.relative_to(PROTOS)) for o, n in pairs if o.read_bytes() != n.read_bytes()]
    assert not stale, f"generated code is stale: {stale}; run: {REGENERATE}"


@pytest.mark.parametrize("stem", sorted(CONTRACT))
def test_contract_is_smgs(stem: str) -> None:
    module = importlib.import_module(f"specmesh.smg.{stem}_pb2")
    importlib.import_module(f"specmesh.smg.{stem}_pb2_grpc")  # imported as specmesh.smg
    assert module.DESCRIPTOR.name == f"smg/worker/v1/{stem}.proto"
    assert module.DESCRIPTOR.package == "smg.worker.v1"
    digest = hashlib.sha256(module.DESCRIPTOR.serialized_pb).hexdigest()
    assert digest == CONTRACT[stem], f"{stem}.proto no longer matches SMG's contract"


def test_services_and_their_shapes() -> None:
    from specmesh.smg import worker_control_pb2, worker_inference_pb2

    inference = worker_inference_pb2.DESCRIPTOR.services_by_name["WorkerInference"]
    assert inference.full_name == "smg.worker.v1.WorkerInference"
    generate = inference.methods_by_name["Generate"]
    assert generate.server_streaming and not generate.client_streaming
    assert set(inference.methods_by_name) == {"Generate", "Abort"}
    control = worker_control_pb2.DESCRIPTOR.services_by_name["WorkerControl"]
    assert set(control.methods_by_name) == {
        "GetIdentity", "GetCapabilities", "GetHealth", "GetTopology"
    }  # fmt: skip
    states = worker_control_pb2.WorkerHealthState
    assert [states.Name(v) for v in range(6)] == [
        f"WORKER_HEALTH_STATE_{s}"
        for s in ("UNSPECIFIED", "STARTING", "SERVING", "DEGRADED", "DRAINING", "NOT_SERVING")
    ]
