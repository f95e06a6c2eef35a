"""A randomized soak of the gRPC cluster against its oracles, one drawn configuration per seed.

    .venv/bin/python scripts/soak.py                          # seeds 1-8, 40 s each
    .venv/bin/python scripts/soak.py --seeds 5,9 --seconds 120 --sample --learn
    .venv/bin/python scripts/soak.py --seeds 3 --requests 24  # a budget of requests instead

Per seed: target, draft and router servers on loopback in this process (`tests/grpc_harness`),
on the copy pair (`tests/copy_drafts.py`: drafts the target accepts, so accepted paths are
exercised), with a configuration drawn from the seed (`draw`): the draft's kind, the target's
KV pool, page size, prefix-cache bound and block, prefill sizes and request rows, the draft's
pre-drafting and prefix cache, the router's micro-batches, batch size, speculation mode, prefill
chunks, pipelined decoding and shared-memory rows, and one or two target replicas (with two, the
second may stop halfway, as a crashed one: its requests are replayed on the first); ``--learn`` gives an EAGLE draft online
learning with a guard that keeps every update (versions change while requests run). Client
threads send requests over a few shared prefixes (three in ten the next turn of the thread's last
chat: its prompt and answer resent), one in three cancelled after its first answers,
until ``--seconds`` or ``--requests`` run out. Checked: every finished greedy output equals
transformers' greedy continuation; with ``--sample`` half the requests are seeded at temperature
0.8 and must equal what plain decoding in process draws for that seed (docs/sampling.md: a seed
fixes the output, speculation or not, except on near ties); no call fails but by cancel; every
KV cache's pages stay in one place each (`SPECMESH_CHECK_KV=1`); both services hold nothing at
the end. A seed stops at its first failed check. Prints one line per seed (the outcome and the
configuration) and exits non-zero if any check failed.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

os.environ.setdefault("SPECMESH_CHECK_KV", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import grpc
from conftest import hf_greedy
from copy_drafts import make_copy_pair
from grpc_harness import LoopThread, serve_draft, serve_router, serve_target, wait_until

from specmesh.client import GenerationClient
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams, TargetConfig
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.target_service.runtime import TargetRuntime

KINDS = ("eagle3", "eagle3", "eagle", "mtp", "standalone", "ngram")


@dataclass
class Config:
    kind: str
    target: dict
    draft: dict
    router: dict
    shared_memory: bool
    learn: bool
    replicas: int  # target replicas behind the router
    stop_one: bool  # the second replica stops halfway: its requests are replayed on the first


@dataclass
class Tally:
    exact: int = 0
    cancelled: int = 0
    wrong: list = field(default_factory=list)  # (prompt, new tokens, seed, got, wanted)
    failed: list = field(default_factory=list)  # status names of failed calls


def draw(seed: int, learn: bool) -> Config:
    rng = random.Random(seed)
    pick = rng.choice
    page = pick([1, 2, 4, 8])
    target = {"num_kv_slots": pick([400, 704, 1200]), "page_size": page,
              "prefix_cache_tokens": pick([0, 64, 160]),
              "prefix_block_size": max(page, pick([4, 8])),
              "max_prefill_tokens": pick([16, 64]), "max_requests": pick([6, 16])}  # fmt: skip
    kind = pick(KINDS)
    draft = {"predraft": pick([0, 2]), "prefix_cache_tokens": pick([0, 64])}
    router = {"num_micro_batches": pick([1, 2]), "max_batch_size": pick([3, 8]),
              "speculation": pick(["always", "adaptive"]), "prefill_chunk_tokens": pick([8, 24, 512]),
              "pipeline_decode": pick([True, False])}  # fmt: skip
    replicas = pick([1, 1, 2])
    shm, learns = pick([True, False]), learn and "eagle" in kind
    stop = replicas > 1 and pick([True, False])
    return Config(kind, target, draft, router, shm, learns, replicas, stop)


class Cluster:
    def __init__(self, pair: Path, cfg: Config) -> None:
        target_dir = str(pair / "target")
        draft_dir = str(pair / cfg.kind) if cfg.kind != "ngram" else None
        self.loop = LoopThread()
        self.targets = [
            self.loop.run(serve_target(TargetRuntime(TargetConfig(target_dir, **cfg.target))))
            for _ in range(cfg.replicas)
        ]
        runtime = load_draft(
            DraftConfig(cfg.kind, draft_dir, target_dir, SpecParams(3, 4, 8), **cfg.draft)
        )
        self.learner = _learning(runtime) if cfg.learn else None
        self.draft = self.loop.run(serve_draft(runtime))
        settings = {"shared_memory": cfg.shared_memory}
        self.router = self.loop.run(
            serve_router(self.targets, self.draft, settings=settings, **cfg.router)
        )
        self.client = GenerationClient(f"127.0.0.1:{self.router.port}")

    def stop_last(self) -> None:
        """The last target replica goes away (as a crashed one: its connections drop)."""
        self.loop.run(self.targets.pop().host.shutdown(0))

    def holds_nothing(self, timeout_s: float) -> bool:
        dr = self.draft.runtime
        cache = getattr(dr.drafter, "cache", None)
        return wait_until(
            lambda: not dr.live and not (cache is not None and cache.requests)
            and not any(t.runtime.cache.requests for t in self.targets), timeout_s,
        )  # fmt: skip

    def close(self) -> None:
        if self.learner is not None:
            self.learner.close()
        self.client.close()
        self.loop.run(self.router.stop(0.5))
        for servicer in (*self.targets, self.draft):
            self.loop.run(servicer.host.shutdown(0.5))
        self.loop.close()


def _learning(runtime):
    from online_traffic import SETTINGS, KeepAll

    from specmesh.draft_service.online import attach_learner

    learner = attach_learner(runtime, SETTINGS, start=False)
    learner.guard = KeepAll()
    learner.start()
    return learner


class Oracle:
    """transformers' greedy continuation, or plain decoding in process for a seeded sample."""

    def __init__(self, target_dir: Path) -> None:
        self.target_dir, self.lock, self.known = target_dir, threading.Lock(), {}
        self.plain: Engine | None = None

    def __call__(self, prompt: list[int], params: SamplingParams) -> list[int]:
        key = (tuple(prompt), params.max_new_tokens, params.seed)
        with self.lock:
            if key not in self.known:
                self.known[key] = self._run(prompt, params)
            return self.known[key]

    def _run(self, prompt: list[int], params: SamplingParams) -> list[int]:
        if params.temperature == 0:
            return hf_greedy(self.target_dir, prompt, params.max_new_tokens)
        self.plain = self.plain or Engine(self.target_dir)
        return self.plain.generate([prompt], params)[0].token_ids


