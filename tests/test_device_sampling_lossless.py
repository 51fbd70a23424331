"""Sampled speculative decoding on the device loop is lossless: the first tokens it emits are distributed as the
target's own samples, by an independent definition (transformers' model and logits warpers, not the project's
sampler), chi-square at level 0.001. A drafter that follows the target makes multi-node acceptance frequent, so
the tree walk is exercised, not only the root's draw; deliberately broken variants are rejected by the same test.

Run eagerly on the CPU (the tensor program a CUDA graph captures on a GPU)."""

import numpy as np
import pytest
import torch
import transformers
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from benchmarks.sampling_lossless_gpu import BROKEN  # the broken variants, patched on the device loop
from benchmarks.sampling_lossless_gpu import gof as p_value  # chi-square goodness of fit, small cells merged
from engines.spec import BuildConfig, SpecConfig
from runner.device.loop import generate_on_device
from runner.sampling import SamplingParams
from tests.conftest import cpu_ranks, fixed_cost_policy

PROMPT = [5, 77, 300, 12, 480, 33, 250]
SPEC = SpecConfig(4, 8)  # depth 3: three drafted levels, up to 8 nodes
RUNS, LEVEL = 600, 1e-3
PARAMS = dict(temperature=1.0, top_k=6)


@pytest.fixture(scope="module")
def hf_model(demo_hf):
    return transformers.DeepseekV3ForCausalLM.from_pretrained(demo_hf / "kimi-k2-tiny", dtype=torch.float32).eval()


def warped_probs(hf_model, sequence: list[int], temperature: float, top_k: int) -> torch.Tensor:
    with torch.no_grad():
        logits = hf_model(torch.tensor([sequence])).logits[0, -1:].double()
    return torch.softmax(TopKLogitsWarper(top_k)(None, TemperatureLogitsWarper(temperature)(None, logits)), -1)[0]


def exact(hf_model, temperature: float, top_k: int, prompt: list[int] = PROMPT):
    """p(t1, t2) and p(t3) of the target's own sampling."""
    p1 = warped_probs(hf_model, prompt, temperature, top_k)
    joint, third = {}, torch.zeros_like(p1)
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = warped_probs(hf_model, prompt + [t1], temperature, top_k)
        for t2 in torch.nonzero(p2).flatten().tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
            third += p1[t1] * p2[t2] * warped_probs(hf_model, prompt + [t1, t2], temperature, top_k)
    return joint, {t: float(p) for t, p in enumerate(third) if p > 0}


def follow_the_target(loop, hf_model, spec=SPEC):
    """The loop's drafter still runs (its caches evolve as in production), then its logits are replaced by the
    target's along its greedy continuation of the sequence so far, plus noise: drafts are often, not always, right."""
    history = list(PROMPT)
    noise = torch.Generator().manual_seed(0)

    def draft():
        real_draft()
        sequence, rows = history + [int(loop.bonus)], []
        with torch.no_grad():
            for _ in range(spec.draft_depth):
                logits = hf_model(torch.tensor([sequence])).logits[0, -1]
                rows.append(logits)
                sequence.append(int(logits.argmax()))
        logits = torch.stack(rows)
        loop.draft_logits = logits + torch.randn(logits.shape, generator=noise)

    def accept():
        real_accept()
        count = int(loop.emitted[-1])
        history.extend([int(loop.bonus_before)] + loop.emitted[: count - 1].tolist())

    def remember_bonus():
        loop.bonus_before = int(loop.bonus)

    real_draft, real_accept = loop._draft, loop._accept
    loop.groups = [[remember_bonus, draft, loop._tree, loop._verify, accept]]


def sample_counts(ranks, hf_model, params, runs=RUNS, spec=SPEC, budgets=None, **options):
    """Counts of (t1, t2) and t3 over `runs` seeds, and the first step's mean accept length; `options`: more
    `generate_on_device` arguments (budget, policy); the first steps' budgets are appended to `budgets`."""
    loop = ranks.lead.loop
    joint, third, accepted, groups = {}, {}, [], loop.groups
    budgets = [] if budgets is None else budgets
    try:
        for seed in range(runs):
            follow_the_target(loop, hf_model, spec)
            result = generate_on_device(ranks, spec, PROMPT, 3, 512, params=SamplingParams(**params, seed=seed),
                                        **options)  # fmt: skip
            t1, t2, t3 = result.tokens
            joint[(t1, t2)] = joint.get((t1, t2), 0) + 1
            third[t3] = third.get(t3, 0) + 1
            accepted.append(result.accept_lengths[0])
            budgets.extend(result.budgets[:1])
    finally:
        loop.groups = groups
    return joint, third, float(np.mean(accepted))


