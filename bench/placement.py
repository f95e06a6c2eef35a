"""Cache-aware placement against least-loaded, by the prompt tokens the replicas' prefix caches
serve: two target replicas whose caches each hold two of four 48-token system prompts, and 16
users of each prompt arriving in a shuffled order, two at a time.

    python -m specmesh.bench.placement [--orders 7] [--target DIR]

Each order (a seeded shuffle of the 64 requests) runs once per placement, on fresh replicas
(a tiny random Llama unless ``--target`` names one; placement reads token ids, not weights).
Prints per order the cached tokens of each placement and their ratio, then the ratio's median
with min / max over the orders, and the best the caches could do (every request after its
prompt's first hits). The outputs of the two placements must be equal (checked).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
from pathlib import Path

NUM_PROMPTS, NUM_USERS, PROMPT_BLOCKS, BLOCK = 4, 16, 3, 16
SYSTEM = [[(31 * s + 7 * i) % 200 + 4 for i in range(PROMPT_BLOCKS * BLOCK)] for s in range(NUM_PROMPTS)]  # fmt: skip
WORKLOAD = [(s, u) for s in range(NUM_PROMPTS) for u in range(NUM_USERS)]
CACHE_TOKENS = 2 * PROMPT_BLOCKS * BLOCK  # two of the four system prompts per replica
NEW_TOKENS = 2


def prompt(system: int, user: int) -> list[int]:
    return SYSTEM[system] + [user + 4, 3]


def run(target_dir: Path, placement: str, order_seed: int = 0) -> tuple[int, int, dict]:
    """(prompt tokens the replicas' caches served, tokens looked up, outputs by (system,
    user)) of one shuffled order under ``placement``."""
    from specmesh.protocol.config import TargetConfig
    from specmesh.protocol.sampling import SamplingParams
    from specmesh.router.core import RouterCore
    from specmesh.router.engine import Engine
    from specmesh.router.in_process import InProcessTarget
    from specmesh.router.router_config import RouterConfig
    from specmesh.target_service.runtime import TargetRuntime

    cfg = TargetConfig(str(target_dir), prefix_cache_tokens=CACHE_TOKENS, prefix_block_size=BLOCK)
    runtimes = [TargetRuntime(cfg) for _ in range(2)]
    order = random.Random(order_seed).sample(WORKLOAD, len(WORKLOAD))
    router = RouterConfig(placement=placement)
    engine = Engine(target_dir, router_config=router)
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)

    async def serve() -> dict:
        targets = [InProcessTarget(rt, f"target-{i}") for i, rt in enumerate(runtimes)]
        core = RouterCore(targets, [], router)
        await core.start()
        out = {}
        try:
            for wave in range(0, len(order), 2):  # two users at a time
                pairs = order[wave : wave + 2]
                reqs = [engine.make_request(prompt(s, u), params) for s, u in pairs]
                done = await asyncio.gather(*(Engine._collect(core, r) for r in reqs))
                out.update({p: r.token_ids for p, r in zip(pairs, done, strict=True)})
        finally:
            await core.stop()
        return out

    outputs = asyncio.run(serve())
    blocks = [rt.prefixes.blocks for rt in runtimes]
    return sum(b.num_hit for b in blocks), sum(b.num_queried for b in blocks), outputs


def best_possible() -> int:
    """Cached tokens if every request but each prompt's first hit its whole system prompt."""
    return (len(WORKLOAD) - NUM_PROMPTS) * PROMPT_BLOCKS * BLOCK


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specmesh.bench.placement", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--orders", type=int, default=7, help="shuffled orders (seeds 0..N-1)")
    parser.add_argument("--target", help="a target checkpoint (default: a tiny random Llama)")
    args = parser.parse_args(argv)
    target = Path(args.target) if args.target else _tiny_target()
    print("| order | cache-aware tokens | least-loaded tokens | ratio |\n|---|---|---|---|")
    ratios = []
    for seed in range(args.orders):
        aware, _, aware_out = run(target, "cache-aware", seed)
        loaded, _, loaded_out = run(target, "least-loaded", seed)
        if aware_out != loaded_out:
            raise SystemExit(f"order {seed}: the placements' outputs differ")
        ratios.append(aware / loaded)
        print(f"| {seed} | {aware} | {loaded} | {aware / loaded:.2f} |", flush=True)
    print(f"\ncache-aware / least-loaded: {statistics.median(ratios):.2f} "
          f"({min(ratios):.2f} - {max(ratios):.2f}) over {args.orders} orders; "
          f"the caches' best: {best_possible()} tokens")  # fmt: skip
    return 0


def _tiny_target() -> Path:
    from specmesh.runtime.tiny import make_tiny_target

    return make_tiny_target(Path(tempfile.mkdtemp(prefix="specmesh-placement-")) / "target")


if __name__ == "__main__":
    sys.exit(main())
