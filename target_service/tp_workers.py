"""The worker ranks of a tensor-parallel target, and rank 0's handle on them.

Rank 0 is the service process: it alone owns request state (KV slot tables, sampling, the
runtime). Ranks 1..N-1 are spawned processes holding only their weight shard, their KV pools
(the same slots as rank 0's, their own KV heads) and an attention backend. For every collective
step rank 0 sends a command on each worker's pipe (control plane: ``(op, skeleton)`` where the
skeleton is the payload with every tensor replaced by its shape and dtype), then broadcasts the
payload's tensors over the process group (data plane: gloo on CPU, NCCL on CUDA), then computes
its own part; the all-reduces inside the layers keep the ranks in lock step:

    rank 0:  send(op) -> broadcast(tensors) -> forward on shard 0 (all-reduce ...) -> result
    rank r:  recv(op) -> broadcast(tensors) -> forward on shard r (all-reduce ...) -> dropped

Failure: a worker that raises logs the error and exits; rank 0 watches every worker's sentinel
and, when one exits unasked, logs which, kills the others and exits the process non-zero (the
router then fails over as for any dead target). A worker whose parent dies (its pipe ends, or
its parent's sentinel fires while it waits in a collective) exits too: no rank is left behind.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import pickle
import socket
import sys
import threading
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from specmesh.runtime.attention.base import AttentionMetadata
from specmesh.runtime.attention.torch_backend import make_backend
from specmesh.runtime.kv_cache import KVCache
from specmesh.runtime.models.causal_lm import load_causal_lm
from specmesh.runtime.parallel import TensorParallel, new_group

log = logging.getLogger(__name__)
FATAL_EXIT_CODE = 70


@dataclass(frozen=True)
class RankSpec:
    """What every rank needs to build its shard, its KV pools and its backend."""

    model_dir: str
    world_size: int
    devices: tuple[torch.device, ...]  # one per rank
    port: int  # the group's rendezvous port on 127.0.0.1
    dtype: torch.dtype | None
    attention_backend: str
    num_kv_slots: int
    page_size: int
    num_threads: int


@dataclass(frozen=True)
class _TensorSlot:
    shape: tuple[int, ...]
    dtype: torch.dtype


def _split(payload: dict, tensors: list[torch.Tensor]) -> dict:
    """``payload`` with each tensor replaced by its slot; the tensors appended in walk order."""
    out = {}
    for key, value in payload.items():
        if isinstance(value, torch.Tensor):
            tensors.append(value.contiguous())
            value = _TensorSlot(tuple(value.shape), value.dtype)
        elif isinstance(value, dict):
            value = _split(value, tensors)
        out[key] = value
    return out


def _fill(skeleton: dict, tp: TensorParallel, device: torch.device) -> dict:
    """The payload again: each slot received from rank 0's broadcast, in the same walk order."""
    out = {}
    for key, value in skeleton.items():
        if isinstance(value, _TensorSlot):
            value = _receive(tp, torch.empty(value.shape, dtype=value.dtype, device=device))
        elif isinstance(value, dict):
            value = _fill(value, tp, device)
        out[key] = value
    return out


