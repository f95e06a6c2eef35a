"""The demo pair's text: the repetition measure, and the committed pair's greedy continuations
of the README's prompts stay clear of loops (issue 50: the pair shipped before wrote
`import sys` eleven times after `import os`; the README's prompts changed with the pair, whose
greedy text still loops on `import os\n`, as its card shows)."""

from __future__ import annotations

import pytest

from specmesh.defaults import REPO_MODELS
from specmesh.demo.text import (
    MAX_REPEATS,
    NEW_TOKENS,
    README_PROMPTS,
    Repeat,
    greedy_continuations,
    longest_repeat,
)


def test_longest_repeat_finds_the_longest_back_to_back_run() -> None:
    assert longest_repeat([1, 2, 3, 4]) == Repeat(1, 1, 0)
    assert longest_repeat([5, 1, 2, 1, 2, 1, 2, 9]) == Repeat(3, 2, 1)
    assert longest_repeat([7, 7, 7, 7, 1, 2, 1, 2]) == Repeat(4, 1, 0)
    # `import sys\n` as three tokens, eleven times: one 3-gram, not a 6-gram 5 times
    assert longest_repeat([4, 5, 6] * 11 + [4]) == Repeat(11, 3, 0)
    assert longest_repeat([1, 2, 3, 1, 2, 4], max_n=2) == Repeat(1, 1, 0)  # not back to back


@pytest.mark.skipif(
    not (REPO_MODELS / "target" / "config.json").is_file(), reason="no committed demo pair"
)
def test_committed_pair_does_not_loop_on_the_readme_prompts() -> None:
    continuations = greedy_continuations(str(REPO_MODELS / "target"))
    assert [c.prompt for c in continuations] == list(README_PROMPTS)
    for c in continuations:
        assert len(c.token_ids) == NEW_TOKENS or c.token_ids[-1] == 1  # <|eos|> may end it
        assert c.repeat.count <= MAX_REPEATS, (
            f"{c.prompt!r}: {c.repeat.count} copies of a {c.repeat.n}-token n-gram: {c.text!r}"
        )
