"""The device loop's sampler (runner/device/sampling.py) against an independent definition: transformers' temperature,
top-k and top-p logits warpers on the same logits. Goodness of fit of 20000 draws (the counter-based noise makes one
row of the batch one independent draw), each setting alone and combined; the same counts must reject deliberately
broken samplers (the temperature applied twice, top-k + 1), so the test has power."""

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from runner.device.sampling import counter_uniform, filter_kind, sample_tokens
from runner.sampling import SamplingParams

DRAWS, VOCAB, LEVEL = 20000, 64, 1e-3
LOGITS = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(0)) * 0.8


def tensor(value, dtype=torch.float32):
    return torch.tensor([value], dtype=dtype)


def draw(temperature, top_k, top_p, seed=11, counter=0, logits=LOGITS):
    """As the device loop draws: with the filter kind of the request."""
    tokens = sample_tokens(logits.expand(DRAWS, -1), tensor(temperature), tensor(top_k, torch.int64), tensor(top_p),
                           tensor(seed, torch.int64), tensor(counter, torch.int64),
                           filter=filter_kind(SamplingParams(temperature, top_k, top_p)))  # fmt: skip
    return torch.bincount(tokens, minlength=logits.shape[-1]).double()


def warped(temperature, top_k, top_p):
    """transformers' definition: temperature, then top-k, then top-p (the order its generate applies them)."""
    scores = TemperatureLogitsWarper(temperature)(None, LOGITS.double())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)[0]


def p_value(counts, probs) -> float:
    """Pearson chi-square; bins expected below 5 merged; a draw outside the support is p = 0."""
    if counts[probs == 0].sum() > 0:
        return 0.0
    expected = probs * counts.sum()
    big = expected >= 5
    observed = np.append(counts[big].numpy(), counts[~big].sum().item())
    wanted = np.append(expected[big].numpy(), expected[~big].sum().item())
    if wanted[-1] == 0:
        observed, wanted = observed[:-1], wanted[:-1]
    return float(chisquare(observed, wanted * observed.sum() / wanted.sum()).pvalue)


SETTINGS = [(1.0, 0, 1.0), (0.6, 0, 1.0), (1.0, 8, 1.0), (1.0, 0, 0.7), (0.8, 20, 0.9), (1.5, 12, 0.8)]


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), SETTINGS)
def test_draws_follow_the_warped_distribution(temperature, top_k, top_p):
    counts = draw(temperature, top_k, top_p)
    probs = warped(temperature, top_k, top_p)
    assert (probs > 0).sum() > 3  # a distribution worth testing
    assert p_value(counts, probs) > LEVEL
    if temperature != 1.0:  # the temperature applied twice is rejected
        assert p_value(counts, warped(temperature * temperature, top_k, top_p)) < LEVEL
    if top_k and top_p == 1.0:  # one more token kept is rejected (where top-p does not cut first)
        assert p_value(counts, warped(temperature, top_k + 1, top_p)) < LEVEL


def test_draws_are_reproducible_and_fresh_per_counter():
    assert torch.equal(draw(1.0, 0, 1.0, seed=5, counter=3), draw(1.0, 0, 1.0, seed=5, counter=3))
    assert not torch.equal(draw(1.0, 0, 1.0, seed=5, counter=3), draw(1.0, 0, 1.0, seed=5, counter=4))
    assert not torch.equal(draw(1.0, 0, 1.0, seed=5, counter=3), draw(1.0, 0, 1.0, seed=6, counter=3))


def test_the_noise_is_uniform_and_uncorrelated():
    from scipy.stats import kstest

    a = counter_uniform(tensor(7, torch.int64), tensor(3, torch.int64), 100, 5000).flatten().numpy()
    b = counter_uniform(tensor(7, torch.int64), tensor(4, torch.int64), 100, 5000).flatten().numpy()
    assert 0 < a.min() and a.max() < 1 and kstest(a, "uniform").pvalue > LEVEL
    assert abs(np.corrcoef(a, b)[0, 1]) < 0.01


