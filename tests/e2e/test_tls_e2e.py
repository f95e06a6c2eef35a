"""``specmesh up`` with TLS files and an API key, driven only through the command line: every
hop is TLS (mTLS between the router and its services), ``specmesh generate --router`` with
``--tls-ca-file`` and the key (flag or ``SPECMESH_API_KEY``) gets transformers' greedy output, a
text prompt is tokenized (the router fetched the target's tokenizer over mTLS), ``specmesh
health`` answers over TLS without the key, a second process asking for the router's live port
fails with a clear error, and the router stays TLS-only and key-protected."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from certs import make_certs

from specmesh.client import GenerationClient
from specmesh.rpc.health import check_health
from specmesh.rpc.security import API_KEY_ENV, TlsFiles

pytestmark = pytest.mark.slow

SPECMESH = [sys.executable, "-m", "specmesh"]
KEY = "e2e-key"


def specmesh(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``specmesh ARGS`` started in the background (the commands run side by side: each spends
    seconds importing torch), without any inherited SPECMESH_API_KEY."""
    clean = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    return subprocess.Popen(
        [*SPECMESH, *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**clean, **(env or {})},
    )


def finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=120)
    return proc.returncode, out, err


def test_up_over_tls_with_an_api_key(tmp_path: Path, tiny_dir: Path, oracle) -> None:
    certs = make_certs(tmp_path / "certs")
    tls = ["--tls-cert-file", str(certs.service_cert), "--tls-key-file", str(certs.service_key)]
    tls += ["--tls-ca-file", str(certs.ca)]
    models = ["--target-model", str(tiny_dir / "target"), "--draft-model", str(tiny_dir / "draft")]
    up = subprocess.Popen(
        [*SPECMESH, "up", "--port", "0", *models, "--draft-kind", "eagle3", *tls, "--api-key", KEY],
        stdout=subprocess.PIPE,
        stderr=open(tmp_path / "up.log", "w"),  # noqa: SIM115
        text=True,
        start_new_session=True,  # its services share its process group: a failure kills them all
    )
    try:
        line = up.stdout.readline()  # blocks until ready (or until `up` dies)
        assert line.startswith("specmesh router ready on "), (tmp_path / "up.log").read_text()
        address = line.split()[-1]
        port = address.rsplit(":", 1)[1]
        ca = ["--tls-ca-file", str(certs.ca)]  # the public port asks for no client certificate
        prompt, n = [5, 6, 7, 8], 12
        ids = ["--prompt-ids", "5,6,7,8", "--max-new-tokens", str(n), "--ignore-eos", "--json"]
        text = ["--prompt", "def add(a, b):", "--max-new-tokens", "4", "--json"]
        health = ["health", address, "--service", "specmesh.v1.Generation", "--timeout", "5"]
        by_flag = specmesh("generate", "--router", address, *ca, "--api-key", KEY, *ids)
        by_env = specmesh("generate", "--router", address, *ca, *text, env={API_KEY_ENV: KEY})
        probe = specmesh(*health, *ca)  # health needs no key
        second = specmesh("target", "--model", str(tiny_dir / "target"), "--port", port, *tls)

        code, out, err = finish(by_flag)
        assert code == 0, err
        assert json.loads(out)["token_ids"] == oracle(tiny_dir / "target", prompt, n)
        code, out, err = finish(by_env)
        assert code == 0, err
        assert json.loads(out)["prompt_tokens"] > 0  # tokenized: GetTokenizer over mTLS worked
        assert finish(probe)[0] == 0
        code, _, err = finish(second)
        assert code == 2 and f"cannot listen on 127.0.0.1:{port}" in err

        public = TlsFiles(ca_file=str(certs.ca))
        assert check_health(address, "specmesh.v1.Generation", tls=public)  # still the router's
        assert not check_health(address, timeout_s=2.0)  # plaintext gets nowhere
        with GenerationClient(address, tls=public) as anonymous:
            with pytest.raises(grpc.RpcError) as e:
                anonymous.info()
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED

        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):  # `up` and whatever it left running
            os.killpg(up.pid, signal.SIGKILL)
        up.wait()
