"""The cost-aware tree budget (runner/budget.py): its arithmetic, and `auto` generation staying lossless."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from engines.spec import BuildConfig, SpecConfig
from runner.budget import BudgetPolicy
from runner.generator import Generator
from runner.sampling import Sampler, SamplingParams
from runner.speculate import generate_autoregressive
from tests.conftest import ENGINE_LIMITS, cpu_ranks, fixed_cost_policy


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

    def steps(budget, seconds, count):
        for _ in range(count):
            policy.last = budget
            policy.record(3, seconds=seconds)

    # the machine runs 3x slower than at warm-up: every budget's cost with it, their ratios unchanged
    steps(4, 3.0, 7)
    assert policy.step_seconds == {4: pytest.approx(3.0), 8: pytest.approx(3.3), 32: pytest.approx(6.0)}
    # consecutive steps at budgets 4 and 8 while the machine's speed swings 4x: each pair says budget 8 costs twice
    # budget 4 (not the warm-up's 1.1), one step of 50 s among them does not move the median, and the speed does
    # not leak into the ratio
    for speed in [1.0, 4.0] * 32:
        steps(4, speed, 1)
        steps(8, 2.0 * speed, 1)
    steps(8, 50.0, 1)
    pairs, prior = len(policy.pairs[(4, 8)]), 4.0  # the fit: (pairs * ln 2 + prior / 2 * ln 1.1) / (pairs + prior / 2)
    assert pairs == 64
    ratio = np.exp((pairs * np.log(2.0) + prior / 2 * np.log(1.1)) / (pairs + prior / 2))
    costs = policy.step_seconds
    assert costs[8] / costs[4] == pytest.approx(ratio, rel=1e-6) and 1.95 < ratio < 2.0
    # budget 32, never paired, is not known to follow budget 4 or budget 8: its cost lies between its warm-up
    # ratios to them (2.0 / 1.0 and 2.0 / 1.1)
    assert costs[32] / costs[4] > 2.0 and costs[32] / costs[8] < 2.0 / 1.1
    # a new request's first step (its draft reads the whole prompt) is not learnt from, and the step after it is not
    # paired with the request before
    policy.start_sequence()
    timed, speed = dict(policy.timed), list(policy.speed)
    steps(4, 40.0, 1)
    assert policy.timed == timed and list(policy.speed) == speed and policy.step_seconds == costs
    steps(4, 0.5, 1)
    assert len(policy.pairs[(4, 8)]) == 64 and policy.timed[4] == timed[4] + 1
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


def test_costs_wrong_at_start_up_are_learnt_on_a_drifting_machine():
    """Start-up measured budgets 4 / 8 / 16 / 32 at 25.0 / 26.5 / 25.5 / 30.0 ms (a shared CPU's noise: a wider
    budget measured cheaper) where a step really costs 0.95 / 1 / 1.13 / 1.34 times budget 8's; the machine's speed
    then wanders over 2x and every step's time carries 10 % noise. Every step's tree expects what the trained pair's
    trees do at temperature 1 (drafted tokens 0.83 / 1.10 / 1.25 / 1.39, about 1 accepted), so at the start-up's
    costs budget 16 looks the best, where at the true costs budget 8 is, by 5 %. The policy samples the budgets
    within 10 % of the best until each has 16 timed steps, learns the ratios from consecutive steps, and moves to
    budget 8."""
    true = {4: 0.95, 8: 1.0, 16: 1.13, 32: 1.34}
    policy = BudgetPolicy((4, 8, 16, 32), {4: 0.0250, 8: 0.0265, 16: 0.0255, 32: 0.0300})
    scores = np.log(np.array([1.0] + [0.2075] * 4 + [0.0675] * 4 + [0.01875] * 8 + [0.00875] * 16))
    rng, log_speed, taken = np.random.default_rng(0), 0.0, []
    for _ in range(1500):
        budget = policy.choose(scores)
        log_speed = float(np.clip(log_speed + rng.normal(0, 0.03), -0.4, 0.4))
        drafted = rng.binomial(1, 0.5) + rng.binomial(1, 0.5 if budget > 4 else 0.3)  # 1 drafted token on average
        policy.record(1 + drafted, seconds=0.025 * true[budget] * np.exp(log_speed + rng.normal(0, 0.1)))
        taken.append(budget)
    expected = policy.expected(policy.expected_drafted(scores))
    rates = {b: expected[b] / true[b] for b in true}
    assert max(rates, key=rates.get) == 8 and max(rates[b] / rates[8] for b in (4, 16, 32)) < 0.97
    costs = policy.costs()
    assert Counter(taken[:16]).most_common(1)[0][0] == 16  # the start-up's costs steer the first steps
    for b in (16, 32):  # the budgets close to the best were paired with budget 8: their ratios are learnt
        assert costs[b] / costs[8] == pytest.approx(true[b], rel=0.04)
    assert policy.timed[16] >= 16 and policy.timed[32] >= 2
    assert taken[-1000:].count(8) >= 990


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


def test_each_segment_of_the_tree_is_calibrated_on_its_own():
    """A drafter too unsure of its first 4 nodes (each 0.5, always accepted) and far too sure of the rest (each 0.2
    on heavy-tailed steps, 0.05 on the others; a tail node is accepted once in 10 steps, whatever its probability).
    One factor for the whole tree (0.75: 820 accepted of 1100 expected) lifts a heavy tail's 5.6 expected tokens to
    4.2 and gives budget 32 6.7 tokens for 1.25x the cost (5.3 a unit of cost against 4.9 at budget 4); the tail's own
    factor (0.04) gives it 5.2 (4.1 a unit). Every heavy-tailed step takes budget 4, as it should."""
    heavy = np.log(np.array([1.0] + [0.5] * 4 + [0.2] * 28))
    light = np.log(np.array([1.0] + [0.5] * 4 + [0.05] * 28))
    policy = BudgetPolicy((4, 32), {4: 1.0, 32: 1.25})
    for step in range(200):  # steps at 32 (the only ones that inform its segment), half of them heavy-tailed
        tail = 1 if step % 10 == 0 else 0
        drafted = policy.expected_drafted(heavy if step % 2 else light)
        policy.observe({"budget": 32, "drafted": drafted, "accepted": {4: 4, 32: 4 + tail}}, 5 + tail)
    prior = 8 * policy.calibration  # PRIOR drafted tokens at the factor of all the steps
    assert policy.calibration == pytest.approx((820 + 8) / (1100 + 8))
    assert policy.calibration_at(4) == pytest.approx((800 + prior) / (400 + 8))  # 4 accepted of 2.0 expected
    assert policy.calibration_at(32) == pytest.approx((20 + prior) / (700 + 8))  # 20 tail tokens of 700 expected
    drafted = policy.expected_drafted(heavy)
    expected = policy.expected(drafted)
    assert expected[4] == pytest.approx(1 + policy.calibration_at(4) * 2.0)
    assert expected[32] == pytest.approx(expected[4] + policy.calibration_at(32) * 5.6)
    assert policy.best(drafted) == 4
    one_factor = (policy.observed_at[32] + prior) / (policy.predicted_at[32] + prior / policy.calibration)
    assert (1 + one_factor * drafted[32]) / 1.25 > expected[4]  # what one factor for the tree would have chosen
    assert policy.best(policy.expected_drafted(np.log(np.array([1.0] + [0.5] * 4 + [0.9] * 28)))) == 4
    # the device loop's choice reads the same factors (`device_inputs`) and chooses the same
    import torch

    from runner.device.budget import choose_budget

    costs, factors = policy.device_inputs()
    index = choose_budget(torch.tensor([drafted[4], drafted[32]], dtype=torch.float64),
                          torch.tensor(factors, dtype=torch.float64), torch.tensor(costs, dtype=torch.float64),
                          torch.tensor([-1]))  # fmt: skip
    assert int(index) == 0


def test_auto_budget_generation_equals_autoregressive(demo_ckpt):
    """`--ddtree_budget auto` in process: costs measured for every budget of the spec, every step verifies one of
    them, greedy output equals autoregressive decoding (the oracle)."""
    spec = SpecConfig(8, 32, extra_budgets=(4, 8, 16))
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS))
    prompt = [5, 77, 300, 12, 480, 33, 250, 9, 81]
    expected = generate_autoregressive(ranks, prompt, 40, Sampler(SamplingParams())).tokens
    auto_generation_equals(ranks, prompt, expected, "host loop")


def auto_generation_equals(ranks, prompt, expected, loop: str) -> None:
    """`--ddtree_budget auto` through the generator on `ranks` (closed after): costs measured for every budget,
    the mode says `loop`, greedy output equals `expected`, and every step took one of the budgets."""
    generator = Generator(ranks)
    costs = generator.enable_auto_budget(tokens=12)
    assert sorted(costs) == [4, 8, 16, 32] and all(c > 0 for c in costs.values())
    assert generator.mode() == f"DDTree budget auto of [4, 8, 16, 32] (block 8), {loop}"
    result = generator.generate(prompt, 40)
    ranks.close()
    assert result.tokens == expected
    assert result.budgets and set(result.budgets) <= {4, 8, 16, 32}
    # the policy that chose: the host loop's `BudgetPolicy`, or the device loop's `StepBudgetPolicy`
    policy = generator.step_policy if "device loop" in loop else generator.policy
    assert sum(policy.chosen.values()) >= len(result.budgets)


def test_auto_needs_several_budgets(demo_ckpt):
    ranks = cpu_ranks(demo_ckpt(1), SpecConfig(8, 32), BuildConfig(**ENGINE_LIMITS))
    try:
        with pytest.raises(ValueError, match=r"chooses among several tree budgets; this engine verifies only \[32\]"):
            Generator(ranks).enable_auto_budget()
    finally:
        ranks.close()


def test_a_request_chooses_its_budget_when_served(demo_hf, tmp_path):
    """`--serve` (the Triton model's runner) on an engine with several verify profiles: a request may name any of
    its budgets or `auto`; the device loop serves each of the engine's budgets and `auto` (one graph), the host loop
    other budgets (a chain of 4 here); every
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
        generator = Generator(ranks, autoregressive)
        generator.warm_up(serving=True)  # a server's warm-up measures `auto`'s costs, once
        if not autoregressive:
            assert generator.policy is not None and generator.step_policy is not None
            assert set(generator.warm_up_phases) == {"requests, greedy", "auto costs"}  # the startup report's parts

            def measured_again(*args, **kwargs):
                raise AssertionError("auto's costs measured again at a request")

            generator.measure_budgets = measured_again
        serve(generator, tokenizer, engine, engine.spec, "torch", inp=io.StringIO(lines), out=out)
        ranks.close()
        return {e["id"]: e for e in map(json.loads, out.getvalue().splitlines()[1:]) if e["event"] != "tokens"}

    finals = served(False, lines)
    expected = served(True, json.dumps({"id": "ar", "text_input": "Hello world", "max_tokens": 24}))["ar"]
    for name in ("default", "16", "auto", "chain"):
        assert finals[name]["event"] == "done" and finals[name]["output_ids"] == expected["output_ids"], name
    assert finals["default"]["mode"] == "DDTree budget 32 (block 8), device loop (eager tensor program)"
    on_device = "device loop (eager tensor program)"
    assert finals["16"]["mode"] == f"DDTree budget 16 (block 8), {on_device}" and set(finals["16"]["budgets"]) == {16}
    assert set(finals["default"]["budgets"]) == {32}
    assert finals["auto"]["mode"] == f"DDTree budget auto of [16, 32] (block 8), {on_device}"
    assert finals["chain"]["mode"] == "DDTree budget 4 (block 8), host loop"
    assert set(finals["auto"]["budgets"]) <= {16, 32} and finals["chain"]["budgets"][0] == 4
    assert (
        "budget=24 needs a 25-token verify_tree profile; the engine verifies tree budgets [16, 32]"
        in (finals["missing"]["error"])
    )
    assert "ddtree_budget must be a tree budget (an integer >= 1) or auto, got '1.5'" in finals["bad"]["error"]
    on_ar = served(True, json.dumps({"id": "x", "text_input": "Hi", "max_tokens": 2, "ddtree_budget": 16}))["x"]
    assert "this server decodes autoregressively" in on_ar["error"]


def test_the_device_choice_is_the_host_policys():
    """The device loop's choice (`runner/device/budget.py`) on the largest budget's tree: for each budget b its
    active nodes are the host's best-first tree of budget b (`build_tree` at b), E_b is the host policy's, and the
    budget chosen is the one the host policy chooses, for costs and calibrations that favour each budget in turn."""
    import torch

    from runner.device.budget import choose_budget, expected_drafted, node_scores, rank_nodes
    from runner.device.tree import build_tree_device, top_logprobs
    from runner.tree import build_tree

    budgets = (4, 8, 16, 32)
    gen = torch.Generator().manual_seed(3)
    for trial in range(6):
        logits = torch.randn(7, 300, generator=gen) * (1.0 + trial)  # sharper drafts as trials go on
        values, ids = top_logprobs(logits, 32)
        tokens, parents, depths, mask, _ = build_tree_device(values, ids, 32, torch.tensor([1]), 33)
        rank, ordered = rank_nodes(node_scores(tokens, depths, mask, values, ids))

        def paths(keep, tokens=tokens, parents=parents):
            found = set()
            for node in keep:
                path, at = [], int(node)
                while at > 0:
                    path.append(int(tokens[at]))
                    at = int(parents[at])
                found.add(tuple(reversed(path)))
            return found

        host_top = values.numpy().astype(np.float64), ids.numpy()
        for b in budgets:
            tree = build_tree(host_top[0][:, :b], host_top[1][:, :b], b, 1, rows=b + 1)
            host_paths = {
                tuple(int(tree.tokens[n]) for n in _ancestry(tree.parents, node)) for node in range(tree.num_nodes)
            }
            assert paths(torch.nonzero(rank <= b).flatten().tolist()) == host_paths, (trial, b)
        full = build_tree(host_top[0], host_top[1], 32, 1, rows=33)
        policy = BudgetPolicy(budgets, {4: 1.0, 8: 1.2, 16: 1.6, 32: 2.4})
        host_drafted = policy.expected_drafted(full.scores)
        drafted = expected_drafted(ordered, torch.tensor(budgets))
        assert drafted.tolist() == pytest.approx([host_drafted[b] for b in budgets], rel=1e-5)
        for costs in ({4: 1.0, 8: 1.2, 16: 1.6, 32: 2.4}, {4: 1.0, 8: 1.0, 16: 1.0, 32: 1.0}, {4: 1.0, 8: 3.0,
                      16: 9.0, 32: 27.0}, {4: 1.0, 8: 1.01, 16: 1.02, 32: 1.03}):  # fmt: skip
            policy = BudgetPolicy(budgets, dict(costs))
            cost_list, calibration = policy.device_inputs()
            auto = choose_budget(drafted, torch.tensor(calibration, dtype=torch.float64),
                                 torch.tensor(cost_list, dtype=torch.float64), torch.tensor([-1]))  # fmt: skip
            assert budgets[int(auto)] == policy.best(host_drafted), (trial, costs)
        fixed = choose_budget(drafted, torch.ones(4, dtype=torch.float64), torch.ones(4, dtype=torch.float64),
                              torch.tensor([1]))  # fmt: skip
        assert int(fixed) == 1


def _ancestry(parents, node):
    """The nodes from the root's child down to `node`."""
    chain = []
    while node > 0:
        chain.append(node)
        node = int(parents[node])
    return list(reversed(chain))


def test_rows_outside_the_steps_budget_add_no_expert():
    """`Router.row_active`: inactive rows take row 0's experts with zero weight; the active rows' output is the
    same as without the limit."""
    import torch

    from models.layout import rank_target_shapes
    from models.moe import MoE
    from models.parallel import SingleRank
    from models.presets import preset
    from models.random_weights import random_state, router_in_fp32
    from runner.factory import cpu_ops

    config = preset("kimi-k2", smoke=True).target  # 16 experts, top-8
    prefix = "model.layers.1.mlp."
    shapes = {k[len(prefix) :]: v for k, v in rank_target_shapes(config).items() if k.startswith(prefix)}
    with torch.device("meta"):
        moe = MoE(config, 1, cpu_ops(SingleRank()))
    moe.load_state_dict(router_in_fp32(random_state(shapes, seed=2)), strict=True, assign=True)
    torch.manual_seed(0)
    x = torch.randn(9, config.hidden_size)
    with torch.no_grad():
        full = moe(x)
    ids, _ = moe.gate(x)
    active = torch.tensor([True, True, False, True, False, False, True, False, False])
    moe.gate.row_active = active
    with torch.no_grad():
        limited_ids, weights = moe.gate(x)
        limited = moe(x)
    moe.gate.row_active = None
    assert torch.equal(limited_ids[active], ids[active]) and (limited_ids[~active] == ids[0]).all()
    assert (weights[~active] == 0).all()
    torch.testing.assert_close(limited[active], full[active])
    assert set(limited_ids.flatten().tolist()) == set(ids[active].flatten().tolist())


def steep_policy():
    """Budget 4 a hundredth of the others' cost, whatever the steps take."""
    return fixed_cost_policy({4: 1.0, 8: 100.0, 16: 200.0, 32: 400.0})


@pytest.mark.parametrize("tp_size", [1, 2])
def test_auto_budget_on_the_device_loop_equals_autoregressive(demo_ckpt, tp_size):
    """Several budgets on the device loop, a graph each: fixed budgets and `auto` (each step's budget named at its
    launch by the `StepBudgetPolicy`) all give autoregressive decoding's tokens, on every rank alike; the policy
    learns acceptance from the steps at the largest budget and each budget's cost from its steps' times."""
    from runner.device.loop import generate_on_device

    spec = SpecConfig(8, 32, extra_budgets=(4, 8, 16))
    ranks = cpu_ranks(demo_ckpt(tp_size), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True)
    prompt = [5, 77, 300, 12, 480, 33, 250, 9, 81]
    expected = generate_autoregressive(ranks, prompt, 40, Sampler(SamplingParams())).tokens
    for budget in (4, 16, 32):
        result = generate_on_device(ranks, spec, prompt, 40, 512, budget=budget)
        assert result.tokens == expected and set(result.budgets) == {budget}, budget
    # the largest budget until its steps informed the acceptance estimates, then by measured cost
    from runner.device.budget import StepBudgetPolicy

    flat = StepBudgetPolicy((4, 8, 16, 32))
    result = generate_on_device(ranks, spec, prompt, 40, 512, budget="auto", policy=flat)
    assert result.tokens == expected and result.budgets[:4] == [32] * 4 and set(result.budgets) <= {4, 8, 16, 32}
    # every collected step recorded (the one launched past the end is not); the widest informed every budget
    assert sum(len(t) for t in flat.times.values()) == len(result.budgets)
    # a lone request's narrower steps report nothing: every budget's estimate is from the widest steps
    assert flat.informed == dict.fromkeys((4, 8, 16, 32), result.budgets.count(32))
    assert sum(flat.chosen.values()) >= len(result.budgets)
    assert flat.accepted[32] == sum(a - 1 for b, a in zip(result.budgets, result.accept_lengths) if b == 32)
    steep = steep_policy()
    result = generate_on_device(ranks, spec, prompt, 40, 512, budget="auto", policy=steep)
    assert result.tokens == expected and set(result.budgets) == {4, 32}
    assert result.budgets.count(4) > result.budgets.count(32)  # the largest only to learn acceptance
    auto_generation_equals(ranks, prompt, expected, "device loop (eager tensor program)")


def test_a_narrow_step_verifies_only_its_own_nodes(demo_ckpt):
    """With a drafter that always knows the continuation (the benchmarks' oracle probe), budget b accepts
    min(b, block - 1) drafted tokens a step plus the bonus, fixed or chosen by `auto` step by step: a step verifies
    its own budget's tree."""
    import torch

    from runner.device.loop import generate_on_device
    from runner.probes import Probes

    spec = SpecConfig(8, 32, extra_budgets=(4, 8, 16))
    prompt = [5, 77, 300, 12, 480, 33, 250]
    reference = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS))
    expected = generate_autoregressive(reference, prompt, 60, Sampler(SamplingParams())).tokens
    reference.close()
    probes = Probes(oracle=torch.tensor(expected))
    ranks = cpu_ranks(demo_ckpt(1), spec, BuildConfig(**ENGINE_LIMITS), device_loop=True, probes=probes)
    for budget, accepted in ((4, 5), (8, 8), (32, 8)):
        result = generate_on_device(ranks, spec, prompt, 60, 512, budget=budget)
        assert result.tokens == expected and result.accept_lengths[:-1] == [accepted] * (len(result.accept_lengths) - 1)
    steep = steep_policy()
    result = generate_on_device(ranks, spec, prompt, 60, 512, budget="auto", policy=steep)
    ranks.close()
    assert result.tokens == expected and set(result.budgets) == {4, 32}
    for budget, accepted in list(zip(result.budgets, result.accept_lengths))[:-1]:
        assert accepted == min(budget, 7) + 1, (budget, accepted)


