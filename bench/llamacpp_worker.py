"""llama.cpp side of ``specmesh bench``, run by an interpreter that has ``llama_cpp``:

    PYTHON bench/llamacpp_worker.py --json-config JOB.json

Standard library and ``llama_cpp`` only (it runs outside specmesh's environment). The job names
the GGUF file, the thread count, the prompts (token ids of the target's tokenizer, fed to
llama.cpp as ids, so both sides see the same tokens), max_new_tokens and num_requests. Greedy
decoding (top-k 1, temperature 0, no repetition penalty), one request at a time, EOS ignored:
exactly max_new_tokens per request. Prints one JSON line: per-request submission and token
times, wall time, pid and threads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

WARMUP_TOKENS = 4


def generate(llm, prompt: list[int], max_new_tokens: int) -> list[float]:
    """Arrival time of each generated token; the KV cache starts empty (no prefix reuse)."""
    llm.reset()
    times: list[float] = []
    tokens = llm.generate(prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0)
    for _token in tokens:
        times.append(time.perf_counter())
        if len(times) == max_new_tokens:
            break
    return times


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json-config", required=True, metavar="FILE")
    with open(parser.parse_args(argv).json_config) as f:
        job = json.load(f)
    import llama_cpp

    prompts, threads = job["prompts"], job["threads"]
    llm = llama_cpp.Llama(
        model_path=job["model_path"], n_ctx=job["n_ctx"], n_batch=job["n_ctx"],
        n_threads=threads, n_threads_batch=threads, verbose=False,
    )  # fmt: skip
    generate(llm, prompts[0], WARMUP_TOKENS)
    traces = []
    start = time.perf_counter()
    for i in range(job["num_requests"]):
        submit_s = time.perf_counter()
        traces.append({"submit_s": submit_s, "chunk_s": generate(llm, prompts[i % len(prompts)], job["max_new_tokens"])})  # fmt: skip
    out = {
        "wall_s": time.perf_counter() - start, "traces": traces, "pid": os.getpid(),
        "threads": threads, "llama_cpp": llama_cpp.__version__,
    }  # fmt: skip
    sys.stdout.write(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
