"""The in-process Engine: continuous batching, stop rules, and lossless speculative sampling."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import assert_speculated, make_small_vocab_pair

from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.router.router_config import RouterConfig

PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13], [40, 41, 42, 43, 44, 45, 46, 47, 48], [90], [7, 7]]
MAX_NEW = [14, 6, 11, 20, 9]


@pytest.mark.parametrize("spec", [None, SpecParams(3, 4, 8)], ids=["plain", "eagle3-3-4-8"])
def test_requests_join_and_finish_at_different_steps(tiny_dir: Path, oracle, spec) -> None:
    """Two micro-batches of at most two requests: later prompts join as earlier ones finish."""
    engine = Engine(
        tiny_dir / "target",
        draft_model=tiny_dir / "draft" if spec else None,
        draft_kind="eagle3" if spec else None,
        spec=spec or SpecParams(),
        router_config=RouterConfig(max_batch_size=2, num_micro_batches=2),
    )
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in MAX_NEW]
    results = engine.generate(PROMPTS, params)
    for prompt, n, res in zip(PROMPTS, MAX_NEW, results, strict=True):
        assert res.token_ids == oracle(tiny_dir / "target", prompt, n)
        assert res.finish_reason == "length"
    if spec:
        assert_speculated(results)


def test_stop_string_and_stop_token_cut_the_output(tiny_dir: Path, oracle) -> None:
    engine = Engine(tiny_dir / "target")
    prompt = [5, 6, 7, 8]
    ref = oracle(tiny_dir / "target", prompt, 12)
    stop_tok = ref[4]
    res = engine.generate(
        [prompt], SamplingParams(max_new_tokens=12, stop_token_ids=(stop_tok,), ignore_eos=True)
    )[0]
    assert res.token_ids == ref[: ref.index(stop_tok) + 1] and res.finish_reason == "stop"
    # A stop string equal to a later token's text: output ends with the token that completes it.
    pieces = [engine.tokenizer.decode([t]) for t in ref]
    k = next(
        i for i in range(2, len(ref)) if pieces[i].strip().isascii() and pieces[i].strip().isalnum()
    )
    stop = pieces[k].strip()
    cut = engine.generate(
        [prompt], SamplingParams(max_new_tokens=12, stop=(stop,), ignore_eos=True)
    )[0]
    assert cut.finish_reason == "stop"
    assert stop not in cut.text
    first = next(i for i in range(len(ref)) if stop in engine.tokenizer.decode(ref[: i + 1]))
    assert cut.token_ids == ref[: first + 1]


def test_result_carries_the_logprobs_the_core_streamed(tiny_dir: Path, oracle) -> None:
    """Greedy fp32 with EAGLE-3 speculation: one logprob per generated token (collected over
    every round's chunk) and one per prompt token, each transformers' log-softmax there."""
    engine = Engine(
        tiny_dir / "target", draft_model=tiny_dir / "draft", draft_kind="eagle3",
        spec=SpecParams(3, 4, 8),
    )  # fmt: skip
    prompt, n = PROMPTS[0], 12
    params = SamplingParams(max_new_tokens=n, ignore_eos=True, logprobs=2, prompt_logprobs=1)
    res, plain = engine.generate([prompt, prompt], [params, SamplingParams(max_new_tokens=n)])
    assert res.token_ids == oracle(tiny_dir / "target", prompt, n)
    assert plain.logprobs is None and plain.prompt_logprobs is None  # not asked for
    from conftest import _hf_model  # the model `oracle` runs, make_small_vocab_pair

    hf = _hf_model(str(tiny_dir / "target"))
    with torch.no_grad():
        rows = torch.log_softmax(hf(torch.tensor([prompt + res.token_ids])).logits[0].float(), -1)
    assert [e.token_id for e in res.logprobs] == res.token_ids
    for k, e in enumerate(res.logprobs):
        row = rows[len(prompt) - 1 + k]
        assert e.logprob == pytest.approx(row[e.token_id].item(), abs=1e-4)
        assert [t for t, _ in e.top] == row.topk(2).indices.tolist()
    first, *rest = res.prompt_logprobs
    assert first is None and [e.token_id for e in rest] == prompt[1:]
    for t, e in enumerate(rest, start=1):
        assert e.logprob == pytest.approx(rows[t - 1, prompt[t]].item(), abs=1e-4)
        assert len(e.top) == 1


@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A target with an 8-token vocabulary, so a top-4 tree covers most of the target's mass and
    speculative sampling accepts often: the distribution test then exercises every branch."""
    return make_small_vocab_pair(
        tmp_path_factory.mktemp("small_vocab"), vocab_size=8, num_layers=6, seed=3
    )


def _target_probs(target: Path, ids: list[int], temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.softmax(hf(torch.tensor([ids])).logits[0, -1] / temperature, -1)


def _chi_square(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson statistic over cells with expected count >= 5 (the rest pooled)."""
    stat, dof, pooled_obs, pooled_exp = 0.0, -1, 0, 0.0
    for tok, p in enumerate(probs.tolist()):
        exp = p * n
        if exp >= 5:
            stat += (counts.get(tok, 0) - exp) ** 2 / exp
            dof += 1
        else:
            pooled_obs, pooled_exp = pooled_obs + counts.get(tok, 0), pooled_exp + exp
    if pooled_exp >= 5:
        stat += (pooled_obs - pooled_exp) ** 2 / pooled_exp
        dof += 1
    return stat, dof


def assert_follows_target(
    outs: list[list[int]], target: Path, prompt: list[int], temperature: float
) -> None:
    """Tokens 2 and 3 of ``outs`` (each conditioned on the most frequent prefix so far) pass a
    chi-square goodness-of-fit test against the target's own distribution at 0.001."""
    prefix: list[int] = []
    for position in (1, 2):
        group = [o for o in outs if o[: len(prefix)] == prefix]
        prefix = [*prefix, Counter(o[len(prefix)] for o in group).most_common(1)[0][0]]
        group = [o for o in outs if o[:position] == prefix]
        counts = Counter(o[position] for o in group)
        probs = _target_probs(target, prompt + prefix, temperature)
        stat, dof = _chi_square(counts, probs, len(group))
        assert dof >= 1 and stat < CHI2_CRIT_001[dof], (position, stat, dof, counts)


def sample_and_check(
    engine: Engine, target: Path, prompt: list[int], temperature: float, n: int
) -> int:
    """``n`` seeded 3-token samples of ``prompt`` through ``engine`` checked by
    `assert_follows_target`; returns how many first rounds accepted a draft token."""
    params = [
        SamplingParams(max_new_tokens=3, temperature=temperature, seed=s, ignore_eos=True)
        for s in range(n)
    ]
    results = engine.generate([prompt] * n, params)
    assert_follows_target([r.token_ids for r in results], target, prompt, temperature)
    return sum(1 for r in results if r.accept_lens and r.accept_lens[0] > 1)


# Every round drafts, and no draft step is dropped for being slow (a loaded machine once took
# 15 of 1,000 first rounds' trees past the adaptive deadline): the counts below are not timing's.
NO_DEADLINE_ALWAYS = RouterConfig(
    max_batch_size=256, speculation="always", draft_timeout_s=600.0, draft_deadline_floor_s=600.0
)
# Upper 0.1% points of the chi-square distribution (significance level 0.001).
CHI2_CRIT_001 = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32}


@pytest.fixture(scope="module")
def small_vocab_deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer DeepSeek-V3 (MLA + MoE) with an 8-token vocabulary and a NextN layer that
    copies its block (`runtime.tiny_nextn`), so MTP trees are accepted often."""
    import transformers

    from specmesh.runtime.tiny import TINY_DEEPSEEK_DIMS, build_tokenizer
    from specmesh.runtime.tiny_nextn import add_nextn_layer

    out = tmp_path_factory.mktemp("small_vocab_deepseek")
    dims = {**TINY_DEEPSEEK_DIMS, "vocab_size": 8, "num_hidden_layers": 1,
            "first_k_dense_replace": 0}  # fmt: skip
    cfg = transformers.DeepseekV3Config(
        **dims, initializer_range=0.3, eos_token_id=None, bos_token_id=None, pad_token_id=None
    )
    torch.manual_seed(5)
    transformers.DeepseekV3ForCausalLM(cfg).save_pretrained(out)
    build_tokenizer().save_pretrained(out)
    return add_nextn_layer(out, copy_layer=0)


@pytest.mark.slow
def test_mtp_tree_sampling_matches_target_distribution(small_vocab_deepseek: Path) -> None:
    """As below, for DeepSeek-V3's own NextN layer drafting top-4 trees (MLA + MoE target)."""
    target, n, temp = small_vocab_deepseek, 3000, 0.8
    prompt = [1, 2, 3]
    engine = Engine(
        target, draft_model=target, draft_kind="mtp", spec=SpecParams(3, 4, 8),
        router_config=NO_DEADLINE_ALWAYS,
    )  # fmt: skip
    accepted = sample_and_check(engine, target, prompt, temp, n)
    assert accepted > n // 3, f"only {accepted} of {n} speculative rounds accepted a draft token"


@pytest.mark.slow
def test_speculative_sampling_matches_target_distribution(small_vocab_pair: Path) -> None:
    """Tokens 2 and 3 (the first speculative round: token 1 comes from prefill) under EAGLE-3 tree
    speculation (3 steps, top-4) are distributed as direct sampling from the target: chi-square
    goodness of fit at significance 0.001 on each conditional, 3000 samples."""
    target, n, temp = small_vocab_pair / "target", 3000, 0.8
    prompt = [1, 2, 3]
    engine = Engine(
        target, draft_model=small_vocab_pair / "draft", draft_kind="eagle3",
        spec=SpecParams(3, 4, 8), router_config=NO_DEADLINE_ALWAYS,
    )  # fmt: skip
    # The test means something only if drafts were accepted: count rounds that took >= 1 node.
    accepted = sample_and_check(engine, target, prompt, temp, n)
    assert accepted > n // 3, f"only {accepted} of {n} speculative rounds accepted a draft token"
