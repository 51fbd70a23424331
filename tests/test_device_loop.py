"""The device-resident greedy step (runner/device/loop.py) is lossless too: equal to autoregressive decoding.

Run eagerly on the CPU here (the same tensor program a CUDA graph captures on a GPU), with the same run-ahead: one
step launched behind the one collected, discarded when the request ends first."""

import pytest

from engines.spec import BuildConfig, SpecConfig
from runner.device.loop import generate_on_device
from runner.probes import Probes
from runner.sampling import Sampler, SamplingParams
from runner.speculate import generate_autoregressive
from tests.conftest import cpu_ranks

# a prompt shorter than a block (its context rides in the first draft), longer (committed to the draft cache first,
# `DeviceLoop.load`), and longer than two 16-token blocks
BUILD = BuildConfig(max_input_len=64, max_seq_len=512)
PROMPTS = [[5, 77, 300, 12, 480, 33, 250], [200, 201, 9, 88, 17, 400, 402, 300, 11, 63, 5], list(range(40, 440, 11))]


@pytest.mark.parametrize(("block_size", "budget", "max_topk"), [(8, 32, None), (8, 7, 1), (8, 4, None), (16, 64, 4)])
def test_device_loop_equals_autoregressive(demo_ckpt, block_size, budget, max_topk):
    spec = SpecConfig(block_size, budget, max_topk)
    engine = cpu_ranks(demo_ckpt(1), spec, BUILD, device_loop=True)
    for prompt in PROMPTS:
        expected = generate_autoregressive(engine, prompt, 96, Sampler(SamplingParams())).tokens
        result = generate_on_device(engine, spec, prompt, 96, capacity=512)
        assert result.tokens == expected
        assert all(1 <= a <= block_size for a in result.accept_lengths)
    engine.close()


def test_device_loop_with_an_oracle_accepts_whole_blocks(demo_ckpt):
    import torch

    spec = SpecConfig(8, 32)
    engine = cpu_ranks(demo_ckpt(1), spec, BUILD)
    expected = generate_autoregressive(engine, PROMPTS[0], 80, Sampler(SamplingParams())).tokens
    engine.close()
    engine = cpu_ranks(demo_ckpt(1), spec, BUILD, device_loop=True, probes=Probes(oracle=torch.tensor(expected)))
    result = generate_on_device(engine, spec, PROMPTS[0], 80, capacity=512)
    assert result.tokens == expected
    assert result.accept_lengths[:-1] == [8] * (len(result.accept_lengths) - 1)  # every step, the first too
    engine.close()


def test_autoregressive_device_loop_equals_host_decoding(demo_ckpt):
    spec = SpecConfig(8, 32)
    engine = cpu_ranks(demo_ckpt(1), spec, BUILD, device_loop=True)
    first = engine.workers[0].loop
    generate_on_device(engine, spec, PROMPTS[0], 20, capacity=512)
    # a new loop closes the old one at once (its graphs and pinned slots must not wait for the garbage collector,
    # which may run while the next graph is being captured)
    engine.workers[0].enable_device_loop(autoregressive=True)
    assert first.host == [] and first.graphs == {} and not first.in_flight
    for prompt in PROMPTS:
        expected = generate_autoregressive(engine, prompt, 50, Sampler(SamplingParams())).tokens
        result = generate_on_device(engine, spec, prompt, 50, capacity=512, autoregressive=True)
        assert result.tokens == expected and result.accept_lengths == [1] * 49
    engine.close()


def test_steps_launched_past_the_end_are_discarded(demo_ckpt):
    """An end token or max_new_tokens ends a request while a step is queued behind it: the output stops there and
    the next request on the same engine is unaffected."""
    spec = SpecConfig(8, 32)
    engine = cpu_ranks(demo_ckpt(1), spec, BUILD, device_loop=True)
    expected = generate_autoregressive(engine, PROMPTS[1], 80, Sampler(SamplingParams())).tokens
    end = expected[40]
    stop = expected.index(end)
    streamed = []
    result = generate_on_device(engine, spec, PROMPTS[1], 80, 512, end_ids={end}, on_tokens=streamed.extend)
    assert result.tokens == expected[: stop + 1] == streamed
    for max_new in (1, 2, 9, 37):
        assert generate_on_device(engine, spec, PROMPTS[1], max_new, 512).tokens == expected[:max_new]
    assert not engine.workers[0].loop.in_flight
    with pytest.raises(ValueError, match=r"the sequence reached the cache capacity \(40 rows\)"):
        generate_on_device(engine, spec, PROMPTS[1], 80, capacity=40)
    engine.close()


def test_stop_sequences_and_bad_words(demo_ckpt):
    """A stop sequence ends a device-loop request right after it, as on the host loop; a request with bad words runs
    on the host loop, and no banned token appears."""
    from runner.generator import Generator

    spec = SpecConfig(8, 32)
    engine = cpu_ranks(demo_ckpt(1), spec, BUILD, device_loop=True)
    generator = Generator(engine)
    expected = generate_autoregressive(engine, PROMPTS[0], 40, Sampler(SamplingParams())).tokens
    stop = tuple(expected[12:14])
    first = next(i for i in range(len(expected) - 1) if tuple(expected[i : i + 2]) == stop)
    greedy = SamplingParams()
    result = generator.generate(PROMPTS[0], 40, greedy, stop_sequences=(stop,))
    assert generator.on_device(greedy) and result.tokens == expected[: first + 2]
    banned = tuple(sorted(set(expected[:10])))
    assert not generator.on_device(greedy, banned)
    result = generator.generate(PROMPTS[0], 40, greedy, banned=banned)
    assert not set(result.tokens) & set(banned) and len(result.tokens) == 40
    engine.close()
