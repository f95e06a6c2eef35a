"""Grammar constraints on a request's output (structured outputs, required tool calls): what a
client asks for, and the one translation to the grammar engine both sides use.

A `Constraint` travels with the `SamplingParams` (wire: ``SamplingParams.constraint``) to the
target, which owns sampling: it masks every token it samples (and every tree node it verifies,
`target_service.grammar`) to the tokens the grammar allows after that token's path; the draft
gets it with a request's starting extend and proposes only such tokens (`draft_service.grammar`).
The router compiles it once at its public API, with its first masks, to refuse what the engine
cannot compile or mask (400 naming the problem) before any work. The engine is llguidance
(torch-free, so the router may load it; bench_results/HISTORY.md "Grammar masks" has the measurements that
chose it over xgrammar).

JSON is generated without free whitespace (``whitespace_flexible: false``, separators ``,`` and
``:``), as xgrammar's ``any_whitespace=False`` / vLLM's ``disable-any-whitespace``: a small
model cannot pad a document with newlines until ``max_tokens`` runs out.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from specmesh.protocol.errors import InvalidRequestError

# The kinds and what ``text`` holds for each.
KINDS = {
    "json_schema": "a JSON schema, as JSON text",
    "json_object": "nothing (any JSON object)",
    "regex": "a regular expression the whole output matches",
    "choice": "a JSON list of strings: the output is one of them",
    "lark": "a Lark grammar (llguidance's dialect)",
}
MAX_CONSTRAINT_BYTES = 64 << 10  # a schema / grammar / choice list, as text
MAX_CHOICES = 256
MAX_PROBED_TOKENS = 16  # forced tokens whose masks the compile check computes
_REGEX_META = set("\\.+*?()|[]{}^$#&-~")
_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True)
class Constraint:
    kind: str  # one of KINDS
    text: str = ""  # what KINDS says for the kind

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                f"constraint kind must be one of {sorted(KINDS)}, got {self.kind!r}"
            )
        size = len(self.text.encode("utf-8"))
        if size > MAX_CONSTRAINT_BYTES:
            raise InvalidRequestError(
                f"the {self.kind} constraint is {size} bytes; the limit is {MAX_CONSTRAINT_BYTES}"
            )
        if self.kind == "choice":
            choices = _choices(self.text)
            if not 1 <= len(choices) <= MAX_CHOICES:
                raise InvalidRequestError(
                    f"a choice constraint needs 1 to {MAX_CHOICES} choices, got {len(choices)}"
                )

    @staticmethod
    def json_schema(schema: Any) -> Constraint:
        """From a schema object (a dict, or a bool as JSON Schema allows)."""
        return Constraint("json_schema", json.dumps(schema, separators=(",", ":")))

    @staticmethod
    def choice(choices: list[str]) -> Constraint:
        return Constraint("choice", json.dumps(choices))


def _choices(text: str) -> list[str]:
    try:
        choices = json.loads(text)
    except ValueError as e:
        raise InvalidRequestError(f"a choice constraint must be a JSON list: {e}") from None
    if not isinstance(choices, list) or not all(isinstance(c, str) and c for c in choices):
        raise InvalidRequestError("a choice constraint must be a list of non-empty strings")
    return choices


def escape_regex(text: str) -> str:
    """``text`` as a regex matching itself (llguidance's Rust syntax: meta characters escaped)."""
    return "".join("\\" + c if c in _REGEX_META else c for c in text)


@lru_cache(maxsize=256)
def grammar_of(constraint: Constraint) -> str:
    """The llguidance grammar (its JSON form) for ``constraint``. Nothing is compiled yet: an
    invalid schema or regex is found by `compile_matcher`."""
    import llguidance

    kind, text = constraint.kind, constraint.text
    if kind == "json_schema":
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise InvalidRequestError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequestError("a JSON schema must be an object or a boolean")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(
            {"type": "object"}, defaults=_JSON_OPTIONS
        )
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "choice":
        pattern = "|".join(f"({escape_regex(c)})" for c in _choices(text))
        return llguidance.LLMatcher.grammar_from_regex(pattern)
    return llguidance.LLMatcher.grammar_from_lark(text)


def parser_limits() -> Any:
    """Bounds on the engine's work per grammar: compile (lexer fuel, grammar size) and per
    token (step fuel, Earley items); a grammar past them is refused, never a stuck service.
    llguidance's defaults, the grammar size cut to a tenth."""
    import llguidance

    return llguidance.LLParserLimits(max_grammar_size=50_000)


def compile_matcher(constraint: Constraint, tokenizer: Any) -> Any:
    """A matcher of ``constraint`` at its start, for ``tokenizer`` (an ``llguidance.LLTokenizer``);
    `InvalidRequestError` naming the problem when the engine cannot compile it or cannot compute
    its first masks (`first_masks_error`). The router checks with it; the services compile with
    it."""
    import llguidance

    try:
        grammar = grammar_of(constraint)
    except InvalidRequestError:
        raise
    except Exception as e:  # the engine's translation refused it
        raise InvalidRequestError(
            f"the {constraint.kind} constraint does not compile: {e}"
        ) from None
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=parser_limits())
    if matcher.is_error():
        raise InvalidRequestError(
            f"the {constraint.kind} constraint does not compile: {_headline(matcher.get_error())}"
        )
    message = first_masks_error(matcher.deep_copy(), tokenizer)
    if message:
        raise InvalidRequestError(
            f"the {constraint.kind} constraint is past the grammar engine's limits at its first "
            f"tokens: {message}"
        )
    return matcher


def check_compiles(constraint: Constraint, tokenizer: Any) -> None:
    """`compile_matcher`, the matcher dropped: the router's check (INVALID_ARGUMENT, HTTP 400)."""
    compile_matcher(constraint, tokenizer)


def first_masks_error(matcher: Any, tokenizer: Any) -> str:
    """'' when the engine computes ``matcher``'s mask at its start and after each token of the
    text its grammar forces there (at most `MAX_PROBED_TOKENS`), else its message. Compiling
    checks the grammar's size, not the parser's work per token: a JSON object of 500 optional
    properties compiles, then its mask after the forced ``{`` has 2,007 Earley items, past the
    engine's 2,000 (issue 54). Advances ``matcher``: pass a copy."""
    matcher.compute_bitmask()
    forced = tokenizer.tokenize_bytes(matcher.compute_ff_bytes())[:MAX_PROBED_TOKENS]
    for token in forced:
        if matcher.is_error() or matcher.try_consume_tokens([token]) != 1:
            break
        matcher.compute_bitmask()
    return _headline(matcher.get_error()) if matcher.is_error() else ""


def _headline(message: str) -> str:
    """The engine's message without the parser state it appends (``<state>`` ...)."""
    return message.split("\n<state>", 1)[0].removeprefix("Parser Error: ").strip()


def llg_tokenizer(hf_tokenizer: Any, vocab_size: int, eos_ids: tuple[int, ...]) -> Any:
    """The engine's view of a Hugging Face fast tokenizer over the model's ``vocab_size`` rows
    (ids past the tokenizer's are never allowed); the grammar's end allows ``eos_ids``."""
    from llguidance.hf import from_tokenizer

    eos = list(eos_ids) or None
    return from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