def client_thread(cluster: Cluster, oracle: Oracle, tally: Tally, rng: random.Random,
                  prefixes: list[list[int]], budget: Budget, sample: bool) -> None:  # fmt: skip
    chat: list[int] = []  # the last finished prompt and answer: a chat's next turn resends them
    while budget.take():
        start = chat if chat and len(chat) < 150 and rng.random() < 0.3 else rng.choice(prefixes)
        prompt = start + [rng.randrange(3, 300) for _ in range(rng.randrange(1, 20))]
        params = SamplingParams(max_new_tokens=rng.randrange(1, 48), ignore_eos=True)
        if sample and rng.random() < 0.5:
            params = SamplingParams(max_new_tokens=params.max_new_tokens, ignore_eos=True,
                                    temperature=0.8, seed=rng.randrange(1 << 30))  # fmt: skip
        cancel_after = rng.choice([None, None, None, None, 1, 3])
        got = _call(cluster.client, prompt, params, cancel_after, tally, budget.timeout_s)
        if got is None:
            continue
        want, chat = oracle(prompt, params), prompt + got
        if got == want:
            tally.exact += 1
        else:
            tally.wrong.append((prompt, params.max_new_tokens, params.seed, got, want))


def _call(client, prompt, params, cancel_after, tally: Tally, timeout_s: float) -> list[int] | None:
    """The call's tokens when it finished; None (counted) when cancelled or failed."""
    call = client.generate(prompt_token_ids=prompt, sampling=params, timeout=timeout_s)
    ids: list[int] = []
    try:
        for k, answer in enumerate(call):
            ids += answer.token_ids
            if cancel_after is not None and k >= cancel_after:
                call.cancel()
                break
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.CANCELLED:
            tally.failed.append(e.code().name)
            return None
    if cancel_after is not None and len(ids) < params.max_new_tokens:
        tally.cancelled += 1
        return None
    return ids


