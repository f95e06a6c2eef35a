"""``specmesh up --metrics-port N``: each model service gets a metrics port of its own (target i
on N + i, the draft next), every address is printed once ready, and a ``--service-arg`` that
would hand them all one port (the second service to bind it dies, and `up` with it) is refused
before anything starts. The command lines are the real ones `up` builds; only the processes
are not started."""

from __future__ import annotations

import socket

import pytest
from up_harness import up

from specmesh import cluster


def _metrics_port(cmd: list[str]) -> int | None:
    return int(cmd[cmd.index("--metrics-port") + 1]) if "--metrics-port" in cmd else None


def _free_ports(n: int) -> int:
    """The first of ``n`` consecutive free loopback ports."""
    for _ in range(50):
        first = cluster.free_port()
        if first + n <= 65536 and all(cluster._port_free("127.0.0.1", first + i) for i in range(n)):
            return first
    pytest.skip(f"no {n} consecutive free ports")


def test_services_get_distinct_metrics_ports(started, capsys) -> None:
    first = _free_ports(3)
    assert up("--num-targets", "2", "--metrics-port", str(first)) == 0
    targets, (draft,), (router,) = started["target"], started["draft"], started["router"]
    assert [_metrics_port(c) for c in targets] == [first, first + 1]
    assert _metrics_port(draft) == first + 2 and _metrics_port(router) is None
    printed = [line for line in capsys.readouterr().out.splitlines() if "metrics:" in line]
    http = router[router.index("--http-port") + 1]
    assert printed == [
        f"specmesh metrics: router http://127.0.0.1:{http}/metrics",
        f"specmesh metrics: target-0 http://127.0.0.1:{first}/metrics",
        f"specmesh metrics: target-1 http://127.0.0.1:{first + 1}/metrics",
        f"specmesh metrics: draft http://127.0.0.1:{first + 2}/metrics",
    ]


def test_no_metrics_ports_by_default(started, capsys) -> None:
    assert up() == 0
    assert all(_metrics_port(c) is None for cmds in started.values() for c in cmds)
    assert "metrics:" not in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags",
    [["--service-arg=--metrics-port=9400"], ["--service-arg=--metrics-port", "--service-arg=9400"]],
)
def test_a_service_metrics_port_is_refused(started, capsys, flags: list[str]) -> None:
    assert up(*flags) == 2
    err = capsys.readouterr().err
    assert "gives target and draft the same port" in err and "up --metrics-port N" in err
    assert not started  # refused before any process started


def test_a_taken_metrics_port_is_refused(started, capsys) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        assert up("--metrics-port", str(port)) == 2  # the target's port is taken
    err = capsys.readouterr().err
    assert f"--metrics-port {port}: port(s) [{port}" in err and "are taken" in err
    assert not started


def test_up_sends_feature_rows_through_shared_memory_unless_told(started) -> None:
    """All of `up`'s processes share this host: its router gets ``--shared-memory``, unless a
    ``--router-arg`` decides."""
    from specmesh.protocol.shared_rows import SHM_DIR

    if not SHM_DIR.is_dir():
        pytest.skip("no /dev/shm")
    assert up() == 0
    assert "--shared-memory" in started["router"][0]
    started.clear()
    assert up("--router-arg=--no-shared-memory") == 0
    assert "--shared-memory" not in started["router"][0]
