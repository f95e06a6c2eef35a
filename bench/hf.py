"""The ``transformers`` baseline: ``model.generate`` on the same checkpoint, dtype and prompts.

A batch of ``batch_size`` prompts is one left-padded ``generate`` call (the prompts have equal
length, so the padding is empty, but the mask is built as for any batch); batches run one after
another. A streamer stamps each decoding step, so TTFT and inter-token latency are measured the
same way as for the router (one token per step per request).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from transformers.generation.streamers import BaseStreamer

from specmesh.bench.metrics import RequestTrace
from specmesh.bench.runners import RunSpec, result


class StepClock(BaseStreamer):
    """A ``transformers`` streamer that records when each step's tokens arrive."""

    def __init__(self, traces: list[RequestTrace]) -> None:
        self.traces, self.seen_prompt = traces, False

    def put(self, value: torch.Tensor) -> None:
        if not self.seen_prompt:  # generate() first puts the prompt ids
            self.seen_prompt = True
            return
        now = time.perf_counter()
        for trace in self.traces:
            trace.add_chunk(now, 1)

    def end(self) -> None:
        pass


class TransformersBackend:
    def __init__(self, model_dir: str, dtype: torch.dtype, pad_token_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).eval()
        self.pad_token_id = pad_token_id

    def run(self, spec: RunSpec, prompts: list[list[int]]) -> dict[str, Any]:
        if spec.temperature != 0.0 or spec.spec is not None:
            raise ValueError("the transformers baseline runs greedy, plain decoding only")
        self._generate([prompts[0]], 4, [RequestTrace(0)])  # warm-up
        rows = [prompts[i % len(prompts)] for i in range(spec.num_requests)]
        traces: list[RequestTrace] = []
        start = time.perf_counter()
        for i in range(0, len(rows), spec.batch_size):
            batch = rows[i : i + spec.batch_size]
            batch_traces = [RequestTrace(time.perf_counter()) for _ in batch]
            self._generate(batch, spec.max_new_tokens, batch_traces)
            traces += batch_traces
        wall_s = time.perf_counter() - start
        split = {
            "wall_s": wall_s, "target_s": wall_s, "draft_s": 0.0, "router_s": 0.0, "network_s": 0.0,
            "note": "transformers generate: the whole loop counts as target time",
        }  # fmt: skip
        return result(spec, traces, wall_s, split, 0, "none")

    def _generate(self, batch: list[list[int]], max_new_tokens: int, traces: list) -> None:
        width = max(len(p) for p in batch)
        ids = torch.tensor(
            [[self.pad_token_id] * (width - len(p)) + p for p in batch]
        )  # [B, width]
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])  # [B, width]
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.pad_token_id,
                streamer=StepClock(traces),
            )
        if out.shape[1] - width != max_new_tokens:
            raise RuntimeError(f"generate made {out.shape[1] - width} tokens, not {max_new_tokens}")
