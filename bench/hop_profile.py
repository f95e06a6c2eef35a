"""The service side of `bench.hop --profile`: each cluster service runs under `cProfile`, every
Python thread included (a service runs its model step on a worker thread, which the event loop's
profiler would not see), and the profiles cover one window of requests that signals open and
close. Then the per-round reading of a profile (`top_functions`, `anatomy`).

    python -m specmesh.bench.hop_profile OUT_FILE SERVICE_ARGS...   (started by `ProfiledSpawn`)
"""

from __future__ import annotations

import asyncio
import contextlib
import cProfile
import io
import pstats
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

MODULE, TOP_FUNCTIONS = "specmesh.bench.hop_profile", 15
SIGNAL_SETTLE_S = 0.5  # for the services to handle a profile signal


class ServiceProfile:
    """Every Python thread of this process under its own `cProfile` profiler (the model step
    runs on a service's worker thread, not the event loop's). SIGUSR1 forgets what they saw so
    far (the window opens); SIGUSR2, or the end of the process, writes their merged stats."""

    def __init__(self, out_file: str) -> None:
        self.out_file, self.written = out_file, False
        self.profilers = [cProfile.Profile()]
        threading.setprofile(self._start_thread)
        signal.signal(signal.SIGUSR1, lambda *_: [p.clear() for p in self.profilers])
        signal.signal(signal.SIGUSR2, lambda *_: self.write())
        self.profilers[0].enable()

    def _start_thread(self, *_: object) -> None:  # a new thread's first profile event
        self.profilers.append(profiler := cProfile.Profile())
        profiler.enable()

    def write(self) -> None:
        if self.written:
            return
        self.written = True
        merged = pstats.Stats()
        for profiler in self.profilers:
            with contextlib.suppress(TypeError):  # a thread that ran nothing in the window
                merged.add(profiler)
        merged.dump_stats(self.out_file)


def profile_service(out_file: str, argv: list[str]) -> int:
    """``specmesh ARGV`` (a service) under `ServiceProfile`: the command's entry point run as a
    program (``python -m specmesh``), as a service process runs it."""
    import runpy

    profile = ServiceProfile(out_file)
    sys.argv = ["specmesh", *argv]
    try:
        runpy.run_module("specmesh", run_name="__main__", alter_sys=True)
    except SystemExit as done:
        return int(done.code or 0)
    finally:
        profile.write()
    return 0


@dataclass
class ProfiledSpawn:
    """A `bench.stacks.Spawn` that starts each service under `profile_service`."""

    prof_dir: Path
    tag: str
    started: dict[str, tuple[subprocess.Popen, Path]] = field(default_factory=dict)

    def __call__(self, children: list, kind: str, flags: list[str]) -> str:
        from specmesh.cluster import LOOPBACK, Child, free_port

        port, out = free_port(), self.prof_dir / f"{self.tag}-{kind}.prof"
        service = [kind, "--host", LOOPBACK, "--port", str(port), *flags]
        proc = subprocess.Popen([sys.executable, "-m", MODULE, str(out), *service])
        children.append(Child(kind, f"{LOOPBACK}:{port}", proc))
        self.started[kind] = (proc, out)
        return f"{LOOPBACK}:{port}"

    async def send_signal(self, signum: int) -> None:
        for proc, _ in self.started.values():
            proc.send_signal(signum)
        await asyncio.sleep(SIGNAL_SETTLE_S)

    def profiles(self) -> dict[str, Path]:
        """service -> its profile, once every service has stopped (SIGTERM: a clean exit)."""
        bad = {k: p.returncode for k, (p, out) in self.started.items() if p.returncode or not out.exists()}  # fmt: skip
        if bad:
            raise RuntimeError(f"services exited uncleanly or wrote no profile: {bad}")
        return {kind: out for kind, (_, out) in self.started.items()}


def top_functions(path: Path, rounds: int) -> list[str]:
    """`anatomy`, then the ``TOP_FUNCTIONS`` functions of a profile by cumulative time, with
    their milliseconds per round."""
    stats = pstats.Stats(str(path), stream=io.StringIO()).sort_stats("cumulative")
    lines = [anatomy(stats, rounds), f"{'cum s':>7} {'own s':>7} {'calls':>7} {'cum ms/round':>12}  function"]  # fmt: skip
    for func in stats.fcn_list[:TOP_FUNCTIONS]:
        _, calls, own_s, cum_s, _ = stats.stats[func]
        file, line, name = func
        where = f"{Path(file).name}:{line}({name})" if line else name
        lines.append(f"{cum_s:7.3f} {own_s:7.3f} {calls:7d} {1e3 * cum_s / rounds:12.3f}  {where}")
    return lines


def anatomy(stats: pstats.Stats, rounds: int) -> str:
    """Per round: event-loop iterations, loop time busy and waiting in epoll, worker jobs."""

    def calls_and_cum_s(file: str, name: str) -> tuple[int, float]:
        hits = [v for (f, _, n), v in stats.stats.items() if f.endswith(file) and n == name]
        return sum(v[1] for v in hits), sum(v[3] for v in hits)

    loops, loop_s = calls_and_cum_s("asyncio/base_events.py", "_run_once")
    _, wait_s = calls_and_cum_s("selectors.py", "select")
    jobs, job_s = calls_and_cum_s("concurrent/futures/thread.py", "run")
    ms = 1e3 / rounds
    return (
        f"per round: {loops / rounds:.1f} loop iterations, loop busy {ms * (loop_s - wait_s):.2f}"
        f" ms, waiting {ms * wait_s:.2f} ms; {jobs / rounds:.2f} worker jobs, {ms * job_s:.2f} ms"
    )


if __name__ == "__main__":  # a service of a --profile run (`ProfiledSpawn`)
    sys.exit(profile_service(sys.argv[1], sys.argv[2:]))
