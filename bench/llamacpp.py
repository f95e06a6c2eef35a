"""llama.cpp as the CPU reference: the target converted to GGUF (f32 for fp32, bf16 for bf16),
run by ``llama-cpp-python`` in a process of its own (`bench/llamacpp_worker.py`) with the same
token ids, thread count and greedy decoding. Optional: the side is skipped, with the reason
printed and recorded in ``meta.skipped``, when the interpreter cannot import ``llama_cpp`` or
the GGUF file is missing. bench/README.md has the build and conversion steps.
"""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

from specmesh.bench.metrics import RequestTrace
from specmesh.bench.runners import RunSpec, result

WORKER = Path(__file__).with_name("llamacpp_worker.py")
GGUF_NAMES = {"fp32": "target-f32.gguf", "bf16": "target-bf16.gguf"}


def gguf_path(gguf_dir: str, dtype: str) -> Path:
    return Path(gguf_dir) / GGUF_NAMES[dtype]


def unavailable(python: str, gguf_dir: str, dtype: str) -> str | None:
    """Why the llama.cpp side cannot run in ``dtype`` (None when it can)."""
    try:
        probe = subprocess.run([python, "-c", "import llama_cpp"], capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{python} does not run: {e}"
    if probe.returncode != 0:
        return f"{python} cannot import llama_cpp (give --llamacpp-python; bench/README.md)"
    path = gguf_path(gguf_dir, dtype)
    return None if path.is_file() else f"no {path} (convert the target: bench/README.md)"


def job(run: RunSpec, gguf_dir: str, threads: int, prompts: list[list[int]]) -> dict[str, Any]:
    if run.batch_size != 1 or run.spec is not None or run.temperature != 0.0:
        raise ValueError("the llama.cpp side runs greedy, plain decoding at batch 1")
    return {
        "model_path": str(gguf_path(gguf_dir, run.dtype)), "threads": threads,
        "prompts": prompts, "max_new_tokens": run.max_new_tokens,
        "num_requests": run.num_requests,
        "n_ctx": max(len(p) for p in prompts) + run.max_new_tokens + 8,
    }  # fmt: skip


def to_result(run: RunSpec, raw: dict[str, Any]) -> dict[str, Any]:
    traces = []
    for t in raw["traces"]:
        trace = RequestTrace(t["submit_s"])
        for at in t["chunk_s"]:
            trace.add_chunk(at, 1)
        traces.append(trace)
    wall_s = raw["wall_s"]
    split = {
        "wall_s": wall_s, "target_s": wall_s, "draft_s": 0.0, "router_s": 0.0, "network_s": 0.0,
        "note": f"llama.cpp {raw['llama_cpp']}: the whole loop counts as target time",
    }  # fmt: skip
    out = result(run, traces, wall_s, split, 0, "none")
    return out | {"pid": raw["pid"], "threads": raw["threads"]}
