"""The math that turns logits into tokens under a request's `SamplingParams`.

The sampling contract (DESIGN.md §6). The token at output position ``p`` of a request is an
inverse-CDF draw from the processed distribution there with ONE uniform, ``keyed_uniforms(seed,
p)``: a hash of the request's seed and the position, not a stream that earlier draws advance.
So a seeded request samples the same tokens whatever batch it shares, on whichever replica it is
replayed, and whatever trees a draft proposed: verification (`target_service.acceptance`) draws
each tree node's token the same way and accepts a child exactly when it is that token, so the
accepted path plus the bonus token is what plain decoding would have drawn (lossless by
construction, and identical for a seed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from specmesh.protocol.sampling import SamplingParams

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def keyed_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
    """One uniform in [0, 1) per (seed, output position), float64: splitmix64 of the pair, a
    counter-based generator, so a draw depends on nothing but its key (no state, no order)."""
    s = np.asarray(seeds, dtype=np.uint64)
    p = np.asarray(positions, dtype=np.uint64)
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps by design
        x = (s * _GOLDEN + p) * _GOLDEN + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * _MIX1
        x = (x ^ (x >> np.uint64(27))) * _MIX2
        x = x ^ (x >> np.uint64(31))
    return torch.from_numpy((x >> np.uint64(11)).astype(np.float64) * 2.0**-53)


@dataclass
class TokenHistory:
    """The tokens so far that a request's logit processors read; kept (by the target) only for
    requests that use them (`SamplingParams.uses_history`). How many were generated is the
    request's sample offset, passed beside it."""

    seen: set[int]  # every id in prompt + output (repetition_penalty)
    output_counts: Counter  # id -> occurrences among generated tokens (frequency / presence)
    stop_ids: frozenset[int]  # EOS (unless ignore_eos) + stop_token_ids: banned before min_tokens

    @staticmethod
    def start(
        prompt: list[int], output: list[int], params: SamplingParams, eos_ids: tuple[int, ...]
    ) -> TokenHistory:
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_ids))
        return TokenHistory(set(prompt) | set(output), Counter(output), frozenset(stop))

    def add(self, tokens: list[int]) -> None:
        self.seen.update(tokens)
        self.output_counts.update(tokens)

    def extended(self, tokens: list[int]) -> TokenHistory:
        """A copy with ``tokens`` generated after these (a tree node's path)."""
        out = TokenHistory(set(self.seen), Counter(self.output_counts), self.stop_ids)
        out.add(tokens)
        return out


def apply_history(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory | None] | None,
    num_generated: list[int] | None,
) -> torch.Tensor:
    """The logit processors that read the tokens so far, per row with a history, in vLLM's
    order: logit_bias; repetition_penalty over prompt + output (positive logits divided, others
    multiplied); ``frequency * count + presence`` subtracted per generated id; EOS and stop ids
    at -inf while fewer than min_tokens were generated. Returns ``logits`` itself when no row
    has a history, else new fp32 logits ``[rows, vocab]``."""
    rows = [r for r, h in enumerate(histories or []) if h is not None and params[r].uses_history]
    if not rows:
        return logits
    bias, rep, pen, ban = ([], [], []), ([], [], []), ([], [], []), ([], [])
    for r in rows:
        p, h = params[r], histories[r]
        for tok, b in p.logit_bias:
            _extend(bias, r, [tok], [b])
        if p.repetition_penalty != 1.0:
            _extend(rep, r, list(h.seen), [p.repetition_penalty] * len(h.seen))
        if p.frequency_penalty or p.presence_penalty:
            ids = list(h.output_counts)
            amounts = [p.frequency_penalty * h.output_counts[t] + p.presence_penalty for t in ids]
            _extend(pen, r, ids, amounts)
        if num_generated[r] < p.min_tokens:
            _extend(ban, r, list(h.stop_ids))
    x = logits.float().clone()
    dev = x.device
    as_t = lambda xs, dtype=torch.int64: torch.tensor(xs, dtype=dtype, device=dev)
    if bias[0]:
        x.index_put_((as_t(bias[0]), as_t(bias[1])), as_t(bias[2], torch.float32), accumulate=True)
    if rep[0]:
        at = (as_t(rep[0]), as_t(rep[1]))
        v, penalty = x[at], as_t(rep[2], torch.float32)
        x[at] = torch.where(v > 0, v / penalty, v * penalty)
    if pen[0]:
        x.index_put_((as_t(pen[0]), as_t(pen[1])), -as_t(pen[2], torch.float32), accumulate=True)
    if ban[0]:
        x[as_t(ban[0]), as_t(ban[1])] = float("-inf")
    return x


