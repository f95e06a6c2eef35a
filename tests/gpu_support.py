"""What the GPU suites share (`tests/gpu`): an engine on CUDA, a spy on its captured runners,
and greedy output checked up to bf16 rounding."""

from __future__ import annotations

from functools import cache
from pathlib import Path

import torch

from specmesh.protocol.config import SpecParams
from specmesh.router.engine import Engine
from specmesh.router.router_config import RouterConfig


def cuda_engine(target: Path, backend: str, graphs: bool, kind: str | None, draft: Path | None,
                spec: SpecParams, dtype: str = "fp32", **router) -> Engine:  # fmt: skip
    runtime = {"device": "cuda", "attention_backend": backend, "cuda_graph": graphs,
               "cuda_graph_max_bs": 8, "dtype": dtype}  # fmt: skip
    return Engine(
        target, draft_model=draft, draft_kind=kind, spec=spec, target_config=runtime,
        draft_config=runtime, router_config=RouterConfig(**router),
    )  # fmt: skip


def spy_graph_replays(engine: Engine) -> set[str]:
    """Names of the captured runners that served a batch (filled in as the engine runs).

    The handshake comes first: an EAGLE-3 draft's aux layers make the target capture its graphs
    again (`TargetRuntime.configure`), so the runners watched are those the engine will use. The
    engine's own handshake, with the same needs, then captures nothing."""
    if engine.draft is not None:
        engine.target.configure(engine.draft.info().needs)
    used: set[str] = set()
    runners = {"decode": engine.target.graphs.decode}
    runners |= {f"verify{n}": r for n, r in engine.target.graphs.verify.items()}
    drafter = engine.draft.drafter if engine.draft is not None else None
    if getattr(drafter, "step_graphs", None) is not None:
        runners |= {f"draft step{i}": r for i, r in drafter.step_graphs.runners.items()}
    if getattr(drafter, "extend_graph", None) is not None:
        runners["draft extend"] = drafter.extend_graph.runner
    if getattr(drafter, "search_graphs", None) is not None:
        runners["draft search"] = drafter.search_graphs
    for name, runner in runners.items():  # every forward of a runner ends in its replay
        replay = runner.replay
        runner.replay = lambda *a, _r=replay, _name=name, **k: used.add(_name) or _r(*a, **k)
    return used


@cache
def _hf_bf16(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()


def assert_greedy_up_to_rounding(target: Path, prompt: list[int], tokens: list[int]) -> None:
    """Every token (greedy in bf16) is within bf16 rounding of the fp32 model's best at its
    position: its fp32 logit is at most ``tol`` below the best, with ``tol`` measured there.

    transformers runs the same model in bf16 on the same ids; ``err`` is the largest change bf16
    makes to any logit at the position, taken as the size of a bf16 engine's errors there (other
    kernels, the same rounding). The engine picks token t over the fp32 best b only if its errors
    lift t over b by the fp32 gap, so the gap is at most ``|err_t| + |err_b| <= 2 * err``.
    ``tol = max(0.1, 2 * err)``; a token farther below the best than bf16's errors reach fails."""
    from conftest import _hf_model

    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        fp32 = _hf_model(str(target))(ids).logits[0].float()
        bf16 = _hf_bf16(str(target))(ids).logits[0].float()
    for k, tok in enumerate(tokens):
        row = fp32[len(prompt) - 1 + k]
        err = (bf16[len(prompt) - 1 + k] - row).abs().max().item()
        gap, tol = (row.max() - row[tok]).item(), max(0.1, 2 * err)
        assert gap <= tol, (k, tok, row.argmax().item(), gap, tol)
