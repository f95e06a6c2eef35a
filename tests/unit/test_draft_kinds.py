"""Every draft kind end to end through `Engine`: greedy speculative output equals transformers'
greedy ``generate`` token for token (lossless), for several (steps, topk, draft tokens).

Plus the kinds' own semantics against independent references: the EAGLE-1 network and the MTP
greedy chain against transformers' Llama decoder layer, the standalone oracle (draft = target
accepts everything) and the n-gram lookup.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import assert_accepted, assert_speculated, record_step_logits, reorder_tolerance

from specmesh.draft_service.ngram import NgramDrafter, find_continuations
from specmesh.draft_service.runtime import load_draft
from specmesh.protocol.config import DraftConfig, SpecParams
from specmesh.protocol.features import Feature
from specmesh.protocol.sampling import SamplingParams
from specmesh.protocol.steps import ExtendInput, PrefillInput
from specmesh.router.engine import Engine
from specmesh.runtime.loader import load_tensors
from specmesh.runtime.tiny import make_tiny_target
from specmesh.runtime.tiny_drafts import make_tiny_draft
from specmesh.target_service.runtime import TargetRuntime

KINDS = ("eagle3", "eagle", "mtp", "standalone", "ngram")
SPECS = ((1, 1, 2), (3, 1, 4), (3, 4, 8), (5, 4, 16), (2, 8, 10))
PROMPTS = (
    [17, 42, 99],
    [5, 6, 7, 8, 9, 10, 11],
    [200, 13, 77, 13, 77, 13, 77, 150, 31, 64, 12, 90],
    [250, 251, 252, 253, 254],
)
MAX_NEW = (12, 16, 20, 14)
STOP_REQ = 1  # this request also stops at a token its reference emits mid-way


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("kinds")
    paths = {"target": make_tiny_target(root / "target", seed=0)}
    for kind in KINDS[:-1]:
        paths[kind] = make_tiny_draft(root / kind, root / "target", kind, seed=1)
    return paths


@pytest.fixture(scope="module")
def pairs(copy_dir: Path, tmp_path_factory) -> dict[str, tuple[Path, Path | None]]:
    """Per kind, a target and a draft that predicts it (`copy_drafts`); for n-gram a target at a
    smaller init scale, whose output falls into short cycles that prompt lookup proposes."""
    cycling = tmp_path_factory.mktemp("cycling") / "target"
    make_tiny_target(cycling, seed=0, initializer_range=0.1)
    return {
        **{k: (copy_dir / "target", copy_dir / k) for k in KINDS[:-1]},
        "ngram": (cycling, None),
    }


@pytest.fixture(scope="module")
def reference(pairs) -> dict[Path, list[list[int]]]:
    """Per target, transformers greedy continuations (cut after the first EOS, as the engine
    stops there)."""
    from transformers import AutoModelForCausalLM

    refs = {}
    for target in {t for t, _ in pairs.values()}:
        model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
        eos = model.generation_config.eos_token_id
        outs = []
        for prompt, n in zip(PROMPTS, MAX_NEW, strict=True):
            ids = torch.tensor([prompt])
            gen = model.generate(ids, max_new_tokens=n, do_sample=False)[0, len(prompt) :].tolist()
            outs.append(gen[: gen.index(eos) + 1] if eos in gen else gen)
        refs[target] = outs
    return refs


def stop_token(ref: list[int]) -> int:
    """A token first emitted mid-way through ``ref``."""
    for j in range(3, len(ref) - 2):
        if ref[j] not in ref[:j]:
            return ref[j]
    pytest.skip("reference has no fresh token mid-way")


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: "s{}k{}n{}".format(*s))
@pytest.mark.parametrize("kind", KINDS)
def test_greedy_matches_transformers(pairs, reference, kind, spec):
    """Each kind's draft predicts its target, so rounds accept draft tokens (a random draft's
    are all rejected and would leave the accepted paths untested)."""
    target, draft = pairs[kind]
    expected = list(reference[target])
    stop = stop_token(expected[STOP_REQ])
    params = [
        SamplingParams(max_new_tokens=n, stop_token_ids=(stop,) if i == STOP_REQ else ())
        for i, n in enumerate(MAX_NEW)
    ]
    expected[STOP_REQ] = expected[STOP_REQ][: expected[STOP_REQ].index(stop) + 1]
    engine = Engine(target, draft_model=draft, draft_kind=kind, spec=SpecParams(*spec))
    results = engine.generate([list(p) for p in PROMPTS], params)
    assert [r.token_ids for r in results] == expected
    if kind != "ngram":  # n-gram proposes only where the context's suffix occurred before
        assert_speculated([r for r in results if len(r.token_ids) > 1])
    assert_accepted(results, min_tokens=4)
    assert results[STOP_REQ].finish_reason == "stop"


@pytest.mark.parametrize("steps", [1, 3])
def test_standalone_oracle_accepts_everything(models, steps):
    """The target as its own standalone draft: every full round accepts all ``steps`` tokens."""
    engine = Engine(
        models["target"],
        draft_model=models["target"],
        draft_kind="standalone",
        spec=SpecParams(steps, 1, steps + 1),
    )
    params = SamplingParams(max_new_tokens=4 * (steps + 1) + 2, ignore_eos=True)
    for r in engine.generate([list(PROMPTS[0]), list(PROMPTS[2])], params):
        full = r.accept_lens[:-1]
        assert full and sum(full) / len(full) == steps + 1, r.accept_lens


# -- network semantics against transformers' decoder layer ----------------------------------------
def test_noisy_standalone_copy_is_accepted(models, oracle, tmp_path: Path):
    """The target with 1 % noise on every weight as a standalone draft with top-2 trees: mostly
    accepted, and where the copy's first choice is wrong its second often is, so accepted paths
    leave tree order (the target must keep their KV, not the first nodes')."""
    import shutil

    from safetensors.torch import load_file, save_file

    noisy = shutil.copytree(models["target"], tmp_path / "noisy")
    gen = torch.Generator().manual_seed(0)
    weights = load_file(noisy / "model.safetensors")
    weights = {
        k: v + 0.01 * v.std() * torch.randn(v.shape, generator=gen) for k, v in weights.items()
    }
    save_file(weights, noisy / "model.safetensors", metadata={"format": "pt"})
    engine = Engine(models["target"], draft_model=noisy, draft_kind="standalone",
                    spec=SpecParams(3, 2, 6))  # fmt: skip
    prompts = [list(p) for p in PROMPTS]
    results = engine.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True)
                                        for n in MAX_NEW])  # fmt: skip
    for prompt, n, res in zip(prompts, MAX_NEW, results, strict=True):
        assert res.token_ids == oracle(models["target"], prompt, n)
    assert_speculated(results, min_mean_accept=2.2)