@pytest.fixture(scope="module")
def ranks(demo_ckpt):
    engine = cpu_ranks(demo_ckpt(1), SPEC, BuildConfig(max_input_len=64, max_seq_len=512), device_loop=True)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def expected(hf_model):
    return exact(hf_model, **PARAMS)


@pytest.mark.slow
def test_sampled_device_steps_are_lossless(ranks, hf_model, expected):
    joint, third, accepted = sample_counts(ranks, hf_model, PARAMS)
    assert accepted > 1.5  # drafted nodes were accepted: the walk, not only the root's draw, is tested
    assert p_value(joint, expected[0]) > LEVEL and p_value(third, expected[1]) > LEVEL
    colder = exact(hf_model, temperature=0.7, top_k=6)  # the test has power against a nearby distribution
    assert p_value(joint, colder[0]) < LEVEL


@pytest.mark.slow
@pytest.mark.parametrize("broken", list(BROKEN))
def test_broken_samplers_are_rejected(ranks, hf_model, expected, broken):
    """The GPU test's broken variants (`benchmarks/sampling_lossless_gpu.py`: greedy acceptance at temperature 1,
    the temperature applied twice, the bonus redrawn without removing the rejected children), patched on the device
    loop the same way, are rejected here too."""
    patch, temperature = BROKEN[broken]
    params = {**PARAMS, "temperature": temperature}
    reference = expected if temperature == PARAMS["temperature"] else exact(hf_model, **params)
    undo = patch()
    try:
        joint, third, _ = sample_counts(ranks, hf_model, params, runs=300)
    finally:
        undo()
    assert min(p_value(joint, reference[0]), p_value(third, reference[1])) < LEVEL


@pytest.mark.slow
def test_sampled_steps_with_a_budget_chosen_per_step_are_lossless(demo_ckpt, hf_model, expected):
    """Several budgets on the device loop, `auto`: each step verifies the tree of the budget the policy names at its
    launch (a graph each); the narrower trees must not bias the walk."""
    spec = SpecConfig(4, 8, extra_budgets=(2, 4))
    engine = cpu_ranks(demo_ckpt(1), spec, BuildConfig(max_input_len=64, max_seq_len=512), device_loop=True)
    policy, budgets = fixed_cost_policy({2: 1.0, 4: 2.0, 8: 4.0}), []
    try:
        joint, third, accepted = sample_counts(engine, hf_model, PARAMS, spec=spec, budget="auto", policy=policy,
                                               budgets=budgets)  # fmt: skip
    finally:
        engine.close()
    # the first steps take the largest budget until the policy has learnt acceptance; what matters is that narrow
    # steps were sampled too
    assert min(budgets) < max(spec.budgets), set(budgets)
    assert accepted > 1.3
    assert p_value(joint, expected[0]) > LEVEL and p_value(third, expected[1]) > LEVEL


def test_a_seed_reproduces_its_tokens_and_seeds_differ(ranks):
    sampled = [generate_on_device(ranks, SPEC, PROMPT, 12, 512, params=SamplingParams(1.0, 0, 1.0, s)).tokens
               for s in (3, 3, 4)]  # fmt: skip
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]


@pytest.mark.slow
def test_sampled_requests_in_a_batch_are_lossless(demo_ckpt, hf_model, expected):
    """Sampled requests sharing batched steps (four a step, two prompts in alternate slots, each request with its own
    seed; `runner/device/batch.py`): each prompt's first three tokens follow the target's own sampling for that
    prompt (chi-square at the same level), so no slot reads another's rows or draws."""
    from runner.generator import Generator

    other = [9, 400, 33, 77, 5]
    laws = {tuple(PROMPT): expected, tuple(other): exact(hf_model, **PARAMS, prompt=other)}
    engine = cpu_ranks(demo_ckpt(1), SPEC, BuildConfig(max_input_len=64, max_seq_len=512), device_loop=True,
                       max_batch_size=4)  # fmt: skip
    generator = Generator(engine)
    counts = {prompt: ({}, {}) for prompt in laws}
    try:
        for start in range(0, 2 * RUNS, 4):
            prompts = [PROMPT, other, PROMPT, other]
            params = [SamplingParams(**PARAMS, seed=seed) for seed in range(start, start + 4)]
            for prompt, result in zip(prompts, generator.generate_many(prompts, 3, params)):
                joint, third = counts[tuple(prompt)]
                t1, t2, t3 = result.tokens
                joint[(t1, t2)] = joint.get((t1, t2), 0) + 1
                third[t3] = third.get(t3, 0) + 1
    finally:
        engine.close()
    for prompt, (joint, third) in counts.items():
        assert p_value(joint, laws[prompt][0]) > LEVEL and p_value(third, laws[prompt][1]) > LEVEL, prompt
    # power: the two prompts' laws differ, and each prompt's draws reject the other's
    assert p_value(counts[tuple(PROMPT)][0], laws[tuple(other)][0]) < LEVEL