def test_uniforms_stay_strictly_inside_the_unit_interval():
    """The extreme hashes map inside (0, 1) in float32: a uniform of 1.0 makes the Gumbel noise infinite, and a token
    outside the top-k (score -inf) then wins a draw (-inf + inf is NaN, which argmax takes)."""
    from runner.device.sampling import bits_to_uniform

    extremes = bits_to_uniform(torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64))
    assert extremes.dtype == torch.float32 and 0 < extremes.min() and extremes.max() < 1


def test_top_k_never_leaks_over_a_large_vocabulary():
    """20000 draws over 4096 tokens, top-k 8: every draw among the 8 (with 24-bit uniforms, about 5 draws fell
    outside: one uniform in 2^24 rounded to 1.0)."""
    logits = torch.randn(1, 4096, generator=torch.Generator().manual_seed(1))
    counts = draw(1.0, 8, 1.0, seed=3, logits=logits)
    assert counts[logits[0].topk(8).indices].sum() == DRAWS


def test_gumbel_kernel_draws_the_tensor_op_tokens_under_the_interpreter():
    """The GPU draw (`sampling_kernel.py`, one Triton kernel) hashes the same noise as the tensor ops: the same token
    for every row, over a vocabulary of several column blocks with a filtered-out (-inf) stretch, any seed and
    counter (each row's argmax depends on all of its 9000 noise values, so a wrong bit anywhere shows)."""
    from tests.interpreter import run_interpreted

    done = run_interpreted("""
        import torch
        from runner.device.sampling import gumbel_argmax
        from runner.device.sampling_kernel import gumbel_argmax_kernel
        scores = torch.randn(64, 9000, generator=torch.Generator().manual_seed(1)) * 2
        scores[:, 4000:8500] = float("-inf")
        for seed, counter in ((11, 0), (2**32 - 1, 7), (123456789, 2**20)):
            seed, counter = torch.tensor([seed]), torch.tensor([counter])
            want = gumbel_argmax(scores, seed, counter)
            got = gumbel_argmax_kernel(scores, seed, counter)
            assert torch.equal(got, want), (got != want).sum()
            assert want.unique().numel() > 20
        print("OK")
    """)
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]


def test_nucleus_kernel_draws_the_sort_based_tokens_under_the_interpreter():
    """Top-p without a sort (`nucleus_argmax_kernel`) gives the token of the sort-based filter then the same draw, for
    peaked and flat rows over several column blocks, at top-p values where the unrestricted draw often falls outside
    the nucleus (further rounds) and where the nucleus is one token; the gumbel kernel test above covers the noise."""
    from tests.interpreter import run_interpreted

    done = run_interpreted(
        """
        import torch
        from runner.device.sampling import filtered_scores, gumbel_argmax
        from runner.device.sampling_kernel import nucleus_argmax_kernel
        gen = torch.Generator().manual_seed(2)
        logits = torch.randn(48, 9000, generator=gen) * torch.linspace(0.2, 6.0, 48)[:, None]  # flat .. peaked
        rounds = 0
        for top_p, seed in ((0.95, 3), (0.5, 4), (0.1, 5), (1e-4, 6)):
            seed, counter, p = torch.tensor([seed]), torch.tensor([1]), torch.tensor([top_p])
            want = gumbel_argmax(filtered_scores(logits, torch.tensor([1.0]), torch.tensor([0]), p), seed, counter)
            got = nucleus_argmax_kernel(logits, p, seed, counter)
            assert torch.equal(got, want), (top_p, (got != want).sum())
            rounds += int((gumbel_argmax(logits, seed, counter) != want).sum())  # rows that needed a second round
        assert rounds > 20, rounds
        empty = torch.full((2, 9000), float("-inf"))  # nothing to draw from: the kernel returns, it does not loop
        assert nucleus_argmax_kernel(empty, torch.tensor([0.9]), seed, counter).tolist() == [0, 0]
        print("OK", rounds)
    """,
        timeout=900,
    )
    assert done.returncode == 0 and "OK" in done.stdout, done.stderr[-3000:]
