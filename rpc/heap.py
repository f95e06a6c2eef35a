"""The heap of a process that moves megabyte messages: freed blocks kept for the next one.

glibc serves a block over its mmap threshold (128 KiB at first, raised as such blocks are
freed, to 32 MiB at most) with a fresh mapping that it unmaps on free, and it gives the top of
its heap back to the system once more than twice that threshold lies free there. A service that
receives, copies and frees a feature batch of a megabyte or more every round then maps and
faults in fresh pages for each copy, every round: measured on the 8B-shaped pair's rows at
batch 8 (48 rows of 24 KiB), the router's relay of one batch took 1.9 ms, 0.36 ms with the
blocks kept (bench_results/HISTORY.md, "eighth session").

`keep_freed_memory` raises both thresholds for the process at run time (``mallopt``): blocks up
to `MMAP_THRESHOLD_BYTES` come from the heap and up to `TRIM_THRESHOLD_BYTES` of free heap is
kept. Each service calls it before serving. An operator's own settings win: with a malloc
tunable in ``GLIBC_TUNABLES`` or a ``MALLOC_*_`` variable in the environment nothing changes.
Other C libraries (musl, macOS) are left alone.

`frozen_startup_heap` takes the objects a service holds for its whole life (imported modules,
the model's modules, graphs, protobuf descriptors, gRPC's machinery: some hundreds of thousands)
out of Python's cyclic garbage collector once the service is ready (``gc.freeze``; SGLang and
vLLM freeze theirs after warm-up too). Without it each full collection walks them all: 90 -
150 ms here, a stall of whatever round it lands in. The process entries serve inside it
(`serve_model`, the router's `serve`); a process that starts services in process (a test)
keeps its collector as it was.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import logging
import os
import platform
from collections.abc import Iterator, Mapping

log = logging.getLogger(__name__)

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# A stream message is at most 4 MiB of rows (`protocol.codec.DEFAULT_MAX_MESSAGE_BYTES`) and a
# batch a few of them: keep blocks to glibc's own upper bound in the heap.
MMAP_THRESHOLD_BYTES = 32 << 20
# Free heap kept for the next rounds before any of it goes back to the system.
TRIM_THRESHOLD_BYTES = 256 << 20


def operator_tuned(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the environment already sets glibc's malloc (a tunable or a ``MALLOC_*_``)."""
    return "glibc.malloc." in environ.get("GLIBC_TUNABLES", "") or any(
        k.startswith("MALLOC_") and k.endswith("_") for k in environ
    )


def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds for this process; whether they were set."""
    if platform.libc_ver()[0] != "glibc" or operator_tuned():
        return False
    libc = ctypes.CDLL(None)
    done = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    )
    log.info("heap: blocks to %d MiB kept for reuse: %s", MMAP_THRESHOLD_BYTES >> 20, done)
    return done


@contextlib.contextmanager
def frozen_startup_heap(process: str) -> Iterator[int]:
    """``with frozen_startup_heap(name) as frozen:`` serve: collect once, then move every object
    alive to the collector's permanent generation (``gc.freeze``), so that later collections
    walk only what was made after; ``frozen`` says how many. They go back to the collector on
    leaving (``gc.unfreeze``): the interpreter's last collection at exit frees them, and
    extension modules that count their objects (triton's) find none leaked."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.info("%s: %d start-up objects out of the garbage collector's passes", process, frozen)
    try:
        yield frozen
    finally:
        gc.unfreeze()
