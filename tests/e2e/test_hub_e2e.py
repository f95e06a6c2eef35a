"""``specmesh up`` with Hugging Face ids for target and draft, found through the environment
alone (``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE=1``, read by every service process) in a Hub cache
built on disk (`tests/hub_cache.py`): the cluster serves them, the router under the Hub id
(GetInfo's model_path) and ``--served-model-name`` (/v1/models, the official openai client)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from hub_cache import DRAFT_ID, TARGET_ID, make_hub, offline_env

from specmesh.client import GenerationClient

pytestmark = pytest.mark.slow


def test_up_serves_hub_ids_offline(tmp_path: Path) -> None:
    env = offline_env(make_hub(tmp_path))
    cmd = [sys.executable, "-m", "specmesh", "up", "--port", "0", "--http-port", "0"]
    cmd += ["--target-model", TARGET_ID, "--draft-model", DRAFT_ID, "--draft-kind", "eagle3"]
    cmd += ["--served-model-name", "tiny-chat", "--service-arg=--max-context=128"]
    log = tmp_path / "up.log"
    up = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(log, "w"), text=True, env=env)  # noqa: SIM115
    try:
        grpc_line, http_line = up.stdout.readline(), up.stdout.readline()
        assert grpc_line.startswith("specmesh router ready on "), log.read_text()
        client = openai.OpenAI(base_url=f"{http_line.split()[-1]}/v1", api_key="-", max_retries=0)
        assert [m.id for m in client.models.list().data] == ["tiny-chat"]
        r = client.completions.create(model="tiny-chat", prompt="def f():", max_tokens=4)
        assert r.usage.completion_tokens >= 1
        with GenerationClient(grpc_line.split()[-1]) as grpc_client:
            info = grpc_client.info()
        assert (info.model_name, info.model_path, info.draft_kind) == (
            "tiny-chat", TARGET_ID, "eagle3")  # fmt: skip
        assert "specmesh target: device cpu, dtype fp32, attention torch" in log.read_text()
    finally:
        up.send_signal(signal.SIGINT)
        assert up.wait(60) == 0, log.read_text()
