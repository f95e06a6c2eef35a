"""The committed demo pair through the normal loaders: greedy speculative output equals
transformers in fp32, and the trained EAGLE-3 head is really accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

from specmesh.defaults import REPO_MODELS, default_models
from specmesh.protocol.config import SpecParams
from specmesh.protocol.sampling import SamplingParams
from specmesh.router.engine import Engine

PROMPTS = [
    "def read_config(path):\n    with open(path) as f:\n",
    "import os\nimport sys\n\n\nclass ",
]

pytestmark = pytest.mark.skipif(
    not (REPO_MODELS / "draft" / "config.json").is_file(), reason="no committed demo pair"
)


def test_default_model_is_the_demo_pair() -> None:
    chosen = default_models()
    assert Path(chosen.target) == REPO_MODELS / "target" and chosen.draft_kind == "eagle3"


@pytest.mark.slow
def test_demo_pair_is_lossless_and_accepted(oracle) -> None:
    fp32 = {"dtype": "fp32"}
    engine = Engine(
        REPO_MODELS / "target", draft_model=REPO_MODELS / "draft", draft_kind="eagle3",
        spec=SpecParams(5, 4, 8), target_config=fp32, draft_config=fp32,
    )  # fmt: skip
    results = engine.generate(PROMPTS, SamplingParams(max_new_tokens=32, ignore_eos=True))
    for res in results:
        assert res.token_ids == oracle(REPO_MODELS / "target", res.prompt_token_ids, 32)
    mean = sum(sum(r.accept_lens) for r in results) / sum(len(r.accept_lens) for r in results)
    assert mean > 2.0, f"the trained draft is barely accepted: mean accept length {mean:.2f}"


def test_demo_chat_template_renders_each_role_as_a_comment() -> None:
    """The shipped `chat_template.jinja` is what `make_demo` writes (`CHAT_TEMPLATE`); the
    router renders chat with it, its BOS left to the tokenizer."""
    from specmesh.demo.target import CHAT_TEMPLATE
    from specmesh.router.chat import ChatRenderer
    from specmesh.router.tokenizer import load_tokenizer

    assert (REPO_MODELS / "target" / "chat_template.jinja").read_text() == CHAT_TEMPLATE
    tokenizer = load_tokenizer(REPO_MODELS / "target")
    messages = [
        {"role": "system", "content": "Write Python."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "print('hi')"},
        {"role": "user", "content": "a fib function"},
    ]
    text = "# system:\nWrite Python.\n# user:\nhi\n# assistant:\nprint('hi')\n"
    text += "# user:\na fib function\n# assistant:\n"
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == "<|bos|>" + text
    assert ChatRenderer(tokenizer).render(messages) == text
