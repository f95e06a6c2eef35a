"""Whether a micro-batch speculates next round, and how many tree nodes it verifies: the choice
that maximizes expected tokens per second on costs measured at run time.

For a micro-batch of ``b`` requests, a round whose trees are cut to ``k`` nodes (root included)
yields ``sum_r E_r[k]`` tokens in ``draft(b) + verify(b, k)`` seconds, where ``E_r[k]`` is what a
round of request r yields (accepted draft tokens plus the bonus token). A plain round (``k = 1``:
the target verifies a bare root, which is plain decoding) yields ``b`` tokens in
``verify(b, 1)`` seconds and costs the draft nothing (the round keeps the committed tokens and
their features and extends the draft over them, in one step, when speculation resumes).

Cutting. The draft lists a tree's nodes parents first (depth by depth, best-ranked parents and
children first), so the first ``k`` nodes form a valid tree: `DraftTree.cut`. The target verifies
whatever tree it is given and samples along it, so output is lossless for every ``k``.

Estimates, all deterministic given the measurements (tests inject them):
- costs: the median of the latest `COST_WINDOW` measurements (`Cost`) per (target,
  batch-size bucket, k) for verify and per (draft, bucket) for a steady draft step (extend over
  one round's tokens + propose: a step that also extends over a prompt or over rounds held back
  is not typical and not counted). Each is the replica's own time for the call
  (`service_time`: with two micro-batches in flight, a call that queued behind the other's is
  not charged the wait); a ``k`` between two measured sizes is interpolated; a cost never
  measured counts as free, so it is tried (full trees first, then plain) before the estimates
  decide. A median of a few, not a moving average: the side not chosen is measured only when
  a probe runs it, and an average kept a slow first call (a draft process's first steady step
  on CPU took 117 ms, the next ones 7 - 10) for hundreds of rounds, planning plain decoding
  all along;
- acceptance: per request and per draft replica, a decayed record of what each cut would have
  yielded (`Acceptance`); a request leans on its draft's record until it has its own, and the
  draft's record starts optimistic (every draft token accepted). A plain round ages the
  request's record toward its draft's (`Acceptance.fade`): without that, a request that went
  plain after a few bad rounds kept its record, and with it its plan, to the end;
- exploring: a bucket's plan now and then tries the other side (plain when speculating, the
  full tree when not), so neither estimate goes stale: after ``probe_every`` plans, then twice
  as many after each probe, up to ``MAX_PROBE_INTERVAL`` (a short run explores little, a long
  one keeps checking). A probe runs `PROBE_ROUNDS` rounds, so that most of the window it
  leaves is its own: a probe of speculation's first draft step extends over the rounds held
  back (not counted), its next two are steady and measured. With one-round probes the draft's
  cost was never measured again once plain decoding won, and with a probe's single measurement
  the window kept a burst of slow calls (another process on the core) as the estimate.

Visible. Each adaptive plan keeps what it compared (`PlanReason`: a plain round against the best
speculative cut, tokens over measured seconds); `SpeculationPolicy.tallies` counts the plans per
(target, bucket) with the latest plain one, which `specmesh generate --in-process --json` prints,
and a change of side is logged at INFO.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from specmesh.protocol.trees import DraftTree
from specmesh.router.plan_reason import Option, PlanReason, PlanTally

log = logging.getLogger(__name__)

MODES = ("adaptive", "always", "never")
COST_WINDOW = 3  # latest measurements a cost estimate is the median of
PROBE_ROUNDS = 3  # rounds a probe runs the side not chosen (2 measured draft steps)
MAX_PROBE_INTERVAL = 256  # plans between two probes of a bucket whose best choice holds
REQUEST_PRIOR_WEIGHT = 2.0  # rounds of the draft's record a request's own record starts from
DRAFT_PRIOR_WEIGHT = 1.0  # rounds of "every draft token accepted" the draft's record starts from


@dataclass(frozen=True)
class Plan:
    tree_size: int  # nodes each request's tree is cut to, root included; 1 = plain decoding
    # What an adaptive plan compared (None: a fixed mode); not part of the plan's identity.
    reason: PlanReason | None = field(default=None, compare=False)

    @property
    def speculate(self) -> bool:
        return self.tree_size > 1


@dataclass
class Acceptance:
    """Decayed record of the tokens rounds yield when trees are cut to k nodes (entry k - 1).
    A round that verified n nodes tells what every cut k <= n would have yielded: its accepted
    path up to the first node with index >= k (indices grow along a path)."""

    decay: float = 0.9
    sums: list[float] = field(default_factory=list)
    counts: list[float] = field(default_factory=list)

    def observe(self, path: Sequence[int], verified_nodes: int) -> None:
        grow = verified_nodes - len(self.sums)
        self.sums += [0.0] * grow
        self.counts += [0.0] * grow
        for k in range(1, verified_nodes + 1):
            yielded = 1 + sum(1 for i in path if i < k)
            self.sums[k - 1] = self.sums[k - 1] * self.decay + yielded
            self.counts[k - 1] = self.counts[k - 1] * self.decay + 1.0

    def fade(self) -> None:
        """A round without speculation tells nothing of acceptance: the record keeps its means
        but weighs less, so the prior (its draft's record) takes over again as such rounds pass
        and a request that stopped speculating after a bad patch tries again."""
        self.sums = [s * self.decay for s in self.sums]
        self.counts = [n * self.decay for n in self.counts]

    def expected(self, k: int, prior: float, prior_weight: float) -> float:
        """Tokens per round with trees cut to ``k``, the record shrunk toward ``prior``."""
        s, n = (self.sums[k - 1], self.counts[k - 1]) if k <= len(self.sums) else (0.0, 0.0)
        return (s + prior_weight * prior) / (n + prior_weight)


@dataclass
class Cost:
    """One call's cost: the median of its latest `COST_WINDOW` measurements (of two, the
    lower). Noise on a shared machine only ever slows a call, so one slow call (a cold first
    one, one that shared its core) moves nothing, and a lasting change wins in two calls."""

    samples: deque[float] = field(default_factory=lambda: deque(maxlen=COST_WINDOW))

    def add(self, seconds: float) -> None:
        self.samples.append(seconds)

    @property
    def seconds(self) -> float:
        ordered = sorted(self.samples)
        return ordered[(len(ordered) - 1) // 2]


def interpolate_costs(measured: dict[int, float], max_nodes: int) -> list[float | None]:
    """Cost of each tree size 1..max_nodes: measured, or linear between the nearest measured
    sizes below and above; None (unknown) otherwise."""
    costs: list[float | None] = []
    for k in range(1, max_nodes + 1):
        below = max((m for m in measured if m <= k), default=None)
        above = min((m for m in measured if m >= k), default=None)
        if below is None or above is None:
            costs.append(None)
        elif below == above:
            costs.append(measured[k])
        else:
            w = (k - below) / (above - below)
            costs.append(measured[below] * (1 - w) + measured[above] * w)
    return costs


def tree_options(
    gains: Sequence[float], verify: Sequence[float | None], draft: float | None
) -> list[Option]:
    """Every tree size ``k`` as an `Option`: ``gains[k-1]`` tokens in ``verify[k-1] + draft``."""
    return [Option(k, gains[k - 1], verify[k - 1], draft) for k in range(1, len(gains) + 1)]


def best_tree_size(
    gains: Sequence[float], verify: Sequence[float | None], draft: float | None
) -> int:
    """The ``k`` maximizing ``gains[k-1] / (verify[k-1] + draft)`` (no draft cost for k = 1).
    An unknown verify cost is taken as free, so it wins and gets measured; candidates are
    tried full tree first, then plain, then the sizes in between (ties keep the earlier)."""
    return _best(tree_options(gains, verify, draft), range(1, len(gains) + 1)).tree_size


def _best(options: Sequence[Option], sizes: Sequence[int]) -> Option:
    """The fastest of ``options`` of ``sizes``: largest first, then 1, then the rest down."""
    top = max(sizes)
    order = sorted(sizes, key=lambda k: (k != top, k != 1, -k))
    best = options[order[0] - 1]
    for k in order[1:]:
        if options[k - 1].tokens_per_s > best.tokens_per_s:
            best = options[k - 1]
    return best


def bucket(batch_size: int) -> int:
    """Batch sizes share cost estimates by power of two (1, 2, 4, 8, ...)."""
    return 1 << max(batch_size - 1, 0).bit_length()


class SpeculationPolicy:
    """The router's plans (one per micro-batch and draft replica, before the draft step) and
    the measurements they rest on. ``mode``: ``adaptive`` plans as above, ``always`` verifies
    the draft's full trees, ``never`` decodes without the draft."""

    def __init__(self, mode: str = "adaptive", probe_every: int = 16) -> None:
        if mode not in MODES:
            raise ValueError(f"speculation mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode, self.probe_every = mode, probe_every
        # Only adaptive plans read costs and acceptance: under ``always`` and ``never`` the
        # replicas and the round record nothing (no bookkeeping in their rounds).
        self.measures = mode == "adaptive"
        self.verify_costs: dict[tuple[str, int], dict[int, Cost]] = {}
        self.draft_costs: dict[tuple[str, int], Cost] = {}
        self.drafts: dict[str, Acceptance] = {}  # per draft replica: the requests' prior
        self.probes: dict[tuple[str, int], _Probe] = {}  # per (target, bucket)
        self.busy_until: dict[str, float] = {}  # per replica: when its last call ended
        self.tallies: dict[tuple[str, int], PlanTally] = {}  # adaptive plans per (target, bucket)

    def service_time(self, replica: str, started: float, ended: float) -> float:
        """What one call cost ``replica`` itself. A service runs its calls one at a time, in
        order, so a call sent while another was running began when that one ended: the other
        micro-batch's work (a prefill, a bigger verify) is not charged to this call."""
        begin = max(started, self.busy_until.get(replica, started))
        self.busy_until[replica] = max(ended, self.busy_until.get(replica, ended))
        return max(ended - begin, 0.0)

    # -- measurements --------------------------------------------------------------------------
    def observe_verify(self, target: str, batch_size: int, tree_size: int, seconds: float) -> None:
        costs = self.verify_costs.setdefault((target, bucket(batch_size)), {})
        costs.setdefault(tree_size, Cost()).add(seconds)

    def observe_draft(self, draft: str, batch_size: int, seconds: float) -> None:
        self.draft_costs.setdefault((draft, bucket(batch_size)), Cost()).add(seconds)

    def observe_round(
        self, draft: str, request: Acceptance, tree: DraftTree, tokens: list[int]
    ) -> None:
        """A verified tree and the tokens its round yielded, for the request and its draft."""
        if tree.num_nodes == 1:  # a plain round: only the request's own record ages
            request.fade()
            return
        path = tree.accepted_path(tokens)
        request.observe(path, tree.num_nodes)
        self.drafts.setdefault(draft, Acceptance()).observe(path, tree.num_nodes)

    # -- plans ---------------------------------------------------------------------------------
    def plan(
        self, target: str, draft: str, batch_size: int, requests: Sequence[Acceptance],
        max_nodes: int,
    ) -> Plan:  # fmt: skip
        """The plan for ``requests`` (those of ``draft`` among the ``batch_size`` requests the
        target verifies together) whose draft proposes trees of ``max_nodes`` nodes."""
        if self.mode == "never" or max_nodes < 2:
            return Plan(1)
        if self.mode == "always":
            return Plan(max_nodes)
        key = (target, bucket(batch_size))
        gains = self.expected_tokens(draft, requests, max_nodes, batch_size)
        measured = {k: c.seconds for k, c in self.verify_costs.get(key, {}).items()}
        draft_cost = self.draft_costs.get((draft, key[1]))
        draft_s = None if draft_cost is None else draft_cost.seconds
        options = tree_options(gains, interpolate_costs(measured, max_nodes), draft_s)
        best = _best(options, range(1, max_nodes + 1)).tree_size
        probe = self.probes.setdefault(key, _Probe(self.probe_every, self.probe_every))
        if not probe.rounds_left and probe.due() and all(o.seconds is not None for o in options):
            probe.rounds_left, probe.speculate = PROBE_ROUNDS, best == 1
        size, probing = best, bool(probe.rounds_left)
        if probing:
            probe.rounds_left -= 1
            size = max_nodes if probe.speculate else 1
        speculative = options[size - 1] if size > 1 else _best(options, range(2, max_nodes + 1))
        reason = PlanReason(size, options[0], speculative, probing)
        self._tally(key, reason)
        return Plan(size, reason)

    def _tally(self, key: tuple[str, int], reason: PlanReason) -> None:
        """Count the plan; log when the side the estimates choose changes (probes aside)."""
        tally = self.tallies.setdefault(key, PlanTally())
        tally.add(reason)
        speculating = reason.tree_size > 1
        if not reason.probe and tally.speculating != speculating:
            tally.speculating = speculating
            log.info("speculation, target %s, batch <= %d: %s", *key, reason.describe())

    def expected_tokens(
        self, draft: str, requests: Sequence[Acceptance], max_nodes: int, batch_size: int
    ) -> list[float]:
        """Per tree size k: the tokens a round of the whole batch is expected to yield (the
        requests of other drafts, or of none, yield one each)."""
        prior = self.drafts.get(draft, Acceptance())
        others = max(batch_size - len(requests), 0)
        gains = []
        for k in range(1, max_nodes + 1):
            draft_mean = prior.expected(k, float(k), DRAFT_PRIOR_WEIGHT)
            own = sum(r.expected(k, draft_mean, REQUEST_PRIOR_WEIGHT) for r in requests)
            gains.append(own + others)
        return gains


@dataclass
class _Probe:
    """When a bucket next tries the side its estimates do not choose."""

    interval: int
    countdown: int
    rounds_left: int = 0  # of the probe running now
    speculate: bool = False  # the side it runs

    def due(self) -> bool:
        self.countdown -= 1
        if self.countdown > 0:
            return False
        self.interval = min(2 * self.interval, MAX_PROBE_INTERVAL)
        self.countdown = self.interval
        return True
