"""The cost-aware tree budget: each step verifies the budget with the most expected tokens per second.

For the best-first tree of the largest budget, the b best nodes form the tree of budget b, and node i is accepted
only if the target agrees along its whole path; with the drafter's own probabilities as the estimate, budget b
emits E_b = 1 + sum of exp(path log-probability) over its b nodes (the bonus counts one). Each budget's step costs
what warm-up measured on the running hardware (draft, tree, verify and commit), then what the steps taken show. A
machine's speed drifts (on a shared CPU by 2x within a minute), so one budget's steps timed at one moment and another
budget's at another would compare times of different speeds. What the policy learns is therefore the ratio between
budgets' costs, from **consecutive steps at different budgets** (the machine's speed is the same for both, and
cancels; a request's first step, whose draft also reads the whole prompt, is left out): the median of the recent
log-ratios of each pair of budgets, all pairs and the warm-up's costs (worth PAIR_PRIOR such pairs each) fitted by
least squares to one log-cost per budget. The current speed, the median of the recent steps' time over their
budget's fitted cost, gives the costs in seconds; only their ratios steer the choice.
A budget never taken would keep its warm-up cost for good, wrong or not, and one taken rarely would be fitted from
few pairs: so while a budget's expected rate is within COST_MARGIN of the step's best and it has been timed fewer
than COST_MIN_STEPS times, the step takes it instead (the one timed least): cost sampling, which costs at most that
margin on those few steps, and only where the choice is close. A wider tree never costs less than a narrower one (the
same step with more verify rows), so the costs the choice uses are made non-decreasing in the budget (a budget
measured dearer than a wider one is pooled with it: isotonic regression), which keeps noise in the measured costs
from swinging the choice between two budgets of nearly equal cost. The policy takes the budget that maximises
1 + sum over the segments up to b of calibration_s * (the drafter's expected tokens in segment s), over that cost.
A segment is the nodes a budget adds to the next smaller one (nodes 1-4, 5-8, 9-16, 17-32 for budgets 4/8/16/32),
and `calibration_s` scales the drafter's probabilities there to what the target accepts there: the observed over
the predicted drafted tokens of that segment, with a prior of PRIOR tokens at the factor of all the steps taken
(itself with a prior of PRIOR tokens at 1.0). Per segment, because choosing between two budgets is a question about
the nodes between them: a drafter sure of its first nodes and too sure of its tail (the usual case) would, with one
factor for a whole tree, have the first nodes' factor lift the tail's probabilities, and widen the trees of steps
whose tails look likely although such tails are rarely accepted.
Every step informs every budget up to the one it took: best-first, a smaller budget's tree is the first nodes of
the larger one and a child comes after its parent, so the tokens budget b would have accepted are the accepted
path's nodes numbered b or less (the target's choices at those nodes are the same). A drafter that is more (or
less) often right than its probabilities say, at some widths more than at others, gets trees widened (or narrowed)
where that holds.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

PRIOR = 8.0  # drafted tokens of pseudo-evidence for calibration 1.0
COST_WINDOW = 64  # a pair of budgets' cost ratio: the median of its last 64 paired steps; the speed: of 64 steps
PAIR_PRIOR = 4.0  # the warm-up's cost of a budget counts as this many paired steps
COST_MARGIN, COST_MIN_STEPS = 0.10, 16  # cost sampling: a budget within 10 % of the best rate, timed < 16 times


def require_several(budgets: tuple[int, ...], flag: str) -> None:
    """`auto` (the CLI's `--ddtree_budget auto`, a request's `ddtree_budget`) needs an engine with several budgets."""
    if len(budgets) < 2:
        raise ValueError(f"{flag} auto chooses among several tree budgets; this engine verifies only {list(budgets)} "
                         "(build it with --extra_budgets, e.g. 8,16)")  # fmt: skip


@dataclass
class BudgetPolicy:
    budgets: tuple[int, ...]  # the tree budgets the engines verify, ascending
    step_seconds: dict[int, float]  # measured cost of one step at each budget
    calibration: float = 1.0  # all steps taken: observed over predicted drafted tokens (`record`), reported
    chosen: Counter = field(default_factory=Counter)
    predicted: float = 0.0  # sums over the steps taken: drafted tokens expected and accepted
    observed: float = 0.0
    last: int | None = None  # the budget of the step being taken
    last_drafted: dict = field(default_factory=dict)  # its expected drafted tokens at every budget
    # per budget, over the steps that inform it: drafted tokens expected and accepted among the nodes b adds to the
    # next smaller budget (its segment)
    segment_predicted: Counter = field(default_factory=Counter)
    segment_observed: Counter = field(default_factory=Counter)
    speed: deque = field(default_factory=lambda: deque(maxlen=COST_WINDOW))  # recent steps' time / fitted cost
    pairs: dict = field(default_factory=dict)  # (b1, b2), b1 < b2 -> recent log(t2 / t1) of consecutive steps
    timed: Counter = field(default_factory=Counter)  # budget -> steps timed at it
    previous: tuple | None = None  # (budget, seconds) of the last timed step of the current sequence
    first_step: bool = False  # the next step is a sequence's first (its time is not a cost of its budget)

    def __post_init__(self) -> None:
        missing = [b for b in self.budgets if b not in self.step_seconds]
        if missing:
            raise ValueError(f"budget policy has no measured cost for budgets {missing}")
        self.warm_up = dict(self.step_seconds)  # each budget's cost at start-up: the fit's prior
        self.log_cost = {b: math.log(self.warm_up[b]) for b in self.budgets}  # fitted, up to a common constant

    def expected_drafted(self, scores: np.ndarray) -> dict[int, float]:
        """Expected accepted drafted tokens at each budget from the best-first path log-probabilities (root first)."""
        cumulative = np.concatenate(([0.0], np.cumsum(np.exp(scores[1:]))))
        return {b: float(cumulative[min(b, len(cumulative) - 1)]) for b in self.budgets}

    @staticmethod
    def _cumulative(budgets, segments: Counter) -> dict[int, float]:
        total, out = 0.0, {}
        for b in budgets:
            if b in segments:
                total += segments[b]
                out[b] = total
        return out

    @property
    def predicted_at(self) -> dict[int, float]:
        """Drafted tokens expected at each budget (its whole tree), over the steps that inform it."""
        return self._cumulative(self.budgets, self.segment_predicted)

    @property
    def observed_at(self) -> dict[int, float]:
        """Drafted tokens accepted at each budget, over the steps that inform it."""
        return self._cumulative(self.budgets, self.segment_observed)

    def calibration_at(self, budget: int) -> float:
        """The factor of the segment `budget` ends: the nodes it adds to the next smaller budget."""
        return (self.segment_observed[budget] + PRIOR * self.calibration) / (self.segment_predicted[budget] + PRIOR)

    def expected(self, drafted: dict[int, float]) -> dict[int, float]:
        """Tokens a step emits at each budget: the bonus, and each segment's expected drafted tokens calibrated."""
        expected, total, below = {}, 1.0, 0.0
        for b in self.budgets:
            total += self.calibration_at(b) * (drafted[b] - below)
            expected[b], below = total, drafted[b]
        return expected

    def costs(self) -> dict[int, float]:
        """The measured step costs made non-decreasing in the budget (pool adjacent violators, equal weights)."""
        blocks: list[list] = []  # [summed cost, budgets pooled]
        for b in self.budgets:
            blocks.append([self.step_seconds[b], [b]])
            while len(blocks) > 1 and blocks[-2][0] / len(blocks[-2][1]) > blocks[-1][0] / len(blocks[-1][1]):
                total, pooled = blocks.pop()
                blocks[-1][0] += total
                blocks[-1][1] += pooled
        return {b: total / len(pooled) for total, pooled in blocks for b in pooled}

    def best(self, drafted: dict[int, float]) -> int:
        """The budget with the most expected tokens a second (the smallest one on ties), unless one within
        COST_MARGIN of that rate has been timed fewer than COST_MIN_STEPS times: that one (cost sampling, once the
        policy times its steps)."""
        costs, expected = self.costs(), self.expected(drafted)
        rate = {b: expected[b] / costs[b] for b in self.budgets}
        top = max(self.budgets, key=lambda b: (rate[b], -b))
        if not self.timed:  # no step timed yet (or none ever is, as in a replay): nothing to sample for
            return top
        close = [b for b in self.budgets if self.timed[b] < COST_MIN_STEPS and rate[b] >= (1 - COST_MARGIN) * rate[top]]
        return min(close, key=lambda b: (self.timed[b], b)) if close else top

    def start_sequence(self) -> None:
        """A new request's steps follow: its first step is not paired with the last one of the request before (a
        prefill, and any time at all, came between them), and its own time is not learnt from: the first draft after
        a prefill reads the whole prompt's context into the drafter (`RankWorker.draft`'s draft_prefill profile; on
        the CPU ~8 ms where a later draft takes ~6), a cost of the prompt, not of the budget the step took."""
        self.previous = None
        self.first_step = True

    def choose(self, scores: np.ndarray) -> int:
        """A host step's budget, from its tree's best-first path log-probabilities; `record` follows the step."""
        drafted = self.expected_drafted(scores)
        best = self.best(drafted)
        self._taken(best, drafted)
        return best

    def _taken(self, budget: int, drafted: dict[int, float]) -> None:
        self.chosen[budget] += 1
        self.predicted += drafted[budget]
        self.last, self.last_drafted = budget, drafted

    def record(self, accept_length: int, seconds: float | None = None, path: list[int] | None = None) -> None:
        """The step just taken: its accepted nodes (root included), where measured its time, and where given its
        accepted path (node indices, root first), which informs every budget up to the one taken."""
        accepted = None
        if path is not None and self.last is not None:
            accepted = {b: sum(1 for node in path[1:] if node <= b) for b in self.budgets if b <= self.last}
        self._learn(accept_length, accepted, seconds)

    def observe(self, stats: dict, accept_length: int, seconds: float | None = None) -> None:
        """A device step, chosen on the device (`runner/device/budget.py`): its statistics (`DeviceLoop.read_stats`:
        its budget, its expected drafted tokens at every budget, the drafted nodes each budget would have
        accepted), its accepted nodes (root included), and where measured its time."""
        budget = stats["budget"]
        self._taken(budget, stats["drafted"])
        self._learn(accept_length, {b: n for b, n in stats["accepted"].items() if b <= budget}, seconds)

    def _learn(self, accept_length: int, accepted: dict[int, int] | None, seconds: float | None) -> None:
        self.observed += accept_length - 1
        self.calibration = (self.observed + PRIOR) / (self.predicted + PRIOR)
        if accepted is not None:
            predicted_below = observed_below = 0.0
            for b in self.budgets:
                if b not in accepted:
                    break
                self.segment_predicted[b] += self.last_drafted[b] - predicted_below
                self.segment_observed[b] += accepted[b] - observed_below
                predicted_below, observed_below = self.last_drafted[b], accepted[b]
        if seconds is not None and self.last is not None and not self.first_step:
            self._time(self.last, seconds)
        self.first_step = False

    def _time(self, budget: int, seconds: float) -> None:
        """A step's time: paired with the previous step's if that was at another budget, the costs refitted, the
        machine's speed followed."""
        self.timed[budget] += 1
        if self.previous is not None and self.previous[0] != budget:
            other, before = self.previous
            low, high = sorted((budget, other))
            ratio = math.log(seconds / before) if budget == high else math.log(before / seconds)
            self.pairs.setdefault((low, high), deque(maxlen=COST_WINDOW)).append(ratio)
            self._fit()
        self.previous = (budget, seconds)
        self.speed.append(seconds / math.exp(self.log_cost[budget]))
        speed = statistics.median(self.speed)
        self.step_seconds = {b: math.exp(self.log_cost[b]) * speed for b in self.budgets}

    def _fit(self) -> None:
        """Log-costs by least squares: every pair's median log-ratio (weighted by its paired steps) and each
        budget's warm-up cost (weighted PAIR_PRIOR)."""
        index = {b: i for i, b in enumerate(self.budgets)}
        normal = np.eye(len(self.budgets)) * PAIR_PRIOR
        target = np.array([PAIR_PRIOR * math.log(self.warm_up[b]) for b in self.budgets])
        for (low, high), ratios in self.pairs.items():
            weight, ratio, i, j = len(ratios), statistics.median(ratios), index[low], index[high]
            normal[i, i] += weight
            normal[j, j] += weight
            normal[i, j] -= weight
            normal[j, i] -= weight
            target[j] += weight * ratio
            target[i] -= weight * ratio
        fitted = np.linalg.solve(normal, target)
        self.log_cost = {b: float(fitted[index[b]]) for b in self.budgets}

    def device_inputs(self) -> tuple[list[float], list[float]]:
        """What the device loop's choice reads, in budget order: the costs `best` uses and each budget's segment's
        calibration factor."""
        costs = self.costs()
        return [costs[b] for b in self.budgets], [self.calibration_at(b) for b in self.budgets]
