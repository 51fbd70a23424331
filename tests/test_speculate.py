"""The spine: speculative decoding is lossless (greedy: token for token; sampling: in distribution)."""

import numpy as np
import pytest
import torch
import transformers  # a test dependency: missing, these tests fail (not skip)

from engines.spec import BuildConfig, SpecConfig
from runner.sampling import Sampler, SamplingParams, sampling_probs
from runner.speculate import check_request, generate, generate_autoregressive
from tests.conftest import cpu_ranks
from tests.oracle import TargetDraftRanks

PROMPTS = [[5, 77, 300, 12, 480, 33, 250], [1, 2, 3], [200, 201, 9, 88, 17, 400, 402, 300, 11, 63, 5]]
BUILD = BuildConfig(max_input_len=64, max_seq_len=512)
GREEDY = SamplingParams()


@pytest.fixture(scope="module")
def hf_model(demo_hf):
    return transformers.DeepseekV3ForCausalLM.from_pretrained(demo_hf / "kimi-k2-tiny", dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engines(demo_ckpt):
    made = {}

    def get(block_size, budget, max_topk=None):
        key = (block_size, budget, max_topk)
        if key not in made:
            made[key] = cpu_ranks(demo_ckpt(1), SpecConfig(block_size, budget, max_topk), BUILD)
        return made[key]

    yield get
    for engine in made.values():
        engine.close()


@pytest.fixture(scope="module")
def autoregressive(engines):
    engine = engines(8, 32)
    return [generate_autoregressive(engine, p, 128, Sampler(GREEDY)).tokens for p in PROMPTS]


def test_autoregressive_reference_equals_transformers_greedy(hf_model, autoregressive):
    for prompt, tokens in zip(PROMPTS[:2], autoregressive):
        out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)
        assert out[0, len(prompt) :].tolist() == tokens[:48]


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("budget", [1, 4, 7, 8, 32, 64])
def test_greedy_speculative_equals_autoregressive(engines, autoregressive, block_size, budget):
    spec = SpecConfig(block_size, budget)
    for prompt, expected in zip(PROMPTS, autoregressive):
        result = generate(engines(block_size, budget), prompt, 128, spec, Sampler(GREEDY))
        assert result.tokens == expected
        assert result.target_forwards == len(result.accept_lengths) + 1
        assert all(1 <= a <= block_size for a in result.accept_lengths)


@pytest.mark.parametrize(
    ("block_size", "budget", "max_topk", "noise"),
    [(8, 32, None, 2.0), (8, 7, 1, 1.0), (16, 64, 4, 3.0), (8, 4, None, 0.5)],
)
def test_greedy_lossless_with_frequent_acceptance(
    engines, autoregressive, hf_model, block_size, budget, max_topk, noise
):
    spec = SpecConfig(block_size, budget, max_topk)
    oracle = TargetDraftRanks(engines(block_size, budget, max_topk), hf_model, depth=block_size - 1, noise=noise)
    for prompt, expected in zip(PROMPTS[:2], autoregressive):
        result = generate(oracle, prompt, 128, spec, Sampler(GREEDY))
        assert result.tokens == expected
        assert max(result.accept_lengths) >= 3  # multi-node paths really were accepted


def test_exact_oracle_accepts_whole_blocks(engines, autoregressive, hf_model):
    spec = SpecConfig(8, 7, max_topk=1)  # plain DFlash: a chain of block_size - 1 drafts
    result = generate(TargetDraftRanks(engines(8, 7, 1), hf_model, depth=7), PROMPTS[0], 64, spec, Sampler(GREEDY))
    assert result.tokens == autoregressive[0][:64]
    assert result.accept_lengths[:-1] == [8] * (len(result.accept_lengths) - 1)
    assert result.tokens_per_target_forward > 6


