"""The floor under the hop: what one message on an open gRPC bidi stream costs on this machine,
with nothing of specmesh in it. A `grpc.aio` echo server in its own process (raw bytes, no
protobuf) and a `grpc.aio` client that writes a message and reads it back, over and over.

    python -m specmesh.bench.hop_floor [--sizes 256 4096] [--round-trips 2000]

A sequential round costs at least one round trip per service it calls: a plain round one (the
target), a speculative round two (target, then draft). `bench.hop` prints these floors beside
its ratios: in-process time per round / (that + the floor) is the best ratio a round that calls
its services one after the other can reach here.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc

MODULE, METHOD = "specmesh.bench.hop_floor", "/specmesh.bench.Echo/Echo"
WARM_UP = 200
SIZES = (256, 4096)  # a verify or draft request; an answer with feature rows


def _raw(data: bytes) -> bytes:
    return data


async def _serve(port_file: str) -> None:
    async def echo(requests, context):
        async for msg in requests:
            yield msg

    handler = grpc.stream_stream_rpc_method_handler(echo, _raw, _raw)
    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("specmesh.bench.Echo", {"Echo": handler}),)
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    Path(f"{port_file}.tmp").write_text(str(port))
    Path(f"{port_file}.tmp").rename(port_file)  # whole, or not there yet
    await server.wait_for_termination()


async def _round_trips(port: int, size: int, count: int) -> list[float]:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream(METHOD, request_serializer=_raw, response_deserializer=_raw)()
        msg, seconds = b"x" * size, []
        for i in range(WARM_UP + count):
            started = time.perf_counter()
            await call.write(msg)
            await call.read()
            if i >= WARM_UP:
                seconds.append(time.perf_counter() - started)
        await call.done_writing()
    return seconds


def measure(sizes: tuple[int, ...] = SIZES, count: int = 2000) -> list[dict[str, Any]]:
    """Round-trip times per message size (ms: median, 10th and 90th percentile), each size's
    trips after a warm-up, against one echo server process."""
    with tempfile.TemporaryDirectory() as tmp:
        port_file = Path(tmp) / "port"
        server = subprocess.Popen([sys.executable, "-m", MODULE, "--serve", str(port_file)])
        try:
            while not port_file.exists():
                if server.poll() is not None:
                    raise RuntimeError(f"the echo server exited ({server.returncode})")
                time.sleep(0.05)
            port = int(port_file.read_text())
            out = []
            for size in sizes:
                ms = sorted(1e3 * s for s in asyncio.run(_round_trips(port, size, count)))
                deciles = statistics.quantiles(ms, n=10)
                out.append({"bytes": size, "round_trip_ms": statistics.median(ms),
                            "p10_ms": deciles[0], "p90_ms": deciles[-1], "count": count})  # fmt: skip
            return out
        finally:
            server.terminate()
            server.wait(10)


def format_floor(floor: list[dict[str, Any]]) -> str:
    lines = ["| message bytes | gRPC round trip ms, median (p10 - p90) |", "|---|---|"]
    lines += [f"| {f['bytes']} | {f['round_trip_ms']:.3f} ({f['p10_ms']:.3f} - {f['p90_ms']:.3f}) |"
              for f in floor]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.bench.hop_floor", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--serve", metavar="PORT_FILE", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES))
    parser.add_argument("--round-trips", type=int, default=2000)
    args = parser.parse_args(argv)
    if args.serve:
        asyncio.run(_serve(args.serve))
        return 0
    if args.round_trips < 1 or min(args.sizes) < 0:
        parser.error("--round-trips must be >= 1 and --sizes >= 0")
    print(format_floor(measure(tuple(args.sizes), args.round_trips)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
