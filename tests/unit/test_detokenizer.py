"""Incremental detokenization through the `tokenizers` library's `DecodeStream` (the demo's
real tokenizer) against the window decode that every other tokenizer uses, and against
decoding the whole output at once."""

from __future__ import annotations

import random

import pytest
import transformers

from specmesh.defaults import default_models
from specmesh.router.detokenizer import Detokenizer

TEXTS = [
    "def add(a, b):\n    return a + b  # sum\n",
    "naïve café — 東京 🚀🚀 emoji, ünïcödé; Ελληνικά ✓\n\tend",
    "   leading spaces and 'quotes' don't split , . ! ?",
]


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(default_models().target)


class WindowOnly:
    """The same tokenizer without its backend: the window decode."""

    def __init__(self, tokenizer) -> None:
        self.decode = tokenizer.decode


def stream(detok: Detokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids] + [detok.flush()]


def cases(tokenizer) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, output ids): real text split anywhere, and random ids (specials included)."""
    rng = random.Random(0)
    out = []
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        for cut in (0, 1, 3, len(ids) // 2):
            out.append((ids[:cut], ids[cut:]))
    for _ in range(20):
        out.append(([rng.randrange(len(tokenizer)) for _ in range(5)],
                    [rng.randrange(len(tokenizer)) for _ in range(40)]))  # fmt: skip
    return out


def test_the_stream_gives_what_the_window_decode_gives(tokenizer):
    all_cases = cases(tokenizer)
    streamed = [Detokenizer(tokenizer, prompt).backend is not None for prompt, _ in all_cases]
    assert sum(streamed) >= 0.8 * len(all_cases)  # the demo's tokenizer streams
    for prompt, ids in all_cases:
        fast = stream(Detokenizer(tokenizer, prompt), ids)
        window = stream(Detokenizer(WindowOnly(tokenizer), prompt), ids)
        assert "".join(fast) == "".join(window), (prompt, ids)


def test_a_prompt_ending_inside_a_character_is_not_streamed_again(tokenizer):
    ids = tokenizer("naïve", add_special_tokens=False)["input_ids"]
    cut = next(i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    detok = Detokenizer(tokenizer, ids[:cut])
    assert detok.backend is None and not "".join(stream(detok, ids[cut:])).startswith("na")


def test_the_streamed_text_is_the_whole_decode(tokenizer):
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert "".join(stream(Detokenizer(tokenizer, []), ids)) == text


def test_a_tokenizer_that_cleans_up_spaces_keeps_the_window_decode(tokenizer):
    class CleansUp(WindowOnly):
        backend_tokenizer = tokenizer.backend_tokenizer
        clean_up_tokenization_spaces = True

    assert Detokenizer(CleansUp(tokenizer)).backend is None
