"""A cluster service of `bench.round_timeline --cluster`: ``specmesh SERVICE_ARGS...`` with the
round's stages timed (`bench.timeline_spans`) inside one window of requests. The bench writes
``open`` or ``close`` into ``PREFIX.cmd``; a control thread of the service reads it. Open
starts the spans (and, in a model service on a GPU, launches the clock anchor of the profiler
it started before loading anything) and writes ``PREFIX.open``; close writes ``PREFIX.json``
(the spans, the anchor) and ``PREFIX.trace.json`` (the profiler's chrome trace, first window
only). A file, not a signal: on the H200 the model services never answered SIGUSR1 (three runs).

    python -m specmesh.bench.timeline_service PREFIX SERVICE_ARGS...   (started by `TimelineSpawn`)
"""

from __future__ import annotations

import asyncio
import faulthandler
import functools
import json
import os
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specmesh.bench.timeline_spans import Spans, install

MODULE = "specmesh.bench.timeline_service"
WINDOW_TIMEOUT_S = 45.0
POLL_S = 0.02  # how often a service looks for a command


PROFILE_ENV = "SPECMESH_TIMELINE_DEVICE"  # set: model services record device activity
HANG_DUMP_S = 15.0  # a window step that takes longer dumps every thread's stack to stderr


def start_device_profile() -> tuple[Any, int]:
    """`torch.profiler` on the device's activity (kernels, copies, runtime calls), and the clock
    anchor (`anchor`)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.start()
    return prof, anchor()


def anchor() -> int:
    """The monotonic time at which a `torch.cuda._sleep` kernel was launched: the trace's
    ``spin_kernel`` puts the profiler's clock on the spans' clock."""
    import torch

    torch.cuda.synchronize()
    now = time.monotonic_ns()
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    return now


def stop_device_profile(prof: Any, trace_path: Path) -> None:
    import torch

    torch.cuda.synchronize()
    prof.stop()
    prof.export_chrome_trace(str(trace_path))


class ServiceWindow:
    """The window of one service process, opened and closed by commands in ``PREFIX.cmd`` that
    a control thread of its own carries out, so that neither the profiler nor an error of it
    runs inside whatever the service's threads were doing. A model service told to record the
    device (``SPECMESH_TIMELINE_DEVICE``) starts the profiler before the service loads
    anything: started in a service already serving, on a GPU, it never returned."""

    def __init__(self, prefix: Path, kind: str) -> None:
        self.prefix, self.kind = prefix, kind
        self.spans, self.prof, self.anchor, self.error = Spans(), None, 0, None
        install(self.spans)
        started = threading.Event()
        profile = kind != "router" and bool(os.environ.get(PROFILE_ENV))
        threading.Thread(
            target=self._control, args=(profile, started), name="timeline-control", daemon=True
        ).start()
        started.wait()

    def _control(self, profile: bool, started: threading.Event) -> None:
        """Carry out the window's commands. The profiler starts here, before the service loads
        anything (``started``), and stops here: Kineto is stopped only by the thread that
        started it (stopped from another, on the H200, it raised "not running")."""
        try:
            if profile:
                from torch.profiler import ProfilerActivity
                from torch.profiler import profile as device_profile

                self.prof = device_profile(activities=[ProfilerActivity.CUDA])
                self.prof.start()
        except Exception as e:  # the window reports it; the service starts regardless
            self.prof, self.error = None, repr(e)
            traceback.print_exc()
        finally:
            started.set()
        cmd = self.prefix.with_suffix(".cmd")
        while True:
            time.sleep(POLL_S)
            if not cmd.exists():
                continue
            command = cmd.read_text().strip()
            cmd.unlink()
            faulthandler.dump_traceback_later(HANG_DUMP_S)
            try:
                self.open() if command == "open" else self.close()
            except Exception as e:  # reported in the window's files; the service goes on
                self.error = repr(e)
                traceback.print_exc()
                self.prefix.with_suffix(".open" if command == "open" else ".json").write_text(
                    json.dumps({"process": self.kind, "error": self.error, "spans": []})
                )
            finally:
                faulthandler.cancel_dump_traceback_later()

    def open(self) -> None:
        self.spans.take()
        self.error = None
        if self.prof is not None:
            self.anchor = anchor()
        self.spans.on = True
        self.prefix.with_suffix(".open").write_text(json.dumps({"error": self.error}))

    def close(self) -> None:
        self.spans.on = False
        trace = None
        if self.prof is not None:
            trace = self.prefix.with_suffix(".trace.json")
            prof, self.prof = self.prof, None
            stop_device_profile(prof, trace)
        body = {"process": self.kind, "anchor_ns": self.anchor, "trace": trace and str(trace),
                "error": self.error, "spans": self.spans.take(),
                "cpus": sorted(os.sched_getaffinity(0))}  # fmt: skip
        tmp = self.prefix.with_suffix(".tmp")
        tmp.write_text(json.dumps(body))
        tmp.rename(self.prefix.with_suffix(".json"))


def run_service(prefix: str, argv: list[str]) -> int:
    import runpy

    ServiceWindow(Path(prefix), argv[0])
    sys.argv = ["specmesh", *argv]
    try:
        runpy.run_module("specmesh", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return int(done.code or 0)
    return 0


@dataclass
class TimelineSpawn:
    """A `bench.stacks.Spawn` that starts each service under `run_service`."""

    out_dir: Path
    tag: str = "run"
    device: bool = False  # the model services record the device's activity too
    cpus: dict[str, list[int]] = field(default_factory=dict)  # `bench.worker.TWO_DEVICES`
    started: dict[str, tuple[subprocess.Popen, Path]] = field(default_factory=dict)

    def __call__(self, children: list, kind: str, flags: list[str]) -> str:
        from specmesh.cluster import LOOPBACK, Child, free_port

        port, prefix = free_port(), self.out_dir / f"{self.tag}-{kind}"
        service = [kind, "--host", LOOPBACK, "--port", str(port), *flags]
        env = {**os.environ, PROFILE_ENV: "1"} if self.device else None
        cpus = self.cpus.get(kind)
        place = None if cpus is None else functools.partial(os.sched_setaffinity, 0, cpus)
        cmd = [sys.executable, "-m", MODULE, str(prefix), *service]
        proc = subprocess.Popen(cmd, env=env, preexec_fn=place)
        children.append(Child(kind, f"{LOOPBACK}:{port}", proc))
        self.started[kind] = (proc, prefix)
        return f"{LOOPBACK}:{port}"

    async def window(self, command: str, suffix: str) -> None:
        """Tell every service to ``open`` or ``close`` its window and wait until each has
        answered with ``PREFIX<suffix>``."""
        for _, prefix in self.started.values():
            prefix.with_suffix(suffix).unlink(missing_ok=True)
            tmp = prefix.with_suffix(".cmd-tmp")
            tmp.write_text(command)
            tmp.rename(prefix.with_suffix(".cmd"))
        deadline = time.monotonic() + WINDOW_TIMEOUT_S
        while not all(p.with_suffix(suffix).exists() for _, p in self.started.values()):
            if time.monotonic() > deadline:
                silent = [k for k, (_, p) in self.started.items() if not p.with_suffix(suffix).exists()]  # fmt: skip
                raise TimeoutError(f"{', '.join(silent)} did not {command} the timeline window")
            await asyncio.sleep(0.05)

    def results(self) -> list[dict[str, Any]]:
        return [json.loads(p.with_suffix(".json").read_text()) for _, p in self.started.values()]


if __name__ == "__main__":
    sys.exit(run_service(sys.argv[1], sys.argv[2:]))
