"""The oracle tests must bite: plant known bugs, one at a time, and check the suite catches each.

    .venv/bin/python scripts/mutants.py            # every mutant, with a baseline run first
    .venv/bin/python scripts/mutants.py --list     # names, what each breaks, the tests it runs
    .venv/bin/python scripts/mutants.py kv-tree-order bonus-dropped --no-baseline --first
    .venv/bin/python scripts/mutants.py predraft-bonus-only --tests tests/unit/test_predraft.py

Each mutant replaces one exact snippet of one file in a scratch copy of the working tree (tracked
and untracked, not ignored files) and runs the tests named for it there; it is *killed* when they
fail (or hang past ``--timeout``), and *survives* when they pass. The report names every test that
failed (``--first``: stop at the first, faster; ``--tests``: other tests for every mutant). The
scratch copy is imported through a folder of symlinks that mirrors pyproject's package-dir
mapping, put first on PYTHONPATH, so the editable install (`.venv`) keeps pointing at the real
tree. Exit status 0 only when every mutant is killed and the baseline (the same tests,
unmutated) passes. `tests/unit/test_mutants.py` checks that every snippet is still in its file.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    breaks: str  # the bug, in words
    path: str  # file, relative to the repository root
    old: str  # exact snippet; must occur once
    new: str
    tests: tuple[str, ...]  # pytest node ids that must fail


ORACLE_TESTS = (
    "tests/unit/test_oracle_paths.py",
    "tests/unit/test_logprobs.py::test_greedy_logprobs_equal_transformers",
    "tests/unit/test_chunked_prefill.py::test_greedy_output_equals_transformers",
    "tests/unit/test_draft_kinds.py::test_noisy_standalone_copy_is_accepted",
    "tests/unit/test_kv_pressure.py::test_small_kv_cache_preempts_and_replays",
    "tests/integration/test_grpc_services.py::test_oracle_draft_accepts_several_tokens_per_round",
)
PREFIX_TESTS = (
    "tests/unit/test_prefix_eviction.py",
    "tests/integration/test_prefix_eviction_grpc.py",
    "tests/unit/test_prefix_cache.py::test_eviction_under_kv_pressure_keeps_output_exact",
)
MUTANTS = (
    Mutant(
        "kv-tree-order",
        "after a verify the target keeps the KV of the first nodes in tree order, not the path's",
        "runtime/kv_cache.py",
        "order = [*path, *(i for i in range(num_nodes) if i not in on_path)]",
        "order = list(range(num_nodes))  # mutant: tree order",
        ORACLE_TESTS,
    ),
    Mutant(
        "bonus-dropped",
        "a round that accepts draft tokens does not emit the bonus token after them",
        "target_service/verify.py",
        "tokens = [*path_ids[1:], bonus]",
        "tokens = [*path_ids[1:]] or [bonus]",
        ORACLE_TESTS,
    ),
    Mutant(
        "logprobs-untrimmed",
        "a stop inside an accepted run cuts the tokens but not their logprobs",
        "router/request.py",
        "kept = None if logprobs is None else logprobs[: len(new_ids)]",
        "kept = logprobs",
        (
            "tests/unit/test_logprobs.py",
            "tests/integration/test_logprobs_grpc.py::test_logprobs_and_penalty_over_grpc",
        ),
    ),
    Mutant(
        "draft-always-fails",
        "every draft step but the warm-up raises: the router silently falls back to plain decoding",
        "draft_service/runtime.py",
        "return propose(rids, roots) if grammar is None else propose(rids, roots, grammar)",
        'return propose(rids, roots) if "__warmup__" in rids else (_ for _ in ()).throw('
        'RuntimeError("mutant: the draft fails"))',
        (
            "tests/unit/test_oracle_paths.py",
            "tests/unit/test_engine.py::test_requests_join_and_finish_at_different_steps",
            "tests/unit/test_draft_kinds.py::test_greedy_matches_transformers",
            "tests/unit/test_multimodal.py::test_image_request_matches_transformers",
            "tests/unit/test_chunked_prefill.py::test_greedy_output_equals_transformers",
            "tests/unit/test_cli.py::test_make_tiny_then_generate",
            "tests/unit/test_kv_pressure.py::test_small_kv_cache_preempts_and_replays",
            "tests/integration/test_chunked_prefill_grpc.py::test_concurrent_requests_equal_transformers_greedy",
            "tests/integration/test_grpc_services.py::test_32_concurrent_streams_are_all_correct",
            "tests/integration/test_structured_outputs.py::test_json_schema_validates_and_equals_no_speculation",
        ),
    ),
    Mutant(
        "draft-ignores-grammar",
        "the draft proposes a constrained request's trees without its grammar's masks",
        "draft_service/runtime.py",
        "grammar = self.grammars.batch(rids)",
        "grammar = None",
        ("tests/unit/test_draft_grammar.py",),
    ),
    Mutant(
        "aux-layers-off-by-one",
        "the target captures EAGLE-3's aux hidden states one layer too deep",
        "protocol/features.py",
        'shift = 0 if self.convention == "input" else 1',
        'shift = 1 if self.convention == "input" else 2',
        (
            "tests/unit/test_target_runtime.py::test_aux_hidden_states_are_the_named_layers",
            "tests/unit/test_demo_pair.py::test_demo_pair_is_lossless_and_accepted",
        ),
    ),
    Mutant(
        "ids-not-rotated",
        "the EAGLE draft pairs feature row p with token p instead of token p + 1",
        "draft_service/feature_drafter.py",
        "ids = torch.from_numpy(np.array([*inp.committed_ids[1:], inp.next_token], dtype=np.int64))",
        "ids = torch.from_numpy(np.array(inp.committed_ids, dtype=np.int64))",
        ("tests/unit/test_demo_pair.py::test_demo_pair_is_lossless_and_accepted",),
    ),
    Mutant(
        "tree-mask-without-ancestors",
        "a tree node attends to the prefix and itself but not to its ancestors",
        "target_service/verify.py",
        "mask[i] |= mask[p]",
        "pass  # mutant: no ancestors",
        ORACLE_TESTS,
    ),
    Mutant(
        "tree-draws-keyed-by-request",
        "verify draws every tree node's token with the key of the request's next position, not the node's own",
        "target_service/acceptance.py",
        "target_ids = draw_tokens(padded, params, generated, impl).view(bs, n_max)",
        "target_ids = draw_tokens(padded, params, [i.sample_offset for i in inputs for _ in range(n_max)], impl).view(bs, n_max)",
        (
            "tests/unit/test_seeded_sampling.py",
            "tests/integration/test_grpc_services.py::test_a_seed_fixes_the_output_through_the_cluster",
        ),
    ),
    Mutant(
        "gumbel-noise-per-row",
        "the draw's noise ignores the token id, so every token of a row gets the same noise (the draw is greedy)",
        "kernels/gumbel.py",
        "h = _mix32_ref(tokens ^ lo)",
        "h = _mix32_ref(tokens * 0 ^ lo)",
        (
            "tests/unit/test_seeded_sampling.py::test_draws_over_seeds_follow_the_processed_distribution",
        ),
    ),
    Mutant(
        "gumbel-race-tie-to-the-last",
        "the Triton race gives a tie between two blocks to the later token, not the first as torch's argmax",
        "kernels/gumbel.py",
        "take = value > best",
        "take = value >= best",
        ("tests/unit/test_kernels_gumbel.py",),
    ),
    Mutant(
        "predraft-bonus-only",
        "a pre-drafted tree is taken for any extend with its bonus token, whatever path was accepted",
        "draft_service/predraft.py",
        "hit = outcomes.get((tuple(inp.committed_ids), inp.next_token))",
        "hit = next((o for (_, b), o in outcomes.items() if b == inp.next_token), None)",
        (
            "tests/unit/test_predraft.py::test_a_predrafted_tree_is_the_tree_drafted_cold",
            "tests/unit/test_predraft.py::test_an_outcome_is_matched_on_its_path_not_its_bonus_alone",
        ),
    ),
    Mutant(
        "mtp-prefix-lookahead-short",
        "the MTP draft's prefix blocks are keyed one token short: a cached row holds a guessed token",
        "draft_service/mtp_drafter.py",
        "self.prefix_lookahead = len(cache.pools)",
        "self.prefix_lookahead = len(cache.pools) - 1",
        (
            "tests/unit/test_draft_kinds.py::test_prefix_hit_at_the_lookahead_edge_equals_a_cold_extend",
        ),
    ),
    Mutant(
        "prefix-refs-dropped-before-row",
        "a release drops the row's prefix references before freeing its row: an eviction it starts "
        "frees pages the row still lists, and the row frees them again",
        "runtime/kv_cache.py",
        "        self.free_pages.extend(p for p in reversed(req.pages) if p not in self.shared)\n"
        "        self.free_rows.append(req.row)\n"
        "        if self.on_release is not None:\n"
        "            self.on_release(rid)\n",
        "        if self.on_release is not None:\n"
        "            self.on_release(rid)\n"
        "        self.free_pages.extend(p for p in reversed(req.pages) if p not in self.shared)\n"
        "        self.free_rows.append(req.row)\n",
        PREFIX_TESTS,
    ),
    Mutant(
        "prefix-evicts-referenced-block",
        "a block a running request's row lists can be evicted: its pages are freed under the row",
        "runtime/prefix_cache.py",
        "return not self.refs and not self.children",
        "return not self.children",
        PREFIX_TESTS,
    ),
    Mutant(
        "prefix-mixed-pages",
        "with KV pages of several tokens, an answer's blocks share pages an accepted path mixed: "
        "the next turn reads KV of tokens it never had",
        "runtime/prefix_cache.py",
        "    if page_size == 1:\n        return [True] * len(table)\n",
        "    if True:\n        return [True] * len(table)\n",
        (
            "tests/unit/test_prefix_eviction.py::test_a_block_joins_only_with_whole_pages_in_order",
            "tests/unit/test_prefix_cache.py::test_a_paged_cache_reuses_an_answer_exactly",
        ),
    ),
    Mutant(
        "moe-pairs-unweighted",
        "a captured MoE's (token, expert) pairs add their experts' outputs without the routing "
        "weights: every DeepSeek decode step in a CUDA graph goes wrong",
        "kernels/moe_experts.py",
        "    return _sum_terms((y * weights.reshape(-1, 1)).to(x.dtype), x)\n",
        "    return _sum_terms(y.to(x.dtype), x)\n",
        (
            "tests/unit/test_moe.py::test_stacked_pairs_equal_the_routed_path",
            "tests/unit/test_deepseek_graphs.py::test_target_and_nextn_draft_through_static_paths",
        ),
    ),
    Mutant(
        "attention-rows-collapse",
        "a rows program attends its first row for every row of its block: a verify's tree "
        "rows all see the root's view",
        "kernels/attention.py",
        "        i = i0 + m // GROUP_PAD\n",
        "        i = i0 + 0 * m\n",
        (
            "tests/unit/test_kernels_attention.py",
            "tests/unit/test_backends.py",
        ),
    ),
)


def scratch_copy(dest: Path) -> None:
    """Tracked and untracked (not ignored) files of the working tree."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def import_shim(scratch: Path, shim: Path) -> None:
    """``shim/specmesh``: the scratch folders under the names pyproject maps them to."""
    config = tomllib.loads((scratch / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    root = shim / "specmesh"
    root.mkdir(parents=True)
    for entry in (scratch / mapping["specmesh"]).iterdir():
        (root / entry.name).symlink_to(entry)
    for name, folder in mapping.items():
        if name != "specmesh":
            (root / name.removeprefix("specmesh.")).symlink_to(scratch / folder)


def mutate(scratch: Path, m: Mutant) -> None:
    path = scratch / m.path
    text = path.read_text()
    if text.count(m.old) != 1:
        raise SystemExit(f"mutant {m.name}: {m.path} holds {text.count(m.old)} copies of {m.old!r}")
    path.write_text(text.replace(m.old, m.new))


def shim_env(shim: Path) -> dict[str, str]:
    """The shim first on the path, and no current folder before it: the scratch copy's own
    ``specmesh/`` (the namespace root, without the mapped folders) would shadow the shim and let
    the editable install import the real tree."""
    return {**os.environ, "PYTHONPATH": str(shim), "PYTHONSAFEPATH": "1"}


HUNG = -1  # `run_tests`' code when the tests did not end in time


def run_tests(
    scratch: Path, shim: Path, tests: tuple[str, ...], stop_first: bool, timeout_s: float
) -> tuple[int, list[str]]:
    """pytest's exit status and the tests that failed; `HUNG` after ``timeout_s`` (a mutant
    that makes a test wait forever is caught, but must not stop the run)."""
    env = shim_env(shim)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", *tests]
    if stop_first:
        cmd.insert(3, "-x")
    try:
        out = subprocess.run(
            cmd, cwd=scratch, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired as e:
        partial = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        return HUNG, re.findall(r"^FAILED (\S+)", partial, re.M)
    failed = re.findall(r"^FAILED (\S+)", out.stdout, re.M)
    if out.returncode not in (0, 1):
        sys.stderr.write(out.stdout[-3000:] + out.stderr[-3000:])
    return out.returncode, failed


def check_shim(scratch: Path, shim: Path) -> None:
    """Where the tests import from, run as they are (in the scratch copy)."""
    code = "import specmesh.router.request as m; print(m.__file__)"
    where = subprocess.run([sys.executable, "-c", code], cwd=scratch, env=shim_env(shim),
                           capture_output=True, text=True)  # fmt: skip
    if not where.stdout.startswith(str(shim)):
        raise SystemExit(f"the scratch copy is not what imports: {where.stdout or where.stderr}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("names", nargs="*", help="mutants to run (default: all)")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--no-baseline", action="store_true", help="skip the unmutated run")
    ap.add_argument("--first", action="store_true", help="stop each mutant at its first failure")
    ap.add_argument(
        "--tests", nargs="+", metavar="NODEID", help="run these tests for every chosen mutant"
    )
    ap.add_argument(
        "--timeout", type=float, default=600, help="seconds a test run may take (default 600)"
    )
    args = ap.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    if args.tests:
        chosen = [replace(m, tests=tuple(args.tests)) for m in chosen]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        raise SystemExit(f"unknown mutants {sorted(unknown)}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:31} {m.path}: {m.breaks}\n{'':31} tests: {' '.join(m.tests)}")
        return 0
    ok = True
    with tempfile.TemporaryDirectory(prefix="specmesh-mutants-") as tmp:
        scratch, shim = Path(tmp) / "tree", Path(tmp) / "shim"
        scratch_copy(scratch)
        import_shim(scratch, shim)
        check_shim(scratch, shim)
        if not args.no_baseline:
            tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
            start = time.monotonic()
            code, failed = run_tests(scratch, shim, tests, False, args.timeout)
            took = time.monotonic() - start
            print(
                f"{'baseline':31} {'passes' if code == 0 else 'FAILS'} ({took:.0f} s) {' '.join(failed)}"
            )
            ok = code == 0
        for m in chosen:
            original = (scratch / m.path).read_text()
            mutate(scratch, m)
            start = time.monotonic()
            code, failed = run_tests(scratch, shim, m.tests, args.first, args.timeout)
            took = time.monotonic() - start
            (scratch / m.path).write_text(original)
            verdict = {0: "SURVIVED", 1: "killed", HUNG: "killed (a test hung)"}.get(
                code, f"ERROR (pytest exit {code})"
            )
            print(f"{m.name:31} {verdict} ({took:.0f} s) by {' '.join(failed) or '-'}", flush=True)
            ok = ok and code in (1, HUNG)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
