"""Rank 0's generation over all ranks, for the CLI, `--serve` and the benchmarks alike: it picks the loop for each
request (the device loop where the ranks have one, greedy or sampled; the host loop for requests with bad words or
another budget than the loop's, and everywhere else), warms up (CUDA graphs are captured before the first request, as
SGLang and TensorRT-LLM do at start-up), and says in words what runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

from runner.device.loop import generate_on_device
from runner.ranks import Ranks
from runner.sampling import Sampler, SamplingParams
from runner.sessions.base import length_buckets
from runner.speculate import GenerationResult, generate, generate_autoregressive

GREEDY = SamplingParams()
# the steps a job of `Generator.measure_batch_costs` runs (at a full block a step) where an `auto` batch's steps are
# queued ahead: the first step and the last, near the token limit, run one at a time, the rest queued
QUEUED_STEPS = 6


def group_admissions() -> bool:
    """`DDTREE_GROUP_ADMISSIONS=1`: a batch under a backlog puts a freed slot's admission off while sharing it with the
    slots the next steps free pays by its own measurements (`Batcher.admit_now`). Off by default: on two CPU cores an
    admission's time grows with its requests (sixteen together take what sixteen lone ones do: nothing to share),
    and on one H100, where a lone admission costs most of what sixteen together do, it halved a DDTree 8 job's
    admissions under a steady load at 16 slots and still slowed the job 2-4 %: the freed slots' idle steps cost more
    than the shared prefills save (BENCHMARKS.md, section 18)."""
    from runner.device.batch import env_switch

    return bool(env_switch("DDTREE_GROUP_ADMISSIONS"))


class Generator:
    def __init__(self, ranks: Ranks, autoregressive: bool = False):
        lead = ranks.lead
        self.ranks, self.spec, self.autoregressive = ranks, lead.spec, autoregressive
        self.capacity = lead.cache.capacity
        self.device_loop = lead.loop is not None
        if self.device_loop and lead.loop.autoregressive != autoregressive:
            raise ValueError(
                f"the ranks' device loop is {'autoregressive' if lead.loop.autoregressive else 'speculative'}; "
                f"this generator is {'autoregressive' if autoregressive else 'speculative'}"
            )
        # the budgets the device loop verifies: with several, every one of them (a graph each) and "auto"
        self.device_budgets = lead.loop.budgets if self.device_loop and lead.loop.auto else (self.spec.budget,)
        self.on_gpu = lead.device.type == "cuda"
        # in-flight batching (`runner/device/batch.py`): requests a step serves at most
        self.batch_slots = len(lead.batch.loops) if lead.batch is not None else 1
        self.rank_description = lead.description
        self.warm_up_phases: dict[str, float] = {}  # `warm_up`'s seconds by part
        self.policy = None  # the cost-aware tree budget's policy (`runner/budget.py`), measured on first use
        self.step_policy = None  # `auto` on the device loop (`runner/device/budget.py`), seeded with the same costs
        # an all-`auto` batch's one budget a step, autoregressive steps among the choices (`StepBudgetPolicy`); shared
        # by the batchers, so what one job or server learnt of the costs at each batch size the next step uses
        self.batch_policy = None
        self.last_batcher = None  # the last `generate_many`'s batch
        self.auto_default = False  # `enable_auto_budget`: requests that name no budget take `auto`

    def on_device(self, params: SamplingParams, banned: tuple[int, ...] = (), budget: int | str | None = None) -> bool:
        """Whether a request runs on the device loop: where the ranks have one, greedy or sampled, unless it bans
        tokens (bad_words: the host loop's sampler) or its budget is not one the loop verifies (an engine with
        several budgets: each of them, a graph each, and `auto`, a budget chosen for every step; else the spec's budget
        only)."""
        chosen = self.step_budget(budget)
        several = len(self.device_budgets) > 1
        return self.device_loop and not banned and (chosen in self.device_budgets or (chosen == "auto" and several))

    def step_budget(self, budget: int | str | None) -> int | str:
        """What a request's `budget` (None: the job's default) runs: "auto" or a fixed tree budget."""
        if budget is None:
            return "auto" if self.auto_default else self.spec.budget
        return budget

    def enable_auto_budget(self, tokens: int = 32, calibration: float = 1.0) -> dict[int, float]:
        """`--ddtree_budget auto`: every request that names no budget has it chosen every step; returns the seconds
        a step measured at each budget (`measure_budgets`)."""
        costs = self.measure_budgets(tokens, calibration)
        self.auto_default = True
        return costs

    def measure_budgets(self, tokens: int = 32, calibration: float = 1.0, rounds: int = 3) -> dict[int, float]:
        """Measures one step's cost at every tree budget the ranks' engines verify (short greedy requests, on this
        hardware) for the policy that chooses the budget every step (`runner/budget.py`); returns the seconds a
        step. Each budget runs once untimed (first calls), then `rounds` times, the budgets interleaved (each round
        takes them in turn, starting one further on) so a machine whose speed drifts meanwhile slows them alike:
        a budget's cost is the median of its rounds' seconds a step. Only the ratios between the budgets steer the
        choice; the policy starts from them and learns them from consecutive steps (`BudgetPolicy`)."""
        from runner.budget import BudgetPolicy, require_several

        if self.autoregressive:
            raise ValueError("--ddtree_budget auto needs speculative ranks, not autoregressive ones")
        budgets = self.spec.budgets
        require_several(budgets, "--ddtree_budget")
        prompt = self._warm_prompt()
        tokens = max(1, min(tokens, self.capacity - len(prompt) - 2 * self.spec.block_size - 1))
        on_device = self.device_budgets == budgets  # the device loop: the path `auto` requests take

        def step_seconds(budget: int) -> float:
            if on_device:
                result = generate_on_device(self.ranks, self.spec, prompt, tokens, self.capacity, budget=budget)
            else:
                result = generate(self.ranks, prompt, tokens, self.spec.with_budget(budget), Sampler(GREEDY))
            steps = max(1, len(result.accept_lengths))
            if on_device:  # steps overlap: the time after the first token, a step
                return result.decode_seconds / steps
            return sum(result.seconds.get(p, 0.0) for p in ("draft", "tree", "verify", "commit")) / steps

        for budget in budgets:
            step_seconds(budget)  # untimed: first calls
        times: dict[int, list[float]] = {b: [] for b in budgets}
        for r in range(max(1, rounds)):
            for i in range(len(budgets)):
                budget = budgets[(i + r) % len(budgets)]
                times[budget].append(step_seconds(budget))
        costs = {b: statistics.median(t) for b, t in times.items()}
        self.policy = BudgetPolicy(budgets, costs, calibration)
        if on_device:
            from runner.device.budget import StepBudgetPolicy

            self.step_policy = StepBudgetPolicy(budgets, costs)
        return costs

    def auto_policy(self):
        """`auto`'s `BudgetPolicy` (the host loop's, and a mixed batch's `auto` slots'), its costs measured at the
        first request that asks."""
        if self.policy is None:
            self.measure_budgets()
        return self.policy

    def device_auto_policy(self):
        """A lone `auto` request's `StepBudgetPolicy` on the device loop (shared by the requests, which learn for
        each other), seeded with the costs measured at the first request that asks."""
        if self.step_policy is None:
            self.measure_budgets()
        return self.step_policy

    def _warm_prefill_lengths(self, params: SamplingParams) -> None:
        """A one-token request at every prompt length of `length_buckets` up to the longest prefill: on a GPU a GEMM
        of another row count takes another kernel, which the first request that needs it loads (one H200, the
        trained pair through the CLI: a first prefill of 73 tokens took 1332 ms in bf16 and 2084 ms in float32
        after a warm-up at 32 tokens, the later ones 10-25 ms; `benchmarks/first_request.py`). Prompts up to
        `PREFILL_GRAPH_TOKENS` are padded to these lengths and replayed as a graph each, captured here."""
        longest = self.ranks.lead.session.profile("prefill").dims["tokens"][2]
        for length in length_buckets(min(longest, self.capacity - 2)):
            self.generate([1 + i % 255 for i in range(length)], 1, params)

    def _warm_batch(self, prompt: list[int], params: SamplingParams) -> None:
        """Every batched step's graph: at each slot count, one step of that many requests of two tokens (the first
        from the prefill, the second from the step) at two budgets alternating (each slot's own: a mixed batch's
        form), then one with each budget for the whole batch as an all-`auto` batch steps it (statistics reported)
        and as a batch all at that fixed budget steps it (none), and one autoregressive step (`DECODE`); the `auto`
        ones each under a policy of that one choice, so the batch policy learns nothing from these steps (they
        include the captures), an autoregressive step after a tree step, and with `BatchLoop.lazy_context` the
        commit of a run of autoregressive steps' rows and a tree step's flush of them (where the cache holds such a
        run). Requests of different lengths leaving one after another missed slot counts whenever two left at the
        same step (one H200: the first step at such a count took 110-161 ms, and its time steered the policy). First
        the admissions of several requests at once (`_warm_group_prefills`)."""
        from runner.device.budget import DECODE, ScriptedPolicy, StepBudgetPolicy

        self._warm_group_prefills(params)
        several, budgets = len(self.device_budgets) > 1, self.device_budgets
        for count in range(self.batch_slots, 0, -1):
            batch = ([prompt] * count, 2, [params] * count)
            if not several:
                self.generate_many(*batch, budget=self.spec.budget)
                continue
            if count > 1:  # requests of different budgets: each slot's own (the largest budget's rows)
                self.generate_many(*batch, budget=[(budgets[0], budgets[-1])[i % 2] for i in range(count)])
            for budget in (DECODE, *budgets):  # one budget for the whole batch: all `auto`, then all at that budget
                self.generate_many(*batch, budget="auto", batch_policy=StepBudgetPolicy((budget,)))
                if budget != DECODE:
                    self.generate_many(*batch, budget=budget)
            # an autoregressive step after a tree step, whose pending context may be a block wide (after a load or
            # an autoregressive step it is one row at most: the form above; `BatchLoop._decode`): a tree step emits
            # at most a block, so requests of 2 + block tokens take a second step
            self.generate_many([prompt] * count, 2 + self.spec.block_size, [params] * count, budget="auto",
                               batch_policy=ScriptedPolicy((budgets[0], DECODE)))  # fmt: skip
            batch_loop = self.ranks.lead.batch
            if batch_loop.lazy_context:  # autoregressive steps' rows pending until `context_rows` of them commit,
                rows = batch_loop.context_rows  # then (more than a block pending) a tree step's flush before it
                room = self.capacity - len(prompt) - 2 * self.spec.block_size - 1
                self.generate_many([prompt] * count, max(2, min(2 + rows, room)), [params] * count, budget="auto",
                                   batch_policy=ScriptedPolicy((DECODE,)))  # fmt: skip
                if rows > self.spec.block_size and self.spec.block_size + 4 <= room:
                    script = (DECODE,) * (self.spec.block_size + 1) + (budgets[0],)
                    self.generate_many([prompt] * count, 2 + len(script), [params] * count, budget="auto",
                                       batch_policy=ScriptedPolicy(script))  # fmt: skip

    def measure_batch_costs(self, prompt: list[int], params: SamplingParams = GREEDY,
                            rounds: int = 3) -> dict[tuple[int, int], float]:  # fmt: skip
        """Times one batched step at each choice of an all-`auto` batch (`DECODE` and every budget) at 1, 2, 4 ...
        slots and the most, as a settled step takes it (reporting no statistics), and seeds the batch policy with
        them (`StepBudgetPolicy(step_costs=...)`; between the counts timed the policy draws a line), so the first
        steps of a job serve its requests instead of timing the choices (one H200, the trained pair, 16 requests of
        128 tokens: a 16-slot batch's first steps took 32, 0, 0, 8, 8, 16, 16 and 32, all but the first to time a
        choice twice, where 8 was the best from the first). `rounds` rounds, the choices interleaved (each round
        starts one further on); a pair's cost is its median. Where an `auto` batch queues its steps ahead
        (`BatchLoop.run_ahead_auto`), a step's cost is what it takes queued behind another (the
        host's work between steps hidden behind the GPU's), so each job runs `QUEUED_STEPS` steps' tokens and most of
        its steps are queued: timed one at a time, an autoregressive step, whose host work is the largest share of it,
        cost 0.78 ms at 16 slots of the trained pair on one H100, where queued it costs 0.64 (the batch policy's
        medians; BENCHMARKS.md, section 18). Returns {(slots, budget): seconds a step}."""
        from runner.device.budget import DECODE, StepBudgetPolicy

        options, timings = (DECODE, *self.device_budgets), {}
        counts = sorted({*(2**i for i in range(self.batch_slots.bit_length())), self.batch_slots})
        batch_loop = self.ranks.lead.batch
        queued = batch_loop.run_ahead_auto
        tokens = 2 + QUEUED_STEPS * (self.spec.draft_depth + 1) if queued else 2  # the prefill's token and the steps'
        tokens = max(2, min(tokens, self.capacity - len(prompt) - 2 * self.spec.block_size - 1))  # a short cache
        for r in range(max(1, rounds)):
            for count in counts:
                for i in range(len(options)):
                    budget = options[(i + r) % len(options)]
                    batch = ([prompt] * count, tokens, [params] * count)
                    if budget == DECODE:  # autoregressive steps of an all-`auto` batch (they report nothing)
                        self.generate_many(*batch, budget="auto", batch_policy=StepBudgetPolicy((DECODE,)),
                                           timings=timings)  # fmt: skip
                    else:  # a batch at one budget steps as a settled `auto` batch does: its graph, no statistics
                        self.generate_many(*batch, budget=budget, timings=timings)
        costs = {(count, budget): statistics.median(times) for (count, budget, report), times in timings.items()
                 if budget is not None and not report}  # fmt: skip
        self.batch_policy = StepBudgetPolicy(self.device_budgets, decode=True, narrow_informs=True, step_costs=costs,
                                             max_tokens=self.spec.block_size)  # fmt: skip
        return costs

    def _warm_group_prefills(self, params: SamplingParams) -> None:
        """Several requests admitted at once prefill in one forward (`BatchLoop.prefill`; on GPUs a graph of their
        count, a power of two, and padded length): one-token requests at every prefill length, 2, 4, 8 ... up to the
        slots at a time (from 1 where a lone admission is a group of one, `BatchLoop.lone_as_group`; while a group
        fits a prefill chunk), capture those graphs (and load the kernels their row counts take) before a request
        needs them, as `_warm_prefill_lengths` does for one request."""
        lead = self.ranks.lead
        limit = lead.prefill_chunk or lead.session.profile("prefill").dims["tokens"][2]
        for length in length_buckets(min(lead.session.profile("prefill").dims["tokens"][2], self.capacity - 2)):
            count = 1 if lead.batch.lone_as_group else 2
            while count <= self.batch_slots and count * lead._prefill_rows(length, 0) <= limit:
                self.generate_many([[1 + i % 255 for i in range(length)]] * count, 1, [params] * count)
                count *= 2

    def _warm_prompt(self) -> list[int]:
        block = self.spec.block_size
        longest = self.ranks.lead.session.profile("prefill").dims["tokens"][2]
        return list(range(1, min(4 * block, longest) + 1))

    def mode(
        self, params: SamplingParams = GREEDY, banned: tuple[int, ...] = (), budget: int | str | None = None
    ) -> str:
        spec, chosen = self.spec, self.step_budget(budget)
        if self.autoregressive:
            what = "autoregressive"
        elif spec.max_topk == 1:
            what = f"DFlash chain (block {spec.block_size})"
        elif chosen == "auto":
            what = f"DDTree budget auto of {list(spec.budgets)} (block {spec.block_size})"
        else:
            what = f"DDTree budget {chosen} (block {spec.block_size})"
        if not self.on_device(params, banned, budget):
            return f"{what}, host loop"
        batched = f", batched: up to {self.batch_slots} requests a step" if self.batch_slots > 1 else ""
        return f"{what}, device loop ({'one CUDA graph a step' if self.on_gpu else 'eager tensor program'}){batched}"

    def batcher(self):
        """In-flight batching over the ranks' slots (`RankOptions.max_batch_size`): a `Batcher` to `admit` into."""
        from runner.device.batch import Batcher
        from runner.device.budget import StepBudgetPolicy

        if self.batch_slots < 2:
            raise ValueError("batched steps need ranks built with max_batch_size > 1 (--max_batch_size)")
        several = len(self.device_budgets) > 1  # `auto` requests share one budget a step, chosen for the batch
        if several and self.batch_policy is None:
            self.batch_policy = StepBudgetPolicy(self.device_budgets, decode=not self.autoregressive,
                                                 narrow_informs=True, max_tokens=self.spec.block_size)  # fmt: skip
        return Batcher(self.ranks, self.batch_slots, self.autoregressive, self.policy,
                       self.batch_policy if several else None, group_admissions())  # fmt: skip

    def admit(self, batcher, prompt: list[int], max_new_tokens: int, params: SamplingParams = GREEDY,
              end_ids: set[int] = frozenset(), on_tokens=None, stop_sequences=(), budget=None, tag=None):  # fmt: skip
        """A request into the batch (one the device loop serves: `on_device`); `auto`'s costs are measured at the
        first request that asks, as for single requests."""
        from runner.device.batch import Admission

        return self.admit_many(batcher, [Admission(prompt, max_new_tokens, params, end_ids, on_tokens, stop_sequences,
                                                   budget, tag)])[0]  # fmt: skip

    def admit_many(self, batcher, requests: list) -> list:
        """Requests (`runner.device.batch.Admission`, at most `batcher.free`) into the batch at once: their
        prefills share forwards (`Batcher.admit_many`); returns their members in order."""
        from dataclasses import replace

        requests = [replace(r, budget=self.step_budget(r.budget)) for r in requests]
        if any(r.budget == "auto" for r in requests):
            batcher.policy = self.auto_policy()
        return batcher.admit_many(requests)

    def generate_many(self, prompts: list[list[int]], max_new_tokens: int | list[int], params: list[SamplingParams],
                      end_ids: set[int] = frozenset(), budget=None,
                      batch_policy=None, timings=None) -> list[GenerationResult]:  # fmt: skip
        """Several requests at once, in-flight batched: each joins when a slot is free and leaves when done; returns
        their results in order. max_new_tokens, budget: one for all, or each request's. batch_policy: chooses the
        budget of each step of an all-`auto` batch instead of the batcher's own `StepBudgetPolicy` (warm-up).
        timings: a dict the steps' seconds go into (`Batcher.timings`)."""
        from runner.device.batch import Admission

        batcher, results = self.batcher(), {}
        self.last_batcher = batcher  # what the job's batch did (`Batcher.admission_summary`: the CLI's summary)
        if batch_policy is not None:
            batcher.batch_policy = batch_policy
        batcher.timings = timings
        counts = max_new_tokens if isinstance(max_new_tokens, list) else [max_new_tokens] * len(prompts)
        budgets = budget if isinstance(budget, list) else [budget] * len(prompts)
        waiting = [Admission(prompt, tokens, request_params, end_ids, budget=request_budget, tag=index)
                   for index, (prompt, request_params, tokens, request_budget)
                   in enumerate(zip(prompts, params, counts, budgets))]  # fmt: skip
        while waiting or batcher.members:
            if waiting and batcher.admit_now(len(waiting)):  # every request a free slot takes, admitted together
                admitted, waiting = waiting[: batcher.free], waiting[batcher.free :]
                for member in self.admit_many(batcher, admitted):
                    if member.result.elapsed:  # done at its first token
                        results[member.tag] = member.result
            for member in batcher.step():
                results[member.tag] = member.result
        return [results[i] for i in range(len(prompts))]

    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        params: SamplingParams = GREEDY,
        end_ids: set[int] = frozenset(),
        on_tokens: Callable[[list[int]], None] | None = None,
        stop_sequences: tuple[tuple[int, ...], ...] = (),
        banned: tuple[int, ...] = (),
        budget: int | str | None = None,
    ) -> GenerationResult:
        """budget: this request's tree budget, one the engines verify, or "auto" (None: the job's default); the
        device loop runs the budget it was built for, any other on the host loop."""
        if self.on_device(params, banned, budget):
            chosen = self.step_budget(budget)
            policy = self.device_auto_policy() if chosen == "auto" else None
            return generate_on_device(self.ranks, self.spec, prompt, max_new_tokens, self.capacity, end_ids, on_tokens,
                                      self.autoregressive, stop_sequences, params, chosen, policy)  # fmt: skip
        sampler = Sampler(params, banned)
        if self.autoregressive:
            return generate_autoregressive(self.ranks, prompt, max_new_tokens, sampler, end_ids, on_tokens,
                                           stop_sequences)  # fmt: skip
        chosen, policy = self.step_budget(budget), None
        if chosen == "auto":
            policy = self.auto_policy()
            chosen = max(policy.budgets)  # the tree is built at the largest; the policy takes its best prefix
        spec = self.spec if chosen == self.spec.budget else self.spec.with_budget(chosen)
        return generate(self.ranks, prompt, max_new_tokens, spec, sampler, end_ids, on_tokens, stop_sequences,
                        policy)  # fmt: skip

    def warm_up(self, requests: tuple[SamplingParams, ...] = (GREEDY,), serving: bool = False) -> float:
        """Runs a short request with each of `requests`' parameters, so the graph captures, kernel compilations and
        allocations of the paths later requests take happen now; `serving` (a server, whose requests may name a
        budget): with several budgets, `auto`'s step costs measured too, not while the first `auto` request waits
        (the tiny demo engine through Triton on the CPU: that request took 2.2 s for 8 tokens, the next 0.04 s).
        Returns the seconds it took."""
        start = time.perf_counter()
        phases = self.warm_up_phases = {}  # seconds each part took, for the startup report

        def timed(name: str, work, *args) -> None:
            began = time.perf_counter()
            work(*args)
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - began

        block = self.spec.block_size
        # longer than a block, so the host loop's first draft takes the draft_prefill profile as a real prompt does
        prompt = self._warm_prompt()
        tokens = max(1, min(2 * block + 1, self.capacity - len(prompt) - 2 * block - 1))
        if self.on_gpu:
            timed("prefill lengths", self._warm_prefill_lengths, requests[0] if requests else GREEDY)
        batched = []  # the forms whose batched steps were warmed (a GPU's graphs), or whose costs a CPU measures
        # a CPU has no graphs to warm, but an all-`auto` batch there still needs its step costs: without them its
        # policy takes each choice twice at the first batch's size to time it (the trained pair on two CPU cores, 16
        # requests of 64 tokens: budget 8, 16 and 32 steps of 67, 95 and 144 ms where an autoregressive one takes 14
        # ms; `auto` through the CLI 0.71x autoregressive, seeded 0.90x; BENCHMARKS.md 18). Measured where `auto` can
        # be asked for: a server, or a job whose requests take it (`enable_auto_budget`)
        batch_costs = self.on_gpu or serving or self.auto_default
        for params in requests:
            form = _form_name(params)
            timed(f"requests, {form}", self._warm_requests, prompt, tokens, params)
            if self.batch_slots > 1 and batch_costs and self.on_device(params):
                if self.on_gpu:
                    timed(f"batched steps, {form}", self._warm_batch, prompt, params)
                batched.append(params)
        if batched and len(self.device_budgets) > 1 and not self.autoregressive:
            # once, at the first form's costs (a server's: greedy)
            timed("batch costs", self.measure_batch_costs, prompt, batched[0])
        if serving and self.policy is None and len(self.spec.budgets) > 1 and not self.autoregressive:
            timed("auto costs", self.measure_budgets)
        return time.perf_counter() - start

    def _warm_requests(self, prompt: list[int], tokens: int, params: SamplingParams) -> None:
        """One request with `params`; on a GPU's device loop with several budgets, one at each (a graph each)."""
        self.generate(prompt, tokens, params)
        if self.on_gpu and self.on_device(params) and len(self.device_budgets) > 1:
            for budget in self.device_budgets:  # each budget's graph (the default's was just captured)
                self.generate(prompt, tokens, params, budget=budget)


def _form_name(params: SamplingParams) -> str:
    """A request form in words, for the warm-up's report: "greedy" or "temperature 1, top-p 0.95"."""
    if params.greedy:
        return "greedy"
    words = [f"temperature {params.temperature:g}"]
    if params.top_k:
        words.append(f"top-k {params.top_k}")
    if params.top_p < 1:
        words.append(f"top-p {params.top_p:g}")
    return ", ".join(words)
