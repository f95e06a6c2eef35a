"""Per-request traces and the statistics of one benchmark configuration.

Latency definitions (all seconds, `time.perf_counter`):

- time to first token (TTFT): first streamed chunk - submission;
- inter-token latency (ITL): gap between consecutive streamed chunks of one request; a
  speculative chunk carries every token accepted in one round, so its gaps are per round;
- time per output token (TPOT): (last chunk - first chunk) / (tokens - 1), per request.

Acceptance: ``accept_lens`` holds the tokens emitted per verify round (accepted draft tokens +
the bonus token), so draft position i (1-based, i <= num_steps) was accepted in a round exactly
when that round's accept_len >= i + 1.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestTrace:
    submit_s: float
    chunk_s: list[float] = field(default_factory=list)  # arrival time of each non-empty chunk
    num_tokens: int = 0
    accept_lens: list[int] = field(default_factory=list)
    predraft_hits: int = 0  # rounds whose tree the draft had pre-drafted
    draft_wait_s: float = 0.0  # time its rounds waited on the draft for their trees

    def add_chunk(self, at_s: float, num_tokens: int) -> None:
        if num_tokens:
            self.chunk_s.append(at_s)
            self.num_tokens += num_tokens


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]; 0.0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def accept_per_position(accept_lens: list[int], num_steps: int) -> list[float]:
    """Fraction of rounds in which draft position 1..num_steps was accepted."""
    if not accept_lens or num_steps < 1:
        return []
    return [
        sum(n >= i + 1 for n in accept_lens) / len(accept_lens) for i in range(1, num_steps + 1)
    ]


def summarize(traces: list[RequestTrace], wall_s: float, num_steps: int) -> dict[str, Any]:
    """Throughput, latency and acceptance fields of one configuration's result."""
    tokens = sum(t.num_tokens for t in traces)
    ttft = [t.chunk_s[0] - t.submit_s for t in traces if t.chunk_s]
    itl = [b - a for t in traces for a, b in zip(t.chunk_s, t.chunk_s[1:], strict=False)]
    tpot = [(t.chunk_s[-1] - t.chunk_s[0]) / (t.num_tokens - 1) for t in traces if t.num_tokens > 1]
    lens = [n for t in traces for n in t.accept_lens]
    return {
        "num_requests": len(traces),
        "generated_tokens": tokens,
        "wall_s": wall_s,
        "tokens_per_s": tokens / wall_s if wall_s > 0 else 0.0,
        "ttft_s_mean": sum(ttft) / len(ttft) if ttft else 0.0,
        "ttft_s_p50": percentile(ttft, 50),
        "itl_s_p50": percentile(itl, 50),
        "itl_s_p99": percentile(itl, 99),
        "tpot_s_mean": sum(tpot) / len(tpot) if tpot else 0.0,
        "num_rounds": len(lens),
        "mean_accept_len": sum(lens) / len(lens) if lens else 1.0,
        "accept_per_position": accept_per_position(lens, num_steps),
        "predraft_hit_rate": sum(t.predraft_hits for t in traces) / len(lens) if lens else 0.0,
        "draft_wait_ms_per_round": 1e3 * sum(t.draft_wait_s for t in traces) / len(lens)
        if lens
        else 0.0,
    }


def spread(values: list[float]) -> dict[str, float]:
    """min / median / max of one configuration's per-repeat values."""
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def ratio_spread(numerators: list[float], denominators: list[float]) -> dict[str, Any]:
    """The ratio of the medians, and the per-repeat ratios (repeat i of one side over repeat i of
    the other: runs taken under the same machine load) with their min and max."""
    per_repeat = [a / b if b > 0 else math.inf for a, b in zip(numerators, denominators, strict=True)]  # fmt: skip
    den = statistics.median(denominators)
    return {
        "ratio": statistics.median(numerators) / den if den > 0 else math.inf,
        "ratio_min": min(per_repeat),
        "ratio_max": max(per_repeat),
        "ratio_runs": per_repeat,
    }


def aggregate(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One configuration's repeats (in repeat order) -> one entry: tokens/s is the median, its
    spread and every repeat's value are kept; the other fields are those of the median run (the
    lower of the two middle runs for an even count)."""
    values = [r["tokens_per_s"] for r in runs]
    middle = sorted(runs, key=lambda r: r["tokens_per_s"])[(len(runs) - 1) // 2]
    stats = spread(values)
    return {
        **middle,
        "tokens_per_s": stats["median"],
        "tokens_per_s_min": stats["min"],
        "tokens_per_s_max": stats["max"],
        "tokens_per_s_runs": values,
        "pids": [r["pid"] for r in runs],
        "repeats": len(runs),
    }


def speed_row(config: dict[str, Any], ratio: dict[str, Any] | None) -> str:
    """A table row's first cells: ``| label | tok/s median (min - max) | ratio (min - max) |
    tokens/round |`` (``ratio`` None: the baseline, "1")."""
    c, r = config, ratio
    vs = f"{r['ratio']:.2f} ({r['ratio_min']:.2f} - {r['ratio_max']:.2f})" if r else "1"
    return (
        f"| {c['label']} | {c['tokens_per_s']:.1f} ({c['tokens_per_s_min']:.1f} - "
        f"{c['tokens_per_s_max']:.1f}) | {vs} | {c['mean_accept_len']:.2f} |"
    )
