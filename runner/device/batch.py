"""Batched steps on the device loop: several requests in one step (in-flight batching).

Each request holds a *slot*: its own caches and its own `DeviceLoop` state (cached rows, bonus token, sampling
settings and draw counter, tree budget), so requests at different lengths, with different trees, budgets and seeds
share a step. One step over the first `n` slots runs **one drafter forward for every slot's block** and **one target
forward for every slot's tree** (their rows side by side, each attending to its own caches: `models/mla.py`,
`per_request`, and `models/dflash.py`), so each model's weights are read once for the whole batch; between them
every slot's tree, after them every slot's walk and commit. On GPUs the step is one CUDA graph per slot count and
per slot modes (greedy or sampled, filter kind).

A request joins at the next step after its prefill (requests admitted together in one forward, `BatchLoop.prefill`,
a graph of their count and length on GPUs, where a lone one is a group of one; on CPUs a lone one on the prefill
profile into its slot's caches) and leaves when it is done; slots past the last busy one are not stepped, and before
each step the requests of the highest slots move down into free slots below them (`BatchLoop.move`: their committed
rows and state copied), so a step covers as many slots as there are requests. `Batcher` (rank 0) schedules: it
admits, steps, emits tokens to each request's callback and reports finished requests. Where nothing the next step
needs depends on a step's tokens (fixed budgets or autoregressive decoding, the same requests, none at its token
limit; an all-`auto` batch too, its budget chosen one step behind, unless `DDTREE_RUN_AHEAD_AUTO=0`), it queues that
step before reading the tokens of the one in flight, as the single request's device loop does (`Batcher._next_plan`;
`BatchLoop.launch` / `collect`: each step's tokens in a pinned host slot of their own).
"""

from __future__ import annotations

import gc
import logging
import os
import statistics
import time
from collections import Counter, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from models.moe import active_rows
from runner.device.budget import (
    COST_WINDOW,
    DECODE,
    accepted_at,
    accepted_at_batched,
    expected_drafted,
    node_scores_batched,
    rank_nodes,
)
from runner.device.loop import SLOTS, DeviceLoop, first_token
from runner.device.tree import accept_greedy_batched, batched_tree_form
from runner.kv_cache import SequenceCache
from runner.probes import Probes
from runner.sessions.cuda_graphs import capture_graph, timing_event, warm_up
from runner.speculate import GenerationResult, PhaseTimer, _emit


def env_count(name: str, unset: str = "") -> int | None:
    """A positive whole number from the environment, None where it is not set (or empty); any other value an error
    naming the variable (`unset`: what not setting it does, for the message)."""
    chosen = os.environ.get(name, "")
    if chosen and not (chosen.isdigit() and int(chosen) > 0):
        raise ValueError(f"{name}: expected a whole number of at least 1{unset}, got {chosen!r}")
    return int(chosen) if chosen else None


def env_switch(name: str, unset: str = "") -> bool | None:
    """An on/off environment switch: 1 on, 0 off, None where it is not set (or empty); any other value an error
    naming the variable (`unset`: what not setting it does, for the message)."""
    chosen = os.environ.get(name, "")
    if chosen not in ("", "0", "1"):
        raise ValueError(f"{name}: expected 0 or 1{unset}, got {chosen!r}")
    return None if not chosen else chosen == "1"


class _Slot:
    """What a `DeviceLoop` reads of its worker, for one slot: the rank's session, the slot's own caches."""

    def __init__(self, worker, cache: SequenceCache):
        self.session, self.mask_token_id, self.device = worker.session, worker.mask_token_id, worker.device
        self.cache, self.context_rows = cache, 0


