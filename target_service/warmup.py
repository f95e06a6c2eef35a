"""A warm-up request before the target reports ready, so the first real request does not pay
for compiling kernels. CUDA graphs capture (and so compile) only decode and the captured verify
sizes; a prefill, a verify of another tree size and the eager paths of the attention backend
compile at their first use otherwise: FlashInfer JIT-builds its prefill and custom-mask kernels
then (tens of seconds), and a request that waits for that stalls every request behind it (and a
draft sharing its worker misses the router's deadline, so speculation pauses).

The warm-up is one pseudo request through the public steps: a prefill of a few tokens, then a
verify of a branching tree (a custom mask, never a captured size), then its release. It uses the
same code as any request, so it leaves nothing behind (checked by the tests).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import PrefillInput, VerifyInput
from specmesh.protocol.trees import DraftTree

if TYPE_CHECKING:
    from specmesh.target_service.runtime import TargetRuntime

WARMUP_RID = "__warmup__"  # ids of real requests come from the router (`rpc` ids): no clash
PROMPT = [0, 1, 2, 3, 4]  # shorter than the default prefix-cache block (16): nothing is cached


def warm_up(rt: TargetRuntime) -> None:
    """Prefill, verify a one-level tree (a root and its children) of the smallest size from 3 up
    that no CUDA graph captured, and release."""
    params = SamplingParams(max_new_tokens=4, ignore_eos=True)
    prompt = [t % rt.model_config.vocab_size for t in PROMPT]
    sizes = rt.graphs.verify if rt.graphs is not None else {}
    width = next(n for n in range(3, 64) if n not in sizes)  # an eager verify
    try:
        out = rt.prefill([PrefillInput(WARMUP_RID, prompt, params)])
        if WARMUP_RID in out.errors:
            raise RuntimeError(f"warm-up prefill failed: {out.errors[WARMUP_RID]}")
        root, vocab = rt.requests[WARMUP_RID].pending, rt.model_config.vocab_size
        children = [(root + i) % vocab for i in range(1, width)]
        tree = DraftTree.of([root, *children], [-1] + [0] * (width - 1))
        out = rt.verify([VerifyInput(WARMUP_RID, tree)])
        if WARMUP_RID in out.errors:
            raise RuntimeError(f"warm-up verify failed: {out.errors[WARMUP_RID]}")
    finally:
        rt.release(WARMUP_RID)
