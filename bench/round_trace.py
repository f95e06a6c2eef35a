"""The project functions and files one steady speculative round crosses, in process.

    python -m specmesh.bench.round_trace [--rounds 3] [--list]

Builds a tiny target and EAGLE-3 head (no download), runs one greedy request with
``--speculation always`` and records, with `sys.setprofile` on the router's thread and the
runtimes' worker threads, every project function called between the start of round k and the
start of round k + 1, for ``--rounds`` steady rounds (after the prefill's and the first
rounds). A round's count is the number of distinct functions (and their files) it called,
as a GPU round calls them: the target's and the draft's static-shape runners run on CPU (here
with the draft's extend runner too) what a CUDA graph replays on a GPU (a forward, a draft's
whole search), so what those call is not counted (``--eager-bodies``
counts it too); printed per round, with the largest. ``--list`` prints the functions of the last round.
Library code (torch, grpc, the standard library) and the tests are not counted.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SKIP = (ROOT / ".venv", ROOT / "tests", ROOT / "bench")
# What a CUDA graph replays on a GPU (run eagerly on CPU): counted, what they call is not.
GRAPH_BODIES = ("GraphRunner._forward", "SearchGraphs._search")


@dataclass
class RoundTrace:
    """Distinct project functions per traced round: (file relative to the root, name, line)."""

    rounds: list[set[tuple[str, str, int]]] = field(default_factory=list)
    recording: bool = False
    bodies: tuple[str, ...] = GRAPH_BODIES  # functions whose callees are not counted
    replayed: dict[int, object] = field(default_factory=dict)  # by thread: the graph body's frame

    def profile(self, frame, event: str, arg) -> None:
        if not self.recording:
            return
        inside = self.replayed.get(threading.get_ident())
        if inside is not None:  # a CUDA graph replays this on a GPU: no Python runs there
            if event == "return" and frame is inside:
                del self.replayed[threading.get_ident()]
            return
        if event != "call":
            return
        code = frame.f_code
        path = Path(code.co_filename)
        if path.is_relative_to(ROOT) and not any(path.is_relative_to(s) for s in SKIP):
            rel = str(path.relative_to(ROOT))
            self.rounds[-1].add((rel, code.co_qualname, code.co_firstlineno))
            if code.co_qualname in self.bodies:
                self.replayed[threading.get_ident()] = frame

    def functions(self, k: int) -> int:
        return len(self.rounds[k])

    def files(self, k: int) -> int:
        return len({f for f, _, _ in self.rounds[k]})


def _patch_round(trace: RoundTrace, skip: int, num_rounds: int) -> Callable[[], None]:
    """Start a new traced round at each `RoundRunner._round` after ``skip`` of them."""
    from specmesh.router.round import RoundRunner

    original = RoundRunner._round
    seen = [0]

    async def traced(self, batch) -> None:
        seen[0] += 1
        index = seen[0] - skip - 1
        trace.recording = 0 <= index < num_rounds
        if trace.recording:
            trace.rounds.append(set())
        await original(self, batch)

    RoundRunner._round = traced
    return lambda: setattr(RoundRunner, "_round", original)


def trace_rounds(num_rounds: int = 3, skip: int = 2, *, eager_bodies: bool = False) -> RoundTrace:
    from specmesh.protocol.config import SpecParams
    from specmesh.protocol.sampling import SamplingParams
    from specmesh.router.engine import Engine
    from specmesh.router.router_config import RouterConfig
    from specmesh.runtime.tiny import make_tiny_eagle3, make_tiny_target

    trace = RoundTrace(bodies=() if eager_bodies else GRAPH_BODIES)
    with tempfile.TemporaryDirectory(prefix="specmesh-trace-") as tmp:
        target, draft = Path(tmp) / "target", Path(tmp) / "draft"
        make_tiny_target(target)
        make_tiny_eagle3(draft, target)
        engine = Engine(target, draft_model=draft, draft_kind="eagle3",
                        spec=SpecParams(3, 2, 4), router_config=RouterConfig(speculation="always"))  # fmt: skip
        _gpu_paths(engine)
        restore = _patch_round(trace, skip, num_rounds)
        threading.setprofile(trace.profile)  # the runtimes' worker threads start later
        sys.setprofile(trace.profile)
        try:
            params = SamplingParams(max_new_tokens=4 * (skip + num_rounds + 2), ignore_eos=True)
            engine.generate([list(range(5, 37))], params)
        finally:
            sys.setprofile(None)
            threading.setprofile(None)
            restore()
    return trace


def _gpu_paths(engine) -> None:
    """The target's decode and verify and the draft's extend through their static-shape runners,
    eagerly, as a GPU replays them (on CPU the target and the extend run ragged): the draft's
    handshake first, which names the aux layers the target's runners are built with."""
    from specmesh.target_service.runtime import TargetGraphs

    t = engine.target
    t.configure(engine.draft.info().needs)
    t.graphs = TargetGraphs(t.model, t.cache, t.backend, mode="eager-static", max_bs=4,
                            tree_sizes=t.cfg.cuda_graph_tree_sizes, aux=t.aux_layers)  # fmt: skip
    engine.draft.drafter.enable_step_graphs("eager-static", 4)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--list", action="store_true", help="print the last round's functions")
    p.add_argument(
        "--eager-bodies",
        action="store_true",
        help="also count what the graph bodies call (the CPU's eager path)",
    )
    args = p.parse_args(argv)
    trace = trace_rounds(args.rounds, eager_bodies=args.eager_bodies)
    for k in range(len(trace.rounds)):
        print(f"round {k}: {trace.functions(k)} functions in {trace.files(k)} files")
    if args.list:
        for f, name, line in sorted(trace.rounds[-1]):
            print(f"  {f}:{line} {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
