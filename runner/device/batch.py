"""Batched steps on the device loop: several requests in one step (in-flight batching).

Each request holds a *slot*: its own caches and its own `DeviceLoop` state (cached rows, bonus token, sampling
settings and draw counter, tree budget), so requests at different lengths, with different trees, budgets and seeds
share a step. One step over the first `n` slots runs **one drafter forward for every slot's block** and **one target
forward for every slot's tree** (their rows side by side, each attending to its own caches: `models/mla.py`,
`per_request`, and `models/dflash.py`), so each model's weights are read once for the whole batch; between them
every slot's tree, after them every slot's walk and commit. On GPUs the step is one CUDA graph per slot count and
per slot modes (greedy or sampled, filter kind).

A request joins at the next step after its own prefill (which runs on the host loop's prefill profile into its
slot's caches) and leaves when it is done; slots past the last busy one are not stepped; a free slot below it is
stepped on reset state (its rows are discarded) and is the next request's. `Batcher` (rank 0) schedules: it admits,
steps, emits tokens to each request's callback and reports finished requests.
"""

from __future__ import annotations

import gc
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from models.moe import active_rows
from runner.device.budget import DECODE
from runner.device.loop import DeviceLoop, first_token
from runner.kv_cache import SequenceCache
from runner.probes import Probes
from runner.sessions.cuda_graphs import capture_graph, warm_up
from runner.speculate import GenerationResult, PhaseTimer, _emit


class _Slot:
    """What a `DeviceLoop` reads of its worker, for one slot: the rank's session, the slot's own caches."""

    def __init__(self, worker, cache: SequenceCache):
        self.session, self.mask_token_id, self.device = worker.session, worker.mask_token_id, worker.device
        self.cache, self.context_rows = cache, 0


