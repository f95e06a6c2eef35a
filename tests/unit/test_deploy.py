"""docker-compose.yml (+ docker-compose.tls.yml), the Dockerfile and the Kubernetes manifests.
Their schemas (`kubernetes-validate --strict`) are `test_deploy_schema.py`'s; what a schema
cannot say is checked here against the real CLI: every command parses with `specmesh`'s own parser, every port a
command listens on is the one exposed / probed / dialled / admitted by the NetworkPolicies,
every health check names a service the servers register, every port serving /metrics (a
model service's ``--metrics-port``, the router's ``--http-port``) is the one the Prometheus
annotations name and the NetworkPolicies open, every path baked into the image exists
in the repository, every TLS file is mounted (from a Secret in Kubernetes) and every probe of a
TLS service speaks TLS with the service's own files. `test_k8s_checks_catch_a_wrong_port` keeps
the checks honest: each port mismatch it plants must fail them."""

from __future__ import annotations

import copy
import re
from pathlib import Path

import pytest
import yaml

from specmesh.cli.main import build_parser
from specmesh.draft_service.server import SERVICE_NAME as DRAFT_SERVICE
from specmesh.router.server import SERVICE_NAME as ROUTER_SERVICE
from specmesh.rpc.security import API_KEY_ENV, TLS_FLAGS
from specmesh.target_service.server import SERVICE_NAME as TARGET_SERVICE

ROOT = Path(__file__).resolve().parents[2]
ROLE_SERVICE = {"target": TARGET_SERVICE, "draft": DRAFT_SERVICE, "router": ROUTER_SERVICE}
HEALTH_NAMES = {"", *ROLE_SERVICE.values()}
TLS_ARGS = ("tls_cert_file", "tls_key_file", "tls_ca_file")


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


def _tls(args) -> tuple[str | None, ...]:
    return tuple(getattr(args, name) for name in TLS_ARGS)


def _public_ports(args) -> list[int]:
    """The ports a command serves its clients on: gRPC, then the router's HTTP API if set."""
    http_port = getattr(args, "http_port", None)
    return [args.port, *([http_port] if http_port else [])]


def _check_probe_tls(service, probe) -> None:
    """A probe of a TLS service verifies it with the service's CA and, where the service asks
    for client certificates (a CA given to target / draft), presents the service's own."""
    cert, key, ca = _tls(service)
    assert probe.tls_ca_file == ca, "the probe must verify the service with its CA"
    if ca and service.command in ("target", "draft"):
        assert (probe.tls_cert_file, probe.tls_key_file) == (cert, key)


# -- docker compose ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())["services"]


@pytest.fixture(scope="module")
def compose_tls() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.tls.yml").read_text())["services"]


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
        for port in _public_ports(args):
            assert str(port) in published, f"{name} listens on {port}, exposes {published}"
        test = svc["healthcheck"]["test"]
        assert test[0] == "CMD" and test[1] == "specmesh"
        health = _parse(test[2:])
        assert health.command == "health" and health.address == f"localhost:{args.port}"
        assert health.service == ROLE_SERVICE[name]
        assert args.host == "0.0.0.0"  # the CLI's default is loopback: containers say so
    assert "SPECMESH_API_KEY" in compose["router"]["environment"]
    router = _parse(compose["router"]["command"])
    assert router.http_port, "the router serves no OpenAI-compatible HTTP API"
    assert sorted(compose["router"]["ports"]) == sorted(
        f"127.0.0.1:{p}:{p}" for p in _public_ports(router)
    ), "the router's ports are published on the host's loopback, each on its own number"
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


def test_compose_tls_override_adds_only_tls_files_that_are_mounted(
    compose: dict, compose_tls: dict
) -> None:
    """docker-compose.tls.yml replaces each command (compose merges lists by replacement) with
    the base command plus the three TLS flags; the files lie in the mounted certs volume."""
    assert set(compose_tls) == set(compose)
    for name, svc in compose_tls.items():
        base, command = compose[name]["command"], svc["command"]
        assert command[: len(base)] == base, f"{name}: the TLS command drifted from the base"
        args = _parse(command)
        assert command[len(base) :] == [
            arg for flag, path in zip(TLS_FLAGS.values(), _tls(args), strict=True)
            for arg in (flag, path)
        ]  # fmt: skip
        mounts = [v.split(":")[1] for v in svc["volumes"]]
        for path in _tls(args):
            assert any(path.startswith(m + "/") for m in mounts), f"{name}: {path} not mounted"
        health = _parse(svc["healthcheck"]["test"][2:])
        assert health.address == f"localhost:{args.port}"
        assert health.service == ROLE_SERVICE[name]
        _check_probe_tls(args, health)


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


def test_k8s_workloads_parse_and_probe_registered_services(k8s: list[dict]) -> None:
    _check_workloads(k8s)


