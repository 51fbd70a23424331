"""The whole step on the device (greedy or sampled), one CUDA graph a step (torch backend), with the next step
queued behind the running one so the GPU never waits for the host.

The host loop (`speculate.speculative_step`) goes to the host twice a step: for the draft's top-k, to build the
tree in Python, and for the target's argmax, to walk it. Here the step is fixed-shape tensor work end to end, in four
phases: draft -> tree (top-k, `build_tree_device`) -> verify (target forward, greedy choices) -> accept (the walk
`accept_greedy_device`, the commit of the accepted rows into the caches, the next step's context and bonus), with the
sequence state (cached rows, drafted rows, context rows, bonus token) in device scalars. The autoregressive mode is
the same machinery with one phase (decode a token, commit it): the baseline the speed-ups are measured against.

`launch` replays the step graph and queues an asynchronous copy of the emitted tokens into a pinned host slot;
`collect` waits for the oldest launched step and returns its tokens. `generate_on_device` keeps one step in flight
behind the one it collects (as SGLang's overlap scheduler does), so graph replays run back to back; a step launched
past the end of a request is discarded. A sampled request's step draws the target's choices on the device
(`runner/device/sampling.py`) in a graph of its own. The prompt's context enters the draft cache with the prefill
(`prefill_context`, the drafter's prefill), so the first step is a device step too.

Several tree budgets (`spec.budgets`): a graph per budget (its tree and its verify on that budget's rows), and each
launch says which: the request's fixed budget, or `auto`'s choice for the step (`StepBudgetPolicy` in
`runner/device/budget.py`, on the host before the launch, from earlier steps' statistics: no round trip). A step at the
largest budget reports what every smaller budget would have accepted.

Rows past the accepted path are written too (into cache rows past the new length, which no step reads before they
are overwritten): fixed shapes, no data-dependent slicing. The caller keeps `2 * block_size` rows of cache spare.
"""

from __future__ import annotations

import gc
import time
from collections import deque

import torch

from engines.spec import SpecConfig
from models.moe import Router
from runner.device.budget import accepted_at, choose_budget, expected_drafted, node_scores, rank_nodes
from runner.device.sampling import filter_kind, sample_tokens, sampling_tensors
from runner.device.tree import accept_greedy_device, tree_forms
from runner.probes import Probes
from runner.sampling import SamplingParams
from runner.sessions.cuda_graphs import capture_graph, timing_event, warm_up
from runner.speculate import GenerationResult, PhaseTimer, _emit

SLOTS = 2  # steps in flight at most: the one running and the one queued behind it


