"""What one rank does for each step: build the feeds, run its engine session, commit into its own caches.

Every rank runs the same calls in the same order (the engines' collectives pair them up); only rank 0's return
values are used. Logits stay on the session's device; rank 0 reduces them (argmax, top-k) before moving them.
"""

from __future__ import annotations

import numpy as np
import torch

from engines.spec import SpecConfig
from runner.kv_cache import SequenceCache
from runner.sessions.base import EngineSession


class RankWorker:
    def __init__(
        self,
        session: EngineSession,
        spec: SpecConfig,
        target_cfg,
        drafter_cfg,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ):
        self.session, self.spec, self.device = session, spec, torch.device(device)
        # the verify profile of each row count the engine has (the rank factory checked the spec's budgets fit them):
        # a step's tree picks its own, so a budget chosen per step runs on its profile
        self.verify_profiles = {p.fixed("tokens"): n for n, p in session.profiles.items() if n.startswith("verify_")}
        self.mask_token_id = drafter_cfg.mask_token_id
        latent = (target_cfg.num_hidden_layers, capacity, target_cfg.latent_dim)
        draft = (drafter_cfg.num_hidden_layers, 2, capacity, drafter_cfg.kv_heads_per_rank, drafter_cfg.head_dim)
        self.cache = SequenceCache(latent, draft, dtype, self.device)
        self._pending: dict[str, torch.Tensor] = {}
        self.loop = None  # `enable_device_loop`
        self.batch = None  # `enable_batching`: slots of requests stepped together
        self.context_rows = 0  # benchmarks' synthetic context (`runner/probes.py`), set with the device loop's probes
        self.prefill_chunk = 0  # tokens a prefill forward takes at most (0: the whole prompt); the factory sets it
        self.description = session.backend  # what the rank runs, in words (set by the rank factory)

    def _tensor(self, values, dtype=torch.int64) -> torch.Tensor:
        """Small step inputs stay on the host: a session copies each one once into its own (device) buffer."""
        return torch.as_tensor(np.asarray(values), dtype=dtype)

    def _target(self, profile: str, tokens, positions, mask, logit_rows) -> dict[str, torch.Tensor]:
        return self.session.run(
            profile,
            {
                "input_ids": self._tensor(tokens),
                "positions": self._tensor(positions),
                "tree_mask": self._tensor(mask, torch.bool),
                "latent_cache": self.cache.latent,
                "cache_length": self._tensor([self.cache.num_cached]),
                "logit_indices": self._tensor(logit_rows),
            },
        )

    def reset(self) -> None:
        if self.loop is not None:
            self.loop.discard()  # steps still in flight (a request that failed mid-way) must not write later
        self.cache.reset()
        self._pending = {}
        # benchmarks' synthetic context (`runner/probes.py`): its rows, written once, count as cached
        self.cache.num_cached = self.cache.num_drafted = self.context_rows

    def _write_synthetic_context(self, rows: int) -> None:
        """Rows [0, rows) of both caches get seeded random K/V; requests write only past them."""
        cache = self.cache
        if rows + 1 > cache.capacity:
            raise ValueError(f"a synthetic context of {rows} rows needs a larger cache than {cache.capacity} rows")
        gen = torch.Generator(device=self.device).manual_seed(1234)
        for layer in range(cache.latent.shape[0]):  # a layer at a time: no float32 copy of the whole cache
            values = torch.randn((rows, cache.latent.shape[2]), generator=gen, device=self.device)
            cache.latent[layer, :rows] = values.to(cache.latent.dtype)
        for layer in range(cache.draft.shape[0]):
            values = torch.randn((2, rows, *cache.draft.shape[3:]), generator=gen, device=self.device)
            cache.draft[layer, :, :rows] = values.to(cache.draft.dtype)

    def prefill(self, prompt: list[int]) -> torch.Tensor:
        """Runs the prompt, commits all of it; returns the last row's logits [1, V]. A prompt longer than
        `prefill_chunk` runs in chunks: each is committed before the next, which attends to it through the cache
        (causal within itself), so a forward's T x T mask and attention buffers stay at most chunk x chunk."""
        chunk = self.prefill_chunk or len(prompt)
        for begin in range(0, len(prompt), chunk):
            piece = prompt[begin : begin + chunk]
            count, start = len(piece), self.cache.num_cached
            rows = self._prefill_rows(count, start)
            if rows > count:  # padded to a captured length: rows past the prompt's see it, it never sees them
                piece = piece + [piece[-1]] * (rows - count)
            causal = np.tril(np.ones((rows, rows), dtype=bool))
            out = self._target("prefill", piece, np.arange(start, start + rows), causal, [count - 1])
            taps = out["taps"][:count] if rows > count else out["taps"]
            self.cache.commit_target(out["new_latent_kv"][:, :count], taps, rows=None)
        return out["logits"]

    def _prefill_rows(self, count: int, start: int) -> int:
        """The rows a prefill of `count` tokens runs: the session's next `prefill_buckets` length (a CUDA graph each
        on GPUs, `CudaGraphSession`) while its rows fit in the cache, else `count`."""
        rows = next((b for b in self.session.prefill_buckets if b >= count), count)
        return rows if start + rows <= self.cache.capacity else count

    def decode(self, token: int) -> torch.Tensor:
        """One autoregressive step (no drafter): [1, V] logits of the next token."""
        start = self.cache.num_cached
        out = self._target("decode", [token], [start], [[True]], [0])
        self.cache.commit_target(out["new_latent_kv"], None, rows=None)
        return out["logits"]

    def draft(self, bonus: int) -> torch.Tensor:
        """One drafter forward on [bonus, mask x (block_size - 1)]; returns draft logits [block_size - 1, V]."""
        taps, context_start = self.cache.take_context()
        count, block = taps.shape[0], self.spec.block_size
        profile = "draft" if count <= block else "draft_prefill"
        rows = block if profile == "draft" else count
        if rows > count:
            taps = torch.cat((taps, taps.new_zeros(rows - count, taps.shape[1])), dim=0)
        start = self.cache.num_cached  # the bonus token's position
        out = self.session.run(
            profile,
            {
                "context_hidden": taps,
                "context_positions": self._tensor(np.arange(context_start, context_start + rows)),
                "context_length": self._tensor([count]),
                "block_ids": self._tensor([bonus] + [self.mask_token_id] * (block - 1)),
                "block_positions": self._tensor(np.arange(start, start + block)),
                "draft_cache": self.cache.draft,
                "draft_cache_length": self._tensor([self.cache.num_drafted]),
            },
        )
        self.cache.commit_draft(out["new_context_kv"], count)
        return out["draft_logits"]

    def verify(self, tokens: np.ndarray, depths: np.ndarray, mask: np.ndarray) -> torch.Tensor:
        """The target on the whole tree in one forward; returns logits [rows, V]. Nothing is committed yet."""
        start = self.cache.num_cached
        out = self._target(self.verify_profiles[len(tokens)], tokens, start + depths, mask, np.arange(len(tokens)))
        self._pending = out
        return out["logits"]

    def enable_device_loop(self, autoregressive: bool = False, probes=None) -> None:
        """Runs later steps (greedy or sampled) as one tensor program (a CUDA graph on GPUs): `runner/device/loop.py`.
        The rank factory calls it; `probes` are benchmarks' hooks (`runner/probes.py`)."""
        from runner.device.loop import DeviceLoop

        self.close()  # the previous loop's graphs and pinned slots go now, not whenever the garbage collector runs
        self.loop = DeviceLoop(self, self.spec, self.device.type == "cuda", autoregressive, probes)
        self.context_rows = probes.context_rows if probes is not None else 0
        if self.context_rows:
            self._write_synthetic_context(self.context_rows)
        self.reset()

    def close(self) -> None:
        if self.batch is not None:
            self.batch.close()
            self.batch = None
        if self.loop is not None:
            self.loop.close()
            self.loop = None

    # --- in-flight batching (`runner/device/batch.py`): each request in a slot of its own caches ---

    def enable_batching(self, slots: int) -> None:
        from runner.device.batch import BatchLoop

        if self.loop is None:
            raise RuntimeError("batched steps run on the device loop: enable it first")
        if self.device.type == "cuda":  # every slot holds caches for the engine's whole sequence
            check_slot_memory(slots, self.cache, torch.cuda.mem_get_info(self.device)[0], self.device)
        self.batch = BatchLoop(self, self.spec, slots, self.device.type == "cuda", self.loop.autoregressive)

    def batch_prefill(self, slot: int, prompt: list[int]) -> torch.Tensor:
        """The prompt into the slot's caches (the prefill profile, as a single request's); its last row's logits."""
        cache = self.batch.loops[slot].cache
        main, self.cache = self.cache, cache
        try:
            with self.batch.timed("admission of", 1):
                cache.reset()
                return self.prefill(prompt)
        finally:
            self.cache = main

    def batch_prefill_many(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Several prompts into their slots' caches, in as few forwards as fit (`prefill_group`): a group's padded
        rows stay within a prefill chunk (`prefill_chunk`, else the prefill profile's longest), a prompt longer than
        that prefills alone in chunks (`batch_prefill`), as does one alone where lone admissions are not groups of
        one (`BatchLoop.lone_as_group`). Each prompt's last row's logits [len(prompts), V], in order.
        With graphs (GPUs) a group is cut into counts of powers of two, largest first, each a captured form (13
        requests: 8, 4 and 1). Every rank groups alike (the same lengths, the same limit)."""
        with self.batch.timed("admission of", len(prompts)):
            return self._batch_prefill_many(slots, prompts)

    def _batch_prefill_many(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        limit = self.prefill_chunk or self.session.profile("prefill").dims["tokens"][2]
        padded = [self._prefill_rows(len(p), 0) for p in prompts]
        logits, group = [None] * len(prompts), []

        def flush():
            for part in _group_parts(group, self.batch.use_graph):
                if len(part) == 1 and self._prefills_alone(padded[part[0]], limit):
                    logits[part[0]] = self.batch_prefill(slots[part[0]], prompts[part[0]])
                    continue
                out = self.prefill_group([slots[i] for i in part], [prompts[i] for i in part])
                for row, i in enumerate(part):
                    logits[i] = out[row : row + 1]
            group.clear()

        for i, rows in enumerate(padded):
            if group and (len(group) + 1) * max(rows, *(padded[j] for j in group)) > limit:
                flush()
            group.append(i)
            if rows > limit:  # alone, in chunks
                flush()
        flush()
        return torch.cat(logits)

    def _prefills_alone(self, rows: int, limit: int) -> bool:
        """Whether a prompt admitted by itself (padded to `rows`) prefills on the prefill profile (`batch_prefill`)
        rather than as a group of one: where it is longer than a group may be, or where lone admissions are not
        groups of one (`BatchLoop.lone_as_group`; on GPUs a group of one is a graph, so its length must be captured)."""
        graphed = not self.batch.use_graph or rows in self.session.prefill_buckets
        return rows > limit or not (self.batch.lone_as_group and graphed)

    def prefill_group(self, slots: list[int], prompts: list[list[int]]) -> torch.Tensor:
        """Prompts into their (free) slots' caches in one target forward (`BatchLoop.prefill`): each padded to the
        group's longest padded length (`_prefill_rows`: the same kernels as a prefill of its own), its rows side by
        side, causal within its own, over an empty cache; its latent K/V and (speculative) the drafter's context K/V
        written into its slot, as the device loop's `prefill_context` leaves a prompt. Returns each prompt's last
        row's logits [len(prompts), V]. On GPUs a group of a captured length replays a graph of its count and length
        (`batch_prefill_many` cuts groups into counts of powers of two)."""
        batch = self.batch
        rows = max(self._prefill_rows(len(p), 0) for p in prompts)
        logits = batch.prefill(slots, prompts, rows, graph=rows in self.session.prefill_buckets)
        for slot, prompt in zip(slots, prompts):
            cache = batch.loops[slot].cache
            cache.reset()
            cache.num_cached = len(prompt)
            cache.num_drafted = 0 if batch.autoregressive else len(prompt)
        return logits

    def batch_load(self, slot: int, bonus: int, prompt_length: int, params=None, budget=None) -> None:
        self.batch.loops[slot].load(bonus, prompt_length, params, budget)

    def batch_load_many(self, loads: list[tuple]) -> None:
        """`batch_load` of each (slot, bonus, prompt_length, params, budget): the requests of one admission."""
        with self.batch.timed("load"):
            for load in loads:
                self.batch_load(*load)

    def batch_move(self, source: int, target: int, emitted: int) -> None:
        """Slot `source`'s request into free slot `target` (`BatchLoop.move`); emitted: its tokens so far, so its
        committed rows are at most its prefill's rows plus that many."""
        with self.batch.timed("move"):
            self.batch.move(source, target, self.batch.loops[source].cache.num_cached + emitted)

    def batch_launch(self, count: int, choices: dict | None = None, budget=None, report: bool = True) -> None:
        """Queues one step of slots [0, count) (`BatchLoop.launch`); `batch_collect` reads it. choices: the budget
        policy's inputs of the slots whose requests chose `auto`; budget: one tree budget for every slot
        (`StepBudgetPolicy`); report: whether a step at one budget reports statistics."""
        loops = self.batch.loops
        with self.batch.timed("step of", count, *(() if budget is None else ("at", budget))):
            for slot, choice in (choices or {}).items():
                loops[slot].set_choice(choice)
            self.batch.launch(count, budget, report)

    def batch_collect(self):
        """The oldest queued step's results (`BatchLoop.collect`): (each slot's tokens, each several-budget slot's
        statistics, whether the step captured its graph)."""
        emitted, captured = self.batch.collect()
        loops = self.batch.loops
        return emitted, {s: loops[s].last_stats for s in range(len(emitted)) if loops[s].auto}, captured

    def device_prefill_context(self) -> None:
        self.loop.prefill_context()

    def device_load(self, bonus: int, prompt_length: int, params=None, budget=None) -> None:
        self.loop.load(bonus, prompt_length, params, budget)

    def device_launch(self, budget=None) -> None:
        self.loop.launch(budget)

    def device_collect(self) -> list[int]:
        return self.loop.collect()

    def commit(self, rows: list[int]) -> None:
        """Commits the accepted tree rows (root first) of the last verify."""
        self.cache.commit_target(self._pending["new_latent_kv"], self._pending["taps"], rows)
        self._pending = {}


def _group_parts(group: list[int], powers_of_two: bool) -> list[list[int]]:
    """A prefill group as it runs: whole, or (powers_of_two) cut into counts of powers of two, largest first."""
    if not powers_of_two:
        return [list(group)] if group else []
    parts, begin = [], 0
    while begin < len(group):
        size = 1 << ((len(group) - begin).bit_length() - 1)
        parts.append(list(group[begin : begin + size]))
        begin += size
    return parts


def check_slot_memory(slots: int, cache: SequenceCache, free_bytes: int, device) -> None:
    """max_batch_size slots of caches (each as large as the engine's sequence) must fit in the device's free memory:
    otherwise a clear error now, not an allocation failure while the ranks are built."""
    from builder.convert import human_size

    per_slot = sum(t.numel() * t.element_size() for t in (cache.latent, cache.draft))
    if slots * per_slot > free_bytes:
        raise ValueError(f"max_batch_size={slots}: {slots} slots of caches for {cache.capacity} tokens each need "
                         f"{human_size(slots * per_slot)}; {human_size(free_bytes)} is free on {device} (lower "
                         f"--max_batch_size, or build the engine with a smaller max_seq_len)")  # fmt: skip
