"""``specmesh router --per-request-spec-decode-metrics``: vLLM's flag reaches the router's
settings (`RouterSettings.per_request_spec_decode_metrics`, read by the HTTP API's
`openai_spec`), ``none`` by default; a value it does not know is refused by the parser."""

from __future__ import annotations

import pytest

from specmesh.cli.main import build_parser
from specmesh.router import server


@pytest.mark.parametrize(("flag", "level"), [([], "none"), (["summary"], "summary"),
                                             (["detailed"], "detailed")])  # fmt: skip
def test_the_flag_reaches_the_router_settings(monkeypatch, flag: list[str], level: str) -> None:
    seen = []

    async def serve(settings, grace_s: float) -> None:
        seen.append(settings)

    monkeypatch.setattr(server, "serve", serve)
    argv = ["router", "--target", "127.0.0.1:1", "--http-port", "0"]
    argv += ["--per-request-spec-decode-metrics", *flag] if flag else []
    args = build_parser("router").parse_args(argv)
    assert args.run(args) == 0
    assert seen[0].per_request_spec_decode_metrics == level


def test_an_unknown_level_is_refused() -> None:
    argv = ["router", "--target", "127.0.0.1:1", "--per-request-spec-decode-metrics", "all"]
    with pytest.raises(SystemExit):
        build_parser("router").parse_args(argv)
