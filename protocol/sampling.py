"""Per-request sampling parameters: what a client asks for, checked once at the public API.

Torch-free: the router, the CLI's router path and the wire code read it; the math that turns
logits into tokens under these parameters is `specmesh.runtime.sampling`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from specmesh.protocol.constraints import Constraint
from specmesh.protocol.errors import InvalidRequestError

MAX_LOGPROBS = 20  # most alternatives a request may ask for per token
NUM_SEEDS = 2**63  # seeds are in [0, NUM_SEEDS): an int64 that is never negative


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Controls applied to the target's logits before sampling, per tree path under speculation
    # (the tokens before each node count): vLLM / OpenAI semantics.
    min_p: float = 0.0  # drop tokens below min_p x the top probability; 0 = off
    repetition_penalty: float = 1.0  # >1 divides positive / multiplies negative logits of seen ids
    frequency_penalty: float = 0.0  # logit -= f x count of the id among generated tokens
    presence_penalty: float = 0.0  # logit -= p if the id occurs among generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    min_tokens: int = 0  # EOS and stop token ids are impossible before this many tokens
    # Log-probabilities returned with each output token under the target's processed
    # distribution: None = none, 0 = the chosen token's, k = it plus the top k alternatives.
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    # A grammar every output token follows (structured outputs, required tool calls): the
    # target masks each token it samples, each tree node's by the node's own path.
    constraint: Constraint | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        """Range checks, once, where the parameters are made: at a public API (the router's
        gRPC and HTTP fronts, the `Engine`) and where the target reads them off the wire. A
        `SamplingParams` that exists is in range; only its token ids wait for a vocabulary
        (`check_vocab`)."""
        if not 1 <= self.max_new_tokens < 2**31:
            raise InvalidRequestError(
                f"max_new_tokens must be in [1, 2**31), got {self.max_new_tokens}"
            )
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.top_k < 2**31:
            raise InvalidRequestError(f"top_k must be in [0, 2**31), got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < NUM_SEEDS:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}")
        self._check_controls()

    def _check_controls(self) -> None:
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0.0 < self.repetition_penalty <= 100.0:
            raise InvalidRequestError(
                f"repetition_penalty must be in (0, 100], got {self.repetition_penalty}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise InvalidRequestError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidRequestError(
                f"min_tokens must be in [0, max_new_tokens={self.max_new_tokens}], "
                f"got {self.min_tokens}"
            )
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and not 0 <= n <= MAX_LOGPROBS:
                raise InvalidRequestError(f"{name} must be in [0, {MAX_LOGPROBS}], got {n}")
        self.check_vocab(2**31)
        if self.constraint is not None and (self.ignore_eos or self.min_tokens):
            # The grammar's end allows only EOS: neither may keep a finished document going.
            raise InvalidRequestError(
                "ignore_eos and min_tokens cannot be combined with a grammar constraint "
                "(structured output, a required tool call): the grammar decides where it ends"
            )

    def check_vocab(self, vocab_size: int) -> None:
        """The logit_bias ids exist in a ``vocab_size`` vocabulary (and their biases in range)."""
        limit = vocab_size
        bad = [(t, b) for t, b in self.logit_bias if not (0 <= t < limit and -100 <= b <= 100)]
        if bad:
            raise InvalidRequestError(
                f"logit_bias needs token ids in [0, {limit}) and biases in [-100, 100]: {bad[:5]}"
            )

    @property
    def uses_history(self) -> bool:
        """Whether the logits are processed with the tokens so far (`TokenHistory`)."""
        return bool(
            self.logit_bias
            or self.repetition_penalty != 1.0
            or self.frequency_penalty
            or self.presence_penalty
            or self.min_tokens
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
