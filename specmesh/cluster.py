"""``specmesh up``: target(s), draft and router as child processes on this machine.

Each child is ``python -m specmesh <service>`` on a free loopback port. The manager waits until
every child reports ready through ``grpc.health.v1`` (its service name SERVING), prints
``specmesh router ready on HOST:PORT`` and (unless ``--no-http``) ``specmesh http ready on
http://HOST:PORT`` (the OpenAI-compatible API, `--http-port`), then watches: Ctrl-C or SIGTERM
stops every child (SIGTERM, a grace period, then SIGKILL), and so does any child exiting on its
own.

Metrics: the router serves its own at ``/metrics`` on its HTTP port. ``--metrics-port N`` gives
each model service a port of its own, N + i for target i and the next one for the draft
(`metrics_ports`), and prints every address once ready; a ``--service-arg=--metrics-port`` would
give them all the same port, so it is refused.

With ``--tls-*`` every child gets the same files (so the certificate needs serverAuth and
clientAuth and a SAN for 127.0.0.1, plus the router's public name) and the health checks
connect with them; ``--api-key`` reaches the router through its environment, not its command
line (which any local user can read).
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass

from specmesh.defaults import resolve_models
from specmesh.rpc.security import API_KEY_ENV, TlsFiles, api_key_from_args, tls_from_args
from specmesh.up_flags import route

LOOPBACK = "127.0.0.1"
SERVICES = {
    "target": "specmesh.v1.Target",
    "draft": "specmesh.v1.Draft",
    "router": "specmesh.v1.Generation",
}


@dataclass
class Child:
    kind: str  # "target", "draft" or "router"
    address: str  # where its health service answers
    proc: subprocess.Popen


def free_port(host: str = LOOPBACK) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def run_cluster(args: argparse.Namespace) -> int:
    models = resolve_models(args.target_model, args.draft_model, args.draft_kind)
    refuse_metrics_service_arg(args.service_arg)
    with_draft = models.draft_kind is not None
    extra = route(args.router_arg, args.target_arg, args.draft_arg, args.service_arg, with_draft)
    metrics = metrics_ports(args.metrics_port, args.num_targets, with_draft)
    taken = [p for p in metrics if not _port_free(LOOPBACK, p)]
    if taken:
        raise ValueError(f"--metrics-port {args.metrics_port}: port(s) {taken} are taken")
    if args.port and not _port_free(args.host, args.port):
        raise ValueError(
            f"router port {args.host}:{args.port} is taken (another specmesh up or router?): "
            "stop it, or pass --port 0 for a free port"
        )
    tls = tls_from_args(args)
    api_key = api_key_from_args(args)
    children: list[Child] = []
    spawn = functools.partial(spawn_service, children, log_level=args.log_level, tls=tls)
    tp = args.tensor_parallel_size  # processes per target
    num_procs = args.num_targets * tp + (models.draft_kind is not None)
    threads = ["--threads", str(model_threads(num_procs))]
    gpu = _gpu_flags(extra.by_kind, with_draft)
    target_flags = ["--model", models.target, *_flag("--revision", args.target_revision)]
    target_flags += ["--tensor-parallel-size", str(tp), *threads, *gpu["target"]]
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        metrics_flag = lambda i: ["--metrics-port", str(metrics[i])] if metrics else []
        targets = [
            spawn("target", [*target_flags, *metrics_flag(i), *extra.by_kind["target"]])
            for i in range(args.num_targets)
        ]
        drafts = []
        if models.draft_kind is not None:
            draft_model = ["--model", models.draft] if models.draft else []
            draft_model += _flag("--revision", args.draft_revision) if models.draft else []
            flags = ["--kind", models.draft_kind, "--target-model", models.target, *draft_model]
            flags += _flag("--target-revision", args.target_revision)
            flags += [*metrics_flag(args.num_targets), *gpu["draft"]]
            drafts.append(spawn("draft", [*flags, *threads, *extra.by_kind["draft"]]))
        port = args.port or free_port(args.host)
        router = ["--target", ",".join(targets), "--draft", ",".join(drafts), "--threads", "1"]
        env = {**os.environ, API_KEY_ENV: api_key or ""}
        http_port = None if args.no_http else _http_port(args.host, args.http_port)
        if http_port is not None:
            router += ["--http-port", str(http_port)]
        router += ["--chat-template", args.chat_template] if args.chat_template else []
        router += _flag("--served-model-name", args.served_model_name) + gpu["router"]
        router += _shared_memory_flag(extra.by_kind["router"], with_draft)
        router += extra.by_kind["router"]
        spawn("router", router, host=args.host, port=port, env=env)
        wait_ready(children, args.ready_timeout, tls)
        print(f"specmesh router ready on {args.host}:{port}", flush=True)
        router_http = None
        if http_port is not None:  # the router serves HTTP before it reports ready
            scheme = "https" if tls and tls.cert_file else "http"
            router_http = f"{scheme}://{args.host}:{http_port}"
            print(f"specmesh http ready on {router_http}", flush=True)
        if metrics:
            _print_metrics(router_http, args.num_targets, metrics)
        return _watch(children)
    except KeyboardInterrupt:
        return 0
    except (RuntimeError, TimeoutError) as e:
        print(f"specmesh up: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the stop
        stop_all(children)
        signal.signal(signal.SIGTERM, previous)


def _flag(flag: str, value: str | None) -> list[str]:
    return [flag, value] if value else []


def _shared_memory_flag(router_args: list[str], with_draft: bool) -> list[str]:
    """`up` runs every process on this host as this user: with a draft, the router sends the
    feature rows through /dev/shm (``--shared-memory``, `protocol.shared_rows`) where there is
    one, unless its own flags decide."""
    from specmesh.protocol.shared_rows import SHM_DIR

    names = ("--shared-memory", "--no-shared-memory")
    given = any(a.split("=")[0] in names for a in router_args)
    return ["--shared-memory"] if with_draft and not given and SHM_DIR.is_dir() else []


def _gpu_flags(by_kind: dict[str, list[str]], with_draft: bool) -> dict[str, list[str]]:
    """Where CUDA is present: target and draft on one device, and the router one micro-batch
    when they share it (`device_defaults.shared_gpu_flags`); nothing on a CPU machine."""
    from specmesh.device_defaults import machine_facts, shared_gpu_flags

    return shared_gpu_flags(machine_facts().cuda, by_kind, with_draft)


def metrics_ports(first: int, num_targets: int, with_draft: bool) -> list[int]:
    """The model services' metrics ports for ``--metrics-port first``: target i at first + i,
    then the draft; none when ``first`` is 0."""
    if not first:
        return []
    ports = list(range(first, first + num_targets + with_draft))
    if first < 0 or ports[-1] > 65535:
        raise ValueError(f"--metrics-port {first}: needs ports {first} to {ports[-1]}")
    return ports


def _print_metrics(router_http: str | None, num_targets: int, ports: list[int]) -> None:
    """Where each process serves /metrics (the router: on its HTTP port, if it has one)."""
    if router_http is not None:
        print(f"specmesh metrics: router {router_http}/metrics", flush=True)
    for i, port in enumerate(ports):
        name = f"target-{i}" if i < num_targets else "draft"
        print(f"specmesh metrics: {name} http://{LOOPBACK}:{port}/metrics", flush=True)


def refuse_metrics_service_arg(service_args: list[str]) -> None:
    """``--service-arg=--metrics-port=N`` would hand every service the same port: the second
    to bind it dies, and `up` with it."""
    if any(a == "--metrics-port" or a.startswith("--metrics-port=") for a in service_args):
        raise ValueError(
            "--service-arg=--metrics-port gives target and draft the same port; use "
            "`specmesh up --metrics-port N` (target i on N+i, the draft next)"
        )


def _port_free(host: str, port: int) -> bool:
    """Whether a server could bind ``port`` now, binding as the routers do (``SO_REUSEADDR``:
    connections of a stopped run still in TIME_WAIT do not make it taken)."""
    try:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
        return True
    except OSError:
        return False


def _http_port(host: str, port: int) -> int:
    """``port``, or a free one when it is 0 or taken (the default 8000 often is)."""
    if port:
        if _port_free(host, port):
            return port
        print(f"specmesh up: HTTP port {port} is taken, using a free one", file=sys.stderr)
    return free_port(host)


def model_threads(num_model_services: int) -> int:
    """CPU threads per model service so that the services together use each core once (the
    router needs one); a GPU service barely uses its CPU threads either way."""
    import os

    return max(1, (os.cpu_count() or 1) // max(1, num_model_services))


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def spawn_service(
    children: list[Child],
    kind: str,
    flags: list[str],
    host: str = LOOPBACK,
    port: int = 0,
    log_level: str = "WARNING",
    tls: TlsFiles | None = None,
    env: dict[str, str] | None = None,
) -> str:
    port = port or free_port()
    cmd = [
        sys.executable,
        "-m",
        "specmesh",
        "--log-level",
        log_level,
        kind,
        "--host",
        host,
        "--port",
        str(port),
        *(tls.as_args() if tls else []),
        *flags,
    ]
    health_host = LOOPBACK if host in ("0.0.0.0", "::") else host
    children.append(Child(kind, f"{health_host}:{port}", subprocess.Popen(cmd, env=env)))
    return f"{LOOPBACK}:{port}"


def wait_ready(children: list[Child], timeout_s: float, tls: TlsFiles | None = None) -> None:
    from specmesh.rpc.health import check_health

    deadline = time.monotonic() + timeout_s
    for child in children:
        while not check_health(child.address, SERVICES[child.kind], 2.0, tls):
            _check_alive(child)
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"{child.kind} at {child.address} not ready after {timeout_s:.0f} s"
                )
            time.sleep(0.2)
    for child in children:  # a health answer from another process on the port is not ours
        _check_alive(child)


def _check_alive(child: Child) -> None:
    if child.proc.poll() is not None:
        raise RuntimeError(
            f"{child.kind} exited with code {child.proc.returncode} before it was ready"
        )


def _watch(children: list[Child]) -> int:
    """Block until a signal (KeyboardInterrupt) or until a child exits on its own."""
    while True:
        for child in children:
            if child.proc.poll() is not None:
                print(
                    f"specmesh up: {child.kind} exited with code {child.proc.returncode}; stopping",
                    file=sys.stderr,
                )
                return 1
        time.sleep(0.5)


def stop_all(children: list[Child], grace_s: float = 15.0) -> None:
    """SIGTERM the router first (it drains), then the model services; SIGKILL what remains."""
    for child in reversed(children):
        if child.proc.poll() is None:
            child.proc.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.proc.kill()
            child.proc.wait()
