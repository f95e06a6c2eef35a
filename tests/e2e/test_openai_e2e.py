"""``specmesh up`` serves the OpenAI-compatible HTTP API beside gRPC: it prints both addresses,
the official `openai` client gets completions (plain and streamed) and chat from it, with the
API key handed to the router, and Ctrl-C stops everything."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest

pytestmark = pytest.mark.slow

SPECMESH = [sys.executable, "-m", "specmesh"]
KEY = "sk-e2e"


def test_up_serves_openai_http(tmp_path: Path, tiny_dir: Path) -> None:
    models = ["--target-model", str(tiny_dir / "target"), "--draft-model", str(tiny_dir / "draft")]
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}\n{% endfor %}")
    cmd = [*SPECMESH, "up", "--port", "0", "--http-port", "0", *models, "--draft-kind", "eagle3"]
    cmd += ["--api-key", KEY, "--chat-template", str(template)]
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
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, log.read_text()
