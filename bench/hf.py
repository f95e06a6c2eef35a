"""The ``transformers`` baselines: ``model.generate`` on the same checkpoint, dtype and prompts,
always in a worker process of its own (`bench.worker`).

- plain: greedy ``generate``; a batch of ``batch_size`` prompts is one left-padded call (the
  prompts have equal length, so the padding is empty, but the mask is built as for any batch);
- ``ngram`` drafting -> prompt lookup, ``prompt_lookup_num_tokens = num_draft_tokens - 1`` (the
  most tokens specmesh's n-gram drafter proposes) and ``max_matching_ngram_size = 3`` (its
  longest match);
- ``standalone`` drafting -> assisted generation, ``assistant_model=`` the same draft checkpoint
  specmesh loads, ``num_assistant_tokens = num_steps`` (transformers' other assisted-generation
  defaults kept: constant schedule, confidence threshold 0.4).

transformers drafts for one sequence at a time, so its drafting baselines run at batch 1. A
streamer stamps each step, so TTFT and inter-token latency are measured the way the router's are
(a drafting step's chunk carries every token it accepted).
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
        drafting = value.dim() == 2  # [1, accepted + bonus] per drafting round, else [batch]
        num_tokens = value.shape[-1] if drafting else 1
        for trace in self.traces:
            trace.add_chunk(now, num_tokens)
            trace.accept_lens += [num_tokens] if drafting else []

    def end(self) -> None:
        pass


DRAFT_KINDS = ("ngram", "standalone")  # the drafting transformers has a counterpart of


def drafting_options(spec: RunSpec) -> dict[str, Any]:
    """The ``generate`` arguments of the run's drafting (none for plain decoding)."""
    s = spec.spec
    if s is None:
        return {}
    if spec.draft_kind == "ngram":
        return {"prompt_lookup_num_tokens": s.num_draft_tokens - 1, "max_matching_ngram_size": 3}
    if spec.draft_kind == "standalone":
        return {"num_assistant_tokens": s.num_steps}
    raise ValueError(f"transformers has no counterpart of {spec.draft_kind!r} drafting")


class TransformersBackend:
    def __init__(
        self,
        model_dir: str,
        dtype: torch.dtype,
        pad_token_id: int,
        draft_dir: str | None = None,
        device: str = "cpu",
    ) -> None:
        from transformers import AutoModelForCausalLM

        load = lambda path: (
            AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
        )
        self.device = device
        self.model = load(model_dir)
        self.assistant = load(draft_dir) if draft_dir else None
        self.pad_token_id = pad_token_id

    def run(self, spec: RunSpec, prompts: list[list[int]]) -> dict[str, Any]:
        options = drafting_options(spec)
        if spec.draft_kind == "standalone":
            if self.assistant is None:
                raise ValueError("assisted generation needs the standalone draft's directory")
            options["assistant_model"] = self.assistant
        if spec.temperature != 0.0 or (spec.spec is not None and spec.batch_size != 1):
            raise ValueError("the transformers baselines run greedy, drafting at batch 1 only")
        self.generate([prompts[0]], 4, [RequestTrace(0)], options)  # warm-up
        rows = [prompts[i % len(prompts)] for i in range(spec.num_requests)]
        traces: list[RequestTrace] = []
        start = time.perf_counter()
        for i in range(0, len(rows), spec.batch_size):
            batch = rows[i : i + spec.batch_size]
            batch_traces = [RequestTrace(time.perf_counter()) for _ in batch]
            self.generate(batch, spec.max_new_tokens, batch_traces, options)
            traces += batch_traces
        wall_s = time.perf_counter() - start
        split = {
            "wall_s": wall_s, "target_s": wall_s, "draft_s": 0.0, "router_s": 0.0, "network_s": 0.0,
            "note": "transformers generate: the whole loop counts as target time",
        }  # fmt: skip
        return result(spec, traces, wall_s, split, 0, "none")

    def generate(
        self,
        batch: list[list[int]],
        max_new_tokens: int,
        traces: list[RequestTrace] | None = None,
        options: dict[str, Any] | None = None,
    ) -> None:
        """One greedy left-padded ``generate`` call of exactly ``max_new_tokens`` per prompt;
        with ``traces``, each step's arrival is recorded in them (a streamer on the loop)."""
        width = max(len(p) for p in batch)
        ids = torch.tensor(
            [[self.pad_token_id] * (width - len(p)) + p for p in batch], device=self.device
        )  # [B, width]
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in batch], device=self.device
        )  # [B, width]
        with torch.inference_mode():
            out = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=self.pad_token_id,
                streamer=None if traces is None else StepClock(traces),
                **(options or {}),
            )
        if out.shape[1] - width != max_new_tokens:
            raise RuntimeError(f"generate made {out.shape[1] - width} tokens, not {max_new_tokens}")
