"""A DeepSeek-V3-class target served over gRPC (router + target, no draft): concurrent requests,
one prefilled in pieces of 8 tokens, give transformers' greedy tokens, from a cache of one latent
vector per token and layer."""

from __future__ import annotations

import threading
from pathlib import Path

from conftest import hf_greedy
from grpc_harness import LoopThread, collect, greedy, serve_router, serve_target

from specmesh.client import GenerationClient
from specmesh.protocol.config import TargetConfig
from specmesh.target_service.runtime import TargetRuntime

PROMPTS = [[5, 6, 7, 8, 9, 10], list(range(60, 80)), [40, 41, 42]]


def test_deepseek_target_over_grpc_equals_transformers(tiny_deepseek_dir: Path) -> None:
    d = str(tiny_deepseek_dir)
    loop = LoopThread()
    target = loop.run(serve_target(TargetRuntime(TargetConfig(d))))
    router = loop.run(serve_router(target, prefill_chunk_tokens=8))
    client = GenerationClient(f"127.0.0.1:{router.port}")
    results: dict[int, list[int]] = {}

    def run(k: int) -> None:
        call = client.generate(prompt_token_ids=PROMPTS[k], sampling=greedy(12), timeout=60)
        results[k] = collect(call)[0]

    try:
        threads = [threading.Thread(target=run, args=(k,)) for k in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for k, prompt in enumerate(PROMPTS):
            assert results[k] == hf_greedy(d, prompt, 12), k
        pool = target.runtime.cache.pools[0]
        assert pool.k.shape[1:] == (1, 32 + 8)  # kv_lora_rank + qk_rope_head_dim, one head
    finally:
        client.close()
        loop.run(router.stop(0.5))
        loop.run(target.host.shutdown(0.5))
        loop.close()