def _extend(cols: tuple[list, ...], row: int, ids: list[int], *values: list) -> None:
    cols[0].extend([row] * len(ids))
    cols[1].extend(ids)
    for col, vals in zip(cols[2:], values, strict=True):
        col.extend(vals)


def processed_probs(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory | None] | None = None,
    num_generated: list[int] | None = None,
) -> torch.Tensor:
    """`apply_history`, then temperature, top-k, top-p and min_p, per row; returns fp32
    probabilities ``[rows, vocab]``. Rows with greedy params become one-hot on the argmax.
    Batched over rows (a few kernels for the whole batch; each row's result depends on that
    row alone: sorts are stable)."""
    logits = apply_history(logits, params, histories, num_generated).float()
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
    if any(p.min_p > 0.0 for p in params):
        min_p = col([p.min_p for p in params])
        cut = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
        probs = torch.where(min_p > 0.0, cut / cut.sum(-1, keepdim=True), probs)
    if not any(p.greedy for p in params):
        return probs
    greedy = col([p.greedy for p in params], torch.bool)
    return torch.where(greedy, torch.nn.functional.one_hot(logits.argmax(-1), vocab).float(), probs)


def processed_logprobs(
    logits: torch.Tensor,
    params: list[SamplingParams],
    histories: list[TokenHistory | None] | None = None,
    num_generated: list[int] | None = None,
) -> torch.Tensor:
    """Log-probabilities ``[rows, vocab]`` fp32 of the distribution each row samples from:
    greedy rows the log-softmax of the processed logits (temperature 1), the others the log of
    `processed_probs` (-inf where top-k / top-p / min_p removed a token)."""
    x = apply_history(logits, params, histories, num_generated).float()
    out = torch.log_softmax(x, -1)
    rows = [r for r, p in enumerate(params) if not p.greedy]
    if rows:
        out[rows] = processed_probs(x[rows], [params[r] for r in rows]).log()
    return out


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Smallest index whose cumulative mass exceeds ``u * total``, per row: ``[rows] int64``."""
    cdf = probs.cumsum(-1)
    idx = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1)
    last_nonzero = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(idx, last_nonzero)


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    offsets: list[int],
    histories: list[TokenHistory | None] | None = None,
) -> torch.Tensor:
    """One token per row of ``logits`` ``[rows, vocab]``: greedy rows by argmax of the processed
    logits, others by inverse CDF with the request's own uniform. ``offsets`` (tokens generated
    so far) seed the draws and drive min_tokens."""
    return draw_tokens(apply_history(logits, params, histories, offsets), params, offsets)


def draw_tokens(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int]
) -> torch.Tensor:
    """One token per row of history-processed ``logits`` ``[rows, vocab]``: the argmax for a
    greedy row, else the inverse-CDF draw with the row's keyed uniform (``positions``: the output
    position each row's token takes)."""
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        probs = processed_probs(logits[rows], [params[i] for i in rows])
        u = keyed_uniforms([params[i].seed or 0 for i in rows], [positions[i] for i in rows])
        tokens[rows] = inverse_cdf(probs, u.to(probs.device, probs.dtype))
    return tokens
