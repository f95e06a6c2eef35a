"""Regenerate the checked-in Python code for SMG's smg.worker.v1 protos (docs/smg.md).

    python protos/generate_smg.py        # writes protos/smg/worker/v1/*_pb2.py, *_pb2_grpc.py, *_pb2.pyi

Like protos/generate.py, with ``-I protos``: a proto's name is ``smg/worker/v1/<file>.proto``.
The generated modules are imported as ``specmesh.smg`` (pyproject.toml maps that package to
``protos/smg/worker/v1``), never as a top-level ``smg``, which is SMG's own name. protoc's gRPC
plugin writes the absolute import ``from smg.worker.v1 import x_pb2``; `generate` rewrites that
one line to ``from specmesh.smg import x_pb2`` (the messages' modules import only Google's
well-known types). tests/unit/test_smg_protos.py regenerates into a temporary folder and fails
when the checked-in files differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent  # the -I root
PACKAGE_DIR = Path("smg") / "worker" / "v1"
PYTHON_PACKAGE = "specmesh.smg"
SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files() -> list[Path]:
    """The .proto sources, relative to PROTO_ROOT, sorted."""
    return sorted(p.relative_to(PROTO_ROOT) for p in (PROTO_ROOT / PACKAGE_DIR).glob("*.proto"))


def generated_files(out_dir: Path | str = PROTO_ROOT) -> list[Path]:
    """What `generate` writes under ``out_dir``, sorted."""
    folder = Path(out_dir) / PACKAGE_DIR
    return sorted(folder / f"{p.stem}{suffix}" for p in proto_files() for suffix in SUFFIXES)


def generate(out_dir: Path | str = PROTO_ROOT) -> list[Path]:
    """Compile every smg.worker.v1 proto into ``out_dir/smg/worker/v1/``; the default
    regenerates the checked-in code in place."""
    from grpc_tools import protoc  # a build-time tool: imported only here

    out_dir = Path(out_dir)
    (out_dir / PACKAGE_DIR).mkdir(parents=True, exist_ok=True)
    well_known = Path(protoc.__file__).parent / "_proto"  # google/protobuf/*.proto
    outputs = (f"--{kind}_out={out_dir}" for kind in ("python", "pyi", "grpc_python"))
    args = ["grpc_tools.protoc", f"-I{PROTO_ROOT}", f"-I{well_known}", *outputs]
    if protoc.main([*args, *map(str, proto_files())]) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    absolute = f"from {'.'.join(PACKAGE_DIR.parts)} import "
    for path in generated_files(out_dir):
        if path.name.endswith("_pb2_grpc.py"):
            text = path.read_text()
            path.write_text(text.replace(absolute, f"from {PYTHON_PACKAGE} import "))
    return generated_files(out_dir)


if __name__ == "__main__":
    for written in generate(sys.argv[1] if len(sys.argv) > 1 else PROTO_ROOT):
        print(written)