class BatchLoop:
    """One rank's slots and its batched step (the worker's `batch_*` calls)."""

    def __init__(self, worker, spec, slots: int, use_graph: bool, autoregressive: bool = False):
        main = worker.cache
        # benchmarks' oracle (`runner/probes.py`), as the rank's own loop has it: every slot follows the continuation
        self.oracle = worker.loop.oracle if worker.loop is not None else None
        probes = Probes(oracle=self.oracle)
        self.loops = []
        for _ in range(slots):
            cache = SequenceCache(main.latent.shape, main.draft.shape, main.latent.dtype, main.latent.device)
            self.loops.append(DeviceLoop(_Slot(worker, cache), spec, use_graph, autoregressive, probes))
        lead = self.loops[0]
        self.target, self.drafter, self.autoregressive, self.rows = lead.target, lead.drafter, autoregressive, lead.rows
        self.block = spec.block_size
        self.routers = lead.routers if lead.auto else []
        self.logit_rows = torch.arange(slots * self.rows, device=main.latent.device)
        self.use_graph, self.graphs = use_graph, {}
        self.captured = False  # whether the last step captured its graph
        self.device = main.latent.device

    def release(self, slot: int) -> None:
        """A free slot below a busy one is stepped too: its state goes back to an empty sequence before each step,
        so its discarded steps never run past the cache."""
        loop = self.loops[slot]
        for state in (loop.num_cached, loop.num_drafted, loop.context_count):
            state.fill_(0)
        loop.cache.reset()

    def step(self, count: int, idle: tuple[int, ...] = (), budget: int | None = None) -> list[list[int]]:
        """One step of slots [0, count); returns each slot's emitted tokens (an idle slot's are to be dropped).
        budget: one tree budget for every slot this step (`StepBudgetPolicy`: the verify then has that budget's
        rows for each request; at the largest budget each slot's statistics tell every smaller budget); None: each
        slot's own (its request's budget, or `auto` chosen in the slot from its tree)."""
        for slot in idle:
            self.release(slot)
        loops = self.loops[:count]
        for loop in loops if loops[0].auto else ():
            largest = len(loop.budgets) - 1
            loop.choice_inputs[-1:].fill_(largest if budget is not None else loop.request_index)
        if not self.use_graph:
            self._run(count, budget)
        else:
            key = (count, tuple((loop.sampled, loop.filter) for loop in loops), budget)
            self.captured = key not in self.graphs  # this step's time includes the capture: no cost of the step
            if self.captured:
                self.graphs[key] = self._capture(count, budget)
            self.graphs[key].replay()
        emitted = torch.stack([loop.emitted for loop in loops]).tolist()  # the one device -> host copy of a step
        for loop in loops if loops[0].auto else ():
            # the statistics of a step on the largest tree (or on each slot's own budget); none of a narrower
            # batch-wide one (decided from `budget`: a replayed graph does not set the Python attributes)
            informs = budget is None or budget == loop.tree_spec.budget
            loop.last_stats = loop.read_stats(loop.stats.tolist()) if informs else None
        return [values[: values[-1]] for values in emitted]

    def _run(self, count: int, budget: int | None = None) -> None:
        loops = self.loops[:count]
        if self.autoregressive:
            return self._decode(loops)
        if budget == DECODE:
            return self._decode(loops, speculative=True)
        self._draft(loops)
        for loop in loops:
            if self.oracle is not None:
                loop._oracle_draft()
            loop._tree(budget)
        self._verify(loops, per_slot=budget is None)
        for loop in loops if self.oracle is not None else ():
            loop._oracle_choices()
        for loop in loops:
            loop._accept()

    def _draft(self, loops) -> None:
        """Every slot's block in one drafter forward, each over its own draft cache (`DeviceLoop._draft`, batched)."""
        lead, block = loops[0], self.block
        ids = torch.cat([torch.cat((loop.bonus, loop.masks)) for loop in loops])
        positions = torch.cat([loop.num_cached + lead.arange_block for loop in loops])
        context, context_positions = self._context(loops)
        counts = torch.cat([loop.context_count for loop in loops])
        caches = tuple(loop.cache.draft for loop in loops)
        drafted = torch.cat([loop.num_drafted for loop in loops])
        logits, new_context_kv = self.drafter(context, context_positions, counts, ids, positions, caches, drafted)
        self._commit_context(loops, new_context_kv)
        for b, loop in enumerate(loops):
            loop.draft_logits = logits[b * (block - 1) : (b + 1) * (block - 1)]

    def _context(self, loops) -> tuple[torch.Tensor, torch.Tensor]:
        """Every slot's pending context rows (a block each, `context_count` of them valid) and their positions."""
        arange = loops[0].arange_block
        context = torch.cat([loop.context for loop in loops])
        return context, torch.cat([loop.num_cached - loop.context_count + arange for loop in loops])

    def _commit_context(self, loops, new_context_kv) -> None:
        """Each slot's context K/V rows into its draft cache (a block written, its `context_count` rows kept)."""
        arange, block = loops[0].arange_block, self.block
        for b, loop in enumerate(loops):
            loop.cache.draft.index_copy_(
                2, loop.num_drafted + arange, new_context_kv[:, :, b * block : (b + 1) * block]
            )
            loop.num_drafted += loop.context_count

    def _verify(self, loops, per_slot: bool = True) -> None:
        """Every slot's tree in one target forward, each over its own cache; each slot's choices from its rows.
        per_slot: each slot's own budget (the nodes outside it add no expert); else one budget for all, every row
        verified."""
        rows = loops[0].tree[0].shape[0]
        trees = [loop.tree for loop in loops]
        tokens = torch.cat([tree[0] for tree in trees])
        positions = torch.cat([loop.num_cached + tree[2] for loop, tree in zip(loops, trees)])
        masks = torch.stack([tree[3] for tree in trees])
        lengths = torch.cat([loop.num_cached for loop in loops])
        caches = tuple(loop.cache.latent for loop in loops)
        routers = self.routers if per_slot else []  # each slot's nodes outside its step's budget add no expert
        with active_rows(routers, torch.cat([loop.active for loop in loops]) if routers else None):
            logits, new_kv, taps = self.target(tokens, positions, masks, caches, lengths,
                                               self.logit_rows[: len(loops) * rows])  # fmt: skip
        for b, loop in enumerate(loops):
            loop.new_kv, loop.taps = new_kv[:, b * rows : (b + 1) * rows], taps[b * rows : (b + 1) * rows]
            loop.choices = loop._choose(logits[b * rows : (b + 1) * rows])

    def _decode(self, loops, speculative: bool = False) -> None:
        """Every slot's bonus token in one target forward, each over its own cache; its KV committed, the next token
        chosen. speculative: an autoregressive step of speculative requests (`DECODE`: the batch policy's choice when
        no tree pays for its rows): each slot's pending context (its last step's accepted rows) first goes into its
        draft cache as a draft would commit it (`DFlashDrafter.context_kv`, every slot's rows in one call), and the
        new row's taps become the next context: the state a step that accepted only the bonus leaves, so the next
        step may draft or decode again."""
        count = len(loops)
        if speculative:
            self._commit_context(loops, self.drafter.context_kv(*self._context(loops)))
        tokens = torch.cat([loop.bonus for loop in loops])
        lengths = torch.cat([loop.num_cached for loop in loops])
        masks = loops[0].decode_mask.expand(count, 1, 1)
        caches = tuple(loop.cache.latent for loop in loops)
        logits, new_kv, taps = self.target(tokens, lengths, masks, caches, lengths, self.logit_rows[:count])
        for b, loop in enumerate(loops):
            if speculative and self.oracle is not None:  # benchmarks' oracle: the continuation's next token
                token = loop._oracle_tokens(loop.arange_block[:1] + 1)
            else:
                token = loop._choose(logits[b : b + 1])
            loop.cache.latent.index_copy_(1, loop.num_cached, new_kv[:, b : b + 1])
            if speculative:
                loop.context[:1].copy_(taps[b : b + 1])
                loop.context_count.fill_(1)
            loop.num_cached += 1
            loop.emitted[:1].copy_(token)
            loop.emitted[-1:].fill_(1)
            loop.bonus.copy_(token)

    def _capture(self, count: int, budget: int | None = None):
        state = [t for loop in self.loops[:count] for t in (loop.num_cached, loop.num_drafted, loop.context_count,
                                                            loop.bonus, loop.context, loop.draws)]  # fmt: skip
        saved = [t.clone() for t in state]
        warm_up(lambda: self._run(count, budget), self.device)
        for tensor, before in zip(state, saved):
            tensor.copy_(before)  # the warm-up must not count as a step
        gc.collect()  # nothing holding CUDA resources may be freed while the stream captures
        return capture_graph(lambda: self._run(count, budget), self.device, warmups=0)[0]

    def close(self) -> None:
        for loop in self.loops:
            loop.close()
        self.graphs = {}


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


