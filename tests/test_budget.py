"""The cost-aware tree budget (runner/budget.py): its arithmetic, and `auto` generation staying lossless."""

from __future__ import annotations

import numpy as np
import pytest

from engines.spec import BuildConfig, SpecConfig
from runner.budget import BudgetPolicy
from runner.generator import Generator
from runner.sampling import Sampler, SamplingParams
from runner.speculate import generate_autoregressive
from tests.conftest import ENGINE_LIMITS, cpu_ranks


def test_the_policy_maximises_expected_tokens_per_second():
    # best-first path log-probabilities: 4 confident nodes, then unlikely ones
    scores = np.log(np.array([1.0, 0.9, 0.8, 0.7, 0.6] + [0.01] * 28))
    policy = BudgetPolicy((4, 8, 32), {4: 1.0, 8: 1.1, 32: 2.0})
    drafted = policy.expected_drafted(scores)
    assert drafted[4] == pytest.approx(3.0) and drafted[8] == pytest.approx(3.04)
    assert drafted[32] == pytest.approx(3.28)
    assert policy.choose(scores) == 4  # (1 + 3.0) / 1.0 beats (1 + 3.04) / 1.1 and (1 + 3.28) / 2.0
    cheap_width = BudgetPolicy((4, 8, 32), {4: 1.0, 8: 1.0, 32: 1.0})
    assert cheap_width.choose(scores) == 32  # at equal cost the widest tree expects the most
    assert policy.chosen[4] == 1 and policy.predicted == pytest.approx(3.0)
    policy.record(3)
    assert policy.observed == 2  # accept length 3 = 2 drafted tokens + the bonus
    assert policy.calibration == pytest.approx((2 + 8) / (3.0 + 8))  # observed / predicted, with a prior
    with pytest.raises(ValueError, match="no measured cost for budgets"):
        BudgetPolicy((4, 8), {4: 1.0})


def test_auto_budget_generation_equals_autoregressive(demo_ckpt):
    """`--ddtree_budget auto` in process: costs measured for every budget of the spec, every step verifies one of
    them, greedy output equals autoregressive decoding (the oracle)."""
    spec = SpecConfig(8, 32, extra_budgets=(4, 8, 16))
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS))
    prompt = [5, 77, 300, 12, 480, 33, 250, 9, 81]
    expected = generate_autoregressive(ranks, prompt, 40, Sampler(SamplingParams())).tokens
    generator = Generator(ranks)
    costs = generator.enable_auto_budget(tokens=12)
    assert sorted(costs) == [4, 8, 16, 32] and all(c > 0 for c in costs.values())
    assert generator.mode() == "DDTree budget auto of [4, 8, 16, 32] (block 8), host loop"
    result = generator.generate(prompt, 40)
    ranks.close()
    assert result.tokens == expected
    assert result.budgets and set(result.budgets) <= {4, 8, 16, 32}
    assert sum(generator.policy.chosen.values()) >= len(result.budgets)


def test_auto_needs_several_budgets(demo_ckpt):
    ranks = cpu_ranks(demo_ckpt(1), SpecConfig(8, 32), BuildConfig(**ENGINE_LIMITS))
    try:
        with pytest.raises(ValueError, match=r"chooses among several tree budgets; this engine verifies only \[32\]"):
            Generator(ranks).enable_auto_budget()
    finally:
        ranks.close()
