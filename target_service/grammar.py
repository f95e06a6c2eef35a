"""Grammar masks on the target (`protocol.constraints`): a constrained request's every sampled
token, and every tree node it verifies, is drawn from the tokens its grammar allows there.

Per request the target keeps one llguidance matcher that has consumed every committed token,
the pending one included (the prefill's first token, each verify's accepted tokens and bonus:
`TargetRuntime.advance`); a replay (failover, preemption) rebuilds it from the emitted tokens it
is sent. Verify walks the tree: node i's state is a copy of its parent's that consumed node i's
token, so node i's mask is exactly the one plain constrained decoding computes after the path
root..i. A node whose token the grammar refuses gets no state: it can never be accepted (its
parent's draw is masked to allowed tokens), so its row and its subtree's stay unmasked
(rollback is structural: the request's own matcher never saw the node).

    committed tokens ... pending │ tree: root=pending ─ a ─ b      state(a) = copy(root) + a
    request matcher ─────────────┘                    └ c ─ d      state(d) = copy(c) + d

Masked logits are -inf where the grammar refuses, before every other processor, so greedy takes
the allowed argmax and the keyed draws (`runtime.sampling`) sample the constrained distribution:
the output equals constrained decoding without speculation, greedy and seeded.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np
import torch

from specmesh.protocol.constraints import Constraint, grammar_of, llg_tokenizer, parser_limits
from specmesh.protocol.errors import InvalidRequestError

MAX_COMPILED = 64  # compiled grammars kept per target (LRU), keyed by the constraint's text


class Grammars:
    """One target's compiled constraints: a template matcher per constraint, copied per request
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


def consume(matcher: Any, tokens: list[int]) -> None:
    """Advance a request's matcher over committed tokens (each was drawn under its mask). One
    call per token: llguidance's ``consume_tokens`` refuses the EOS that ends a stopped
    grammar, which ``consume_token`` takes."""
    if not all(matcher.consume_token(t) for t in tokens):
        raise InvalidRequestError(
            f"grammar matcher refused committed tokens: {matcher.get_error()}"
        )


def tree_masks(
    matcher: Any, tokens: list[int], parents: list[int], vocab_size: int
) -> torch.Tensor:
    """``[n, vocab]`` bool: row i, the tokens the grammar allows after the path root..i (the
    root, the pending token, is already consumed by ``matcher``, which is not changed). Nodes
    off the grammar, and their subtrees, allow everything (the module docstring)."""
    n = len(tokens)
    rows = torch.ones(n, vocab_size, dtype=torch.bool)
    states: list[Any] = [matcher] + [None] * (n - 1)
    rows[0] = allowed(matcher, vocab_size)
    for i in range(1, n):  # parents come before children
        parent = states[parents[i]]
        if parent is None:
            continue
        state = parent.deep_copy()
        if state.consume_token(tokens[i]):
            states[i], rows[i] = state, allowed(state, vocab_size)
    return rows


def mask_logits(logits: torch.Tensor, allow: torch.Tensor | None) -> torch.Tensor:
    """``logits`` ``[rows, vocab]`` with -inf where ``allow`` (``[rows, vocab]`` bool) is
    False; ``logits`` itself when there is no mask."""
    if allow is None:
        return logits
    return logits.masked_fill(~allow.to(logits.device), float("-inf"))


def row_masks(matchers: list[Any | None], vocab_size: int) -> torch.Tensor | None:
    """``[rows, vocab]`` bool, one row per matcher (None: everything allowed); None when no
    row is constrained."""
    if all(m is None for m in matchers):
        return None
    out = torch.ones(len(matchers), vocab_size, dtype=torch.bool)
    for r, matcher in enumerate(matchers):
        if matcher is not None:
            out[r] = allowed(matcher, vocab_size)
    return out


def padded_masks(
    matchers: list[Any | None], trees: list[tuple[list[int], list[int]]], n_max: int,
    vocab_size: int,
) -> torch.Tensor | None:  # fmt: skip
    """``[bs * n_max, vocab]`` bool for trees padded to ``n_max`` nodes (``trees``: per request,
    its tokens and parents); None when no request is constrained."""
    if all(m is None for m in matchers):
        return None
    out = torch.ones(len(matchers) * n_max, vocab_size, dtype=torch.bool)
    for b, (matcher, (tokens, parents)) in enumerate(zip(matchers, trees, strict=True)):
        if matcher is not None:
            out[b * n_max : b * n_max + len(tokens)] = tree_masks(
                matcher, tokens, parents, vocab_size
            )
    return out
