"""The stages of a speculative round as timed spans, for `bench.round_timeline`.

`install` wraps each function of `STAGES` (router, draft and target service, in whichever
process imports it) so that, while a `Spans` recorder is on, every call leaves a span: its
label, the OS thread it ran on and its start and end on the system-wide monotonic clock (the
same in every process of one machine, so the spans of the three cluster processes line up).
The services' code is untouched: the bench patches it in its own processes only.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# (module, function or Class.method, label). Nested labels (a replay inside a verify) are fine:
# the analysis gives device work to the innermost span that launched it.
STAGES: tuple[tuple[str, str, str], ...] = (
    ("specmesh.router.round", "RoundRunner._round", "round"),
    ("specmesh.router.replica", "DraftReplica.step", "router.draft_call"),
    ("specmesh.router.replica", "TargetReplica.verify", "router.verify_call"),
    ("specmesh.router.round", "RoundRunner._emit", "router.emit"),
    ("specmesh.router.step_stream", "StepStream._write", "router.stream_write"),
    ("specmesh.router.step_stream", "StepStream._answer", "router.stream_wait"),
    ("specmesh.rpc.wire", "Reassembler.add", "wire.arrive"),  # a message read, any process
    ("specmesh.rpc.service_common", "ModelServicer._step", "service.step"),
    ("specmesh.rpc.service_common", "ModelServicer._answer", "service.answer"),
    ("specmesh.draft_service.server", "DraftServicer.run_batch", "draft.rpc_batch"),
    ("specmesh.draft_service.server", "DraftServicer._decode_states", "draft.decode_rows"),
    ("specmesh.draft_service.server", "DraftServicer._result", "draft.encode"),
    ("specmesh.draft_service.runtime", "DraftRuntime._extend", "draft.extend"),
    ("specmesh.draft_service.runtime", "DraftRuntime._propose", "draft.propose"),
    ("specmesh.draft_service.drafter", "TreeDrafter._expand", "draft.expand_step"),
    ("specmesh.draft_service.drafter", "select_tree", "draft.select_tree"),
    ("specmesh.draft_service.search_graph", "SearchGraphs.replay", "draft.search_graph"),
    ("specmesh.target_service.server", "TargetServicer.run_batch", "target.rpc_batch"),
    ("specmesh.target_service.server", "TargetServicer._response", "target.encode"),
    ("specmesh.target_service.runtime", "TargetRuntime.verify", "target.verify"),
    ("specmesh.target_service.verify", "verify_rows", "target.rows"),
    ("specmesh.target_service.verify", "run_batch", "target.forward_eager"),
    ("specmesh.target_service.verify", "accept_trees", "target.accept"),
    ("specmesh.target_service.verify", "keep", "target.keep"),
    ("specmesh.runtime.models.causal_lm", "CausalLM.compute_logits", "lm_head"),
    ("specmesh.runtime.graph_runner", "GraphRunner.replay", "graph_replay"),
)


@dataclass
class Spans:
    """Spans recorded while ``on``: (label, thread, start ns, end ns), monotonic clock. The
    thread is the low 32 bits of its pthread id: what the CUDA profiler's trace names it by."""

    on: bool = False
    rows: list[tuple[str, int, int, int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, label: str, start_ns: int) -> None:
        row = (label, threading.get_ident() & 0xFFFFFFFF, start_ns, time.monotonic_ns())
        with self.lock:
            self.rows.append(row)

    def take(self) -> list[tuple[str, int, int, int]]:
        with self.lock:
            rows, self.rows = self.rows, []
        return rows


def _wrapped(fn: Callable, label: str, spans: Spans) -> Callable:
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def timed_async(*args: Any, **kwargs: Any) -> Any:
            if not spans.on:
                return await fn(*args, **kwargs)
            start = time.monotonic_ns()
            try:
                return await fn(*args, **kwargs)
            finally:
                spans.add(label, start)

        return timed_async

    @functools.wraps(fn)
    def timed(*args: Any, **kwargs: Any) -> Any:
        if not spans.on:
            return fn(*args, **kwargs)
        start = time.monotonic_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            spans.add(label, start)

    return timed


def install(spans: Spans, stages: tuple[tuple[str, str, str], ...] = STAGES) -> None:
    """Wrap every stage function (once per process) so that it records into ``spans``."""
    for module_name, path, label in stages:
        owner: Any = importlib.import_module(module_name)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        fn = inspect.getattr_static(owner, name)
        if getattr(fn, "_timeline_label", None):
            continue  # installed already
        timed = _wrapped(fn, label, spans)
        timed._timeline_label = label  # type: ignore[attr-defined]
        setattr(owner, name, timed)
