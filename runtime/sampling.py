"""Per-request sampling parameters and the math that turns logits into tokens.

Randomness is a pure function of ``(seed, offset)`` where ``offset`` counts the tokens the request
has generated so far, so a request samples the same way whatever batch it shares and on whichever
replica it is replayed. Every sampled token is an inverse-CDF draw with one uniform, the same rule
the tree sampler uses for its final token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specmesh.runtime.errors import InvalidRequestError

_MIX = 0x9E3779B97F4A7C15


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
    extra: dict = field(default_factory=dict, compare=False)

    def validate(self) -> None:
        if self.max_new_tokens < 1:
            raise InvalidRequestError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not 0.0 <= self.temperature <= 100.0:
            raise InvalidRequestError(f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InvalidRequestError(f"top_k must be >= 0, got {self.top_k}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise InvalidRequestError(f"seed must be in [0, 2**63), got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def request_generator(seed: int, offset: int) -> torch.Generator:
    return torch.Generator().manual_seed((seed * _MIX + offset) % 2**63)


def uniforms(seed: int, offset: int, n: int) -> torch.Tensor:
    """``n`` uniforms in [0, 1) owned by one request at one generation offset."""
    return torch.rand(n, generator=request_generator(seed, offset))


def processed_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p, per row; returns fp32 probabilities ``[rows, vocab]``.
    Rows with greedy params become one-hot on the argmax. Batched over rows (a few kernels for
    the whole batch; each row's result depends on that row alone: sorts are stable)."""
    logits = logits.float()
    vocab = logits.shape[-1]
    dev = logits.device
    col = lambda values, dtype=torch.float32: torch.tensor(values, dtype=dtype, device=dev)[:, None]
    x = logits / col([1.0 if p.greedy else p.temperature for p in params])
    probs = torch.softmax(x, -1)
    if any(0 < p.top_k < vocab for p in params):  # decided on the host: no device sync
        top_k = col([p.top_k if 0 < p.top_k < vocab else vocab for p in params], torch.int64)
        kth = x.sort(dim=-1, descending=True, stable=True).values.gather(-1, top_k - 1)
        probs = torch.softmax(x.masked_fill(x < kth, float("-inf")), -1)
    if any(p.top_p < 1.0 for p in params):
        top_p = col([p.top_p for p in params])
        sorted_p, order = probs.sort(dim=-1, descending=True, stable=True)
        # keep the smallest set reaching top_p (rows with top_p = 1 keep everything)
        drop = (sorted_p.cumsum(-1) - sorted_p >= top_p) & (top_p < 1.0)
        cut = probs.scatter(-1, order, sorted_p.masked_fill(drop, 0.0))
        probs = torch.where(top_p < 1.0, cut / cut.sum(-1, keepdim=True), probs)
    if not any(p.greedy for p in params):
        return probs
    greedy = col([p.greedy for p in params], torch.bool)
    return torch.where(greedy, torch.nn.functional.one_hot(logits.argmax(-1), vocab).float(), probs)


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Smallest index whose cumulative mass exceeds ``u * total``, per row: ``[rows] int64``."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(idx, last_nonzero)


def sample_tokens(
    logits: torch.Tensor, params: list[SamplingParams], offsets: list[int]
) -> torch.Tensor:
    """One token per row of ``logits`` ``[rows, vocab]``: greedy rows by argmax, others by
    inverse CDF with the request's own uniform."""
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = processed_probs(logits[rows], [params[i] for i in rows])
        u = torch.stack([uniforms(params[i].seed or 0, offsets[i], 1)[0] for i in rows])
        tokens[rows] = inverse_cdf(probs, u.to(probs.device))
    return tokens
