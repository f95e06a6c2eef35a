"""The math that turns logits into tokens under a request's `SamplingParams`.

The sampling contract (DESIGN.md §6). The token at output position ``p`` of a request is the
argmax of ``log p_processed(t) + G(seed, p, t)`` over token ids ``t``: Gumbel-max with noise
from a counter-based hash of (seed, position, token), not a stream that earlier draws advance
(`specmesh.kernels.gumbel`). So a seeded request samples the same tokens whatever batch it
shares, on whichever replica it is replayed, and whatever trees a draft proposed: verification
(`target_service.acceptance`) draws each tree node's token the same way and accepts a child
exactly when it is that token, so the accepted path plus the bonus token is what plain decoding
would have drawn (lossless by construction, and identical for a seed). Two code paths whose
logits differ by rounding draw different tokens only where the top two of ``log p + G`` are
that close: a near tie of the race, not a boundary between neighbouring ids in a CDF.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from specmesh.kernels.gumbel import gumbel_argmax, row_keys
from specmesh.protocol.sampling import SamplingParams


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
    x = _tempered(logits, params)
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


def _tempered(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """fp32 logits divided by each row's temperature (1 for a greedy row): ``[rows, vocab]``."""
    temps = [1.0 if p.greedy else p.temperature for p in params]
    return logits.float() / torch.tensor(temps, device=logits.device)[:, None]


def _truncates(p: SamplingParams, vocab: int) -> bool:
    return 0 < p.top_k < vocab or p.top_p < 1.0 or p.min_p > 0.0


def sampling_scores(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """What a sampled row's draw races over: ``log p`` of its processed distribution up to a
    per-row constant, i.e. the tempered logits with -inf where top-k / top-p / min_p removed a
    token (where `processed_probs` is 0, which in a truncated row also drops tokens below
    float32's smallest probability, ~e**-103). fp32 ``[rows, vocab]``; ``logits``
    history-processed."""
    x = _tempered(logits, params)
    if not any(_truncates(p, x.shape[-1]) for p in params):
        return x
    return x.masked_fill(processed_probs(logits, params) == 0, float("-inf"))


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    offsets: list[int],
    histories: list[TokenHistory | None] | None = None,
    impl: str = "torch",
) -> torch.Tensor:
    """One token per row of ``logits`` ``[rows, vocab]``: greedy rows by argmax of the processed
    logits, others by the keyed Gumbel-max draw (``impl``: its kernel). ``offsets`` (tokens
    generated so far) key the draws and drive min_tokens."""
    logits = apply_history(logits, params, histories, offsets)
    return draw_tokens(logits, params, offsets, impl)


def draw_tokens(
    logits: torch.Tensor, params: list[SamplingParams], positions: list[int], impl: str = "torch"
) -> torch.Tensor:
    """One token per row of history-processed ``logits`` ``[rows, vocab]``: the argmax for a
    greedy row, else the Gumbel-max draw keyed by (seed, ``positions[row]``: the output position
    the row's token takes). ``impl`` picks the draw's kernel (`specmesh.kernels.gumbel`); both
    give the same tokens bit for bit."""
    tokens = logits.argmax(-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        scores = sampling_scores(logits[rows], [params[i] for i in rows])
        keys = row_keys([params[i].seed or 0 for i in rows], [positions[i] for i in rows])
        tokens[rows] = gumbel_argmax(scores, keys.to(scores.device), impl)
    return tokens