def _receive(tp: TensorParallel, x: torch.Tensor) -> torch.Tensor:
    return tp.broadcast(x) if x.numel() else x


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class WorkerGroup:
    """Rank 0's side: spawns ranks 1..N-1, sends them commands, watches them die."""

    def __init__(self, spec: RankSpec) -> None:
        ctx = mp.get_context("spawn")
        self.closing = False
        self.procs: list[mp.process.BaseProcess] = []
        self.conns: list[Connection] = []
        for rank in range(1, spec.world_size):
            ours, theirs = ctx.Pipe()
            proc = ctx.Process(
                target=worker_main, args=(spec, rank, theirs), name=f"specmesh-tp{rank}",
                daemon=True,
            )  # fmt: skip
            proc.start()
            theirs.close()
            log.info("tensor-parallel rank %d: pid %d on %s", rank, proc.pid, spec.devices[rank])
            self.procs.append(proc)
            self.conns.append(ours)
        self.tp: TensorParallel | None = None
        threading.Thread(target=self._monitor, name="specmesh-tp-monitor", daemon=True).start()

    def wait_ready(self, num_kv_heads: int) -> None:
        """Every worker's report after loading: its rank and KV heads must be what rank 0 expects
        of a rank in this group (a mismatched world would compute garbage)."""
        for rank, conn in enumerate(self.conns, start=1):
            try:
                got = pickle.loads(conn.recv_bytes())
            except EOFError:
                raise RuntimeError(f"tensor-parallel rank {rank} exited while loading") from None
            expected = (rank, len(self.procs) + 1, num_kv_heads)
            if got != expected:
                raise RuntimeError(
                    f"tensor-parallel rank {rank} reports (rank, world size, KV heads) {got}, "
                    f"expected {expected}"
                )
        log.info("tensor-parallel group of %d ready (%d KV heads per rank)", len(self.procs) + 1,
                 num_kv_heads)  # fmt: skip

    def send(self, op: str, payload: dict) -> None:
        """Command every worker to run ``op`` on ``payload`` with rank 0 (which runs it next)."""
        tensors: list[torch.Tensor] = []
        header = pickle.dumps((op, _split(payload, tensors)))
        for conn in self.conns:
            conn.send_bytes(header)
        for t in tensors:
            _receive(self.tp, t)

    def fatal(self, message: str) -> None:
        """The group is broken (a rank died, or rank 0 failed mid-step): stop the whole target."""
        log.critical("%s; stopping the target service (all tensor-parallel ranks)", message)
        self._kill_all()
        logging.shutdown()
        os._exit(FATAL_EXIT_CODE)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop every worker (normal shutdown)."""
        self.closing = True
        for conn in self.conns:
            with contextlib.suppress(OSError):  # a worker already gone
                conn.send_bytes(pickle.dumps(("stop", {})))
        for proc in self.procs:
            proc.join(timeout_s)
        self._kill_all()

    def _kill_all(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def _monitor(self) -> None:
        ready = wait([p.sentinel for p in self.procs])
        if self.closing:
            return
        dead = next(p for p in self.procs if p.sentinel in ready)
        dead.join(1)
        rank = self.procs.index(dead) + 1
        self.fatal(f"tensor-parallel rank {rank} (pid {dead.pid}) exited with code {dead.exitcode}")


# -- worker processes ----------------------------------------------------------------------------
def worker_main(spec: RankSpec, rank: int, conn: Connection) -> None:
    """Entry of rank ``rank`` (a spawned process): join, load, report, serve until told to stop
    or until rank 0 is gone."""
    logging.basicConfig(
        level=logging.WARNING,
        format=f"%(asctime)s tp-rank{rank} %(name)s %(levelname)s %(message)s",
    )
    threading.Thread(target=_exit_with_parent, daemon=True).start()
    if spec.num_threads > 0:
        torch.set_num_threads(spec.num_threads)
    try:
        worker = _Worker(spec, rank)
        conn.send_bytes(pickle.dumps((rank, spec.world_size, worker.model.num_local_kv_heads)))
        worker.serve(conn)
    except EOFError:  # rank 0 is gone
        sys.exit(0)
    except BaseException:
        log.exception("tensor-parallel rank %d failed", rank)
        sys.exit(1)


def _exit_with_parent() -> None:
    """A worker blocked in a collective never reads its pipe: leave when the parent dies."""
    parent = mp.parent_process()
    if parent is not None:
        wait([parent.sentinel])
        os._exit(1)


class _Worker:
    def __init__(self, spec: RankSpec, rank: int) -> None:
        self.device = spec.devices[rank]
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.tp = new_group(rank, spec.world_size, spec.port, self.device)
        self.model = load_causal_lm(
            spec.model_dir, dtype=spec.dtype, device=self.device, tp=self.tp
        )
        mc = self.model.config
        # The same slots as rank 0's pools, this rank's KV heads; the slot tables are rank 0's.
        self.pools = KVCache(
            num_layers=mc.num_layers, num_slots=spec.num_kv_slots,
            num_kv_heads=self.model.num_local_kv_heads, head_dim=mc.head_dim, dtype=mc.dtype,
            device=self.device, page_size=spec.page_size, max_requests=1, max_context=1,
            latent_dim=mc.kv_latent_dim,
        ).pools  # fmt: skip
        self.backend = make_backend(
            spec.attention_backend, self.device, mc.head_dim, mc.dtype, latent=mc.mla is not None
        )

    @torch.inference_mode()
    def serve(self, conn: Connection) -> None:
        while True:
            op, skeleton = pickle.loads(conn.recv_bytes())
            if op == "stop":
                return
            self.run(op, _fill(skeleton, self.tp, self.device))

    def run(self, op: str, p: dict[str, Any]) -> None:
        if op == "forward":
            self.backend.prepare(AttentionMetadata(**p["meta"]))
            self.model(
                positions=p["positions"], kv_pools=self.pools, backend=self.backend,
                input_ids=p["input_ids"], input_embeds=p["input_embeds"],
            )  # fmt: skip
        elif op == "logits":
            self.model.compute_logits(p["hidden"])
        elif op == "embed":
            self.model.embed(p["input_ids"])
        else:
            raise ValueError(f"unknown tensor-parallel command {op!r}")
