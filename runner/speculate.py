"""The speculative loop: draft a block, build the tree, verify once, accept the longest matching path, commit.

`speculative_step` is the whole algorithm in one function; `generate` runs prefill and then steps;
`generate_autoregressive` is the baseline (and the lossless oracle: greedy speculative == greedy autoregressive).
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engines.spec import SpecConfig
from runner.budget import BudgetPolicy
from runner.ranks import Ranks
from runner.sampling import Sampler
from runner.tree import build_tree, follow_tree


class PhaseTimer:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] += time.perf_counter() - start


@dataclass
class StepResult:
    tokens: list[int]  # emitted by this step: the accepted drafted tokens, then the new bonus token
    accept_length: int  # accepted tree nodes including the root; equals len(tokens)
    tree_nodes: int  # real tree rows verified (root included)
    budget: int = 0  # the tree budget this step verified


@dataclass
class GenerationResult:
    prompt: list[int]
    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)
    budgets: list[int] = field(default_factory=list)  # the tree budget of each step (a cost-aware policy's choices)
    target_forwards: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    elapsed: float = 0.0

    @property
    def mean_accept_length(self) -> float:
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return len(self.tokens) / self.target_forwards if self.target_forwards else 0.0

    @property
    def prefill_seconds(self) -> float:
        """Time to the first token: the prompt's forward (and the drafter's prefill) and the first choice."""
        return self.seconds.get("prefill", 0.0)

    @property
    def decode_seconds(self) -> float:
        """Everything after the first token: the steps that emit the other tokens."""
        return self.elapsed - self.prefill_seconds

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first over the time after the first token (the steady decode rate)."""
        decoded = len(self.tokens) - 1
        return decoded / self.decode_seconds if decoded > 0 and self.decode_seconds > 0 else 0.0


def speculative_step(engine: Ranks, spec: SpecConfig, sampler: Sampler, bonus: int, timer: PhaseTimer,
                     policy: BudgetPolicy | None = None) -> StepResult:  # fmt: skip
    """One DDTree round from the last committed token `bonus` (already emitted, not yet in the target cache).
    policy: the tree budget is chosen for this step (`runner/budget.py`) among the engine's, up to spec.budget."""
    started = time.perf_counter()
    with timer("draft"):  # one drafter forward over [bonus, mask x (block_size - 1)]
        draft_logits = engine.draft(bonus)  # [block_size - 1, V]
        top = torch.log_softmax(draft_logits.to(torch.float32), dim=-1).topk(spec.tree_width(draft_logits.shape[-1]))
        top_logprobs, top_ids = top.values.cpu().numpy(), top.indices.cpu().numpy()
    with timer("tree"):  # best-first by cumulative draft log-probability, padded to the verify profile's rows
        tree = build_tree(top_logprobs, top_ids, spec.budget, bonus, rows=spec.verify_tokens)
        budget = spec.budget
        if policy is not None and (budget := policy.choose(tree.scores)) != spec.budget:
            # best-first: the smaller budget's tree is the first nodes of this one, on its own profile's rows
            tree = tree.prefix(budget, rows=spec.with_budget(budget).verify_tokens)
        mask = tree.mask()
    with timer("verify"):  # the target on every tree node at once, and its own choice at each node
        logits = engine.verify(tree.tokens, tree.depths, mask)  # [rows, V]
        target_tokens = sampler.choose(logits[: tree.num_nodes])
    # Accept: follow the target's own choice from the root while it is a child of the current node; the choice
    # where the walk stops is the next bonus. Every emitted token is the target's choice, so output is lossless.
    path, next_bonus = follow_tree(tree, target_tokens)
    with timer("commit"):  # only the accepted path's KV enters the caches
        engine.commit(path)
    accepted = [int(tree.tokens[node]) for node in path[1:]]
    if policy is not None:
        policy.record(len(path), time.perf_counter() - started, path)
    return StepResult(accepted + [next_bonus], accept_length=len(path), tree_nodes=tree.num_nodes, budget=budget)


