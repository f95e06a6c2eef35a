"""A service's grammar engine (`protocol.constraints`, llguidance): constraints compiled once
per service, a matcher per constrained request, and the allowed-token mask of a matcher state.

The target masks what it samples and verifies (`target_service.grammar`); the draft masks what it
proposes (`draft_service.grammar`). Both build their matchers here from the target's tokenizer,
its vocabulary size and EOS ids, so a mask means the same token set on either side.

Compiling can take a second (a large schema), so a service compiles off its step thread: as a
batch arrives, `Grammars.compiling` starts its constraints' compiles on a small pool and the batch
waits for them off the step thread (`rpc.held_batches`: the target's prefill, the draft's
starting extend); the step thread then finds them finished (`Grammars.compiled`), or refuses the
request once `COMPILE_TIMEOUT_S` passed. A constraint nobody submitted is compiled where it is
asked for (the in-process engine, whose draft shares the target's compiles).
"""

from __future__ import annotations

import asyncio
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from specmesh.protocol.constraints import Constraint, compile_matcher, llg_tokenizer
from specmesh.protocol.errors import InvalidRequestError

MAX_COMPILED = 64  # compiled grammars kept per service (LRU), keyed by the constraint's text
COMPILE_TIMEOUT_S = 10.0  # the most a batch waits for its constraints to compile
NUM_COMPILE_THREADS = 2  # compiles at once, beside the step thread


class Grammars:
    """One service's compiled constraints: a template matcher per constraint, copied per request
    (a copy costs ~1 µs; compiling, up to the engine's limits, much more). Each constraint has
    one future, running or done (a refusal is remembered like a matcher); the event loop submits,
    the step thread reads, under one lock."""

    def __init__(self, model_dir: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.model_dir, self.vocab_size, self.eos_ids = model_dir, vocab_size, eos_ids
        self._tokenizer: Any = None
        self._compiled: OrderedDict[Constraint, Future] = OrderedDict()
        self._lock = threading.Lock()  # the cache (held for dictionary operations only)
        self._tokenizer_lock = threading.Lock()  # its first load
        self._pool: ThreadPoolExecutor | None = None  # started by the first `submit`

    def tokenizer(self) -> Any:
        with self._tokenizer_lock:
            if self._tokenizer is None:
                self._tokenizer = self._load_tokenizer()
            return self._tokenizer

    def _load_tokenizer(self) -> Any:
        from transformers import AutoTokenizer

        try:
            hf = AutoTokenizer.from_pretrained(self.model_dir, local_files_only=True)
        except (OSError, ValueError) as e:
            raise InvalidRequestError(
                f"grammar constraints need the target's tokenizer; {self.model_dir} has none "
                f"usable: {e}"
            ) from None
        return llg_tokenizer(hf, self.vocab_size, self.eos_ids)

    def submit(self, constraint: Constraint) -> Future:
        """The compile of ``constraint``: started now on the pool unless it ran or runs already
        (cheap: call it on an event loop). Its result is the template matcher, or the
        `InvalidRequestError` that refuses the constraint."""
        with self._lock:
            future = self._get(constraint)
            if future is not None:
                return future
            if self._pool is None:
                self._pool = ThreadPoolExecutor(NUM_COMPILE_THREADS, "grammar-compile")
            future = self._pool.submit(self._compile, constraint)
            self._put(constraint, future)
            return future

    def compiling(self, constraints: Iterable[Constraint]) -> Awaitable[None] | None:
        """What a batch asking for ``constraints`` waits for, on the event loop: their compiles
        (each submitted now unless it ran or runs already) until all finished or
        `COMPILE_TIMEOUT_S` passed (the step thread then refuses what still compiles); None when
        none is still compiling."""
        running = [f for f in map(self.submit, constraints) if not f.done()]
        return _finished(running) if running else None

    def compiled(self, constraint: Constraint) -> Any:
        """The template matcher (step thread): a submitted compile's result, else compiled here
        (and kept). InvalidRequestError naming the problem when the engine refuses it, or when
        its submitted compile still runs (past the bound its batch waited)."""
        with self._lock:
            future = self._get(constraint)
        if future is None:
            future = Future()
            try:
                future.set_result(self._compile(constraint))
            except InvalidRequestError as e:
                future.set_exception(e)
            with self._lock:
                self._put(constraint, future)
        if not future.done():
            raise InvalidRequestError(
                f"the {constraint.kind} constraint did not compile within {COMPILE_TIMEOUT_S} s"
            )
        if isinstance(error := future.exception(), InvalidRequestError):
            raise InvalidRequestError(str(error))  # a fresh one: raised again, it would grow
        return future.result()

    def _compile(self, constraint: Constraint) -> Any:
        return compile_matcher(constraint, self.tokenizer())

    def _get(self, constraint: Constraint) -> Future | None:
        future = self._compiled.get(constraint)
        if future is not None:
            self._compiled.move_to_end(constraint)
        return future

    def _put(self, constraint: Constraint, future: Future) -> None:
        self._compiled[constraint] = future
        if len(self._compiled) > MAX_COMPILED:
            self._compiled.popitem(last=False)

    def start(self, constraint: Constraint, emitted: list[int]) -> Any:
        """A request's matcher after the tokens it already emitted (a replay's)."""
        matcher = self.compiled(constraint).deep_copy()
        if not all(matcher.consume_token(t) for t in emitted):
            raise InvalidRequestError(
                f"the emitted tokens do not follow the {constraint.kind} constraint"
            )
        return matcher


async def _finished(futures: list[Future]) -> None:
    """Until every one of ``futures`` finished, or `COMPILE_TIMEOUT_S` passed. A refusal is read
    where the batch runs (`Grammars.compiled`), not here."""
    waits = [asyncio.wrap_future(f) for f in futures]
    for w in waits:
        w.add_done_callback(lambda f: f.cancelled() or f.exception())
    await asyncio.wait(waits, timeout=COMPILE_TIMEOUT_S)


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
