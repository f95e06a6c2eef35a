"""Stop rules inside accepted runs, held-back text for stop strings, incremental detokenization."""

from __future__ import annotations

from specmesh.protocol.sampling import SamplingParams
from specmesh.router.detokenizer import Detokenizer
from specmesh.router.request import Request


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
    chunk = r.emit(_ids("abxcd"), tree_size=1)
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


def _reference_emit(text_steps: list[str], stop: tuple[str, ...]) -> tuple[str, bool]:
    """Stop strings by rescanning the whole text after every token (the rule `emit` keeps)."""
    full = ""
    for piece in text_steps:
        full += piece
        hits = [i for s in stop if (i := full.find(s)) >= 0]
        if hits:
            return full[: min(hits)], True
    return full, False


def test_incremental_stop_search_matches_a_full_rescan() -> None:
    """Random texts and stop sets (overlapping, nested, one a prefix of another), emitted in
    runs of several tokens: the same cut, the same finish, the same streamed text."""
    import random

    rng = random.Random(0)
    for _ in range(400):
        alphabet = "abc"
        stop = tuple(
            "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 5)))
            for _ in range(rng.randint(1, 4))
        )
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
        r = _req(stop=stop, max_new_tokens=len(text))  # the last token finishes it anyway
        streamed, i = "", 0
        while not r.finished:
            n = rng.randint(1, 4)
            streamed += r.emit(_ids(text[i : i + n])).text
            i += n
        expected, hit = _reference_emit(list(text), stop)
        assert r.text == streamed == expected, (stop, text)
        assert r.finish_reason == ("stop" if hit else "length")


def test_stop_search_cost_does_not_grow_with_the_text(monkeypatch) -> None:
    """32 stop strings of 256 characters, each almost matching the text, over 20 000 tokens:
    after each token only the tail is searched (the newest text and the 255 characters before
    it), never the whole text again. Measured on a 2-core VM: 0.3 s; a rescan per token: 3.1 s."""
    import time

    stop = tuple(("abcdefghij" * 26)[:255] + chr(ord("k") + i) for i in range(32))
    r = _req(stop=stop, max_new_tokens=20_000)
    windows = []  # characters each search may look at
    search = Request._stop_string_index

    def recording(self: Request, start: int) -> int | None:
        windows.append(len(self._full_text) - max(start, 0))
        return search(self, start)

    monkeypatch.setattr(Request, "_stop_string_index", recording)
    start = time.perf_counter()
    for _ in range(200):
        r.emit(_ids("abcdefghij" * 10))
    print(f"\n20 000 tokens, 32 stop strings of 256 chars: {time.perf_counter() - start:.2f} s")
    assert r.finish_reason == "length" and len(r.text) == 20_000
    assert len(windows) == 20_000 and max(windows) == 256  # 255 + the token's one character
