"""``specmesh up`` serves the OpenAI-compatible HTTP API beside gRPC: it prints both addresses,
the official `openai` client gets completions (plain and streamed) and chat from it, with the
API key handed to the router, and Ctrl-C stops everything. A router killed with HTTP
connections open restarts on its HTTP port at once."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import openai
import pytest
from http_raw import connect, read_response, send_head

from specmesh.cluster import free_port

pytestmark = pytest.mark.slow

SPECMESH = [sys.executable, "-m", "specmesh"]
KEY = "sk-e2e"


def test_up_serves_openai_http(tmp_path: Path, tiny_dir: Path) -> None:
    models = ["--target-model", str(tiny_dir / "target"), "--draft-model", str(tiny_dir / "draft")]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    cmd = [*SPECMESH, "up", "--port", "0", "--http-port", "0", *models, "--draft-kind", "eagle3"]
    cmd += ["--api-key", KEY, "--chat-template", str(template)]
    cmd += ["--router-arg=--max-stop-strings", "--router-arg=1"]  # reaches the router (below)
    log = tmp_path / "up.log"
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)  # noqa: SIM115
    try:
        grpc_line, http_line = up.stdout.readline(), up.stdout.readline()
        assert grpc_line.startswith("specmesh router ready on "), log.read_text()
        assert http_line.startswith("specmesh http ready on http://"), log.read_text()
        base = http_line.split()[-1]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=KEY, max_retries=0)
        name = client.models.list().data[0].id
        assert name == "target"
        args = dict(model=name, prompt="def fib(n):", max_tokens=8, temperature=0.0)
        whole = client.completions.create(**args, extra_body={"ignore_eos": True})
        assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
        streamed = client.completions.create(**args, stream=True, extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
        chat = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
        )
        assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError, match="stop"):  # --max-stop-strings 1
            client.completions.create(**args, stop=["a", "b"])
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, log.read_text()


def _router(port: int, log: Path) -> subprocess.Popen:
    """A router whose target never answers: it serves HTTP (503) while it keeps connecting."""
    cmd = [*SPECMESH, "router", "--target", "127.0.0.1:1", "--port", "0"]
    cmd += ["--http-port", str(port), "--connect-timeout", "600"]
    with open(log, "a") as out:  # the child keeps its own copy
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)


def _wait_http(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + 120
    while True:
        assert proc.poll() is None, log.read_text()
        try:
            with connect(port, 5) as sock:
                send_head(sock, "GET", "/health", {"Connection": "close"})
                assert read_response(sock).status == 503
                return
        except OSError:
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)


def test_router_killed_with_open_http_connections_rebinds_at_once(tmp_path: Path) -> None:
    """SIGKILL leaves the dead router's connections in FIN_WAIT / TIME_WAIT on its HTTP port;
    the next router binds it at once (SO_REUSEADDR), while a live one still keeps it."""
    port, log = free_port(), tmp_path / "router.log"
    first = _router(port, log)
    second = None
    socks: list[socket.socket] = []
    try:
        _wait_http(first, port, log)
        for _ in range(4):  # keep-alive connections, each after an answered request
            sock = connect(port)
            send_head(sock, "GET", "/health")
            assert read_response(sock).status == 503
            socks.append(sock)
        sock = connect(port)  # and one in the middle of sending a body
        send_head(sock, "POST", "/v1/completions", {"Content-Length": "100"})
        sock.sendall(b'{"model": ')
        socks.append(sock)
        taken = _router(port, tmp_path / "taken.log")  # the port is still exclusive
        assert taken.wait(120) != 0 and "cannot listen" in (tmp_path / "taken.log").read_text()
        first.kill()
        first.wait()
        second = _router(port, log)
        _wait_http(second, port, log)
    finally:
        for sock in socks:
            sock.close()
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