def _warped(logits, params):
    """transformers' definition of the sampled distribution (not the project's `sampling_probs`)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    scores = TemperatureLogitsWarper(params.temperature)(None, logits.double())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


def _exact_distributions(hf_model, prompt, params):
    """Exact p(t1, t2) and p(t3) of the target's own sampling."""
    with torch.no_grad():
        p1 = _warped(hf_model(torch.tensor([prompt])).logits[0, -1:], params)[0]
        joint, third = {}, torch.zeros_like(p1)
        for t1 in torch.nonzero(p1).flatten().tolist():
            p2 = _warped(hf_model(torch.tensor([prompt + [t1]])).logits[0, -1:], params)[0]
            for t2 in torch.nonzero(p2).flatten().tolist():
                joint[(t1, t2)] = float(p1[t1] * p2[t2])
                p3 = _warped(hf_model(torch.tensor([prompt + [t1, t2]])).logits[0, -1:], params)[0]
                third += p1[t1] * p2[t2] * p3
    return joint, {t: float(p) for t, p in enumerate(third) if p > 0}


def _chi_square_p(observed: dict, expected: dict, runs: int) -> float:
    """Pearson chi-square p-value; bins expected below 5 counts are merged."""
    from scipy.stats import chisquare

    big = [k for k, p in expected.items() if p * runs >= 5]
    obs = [observed.get(k, 0) for k in big] + [runs - sum(observed.get(k, 0) for k in big)]
    exp = [expected[k] * runs for k in big] + [runs * (1 - sum(expected[k] for k in big))]
    return float(chisquare(obs, exp).pvalue)


@pytest.mark.slow
def test_sampling_is_lossless_chi_square(engines, hf_model):
    """At temperature 1 / top-k 6, the first speculative token (with the first, jointly) and the next one are
    distributed as the target's own samples: chi-square at significance 0.001, 600 seeded runs."""
    params = SamplingParams(temperature=1.0, top_k=6)
    spec, prompt, runs = SpecConfig(4, 8), PROMPTS[0], 600
    oracle = TargetDraftRanks(engines(4, 8), hf_model, depth=3, noise=1.0)
    joint, third = _exact_distributions(hf_model, prompt, params)
    seen_joint, seen_third, accepted = {}, {}, []
    for seed in range(runs):
        result = generate(oracle, prompt, 3, spec, Sampler(SamplingParams(1.0, 6, 1.0, seed)))
        t1, t2, t3 = result.tokens
        seen_joint[(t1, t2)] = seen_joint.get((t1, t2), 0) + 1
        seen_third[t3] = seen_third.get(t3, 0) + 1
        accepted.append(result.accept_lengths[0])
    assert _chi_square_p(seen_joint, joint, runs) > 1e-3
    assert _chi_square_p(seen_third, third, runs) > 1e-3
    assert np.mean(accepted) > 1.5  # drafted nodes were accepted, not only bonus tokens sampled
    # the test has power: the same counts against a slightly different distribution are rejected
    colder, _ = _exact_distributions(hf_model, prompt, SamplingParams(temperature=0.7, top_k=6))
    assert _chi_square_p(seen_joint, colder, runs) < 1e-3


def test_sampling_probs_definition():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0]])
    probs = sampling_probs(logits, SamplingParams(temperature=0.5, top_k=3, top_p=0.9))
    scaled = torch.softmax(torch.tensor([2.0, 1.0, 0.5]) / 0.5, -1)  # top-3, then nucleus 0.9 keeps the first two
    expected = torch.zeros(5)
    expected[:2] = scaled[:2] / scaled[:2].sum()
    assert torch.allclose(probs[0], expected)


def test_end_token_and_max_new_tokens(engines, autoregressive):
    spec = SpecConfig(8, 32)
    expected = autoregressive[0]
    end = expected[9]
    result = generate(engines(8, 32), PROMPTS[0], 128, spec, Sampler(GREEDY), end_ids={end})
    assert result.tokens == expected[: expected.index(end) + 1]
    streamed = []
    result = generate(engines(8, 32), PROMPTS[0], 5, spec, Sampler(GREEDY), on_tokens=streamed.extend)
    assert result.tokens == expected[:5] == streamed


def test_request_limits_are_checked():
    with pytest.raises(ValueError, match="prompt of 70 tokens is longer than the engine's max_input_len=64"):
        check_request(70, 10, 64, 512, 8)
    with pytest.raises(ValueError, match=r"prompt \(60\) \+ max_output_len \(450\) \+ one draft block \(8\) = 518"):
        check_request(60, 450, 64, 512, 8)
    with pytest.raises(ValueError, match="the prompt is empty"):
        check_request(0, 10, 64, 512, 8)
