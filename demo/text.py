"""What the demo pair writes on the README's prompts, and how degenerate it is.

A tiny model decoding greedily falls into loops: the pair shipped before issue 50 wrote
`import sys` eleven times after `import os`, and `def _get_from_from_from...` after
`def fibonacci(n):`. The measure is the longest run of back-to-back copies of one n-gram of
tokens (`longest_repeat`): 11 copies of a 3-token n-gram there, 2 in ordinary code (two
`self.x = x` lines are different n-grams). The shipped pair's greedy continuations stay within
`MAX_REPEATS` (tests/unit/test_demo_text.py); `demo.compare` reports it for any pair.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# The prompts the README's examples send (in process, Python API, gRPC, OpenAI HTTP): chosen
# for the demo pair, whose greedy text loops on `def fib(n):` and `import os\n` (its card shows).
README_PROMPTS = ("def read_lines(path):", "def list_files(path):")
LOOPING_PROMPTS = ("def fib(n):", "import os\n")  # the README's earlier prompts, on the card
NEW_TOKENS = 64  # the longest continuation the README's examples ask for (generate's default)
MAX_REPEATS = 3  # back-to-back copies of one n-gram a greedy continuation may hold
MAX_NGRAM = 16  # longest n-gram (tokens) looked for


@dataclass(frozen=True)
class Repeat:
    count: int  # back-to-back copies
    n: int  # tokens per copy
    start: int  # index of the first copy


def longest_repeat(ids: Sequence[int], max_n: int = MAX_NGRAM) -> Repeat:
    """The n-gram (n <= max_n) repeated most often back to back in ``ids``; the shortest such
    n-gram, then the earliest, on ties. A sequence without repetition gives count 1."""
    ids = list(ids)
    best = Repeat(1, 1, 0)
    for n in range(1, max_n + 1):
        for start in range(len(ids) - 2 * n + 1):
            gram, count = ids[start : start + n], 1
            while ids[start + count * n : start + (count + 1) * n] == gram:
                count += 1
            if count > best.count:
                best = Repeat(count, n, start)
    return best


@dataclass(frozen=True)
class Continuation:
    prompt: str
    text: str
    token_ids: list[int]
    repeat: Repeat


def greedy_continuations(
    target_dir: str, prompts: Sequence[str] = README_PROMPTS, new_tokens: int = NEW_TOKENS
) -> list[Continuation]:
    """The target's greedy continuations through the serving engine (fp32, no draft: greedy
    output does not depend on speculation), as the README's examples get them."""
    from specmesh.protocol.sampling import SamplingParams
    from specmesh.router.engine import Engine

    engine = Engine(target_dir, target_config={"dtype": "fp32"})
    params = SamplingParams(max_new_tokens=new_tokens)
    results = engine.generate(list(prompts), params)
    return [
        Continuation(p, r.text, r.token_ids, longest_repeat(r.token_ids))
        for p, r in zip(prompts, results, strict=True)
    ]
