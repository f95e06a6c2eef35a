"""``specmesh bench --http URL``: the bench workload against an OpenAI-compatible server's
``/v1/completions`` (specmesh's own HTTP API, vLLM, SGLang...), so figures compare with
``vllm bench serve``-style clients. Token-id prompts, greedy or sampled, EOS ignored,
``batch`` requests in flight; streamed, so TTFT is measured too. Standard library only."""

from __future__ import annotations

import json
import statistics
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass


@dataclass(frozen=True)
class HttpResult:
    batch_size: int
    num_requests: int
    completion_tokens: int
    wall_s: float
    ttft_p50_s: float
    latency_p50_s: float

    @property
    def tokens_per_s(self) -> float:
        return self.completion_tokens / self.wall_s if self.wall_s else 0.0


def served_model(url: str, api_key: str | None = None) -> str:
    with urllib.request.urlopen(_request(f"{url}/v1/models", None, api_key), timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def run_http(
    url: str, prompts: list[list[int]], max_new_tokens: int, batch_size: int,
    temperature: float = 0.0, api_key: str | None = None,
) -> HttpResult:  # fmt: skip
    """Every prompt once, ``batch_size`` at a time; tokens/s = completion tokens / wall time."""
    url = url.rstrip("/")
    model = served_model(url, api_key)
    body = lambda prompt: {
        "model": model, "prompt": prompt, "max_tokens": max_new_tokens, "stream": True,
        "temperature": temperature, "ignore_eos": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    start = time.perf_counter()
    with ThreadPoolExecutor(batch_size) as pool:
        runs = list(pool.map(lambda p: _one(f"{url}/v1/completions", body(p), api_key), prompts))
    wall = time.perf_counter() - start
    return HttpResult(
        batch_size, len(prompts), sum(r[0] for r in runs), wall,
        statistics.median(r[1] for r in runs), statistics.median(r[2] for r in runs),
    )  # fmt: skip


def _one(url: str, body: dict, api_key: str | None) -> tuple[int, float, float]:
    """(completion tokens, time to first text, latency) of one streamed request."""
    start = time.perf_counter()
    first, tokens = None, 0
    with urllib.request.urlopen(_request(url, body, api_key), timeout=600) as r:
        for line in r:
            data = line.decode().strip().removeprefix("data: ")
            if not data or data == "[DONE]" or not line.startswith(b"data: "):
                continue
            event = json.loads(data)
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']['message']}")
            if first is None and any(c.get("text") for c in event.get("choices", [])):
                first = time.perf_counter() - start
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
    latency = time.perf_counter() - start
    return tokens, latency if first is None else first, latency


def _request(url: str, body: dict | None, api_key: str | None) -> urllib.request.Request:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    return urllib.request.Request(url, data=data, headers=headers)


def format_results(url: str, results: list[HttpResult]) -> str:
    lines = [f"{url}/v1/completions", "batch  requests  tokens  wall_s  tokens/s  ttft_p50  p50_s"]
    for r in results:
        lines.append(
            f"{r.batch_size:5d}  {r.num_requests:8d}  {r.completion_tokens:6d}  {r.wall_s:6.2f}  "
            f"{r.tokens_per_s:8.1f}  {r.ttft_p50_s:8.3f}  {r.latency_p50_s:5.2f}"
        )
    return "\n".join(lines)