def check_request(
    prompt_length: int, max_new_tokens: int, max_input_len: int, max_seq_len: int, block_size: int
) -> None:
    if prompt_length < 1:
        raise ValueError("the prompt is empty; at least one token is needed")
    if prompt_length > max_input_len:
        raise ValueError(f"prompt of {prompt_length} tokens is longer than the engine's max_input_len={max_input_len}")
    if max_new_tokens < 1:
        raise ValueError(f"max_output_len must be >= 1, got {max_new_tokens}")
    if prompt_length + max_new_tokens + block_size > max_seq_len:
        raise ValueError(
            f"prompt ({prompt_length}) + max_output_len ({max_new_tokens}) + one draft block ({block_size}) = "
            f"{prompt_length + max_new_tokens + block_size} exceeds the engine's max_seq_len={max_seq_len}"
        )


def _emit(
    tokens: list[int],
    new: list[int],
    max_new_tokens: int,
    end_ids: set[int],
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    on_tokens: Callable[[list[int]], None] | None = None,
) -> tuple[list[int], bool]:
    """Appends `new` up to the token budget, the first end id, or the end of a stop sequence, and hands what was
    appended to `on_tokens`; returns (appended, finished)."""
    taken, stopped = [], False
    for token in new:
        if len(tokens) + len(taken) >= max_new_tokens:
            break
        taken.append(token)
        tail = tokens + taken
        if token in end_ids or any(seq and tuple(tail[-len(seq) :]) == seq for seq in stop_sequences):
            stopped = True
            break
    tokens.extend(taken)
    if on_tokens and taken:
        on_tokens(taken)
    return taken, stopped or len(tokens) >= max_new_tokens


def generate(
    engine: Ranks,
    prompt: list[int],
    max_new_tokens: int,
    spec: SpecConfig,
    sampler: Sampler,
    end_ids: set[int] = frozenset(),
    on_tokens: Callable[[list[int]], None] | None = None,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
    policy: BudgetPolicy | None = None,
) -> GenerationResult:
    """Prefill, then speculative steps until max_new_tokens, an end token or a stop sequence."""
    timer, start = PhaseTimer(), time.perf_counter()
    result = GenerationResult(prompt=list(prompt), tokens=[])
    if policy is not None:
        policy.start_sequence()  # this request's first step is not paired with the last one's (`runner/budget.py`)
    engine.reset()
    with timer("prefill"):
        first = sampler.choose(engine.prefill(list(prompt)))
    result.target_forwards = 1
    _, finished = _emit(result.tokens, first, max_new_tokens, end_ids, stop_sequences, on_tokens)
    while not finished:
        step = speculative_step(engine, spec, sampler, result.tokens[-1], timer, policy)
        result.target_forwards += 1
        result.accept_lengths.append(step.accept_length)
        result.budgets.append(step.budget)
        _, finished = _emit(result.tokens, step.tokens, max_new_tokens, end_ids, stop_sequences, on_tokens)
    result.seconds, result.elapsed = dict(timer.seconds), time.perf_counter() - start
    return result


def generate_autoregressive(
    engine: Ranks,
    prompt: list[int],
    max_new_tokens: int,
    sampler: Sampler,
    end_ids: set[int] = frozenset(),
    on_tokens: Callable[[list[int]], None] | None = None,
    stop_sequences: tuple[tuple[int, ...], ...] = (),
) -> GenerationResult:
    """The baseline (and the lossless oracle): one target forward a token."""
    timer, start = PhaseTimer(), time.perf_counter()
    result = GenerationResult(prompt=list(prompt), tokens=[])
    engine.reset()
    with timer("prefill"):
        logits = engine.prefill(list(prompt))
    finished = False
    while not finished:
        _, finished = _emit(result.tokens, sampler.choose(logits), max_new_tokens, end_ids, stop_sequences, on_tokens)
        result.target_forwards += 1
        if not finished:
            with timer("decode"):
                logits = engine.decode(result.tokens[-1])
    result.seconds, result.elapsed = dict(timer.seconds), time.perf_counter() - start
    return result