def test_ngram_is_accepted_on_repeating_output(tmp_path: Path, oracle):
    """Prompt lookup pays where text repeats: a target at transformers' default init scale falls
    into short cycles, which the n-gram draft proposes and the target accepts."""
    target = make_tiny_target(tmp_path / "target", initializer_range=0.02)
    engine = Engine(target, draft_kind="ngram", spec=SpecParams(3, 1, 4))
    prompts = [[17, 42, 99], [5, 6, 7, 8, 9, 10, 11], [250, 251, 252]]
    results = engine.generate(prompts, SamplingParams(max_new_tokens=24, ignore_eos=True))
    for prompt, res in zip(prompts, results, strict=True):
        assert res.token_ids == oracle(target, prompt, 24)
    assert_speculated(results, min_mean_accept=1.8)


def hf_layer(draft_dir: Path, prefix: str, *, input_norm: bool = True):
    """A transformers Llama decoder layer holding ``prefix``'s tensors; returns u -> layer(u)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    cfg = LlamaConfig(**json.loads((draft_dir / "config.json").read_text()))
    cfg._attn_implementation = "sdpa"
    layer = LlamaDecoderLayer(cfg, 0)
    if not input_norm:
        layer.input_layernorm = torch.nn.Identity()
    tensors = load_tensors(draft_dir)
    own = layer.state_dict()
    layer.load_state_dict(
        {
            k[len(prefix) :]: v
            for k, v in tensors.items()
            if k[len(prefix) :] in own and k.startswith(prefix)
        }
    )
    rope = LlamaRotaryEmbedding(cfg)

    def run(u: torch.Tensor, positions: list[int] | None = None) -> torch.Tensor:
        """[T, H] -> [T, H], causal; positions default to 0 .. T-1."""
        pos = torch.tensor([positions or list(range(u.shape[0]))])
        return layer(u[None], position_embeddings=rope(u[None], pos), position_ids=pos)[0]

    return run, tensors


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def prefill(models, feature: str, prompt: list[int]) -> tuple[TargetRuntime, int, torch.Tensor]:
    target = TargetRuntime.from_dir(models["target"])
    out = target.prefill([PrefillInput("r", prompt, SamplingParams())], Feature(feature))
    return target, out.tokens["r"][0], out.features


@torch.inference_mode()
def test_eagle1_root_logits_match_reference(models):
    prompt = list(PROMPTS[2])
    target, first, feats = prefill(models, "hidden", prompt)
    cfg = DraftConfig("eagle", str(models["eagle"]), str(models["target"]), SpecParams(1, 1, 2))
    drafter = load_draft(cfg, target.model).drafter
    assert drafter.needs.feature is Feature.HIDDEN
    drafter.extend([ExtendInput("r", prompt, first, feats, new=True)])

    layer, t = hf_layer(models["eagle"], "layers.0.", input_norm=False)
    embeds = target.model.embed(torch.tensor([*prompt[1:], first]))
    u = torch.cat([embeds, feats], -1) @ t["fc.weight"].t() + t["fc.bias"]
    expected = layer(u)[-1] @ target.model.head_weight.t()
    torch.testing.assert_close(drafter.roots["r"].logits, expected, rtol=1e-4, atol=1e-4)


@torch.inference_mode()
def test_mtp_topk1_chain_matches_reference(models):
    """topk = 1, 5 steps over 3 layers: every step's logits equal layer ``j % 3`` of a plain
    transformers re-computation. Steps 0-2 are the extend's greedy chain (layer l's rows, token
    column shifted by one per layer, guesses appended); steps 3-4 wrap around: one more row for
    layers 0 and 1 at position ``T - 1 + 3``, causal over that layer's earlier rows."""
    num_steps, num_layers = 5, 3
    prompt = list(PROMPTS[2])
    target, first, feats = prefill(models, "hidden_pre_norm", prompt)
    spec = SpecParams(num_steps, 1, num_steps + 1)
    drafter = load_draft(
        DraftConfig("mtp", str(models["mtp"]), str(models["target"]), spec), target.model
    ).drafter
    drafter.extend([ExtendInput("r", prompt, first, feats, new=True)])
    step_logits = record_step_logits(drafter, "r")  # step 0's logits, then each forward's
    tree = drafter.propose(["r"], [first])[0]

    def mtp_layer(i: int, ids: list[int], hidden: torch.Tensor, positions: list[int]):
        p = f"model.layers.{target.model_config.num_layers + i}."
        block, t = hf_layer(models["mtp"], p)
        e = target.model.embed(torch.tensor(ids))
        u = torch.cat([rms(e, t[p + "enorm.weight"]), rms(hidden, t[p + "hnorm.weight"])], -1)
        out = block(u @ t[p + "eh_proj.weight"].t(), positions)
        return out, rms(out, t[p + "shared_head.norm.weight"]) @ target.model.head_weight.t()

    n = len(prompt)
    ids, hidden, chain, rows = [*prompt[1:], first], feats, [], {}
    for j in range(num_steps):
        layer = j % num_layers
        if j < num_layers:  # the extend rows of this layer
            ids = ids if j == 0 else [*ids[1:], chain[-1]]
            rows[layer] = (ids, hidden, list(range(n)))
        else:  # one more row after this layer's extend rows
            toks, hid, pos = rows[layer]
            extra = n - 1 + num_layers * (j // num_layers)
            rows[layer] = ([*toks, chain[-1]], torch.cat([hid, hidden[-1:]]), [*pos, extra])
        hidden, logits = mtp_layer(layer, *rows[layer])
        torch.testing.assert_close(step_logits[j], logits[-1], rtol=1e-4, atol=1e-4)
        chain.append(int(logits[-1].argmax()))
    assert list(tree.tokens) == [first, *chain]
    assert list(tree.parents) == list(range(-1, num_steps))


# -- n-gram ---------------------------------------------------------------------------------------
def test_ngram_prefers_longest_then_most_recent_match():
    seq = [1, 2, 3, 9, 5, 2, 3, 7, 8, 1, 2, 3]
    # "1 2 3" occurred at 0 (followed by 9); "2 3" also at 5 (followed by 7, more recent).
    assert find_continuations(seq, 1, 3) == [[9, 5, 2]]
    assert find_continuations(seq, 3, 2) == [[9, 5], [7, 8]]
    assert find_continuations([4, 5, 6], 2, 3) == []
    assert find_continuations([7, 8, 7, 8], 1, 5) == [[7, 8, 7, 8, 7]]  # a pattern keeps going


def test_ngram_tree_branches_and_budget():
    drafter = NgramDrafter(SpecParams(3, 4, 6))
    drafter.extend([ExtendInput("r", [1, 2, 3, 9, 5, 6, 2, 3, 7, 8, 1, 2], 3, new=True)])
    tree = drafter.propose(["r"], [3])[0]
    # branches: "1 2 3" -> 9 5 6 ..., "2 3" -> 7 8 ...; 5 nodes: both first tokens, then chain 0
    assert list(tree.tokens) == [3, 9, 7, 5, 6, 2]
    assert list(tree.parents) == [-1, 0, 0, 1, 3, 4]
    drafter.extend([ExtendInput("q", [4, 5], 6, new=True)])
    assert drafter.propose(["q"], [6])[0].num_nodes == 1  # no match: root only


@pytest.mark.parametrize("kind", ["eagle3", "eagle", "mtp"])
def test_half_precision_drafts_keep_fp32_rope_frequencies(models, kind):
    """Casting a draft to bf16 must not round its RoPE inverse frequencies (the angles of far
    positions would drift from the ones the draft was trained with)."""
    cfg = DraftConfig(kind, str(models[kind]), str(models["target"]), SpecParams(), dtype="bf16")
    net = load_draft(cfg).drafter.net
    rotaries = [m for m in net.modules() if hasattr(m, "inv_freq")]
    assert rotaries and all(m.inv_freq.dtype == torch.float32 for m in rotaries)
    assert next(p for p in net.parameters() if p.is_floating_point()).dtype == torch.bfloat16


# -- the draft's own prefix cache -----------------------------------------------------------------
SHARED = [(11 * i + 5) % 240 + 3 for i in range(24)]  # 3 blocks of 8: the tails start a 4th


@pytest.mark.parametrize("kind", ["eagle", "mtp", "standalone"])
def test_draft_prefix_cache_rows_are_the_computed_ones(models, oracle, kind):
    """Prompts sharing a prefix, one at a time, with the draft's prefix cache on and off (the
    target's off, so the draft gets every row either way): outputs equal transformers', the
    draft reused rows, and every request's committed draft KV, in every layer's pool, is what
    the draft computes without the cache (a row cached under the wrong key shows here: output
    exactness cannot see it, and a random draft's acceptance barely can)."""
    prompts = [SHARED + tail for tail in ([7, 8], [9], [10, 11, 12])]
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    runs, rows = [], []
    for draft_cache in (0, 4096):
        engine = Engine(
            models["target"], draft_model=models[kind], draft_kind=kind,
            spec=SpecParams(3, 2, 6), target_config={"prefix_cache_tokens": 0},
            draft_config={"prefix_cache_tokens": draft_cache, "prefix_block_size": 8},
        )  # fmt: skip
        rows.append(_committed_rows_at_release(engine.draft.drafter))
        runs.append([engine.generate([p], params)[0] for p in prompts])
        prefixes = engine.draft.drafter.prefixes
        assert (prefixes is not None and prefixes.num_hit > 0) == bool(draft_cache)
    off, on = runs
    for prompt, a, b in zip(prompts, off, on, strict=True):
        assert b.token_ids == a.token_ids == oracle(models["target"], prompt, 10)
        assert b.accept_lens == a.accept_lens
    assert_speculated(on)
    assert len(rows[0]) == len(rows[1]) == len(prompts)
    for a, b in zip(*rows, strict=True):
        for ka, kb in zip(a, b, strict=True):
            torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-5)


