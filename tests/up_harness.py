"""``specmesh up`` with its real command lines and no processes: every child is "up" at once."""

from __future__ import annotations

import pytest

from specmesh import cluster
from specmesh.cli.main import main


class _Proc:
    """A child that is up at once and stops when told."""

    returncode = None

    def poll(self) -> int | None:
        return self.returncode

    def terminate(self) -> None:
        self.returncode = 0

    kill = terminate

    def wait(self, timeout: float | None = None) -> int:
        return 0


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[list[str]]]:
    """The command line of every child `up` starts, by service kind."""
    commands: dict[str, list[list[str]]] = {}

    def popen(cmd: list[str], env: dict | None = None) -> _Proc:
        commands.setdefault(cmd[cmd.index("specmesh") + 3], []).append(cmd)
        return _Proc()

    monkeypatch.setattr(cluster.subprocess, "Popen", popen)
    monkeypatch.setattr(cluster, "wait_ready", lambda *args: None)
    monkeypatch.setattr(cluster, "_watch", lambda children: 0)
    return commands


def up(*flags: str) -> int:
    models = ["--target-model", "t", "--draft-model", "d", "--port", "0", "--http-port", "0"]
    return main(["up", *models, *flags])
