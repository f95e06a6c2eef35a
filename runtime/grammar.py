"""A service's grammar engine (`protocol.constraints`, llguidance): constraints compiled once
per service, a matcher per constrained request, and the allowed-token mask of a matcher state.

The target masks what it samples and verifies (`target_service.grammar`); the draft masks what it
proposes (`draft_service.grammar`). Both build their matchers here from the target's tokenizer,
its vocabulary size and EOS ids, so a mask means the same token set on either side.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from specmesh.protocol.constraints import Constraint, grammar_of, llg_tokenizer, parser_limits
from specmesh.protocol.errors import InvalidRequestError

MAX_COMPILED = 64  # compiled grammars kept per service (LRU), keyed by the constraint's text


class Grammars:
    """One service's compiled constraints: a template matcher per constraint, copied per request
    (a copy costs ~1 µs; compiling, up to the engine's limits, much more)."""

    def __init__(self, model_dir: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.model_dir, self.vocab_size, self.eos_ids = model_dir, vocab_size, eos_ids
        self._tokenizer: Any = None
        self._compiled: OrderedDict[Constraint, Any] = OrderedDict()

    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                hf = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
            except (OSError, ValueError) as e:
                raise InvalidRequestError(
                    f"grammar constraints need the target's tokenizer; {self.model_dir} has none "
                    f"usable: {e}"
                ) from None
            self._tokenizer = llg_tokenizer(hf, self.vocab_size, self.eos_ids)
        return self._tokenizer

    def compiled(self, constraint: Constraint) -> Any:
        """The template matcher (compiled once, then from the cache); InvalidRequestError
        naming the problem when the engine cannot compile it."""
        import llguidance

        hit = self._compiled.get(constraint)
        if hit is not None:
            self._compiled.move_to_end(constraint)
            return hit
        grammar = grammar_of(constraint)
        matcher = llguidance.LLMatcher(
            self.tokenizer(), grammar, log_level=0, limits=parser_limits()
        )
        if matcher.is_error():
            raise InvalidRequestError(
                f"the {constraint.kind} constraint does not compile: {matcher.get_error()}"
            )
        self._compiled[constraint] = matcher
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)
        return matcher

    def start(self, constraint: Constraint, emitted: list[int]) -> Any:
        """A request's matcher after the tokens it already emitted (a replay's)."""
        matcher = self.compiled(constraint).deep_copy()
        if not all(matcher.consume_token(t) for t in emitted):
            raise InvalidRequestError(
                f"the emitted tokens do not follow the {constraint.kind} constraint"
            )
        return matcher


def allowed(matcher: Any, vocab_size: int) -> torch.Tensor:
    """``[vocab]`` bool: the tokens ``matcher``'s grammar allows next."""
    if matcher.is_error():
        raise InvalidRequestError(f"grammar matcher failed: {matcher.get_error()}")
    bits = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return torch.from_numpy(np.unpackbits(bits, bitorder="little")[:vocab_size].astype(np.bool_))


def allowed_rows(matchers: list[Any], vocab_size: int) -> np.ndarray:
    """``[len(matchers), vocab]`` bool (numpy): `allowed` of each matcher, written into one
    bitmask and unpacked once (a tree search's masks of one step)."""
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    bitmask = allocate_token_bitmask(len(matchers), vocab_size)  # [rows, ceil(vocab / 32)]
    for row, matcher in enumerate(matchers):
        if matcher.is_error():
            raise InvalidRequestError(f"grammar matcher failed: {matcher.get_error()}")
        fill_next_token_bitmask(matcher, bitmask, row)
    bits = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return bits.astype(np.bool_)


def consume(matcher: Any, tokens: list[int]) -> None:
    """Advance a request's matcher over committed tokens (each was drawn under its mask). One
    call per token: llguidance's ``consume_tokens`` refuses the EOS that ends a stopped
    grammar, which ``consume_token`` takes."""
    if not all(matcher.consume_token(t) for t in tokens):
        raise InvalidRequestError(
            f"grammar matcher refused committed tokens: {matcher.get_error()}"
        )