def banned_law(hf_model, banned: tuple[int, ...], temperature: float, top_k: int, ban_first: bool = True) -> dict:
    """p(t1, t2) of the target's own sampling with `banned` tokens never emitted, by transformers: its
    `NoBadWordsLogitsProcessor` before the temperature and top-k warpers, as `generate(bad_words_ids=...)` orders
    them (ban_first=False: the ban after the top-k, a broken order with fewer than k candidates left)."""
    from transformers.generation.logits_process import NoBadWordsLogitsProcessor

    ban = NoBadWordsLogitsProcessor([[t] for t in banned])

    def probs(sequence):
        ids = torch.tensor([sequence])
        with torch.no_grad():
            scores = hf_model(ids).logits[0, -1:].double()
        if ban_first:
            scores = ban(ids, scores)
        scores = TopKLogitsWarper(top_k)(ids, TemperatureLogitsWarper(temperature)(ids, scores))
        if not ban_first:
            scores = ban(ids, scores)
        return torch.softmax(scores, -1)[0]

    p1, joint = probs(PROMPT), {}
    for t1 in torch.nonzero(p1).flatten().tolist():
        p2 = probs(PROMPT + [t1])
        joint.update({(t1, t2): float(p1[t1] * p2[t2]) for t2 in torch.nonzero(p2).flatten().tolist()})
    return joint


@pytest.mark.slow
def test_sampled_requests_with_bad_words_follow_the_banned_law(demo_ckpt, hf_model):
    """A sampled speculative request with bad words (the host loop's sampler: `Generator.on_device` sends banned
    tokens there) emits its first two tokens as the target's own sampling with those tokens banned, by transformers'
    definition; the law without the ban and the ban applied after the top-k are rejected by the same test."""
    from runner.generator import Generator

    top = warped_probs(hf_model, PROMPT, **PARAMS).argsort(descending=True).tolist()
    banned = (top[0], top[2])  # the most probable first token and another one among the top k
    law = banned_law(hf_model, banned, **PARAMS)
    engine = cpu_ranks(demo_ckpt(1), SPEC, BuildConfig(max_input_len=64, max_seq_len=512))
    generator = Generator(engine)
    assert not generator.on_device(SamplingParams(**PARAMS), banned)
    joint = {}
    try:
        for seed in range(RUNS):
            tokens = generator.generate(PROMPT, 2, SamplingParams(**PARAMS, seed=seed), banned=banned).tokens
            joint[tuple(tokens)] = joint.get(tuple(tokens), 0) + 1
    finally:
        engine.close()
    assert not {t for pair in joint for t in pair} & set(banned)
    assert p_value(joint, law) > LEVEL
    assert p_value(joint, exact(hf_model, **PARAMS)[0]) < LEVEL  # no ban
    assert p_value(joint, banned_law(hf_model, banned, **PARAMS, ban_first=False)) < LEVEL  # banned after top-k


def test_a_sampled_request_stops_right_after_its_stop_sequence(ranks):
    """The stop-sequence path of a sampled request on the device loop: with the same seed, the request ends right
    after the first occurrence of a stop sequence taken from its own draws, the tokens before it unchanged."""
    from runner.generator import Generator

    params = SamplingParams(**PARAMS, seed=11)
    generator = Generator(ranks)
    assert generator.on_device(params)
    full = generator.generate(PROMPT, 40, params).tokens
    stop = tuple(full[20:22])
    first = next(i for i in range(len(full) - 1) if tuple(full[i : i + 2]) == stop)
    stopped = generator.generate(PROMPT, 40, params, stop_sequences=(stop,)).tokens
    assert stopped == full[: first + 2]
