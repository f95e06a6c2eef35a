"""Per-request speculative figures in OpenAI responses (issue 51, `router/openai_spec.py`), in
vLLM's ``metrics.speculative_decoding`` shape, through the `openai` client: on with the router's
``per_request_spec_decode_metrics`` or a request's ``spec_decode_metrics``, in a response and in
a stream's final usage chunk, ``null`` for several choices. The copy pair's draft predicts its
target, so rounds accept draft tokens."""

from __future__ import annotations

import openai
import pytest
from grpc_harness import SPEC, serve_router

SUMMARY = {
    "mean_acceptance_length", "draft_acceptance_rate", "acceptance_histogram", "num_spec_steps",
    "num_accepted_draft_tokens", "num_draft_tokens", "num_spec_tokens",
}  # fmt: skip
GREEDY = {"temperature": 0.0, "max_tokens": 24}
HI = [{"role": "user", "content": "hi"}]


TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("chat") / "template.jinja"
    path.write_text(TEMPLATE)
    return str(path)


def _client(stack, level: str, template: str) -> tuple[openai.OpenAI, object]:
    settings = {"per_request_spec_decode_metrics": level, "chat_template": template}
    router = stack.loop.run(serve_router(stack.target, stack.draft, http_port=0, settings=settings))
    base = f"http://127.0.0.1:{router.http_port}/v1"
    return openai.OpenAI(base_url=base, api_key="-", max_retries=0), router


@pytest.fixture(scope="module")
def summary(copy_stack, template):
    """A router whose flag is ``summary``."""
    oa, router = _client(copy_stack, "summary", template)
    yield oa
    oa.close()
    copy_stack.loop.run(router.stop(0.5))


@pytest.fixture(scope="module")
def off(copy_stack, template):
    """A router with the flag left at ``none``."""
    oa, router = _client(copy_stack, "none", template)
    yield oa
    oa.close()
    copy_stack.loop.run(router.stop(0.5))


def _figures(response) -> dict | None:
    return response.to_dict().get("metrics", {}).get("speculative_decoding", "absent")


def _assert_consistent(spec: dict, detailed: bool) -> None:
    assert set(spec) == SUMMARY | ({"per_step_accepted", "per_step_drafted"} if detailed else set())
    hist, steps, accepted = spec["acceptance_histogram"], spec["num_spec_steps"], 0
    assert spec["num_spec_tokens"] == SPEC.num_steps and len(hist) == SPEC.num_steps + 1
    accepted = sum(j * count for j, count in enumerate(hist))
    assert sum(hist) == steps > 0 and accepted == spec["num_accepted_draft_tokens"] > 0
    assert spec["mean_acceptance_length"] == pytest.approx(1 + accepted / steps)
    assert spec["draft_acceptance_rate"] == pytest.approx(accepted / spec["num_draft_tokens"])
    if detailed:
        assert (
            sum(spec["per_step_accepted"]) == accepted and len(spec["per_step_accepted"]) == steps
        )
        assert sum(spec["per_step_drafted"]) == spec["num_draft_tokens"]
        assert all(0 < d < SPEC.num_draft_tokens for d in spec["per_step_drafted"])


def test_the_router_flag_puts_the_figures_in_every_response(summary) -> None:
    r = summary.completions.create(model="target", prompt=[5, 6, 7], **GREEDY)
    _assert_consistent(_figures(r), detailed=False)
    r = summary.chat.completions.create(model="target", messages=HI, **GREEDY)
    _assert_consistent(_figures(r), detailed=False)
    extra = {"spec_decode_metrics": "none"}  # a request may opt out
    r = summary.completions.create(model="target", prompt=[5], extra_body=extra, **GREEDY)
    assert "metrics" not in r.to_dict()


def test_a_request_asks_for_them_where_the_flag_is_off(off) -> None:
    r = off.completions.create(model="target", prompt=[5, 6, 7], **GREEDY)
    assert "metrics" not in r.to_dict()
    extra = {"spec_decode_metrics": "detailed"}
    r = off.completions.create(model="target", prompt=[5, 6, 7], extra_body=extra, **GREEDY)
    _assert_consistent(_figures(r), detailed=True)


def test_several_choices_get_null(summary) -> None:
    r = summary.completions.create(model="target", prompt=[5, 6], n=2, **GREEDY)
    assert _figures(r) is None
    r = summary.completions.create(model="target", prompt=[[5, 6], [7]], **GREEDY)
    assert _figures(r) is None


def test_a_stream_carries_them_in_its_final_usage_chunk(summary) -> None:
    options = {"include_usage": True}
    stream = summary.chat.completions.create(
        model="target", messages=HI, stream=True, stream_options=options, **GREEDY
    )
    chunks = list(stream)
    assert [_figures(c) for c in chunks[:-1]] == ["absent"] * (len(chunks) - 1)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 24
    _assert_consistent(_figures(chunks[-1]), detailed=False)
    plain = summary.completions.create(model="target", prompt=[5], stream=True, **GREEDY)
    assert all(_figures(c) == "absent" for c in plain)  # no usage chunk, no figures (vLLM)
