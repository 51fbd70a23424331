"""The cost-aware tree budget on the device loop.

**Each budget is a CUDA graph of its own** (the tree and the verify on that budget's rows), and the budget of a step
is chosen on the host before its launch, from what earlier steps measured: no host round trip (the host reads each
step's tokens anyway, and the statistics come back with them). `StepBudgetPolicy` chooses for a lone request (a batch
of one) and for a batch whose requests all asked for `auto` (one budget for the batch): the most expected tokens a
second, from the drafted tokens each budget would have accepted (a step at the largest budget verifies every node,
and tells every smaller budget's acceptance: its b best nodes are that budget's tree) over each budget's measured
step time. The budgets are separate graphs because a narrow step inside the largest budget's graph (its other nodes
made padding) would still run the attention and the dense layers over every row, and the padding's expert pairs
would still take kernel work; with a graph each, a budget-8 step of an engine with budgets 8/16/32 costs what a
budget-8-only engine's does (whole Kimi K2 rank on one H200, two runs: 15.58 against 15.57 ms; BENCHMARKS.md 11).

**Autoregressive steps** (`DECODE`, a batch's policy only): a step of one target row a request, no draft and no tree
(`BatchLoop._decode(speculative=True)`: the new row joins the drafter's pending context while it has room,
`BatchLoop.lazy_context` and `context_rows`, the default; else the pending context is committed and the new row's
becomes the next; requests stay lossless and the next speculative step drafts from a full context). As a batch grows,
its verify rows cost more while an autoregressive step's rows stay few: one H200, the trained pair, 16 requests of 128
tokens in flight took 7944 tokens/s at budget 8 where autoregressive steps took 12029 (BENCHMARKS.md 18), so the policy
weighs an autoregressive step, one token a request, against the budgets like any other choice.

The tensor functions below rank a tree's nodes by path log-probability (one tree, or a batch's trees at once): a
step at the largest budget reports what every budget would have accepted (`accepted_at`) and what the drafter
expected (`expected_drafted`: predicted against observed acceptance); a batch's step at a smaller budget b reports
the same for b and every budget below it (its tree is their best nodes; `BatchLoop._rank`). A batch that mixes
`auto` with fixed budgets (`runner/device/batch.py`, each slot's own budget in one verify of the largest budget's
rows) still chooses each `auto` slot's budget inside the graph from its own tree (`choose_budget`) and makes the
other nodes padding: the other slots' rows are verified at that width anyway.
The padding sees nothing, nothing sees it, the walk never accepts it, and the target's MoE routes it to the root's
experts with zero weight (`models/moe.py`, `Router.row_active`).
"""

from __future__ import annotations

import statistics
from collections import Counter, deque

import torch


def node_scores(tokens, depths, mask, top_values, top_ids) -> torch.Tensor:
    """Each real node's path log-probability under the drafter (root 0; padding -inf): [rows] float32.

    A depth-d node's token is one of the drafter's top candidates at depth d (the tree is built from them), so its
    own log-probability is looked up there; the path's is the sum over the node's ancestors-or-self (the mask)."""
    return node_scores_batched(tokens[None], depths[None], mask[None], top_values[None], top_ids[None])[0]


def node_scores_batched(tokens, depths, masks, top_values, top_ids) -> torch.Tensor:
    """`node_scores` of B trees at once (a batched step's, `runner/device/batch.py`): tokens, depths [B, rows],
    masks [B, rows, rows], top_values, top_ids [B, depth, K] -> [B, rows]."""
    real = masks.diagonal(dim1=1, dim2=2)
    row = (depths - 1).clamp_min(0)[..., None].expand(-1, -1, top_ids.shape[-1])  # [B, rows, K]
    match = top_ids.gather(1, row) == tokens[..., None]
    own = torch.where(match, top_values.gather(1, row), 0.0).sum(dim=2)
    own = torch.where(real & (depths > 0), own, 0.0)
    scores = torch.bmm(masks.to(torch.float32), own[..., None])[..., 0]
    return torch.where(real, scores, float("-inf"))


