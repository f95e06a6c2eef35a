"""What the GPU suites share (`tests/gpu`): an engine on CUDA, and a spy on its captured
runners."""

from __future__ import annotations

from pathlib import Path

from specmesh.protocol.config import SpecParams
from specmesh.router.core import RouterConfig
from specmesh.router.engine import Engine


def cuda_engine(target: Path, backend: str, graphs: bool, kind: str | None, draft: Path | None,
                spec: SpecParams, dtype: str = "fp32", **router) -> Engine:  # fmt: skip
    runtime = {"device": "cuda", "attention_backend": backend, "cuda_graph": graphs,
               "cuda_graph_max_bs": 8, "dtype": dtype}  # fmt: skip
    return Engine(
        target, draft_model=draft, draft_kind=kind, spec=spec, target_config=runtime,
        draft_config=runtime, router_config=RouterConfig(**router),
    )  # fmt: skip


def spy_graph_replays(engine: Engine) -> set[str]:
    """Names of the captured runners that served a batch (filled in as the engine runs)."""
    used: set[str] = set()
    runners = {"decode": engine.target.graphs.decode}
    runners |= {f"verify{n}": r for n, r in engine.target.graphs.verify.items()}
    drafter = engine.draft.drafter if engine.draft is not None else None
    if getattr(drafter, "step_graphs", None) is not None:
        runners |= {f"draft step{i}": r for i, r in drafter.step_graphs.runners.items()}
    if getattr(drafter, "extend_graph", None) is not None:
        runners["draft extend"] = drafter.extend_graph.runner
    for name, runner in runners.items():
        run = runner.run
        runner.run = lambda *a, _run=run, _name=name, **k: used.add(_name) or _run(*a, **k)
    return used