class DeviceLoop:
    def __init__(self, worker, spec: SpecConfig, use_graph: bool = True, autoregressive: bool = False,
                 probes: Probes | None = None):  # fmt: skip
        """worker: a `RankWorker` on the torch backend (its modules and caches are used in place); use_graph: one
        CUDA graph a step (else eager, as on CPUs); probes: benchmarks' hooks (`runner/probes.py`), None in
        production."""
        self.worker, self.spec, self.autoregressive = worker, spec, autoregressive
        self.target = worker.session.modules["target"]
        self.drafter = worker.session.modules["draft"]
        self.cache = worker.cache
        device = self.device = self.cache.latent.device
        block, depth = spec.block_size, spec.draft_depth
        # several budgets: a graph per budget, each launch names its step's budget
        self.budgets = () if autoregressive else spec.budgets
        self.auto = len(self.budgets) > 1
        self.tree_spec = spec.with_budget(max(self.budgets)) if self.auto else spec
        self.rows = 1 if autoregressive else self.tree_spec.verify_tokens
        self.width = self.tree_spec.tree_width(self.target.config.vocab_size)
        self.top_logprobs, self.build_tree = tree_forms(device)
        long = {"dtype": torch.long, "device": device}
        self.num_cached = torch.zeros(1, **long)
        self.num_drafted = torch.zeros(1, **long)
        self.context_count = torch.zeros(1, **long)
        # on the host: whether the pending context may hold more than one row (after a tree step: the accepted
        # rows; after a load or an autoregressive step of a batch: at most one), `BatchLoop._decode`'s choice, and
        # how many rows it holds (a batch's slot: its last tree step's accepted rows and its autoregressive steps'
        # since, `BatchLoop.lazy_context`)
        self.wide_context, self.pending = False, 0
        self.bonus = torch.zeros(1, **long)
        self.context = torch.zeros(block, self.drafter.fc.weight.shape[1], dtype=self.cache.latent.dtype, device=device)
        self.masks = torch.full((block - 1,), worker.mask_token_id, **long)
        self.arange_block = torch.arange(block, device=device)
        self.arange_rows = torch.arange(self.rows, device=device)
        self.arange_path = torch.arange(depth + 1, device=device)
        self.decode_mask = torch.ones(1, 1, dtype=torch.bool, device=device)
        self.emitted = torch.zeros(depth + 2, **long)  # tokens (depth + 1 at most), then the count
        self.prompt_length = torch.zeros(1, **long)
        # a sampled request's settings and draw counter (`runner/device/sampling.py`), set by `load`
        self.sampling = sampling_tensors(SamplingParams(1.0), device)
        self.draws = torch.zeros(1, **long)
        # the mode of the request loaded: greedy, and sampled with each filter kind, are graphs of their own
        self.sampled, self.filter = False, "none"
        self.narrow = False  # this step's tree is narrower than the largest budget's (`_tree`)
        self.step_budget: int | None = None  # a lone request's step budget (`launch`); None: the largest
        # the phases, in groups: one graph a step holds them all; probes.split_phases captures a graph per group
        groups = [[self._decode]] if autoregressive else [[self._draft], [self._tree], [self._verify], [self._accept]]
        probes = probes or Probes()
        self.oracle = probes.oracle
        if self.oracle is not None and not autoregressive:  # benchmarks: the real forwards, then the oracle's logits
            groups[0].append(self._oracle_draft)
            groups[2].append(self._oracle_choices)
        self.groups = groups if probes.split_phases else [[phase for group in groups for phase in group]]
        self.use_graph, self.graphs = use_graph, {}
        pinned = device.type == "cuda"
        self.host = [torch.zeros(depth + 2, dtype=torch.long, pin_memory=pinned) for _ in range(SLOTS)]
        self.done = [torch.cuda.Event() for _ in range(SLOTS)] if pinned else None
        self.in_flight: deque[int] = deque()
        self.launched = 0
        if self.auto:
            self._budget_tensors(pinned)
        # probes.record_events: per step, an event before the first graph and after each graph
        self.events: list[tuple] | None = [] if probes.record_events else None

    def _budget_tensors(self, pinned: bool) -> None:
        """The choice's inputs (costs, calibration factors, the fixed budget's index or -1: one float64 vector the
        host refreshes from a pinned slot per launch) and the step's statistics (the budget index, E_b, and the
        nodes each budget would have accepted), which come back with its tokens."""
        count, device = len(self.budgets), self.device
        self.budget_values = torch.tensor(self.budgets, dtype=torch.long, device=device)
        self.choice_inputs = torch.ones(2 * count + 1, dtype=torch.float64, device=device)
        self.choice_inputs[-1] = count - 1
        self.request_index = count - 1  # the loaded request's budget index (`load`; -1: auto)
        self.request_budget: int | None = max(self.budgets)  # a lone request's fixed budget (`load`; None: auto)
        self.slot_budgets = [max(self.budgets)] * SLOTS  # the budget of the step in each pinned slot
        self.stats = torch.zeros(1 + 2 * count, dtype=torch.float64, device=device)
        self.active = torch.ones(self.rows, dtype=torch.bool, device=device)
        self.inputs_host = [torch.zeros(2 * count, dtype=torch.float64, pin_memory=pinned) for _ in range(SLOTS)]
        self.stats_host = [torch.zeros(1 + 2 * count, dtype=torch.float64, pin_memory=pinned) for _ in range(SLOTS)]
        self.routers = [module for module in self.target.modules() if isinstance(module, Router)]
        self.last_stats: dict | None = None

    def budget_index(self, budget: int | str | None) -> int:
        """The choice's index for a request's budget: -1 for "auto", else its place in `budgets` (None: the spec's)."""
        if budget == "auto":
            return -1
        budget = self.spec.budget if budget is None else budget
        if budget not in self.budgets:
            raise ValueError(f"budget {budget} is not one of the device loop's tree budgets {list(self.budgets)}")
        return self.budgets.index(budget)

    def prefill_context(self) -> None:
        """The drafter's prefill: the pending context (the prompt's, after the target's prefill) goes into the draft
        cache as K/V (`DFlashDrafter.context_kv`), queued behind the prefill before the host waits for its logits.
        The first step then drafts with no new context rows (the same keys as a host step's longer draft profile),
        so every step runs on the device."""
        if self.autoregressive or self.cache.pending_taps is None:
            return
        taps, start = self.cache.take_context()
        with torch.no_grad():
            positions = torch.arange(start, start + taps.shape[0], device=self.device)
            self.cache.commit_draft(self.drafter.context_kv(taps, positions), taps.shape[0])

    def load(self, bonus: int, prompt_length: int, params=None, budget: int | str | None = None) -> None:
        """Takes over a prefilled sequence (or one the host loop has stepped); context still pending goes through
        `prefill_context`, so the first step has no new context rows. params: a sampled request's `SamplingParams`
        (its draws continue the counter after the first token's, drawn by `first_token`); None: greedy. budget:
        with several budgets, the request's (one of them, "auto", or None: the spec's)."""
        if self.in_flight:
            raise RuntimeError(f"{len(self.in_flight)} device steps are still in flight: collect them first")
        if not self.autoregressive:
            self.prefill_context()
            self.context.zero_()
            self.context_count.fill_(0)
            self.wide_context, self.pending = False, 0
        self.num_cached.fill_(self.cache.num_cached)
        self.num_drafted.fill_(self.cache.num_drafted)
        self.bonus.fill_(bonus)
        # where the continuation starts, for the benchmarks' oracle: after the prompt (and a synthetic context's rows)
        self.prompt_length.fill_(prompt_length + self.worker.context_rows)
        self.sampled = params is not None and not params.greedy
        self.filter = filter_kind(params) if self.sampled else "none"
        if self.sampled:
            for name, value in sampling_tensors(params, self.device).items():
                self.sampling[name].copy_(value)
            self.draws.fill_(1)
        if self.auto:
            self.request_index = self.budget_index(budget)  # the choice's index for this request (-1: auto)
            self.request_budget = None if budget == "auto" else self.budgets[self.request_index]
            # a lone request's step at the largest budget verifies every node (statistics for every budget); a
            # batch sets each slot's index before each step (`BatchLoop.step`)
            self.choice_inputs[-1:].fill_(len(self.budgets) - 1)
        elif budget not in (None, "auto", self.spec.budget):
            raise ValueError(f"this device loop verifies tree budget {self.spec.budget} only, not {budget}")

    # --- the phases (fixed shapes, device tensors only: each can be captured in a graph) ---

    def _draft(self) -> None:
        """Draft: [bonus, mask x (block - 1)] attending to the cached and the new context rows."""
        block_ids = torch.cat((self.bonus, self.masks))
        positions = self.num_cached + self.arange_block
        context_positions = self.num_cached - self.context_count + self.arange_block
        draft_logits, new_context_kv = self.drafter(self.context, context_positions, self.context_count, block_ids,
                                                    positions, self.cache.draft, self.num_drafted)  # fmt: skip
        self.cache.draft.index_copy_(2, self.num_drafted + self.arange_block, new_context_kv)
        self.num_drafted += self.context_count
        self.draft_logits = draft_logits

    def _tree(self, budget: int | None = None, top=None, choose: bool = True, built=None) -> None:
        """Tree: best-first under the budget (several budgets: the largest one's tree, then the step's budget).
        budget: the step's budget (a batched step's for every request, `runner/device/batch.py`; None: a lone
        request's `step_budget`, set by `launch`): this tree is built at it, on its own rows; at the largest budget
        every node is verified and the statistics tell each smaller one. top: the draft's top candidates at
        `tree_width(budget)` (a batched step takes every slot's in one launch), else taken here. choose: with
        several budgets, the largest budget's tree chooses its own (`_choose_budget`); a batch-wide step ranks every
        slot's nodes at once instead (`BatchLoop._rank`). built: this tree, built already (a batched step builds
        every slot's in one launch, `tree_kernel.build_trees_kernel`)."""
        at, rows, self.narrow = self.tree_at(budget)
        values, indices = top if top is not None else self.top_logprobs(self.draft_logits, self.tree_width(at))
        self.tree = built or self.build_tree(values, indices, at, self.bonus, rows)
        if self.auto and choose and not self.narrow:
            self._choose_budget(values, indices)

    def tree_at(self, budget: int | None = None) -> tuple[int, int, bool]:
        """(the budget a step's tree is built at, its rows, whether that is narrower than the largest budget) for a
        step at `budget` (None: a lone request's `step_budget`, else the largest)."""
        budget = self.step_budget if budget is None else budget
        if budget is not None and budget != self.tree_spec.budget:
            return budget, self.spec.with_budget(budget).verify_tokens, True
        return self.tree_spec.budget, self.rows, False

    def tree_width(self, budget: int | None = None) -> int:
        """The draft candidates a depth the tree of `budget` needs (None: the largest budget's)."""
        if budget is None or budget == self.tree_spec.budget:
            return self.width
        return self.spec.with_budget(budget).tree_width(self.target.config.vocab_size)

    def _choose_budget(self, values, indices) -> None:
        """The step's budget b (`runner/device/budget.py`); the nodes outside the b best become padding."""
        tokens, parents, depths, mask, count = self.tree
        budgets = len(self.budgets)
        rank, ordered = rank_nodes(node_scores(tokens, depths, mask, values, indices))
        drafted = expected_drafted(ordered, self.budget_values)
        inputs = self.choice_inputs
        index = choose_budget(drafted, inputs[budgets : 2 * budgets], inputs[:budgets], inputs[-1:].to(torch.long))
        active = mask.diagonal() & (rank <= self.budget_values.index_select(0, index))
        self.active.copy_(active)
        self.rank = rank
        self.stats[:1].copy_(index)
        self.stats[1 : 1 + budgets].copy_(drafted)
        self.tree = (tokens, parents, depths, mask & active[:, None] & active[None, :], count)

    def _verify(self) -> None:
        """Every node at position start + depth, one target forward; the target's greedy choice per node."""
        tokens, _, depths, mask, _ = self.tree
        logits, self.new_kv, self.taps = self.target(tokens, self.num_cached + depths, mask, self.cache.latent,
                                                     self.num_cached, self.arange_rows[: tokens.shape[0]])  # fmt: skip
        self.choices = self._choose(logits)

    def _accept(self) -> None:
        """The longest path of the target's own choices; its end's choice is the next bonus. Commits the path's rows
        (and, harmlessly, rows past it); they become the drafter's next context."""
        depth = self.spec.draft_depth
        tokens, parents, depths, mask, _ = self.tree
        path, length, next_bonus = accept_greedy_device(tokens, parents, depths, mask, self.choices, depth)
        self.cache.latent.index_copy_(1, self.num_cached + self.arange_path, self.new_kv.index_select(1, path))
        self.context.copy_(self.taps.index_select(0, path))
        self.context_count.copy_(length)
        self.num_cached += length
        emitted = torch.roll(tokens.index_select(0, path), -1).scatter_(0, length - 1, next_bonus)
        self.emitted[: depth + 1].copy_(emitted)
        self.emitted[depth + 1 :].copy_(length)
        self.bonus.copy_(next_bonus)
        if self.auto and not self.narrow:
            self.stats[1 + len(self.budgets) :].copy_(accepted_at(self.rank, path, length, self.budget_values))

    def _decode(self) -> None:
        """Autoregressive: the bonus token's forward, its KV committed, the greedy next token."""
        logits, new_kv, _ = self.target(self.bonus, self.num_cached, self.decode_mask, self.cache.latent,
                                        self.num_cached, self.arange_rows)  # fmt: skip
        token = self._choose(logits)
        self.cache.latent.index_copy_(1, self.num_cached, new_kv)
        self.num_cached += 1
        self.emitted[:1].copy_(token)
        self.emitted[-1:].copy_(self.decode_mask.reshape(1))
        self.bonus.copy_(token)

    def _choose(self, logits: torch.Tensor) -> torch.Tensor:
        """The target's token at each row: its argmax, or (a sampled request) one exact draw from its distribution
        there, with fresh counter-based noise every step. Each node's draw is independent, so walking the tree by
        them emits exactly the target's samples (lossless)."""
        if not self.sampled:
            return logits.argmax(dim=-1)
        self.draws += 1
        return sample_tokens(logits, **self.sampling, counter=self.draws, filter=self.filter)

    # --- benchmarks' oracle (probes.oracle): after the real forward, logits that follow the known continuation ---

    def _oracle_draft(self) -> None:
        ahead = self._oracle_tokens(self.arange_block[: self.spec.draft_depth] + 1)
        self.draft_logits = torch.zeros_like(self.draft_logits).scatter_(1, ahead[:, None], 30.0)

    def _oracle_choices(self) -> None:
        self.choices = self._oracle_tokens(self.tree[2] + 1)  # every node's choice: the token one past its depth

    def _oracle_tokens(self, ahead: torch.Tensor) -> torch.Tensor:
        index = (self.num_cached - self.prompt_length + ahead).clamp(0, self.oracle.shape[0] - 1)
        return self.oracle[index]

    # --- launching and collecting steps ---

    def launch(self, budget: int | None = None) -> None:
        """Queues one step (a graph replay on the GPU; eager elsewhere) and the copy of its tokens to the host.
        budget: with several budgets, this step's (a graph each; None: the loaded request's fixed budget; an `auto`
        request's steps each name theirs, `StepBudgetPolicy.choose`)."""
        if len(self.in_flight) == SLOTS:
            raise RuntimeError(f"{SLOTS} device steps in flight: collect one before launching another")
        slot = self.launched % SLOTS
        if self.auto:
            budget = self.request_budget if budget is None else budget
            if budget not in self.budgets:
                raise ValueError(f"a step's budget must be one of the device loop's {list(self.budgets)}, got "
                                 f"{budget} (an auto request names each step's)")  # fmt: skip
            self.slot_budgets[slot] = budget
            self.step_budget = None if budget == self.tree_spec.budget else budget
        self.launched += 1
        if not self.use_graph:
            for group in self.groups:
                _run(group)
            self.host[slot].copy_(self.emitted)
            if self.auto and self.step_budget is None:  # only a step at the largest budget reports statistics
                self.stats_host[slot].copy_(self.stats)
        else:
            mode = (self.sampled, self.filter, self.step_budget)
            if mode not in self.graphs:
                self.graphs[mode] = self._capture()
            marks = [] if self.events is not None else None
            for graph in self.graphs[mode]:
                if marks is not None:
                    marks.append(timing_event())
                graph.replay()
            if marks is not None:
                self.events.append((*marks, timing_event()))
            self.host[slot].copy_(self.emitted, non_blocking=True)
            if self.auto and self.step_budget is None:  # a narrower step's statistics are not read: no copy
                self.stats_host[slot].copy_(self.stats, non_blocking=True)
            self.done[slot].record()
        self.in_flight.append(slot)

    def collect(self) -> list[int]:
        """Waits for the oldest step in flight; returns the tokens it emits (accepted drafts, then the new bonus)."""
        slot = self.in_flight.popleft()
        if self.done is not None:
            self.done[slot].synchronize()
        values = self.host[slot].tolist()  # the one device -> host transfer of a step
        count = values[-1]
        if self.auto:  # the step's budget; a step at the largest budget also reports every budget's acceptance
            self.last_budget = self.slot_budgets[slot]
            full = self.last_budget == self.tree_spec.budget
            self.last_stats = self.read_stats(self.stats_host[slot].tolist()) if full else None
        self.cache.num_cached += count  # the host's mirror, for the capacity check
        return values[:count]

    def set_choice(self, choice: tuple[list[float], list[float]], slot: int = 0) -> None:
        """A batch's `auto` slot (`BatchLoop`): the host policy's costs and calibration factors
        (`BudgetPolicy.device_inputs`) into the choice's inputs, through pinned slot `slot` (its previous copy finished
        before its step, which the host waited for)."""
        staged = self.inputs_host[slot]
        staged.copy_(torch.tensor([*choice[0], *choice[1]], dtype=torch.float64))
        self.choice_inputs[:-1].copy_(staged, non_blocking=True)

    def read_stats(self, values: list[float]) -> dict:
        """A step's statistics (`stats`, several budgets): the budget it verified, its expected drafted tokens at
        every budget, the drafted tokens each budget would have accepted."""
        count = len(self.budgets)
        return {"budget": self.budgets[int(values[0])], "drafted": dict(zip(self.budgets, values[1 : 1 + count])),
                "accepted": {b: int(n) for b, n in zip(self.budgets, values[1 + count :])}}  # fmt: skip

    def close(self) -> None:
        """Finishes the steps in flight and frees the graphs, events and pinned slots when the engine closes, not
        whenever interpreter shutdown gets to them."""
        self.discard()
        if self.done is not None:
            torch.cuda.synchronize(self.device)
        self.graphs, self.done, self.host, self.events = {}, None, [], None

    def discard(self) -> None:
        """Waits for the steps in flight and drops their tokens."""
        while self.in_flight:
            self.collect()

    def _capture(self) -> list:
        """The step's graphs in the current mode (greedy, or sampled with a filter kind: `_choose` branches at
        capture time)."""
        state = (self.num_cached, self.num_drafted, self.context_count, self.bonus, self.context, self.draws)
        saved = [t.clone() for t in state]
        warm_up(lambda: [_run(group) for group in self.groups], self.device)
        for tensor, before in zip(state, saved):
            tensor.copy_(before)  # the warm-up must not count as a step
        # garbage holding CUDA resources (pinned memory, events) must not be freed while a stream captures: a
        # collection that happens to run mid-capture invalidates the capture (torch no longer collects on entry)
        gc.collect()
        pool = torch.cuda.graph_pool_handle()
        return [capture_graph(lambda g=g: _run(g), self.device, warmups=0, pool=pool)[0] for g in self.groups]


def _run(phases) -> None:
    for phase in phases:
        phase()


def first_token(logits: torch.Tensor, params=None) -> list[int]:
    """The token after the prompt from the prefill's last-row logits: the argmax, or (a sampled request's
    `SamplingParams`) its draw 0; the device steps draw on from 1."""
    if params is None or params.greedy:
        return logits.argmax(dim=-1).tolist()
    draw = sampling_tensors(params, logits.device)
    counter = torch.zeros(1, dtype=torch.long, device=logits.device)
    return sample_tokens(logits, **draw, counter=counter, filter=filter_kind(params)).tolist()


def generate_on_device(engine, spec: SpecConfig, prompt: list[int], max_new_tokens: int, capacity: int,
                       end_ids: set[int] = frozenset(), on_tokens=None, autoregressive: bool = False,
                       stop_sequences: tuple[tuple[int, ...], ...] = (), params=None, budget: int | str | None = None,
                       policy=None) -> GenerationResult:  # fmt: skip
    """Generation with device steps, one queued behind the one collected; the prefill runs on the host loop. params:
    a sampled request's `SamplingParams` (the first token is its draw 0, the steps draw on from 1); None: greedy.
    budget: with several tree budgets, one of them or "auto" (None: the spec's); policy: auto's `StepBudgetPolicy`,
    which names each step's budget at its launch and learns from each step's time and statistics. Every rank's
    worker must have called `enable_device_loop` (with the same `autoregressive`)."""
    timer, start = PhaseTimer(), time.perf_counter()
    result = GenerationResult(prompt=list(prompt), tokens=[])
    sampled = params is not None and not params.greedy
    engine.reset()
    with timer("prefill"):  # the target's prefill, then the drafter's (queued behind it: no wait in between)
        logits = engine.prefill(list(prompt))
        if not autoregressive:
            engine.device_prefill_context()
        first = first_token(logits, params if sampled else None)
    result.target_forwards = 1
    _, finished = _emit(result.tokens, first, max_new_tokens, end_ids, stop_sequences, on_tokens)
    if not finished:
        with timer("device_load"):
            engine.device_load(result.tokens[-1], len(prompt), params if sampled else None, budget)
    loop = engine.lead.loop
    several = not autoregressive and loop.auto  # each step reports the budget it verified
    if several and budget == "auto" and policy is None:
        raise ValueError("an auto request on the device loop needs its StepBudgetPolicy")
    choose = policy.choose if several and budget == "auto" else lambda: None
    last = time.perf_counter()
    most = 1 if autoregressive else spec.draft_depth + 1  # tokens (and committed rows) a step adds at most
    spare = 1 if autoregressive else 2 * spec.block_size  # rows a step writes past the committed ones
    in_flight = 0
    while not finished:
        while in_flight < SLOTS:
            ahead = len(prompt) + len(result.tokens) + in_flight * most + spare
            if in_flight and (len(result.tokens) + in_flight * most >= max_new_tokens or ahead > capacity):
                break  # the steps in flight may end the request, or one more might not fit: no run-ahead
            if ahead > capacity:
                raise ValueError(f"the sequence reached the cache capacity ({capacity} rows)")
            engine.device_launch(choose())
            in_flight += 1
        with timer("device_step"):
            step_tokens = engine.device_collect()
        in_flight -= 1
        if several:  # the step's time: from the previous step's tokens to its own (the GPU runs them back to back)
            now, stats = time.perf_counter(), loop.last_stats
            result.budgets.append(loop.last_budget)
            if budget == "auto":
                policy.record(1, loop.last_budget, now - last, [stats] if stats else [])
            last = now
        result.target_forwards += 1
        result.accept_lengths.append(len(step_tokens))
        _, finished = _emit(result.tokens, step_tokens, max_new_tokens, end_ids, stop_sequences, on_tokens)
    for _ in range(in_flight):  # a step launched past the end: its tokens are not the request's
        engine.device_collect()
    result.seconds, result.elapsed = dict(timer.seconds), time.perf_counter() - start
    return result