def rank_nodes(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rank [..., rows]: each node's place in best-first order, the root 0; sorted scores [..., rows]), of one tree
    or of each of B trees ([B, rows]). Ties keep the node order, in which every parent precedes its children, so the
    b best always include each one's ancestors."""
    ordered, order = scores.sort(dim=-1, descending=True, stable=True)
    places = torch.arange(order.shape[-1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(-1, order, places)
    return rank, ordered


def expected_drafted(ordered_scores: torch.Tensor, budgets: torch.Tensor) -> torch.Tensor:
    """E_b for each budget: the drafter's expected accepted drafted tokens of the b best nodes, [..., nb] float64
    (a tree smaller than b: all its nodes)."""
    cumulative = ordered_scores[..., 1:].to(torch.float64).exp().cumsum(-1)
    return cumulative.index_select(-1, (budgets - 1).clamp_max(cumulative.shape[-1] - 1))


def choose_budget(drafted, calibration, costs, fixed) -> torch.Tensor:
    """The index [1] of the budget with the most expected tokens a second (`fixed` >= 0: that index instead).
    calibration: one factor a budget's segment, the nodes it adds to the next smaller budget (`BudgetPolicy`)."""
    segments = torch.diff(drafted, prepend=drafted.new_zeros(1))
    rate = (1.0 + (calibration * segments).cumsum(0)) / costs
    best = rate.argmax().reshape(1)
    return torch.where(fixed >= 0, fixed, best)


def accepted_at(rank, path, length, budgets) -> torch.Tensor:
    """For each budget b, the accepted path's drafted nodes among the b best (what budget b would have accepted:
    the target's choices at those nodes are the same), [nb] int64. length: [1]."""
    return accepted_at_batched(rank[None], path[None], length, budgets)[0]


def accepted_at_batched(rank, path, length, budgets) -> torch.Tensor:
    """`accepted_at` of B trees: rank [B, rows], path [B, steps], length [B] -> [B, nb]. A tree narrower than b
    counts its own nodes (what a batch-wide step at a smaller budget tells of b is no more than its budget's)."""
    steps = torch.arange(path.shape[1], device=path.device)
    drafted = (steps[None, :] > 0) & (steps[None, :] < length[:, None])  # [B, steps]
    within = rank.gather(1, path)[:, None, :] <= budgets[None, :, None]  # [B, nb, steps]
    return (within & drafted[:, None, :]).sum(dim=2)


MIN_INFORMED = 4  # request-steps at the largest budget before the acceptance estimates are used
COST_WINDOW = 32  # a (slots, budget) step's cost: the median of its last 32 times
# steps of a (slots, budget) pair timed before its cost is used: one time can be an outlier (one H200, two requests:
# budget 8, timed once, lost to 16 for the rest of the run, though the batch ran 24 % faster at a fixed 8; that time
# was most likely a graph capture, which a step's time no longer counts). Each new batch size costs these steps at
# every choice: in a short run (16 requests of 128 tokens, leaving one by one) they are a large share of the steps.
MIN_TIMED = 2
DECODE = 0  # the choice of an autoregressive step (a batch's policy: `StepBudgetPolicy(decode=True)`)
# Exploration (a step at a budget above the chosen one, which informs it and every smaller one) is paid for out of a
# share of the time the chosen budget's steps take: EXPLORE_SHARE while a larger budget could still win (its
# optimistic rate, the mean accepted plus two standard errors, at least the best's; the one with the best such rate is
# explored), EXPLORE_SHARE_SETTLED once none could (then the largest, so a drifting drafter is still noticed); never
# two within EXPLORE_GAP steps. On a Kimi K2 rank a budget-32 step costs 3x a budget-8 step (BENCHMARKS.md, section
# 11): exploring every 8th step cost auto a fifth of its speed there.
EXPLORE_SHARE, EXPLORE_SHARE_SETTLED, EXPLORE_GAP = 0.02, 0.002, 8
# A settled step (the best rate's budget, no exploration) reports statistics only where they tell something its
# emitted tokens do not: its own budget's acceptance is its accepted length (`observe`), so a step at the smallest
# budget never reports, and a step at a larger one every REPORT_GAP-th step (it tells the budgets below it). One H200,
# the trained pair, 16 requests: a budget-8 step that reported took 1.56 ms a step where a fixed budget 8's took 1.33
# (ranking every slot's nodes, the statistics' copy and their reading on the host), and auto ran 0.85x budget 8.
# A step taken to time its budget reports nothing either, so its time is a settled step's; a batch's reported steps
# count no time where their (slots, budget) pair has one (`Batcher.step`).
REPORT_GAP = 4


class StepBudgetPolicy:
    """One tree budget for a step (a lone request's, or every request's of a batched step), chosen on the host before
    the step's launch: the budget with the most expected tokens a second, busy requests x (1 + drafted tokens a
    request accepts at that budget) over the measured time of a step of that many slots at that budget.

    Acceptance: a step at budget B verifies its tree's B best nodes, and each request's statistics say how many
    drafted tokens each budget b <= B would have accepted (its b best nodes: what that budget's tree is); the estimate
    at b is their mean over the request-steps at b or above (`informed[b]`: a batch's steps at every budget report
    them, a lone request's at the largest only). Steps inform nothing larger than their budget, so the largest budget
    is taken until `MIN_INFORMED` request-steps informed the estimates, then a larger budget than the chosen one
    whenever the exploration credit covers what its step costs over the chosen one (the credit grows by a share of
    each chosen step's cost: `EXPLORE_SHARE` while a larger budget's optimistic rate could beat the best, the most
    hopeful of them explored; `EXPLORE_SHARE_SETTLED`, at the largest, once none could), so exploring never costs
    more than that share of the time, whatever the budgets cost. Costs: `costs`
    seeds a lone request's (seconds a step at each budget, as warm-up measured them: medians, trusted as they are),
    `step_costs` a batch's at the slot counts warm-up timed (`Generator.measure_batch_costs`); a
    budget no slot count has timed `MIN_TIMED` times is taken to time it; a (slots, budget) pair's cost is the median
    of its last `COST_WINDOW` step times, or until it is timed the line between the slot counts timed at that budget
    (`cost`). As the batch grows the wide verify's rows cost more and more, and the choice moves to
    narrower trees where their tokens a second win; with `decode`, to autoregressive steps once even the narrowest
    tree's tokens a second lose to one token a request at an autoregressive step's cost.
    The drafter's own expectation at each budget is summed next to what was accepted (`predicted`, `accepted`): how
    far its probabilities are from the target's agreement."""

    def __init__(self, budgets: tuple[int, ...], costs: dict[int, float] | None = None, decode: bool = False,
                 narrow_informs: bool = False, step_costs: dict[tuple[int, int], float] | None = None,
                 max_tokens: int | None = None):  # fmt: skip
        self.budgets = tuple(sorted(budgets))
        # the most tokens a request emits in a step (a block): with `narrow_informs`, a budget whose step could not
        # win at that many is neither informed nor explored (`possible`); None: every budget could
        self.max_tokens = max_tokens
        # whether a step below the largest budget reports statistics (a batch's do, `BatchLoop._rank`; a lone
        # request's do not): then a budget above the chosen one may be explored, else only the largest
        self.narrow_informs = narrow_informs
        # what a step can take: the budgets, and with `decode` an autoregressive step (`DECODE`) as well
        self.options = ((DECODE,) if decode and DECODE not in self.budgets else ()) + self.budgets
        self.accepted = dict.fromkeys(self.budgets, 0.0)  # drafted tokens accepted at b, summed over request-steps
        self.squares = dict.fromkeys(self.budgets, 0.0)  # and their squares (the estimates' standard errors)
        self.predicted = dict.fromkeys(self.budgets, 0.0)  # the drafter's expectation of the same
        self.informed = dict.fromkeys(self.budgets, 0)  # request-steps whose statistics told budget b
        self.times: dict[tuple[int, int], deque] = {}
        # timed already: a median of warm-up's steps each (`costs`: a lone request's; `step_costs`: (slots, budget)
        # pairs of a batch, `Generator.measure_batch_costs`), so no step is taken only to time it
        seeds = {**{(1, b): s for b, s in (costs or {}).items()}, **(step_costs or {})}
        for pair, seconds in seeds.items():
            self.times[pair] = deque([seconds], maxlen=COST_WINDOW)
        self.seeded = set(seeds)
        self.steps = 0
        self.credit = 0.0  # seconds of exploration earned and not spent yet
        self.explored_at = 0  # the step that last took the largest budget
        self.settled = False  # whether the step chosen last is the best rate's budget (no exploring, no timing)
        self.timing = False  # whether the step chosen last was taken to time its budget
        self.reported_at = 0  # the last settled step that reported statistics
        self.reported = dict.fromkeys(self.budgets, 0)  # request-steps whose drafter expectation `predicted` sums
        self.chosen: Counter = Counter()  # (slots stepped, budget) -> steps

    def expected(self, budget: int) -> float:
        """Tokens a request emits a step at `budget` (the bonus and the drafted tokens accepted; an autoregressive
        step's one)."""
        if budget == DECODE:
            return 1.0
        return 1.0 + self.accepted[budget] / max(self.informed[budget], 1)

    def timed(self, budget: int, count: int) -> bool:
        """Whether a step of `count` slots at `budget` has a cost of its own (timed `MIN_TIMED` times, or seeded)."""
        return len(self.times.get((count, budget), ())) >= MIN_TIMED or (count, budget) in self.seeded

    def timed_counts(self) -> dict[int, list[int]]:
        """{budget: the slot counts at which it has a cost of its own (`timed`), ascending}: one pass over the times."""
        out: dict[int, list[int]] = {}
        for count, budget in self.times:
            if self.timed(budget, count):
                out.setdefault(budget, []).append(count)
        for counts in out.values():
            counts.sort()
        return out

    def cost(self, budget: int, count: int = 1, timed: dict[int, list[int]] | None = None) -> float | None:
        """Seconds a step of `count` slots at `budget` takes: the median of its recent times once timed; before, the
        line between the nearest slot counts below and above that are timed at that budget (one side: its nearest),
        as a step's cost grows smoothly with its slots (one H200, the trained pair, budget 8: 0.91 ms at 1 slot, 1.13
        at 4, 1.40 at 8, 1.69 at 16); else its own times, if any; None: never timed. timed: `timed_counts()`, where
        the caller has it (a step's choice asks every option's cost, and its host time is time the GPU waits)."""
        counts = (self.timed_counts() if timed is None else timed).get(budget, [])
        times = self.times.get((count, budget))
        if count in counts:
            return statistics.median(times)
        counts = [c for c in counts if c != count]
        below, above = [c for c in counts if c < count][-1:], [c for c in counts if c > count][:1]
        at = lambda c: statistics.median(self.times[(c, budget)])  # noqa: E731
        if below and above:
            low, high = at(below[0]), at(above[0])
            return low + (high - low) * (count - below[0]) / (above[0] - below[0])
        if below or above:
            return at((below or above)[0])
        return statistics.median(times) if times else None

    def optimistic(self, budget: int) -> float:
        """Tokens a request emits a step at `budget`, two standard errors above the estimate (a variance floor of
        1/4 keeps a few identical steps from passing for certainty)."""
        n = max(self.informed[budget], 1)
        mean = self.accepted[budget] / n
        variance = max(self.squares[budget] / n - mean * mean, 0.0) + 0.25
        return 1.0 + mean + 2.0 * (variance / n) ** 0.5

    def possible(self, costs: dict[int, float]) -> tuple[int, ...]:
        """The budgets a batch's step could win with (`max_tokens` set, `narrow_informs`): those whose rate if every
        request emitted `max_tokens` reaches the best rate any option is sure of (one token a request a step, the
        least a step emits). On two CPU cores, 16 slots of the trained pair, a budget-32 step took 145 ms where an
        autoregressive one took 13.4: at 8 tokens a request it loses, and the first steps need not learn it."""
        if self.max_tokens is None or not self.narrow_informs:
            return self.budgets
        sure = max(1.0 / costs[b] for b in self.options)
        return tuple(b for b in self.budgets if self.max_tokens / costs[b] >= sure) or self.budgets[:1]

    def choose(self, busy: int = 1, count: int = 1) -> int:
        self.steps += 1
        self.settled = self.timing = False
        # a budget is taken to time it only where no slot count has its cost yet (elsewhere `cost` estimates it
        # from the counts that have one, and the steps that take it time it): each new batch size costs no steps
        timed = self.timed_counts()
        untimed = [b for b in self.options if not timed.get(b)]
        costs = {b: self.cost(b, count, timed) for b in self.options} if not untimed else {}
        # the largest budget that could win here: learnt first (its steps tell the budgets below it), explored
        largest = self.possible(costs)[-1] if costs else self.budgets[-1]
        if self.informed[largest] < MIN_INFORMED:
            best = largest
        elif untimed:
            best, self.timing = untimed[0], True
        else:
            rate = lambda b: busy * self.expected(b) / costs[b]  # noqa: E731
            hope = lambda b: busy * self.optimistic(b) / costs[b]  # noqa: E731
            best = max((b for b in self.options if b <= largest), key=lambda b: (rate(b), -b))
            self.settled = True
            if best != largest:
                # the budgets above the best that could still win, the most hopeful explored (each informs itself
                # and the budgets below it); none: the largest, at the settled share
                above = [b for b in self.budgets if best < b <= largest] if self.narrow_informs else [largest]
                hopeful = [b for b in above if hope(b) >= rate(best)]
                target = max(hopeful, key=lambda b: (hope(b), -b)) if hopeful else largest
                extra = costs[target] - costs[best]
                share = EXPLORE_SHARE if hopeful else EXPLORE_SHARE_SETTLED
                self.credit = min(self.credit + share * costs[best], max(extra, 0.0))
                if self.credit >= extra and self.steps - self.explored_at >= EXPLORE_GAP:
                    best, self.settled = target, False
                    self.credit, self.explored_at = 0.0, self.steps
        if best == largest:
            self.credit, self.explored_at = 0.0, self.steps
        self.chosen[(count, best)] += 1
        return best

    def reports(self, budget: int) -> bool:
        """Whether the step just chosen (at `budget`) should report statistics (`BatchLoop.launch(report=...)`): every
        step while learning or exploring; a step taken to time its budget never (its time is then what a settled
        step at that budget costs, and `observe` learns its acceptance from its emitted tokens); a settled one at the
        smallest budget never, at a larger budget every `REPORT_GAP`-th step (it tells the budgets below it)."""
        if budget == DECODE or self.timing:
            return False
        if not self.settled:
            return True
        if budget == self.budgets[0] or self.steps - self.reported_at < REPORT_GAP:
            return False
        self.reported_at = self.steps
        return True

    def observe(self, budget: int, accepted: list[int]) -> None:
        """A step at `budget` that reported nothing: each busy request's drafted tokens accepted (its emitted tokens
        but the bonus), which tell `budget` alone (what the b best nodes of its tree accepted is what it accepted)."""
        for tokens in accepted:
            self.informed[budget] += 1  # one of `informed - reported`: told by its emitted tokens alone
            self.accepted[budget] += tokens
            self.squares[budget] += tokens**2

    def record(self, count: int, budget: int, seconds: float | None, stats: list[dict]) -> None:
        """A step of `count` slots at `budget`: its time, and each busy request's statistics (`DeviceLoop.read_stats`;
        none: a step that reports none), which tell `budget` and every smaller budget."""
        if seconds is not None:  # None: a step whose time is no cost (it captured its graph)
            self.times.setdefault((count, budget), deque(maxlen=COST_WINDOW)).append(seconds)
        if budget == DECODE:
            return  # an autoregressive step informs no budget
        told = [b for b in self.budgets if b <= budget]
        for request in stats:
            for b in told:
                self.informed[b] += 1
                self.accepted[b] += request["accepted"][b]
                self.squares[b] += request["accepted"][b] ** 2
                self.predicted[b] += request["drafted"][b]
                self.reported[b] += 1

    def summary(self) -> dict:
        """What the policy chose and measured, by the slots a step ran: {slots: {"steps": {budget: steps},
        "ms": {budget: median ms a step}}} (budget 0: autoregressive steps)."""
        out: dict = {}
        for (count, budget), steps in sorted(self.chosen.items()):
            out.setdefault(count, {"steps": {}, "ms": {}})["steps"][budget] = steps
        for (count, budget), times in sorted(self.times.items()):
            out.setdefault(count, {"steps": {}, "ms": {}})["ms"][budget] = round(statistics.median(times) * 1e3, 3)
        return out


class ScriptedPolicy(StepBudgetPolicy):
    """The steps of `script` in turn (`DECODE` or a budget; cyclically), learning nothing: how the warm-up takes a
    given sequence of step forms (`Generator._warm_batch`: a tree step, then an autoregressive one). budgets: the
    policy's own (what `reports` sees; default the script's)."""

    def __init__(self, script: tuple[int, ...], budgets: tuple[int, ...] | None = None):
        super().__init__(budgets or tuple({b for b in script if b != DECODE}) or (DECODE,), decode=DECODE in script)
        self.script = tuple(script)
        self.taken = 0  # choices made (a batch may choose a step before the previous one is recorded)

    def choose(self, busy: int = 1, count: int = 1) -> int:
        self.taken += 1
        return self.script[(self.taken - 1) % len(self.script)]

    def record(self, count: int, budget: int, seconds: float | None, stats: list[dict]) -> None:
        self.steps += 1