class BatchLoop:
    """One rank's slots and its batched step (the worker's `batch_*` calls).

    The slots' caches are rows of two batch tensors (latent [slots, layers, S, D], draft [slots, layers, 2, S, ...])
    and each slot's step state (cached rows, draft rows, context, bonus, emitted tokens) a row of the batch's state
    tensors, each `DeviceLoop` holding views of its row: one kernel commits, walks or chooses for every slot, and
    the attention kernels take the batch's caches whole (`models/mla.py`, `per_request`)."""

    def __init__(self, worker, spec, slots: int, use_graph: bool, autoregressive: bool = False,
                 lazy_context: bool | None = None):  # fmt: skip
        main = worker.cache
        device = self.device = main.latent.device
        # benchmarks' oracle (`runner/probes.py`), as the rank's own loop has it: every slot follows the continuation
        self.oracle = worker.loop.oracle if worker.loop is not None else None
        probes = Probes(oracle=self.oracle)
        self.latent = torch.zeros((slots, *main.latent.shape), dtype=main.latent.dtype, device=device)
        self.draft = torch.zeros((slots, *main.draft.shape), dtype=main.draft.dtype, device=device)
        self.loops = [DeviceLoop(_Slot(worker, SequenceCache.over(self.latent[s], self.draft[s])), spec, use_graph,
                                 autoregressive, probes) for s in range(slots)]  # fmt: skip
        lead = self.loops[0]
        long = {"dtype": torch.long, "device": device}
        self.num_cached, self.num_drafted = torch.zeros(slots, **long), torch.zeros(slots, **long)
        self.context_count, self.bonus = torch.zeros(slots, **long), torch.zeros(slots, **long)
        # an autoregressive step of speculative requests appends its row to each slot's pending context while every
        # slot's holds less than `context_rows` (the next draft takes up to a block of pending rows), instead of
        # committing the pending rows to the draft cache first (`_decode`): on by default on every device (on one
        # H100 the whole Kimi rank's `auto` batch of 4 taking autoregressive steps ran at 0.99x the autoregressive
        # engine with it, 0.95x without; BENCHMARKS.md section 18); `DDTREE_LAZY_CONTEXT=0` commits each step's row
        # (the former form)
        if lazy_context is None:
            chosen = env_switch("DDTREE_LAZY_CONTEXT", " (or unset: on)")
            lazy_context = True if chosen is None else chosen
        self.lazy_context = lazy_context
        # the rows a slot's pending context holds: `context_blocks` blocks (`DDTREE_CONTEXT_BLOCKS`; default 8 where
        # graphs run, 1 elsewhere). A run of autoregressive steps then commits its rows to the draft cache once every
        # `context_rows` steps, in one drafter call over all of them, and a tree step after more than a block of them
        # commits them first (`_flush`). On a GPU that call costs about what a block's does (it reads the drafter's
        # context weights once, whatever its rows): on one H100 the whole Kimi rank's `auto` batch of 4, taking
        # autoregressive steps, ran at 0.991-0.997x the autoregressive engine with 8 blocks, 0.988-0.991x with one
        # (the fastest batch 0.3 % over the engine's instead of 0.7 %; BENCHMARKS.md section 18); on a CPU its cost
        # grows with its rows, so one block there. Without `lazy_context`, one block.
        blocks = env_count("DDTREE_CONTEXT_BLOCKS", " (or unset: 8 where graphs run, else 1)")
        blocks = (8 if use_graph else 1) if blocks is None else blocks
        self.context_rows = spec.block_size * (blocks if lazy_context else 1)
        self.context = torch.zeros((slots, self.context_rows, lead.context.shape[1]), dtype=lead.context.dtype,
                                   device=device)  # fmt: skip
        self.arange_context = torch.arange(self.context_rows, device=device)
        self.emitted = torch.zeros((slots, *lead.emitted.shape), **long)
        # with several budgets, each slot's step statistics (`DeviceLoop.stats`): one row a slot, read in one copy
        self.stats = torch.zeros((slots, *lead.stats.shape), dtype=torch.float64, device=device) if lead.auto else None
        # and each slot's budget choice inputs (`DeviceLoop.choice_inputs`), a row a slot: a step sets every slot's
        # budget index in one write
        self.choice_inputs = torch.stack([loop.choice_inputs for loop in self.loops]) if lead.auto else None
        for s, loop in enumerate(self.loops):  # each loop's state: views of its slot's row
            loop.num_cached, loop.num_drafted = self.num_cached[s : s + 1], self.num_drafted[s : s + 1]
            loop.context_count, loop.bonus = self.context_count[s : s + 1], self.bonus[s : s + 1]
            loop.context, loop.emitted = self.context[s, : spec.block_size], self.emitted[s]
            if lead.auto:
                loop.stats, loop.choice_inputs = self.stats[s], self.choice_inputs[s]
        self.slot_index = torch.arange(slots, device=device)
        self.target, self.drafter, self.autoregressive, self.rows = lead.target, lead.drafter, autoregressive, lead.rows
        self.block = spec.block_size
        # every slot's tree in one launch where the loops build theirs with the Triton kernel (GPUs); else one a slot
        self.build_trees = batched_tree_form(device)
        self.routers = lead.routers if lead.auto else []
        self.logit_rows = torch.arange(slots * self.rows, device=device)
        self.use_graph, self.graphs = use_graph, {}
        # admissions' group prefills (`prefill`): a graph per (requests, padded length), in a pool of their own (each
        # replay's logits are copied out before the next replay)
        self.prefill_graphs: dict[tuple[int, int], tuple] = {}
        self.prefill_pool = torch.cuda.graph_pool_handle() if use_graph else None
        # a lone admission as a group of one (`prefill`; `DDTREE_LONE_AS_GROUP`, default on where graphs run): on GPUs
        # one graph of the target's prefill, its latent rows' write and the drafter's context K/V, where the prefill
        # profile's graph left the drafter's context to eager kernels at the request's load (about 2 ms of a 16-slot
        # batch's time an admission on one H100, the batch waiting: BENCHMARKS.md, section 18). On CPUs, where every
        # forward is eager, the prefill profile's path (not timed against this one there)
        chosen = env_switch("DDTREE_LONE_AS_GROUP", " (or unset: on where graphs run)")
        self.lone_as_group = use_graph if chosen is None else chosen
        # benchmarks' probes.record_events (the rank's device loop has them): (what, start, end) CUDA events around
        # each of the worker's batch calls, for the GPU's time in steps and admissions and its idle time between them
        self.events: list[tuple] | None = [] if worker.loop.events is not None and use_graph else None
        self._timing, self._end = 0, None
        # steps in flight (`launch`, `collect`): each step's tokens (and statistics) go to a pinned host slot of their
        # own in a copy queued behind it, so a second step can be queued before the first one's tokens are read
        pinned = device.type == "cuda"
        # (`SLOTS` of them, as the single request's loop has: the step running and one queued behind it)
        self.host_emitted = [torch.zeros(self.emitted.shape, dtype=torch.long, pin_memory=pinned)
                             for _ in range(SLOTS)]  # fmt: skip
        self.host_stats = ([torch.zeros(self.stats.shape, dtype=torch.float64, pin_memory=pinned)
                            for _ in range(SLOTS)] if lead.auto else None)  # fmt: skip
        self.done = [torch.cuda.Event() for _ in range(SLOTS)] if pinned else None
        # (pinned slot, slots stepped, budget, statistics read, captured) of each queued step
        self.in_flight: deque = deque()
        self.launched = 0
        # `Batcher` queues the next step before reading a step's tokens where the batch allows it (`run_ahead`):
        # the GPU then runs the steps back to back, where it waited for the host's work between them (8-17 % of a
        # batched job's time on one H100, BENCHMARKS.md, section 18). Default on where graphs run; on CPUs, where a
        # step runs eagerly, queueing ahead gains nothing (`DDTREE_RUN_AHEAD=1` takes the path there too)
        chosen = env_switch("DDTREE_RUN_AHEAD", " (or unset: on where graphs run)")
        self.run_ahead = use_graph if chosen is None else chosen
        # and an all-`auto` batch's steps too, each budget chosen before the previous step's statistics are read,
        # its autoregressive steps among them (their form does not depend on the tokens of the step before,
        # `decode_form`). Default on with `run_ahead` (`DDTREE_RUN_AHEAD_AUTO=0`: off): on one H100,
        # 64 requests of the trained pair through 16 slots, `auto` 1.039x autoregressive decoding with it, 0.999x
        # without, in the same run (BENCHMARKS.md, section 18)
        chosen = env_switch("DDTREE_RUN_AHEAD_AUTO", " (or unset: as DDTREE_RUN_AHEAD)")
        self.run_ahead_auto = self.run_ahead and (chosen is None or chosen)

    @contextmanager
    def timed(self, *what):
        """CUDA events around a batch call (`events`; the outermost call of nested ones), named by `what`'s words
        (joined only where events are recorded), else nothing."""
        if self.events is None or self._timing:
            yield
            return
        self._timing += 1
        start = timing_event()
        try:
            yield
        finally:
            self._timing -= 1
            end, self._end = self._end or timing_event(), None  # a step's: its work queued, before its tokens' wait
            self.events.append((" ".join(map(str, what)), start, end))

    def release(self, slot: int) -> None:
        """A slot whose request moved away (`move`): its state goes back to an empty sequence."""
        loop = self.loops[slot]
        for state in (loop.num_cached, loop.num_drafted, loop.context_count):
            state.fill_(0)
        loop.wide_context, loop.pending = False, 0
        loop.cache.reset()

    def move(self, source: int, target: int, rows: int) -> None:
        """The request in slot `source` goes on in the free slot `target` (below it: the batch's steps then cover
        fewer slots): its first `rows` cache rows (at least the rows it has committed, from the host's count), its
        step state and its settings are copied; `source` is released."""
        src, dst = self.loops[source], self.loops[target]
        rows = min(rows, src.cache.capacity)
        self.latent[target, :, :rows].copy_(self.latent[source, :, :rows])
        self.draft[target, :, :, :rows].copy_(self.draft[source, :, :, :rows])
        for state in (self.num_cached, self.num_drafted, self.context_count, self.bonus, self.context, self.emitted):
            state[target].copy_(state[source])
        for name in ("prompt_length", "draws", *(("choice_inputs",) if src.auto else ())):
            getattr(dst, name).copy_(getattr(src, name))
        for name, value in src.sampling.items():
            dst.sampling[name].copy_(value)
        dst.sampled, dst.filter, dst.wide_context, dst.pending = src.sampled, src.filter, src.wide_context, src.pending
        dst.cache.num_cached, dst.cache.num_drafted = src.cache.num_cached, src.cache.num_drafted  # its prefill's
        if src.auto:
            dst.request_index, dst.request_budget = src.request_index, src.request_budget
        self.release(source)

    def step(self, count: int, budget: int | None = None, report: bool = True) -> list[list[int]]:
        """One step of slots [0, count) (`launch`, then `collect`); returns each slot's emitted tokens."""
        if self.in_flight:
            raise RuntimeError(f"a batched step with {len(self.in_flight)} queued ahead: collect them first")
        self.launch(count, budget, report)
        return self.collect()[0]

    def launch(self, count: int, budget: int | None = None, report: bool = True) -> None:
        """Queues one step of slots [0, count), every one busy (`Batcher._compact`), and the copy of its tokens to a
        pinned host slot; `collect` reads them. budget: one tree budget for every slot this step
        (`StepBudgetPolicy`: the verify then has that budget's rows for each request, and each slot's statistics
        tell that budget and every smaller one); None: each slot's own (its request's budget, or `auto` chosen in
        the slot from its tree). report: whether a step at one budget reports statistics (an all-`auto` batch's
        policy learns from them; a batch all at one fixed budget needs none, and its graph leaves out the ranking).
        A step may be queued behind steps in flight: an autoregressive step's form (`decode_form`) depends on the
        kinds of the steps before it, not on their tokens."""
        if len(self.in_flight) == SLOTS:
            raise RuntimeError(f"{SLOTS} batched steps in flight: collect one before launching another")
        report = report or budget is None or budget == DECODE  # an autoregressive step reports nothing: one graph
        loops = self.loops[:count]
        if loops[0].auto:  # each slot's budget index: the largest where the step has one budget, else its request's
            if budget is not None:
                self.choice_inputs[:count, -1].fill_(len(loops[0].budgets) - 1)
            else:
                indices = torch.tensor([float(loop.request_index) for loop in loops], dtype=torch.float64)
                self.choice_inputs[:count, -1].copy_(indices)
        width, append = self.decode_form(count, budget)
        # a tree step after autoregressive steps that left more than a block pending: those rows go into the draft
        # caches first (the draft takes a block of them at most), and the step drafts from no new context rows
        flush = budget != DECODE and not self.autoregressive and any(loop.pending > self.block for loop in loops)
        for loop in loops if not self.autoregressive else ():  # what the next step's form reads, known now
            loop.wide_context = budget != DECODE  # a tree step leaves its accepted rows pending
            if budget == DECODE:  # an autoregressive step's row: one more pending, or the one left after a commit
                loop.pending = loop.pending + 1 if append else 1
            elif flush:
                loop.pending = 0
        captured = False  # whether this step captured its graph (its time then includes the capture: no cost of it)
        if not self.use_graph:
            if flush:
                self._flush(count)
            self._run(count, budget, report, width, append)
        else:
            keys = [("flush", count)] if flush else []
            keys.append((count, tuple((loop.sampled, loop.filter) for loop in loops), budget, report, width, append))
            for key in keys:
                if key not in self.graphs:
                    captured = True
                    run = (lambda: self._flush(count)) if key[0] == "flush" else None
                    self.graphs[key] = self._capture(count, budget, report, width, append, run)
                self.graphs[key].replay()
        if self._timing:
            self._end = timing_event()
        # every tree step's statistics, each slot's at its own budget or at the batch's; none of an autoregressive
        # step (decided from `budget`: a replayed graph does not set the Python attributes)
        informs = loops[0].auto and budget != DECODE and report
        slot = self.launched % SLOTS
        self.launched += 1
        pinned = self.done is not None
        self.host_emitted[slot][:count].copy_(self.emitted[:count], non_blocking=pinned)
        if informs:
            self.host_stats[slot][:count].copy_(self.stats[:count], non_blocking=pinned)
        if pinned:
            self.done[slot].record()
        self.in_flight.append((slot, count, budget, informs, captured))

    def collect(self) -> tuple[list[list[int]], bool]:
        """Waits for the oldest step in flight; returns (each of its slots' emitted tokens, whether it captured its
        graph) and sets each slot's `last_stats`."""
        slot, count, budget, informs, captured = self.in_flight.popleft()
        if self.done is not None:
            self.done[slot].synchronize()
        loops = self.loops[:count]
        emitted = self.host_emitted[slot][:count].tolist()  # the device -> host copy of a step
        # a tree step's pending rows: its accepted ones (its emitted count), unless a later step, queued behind it,
        # set them at its launch (an autoregressive step, which then commits them: `decode_form`)
        latest = not self.in_flight
        for loop, values in zip(loops, emitted) if budget != DECODE and latest and not self.autoregressive else ():
            loop.pending = values[-1]
        rows = self.host_stats[slot][:count].tolist() if informs else [None] * count
        for loop, values in zip(loops, rows):
            loop.last_stats = None if values is None else loop.read_stats(values)
        return [values[: values[-1]] for values in emitted], captured

    def decode_form(self, count: int, budget: int | None) -> tuple[int, bool]:
        """(width, append) of a step of slots [0, count) at `budget` (0 and False but for an autoregressive step of
        speculative requests, `_decode`): it appends its row to every slot's pending context while each has room for
        it (`lazy_context`, `context_rows`); else it commits the pending rows first, `width` of them a slot: one
        where no slot's pending context holds more than one row, `context_rows` where one holds more than a block
        (autoregressive steps appended them), else a block. Behind a tree step still in flight, whose accepted rows
        (the slots' pending counts) are not read yet, it commits the pending block, as without `lazy_context`: so a
        step's form never waits for the tokens of the one before, and an `auto` batch may queue its steps ahead
        either way."""
        if budget != DECODE or self.autoregressive:
            return 0, False
        loops = self.loops[:count]
        behind_tree = any(queued != DECODE for _, _, queued, *_ in self.in_flight)  # (slot, count, budget, ...)
        append = self.lazy_context and not behind_tree and all(loop.pending < self.context_rows for loop in loops)
        if append:
            return 0, True
        if not any(loop.wide_context or loop.pending > 1 for loop in loops):
            return 1, False
        wide = not behind_tree and any(loop.pending > self.block for loop in loops)
        return (self.context_rows if wide else self.block), False

    def _run(self, count: int, budget: int | None = None, report: bool = True, width: int = 0,
             append: bool = False) -> None:  # fmt: skip
        loops = self.loops[:count]
        if self.autoregressive:
            return self._decode(loops)
        if budget == DECODE:
            return self._decode(loops, speculative=True, width=width, append=append)
        self._draft(loops)
        self._trees(loops, budget, report)
        self._verify(loops, per_slot=budget is None)
        for loop in loops if self.oracle is not None else ():
            loop._oracle_choices()
        self._accept(loops, budget, report)

    def _trees(self, loops, budget: int | None = None, report: bool = True) -> None:
        """Every slot's top candidates in one launch, then each slot's tree (`DeviceLoop._tree`); a batch-wide
        budget's step that reports then ranks every slot's nodes at once (`_rank`)."""
        lead, depth = loops[0], self.block - 1
        width = lead.tree_width(budget)
        if self.oracle is not None:  # benchmarks' oracle: each slot's draft logits replaced
            for loop in loops:
                loop._oracle_draft()
            tops = [lead.top_logprobs(loop.draft_logits, width) for loop in loops]
            values, indices = torch.cat([v for v, _ in tops]), torch.cat([i for _, i in tops])
        else:
            values, indices = lead.top_logprobs(self.draft_logits, width)
        ranked = lead.auto and budget is not None and report
        at, rows, narrow = lead.tree_at(budget)
        chooses = lead.auto and not ranked and not narrow  # each slot chooses its own budget (`DeviceLoop._tree`)
        built = None
        if self.build_trees is not None:  # every slot's tree in one launch, at the step's budget (`DeviceLoop._tree`)
            count = len(loops)
            built = self.build_trees(values.view(count, depth, -1), indices.view(count, depth, -1), at,
                                     self.bonus[:count], rows)  # fmt: skip
        for b, loop in enumerate(loops):
            top = (values[b * depth : (b + 1) * depth], indices[b * depth : (b + 1) * depth])
            tree = None if built is None else (*(part[b] for part in built[:4]), built[4][b : b + 1])
            loop._tree(budget, top, choose=not ranked, built=tree)
        if built is not None and not chooses:  # every slot's tree as built: no slot narrowed its mask
            self.trees = list(built[:4])
        else:
            self.trees = [torch.stack(parts) for parts in zip(*(loop.tree[:4] for loop in loops))]
        if ranked:
            self._rank(len(loops), values.unflatten(0, (len(loops), depth)), indices.unflatten(0, (len(loops), depth)),
                       lead.budgets.index(budget))  # fmt: skip

    def _rank(self, count: int, values, indices, index: int) -> None:
        """A batch-wide step's statistics for every slot at once (one set of kernels, not one a slot): each tree's
        nodes ranked best first by the drafter's path log-probability, the drafter's expected accepted tokens at
        every budget, and the step's budget index; `_accept` adds what each budget would have accepted. A tree at
        a smaller budget is that budget's best nodes, and its best b are any smaller b's, so it tells every budget
        up to its own (`StepBudgetPolicy.record`)."""
        tokens, _, depths, masks = self.trees
        self.rank, ordered = rank_nodes(node_scores_batched(tokens, depths, masks, values, indices))
        budgets = len(self.loops[0].budgets)
        self.stats[:count, :1].fill_(index)
        self.stats[:count, 1 : 1 + budgets].copy_(expected_drafted(ordered, self.loops[0].budget_values))

    def _draft(self, loops) -> None:
        """Every slot's block in one drafter forward, each over its own draft cache (`DeviceLoop._draft`, batched)."""
        count, lead, block = len(loops), loops[0], self.block
        ids = torch.cat((self.bonus[:count, None], lead.masks.expand(count, block - 1)), dim=1).reshape(-1)
        positions = (self.num_cached[:count, None] + lead.arange_block).reshape(-1)
        context, context_positions = self._context(count)
        logits, new_context_kv = self.drafter(context, context_positions, self.context_count[:count], ids, positions,
                                              self.draft[:count], self.num_drafted[:count])  # fmt: skip
        self._commit_context(count, new_context_kv)
        self.draft_logits = logits
        for b, loop in enumerate(loops):
            loop.draft_logits = logits[b * (block - 1) : (b + 1) * (block - 1)]

    def _context(self, count: int, width: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's pending context rows (the first `width` of a block each, default all; `context_count` of them
        valid) and their positions."""
        width = width or self.block
        arange = self.arange_context[:width]
        context = self.context[:count, :width].reshape(count * width, -1)
        start = self.num_cached[:count] - self.context_count[:count]
        return context, (start[:, None] + arange).reshape(-1)

    def _commit_context(self, count: int, new_context_kv, width: int | None = None) -> None:
        """Each slot's context K/V rows into its draft cache (`width` rows written, default a block; its
        `context_count` rows kept): one write for every slot. Rows past the cache's end are not written (a wide
        commit's rows past a slot's count are no context; the cache keeps spare rows past every count)."""
        block = width or self.block
        rows = self.num_drafted[:count, None] + self.arange_context[:block]  # [count, block]
        rows = rows.clamp_max(self.draft.shape[3] - 1)  # past the end: the last row, past every committed one
        by_row = self.draft[:count].transpose(1, 3).transpose(2, 3)  # [count, S, layers, 2, ...], a view
        values = new_context_kv.unflatten(2, (count, block)).permute(2, 3, 0, 1, *range(4, new_context_kv.dim() + 1))
        by_row.index_put_((self.slot_index[:count, None], rows), values)
        self.num_drafted[:count] += self.context_count[:count]

    def _verify(self, loops, per_slot: bool = True) -> None:
        """Every slot's tree in one target forward, each over its own cache; each slot's choices from its rows.
        per_slot: each slot's own budget (the nodes outside it add no expert); else one budget for all, every row
        verified."""
        count, rows = len(loops), loops[0].tree[0].shape[0]
        tokens, _, depths, masks = self.trees
        positions = (self.num_cached[:count, None] + depths).reshape(-1)
        routers = self.routers if per_slot else []  # each slot's nodes outside its step's budget add no expert
        with active_rows(routers, torch.cat([loop.active for loop in loops]) if routers else None):
            caches, lengths = self.latent[:count], self.num_cached[:count]
            logits, self.new_kv, self.taps = self.target(tokens.reshape(-1), positions, masks, caches, lengths,
                                                         self.logit_rows[: count * rows])  # fmt: skip
        self.choices = self._choose(loops, logits, rows)
        for b, loop in enumerate(loops):
            loop.choices = self.choices[b * rows : (b + 1) * rows]

    def _choose(self, loops, logits, rows: int) -> torch.Tensor:
        """The target's token at every slot's rows [count * rows]: one argmax for the greedy slots, each sampled
        slot's own draws (`DeviceLoop._choose`) over its rows."""
        sampled = [b for b, loop in enumerate(loops) if loop.sampled]
        if not sampled:
            return logits.argmax(dim=-1)
        every = len(sampled) == len(loops)
        choices = logits.new_empty(logits.shape[0], dtype=torch.long) if every else logits.argmax(dim=-1)
        for b in sampled:
            choices[b * rows : (b + 1) * rows] = loops[b]._choose(logits[b * rows : (b + 1) * rows])
        return choices

    def _accept(self, loops, budget: int | None = None, report: bool = True) -> None:
        """Every slot's walk and commit at once (`DeviceLoop._accept`, batched): the longest path of the target's
        choices, its rows into the slot's cache, its taps the next context, its end's choice the next bonus."""
        count, lead = len(loops), loops[0]
        tokens, parents, depths, masks = self.trees
        rows, steps = tokens.shape[1], lead.spec.draft_depth + 1
        choices = self.choices.view(count, rows) if self.oracle is None else torch.stack([x.choices for x in loops])
        path, length, next_bonus = accept_greedy_batched(tokens, parents, depths, masks, choices, steps - 1)
        flat = (self.slot_index[:count, None] * rows + path).reshape(-1)  # the path's rows in the forward's rows
        values = self.new_kv.index_select(1, flat).unflatten(1, (count, steps)).permute(1, 2, 0, 3)
        self._commit_latent(count, self.num_cached[:count, None] + lead.arange_path, values)
        self.context[:count, :steps].copy_(self.taps.index_select(0, flat).view(count, steps, -1))
        self.context_count[:count].copy_(length)
        self.num_cached[:count] += length
        emitted = torch.roll(tokens.gather(1, path), -1, dims=1).scatter_(1, (length - 1)[:, None], next_bonus[:, None])
        self.emitted[:count, :steps].copy_(emitted)
        self.emitted[:count, steps:].copy_(length[:, None])
        self.bonus[:count].copy_(next_bonus)
        if lead.auto and budget is not None and report:  # a batch-wide budget's step: every slot's at once
            self.stats[:count, 1 + len(lead.budgets) :].copy_(accepted_at_batched(self.rank, path, length,
                                                                                  lead.budget_values))  # fmt: skip
        for b, loop in enumerate(loops if lead.auto and budget is None else ()):  # each slot at its own budget
            loop.stats[1 + len(loop.budgets) :].copy_(accepted_at(loop.rank, path[b], length[b : b + 1],
                                                                  loop.budget_values))  # fmt: skip

    def _commit_latent(self, count: int, positions, values) -> None:
        """values [count, n, layers, D] into slot b's latent cache at positions [count, n]: one write for every slot."""
        by_row = self.latent[:count].transpose(1, 2)  # [count, S, layers, D], a view
        by_row.index_put_((self.slot_index[:count, None], positions), values)

    def _decode(self, loops, speculative: bool = False, width: int = 0, append: bool = False) -> None:
        """Every slot's bonus token in one target forward, each over its own cache; its KV committed, the next token
        chosen. speculative: an autoregressive step of speculative requests (`DECODE`: the batch policy's choice when
        no tree pays for its rows): each slot's pending context (its last step's accepted rows) first goes into its
        draft cache as a draft would commit it (`DFlashDrafter.context_kv`, every slot's rows in one call), and the
        new row's taps become the next context: the state a step that accepted only the bonus leaves, so the next
        step may draft or decode again. width: the pending rows a slot whose K/V are computed (default a block;
        `decode_form`): one where no slot's pending context holds more than one row (after a load or an
        autoregressive step that committed), as a context row's K/V depend on that row only (the trained pair on two
        CPU cores, 16 slots: a block's took 2.8 of a 25.3 ms step); `context_rows` where autoregressive steps
        appended more than a block.
        append: every slot's pending context has room for one more row (`lazy_context`): nothing is committed, the
        new row's taps join the pending rows, and the next draft (or the autoregressive step that finds a slot's
        pending context full, `context_rows`, or a tree step's `_flush`) commits them all."""
        count = len(loops)
        if speculative and not append:
            self._commit_pending(count, width or self.block)
        lengths = self.num_cached[:count]
        masks = loops[0].decode_mask.expand(count, 1, 1)
        logits, new_kv, taps = self.target(self.bonus[:count], lengths, masks, self.latent[:count], lengths,
                                           self.logit_rows[:count])  # fmt: skip
        if speculative and self.oracle is not None:  # benchmarks' oracle: the continuation's next token
            token = torch.cat([loop._oracle_tokens(loop.arange_block[:1] + 1) for loop in loops])
        else:
            token = self._choose(loops, logits, 1)
        self._commit_latent(count, lengths[:, None], new_kv.transpose(0, 1)[:, None])
        if speculative and append:  # each slot's row after its pending ones
            self.context[:count].index_put_((self.slot_index[:count], self.context_count[:count]), taps)
            self.context_count[:count] += 1
        elif speculative:
            self.context[:count, :1].copy_(taps[:, None])
            self.context_count[:count].fill_(1)
        self.num_cached[:count] += 1
        self.emitted[:count, :1].copy_(token[:, None])
        self.emitted[:count, -1:].fill_(1)
        self.bonus[:count].copy_(token)

    def prefill(self, slots: list[int], prompts: list[list[int]], rows: int, graph: bool = True) -> torch.Tensor:
        """Prompts into the free `slots`' caches in one target forward, each padded to `rows` (its last token
        repeated: rows past a prompt see it, it never sees them), causal within its own rows, over an empty cache
        (`models/mla.py`, `per_request`); every row's latent K/V and (speculative) the drafter's context K/V go into
        the slots' caches in one write each (rows past a prompt are past its length: no step reads them before a
        commit overwrites them). Returns each prompt's last row's logits [len(prompts), V]; the caller sets the
        slots' counts. graph: on GPUs replay the graph of (len(prompts), rows), captured on first use (the
        warm-up takes every form, `Generator._warm_group_prefills`); run eagerly, a forward of the trained pair is
        about a thousand launches (one H200: an admission of 8 prompts in one eager forward took 22.6 ms, where a
        lone prompt's prefill from its graph takes about 2.4 ms)."""
        count, device = len(prompts), self.device
        ids = torch.tensor([p + [p[-1]] * (rows - len(p)) for p in prompts], dtype=torch.long).reshape(-1)
        last = torch.tensor([b * rows + len(p) - 1 for b, p in enumerate(prompts)], dtype=torch.long)
        index = torch.tensor(slots, dtype=torch.long)[:, None]
        if not (graph and self.use_graph and self.prefill_pool is not None):
            return self._prefill_forward(ids.to(device), last.to(device), index.to(device), rows)
        key = (count, rows)
        entry = self.prefill_graphs.get(key)
        if entry is None:
            inputs = tuple(t.to(device) for t in (ids, last, index))
            gc.collect()  # nothing holding CUDA resources may be freed while the stream captures
            try:
                cuda_graph, logits = capture_graph(lambda: self._prefill_forward(*inputs, rows), device, 1,
                                                   self.prefill_pool)  # fmt: skip
            except RuntimeError as err:  # a form that cannot be captured: group prefills run eagerly from now on
                logging.getLogger(__name__).warning("group prefill graphs off, capturing %s: %s", key, err)
                self.prefill_pool = None
                return self._prefill_forward(*inputs, rows)
            entry = self.prefill_graphs[key] = (cuda_graph, inputs, logits)
            # the warm-up and the capture wrote this group's slots already; the replay below writes them again
        cuda_graph, inputs, logits = entry
        for buffer, value in zip(inputs, (ids, last, index)):
            buffer.copy_(value, non_blocking=True)
        cuda_graph.replay()
        return logits.clone()

    @torch.no_grad()
    def _prefill_forward(self, ids, last, index, rows: int) -> torch.Tensor:
        count, device = index.shape[0], self.device
        arange = torch.arange(rows, device=device)
        causal = torch.ones((rows, rows), dtype=torch.bool, device=device).tril().expand(count, rows, rows)
        positions = arange.repeat(count)
        # any `count` slots' caches serve: at length 0 no cache row is read
        logits, new_kv, taps = self.target(ids, positions, causal, self.latent[:count],
                                           torch.zeros(count, dtype=torch.long, device=device), last)  # fmt: skip
        values = new_kv.unflatten(1, (count, rows)).permute(1, 2, 0, 3)  # [count, rows, layers, D]
        self.latent.transpose(1, 2).index_put_((index, arange[None]), values)
        if not self.autoregressive:
            context = self.drafter.context_kv(taps, positions)  # [layers, 2, count * rows, heads, dim]
            values = context.unflatten(2, (count, rows)).permute(2, 3, 0, 1, *range(4, context.dim() + 1))
            self.draft.transpose(1, 3).transpose(2, 3).index_put_((index, arange[None]), values)
        return logits

    @contextmanager
    def state_kept(self, count: int):
        """Slots [0, count)'s step state (cached and drafted rows, context, bonus, draw counters) as it is now, put
        back after the block: steps run there (a graph's warm-up, a benchmark's replays) do not count as steps."""
        state = [self.num_cached, self.num_drafted, self.context_count, self.bonus, self.context,
                 *(loop.draws for loop in self.loops[:count])]  # fmt: skip
        saved = [t.clone() for t in state]
        try:
            yield
        finally:
            for tensor, before in zip(state, saved):
                tensor.copy_(before)

    def _capture(self, count: int, budget: int | None = None, report: bool = True, width: int = 0,
                 append: bool = False, run=None):  # fmt: skip
        """The graph of a step's form (`launch`), or of `run` where given (the flush before a tree step)."""
        run = run or (lambda: self._run(count, budget, report, width, append))
        with self.state_kept(count):  # the warm-up must not count as a step
            warm_up(run, self.device)
        gc.collect()  # nothing holding CUDA resources may be freed while the stream captures
        return capture_graph(run, self.device, warmups=0)[0]

    def _flush(self, count: int) -> None:
        """Every slot's pending context rows into its draft cache (`context_rows` of them computed, each slot's
        `context_count` kept), before a tree step whose draft takes a block of them at most: it then drafts from no
        new context rows, as the first step after a load does."""
        self._commit_pending(count, self.context_rows)
        self.context_count[:count].fill_(0)

    def _commit_pending(self, count: int, width: int) -> None:
        """The first `width` pending context rows of every slot: their K/V in one drafter call
        (`DFlashDrafter.context_kv`), written to the draft caches (`_commit_context`: each slot's `context_count`
        kept)."""
        self._commit_context(count, self.drafter.context_kv(*self._context(count, width)), width)

    def close(self) -> None:
        while self.in_flight:  # the steps in flight finish before their graphs and pinned slots go
            self.collect()
        for loop in self.loops:
            loop.close()
        self.graphs, self.prefill_graphs = {}, {}


@dataclass
class Admission:
    """A request to admit (`Batcher.admit_many`): what `Batcher.admit` takes."""

    prompt: list[int]
    max_new_tokens: int
    params: object = None  # SamplingParams; None: greedy
    end_ids: frozenset = frozenset()
    on_tokens: object = None
    stop_sequences: tuple = ()
    budget: int | str | None = None
    tag: object = None


@dataclass
class Member:
    """A request in the batch (rank 0's record of it)."""

    tag: object  # the caller's handle (the serving request id)
    slot: int
    prompt: list[int]
    max_new_tokens: int
    end_ids: set[int]
    stop_sequences: tuple[tuple[int, ...], ...]
    on_tokens: object
    budget: int | str | None
    result: GenerationResult
    timer: PhaseTimer = field(default_factory=PhaseTimer)
    started: float = field(default_factory=time.perf_counter)


@dataclass
class StepPlan:
    """A batched step as `Batcher` queues it (`RankWorker.batch_launch`'s arguments, and whether the batch's policy
    chose its budget)."""

    count: int
    budget: int | None
    report: bool
    batch_wide: bool
    choices: dict


@dataclass
class InFlight:
    """A queued step: its plan, the requests in its slots when it was queued, and when."""

    plan: StepPlan
    members: dict
    launched: float


