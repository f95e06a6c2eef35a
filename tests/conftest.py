"""Shared fixtures: tiny checkpoints built once per session, and the transformers oracles.

Tests live in three folders, each marked by it: ``unit`` (code in one process), ``integration``
(real gRPC servers on loopback, in process) and ``e2e`` (real service processes); e.g.
``pytest -m "not e2e"``. ``gpu`` holds the tests that need a CUDA device (skipped without one;
``scripts/gpu_check.sh`` runs them)."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from functools import cache
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported
# Every KV cache checks its free list after each release and eviction (`KVCache.check`); the
# service processes the e2e tests start inherit it.
os.environ.setdefault("SPECMESH_CHECK_KV", "1")
sys.path.insert(0, str(Path(__file__).parent))  # test helpers: grpc_harness
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


GROUPS = ("unit", "integration", "e2e", "gpu")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--device", default="cpu", choices=("cpu", "cuda"),
        help="device of the target and draft services the e2e suites start (tests/procs)",
    )  # fmt: skip
    parser.addoption(
        "--attention-backend", default="triton", choices=("torch", "triton", "flashinfer"),
        help="their attention backend with --device cuda (CUDA graphs on for triton/flashinfer)",
    )  # fmt: skip


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("--device") == "cuda":
        import procs

        backend = config.getoption("--attention-backend")
        procs.MODEL_FLAGS = ("--device", "cuda", "--attention-backend", backend)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        group = next((g for g in GROUPS if g in item.path.parts), None)
        if group is not None:
            item.add_marker(getattr(pytest.mark, group))


def rss_mb() -> float:
    """This process's resident memory (Linux), for "a refused request costs nothing" checks."""
    with open("/proc/self/status") as f:
        line = next(line for line in f if line.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


WAIT_S = 60.0  # the longest a test waits on the system under test before it fails


async def within(awaitable: Awaitable, what: str, timeout_s: float = WAIT_S):
    """``await awaitable``, or fail naming ``what`` after ``timeout_s``: a test that waits on
    the system under test fails when the system stops answering, it never hangs."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError:
        raise AssertionError(f"{what}: nothing after {timeout_s:.0f} s") from None


async def until(ready: Callable[[], bool], what: str, timeout_s: float = WAIT_S) -> None:
    """Poll ``ready`` every millisecond; fail naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not after {timeout_s:.0f} s")
        await asyncio.sleep(0.001)


def tiny_engine(tiny_dir: Path, speculate: bool):
    """The in-process engine on the tiny target, with its EAGLE-3 draft when ``speculate``."""
    from specmesh.protocol.config import SpecParams
    from specmesh.router.engine import Engine

    if not speculate:
        return Engine(tiny_dir / "target")
    return Engine(
        tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
        spec=SpecParams(3, 4, 8),
    )  # fmt: skip


# A router config's draft deadline that a loaded CI core cannot trip: the adaptive deadline (floor
# 0.5 s) would turn a burst's slow draft step into a draft failure, and a test that counts
# accepted tokens would then see plain rounds (tested on its own: test_step_deadline.py,
# test_hung_draft_e2e.py)
PATIENT_DRAFT = {"draft_deadline_floor_s": 10.0}
PATIENT_DRAFT_FLAGS = ("--draft-deadline-floor-s", "10")  # the same, for a router process


def assert_speculated(results, min_mean_accept: float = 1.0) -> None:
    """Speculation ran in every round: each request's rounds verified at least one draft token
    per round (plain decoding, a failing draft or the fallback verify none), and the rounds of
    all ``results`` emitted ``min_mean_accept`` tokens each, bonus included. ``results``: engine
    results or `RequestStats` (both have ``accept_lens`` and ``num_draft_tokens``)."""
    for r in results:
        rounds = len(r.accept_lens)
        assert rounds and r.num_draft_tokens >= rounds, (
            f"{r.num_draft_tokens} draft tokens verified in {rounds} rounds: speculation did not run"
        )
    lens = [n for r in results for n in r.accept_lens]
    mean = sum(lens) / len(lens)
    assert mean >= min_mean_accept, f"{mean:.2f} tokens per round, want >= {min_mean_accept}"


def assert_accepted(results, min_tokens: int = 1) -> None:
    """The target accepted at least ``min_tokens`` draft tokens over all ``results`` (engine
    results or `RequestStats`: each ``accept_lens`` entry counts a round's bonus token too).
    Output equal to transformers' says nothing of accepted paths (the KV kept, the bonus after
    them, a stop inside them) while every draft token is rejected, as a random draft's are."""
    accepted = sum(n - 1 for r in results for n in r.accept_lens)
    rounds = sum(len(r.accept_lens) for r in results)
    assert accepted >= min_tokens, f"{accepted} draft tokens accepted in {rounds} rounds"


def record_step_logits(drafter, rid: str) -> list[torch.Tensor]:
    """``rid``'s root logits (the extend's), then the logits of every step forward from now
    on, as the drafter's search sees them (each search's step forward wrapped where `grow`
    takes it: search graphs, static-shape runners or ragged items alike)."""
    seen, grow = [drafter.roots[rid].logits], drafter.grow

    def recording(logits, hidden, roots, steps, stepper, *args, **kwargs):
        def recorded(first_hidden):
            forward = stepper(first_hidden)

            def step(*step_args):
                hidden, logits = forward(*step_args)
                seen.append(logits[0])
                return hidden, logits

            return step

        return grow(logits, hidden, roots, steps, recorded, *args, **kwargs)

    drafter.grow = recording
    return seen


def make_small_vocab_pair(root: Path, vocab_size: int, num_layers: int, seed: int) -> Path:
    """A Llama target with a handful of tokens and an EAGLE-3 draft: top-4 trees cover much of
    the target's mass, so speculative sampling accepts often and every verifier branch runs."""
    import transformers

    from specmesh.runtime.tiny import build_tokenizer, make_tiny_eagle3

    cfg = transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=num_layers,
        num_attention_heads=4, num_key_value_heads=2, initializer_range=0.3, eos_token_id=None,
        bos_token_id=None, pad_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(root / "target")
    build_tokenizer().save_pretrained(root / "target")
    make_tiny_eagle3(root / "draft", root / "target", seed=1)
    return root


def reorder_tolerance(dtype: torch.dtype) -> dict[str, float]:
    """Tolerances for the same math run in another order (padded vs unpadded batches, another
    kernel): a few units in the last place of the dtype, scaled for the tiny models' reductions.
    A real slicing or masking bug moves values by orders of magnitude more."""
    eps = torch.finfo(dtype).eps
    return {"atol": 1000 * eps, "rtol": 1000 * eps}


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama target and a matching random EAGLE-3 draft (reduced draft vocab)."""
    from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target

    root = tmp_path_factory.mktemp("tiny")
    make_tiny_target(root / "target")
    make_tiny_eagle3(root / "draft", root / "target", draft_vocab_size=200)
    return root


@pytest.fixture(scope="session")
def copy_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer tiny target and a draft of each kind built to predict it
    (`copy_drafts.make_copy_pair`): ``target``, ``eagle3``, ``eagle``, ``mtp``, ``standalone``."""
    from copy_drafts import make_copy_pair

    return make_copy_pair(tmp_path_factory.mktemp("copy"))


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 target (`runtime.tiny.make_tiny_deepseek`): MLA, YaRN, MoE."""
    from specmesh.runtime.tiny import make_tiny_deepseek

    return make_tiny_deepseek(tmp_path_factory.mktemp("deepseek") / "target")


@pytest.fixture(scope="session")
def synthetic_pair(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The benchmark's Llama-3.1-8B-shaped pair (`bench.synthetic`, forced acceptance) at small
    widths: (target, draft)."""
    from specmesh.bench.synthetic import make_synthetic_pair

    small = {"vocab_size": 512, "hidden_size": 128, "intermediate_size": 256,
             "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    return make_synthetic_pair(tmp_path_factory.mktemp("synthetic"), tiny_dir / "target", **small)


@cache
def _hf_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def hf_greedy(
    model_dir: str | Path, prompt: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()
) -> list[int]:
    """transformers greedy generation, cut after the first stop id (inclusive)."""
    model = _hf_model(str(model_dir))
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids),  # never infer padding from the ids
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
    tokens = out[0, len(prompt) :].tolist()
    for i, t in enumerate(tokens):
        if t in stop_ids:
            return tokens[: i + 1]
    return tokens


@cache
def _hf_llava(model_dir: str):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    model = LlavaForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def llava_greedy(model_dir: Path, prompt: str, images: list[bytes], n: int) -> list[int]:
    """transformers greedy generation of a LLaVA checkpoint on a text prompt with images."""
    import io

    from PIL import Image

    model, processor = _hf_llava(str(model_dir))
    pil = [Image.open(io.BytesIO(b)).convert("RGB") for b in images] or None
    inputs = processor(text=prompt, images=pil, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0
        )
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="session")
def oracle():
    return hf_greedy


@pytest.fixture(scope="module")
def stack(tiny_dir: Path, oracle):
    """In-process gRPC stack (target, EAGLE-3 draft, router) shared by a test module."""
    from grpc_harness import open_stack

    yield from open_stack(tiny_dir, oracle)


@pytest.fixture(scope="module")
def copy_stack(copy_dir: Path, oracle):
    """`stack` over `copy_dir`: the one-layer target and the EAGLE-3 draft built to predict it,
    so rounds accept draft tokens across both hops."""
    from grpc_harness import open_stack

    yield from open_stack(copy_dir, oracle, draft="eagle3")


@pytest.fixture(scope="session")
def k8s() -> list[dict]:
    """Every document of deploy/k8s/*.yaml (tests copy before they change one)."""
    import yaml

    docs = []
    for path in sorted((Path(__file__).resolve().parents[1] / "deploy" / "k8s").glob("*.yaml")):
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs
