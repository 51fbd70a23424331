"""The whole greedy speculative step on the device, one CUDA graph a step (torch backend, one process).

The host loop (`speculate.speculative_step`) goes to the host twice a step: for the draft's top-k, to build the
tree in Python, and for the target's argmax, to walk it. Here the step is fixed-shape tensor work end to end:
draft -> top-k -> `build_tree_device` -> verify -> argmax -> `accept_greedy_device` -> commit of the accepted rows
into the caches -> next step's context and bonus, with the sequence state (cached rows, drafted rows, context rows,
bonus token) in device scalars. The host replays the graph and reads back one small tensor (the emitted tokens and
their count) per step. Greedy only: sampling uses the host loop.

Rows past the accepted path are written too (into cache rows past the new length, which no step reads before they
are overwritten): fixed shapes, no data-dependent slicing. The caller keeps `block_size` rows of cache spare.
"""

from __future__ import annotations

import time

import torch

from engines.spec import SpecConfig
from runner.device_tree import accept_greedy_device, build_tree_device
from runner.speculate import GenerationResult, PhaseTimer, _emit, speculative_step


class DeviceLoop:
    def __init__(self, worker, spec: SpecConfig, use_graph: bool = True, oracle: torch.Tensor | None = None):
        """worker: a one-rank `RankWorker` on the torch backend (its modules and caches are used in place).
        oracle: optional [N] device tensor, the known continuation (benchmarks): drafts and target choices follow it.
        """
        self.worker, self.spec = worker, spec
        self.target = worker.session.modules["target"]
        self.drafter = worker.session.modules["draft"]
        self.cache = worker.cache
        device = self.device = self.cache.latent.device
        block, depth = spec.block_size, spec.draft_depth
        self.rows = spec.verify_tokens
        self.width = spec.tree_width(self.target.config.vocab_size)
        long = {"dtype": torch.long, "device": device}
        self.num_cached = torch.zeros(1, **long)
        self.num_drafted = torch.zeros(1, **long)
        self.context_count = torch.zeros(1, **long)
        self.bonus = torch.zeros(1, **long)
        self.context = torch.zeros(block, self.cache_taps_width(), dtype=self.cache.latent.dtype, device=device)
        self.masks = torch.full((block - 1,), worker.mask_token_id, **long)
        self.arange_block = torch.arange(block, device=device)
        self.arange_rows = torch.arange(self.rows, device=device)
        self.arange_path = torch.arange(depth + 1, device=device)
        self.emitted = torch.zeros(depth + 2, **long)  # tokens (depth + 1 at most), then the count
        self.oracle, self.prompt_length = oracle, torch.zeros(1, **long)
        self.use_graph, self.graph = use_graph, None
        self.events: list | None = None  # set to [] to time each replay (GPU idle between steps)

    def cache_taps_width(self) -> int:
        return self.drafter.fc.weight.shape[1]

    def load(self, bonus: int, prompt_length: int) -> None:
        """Takes over a sequence the host loop has stepped at least once (its context fits one block)."""
        taps, start = self.cache.take_context()
        count = taps.shape[0]
        if count > self.spec.block_size:
            raise ValueError(f"the device loop needs <= {self.spec.block_size} context rows, got {count}")
        self.context.zero_()
        self.context[:count] = taps
        self.num_cached.fill_(self.cache.num_cached)
        self.num_drafted.fill_(self.cache.num_drafted)
        self.context_count.fill_(count)
        self.bonus.fill_(bonus)
        self.prompt_length.fill_(prompt_length)

    @torch.no_grad()
    def _step(self) -> None:
        spec, depth = self.spec, self.spec.draft_depth
        # Draft: [bonus, mask x (block - 1)] attending to the cached and the new context rows.
        block_ids = torch.cat((self.bonus, self.masks))
        positions = self.num_cached + self.arange_block
        context_positions = self.num_cached - self.context_count + self.arange_block
        draft_logits, new_context_kv = self.drafter(self.context, context_positions, self.context_count, block_ids,
                                                    positions, self.cache.draft, self.num_drafted)  # fmt: skip
        self.cache.draft.index_copy_(2, self.num_drafted + self.arange_block, new_context_kv)
        self.num_drafted += self.context_count
        if self.oracle is not None:  # benchmarks: a drafter that knows the continuation
            ahead = self._oracle_tokens(self.arange_block[:depth] + 1)
            draft_logits = torch.zeros_like(draft_logits).scatter_(1, ahead[:, None], 30.0)
        # Tree: best-first under the budget, on the device.
        top = torch.log_softmax(draft_logits.float(), dim=-1).topk(self.width, dim=-1)
        tokens, parents, depths, mask, count = build_tree_device(top.values, top.indices, spec.budget, self.bonus,
                                                                 self.rows)  # fmt: skip
        # Verify: every node at position start + depth, one target forward; the target's greedy choice per node.
        logits, new_kv, taps = self.target(tokens, self.num_cached + depths, mask, self.cache.latent, self.num_cached,
                                           self.arange_rows)  # fmt: skip
        choices = logits.argmax(dim=-1) if self.oracle is None else self._oracle_tokens(depths + 1)
        # Accept the longest path whose every step is the target's own choice; its end's choice is the next bonus.
        path, length, next_bonus = accept_greedy_device(tokens, parents, self.arange_rows < count, choices, depth)
        # Commit the path's rows (and, harmlessly, rows past it); they become the drafter's next context.
        self.cache.latent.index_copy_(1, self.num_cached + self.arange_path, new_kv.index_select(1, path))
        self.context.copy_(taps.index_select(0, path))
        self.context_count.copy_(length)
        self.num_cached += length
        emitted = torch.roll(tokens.index_select(0, path), -1).scatter_(0, length - 1, next_bonus)
        self.emitted[: depth + 1].copy_(emitted)
        self.emitted[depth + 1 :].copy_(length)
        self.bonus.copy_(next_bonus)

    def _oracle_tokens(self, ahead: torch.Tensor) -> torch.Tensor:
        index = (self.num_cached - self.prompt_length + ahead).clamp(0, self.oracle.shape[0] - 1)
        return self.oracle[index]

    def step(self) -> list[int]:
        """One speculative step; returns the tokens it emits (accepted drafts, then the new bonus)."""
        if not self.use_graph:
            self._step()
        else:
            if self.graph is None:
                self._capture()
            if self.events is None:
                self.graph.replay()
            else:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                self.graph.replay()
                end.record()
                self.events.append((start, end))
        values = self.emitted.tolist()  # the one device -> host transfer of a step
        count = values[-1]
        self.cache.num_cached += count  # the host's mirror, for the capacity check
        return values[:count]

    def _capture(self) -> None:
        state = (self.num_cached, self.num_drafted, self.context_count, self.bonus, self.context)
        saved = [t.clone() for t in state]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            self._step()  # warm-up: compiles and allocates outside the graph
        torch.cuda.current_stream(self.device).wait_stream(side)
        for tensor, before in zip(state, saved):
            tensor.copy_(before)  # the warm-up must not count as a step
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()