# the most steps in a row that `Batcher.admit_now` puts admissions off (a waiting request's added latency)
ADMIT_WAIT_STEPS = 4


class Batcher:
    """Rank 0's in-flight batching over the ranks' slots (`RankWorker.enable_batching`): `admit` prefills a request
    into a free slot and emits its first token; `step` runs one batched step of every admitted request and returns
    the ones that finished. policy: `auto` requests' `BudgetPolicy` (shared: costs are per budget, not per
    request). group_admissions: under a backlog, put a freed slot's admission off while sharing it with the slots the
    next steps free pays (`admit_now`). Whether a step is queued before the one in flight is read (`_next_plan`):
    the ranks' `BatchLoop` settings (`run_ahead`, `run_ahead_auto`, `lazy_context`)."""

    def __init__(self, ranks, slots: int, autoregressive: bool = False, policy=None, batch_policy=None,
                 group_admissions: bool = False):  # fmt: skip
        self.ranks, self.slots, self.autoregressive, self.policy = ranks, slots, autoregressive, policy
        self.batch_policy = batch_policy  # `StepBudgetPolicy`: one budget a step while every request is `auto`
        self.group_admissions = group_admissions
        # what `admit_now` weighs, measured as the batch runs: admissions' seconds by the requests admitted together,
        # recent steps' seconds, and the steps each finished request was in
        self.admission_times: dict[int, deque] = {}
        self.step_times: deque = deque(maxlen=COST_WINDOW)
        self.stays: deque = deque(maxlen=COST_WINDOW)
        self.put_off = 0  # steps in a row that admissions were put off
        self.admitted: Counter = Counter()  # requests admitted together -> admissions (`admission_summary`)
        self.admitted_seconds: Counter = Counter()  # and their seconds
        self.members: dict[int, Member] = {}
        self.batch_sizes: Counter = Counter()  # requests a step served -> steps
        self.moves = 0  # requests moved into a lower free slot (`_compact`)
        # where given, the seconds of each step that captured no graph, by (slots stepped, budget, statistics
        # reported), budget None where each slot ran its own (`Generator.measure_batch_costs` reads them)
        self.timings: dict[tuple[int, int | None, bool], list[float]] | None = None
        # steps queued and not yet read (`step`): at most two, the second queued behind the first (`run_ahead`)
        self.in_flight: deque[InFlight] = deque()
        self._collected = 0.0  # when the last step's tokens were read
        self.finished: list[Member] = []  # requests an admission's read of a queued step finished (`admit_many`)

    @property
    def free(self) -> int:
        return self.slots - len(self.members)

    def admit_now(self, waiting: int) -> bool:
        """Whether to admit requests of the `waiting` ones into the free slots before the next step; else the batch
        steps first and they join with the slots that step frees, in one shared admission. Put off only with
        `group_admissions`, under a backlog (more requests waiting than free slots), at most `ADMIT_WAIT_STEPS` steps
        in a row, and while it pays by the batch's own measurements: the slots the next step is expected to free (busy
        slots over the steps a request stays) times the part of an admission's time that sharing saves
        (`shared_admission_seconds`) against what the free slots' idle step costs (their share of a step's time). On
        one H100 (BENCHMARKS.md, section 18) a lone admission took 1.0-1.3 ms and sixteen together 2 ms, where a
        16-slot step took 1.6 ms; on two CPU cores sixteen took as long as sixteen lone ones, so nothing is saved."""
        if not self.free or not waiting:
            return False
        if self._put_off(waiting):
            self.put_off += 1
            return False
        self.put_off = 0
        return True

    def _put_off(self, waiting: int) -> bool:
        if not self.group_admissions or not self.members or waiting <= self.free or self.put_off >= ADMIT_WAIT_STEPS:
            return False
        saved = self.shared_admission_seconds()
        if saved is None or not self.step_times or not self.stays:
            return False
        freed = len(self.members) / max(statistics.mean(self.stays), 1.0)
        return freed * saved > self.free / self.slots * statistics.median(self.step_times)

    def admission_summary(self) -> dict:
        """{requests admitted together: {"admissions": how many, "ms": their mean time}} (the batch waits for each)."""
        return {k: {"admissions": n, "ms": round(self.admitted_seconds[k] / n * 1e3, 3)}
                for k, n in sorted(self.admitted.items())}  # fmt: skip

    def shared_admission_seconds(self) -> float | None:
        """The part of an admission's time that does not grow with the requests admitted together (seconds = fixed +
        per request x requests, through the medians of the two group sizes admitted most often): what a request
        saves by joining another's admission. None until two sizes are timed."""
        sizes = sorted(self.admission_times, key=lambda k: len(self.admission_times[k]), reverse=True)[:2]
        if len(sizes) < 2:
            return None
        (k1, t1), (k2, t2) = sorted((k, statistics.median(self.admission_times[k])) for k in sizes)
        return max(t1 - (t2 - t1) / (k2 - k1) * k1, 0.0)

    def admit(self, prompt, max_new_tokens, params=None, end_ids=frozenset(), on_tokens=None, stop_sequences=(),
              budget=None, tag=None) -> Member:  # fmt: skip
        """Prefills the request into the lowest free slot and emits its first token; a request that one token ends
        is returned done (`member.result.elapsed` set) and holds no slot."""
        return self.admit_many([Admission(prompt, max_new_tokens, params, end_ids, on_tokens, stop_sequences, budget,
                                          tag)])[0]  # fmt: skip

    def admit_many(self, requests: list[Admission]) -> list[Member]:
        """Requests (at most `free`) into the lowest free slots, as `admit` each: one request's prefill on its own
        profile (a graph on GPUs), several in as few target forwards as fit (`RankWorker.batch_prefill_many`), every
        first token in one copy (greedy ones: one argmax); each request's prefill time is the admission's. Returns
        their members in order."""
        if not requests:
            return []
        while self.in_flight:  # a step queued ahead is read first (the prefill would wait for it on the GPU anyway):
            self.finished += self._collect()  # no slot changes hands under a step in flight; `step` returns these
        if len(requests) > self.free:
            raise ValueError(f"{len(requests)} requests to admit, but {self.free} of {self.slots} slots are free")
        slots = sorted(set(range(self.slots)) - set(self.members))[: len(requests)]
        members = [Member(r.tag, slot, list(r.prompt), r.max_new_tokens, set(r.end_ids), tuple(r.stop_sequences),
                          r.on_tokens, r.budget, GenerationResult(prompt=list(r.prompt), tokens=[]))
                   for r, slot in zip(requests, slots)]  # fmt: skip
        sampled = [r.params is not None and not r.params.greedy for r in requests]
        started = time.perf_counter()
        logits = self.ranks.call("batch_prefill_many", slots, [m.prompt for m in members])
        firsts = logits.argmax(dim=-1).tolist() if not all(sampled) else [None] * len(requests)
        for b, request in enumerate(requests):
            if sampled[b]:
                firsts[b] = first_token(logits[b : b + 1], request.params)[0]
        seconds = time.perf_counter() - started
        self.admission_times.setdefault(len(requests), deque(maxlen=COST_WINDOW)).append(seconds)
        self.admitted[len(requests)] += 1
        self.admitted_seconds[len(requests)] += seconds
        loads, admitted = [], []
        for member, first, request, draws in zip(members, firsts, requests, sampled):
            member.timer.seconds["prefill"] += seconds
            member.result.target_forwards = 1
            _, finished = self._emit(member, [first])
            if finished:
                admitted.append(self._finish(member))
                continue
            loads.append((member.slot, member.result.tokens[-1], len(member.prompt),
                          request.params if draws else None, member.budget))  # fmt: skip
            self.members[member.slot] = member
            admitted.append(member)
        if loads:
            self.ranks.call("batch_load_many", loads)
        return admitted

    def step(self) -> list[Member]:
        """One batched step of every admitted request; returns those it finished (their slots are free again).
        Where the batch allows it (`_next_plan`), the next step is queued before this one's tokens are read and
        is still in flight when this returns: the next call collects it."""
        done, self.finished = self.finished, []
        if self.in_flight and not self._unchanged():  # requests left since it was queued
            done += self._collect()
        if not self.members:
            return done
        if not self.in_flight:
            self._compact()  # the requests in slots [0, count)
            self._launch(self._plan())
        ahead = self._next_plan()
        if ahead is not None:
            self._launch(ahead)
        done += self._collect()
        if self.in_flight and not self.members:  # none of its requests is left: its tokens are no one's
            self._collect()
        return done

    def _plan(self) -> StepPlan:
        """The next step's slots, budget, statistics and slot choices, as the batch stands."""
        count = len(self.members)
        batch_wide = self.batch_policy is not None and all(m.budget == "auto" for m in self.members.values())
        budget = self.batch_policy.choose(len(self.members), count) if batch_wide else None
        fixed = {m.budget for m in self.members.values()}
        if self.batch_policy is not None and len(fixed) == 1 and isinstance(next(iter(fixed)), int):
            # an engine of several budgets, every request at one fixed budget: the batch-wide graph of that budget,
            # whose verify has its rows only; the per-slot form verifies the largest budget's rows (padding outside
            # each slot's budget), which cost a batch of 16 budget-8 requests as much as budget 32 (one H200)
            budget = next(iter(fixed))
        auto = [s for s, m in self.members.items() if m.budget == "auto" and self.policy is not None]
        choices = {} if batch_wide else {s: self.policy.device_inputs() for s in auto}
        # statistics only where a policy learns from them: an all-`auto` batch's steps that its policy asks them of
        # (`StepBudgetPolicy.reports`), or each `auto` slot's own
        report = budget is None or (batch_wide and self.batch_policy.reports(budget))
        return StepPlan(count, budget, report, batch_wide, choices)

    def _launch(self, plan: StepPlan) -> None:
        self.batch_sizes[plan.count] += 1
        launched = time.perf_counter()
        self.ranks.call("batch_launch", plan.count, plan.choices, plan.budget, plan.report)
        self.in_flight.append(InFlight(plan, dict(self.members), launched))

    def _unchanged(self) -> bool:
        """Whether the batch's requests are those of the oldest step in flight, in the same slots."""
        members = self.in_flight[0].members
        return len(members) == len(self.members) and all(self.members.get(s) is m for s, m in members.items())

    def _next_plan(self) -> StepPlan | None:
        """The step to queue before reading the tokens of the one in flight, or None: where `run_ahead` is on, the
        batch is the one that step has, every request goes on after it (no request's token count can reach its limit
        in it; an end token or stop sequence may still end one, whose slot then computes one step for no one), and
        the next step's plan does not depend on its tokens: the same plan at a fixed budget or for autoregressive
        decoding; an all-`auto` batch's policy choosing one step behind (`run_ahead_auto`: its choice made before the
        statistics of the step in flight are recorded; with `lazy_context`, an autoregressive step behind a tree
        step commits the pending rows, `BatchLoop.decode_form`); no slot's own `auto` choice."""
        lead = self.ranks.lead
        if not lead.batch.run_ahead or len(self.in_flight) != 1 or not self._unchanged():
            return None
        most = 1 if self.autoregressive else lead.spec.draft_depth + 1  # the tokens a step emits at most
        if any(len(m.result.tokens) + most >= m.max_new_tokens for m in self.members.values()):
            return None
        plan = self.in_flight[0].plan
        if plan.choices:
            return None
        if not plan.batch_wide:
            return plan
        if not lead.batch.run_ahead_auto:
            return None
        return self._plan()

    def _collect(self) -> list[Member]:
        """Reads the oldest step in flight and hands its tokens to its requests still in the batch (one that left
        since, or whose slot another took, gets none); returns those it finished."""
        step = self.in_flight.popleft()
        plan = step.plan
        emitted, stats, captured = self.ranks.call("batch_collect")
        now = time.perf_counter()
        # a step's time: from its launch, or from the previous step's tokens where it was queued behind that one
        # (the GPU ran them back to back)
        seconds = now - max(step.launched, self._collected)
        self._collected = now
        if self.timings is not None and not captured:
            self.timings.setdefault((plan.count, plan.budget, plan.report), []).append(seconds)
        if not captured:
            self.step_times.append(seconds)
        members = {s: m for s, m in step.members.items() if self.members.get(s) is m}
        if plan.batch_wide:
            # a step that captured its graph tells nothing of its cost (its statistics still count); one that reported
            # statistics costs more than a settled step at its budget, so its time counts only while the pair has no
            # other (one H200, 16 requests: budget 16's median at 16 slots, from such steps only, was 1.17x budget
            # 8's, where a job all at budget 16 took 1.07x a job at 8's time a step)
            no_cost = captured or (plan.report and self.batch_policy.timed(plan.budget, plan.count))
            self.batch_policy.record(plan.count, plan.budget, None if no_cost else seconds,
                                     [stats[s] for s in members if stats.get(s)])  # fmt: skip
            if not plan.report and plan.budget != DECODE:  # its budget's acceptance: each request's tokens, less one
                self.batch_policy.observe(plan.budget, [len(emitted[s]) - 1 for s in members])
        done = []
        for slot, member in members.items():
            tokens = emitted[slot]
            member.result.target_forwards += 1
            member.result.accept_lengths.append(len(tokens))
            member.timer.seconds["device_step"] += seconds
            if plan.batch_wide:
                member.result.budgets.append(plan.budget)
            elif stats.get(slot):
                member.result.budgets.append(stats[slot]["budget"])
                if member.budget == "auto" and self.policy is not None:
                    # no time: the batch verified the widest rows whatever this slot's budget, so its time is no
                    # cost of that budget (the slot's costs stay the single request's, `Generator.measure_budgets`)
                    self.policy.observe(stats[slot], len(tokens))
            _, finished = self._emit(member, tokens)
            if finished:
                self.stays.append(member.result.target_forwards - 1)  # its steps (the first forward: its admission)
                done.append(self._finish(self.members.pop(slot)))
        return done

    def _compact(self) -> None:
        """Before a step, requests in the highest slots move down into free slots below them, so a step covers only
        its requests' slots, [0, requests) (a batch's step costs its slot count: 16 requests leaving one by one kept
        16-slot steps to the end). Before the step, not after the last: the admissions in between take the lowest
        free slots first, so under a backlog a freed slot is refilled, not its request's successor moved into it and
        the newcomer admitted at the top (one H100, 64 requests through 16 slots: 60 moves a DDTree 8 job, 13 ms of
        the GPU's time and 6 ms of its idle time in a 330 ms job; BENCHMARKS.md, section 18)."""
        while self.members:
            high = max(self.members)
            free = [s for s in range(high) if s not in self.members]
            if not free:
                return
            member = self.members.pop(high)
            self.ranks.call("batch_move", high, free[0], len(member.result.tokens))
            member.slot = free[0]
            self.members[free[0]] = member
            self.moves += 1

    def remove(self, member: Member) -> None:
        """Drops a request from the batch (cancelled): its slot is free from the next step."""
        self.members.pop(member.slot, None)

    def _emit(self, member: Member, tokens: list[int]) -> tuple[list[int], bool]:
        return _emit(member.result.tokens, tokens, member.max_new_tokens, member.end_ids, member.stop_sequences,
                     member.on_tokens)  # fmt: skip

    @staticmethod
    def _finish(member: Member) -> Member:
        member.result.seconds = dict(member.timer.seconds)
        member.result.elapsed = time.perf_counter() - member.started
        return member
