"""`OnlineLearner`: the draft's head trains on the traffic it serves, on a thread of its own.

Two threads touch it, each with its own side:

    draft thread    observe(extends)   rows of each extend into the buffer (a copy of the rows)
                    swap()             a published version into the served module, in place,
                                       before an extend: every step runs one version
                    forget(rid)        the request ended
    trainer thread  update()           `steps_per_update` optimizer steps on windows of the
                                       buffer (yielding between them), the guard's verdict, then
                                       publish (+ checkpoint) or roll back

The trainer never writes the served module: it publishes a version (a dict of tensors) that
the draft thread copies in between two steps. Its thread runs at the lowest CPU priority
(nice 19, one torch thread) and, on CUDA, on a stream of its own.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
from dataclasses import dataclass, replace

import torch

from specmesh.draft_service.online.buffer import TrafficBuffer
from specmesh.draft_service.online.checkpoints import Checkpoints
from specmesh.draft_service.online.guard import Guard, Verdict
from specmesh.draft_service.online.head import (
    load_into,
    make_batch,
    snapshot,
    trainable_head,
    ttt_loss,
)
from specmesh.draft_service.online.settings import OnlineSettings
from specmesh.protocol.steps import ExtendInput
from specmesh.runtime.loader import assign_parameters

log = logging.getLogger(__name__)
WAIT_S = 0.5  # the trainer looks for its stop signal this often while idle


@dataclass
class LearnerStats:
    version: int = 0  # of the weights the draft serves now (a resumed checkpoint's, or 0)
    num_updates: int = 0  # updates the guard kept
    num_rollbacks: int = 0  # updates the guard refused to serve
    num_resets: int = 0  # of those, the ones that brought back the shipped weights
    last_loss: float = math.nan  # mean training loss of the last update
    heldout_before: float = math.nan  # accept length on held-out traffic, served weights
    heldout_after: float = math.nan  # the last candidate's
    heldout_shipped: float = math.nan  # the shipped weights'
    train_seconds: float = 0.0  # trainer thread, in updates
    swap_seconds: float = 0.0  # draft thread, copying published versions in
    num_swaps: int = 0
    tokens_observed: int = 0  # rows kept since start (training and held-out)
    train_tokens: int = 0  # rows buffered now to train on
    heldout_tokens: int = 0  # held-out rows buffered now


@dataclass(frozen=True)
class Published:
    version: int
    tensors: dict[str, torch.Tensor]  # the served module's parameters, its dtype and device


class OnlineLearner:
    def __init__(
        self,
        net: torch.nn.Module,  # the served head: `Eagle3Draft` or `Eagle1Draft`
        settings: OnlineSettings,
        checkpoints: Checkpoints | None = None,
        topk: int = 1,  # children per tree node the draft keeps: what the guard's chains count
    ) -> None:
        settings.validate()
        self.net, self.settings, self.checkpoints = net, settings, checkpoints
        self.device = net.fc.weight.device
        self.buffer = TrafficBuffer(settings, torch.bfloat16)
        self.head, self.scratch = trainable_head(net), trainable_head(net)
        self.shipped = self.served = snapshot(self.head)  # fp32, the trainer's
        self.guard = Guard(settings.guard_threshold, settings.num_steps, net.embed, topk)
        self.info = LearnerStats()
        self.version = 0  # the newest version published (the trainer's count)
        self._ready: Published | None = None
        self._lock = threading.Lock()
        self._wake, self._stop, self._idle = threading.Event(), threading.Event(), threading.Event()
        self._pending = 0  # training rows not yet trained on by an update
        self._resume()
        self.optimizer = self._new_optimizer()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="online-learning", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.thread is not None:
            self.thread.join()

    # -- draft thread ----------------------------------------------------------------------------
    def observe(self, extends: list[ExtendInput]) -> None:
        """Keep the rows of extends the drafter took; never raises (learning is best effort,
        the step is not). A multimodal start is skipped: its placeholder ids have no
        embedding to train on (DESIGN.md invariant 1)."""
        try:
            for inp in extends:
                if inp.learn and inp.features is not None and not (inp.new and inp.is_multimodal):
                    self.buffer.add(inp.rid, inp.new, inp.committed_ids, inp.features)
        except Exception:
            log.exception("online learning: rows not kept")
        if self.buffer.num_new_tokens >= self.settings.update_tokens:
            self._wake.set()

    def swap(self) -> None:
        """Between two draft steps: the newest published version, if any, goes in."""
        if self._ready is None:
            return
        with self._lock:
            ready, self._ready = self._ready, None
        started = time.perf_counter()
        load_into(self.net, ready.tensors)
        self.info.version = ready.version
        self.info.swap_seconds += time.perf_counter() - started
        self.info.num_swaps += 1

    def forget(self, rid: str) -> None:
        self.buffer.close(rid)

    def stats(self) -> LearnerStats:
        train, heldout = self.buffer.sizes()
        seen = self.buffer.num_seen_tokens
        return replace(self.info, train_tokens=train, heldout_tokens=heldout, tokens_observed=seen)

    # -- trainer thread --------------------------------------------------------------------------
    def _run(self) -> None:
        _lower_priority()
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            while not self._stop.is_set():
                if not self.due():
                    self._idle.set()
                    self._wake.wait(WAIT_S)
                    self._wake.clear()
                    continue
                self._idle.clear()
                try:
                    self.update()
                except Exception:
                    log.exception("online learning: update failed; the served weights stay")

    def due(self) -> bool:
        """Enough new training rows since the last update, and held-out rows to judge it."""
        self._pending += self.buffer.take_new()
        _, heldout = self.buffer.sizes()
        s = self.settings
        return self._pending >= s.update_tokens and heldout >= s.min_heldout_rounds

    def drain(self, timeout_s: float = 600.0) -> bool:
        """Wait until the trainer has nothing due (tests, the bench); False on timeout."""
        self._idle.clear()
        self._wake.set()
        return self._idle.wait(timeout_s)

    def update(self) -> Verdict | None:
        """Train one update, let the guard judge it, then publish it or roll it back."""
        s, started = self.settings, time.perf_counter()
        self._pending = 0
        losses = []
        self.head.train()
        for _ in range(s.steps_per_update):
            windows = self.buffer.windows(s.batch_windows, s.window_tokens)
            if self._stop.is_set() or not windows:
                return None
            losses.append(self._step(windows))
            time.sleep(s.yield_s)  # 0 still lets the draft's thread take the interpreter
        self.head.eval()
        verdict = self.guard.judge(
            self.head, self.scratch, self.served, self.shipped, self.buffer.heldout()
        )
        if verdict.keep:
            self._publish(snapshot(self.head))
            self.info.num_updates += 1
        else:
            self._refuse(verdict)
        self._record(verdict, sum(losses) / len(losses), time.perf_counter() - started)
        return verdict

    def _step(self, windows: list) -> float:
        s = self.settings
        batch = make_batch(windows, s.num_steps, self.device, s.prompt_labels)
        loss = ttt_loss(self.head, batch, self.net.embed, s.num_steps, s.decay)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), s.max_grad_norm)
        self.optimizer.step()
        return float(loss.detach())

    def _publish(self, weights: dict[str, torch.Tensor]) -> None:
        self.served = weights
        self.version += 1
        dtype = self.net.fc.weight.dtype
        tensors = {name: t.to(dtype, copy=True) for name, t in weights.items()}
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()  # written before it is read
        with self._lock:
            self._ready = Published(self.version, tensors)
        if self.checkpoints is not None:
            info = {"tokens_observed": self.buffer.num_seen_tokens}
            self.checkpoints.save(self.version, {**tensors, **self.head.served_extras()}, info)

    def _refuse(self, verdict: Verdict) -> None:
        """The served weights stay. A rewind sends the trainer back to them (its optimizer
        moments dropped); a reset serves the shipped weights again, as a new version."""
        self.info.num_rollbacks += 1
        if verdict.reset or verdict.rewind:
            load_into(self.head, self.shipped if verdict.reset else self.served)
            self.optimizer = self._new_optimizer()
        if verdict.reset:
            self._publish(self.shipped)
            self.info.num_resets += 1

    def _record(self, verdict: Verdict, loss: float, seconds: float) -> None:
        i = self.info
        i.last_loss, i.train_seconds = loss, i.train_seconds + seconds
        i.heldout_before = verdict.served.accept_length
        i.heldout_after = verdict.candidate.accept_length
        i.heldout_shipped = verdict.shipped.accept_length
        log.info(
            "online learning: %s (held-out accept length %.3f -> %.3f, shipped %.3f, loss %.3f)",
            "kept" if verdict.keep else "rolled back", i.heldout_before, i.heldout_after,
            i.heldout_shipped, loss,
        )  # fmt: skip

    def _new_optimizer(self) -> torch.optim.Optimizer:
        s = self.settings
        return torch.optim.AdamW(self.head.parameters(), lr=s.lr, weight_decay=s.weight_decay)

    def _resume(self) -> None:
        """A draft restarted on --online-learning-dir serves its last checkpoint."""
        latest = None if self.checkpoints is None else self.checkpoints.latest()
        if latest is None:
            return
        tensors = self.checkpoints.load(latest)  # names and shapes checked against the draft's
        assign_parameters(self.net, tensors, what=f"online learning checkpoint {latest.path}")
        load_into(self.head, {k: v.float() for k, v in snapshot(self.net).items()})
        self.served = snapshot(self.head)
        self.version = self.info.version = latest.version
        log.info("online learning: resumed version %d from %s", latest.version, latest.path)


def _lower_priority() -> None:
    """This thread (and the torch threads it starts) at nice 19, with one intra-op thread:
    draft steps on the same cores come first. Not SCHED_IDLE: a thread that never runs while
    holding the interpreter lock would stall the draft's."""
    torch.set_num_threads(1)  # per thread with OpenMP
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
