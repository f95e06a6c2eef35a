"""Stop rules inside accepted runs, held-back text for stop strings, incremental detokenization."""

from __future__ import annotations

from specmesh.router.detokenizer import Detokenizer
from specmesh.router.request import Request
from specmesh.runtime.sampling import SamplingParams


class CharTokenizer:
    """id -> one character; ids >= 1000 are the two UTF-8 halves of 'é'."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raw = b"".join(
            b"\xc3" if i == 1000 else b"\xa9" if i == 1001 else chr(i).encode() for i in ids
        )
        return raw.decode("utf-8", errors="replace")


def _req(**kw: object) -> Request:
    params = SamplingParams(**{"max_new_tokens": 50, **kw})
    return Request("r", [65], params, eos_token_ids=(0,), detok=Detokenizer(CharTokenizer(), [65]))


def _ids(text: str) -> list[int]:
    return [ord(c) for c in text]


def test_stop_token_inside_an_accepted_run_drops_the_rest() -> None:
    r = _req(stop_token_ids=(ord("x"),))
    chunk = r.emit(_ids("abxcd"), accepted_round=True)
    assert chunk.token_ids == _ids("abx") and chunk.finish_reason == "stop"
    assert r.output_ids == _ids("abx") and r.accept_lens == [5]


def test_max_new_tokens_inside_a_run() -> None:
    r = _req(max_new_tokens=3)
    assert r.emit(_ids("abcdef")).token_ids == _ids("abc") and r.finish_reason == "length"


def test_eos_is_emitted_and_ends_unless_ignored() -> None:
    r = _req()
    assert r.emit([ord("a"), 0, ord("b")]).token_ids == [ord("a"), 0] and r.finish_reason == "stop"
    r = _req(ignore_eos=True, max_new_tokens=3)
    assert r.emit([ord("a"), 0, ord("b")]).token_ids == [ord("a"), 0, ord("b")]


def test_stop_string_across_steps_is_never_partly_streamed() -> None:
    r = _req(stop=("END",))
    streamed = [r.emit(_ids("abE")).text, r.emit(_ids("N")).text]
    assert "E" not in "".join(streamed)
    last = r.emit(_ids("Dzz"))
    assert last.finish_reason == "stop" and last.token_ids == _ids("D")
    assert r.text == "ab" == "".join([*streamed, last.text])


def test_multibyte_characters_are_not_split() -> None:
    r = _req()
    assert r.emit([1000]).text == ""
    assert r.emit([1001]).text == "é"