def generate_on_device(engine, spec: SpecConfig, prompt: list[int], max_new_tokens: int, capacity: int,
                       end_ids: set[int] = frozenset(), on_tokens=None) -> GenerationResult:  # fmt: skip
    """Greedy speculative generation: prefill and the first step on the host loop (the prompt's context may exceed
    a block), then device steps. Every rank's worker must have called `enable_device_loop`."""
    from runner.sampling import Sampler, SamplingParams

    timer, start = PhaseTimer(), time.perf_counter()
    result = GenerationResult(prompt=list(prompt), tokens=[])
    greedy = Sampler(SamplingParams())
    engine.reset()
    with timer("prefill"):
        first = greedy.choose(engine.prefill(list(prompt)))
    result.target_forwards = 1
    _, finished = _emit(result.tokens, first, max_new_tokens, end_ids, on_tokens=on_tokens)
    if not finished:
        step = speculative_step(engine, spec, greedy, result.tokens[-1], timer)
        result.target_forwards += 1
        result.accept_lengths.append(step.accept_length)
        _, finished = _emit(result.tokens, step.tokens, max_new_tokens, end_ids, on_tokens=on_tokens)
    if not finished:
        engine.device_load(result.tokens[-1], len(prompt))
    while not finished:
        if len(prompt) + len(result.tokens) + 2 * spec.block_size > capacity:
            raise ValueError(f"the sequence reached the cache capacity ({capacity} rows)")
        with timer("device_step"):
            step_tokens = engine.device_step()
        result.target_forwards += 1
        result.accept_lengths.append(len(step_tokens))
        _, finished = _emit(result.tokens, step_tokens, max_new_tokens, end_ids, on_tokens=on_tokens)
    result.seconds, result.elapsed = dict(timer.seconds), time.perf_counter() - start
    return result
