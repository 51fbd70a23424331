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
    policy.choose(scores)
    for _ in range(7):  # fewer steps than COST_MIN_STEPS at budget 4: still the warm-up cost
        policy.record(3, seconds=3.0)
    assert policy.step_seconds == {4: 1.0, 8: 1.1, 32: 2.0}
    policy.record(3, seconds=50.0)  # one slow step does not move the median of the steps taken
    assert policy.step_seconds[4] == pytest.approx(3.0)
    # budget 4 measured at 3 s, dearer than the wider 8 (1.1 s) and 32 (2.0 s): a wider verify never costs less, so
    # the three are pooled at their mean, and at equal cost the widest tree expects the most
    assert policy.costs() == {b: pytest.approx(6.1 / 3) for b in (4, 8, 32)}
    assert policy.choose(scores) == 32
    with pytest.raises(ValueError, match="no measured cost for budgets"):
        BudgetPolicy((4, 8), {4: 1.0})


def test_the_costs_used_never_fall_as_the_budget_grows():
    """Measured costs out of order (noise) are pooled with their neighbours; costs in order are kept as measured."""
    policy = BudgetPolicy((4, 8, 16, 32), {4: 10.4, 8: 9.4, 16: 12.1, 32: 14.0})
    assert policy.costs() == {4: pytest.approx(9.9), 8: pytest.approx(9.9), 16: 12.1, 32: 14.0}
    ordered = BudgetPolicy((4, 8, 16, 32), {4: 8.3, 8: 9.0, 16: 9.4, 32: 10.3})
    assert ordered.costs() == ordered.step_seconds
    tangled = BudgetPolicy((4, 8, 16), {4: 3.0, 8: 2.0, 16: 1.0})
    assert tangled.costs() == {b: pytest.approx(2.0) for b in (4, 8, 16)}


def test_every_step_informs_each_budget_up_to_the_one_taken():
    """A step at budget 32 whose accepted path is nodes 2, 6 and 20 would have accepted node 2 at budget 4 and
    nodes 2 and 6 at budget 8 (best-first: smaller trees are prefixes, children come after parents): each budget's
    calibration learns from that, and a budget the steps show to gain nothing is no longer taken."""
    scores = np.log(np.array([1.0, 0.9, 0.8, 0.7, 0.6] + [0.3] * 28))
    policy = BudgetPolicy((4, 8, 32), {4: 1.0, 8: 1.05, 32: 1.2})
    assert policy.choose(scores) == 32  # 12.4 expected tokens for 1.2 s beat 4.0 for 1 s
    drafted = policy.expected_drafted(scores)
    policy.record(4, path=[0, 2, 6, 20])
    assert policy.observed_at == {4: 1, 8: 2, 32: 3}
    assert policy.predicted_at == {b: pytest.approx(drafted[b]) for b in (4, 8, 32)}
    for _ in range(40):  # steps that accept nothing past node 4: the wider trees' extra nodes never pay
        policy.choose(scores)
        policy.record(3, path=[0, 1, 3])
    assert policy.calibration_at(32) < policy.calibration_at(4)
    assert policy.choose(scores) == 4  # each budget's learnt gain is the same 2 tokens: the cheapest wins
    small = BudgetPolicy((4, 8), {4: 1.0, 8: 1.0})
    small.choose(scores)
    small.record(2, path=[0, 1])  # a step at 8 informs 4 and 8, never a larger budget
    assert set(small.observed_at) == {4, 8}


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


def test_a_request_chooses_its_budget_when_served(demo_hf, tmp_path):
    """`--serve` (the Triton model's runner) on an engine with several verify profiles: a request may name any of
    its budgets or `auto`; the device loop serves the budget it was built for, the host loop the others; every
    greedy output equals autoregressive decoding; a budget the engine lacks, a malformed one, or a budget on an
    autoregressive server is that request's own error."""
    import io
    import json

    from builder.cli import main as build_main
    from engines.engine_dir import load_engine_dir
    from runner.factory import CheckpointWeights, RankOptions, local_ranks
    from runner.serving.serve import serve
    from runner.tokenizer import load_tokenizer

    out_dir = tmp_path / "engine"
    args = ["--model_dir", str(demo_hf / "kimi-k2-tiny"), "--draft_model_dir", str(demo_hf / "kimi-k2-tiny-dflash"),
            "--output_dir", str(out_dir), "--max_input_len", "64", "--max_seq_len", "512", "--no_onnx",
            "--extra_budgets", "16"]  # fmt: skip
    assert build_main(args) == 0
    engine = load_engine_dir(out_dir)
    assert engine.spec.budgets == (16, 32)
    tokenizer = load_tokenizer(engine.tokenizer_dir, 512)
    requests = [{"id": "default"}, {"id": "16", "ddtree_budget": "16"}, {"id": "auto", "ddtree_budget": "auto"},
                {"id": "chain", "ddtree_budget": 4}, {"id": "missing", "ddtree_budget": "24"},
                {"id": "bad", "ddtree_budget": "1.5"}]  # fmt: skip
    lines = "\n".join(json.dumps({"text_input": "Hello world", "max_tokens": 24, **r}) for r in requests)

    def served(autoregressive: bool, lines: str) -> dict:
        options = RankOptions(device="cpu", device_loop=True, autoregressive=autoregressive)
        ranks = local_ranks(CheckpointWeights(engine.checkpoint_dir), options, engine.spec, engine.build_config)
        out = io.StringIO()
        serve(Generator(ranks, autoregressive), tokenizer, engine, engine.spec, "torch", inp=io.StringIO(lines),
              out=out)  # fmt: skip
        ranks.close()
        return {e["id"]: e for e in map(json.loads, out.getvalue().splitlines()[1:]) if e["event"] != "tokens"}

    finals = served(False, lines)
    expected = served(True, json.dumps({"id": "ar", "text_input": "Hello world", "max_tokens": 24}))["ar"]
    for name in ("default", "16", "auto", "chain"):
        assert finals[name]["event"] == "done" and finals[name]["output_ids"] == expected["output_ids"], name
    assert finals["default"]["mode"] == "DDTree budget 32 (block 8), device loop (eager tensor program)"
    assert finals["16"]["mode"] == "DDTree budget 16 (block 8), host loop" and set(finals["16"]["budgets"]) == {16}
    assert finals["auto"]["mode"] == "DDTree budget auto of [16, 32] (block 8), host loop"
    assert set(finals["auto"]["budgets"]) <= {16, 32} and finals["chain"]["budgets"][0] == 4
    assert (
        "budget=24 needs a 25-token verify_tree profile; the engine verifies tree budgets [16, 32]"
        in (finals["missing"]["error"])
    )
    assert "ddtree_budget must be a tree budget (an integer >= 1) or auto, got '1.5'" in finals["bad"]["error"]
    on_ar = served(True, json.dumps({"id": "x", "text_input": "Hi", "max_tokens": 2, "ddtree_budget": 16}))["x"]
    assert "this server decodes autoregressively" in on_ar["error"]
