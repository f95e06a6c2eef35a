"""Why the n-gram draft proposes nothing under FlashInfer on a GPU (issue 53, step 3): the
cycling target of tests/gpu/test_gpu_engine.py, plain and n-gram, bf16, triton vs flashinfer."""

import os
import tempfile
from pathlib import Path

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.runtime.tiny import make_tiny_target

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46], [200, 13, 77, 13, 77, 13]]
target = make_tiny_target(
    Path(tempfile.mkdtemp()) / "cycling",
    hidden_size=256,
    num_attention_heads=4,
    initializer_range=0.05,
)


def _spied(verify, sizes: list[int]):
    def spy(inputs, *a, **k):
        sizes.extend(i.tree.num_nodes for i in inputs)
        return verify(inputs, *a, **k)

    return spy


DEVICE = os.environ.get("SPECMESH_DIAG_DEVICE", "cuda")
for backend in os.environ.get("SPECMESH_DIAG_BACKENDS", "triton flashinfer").split():
    for kind in (None, "ngram"):
        rt = {"device": DEVICE, "dtype": "bf16", "attention_backend": backend, "cuda_graph": False}
        try:
            e = Engine(
                str(target),
                draft_kind=kind,
                spec=SpecParams(3, 2, 6),
                target_config=rt,
                draft_config=rt,
            )
            sizes: list[int] = []
            e.target.verify = _spied(e.target.verify, sizes)
            res = e.generate(PROMPTS, SamplingParams(max_new_tokens=12, ignore_eos=True))
            for p, r in zip(PROMPTS, res, strict=True):
                print(backend, kind, p, r.token_ids, r.accept_lens, flush=True)
            print(backend, kind, "tree sizes", sizes, flush=True)
            print(backend, kind, "policy", str(vars(e.policy))[:600], flush=True)
        except Exception as exc:
            print(backend, kind, "FAILED", repr(exc), flush=True)
