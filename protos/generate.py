"""Regenerate the checked-in Python code for the specmesh.v1 protos.

    python protos/generate.py            # writes protos/specmesh/v1/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi

Runs the protoc bundled with grpcio-tools with ``-I protos``, so a proto imports another as
``import "specmesh/v1/tensor.proto"`` and the generated code as ``from specmesh.v1 import
tensor_pb2``, which resolves because pyproject.toml maps the package ``specmesh.v1`` to
``protos/specmesh/v1``. tests/unit/test_protos.py regenerates into a temporary folder and fails when
the checked-in files differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the -I root: holds specmesh/v1/*.proto
PROTO_PACKAGE_DIR = Path("specmesh") / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    """The .proto sources, relative to PROTO_ROOT, sorted."""
    return sorted(
        p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PROTO_PACKAGE_DIR).glob("*.proto")
    )


def generate(out_dir: Path | str = PROTO_ROOT) -> list[Path]:
    """Compile every proto into ``out_dir/specmesh/v1/`` and return the generated files.

    ``out_dir`` is the output root (protoc mirrors the ``specmesh/v1`` folders under it); the
    default regenerates the checked-in code in place.
    """
    from grpc_tools import protoc  # grpcio-tools is a build-time tool; import it only here

    out_dir = Path(out_dir)
    (out_dir / PROTO_PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *(str(p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return generated_files(out_dir)


def generated_files(out_dir: Path | str = PROTO_ROOT) -> list[Path]:
    """The generated files that ``generate(out_dir)`` writes, sorted."""
    package_dir = Path(out_dir) / PROTO_PACKAGE_DIR
    stems = [p.stem for p in proto_files()]
    return sorted(
        package_dir / f"{stem}{suffix}" for stem in stems for suffix in GENERATED_SUFFIXES
    )


if __name__ == "__main__":
    for path in generate(sys.argv[1] if len(sys.argv) > 1 else PROTO_ROOT):
        print(path)