def _committed_rows_at_release(drafter) -> list[list[torch.Tensor]]:
    """Each released request's committed K rows, per pool (the drafter's release wrapped)."""
    seen, release = [], drafter.release

    def wrapped(rid: str) -> None:
        cache = drafter.cache
        slots = cache.slots(rid, 0, cache.get(rid).committed_len)
        seen.append([pool.k[slots].clone() for pool in cache.pools])
        release(rid)

    drafter.release = wrapped
    return seen


BLOCK = 8


@pytest.mark.parametrize("kind", ["eagle3", "mtp"])
@torch.inference_mode()
def test_prefix_hit_at_the_lookahead_edge_equals_a_cold_extend(copy_dir, kind):
    """A draft row reads tokens after its own (EAGLE: the next one; MTP layer l: the (l + 1)th
    next), so a block is keyed by its tokens and ``lookahead`` more. The first request's ids
    end one token short of its second block's lookahead: that block must not be cached (MTP's
    last layer read the extend's guess there; an EAGLE row there was never computed). Requests
    that continue the same ids, two ways, must then get the draft KV (every layer's pool), root
    logits and tree of a cold extend. A block keyed one token short hands them a row computed
    from another token: output would stay exact (the target verifies), only acceptance drops."""
    target = copy_dir / "target"

    def runtime(cache_tokens: int):
        cfg = DraftConfig(kind, str(copy_dir / kind), str(target), SpecParams(3, 2, 6),
                          prefix_cache_tokens=cache_tokens, prefix_block_size=BLOCK)  # fmt: skip
        return load_draft(cfg)

    warm, cold = runtime(4096), runtime(0)
    # How far a row reads past itself: EAGLE's next token; the last of the MTP layers a round
    # runs (one pool each) reads that many tokens ahead.
    lookahead = 1 if kind == "eagle3" else len(warm.drafter.cache.pools)
    ids = [(13 * i + 7) % 250 + 3 for i in range(2 * BLOCK + lookahead + 4)]
    width = getattr(warm.drafter.net, "feature_width", warm.target.hidden_size)
    feats = torch.randn(len(ids), width, generator=torch.Generator().manual_seed(0))

    def extend(rt, rid: str, committed: list[int], nxt: int):
        inp = ExtendInput(rid, committed, nxt, feats[: len(committed)].clone(), new=True)
        return rt.step([inp]).trees[rid]

    edge = (
        2 * BLOCK + lookahead - 2
    )  # the first request's committed ids: one short of block 1's key
    extend(warm, "first", ids[:edge], ids[edge])
    for k, nxt in enumerate((5, 6)):  # continue past the edge two ways: one differs from a guess
        committed = [*ids[: edge + 1], 100 + k, *ids[edge + 2 : edge + 4]]
        rid = f"next{k}"
        hits = warm.drafter.prefixes.num_hit
        tree = extend(warm, rid, committed, nxt)
        assert warm.drafter.prefixes.num_hit > hits, "the shared prefix was not reused"
        assert tree == extend(cold, rid, committed, nxt)
        tol = reorder_tolerance(torch.float32)
        torch.testing.assert_close(warm.drafter.roots[rid].logits, cold.drafter.roots[rid].logits,
                                   **tol)  # fmt: skip
        for a, b in zip(_rows(warm.drafter, rid), _rows(cold.drafter, rid), strict=True):
            torch.testing.assert_close(a, b, **tol)


def _rows(drafter, rid: str) -> list[torch.Tensor]:
    """``rid``'s committed K and V rows, per pool."""
    slots = drafter.cache.slots(rid, 0, drafter.cache.get(rid).committed_len)
    return [t[slots] for pool in drafter.cache.pools for t in (pool.k, pool.v)]
