"""What the adaptive speculation policy compared when it planned a round (`router/policy.py`),
in numbers and in words: shown per request by `specmesh generate --json` and logged by the
router when a (target, batch-size bucket) changes side."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Option:
    """One side a plan weighed: trees cut to ``tree_size`` nodes (1: plain decoding)."""

    tree_size: int
    tokens: float  # expected per round, the whole micro-batch
    verify_s: float | None  # measured (median), None: never measured
    draft_s: float | None  # the draft step (0 for plain decoding), None: never measured

    @property
    def seconds(self) -> float | None:
        if self.verify_s is None:
            return None
        return self.verify_s + (self.draft_s or 0.0) * (self.tree_size > 1)

    @property
    def tokens_per_s(self) -> float:
        """An unmeasured option is taken as free (infinitely fast), so it is tried."""
        return self.tokens / self.seconds if self.seconds else math.inf

    def describe(self) -> str:
        what = "a plain step" if self.tree_size == 1 else f"{self.tree_size}-node trees"
        if self.seconds is None:
            return f"{what} (not measured yet)"
        cost = f"{self.verify_s * 1e3:.1f} ms"
        if self.tree_size > 1:
            draft = "?" if self.draft_s is None else f"{self.draft_s * 1e3:.1f}"
            cost = f"draft {draft} + verify {cost}"
        return f"{what}: {self.tokens:.2f} tokens in {cost} = {self.tokens_per_s:.0f} tokens/s"


@dataclass(frozen=True)
class PlanReason:
    """What an adaptive plan compared (set by `SpeculationPolicy.plan`)."""

    tree_size: int  # the plan's, 1 = plain decoding
    plain: Option
    speculative: Option  # the best speculative cut
    probe: bool  # the plan runs the side the estimates do not choose, to measure it again

    def describe(self) -> str:
        chosen, other = self.plain, self.speculative
        if self.tree_size > 1:
            chosen, other = other, chosen
        if self.probe:
            return f"probe of {chosen.describe()} (the estimates chose {other.describe()})"
        return f"{chosen.describe()}, against {other.describe()}"


@dataclass
class PlanTally:
    """The adaptive plans of one (target, batch-size bucket)."""

    num_plain: int = 0
    num_speculative: int = 0
    last_plain: PlanReason | None = None  # why the latest plain round was plain
    speculating: bool | None = None  # the side of the latest plan that was not a probe

    def add(self, reason: PlanReason) -> None:
        if reason.tree_size > 1:
            self.num_speculative += 1
        else:
            self.num_plain, self.last_plain = self.num_plain + 1, reason
