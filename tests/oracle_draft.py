"""A draft that knows the answer, arranged so that only a correct verifier keeps the right KV.

`SiblingLastOracle` proposes the target's own greedy continuation (transformers on the request's
full context), but never in tree order: at every depth the wrong siblings come first and the
correct token last, so the accepted path is ``0, w, 2w, 3w, ...`` and never a prefix of the
node order. A verifier that keeps the KV of the first nodes instead of the accepted path's, drops
the bonus token or builds the tree mask without ancestors changes the greedy output.

The number of correct levels cycles ``depth, depth - 1, ..., 0`` from round to round (per
request), so full acceptance (the bonus after the last level), partial acceptance and rejection at
the root all occur; below the last correct level one level of wrong siblings is still proposed.
A tree has at most ``1 + width * depth`` nodes: give the draft ``SpecParams(depth, width, that)``.
"""

from __future__ import annotations

from pathlib import Path

from conftest import hf_greedy

from specmesh.draft_service.runtime import DraftRuntime
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.features import AuxLayers, Feature, FeatureSpec
from specmesh.protocol.trees import DraftTree
from specmesh.router.engine import Engine
from specmesh.runtime.config import load_model_config


class SiblingLastOracle:
    def __init__(self, target_dir: str | Path, depth: int = 3, width: int = 2) -> None:
        self.target_dir, self.depth, self.width = str(target_dir), depth, width
        mc = load_model_config(target_dir)
        self.vocab = mc.vocab_size
        # Ask the target for EAGLE-3 rows like a feature draft does: they cross every hop.
        self.needs = FeatureSpec(Feature.AUX_HIDDEN, AuxLayers.default(mc.num_layers))
        self.spec = SpecParams(depth, width, 1 + width * depth)
        self.history: dict[str, list[int]] = {}
        self.rounds: dict[str, int] = {}
        self.num_proposed = 0

    def extend(self, inputs) -> None:
        for inp in inputs:
            assert inp.features is not None, "the target sent no feature rows"
            assert inp.features.shape[0] == len(inp.committed_ids), "a feature row per token"
            if inp.new:
                self.history[inp.rid] = []
                self.rounds[inp.rid] = 0
            self.history[inp.rid].extend(inp.committed_ids)

    def propose(self, rids: list[str], roots: list[int]) -> list[DraftTree]:
        trees = []
        for rid, root in zip(rids, roots, strict=True):
            num_correct = self.depth - self.rounds[rid] % (self.depth + 1)
            self.rounds[rid] += 1
            ctx = [*self.history[rid], root]
            truth = hf_greedy(self.target_dir, ctx, min(num_correct + 1, self.depth))
            trees.append(self._tree(root, truth, num_correct))
        self.num_proposed += len(trees)
        return trees

    def _tree(self, root: int, truth: list[int], num_correct: int) -> DraftTree:
        """Levels ``< num_correct``: wrong siblings, then the true token (the next level's
        parent); level ``num_correct``: wrong siblings only. Verify accepts exactly
        ``num_correct`` draft tokens."""
        tokens, parents, parent = [root], [-1], 0
        for level, right in enumerate(truth):
            num_wrong = self.width - 1 if level < num_correct else self.width
            for k in range(num_wrong):
                tokens.append((right + 1 + 37 * k) % self.vocab)
                parents.append(parent)
            if level == num_correct:
                break
            tokens.append(right)
            parents.append(parent)
            parent = len(tokens) - 1
        return DraftTree.of(tokens, parents)

    def release(self, rid: str) -> None:
        self.history.pop(rid)
        self.rounds.pop(rid)

    def check_context(self, rid: str, num_new_tokens: int) -> None:
        """No KV cache, no context limit."""


def oracle_draft_runtime(target_dir: str | Path, depth: int = 3, width: int = 2) -> DraftRuntime:
    """The oracle behind the draft service's runtime (in process or served over gRPC)."""
    drafter = SiblingLastOracle(target_dir, depth, width)
    cfg = DraftConfig("eagle3", None, str(target_dir), drafter.spec)
    return DraftRuntime(cfg, drafter, load_model_config(target_dir))


def oracle_engine(target_dir: str | Path, depth: int = 3, width: int = 2, **engine_kw) -> Engine:
    """The in-process engine on ``target_dir`` with the oracle as its draft."""
    runtime = oracle_draft_runtime(target_dir, depth, width)
    tcfg = {"cuda_graph_tree_sizes": (runtime.cfg.spec.num_draft_tokens,)}
    engine = Engine(target_dir, target_config={**tcfg, **engine_kw.pop("target_config", {})},
                    **engine_kw)  # fmt: skip
    engine.draft = runtime
    return engine


def assert_varied(tokens: list[int], max_repeats: int = 4) -> None:
    """The compared span must not collapse into a few tokens (then wrong KV can go unseen)."""
    most = max(tokens.count(t) for t in set(tokens))
    assert most <= max_repeats, f"degenerate greedy output, a token repeats {most}x: {tokens}"


def mean_accept(results) -> float:
    """Tokens per speculative round over all ``results`` (each has ``accept_lens``)."""
    lens = [n for r in results for n in r.accept_lens]
    return sum(lens) / max(1, len(lens))
