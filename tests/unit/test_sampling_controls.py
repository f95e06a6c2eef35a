"""Penalties, logit_bias, min_tokens and min_p: greedy output equals transformers (its own
``repetition_penalty``, else a reference loop over its logits) with and without speculation;
sampling with penalties under speculation keeps the target's distribution (chi-square)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import assert_accepted, make_small_vocab_pair

from specmesh.protocol.config import SpecParams
from specmesh.protocol.errors import InvalidRequestError
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine
from specmesh.router.router_config import RouterConfig

PROMPT = [5, 6, 7, 8, 9, 10, 5, 6]


def _hf(model_dir: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def reference(model_dir: Path, prompt: list[int], params: SamplingParams, eos: tuple = ()):
    """Greedy decoding over transformers' logits with the controls applied by hand, in order:
    logit_bias, repetition, frequency / presence, min_tokens; stops like the router."""
    hf, out = _hf(model_dir), []
    stop = set(params.stop_token_ids) | set(eos)
    for _ in range(params.max_new_tokens):
        with torch.no_grad():
            x = hf(torch.tensor([prompt + out])).logits[0, -1].float().clone()
        for tok, b in params.logit_bias:
            x[tok] += b
        for tok in set(prompt + out):
            v = x[tok]
            x[tok] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
        for tok, c in Counter(out).items():
            x[tok] -= params.frequency_penalty * c + params.presence_penalty
        if len(out) < params.min_tokens:
            x[list(stop)] = float("-inf")
        out.append(int(x.argmax()))
        if out[-1] in stop:
            break
    return out


def engine(copy_dir: Path, speculate: bool, kind: str = "eagle3") -> Engine:
    """The one-layer target of `copy_drafts`, with its ``kind`` draft when ``speculate``: the
    draft knows no controls, but predicts the target well enough that rounds accept tokens,
    so the controls are applied along accepted paths (their history included)."""
    if not speculate:
        return Engine(copy_dir / "target")
    draft = None if kind == "ngram" else copy_dir / kind
    return Engine(copy_dir / "target", draft_model=draft, draft_kind=kind, spec=SpecParams(3, 4, 8))


def _check(result, speculate: bool) -> list[int]:
    if speculate:
        assert_accepted([result])
    return result.token_ids


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "eagle3"])
def test_repetition_penalty_equals_transformers_generate(copy_dir: Path, speculate: bool) -> None:
    e = engine(copy_dir, speculate)
    hf = _hf(copy_dir / "target")
    for penalty in (1.5, 0.7):
        with torch.no_grad():
            ids = torch.tensor([PROMPT])
            expect = hf.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False,
                repetition_penalty=penalty, eos_token_id=None, pad_token_id=0,
            )[0, len(PROMPT):].tolist()  # fmt: skip
        params = SamplingParams(max_new_tokens=16, repetition_penalty=penalty, ignore_eos=True)
        assert _check(e.generate([PROMPT], params)[0], speculate) == expect, penalty


CONTROLS = {
    "frequency": SamplingParams(max_new_tokens=16, frequency_penalty=1.5, ignore_eos=True),
    "presence": SamplingParams(max_new_tokens=16, presence_penalty=-2.0, ignore_eos=True),
    "mixed": SamplingParams(
        max_new_tokens=16,
        repetition_penalty=1.3,
        frequency_penalty=0.8,
        presence_penalty=0.5,
        logit_bias=((17, 3.0), (40, -1.0)),
        ignore_eos=True,
    ),
    "bias": SamplingParams(max_new_tokens=12, logit_bias=((77, 100.0),), ignore_eos=True),
}


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "speculative"])
@pytest.mark.parametrize("name", list(CONTROLS))
def test_controls_equal_reference_loop(copy_dir: Path, name: str, speculate: bool) -> None:
    """Speculative: the EAGLE-3 draft; for the bias that forces one token, the n-gram draft
    (a draft that knows no bias proposes the forced token only by looking it up)."""
    params = CONTROLS[name]
    e = engine(copy_dir, speculate, "ngram" if name == "bias" else "eagle3")
    out = _check(e.generate([PROMPT], params)[0], speculate)
    assert out == reference(copy_dir / "target", PROMPT, params)
    if name == "bias":
        assert out == [77] * 12


@pytest.mark.parametrize("speculate", [False, True], ids=["plain", "eagle3"])
def test_min_tokens_bans_stop_ids_until_reached(copy_dir: Path, oracle, speculate: bool) -> None:
    plain = oracle(copy_dir / "target", PROMPT, 12)
    stop = plain[2]  # would end the request at its third token
    params = SamplingParams(
        max_new_tokens=12, stop_token_ids=(stop,), min_tokens=6, ignore_eos=True
    )
    out = _check(engine(copy_dir, speculate).generate([PROMPT], params)[0], speculate)
    assert out == reference(copy_dir / "target", PROMPT, params)
    assert stop not in out[:6] and len(out) > 3


def test_validation_names_the_bad_value() -> None:
    bad = [
        dict(repetition_penalty=0.0), dict(frequency_penalty=2.5), dict(presence_penalty=-3.0),
        dict(min_p=1.5), dict(logprobs=21), dict(prompt_logprobs=-1), dict(min_tokens=65),
        dict(logit_bias=((5, 200.0),)),
    ]  # fmt: skip
    for kw in bad:
        with pytest.raises(InvalidRequestError, match=next(iter(kw))):
            SamplingParams(**kw).validate()
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias=((320, 1.0),)).check_vocab(320)
    SamplingParams(logit_bias=((319, 1.0),), logprobs=20, min_tokens=64).check_vocab(320)


# -- distribution under speculation -------------------------------------------------------------
@pytest.fixture(scope="module")
def small_vocab_pair(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 12-token target and an EAGLE-3 draft: top-4 trees cover much of the mass, so
    speculative sampling accepts often and every branch of the verifier runs."""
    return make_small_vocab_pair(
        tmp_path_factory.mktemp("controls_vocab"), vocab_size=12, num_layers=4, seed=5
    )