def _check_workloads(k8s: list[dict]) -> None:
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
        assert args.host == "0.0.0.0"  # the CLI's default is loopback: pods say so
        metrics_port = getattr(args, "metrics_port", 0)
        assert [p["containerPort"] for p in container["ports"]] == [
            *_public_ports(args),
            *([metrics_port] if metrics_port else []),
        ], f"{role}: container ports"
        _check_scrape_annotations(pod["metadata"].get("annotations", {}), args)
        assert container["resources"]["requests"]
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe in container:
                port, service = _k8s_probe(container[probe], args)
                assert port == args.port and service in HEALTH_NAMES
        assert _k8s_probe(container["readinessProbe"], args)[1] == ROLE_SERVICE[role]
        svc = services[w["metadata"]["name"]]
        assert svc["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        assert [p["port"] for p in svc["spec"]["ports"]] == _public_ports(args), f"{role} Service"
        targets = {p["name"]: p["containerPort"] for p in container["ports"]}
        for p in svc["spec"]["ports"]:  # a named targetPort is the container port of that name
            assert targets.get(p["targetPort"], p["targetPort"]) == p["port"], f"{role}: {p}"
        if role in ("target", "draft"):
            assert svc["spec"]["clusterIP"] == "None", f"{role} needs a headless Service"


def _scrape_port(args) -> int | None:
    """The port serving /metrics: ``--metrics-port`` of a target or draft, the router's
    ``--http-port`` (`specmesh.router.metrics.REGISTRY`)."""
    return getattr(args, "metrics_port", None) or getattr(args, "http_port", None)


def _check_scrape_annotations(annotations: dict, args) -> None:
    """A pod serving /metrics carries scrape annotations naming that port, scheme https where the
    port speaks TLS (the router's HTTP API does with --tls-cert-file; metrics ports never)."""
    scrape_port = _scrape_port(args)
    if scrape_port:
        assert annotations.get("prometheus.io/scrape") == "true", f"{args.command} not scraped"
    if "prometheus.io/scrape" in annotations:
        assert scrape_port, f"{args.command} is scraped but serves no /metrics"
        assert annotations["prometheus.io/port"] == str(scrape_port), f"{args.command} scrape"
        assert annotations["prometheus.io/path"] == "/metrics"
        tls = args.command == "router" and args.tls_cert_file
        assert annotations.get("prometheus.io/scheme", "http") == ("https" if tls else "http")


def _k8s_probe(probe: dict, service) -> tuple[int, str]:
    """(port, health service name) of a probe. kubelet's gRPC probes cannot speak TLS, so a TLS
    service is probed by `specmesh health` in the container, with the service's TLS files."""
    if "grpc" in probe:
        assert not any(_tls(service)), "a TLS service needs an exec probe (`specmesh health`)"
        return probe["grpc"]["port"], probe["grpc"]["service"]
    command = probe["exec"]["command"]
    assert command[0] == "specmesh"
    health = _parse(command[1:])
    assert health.command == "health" and health.address.startswith("localhost:")
    _check_probe_tls(service, health)
    return int(health.address.split(":")[1]), health.service


def test_k8s_tls_files_come_from_secrets(k8s: list[dict]) -> None:
    """TLS everywhere: each workload gets certificate, key and CA from a mounted Secret (the
    kubernetes.io/tls layout plus ca.crt, as cert-manager writes it); the router's API key comes
    from a Secret through its environment, never its command line."""
    for w in (d for d in k8s if d["kind"] in ("Deployment", "StatefulSet")):
        pod = w["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = _parse(container["args"])
        volumes = {v["name"]: v for v in pod["volumes"]}
        for path in _tls(args):
            assert path, f"{args.command} runs without TLS"
            folder, name = path.rsplit("/", 1)
            (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == folder]
            secret = volumes[mount["name"]]["secret"]
            keys = [i["path"] for i in secret.get("items", [])] or ["tls.crt", "tls.key", "ca.crt"]
            assert name in keys and mount["readOnly"], f"{path} is not a key of {secret}"
        assert pod["securityContext"]["runAsNonRoot"]
        if args.command == "router":
            (env,) = [e for e in container["env"] if e["name"] == API_KEY_ENV]
            assert "secretKeyRef" in env["valueFrom"]  # its key: the schema requires one
            assert not args.api_key


def test_k8s_network_policies_admit_only_the_router_to_model_services(k8s: list[dict]) -> None:
    _check_policies(k8s)


def _check_policies(k8s: list[dict]) -> None:
    pods, metrics_ports = {}, {}
    for d in k8s:
        if d["kind"] in ("Deployment", "StatefulSet"):
            args = _parse(d["spec"]["template"]["spec"]["containers"][0]["args"])
            labels = d["spec"]["template"]["metadata"]["labels"]
            pods[d["metadata"]["name"]] = (labels, _public_ports(args))
            metrics_ports[d["metadata"]["name"]] = getattr(args, "metrics_port", 0)
    matches = lambda selector, labels: selector["matchLabels"].items() <= labels.items()
    policies = [d for d in k8s if d["kind"] == "NetworkPolicy"]
    for role in ROLE_SERVICE:
        labels, ports = pods[f"specmesh-{role}"]
        (policy,) = [p for p in policies if matches(p["spec"]["podSelector"], labels)]
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        rule, *metrics_rules = policy["spec"]["ingress"]
        assert rule["ports"] == [{"protocol": "TCP", "port": p} for p in ports], f"{role} policy"
        _check_metrics_rules(metrics_rules, metrics_ports[f"specmesh-{role}"])
        if role == "router":
            # The public ports admit anyone: clients, and Prometheus on the HTTP port's /metrics.
            assert "from" not in rule
            continue
        (peer,) = rule["from"]
        admitted = [name for name, (pod, _) in pods.items() if matches(peer["podSelector"], pod)]
        assert admitted == ["specmesh-router"], f"{role} admits {admitted}"


def _check_metrics_rules(rules: list[dict], metrics_port: int) -> None:
    """The metrics port (if any) admits Prometheus pods only, and on that port alone."""
    if not metrics_port:
        assert not rules
        return
    (rule,) = rules
    assert rule["ports"] == [{"protocol": "TCP", "port": metrics_port}]
    (peer,) = rule["from"]
    assert peer["podSelector"]["matchLabels"] == {"app.kubernetes.io/name": "prometheus"}


def _router_pod(docs: list[dict]) -> dict:
    (router,) = [d for d in docs if d["metadata"]["name"] == "specmesh-router"
                 and d["kind"] == "Deployment"]  # fmt: skip
    return router["spec"]["template"]


def _set_http_port(docs: list[dict], port: int) -> None:
    args = _router_pod(docs)["spec"]["containers"][0]["args"]
    args[args.index("--http-port") + 1] = str(port)


def _set_port(docs: list[dict], kind: str, name: str, old: int, new: int) -> None:
    """Every ``port`` / ``containerPort`` equal to ``old`` in that document becomes ``new``."""
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]

    def walk(node) -> None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in list(items):
            if key in ("port", "containerPort") and value == old:
                node[key] = new
            elif isinstance(value, dict | list):
                walk(value)

    walk(doc)


WRONG_PORTS = {
    "annotation": lambda docs: _router_pod(docs)["metadata"]["annotations"].update(
        {"prometheus.io/port": "8001"}
    ),
    "no annotations": lambda docs: _router_pod(docs)["metadata"].pop("annotations"),
    "--http-port": lambda docs: _set_http_port(docs, 8001),
    "container port": lambda docs: _set_port(docs, "Deployment", "specmesh-router", 8000, 8001),
    "Service port": lambda docs: _set_port(docs, "Service", "specmesh-router", 8000, 8001),
    "NetworkPolicy": lambda docs: _set_port(docs, "NetworkPolicy", "specmesh-router", 8000, 8001),
    "target metrics": lambda docs: _set_port(docs, "NetworkPolicy", "specmesh-target", 9402, 9401),
}


@pytest.mark.parametrize("mistake", WRONG_PORTS)
def test_k8s_checks_catch_a_wrong_port(k8s: list[dict], mistake: str) -> None:
    """Each mistake, planted in a copy of the manifests, fails the workload or policy checks."""
    docs = copy.deepcopy(k8s)
    WRONG_PORTS[mistake](docs)
    with pytest.raises(AssertionError):
        _check_workloads(docs)
        _check_policies(docs)


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


def test_a_tensor_parallel_target_gets_one_gpu_per_rank(compose: dict, k8s: list[dict]) -> None:
    """``--tensor-parallel-size N`` and the GPUs given to the target move together: compose
    reads both from one variable, the k8s pod requests (and is limited to) N GPUs, and both
    mount a shared-memory area large enough for NCCL."""
    command = compose["target"]["command"]
    tp = command[command.index("--tensor-parallel-size") + 1]
    (devices,) = compose["target"]["deploy"]["resources"]["reservations"]["devices"]
    assert str(devices["count"]) == tp and devices["capabilities"] == ["gpu"]
    assert compose["target"]["shm_size"]
    (target,) = [d for d in k8s if d["kind"] == "StatefulSet"]
    (container,) = target["spec"]["template"]["spec"]["containers"]
    n = _parse(container["args"]).tensor_parallel_size
    resources = container["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == n
    shm = {m["name"] for m in container["volumeMounts"] if m["mountPath"] == "/dev/shm"}
    volumes = {v["name"]: v for v in target["spec"]["template"]["spec"]["volumes"]}
    assert [volumes[name]["emptyDir"]["medium"] for name in shm] == ["Memory"]
