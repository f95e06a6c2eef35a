"""Package layering: no import cycles between the project's packages, and a router process in
gRPC mode imports no torch (DESIGN.md §1: the router imports only `protocol` and `rpc`)."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _packages() -> dict[str, Path]:
    """Top-level specmesh packages (``specmesh.router`` -> router/), from pyproject.toml."""
    dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {name: ROOT / folder for name, folder in dirs.items() if name.count(".") == 1}


def _edges() -> dict[str, set[str]]:
    """Imports between packages, lazy ones (inside functions) included: a lazy import still
    couples two packages. Imports under ``if TYPE_CHECKING:`` are types only and do not count."""
    packages = _packages()
    edges: dict[str, set[str]] = {name: set() for name in packages}
    for name, folder in packages.items():
        for path in folder.rglob("*.py"):
            for module in _imported(ast.parse(path.read_text())):
                target = ".".join(module.split(".")[:2])
                if target in packages and target != name:
                    edges[name].add(target)
    return edges


def _imported(tree: ast.AST) -> list[str]:
    typing_only = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
        for n in ast.walk(node)
    }
    names = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.ImportFrom) and node.module:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return names


def test_no_import_cycles_between_packages() -> None:
    edges, done, path = _edges(), set(), []

    def visit(name: str) -> None:
        assert name not in path, f"import cycle: {' -> '.join([*path, name])}"
        if name in done:
            return
        path.append(name)
        for nxt in sorted(edges[name]):
            visit(nxt)
        path.pop()
        done.add(name)

    for name in sorted(edges):
        visit(name)


def test_only_the_entry_point_imports_the_command_line() -> None:
    """`specmesh.cli` is a leaf: libraries (bench, router, ...) never import it."""
    assert not [name for name, targets in _edges().items() if "specmesh.cli" in targets]


def test_grpc_router_imports_no_torch_and_no_service_package() -> None:
    """A router process (its CLI path, its gRPC server and clients) loads only `protocol`, `rpc`
    and the router: no torch, no transformers, no runtime, kernels or model service."""
    code = (
        "import sys\n"
        "from specmesh.cli.main import build_parser\n"
        "build_parser('router').parse_args(['router', '--target', 'a:1', '--draft', 'b:2'])\n"
        "import specmesh.router.server, specmesh.router.grpc_clients\n"
        "heavy = ('torch', 'transformers', 'specmesh.runtime', 'specmesh.target_service',\n"
        "         'specmesh.draft_service', 'specmesh.kernels')\n"
        "print(sorted(m for m in sys.modules if m.startswith(heavy)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_health_probe_imports_no_torch() -> None:
    """``specmesh health`` is what Kubernetes and compose run as an exec probe, every few seconds."""
    code = (
        "import sys\n"
        "from specmesh.cli.main import build_parser\n"
        "args = build_parser('health').parse_args(['health', '127.0.0.1:1'])\n"
        "args.run(args)\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.stdout.strip() == "False", out.stderr
