"""A service's heap keeps freed message buffers (`specmesh.rpc.heap`): checked by where glibc
serves a 4 MiB block from, in a fresh process each time."""

import os
import platform
import subprocess
import sys

import pytest

from specmesh.rpc.heap import operator_tuned

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")

# Prints how many mapped blocks a 4 MiB allocation added (glibc's mallinfo2().hblks), after
# keep_freed_memory when asked, and whether that set anything.
PROBE = """
import ctypes, sys
from specmesh.rpc.heap import keep_freed_memory
fields = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in fields]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
done = keep_freed_memory() if sys.argv[1] == "keep" else None
before = libc.mallinfo2().hblks
block = bytearray(4 << 20)
print(libc.mallinfo2().hblks - before, done)
"""


def probe(mode: str, env: dict[str, str] | None = None) -> str:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True,
                         env=env, check=True)  # fmt: skip
    return out.stdout.strip()


def test_a_megabyte_block_comes_from_the_heap_once_kept():
    assert probe("default") == "1 None"  # glibc's default: a mapping of its own
    assert probe("keep") == "0 True"


def test_the_operators_malloc_settings_win():
    env = {**os.environ, "GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=1048576"}
    assert probe("keep", env) == "1 False"  # their 1 MiB threshold stands: not kept, not set
    assert operator_tuned({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert operator_tuned({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert not operator_tuned({"GLIBC_TUNABLES": "glibc.pthread.rseq=0", "MALLOC": "x"})


# Freezes the start-up heap with triton's extension loaded (it counts its objects at exit and
# prints each one still alive), makes a reference cycle while frozen, and reports the freeze
# counts and whether the cycle was collected.
FREEZE_PROBE = """
import gc, weakref
import triton
from specmesh.rpc.heap import frozen_startup_heap
class Node: pass
with frozen_startup_heap("probe") as frozen:
    inside = gc.get_freeze_count()
    a, b = Node(), Node(); a.other, b.other = b, a
    gone = weakref.ref(a); del a, b
    gc.collect()
    print(frozen, inside, gone() is None)
print(gc.get_freeze_count())
"""


def test_the_startup_heap_is_frozen_while_serving_and_handed_back_at_the_end():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", FREEZE_PROBE], capture_output=True, text=True,
                         check=True)  # fmt: skip
    frozen, inside, collected, after = out.stdout.split()
    # every module, class and function of start-up (a frozen object freed by its count leaves)
    assert int(frozen) >= int(inside) > 10_000
    assert collected == "True"  # what is made while serving is still collected
    assert after == "0"  # handed back: the interpreter's last collection frees it
    assert "leaked" not in out.stderr, out.stderr  # triton finds none of its objects left