def test_a_narrower_tree_tells_every_budget_up_to_its_own_what_the_largest_tells():
    """Best-first, the tree of budget b is the b best nodes of the largest budget's, so a step at b tells every
    budget up to b what a step at the largest would (the drafter's expected accepted tokens, and what the target's
    choices accept among each budget's nodes): what a batch's narrower steps report (`BatchLoop._rank`). The
    batched ranking and counts equal each tree's own."""
    import torch

    from runner.device.budget import (
        accepted_at,
        accepted_at_batched,
        expected_drafted,
        node_scores,
        node_scores_batched,
        rank_nodes,
    )
    from runner.device.tree import accept_greedy_batched, build_tree_device, top_logprobs

    budgets, depth = torch.tensor((4, 8, 16, 32)), 7
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, depth, 300, generator=gen) * 4.0
    # the target's continuation: drawn from the drafter's own distribution, so it often leaves its best token
    truth = torch.multinomial(logits.softmax(-1).flatten(0, 1), 1, generator=gen).view(3, depth)  # seeded

    def step(budget):
        """Each tree's (rank, ordered scores, path, length) per tree, and the stacked trees and top candidates."""
        tops = [top_logprobs(logits[t], budget) for t in range(3)]
        trees = [build_tree_device(v, i, budget, torch.tensor([1]), budget + 1) for v, i in tops]
        tokens, parents, depths, masks = (torch.stack(parts) for parts in zip(*(tree[:4] for tree in trees)))
        choices = torch.where(depths < depth, truth.gather(1, depths.clamp_max(depth - 1)), -1)
        path, length, _ = accept_greedy_batched(tokens, parents, depths, masks, choices, depth)
        own = [rank_nodes(node_scores(tree[0], tree[2], tree[3], *top)) for tree, top in zip(trees, tops)]
        values, ids = (torch.stack(parts) for parts in zip(*tops))
        rank, ordered = rank_nodes(node_scores_batched(tokens, depths, masks, values, ids))
        for t, (r, o) in enumerate(own):  # the batched ranking is each tree's own (its sums may round apart)
            assert torch.equal(rank[t], r)
            torch.testing.assert_close(ordered[t], o, rtol=1e-6, atol=1e-6)
            counts = accepted_at(r, path[t], length[t : t + 1], budgets)
            assert torch.equal(accepted_at_batched(rank, path, length, budgets)[t], counts)
        return expected_drafted(ordered, budgets), accepted_at_batched(rank, path, length, budgets)

    full_drafted, full_accepted = step(32)
    assert len(set(full_accepted.flatten().tolist())) > 2  # the paths reach nodes past budget 4's and 8's
    for budget in (4, 8, 16):
        drafted, accepted = step(budget)
        told = budgets <= budget
        assert torch.equal(accepted[:, told], full_accepted[:, told]), budget
        torch.testing.assert_close(drafted[:, told], full_drafted[:, told], rtol=1e-6, atol=1e-9)
