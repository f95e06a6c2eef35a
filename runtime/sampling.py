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
    Rows with greedy params become one-hot on the argmax."""
    logits = logits.float()
    out = torch.empty_like(logits)
    for i, p in enumerate(params):
        row = logits[i]
        if p.greedy:
            out[i] = torch.nn.functional.one_hot(row.argmax(), row.numel()).float()
            continue
        row = row / p.temperature
        if 0 < p.top_k < row.numel():
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, -1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            drop = sorted_p.cumsum(-1) - sorted_p >= p.top_p  # keep the smallest set reaching top_p
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
            probs = probs / probs.sum()
        out[i] = probs
    return out


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