class Batcher:
    """Rank 0's in-flight batching over the ranks' slots (`RankWorker.enable_batching`): `admit` prefills a request
    into a free slot and emits its first token; `step` runs one batched step of every admitted request and returns
    the ones that finished. policy: `auto` requests' `BudgetPolicy` (shared: costs are per budget, not per
    request)."""

    def __init__(self, ranks, slots: int, autoregressive: bool = False, policy=None, batch_policy=None):
        self.ranks, self.slots, self.autoregressive, self.policy = ranks, slots, autoregressive, policy
        self.batch_policy = batch_policy  # `StepBudgetPolicy`: one budget a step while every request is `auto`
        self.members: dict[int, Member] = {}
        self.batch_sizes: Counter = Counter()  # requests a step served -> steps

    @property
    def free(self) -> int:
        return self.slots - len(self.members)

    def admit(self, prompt, max_new_tokens, params=None, end_ids=frozenset(), on_tokens=None, stop_sequences=(),
              budget=None, tag=None) -> Member:  # fmt: skip
        """Prefills the request into the lowest free slot and emits its first token; a request that one token ends
        is returned done (`member.result.elapsed` set) and holds no slot."""
        slot = min(set(range(self.slots)) - set(self.members))
        member = Member(tag, slot, list(prompt), max_new_tokens, set(end_ids), tuple(stop_sequences), on_tokens, budget,
                        GenerationResult(prompt=list(prompt), tokens=[]))  # fmt: skip
        sampled = params is not None and not params.greedy
        with member.timer("prefill"):
            logits = self.ranks.call("batch_prefill", slot, list(prompt))
            first = first_token(logits, params if sampled else None)
        member.result.target_forwards = 1
        _, finished = self._emit(member, first)
        if finished:
            return self._finish(member)
        self.ranks.call("batch_load", slot, member.result.tokens[-1], len(prompt), params if sampled else None,
                        budget)  # fmt: skip
        self.members[slot] = member
        return member

    def step(self) -> list[Member]:
        """One batched step of every admitted request; returns those it finished (their slots are free again)."""
        if not self.members:
            return []
        count = max(self.members) + 1
        self.batch_sizes[len(self.members)] += 1
        idle = tuple(s for s in range(count) if s not in self.members)
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
        started = time.perf_counter()
        emitted, stats, captured = self.ranks.call("batch_step", count, idle, choices, budget)
        seconds = time.perf_counter() - started
        if batch_wide:  # a step that captured its graph tells nothing of its cost (its statistics still count)
            self.batch_policy.record(count, budget, None if captured else seconds,
                                     [stats[s] for s in self.members if stats.get(s)])  # fmt: skip
        done = []
        for slot, member in list(self.members.items()):
            tokens = emitted[slot]
            member.result.target_forwards += 1
            member.result.accept_lengths.append(len(tokens))
            member.timer.seconds["device_step"] += seconds
            if batch_wide:
                member.result.budgets.append(budget)
            elif stats.get(slot):
                member.result.budgets.append(stats[slot]["budget"])
                if member.budget == "auto" and self.policy is not None:
                    # no time: the batch verified the widest rows whatever this slot's budget, so its time is no
                    # cost of that budget (the slot's costs stay the single request's, `Generator.measure_budgets`)
                    self.policy.observe(stats[slot], len(tokens))
            _, finished = self._emit(member, tokens)
            if finished:
                done.append(self._finish(self.members.pop(slot)))
        return done

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
