"""Attention backends agree with each other and with transformers: torch with and without CPU
metadata (the sync-free path), and Triton (interpreter on CPU, compiled on a GPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import assert_accepted

from specmesh.kernels import attention
from specmesh.kernels.attention import TILES
from specmesh.kernels.testing import cpu_triton
from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.runtime.attention.base import AttentionBackend
from specmesh.runtime.attention.torch_backend import TorchBackend, make_backend

PROMPTS = [[5, 6, 7, 8, 9], [11, 12], [40, 41, 42, 43, 44, 45, 46]]


class CpuMetadataFreeTorch(TorchBackend):
    """The torch backend fed metadata without its CPU fields, as the sync-free path builds it."""

    needs_cpu_metadata = False

    def prepare(self, meta) -> None:
        assert meta.q_lens_cpu is None and meta.kv_lens_cpu is None and meta.max_q_len is None
        super().prepare(meta)


# The tile kinds a GPU may run by default (the elementwise "fma" tiles are checked against
# the float64 attention in test_kernels_attention.py).
TRITON_TILES = [cpu_triton(f"triton:{tiles}") for tiles in TILES if tiles != "fma"]


@pytest.mark.parametrize("backend", ["torch-no-cpu-metadata", *TRITON_TILES])
def test_backend_greedy_speculative_equals_transformers(
    copy_dir: Path, oracle, backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the triton backend the speculative kernels (tree build, greedy tree verify)
    are the Triton ones too, its attention in each tile kind. The EAGLE-3 draft predicts its
    target (`copy_drafts`): rounds accept draft tokens, so the kept paths' KV is read back
    through the backend."""
    backend, _, tiles = backend.partition(":")
    if tiles:
        monkeypatch.setattr(attention, "DEFAULT_TILES", tiles)
    called = _spy_triton_kernels(monkeypatch)
    engine = Engine(
        copy_dir / "target", draft_model=copy_dir / "eagle3", draft_kind="eagle3",
        spec=SpecParams(2, 2, 4), target_config={"attention_backend": "torch" if "torch" in backend else backend},
        draft_config={"attention_backend": "torch" if "torch" in backend else backend},
    )  # fmt: skip
    if backend.startswith("torch"):
        engine.target.backend = CpuMetadataFreeTorch()
        engine.draft.drafter.backend = CpuMetadataFreeTorch()
    else:  # built by the runtimes from their configs
        from specmesh.runtime.attention.triton_backend import TritonBackend

        assert type(engine.target.backend) is TritonBackend
        assert type(engine.draft.drafter.backend) is TritonBackend
    target_calls = _count_forwards(engine.target.backend)
    draft_calls = _count_forwards(engine.draft.drafter.backend)
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, ignore_eos=True))
    for prompt, res in zip(PROMPTS, results, strict=True):
        assert res.token_ids == oracle(copy_dir / "target", prompt, 6)
    assert_accepted(results, min_tokens=3)
    # The backend under test computed the attention, in both services.
    assert target_calls["forward"] > 0 and draft_calls["forward"] > 0
    want = {"verify_tree_greedy"} if backend == "triton" else set()
    assert called == want


def _count_forwards(backend: AttentionBackend) -> dict[str, int]:
    """Calls of ``backend.forward`` (one per layer and batch), counted as the engine runs."""
    calls = {"forward": 0}
    forward = backend.forward

    def counted(*args: object, **kwargs: object) -> torch.Tensor:
        calls["forward"] += 1
        return forward(*args, **kwargs)

    backend.forward = counted  # type: ignore[method-assign]
    return calls


def _spy_triton_kernels(monkeypatch: pytest.MonkeyPatch) -> set[str]:
    from specmesh.kernels import tree_verify

    called: set[str] = set()
    for module, name in [(tree_verify, "verify_tree_greedy")]:
        fn = getattr(module, f"{name}_triton")
        spy = lambda *a, _fn=fn, _name=name, **k: called.add(_name) or _fn(*a, **k)
        monkeypatch.setattr(module, f"{name}_triton", spy)
    return called


def test_unknown_backend_is_a_clear_error() -> None:
    from specmesh.runtime.attention.torch_backend import make_backend

    with pytest.raises(ValueError, match="unknown attention backend 'cuda-magic'"):
        make_backend("cuda-magic")


def test_backends_that_cannot_run_the_model_are_refused_at_startup(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Before any request: compiled Triton on a CPU device, FlashInfer on CPU, in fp32, or with a
    head_dim its kernels are not built for (found on a GPU: an internal FlashInfer error at
    CUDA-graph capture)."""
    import torch

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="triton attention backend needs a CUDA device"):
        make_backend("triton", "cpu")
    with pytest.raises(ValueError, match="flashinfer attention backend needs a CUDA device"):
        make_backend("flashinfer", "cpu", 64, torch.bfloat16)
    with pytest.raises(ValueError, match="runs fp16 / bf16 models"):
        make_backend("flashinfer", "cuda", 64, torch.float32)
    with pytest.raises(ValueError, match=r"takes head_dim \(64, 128, 256\), this model has 16"):
        make_backend("flashinfer", "cuda", 16, torch.bfloat16)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert make_backend("triton", "cpu").name == "triton"
