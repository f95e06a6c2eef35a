"""docker-compose.yml, the Dockerfile and the Kubernetes manifests, checked against the real CLI:
every command parses with `specmesh`'s own parser, every port a command listens on is the one
exposed / probed / dialled, every health check names a service the servers register, and every
path baked into the image exists in the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from specmesh.draft_service.server import SERVICE_NAME as DRAFT_SERVICE
from specmesh.main import build_parser
from specmesh.router.server import SERVICE_NAME as ROUTER_SERVICE
from specmesh.target_service.server import SERVICE_NAME as TARGET_SERVICE

ROOT = Path(__file__).resolve().parents[2]
ROLE_SERVICE = {"target": TARGET_SERVICE, "draft": DRAFT_SERVICE, "router": ROUTER_SERVICE}
HEALTH_NAMES = {"", *ROLE_SERVICE.values()}


def _expand(arg: str) -> str:
    """Compose interpolation with defaults: ``${VAR:-default}`` -> ``default``."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", arg)


def _parse(argv: list[str]):
    try:
        return build_parser().parse_args([_expand(a) for a in argv])
    except SystemExit as e:  # argparse exits on a bad command line
        pytest.fail(f"`specmesh {' '.join(argv)}` does not parse: exit {e.code}")


def _image_path(path: str) -> Path:
    assert path.startswith("/app/"), path
    return ROOT / path.removeprefix("/app/")


def _check_paths(args) -> None:
    for name in ("model", "target_model", "tokenizer"):
        value = getattr(args, name, None)
        if value:
            assert (_image_path(value) / "config.json").is_file() or (
                _image_path(value) / "tokenizer.json"
            ).is_file(), f"{name} {value} is not a checkpoint in the image"


# -- docker compose ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


def test_compose_commands_parse_and_ports_line_up(compose: dict) -> None:
    ports = {}
    for name, svc in compose.items():
        args = _parse(svc["command"])
        assert args.command == name, f"service {name!r} runs `specmesh {args.command}`"
        _check_paths(args)
        ports[name] = args.port
        published = [str(p) for p in svc.get("expose", [])] + [
            str(p).split(":")[-1] for p in svc.get("ports", [])
        ]
        assert str(args.port) in published, f"{name} listens on {args.port}, exposes {published}"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "specmesh"
        health = _parse(test[2:])
        assert health.command == "health" and health.address == f"localhost:{args.port}"
        assert health.service == ROLE_SERVICE[name]
    router = _parse(compose["router"]["command"])
    assert (
        router.target == f"target:{ports['target']}" and router.draft == f"draft:{ports['draft']}"
    )
    assert set(compose["router"]["depends_on"]) == {"target", "draft"}
    assert all(
        d["condition"] == "service_healthy" for d in compose["router"]["depends_on"].values()
    )
    for name in ("target", "draft"):
        devices = compose[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]


def test_dockerfile_copies_what_the_package_needs() -> None:
    text = (ROOT / "Dockerfile").read_text()
    copied = re.findall(r"^COPY (\S+)", text, flags=re.M)
    for src in copied:
        assert (ROOT / src).exists(), f"Dockerfile copies missing {src}"
    import tomllib

    package_dirs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ]
    for folder in package_dirs.values():
        assert any(folder == c or folder.startswith(c + "/") for c in copied), (
            f"{folder} not copied"
        )
    entry = re.search(r'^ENTRYPOINT \["specmesh"\]', text, flags=re.M)
    cmd = re.search(r"^CMD (\[.*\])", text, flags=re.M)
    assert entry and cmd
    assert _parse(yaml.safe_load(cmd.group(1))).command == "up"


# -- kubernetes ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def k8s() -> list[dict]:
    docs = []
    for path in sorted((ROOT / "deploy" / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def test_k8s_workloads_parse_and_probe_registered_services(k8s: list[dict]) -> None:
    services = {d["metadata"]["name"]: d for d in k8s if d["kind"] == "Service"}
    workloads = [d for d in k8s if d["kind"] in ("Deployment", "StatefulSet")]
    assert {w["metadata"]["name"] for w in workloads} == {f"specmesh-{r}" for r in ROLE_SERVICE}
    for w in workloads:
        pod = w["spec"]["template"]
        assert w["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        (container,) = pod["spec"]["containers"]
        args = _parse(container["args"])
        _check_paths(args)
        role = args.command
        assert [p["containerPort"] for p in container["ports"]] == [args.port]
        assert container["resources"]["requests"]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                grpc = container[probe]["grpc"]
                assert grpc["port"] == args.port and grpc["service"] in HEALTH_NAMES
        assert container["readinessProbe"]["grpc"]["service"] == ROLE_SERVICE[role]
        svc = services[w["metadata"]["name"]]
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert [p["port"] for p in svc["spec"]["ports"]] == [args.port]
        if role in ("target", "draft"):
            assert svc["spec"]["clusterIP"] == "None", f"{role} needs a headless Service"


def test_k8s_router_dials_every_model_replica(k8s: list[dict]) -> None:
    by_name = {(d["kind"], d["metadata"]["name"]): d for d in k8s}
    router = by_name[("Deployment", "specmesh-router")]
    args = _parse(router["spec"]["template"]["spec"]["containers"][0]["args"])
    target = by_name[("StatefulSet", "specmesh-target")]
    port = by_name[("Service", "specmesh-target")]["spec"]["ports"][0]["port"]
    expected = [
        f"specmesh-target-{i}.specmesh-target:{port}" for i in range(target["spec"]["replicas"])
    ]
    assert args.target.split(",") == expected
    assert target["spec"]["serviceName"] == "specmesh-target"
    draft_port = by_name[("Service", "specmesh-draft")]["spec"]["ports"][0]["port"]
    assert args.draft == f"specmesh-draft:{draft_port}"