CHI2_CRIT_001 = [0, 10.83, 13.82, 16.27, 18.47, 20.52, 22.46, 24.32, 26.12, 27.88, 29.59, 31.26]


def _chi_square(counts: Counter, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson statistic over cells with expected count >= 5 (the rest pooled)."""
    cells, pooled = [], [0, 0.0]
    for tok, p in enumerate(probs.tolist()):
        if p * n >= 5:
            cells.append((counts.get(tok, 0), p * n))
        else:
            pooled = [pooled[0] + counts.get(tok, 0), pooled[1] + p * n]
    if pooled[1] >= 5:
        cells.append(tuple(pooled))
    return sum((o - e) ** 2 / e for o, e in cells), len(cells) - 1


def test_penalised_sampling_under_speculation_keeps_the_distribution(small_vocab_pair: Path):
    """Tokens 2 and 3 (the first verify round) with repetition, frequency and presence
    penalties, min_p and temperature, drawn under EAGLE-3 trees, follow the reference
    distribution (penalties over each sample's own prefix): chi-square at 0.001."""
    target, n, prompt = small_vocab_pair / "target", 2000, [1, 2, 3]
    params = SamplingParams(
        max_new_tokens=3, temperature=0.9, repetition_penalty=1.4, frequency_penalty=0.7,
        presence_penalty=0.4, min_p=0.02, ignore_eos=True,
    )  # fmt: skip
    engine = Engine(
        target, draft_model=small_vocab_pair / "draft", draft_kind="eagle3",
        spec=SpecParams(3, 4, 8), router_config=RouterConfig(max_batch_size=256, speculation="always"),
    )  # fmt: skip
    from dataclasses import replace

    results = engine.generate([prompt] * n, [replace(params, seed=s) for s in range(n)])
    outs = [r.token_ids for r in results]
    hf = _hf(target)
    prefix: list[int] = []
    for position in (1, 2):  # condition on the most frequent prefix so far
        group = [o for o in outs if o[: len(prefix)] == prefix]
        prefix = [*prefix, Counter(o[len(prefix)] for o in group).most_common(1)[0][0]]
        group = [o for o in outs if o[:position] == prefix]
        with torch.no_grad():
            x = hf(torch.tensor([prompt + prefix])).logits[0, -1].float()
        for tok in set(prompt + prefix):
            x[tok] = x[tok] / 1.4 if x[tok] > 0 else x[tok] * 1.4
        for tok, c in Counter(prefix).items():
            x[tok] -= 0.7 * c + 0.4
        probs = torch.softmax(x / 0.9, -1)
        probs = probs.masked_fill(probs < 0.02 * probs.max(), 0.0)
        probs /= probs.sum()
        stat, dof = _chi_square(Counter(o[position] for o in group), probs, len(group))
        assert dof >= 1 and stat < CHI2_CRIT_001[dof], (position, stat, dof)
    accepted = sum(1 for r in results if r.accept_lens and r.accept_lens[0] > 1)
    assert accepted > n // 4, f"only {accepted} of {n} first rounds accepted a draft token"