class Budget:
    """Time and requests left to a seed; none once a check failed (the seed stops there)."""

    def __init__(self, args: argparse.Namespace, tally: Tally) -> None:
        self.end, self.left = time.monotonic() + args.seconds, args.requests
        self.timeout_s, self.tally, self.lock = args.timeout, tally, threading.Lock()
        self.start, self.seconds, self.requests = time.monotonic(), args.seconds, args.requests
        self.taken = 0
        self.halfway = threading.Event()  # half the time or the requests are gone, or all

    def take(self) -> bool:
        with self.lock:
            failed = self.tally.wrong or self.tally.failed
            now = time.monotonic()
            if now - self.start > self.seconds / 2 or 2 * self.taken >= (self.requests or 1 << 62):
                self.halfway.set()
            if failed or now > self.end or self.left == 0:
                self.halfway.set()
                return False
            self.taken += 1
            if self.left is not None:
                self.left -= 1
            return True


def router_counts() -> dict[str, float]:
    """Requests replayed after a target failed, and preempted for KV space, by every router in
    this process so far (`router.metrics`)."""
    from specmesh.router.metrics import REGISTRY

    names = {
        "specmesh_request_replays_total": "replayed",
        "specmesh_num_preemptions_total": "preempted",
    }
    counts = dict.fromkeys(names.values(), 0.0)
    for metric in REGISTRY.collect():
        for sample in metric.samples:
            if sample.name in names:
                counts[names[sample.name]] += sample.value
    return counts


def soak(pair: Path, seed: int, args: argparse.Namespace) -> bool:
    cfg, before = draw(seed, args.learn), router_counts()
    cluster, tally = Cluster(pair, cfg), Tally()
    budget = Budget(args, tally)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 300) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    oracle = Oracle(pair / "target")
    threads = [
        threading.Thread(target=client_thread, args=(cluster, oracle, tally, random.Random(
            seed * 1000 + i), prefixes, budget, args.sample))
        for i in range(args.threads)
    ]  # fmt: skip
    for t in threads:
        t.start()
    if cfg.stop_one:
        budget.halfway.wait()
        cluster.stop_last()
    for t in threads:
        t.join()
    empty = cluster.holds_nothing(args.timeout)
    cluster.close()
    ok = not tally.wrong and not tally.failed and empty
    counts = {k: int(v - before[k]) for k, v in router_counts().items()}
    print(f"seed {seed}: {'ok' if ok else 'FAILED'}: {tally.exact} exact, {len(tally.wrong)} wrong, "
          f"{tally.cancelled} cancelled, {counts['replayed']} replayed, {counts['preempted']} "
          f"preempted, failed {tally.failed or 'none'}, services empty {empty}; "
          f"{asdict(cfg)}", flush=True)  # fmt: skip
    for prompt, n, sample_seed, got, want in tally.wrong[:3]:
        print(f"  prompt {prompt} ({n} tokens, seed {sample_seed}): got {got}, want {want}")
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--seeds", default="1,2,3,4,5,6,7,8", help="comma-separated")
    p.add_argument("--seconds", type=float, default=40.0, help="per seed")
    p.add_argument("--requests", type=int, default=None, help="per seed, instead of time")
    p.add_argument("--threads", type=int, default=10, help="client threads")
    p.add_argument(
        "--timeout", type=float, default=120.0,
        help="seconds a call may take, and the services to empty after the last",
    )  # fmt: skip
    p.add_argument("--sample", action="store_true", help="half the requests seeded at 0.8")
    p.add_argument("--learn", action="store_true", help="EAGLE drafts learn online")
    p.add_argument("--pair", type=Path, default=None, help="a copy pair (built if absent)")
    args = p.parse_args(argv)
    pair = args.pair or Path(tempfile.mkdtemp(prefix="specmesh-soak-")) / "pair"
    if not (pair / "target").is_dir():
        make_copy_pair(pair)
    results = [soak(pair, int(s), args) for s in args.seeds.split(",") if s.strip()]
    return 0 if all(results) else 1


if __name__ == "__main__":
    raise SystemExit(main())
