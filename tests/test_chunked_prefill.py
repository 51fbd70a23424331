"""Chunked prefill (`--chunked_prefill_size`): a long prompt's forward in chunks, each attending to the earlier ones
through the cache, gives the whole prompt's logits and the same generation, on every backend and loop."""

from __future__ import annotations

import json

import pytest
import torch

from engines.spec import BuildConfig, SpecConfig
from runner.generator import Generator
from tests.conftest import ENGINE_LIMITS, cpu_ranks, mpirun

PROMPT = [5, 77, 300, 12, 480, 33, 250, 9, 81, 17, 402, 66, 3, 98, 145, 7, 230, 54, 11, 390, 28, 61, 199]
SPEC = SpecConfig(8, 32)


@pytest.mark.parametrize("device_loop", [False, True])
def test_chunks_give_the_whole_prompts_logits_and_tokens(demo_ckpt, device_loop):
    outputs = {}
    for chunk in (0, 5, 8, 22):  # none; several with a short last one; the draft block; all but the last token
        ranks = cpu_ranks(demo_ckpt(2), SPEC, BuildConfig(**ENGINE_LIMITS), chunked_prefill_size=chunk,
                          device_loop=device_loop)  # fmt: skip
        try:
            logits = ranks.prefill(PROMPT).float()
            cached = ranks.lead.cache.num_cached
            ranks.reset()
            tokens = Generator(ranks).generate(PROMPT, 24).tokens
        finally:
            ranks.close()
        outputs[chunk] = (logits, cached, tokens)
    whole_logits, _, whole_tokens = outputs[0]
    for chunk, (logits, cached, tokens) in outputs.items():
        assert cached == len(PROMPT), chunk
        torch.testing.assert_close(logits, whole_logits, rtol=1e-4, atol=1e-4)
        assert tokens == whole_tokens, chunk


@pytest.mark.parametrize("chunk", [0, 5])
def test_a_prefill_padded_to_a_captured_length_changes_nothing(demo_ckpt, chunk):
    """What a GPU's prefill graphs do (`CudaGraphSession.prefill_buckets`: a prompt padded to the next captured
    length), here eagerly on the CPU ranks: the prompt's logits, its cache rows, the drafter's pending context and the
    generation are those of the unpadded prompt; the padding's rows are not counted as cached. Lengths 4, 8, 16, 32:
    the 23-token prompt runs as 32 rows, chunks of 5 as 8 (the last, of 3, as 4)."""
    outputs = []
    for buckets in ((), (4, 8, 16, 32)):
        ranks = cpu_ranks(demo_ckpt(2), SPEC, BuildConfig(**ENGINE_LIMITS), chunked_prefill_size=chunk)
        try:
            for worker in ranks.workers:
                worker.session.prefill_buckets = buckets
            logits = ranks.prefill(PROMPT).float()
            cache = ranks.lead.cache
            rows = cache.latent[:, : cache.num_cached].float().clone()
            taps = cache.pending_taps.float().clone()
            cached = cache.num_cached
            ranks.reset()
            tokens = Generator(ranks).generate(PROMPT, 24).tokens
        finally:
            ranks.close()
        outputs.append((logits, rows, taps, cached, tokens))
    (logits, rows, taps, cached, tokens), padded = outputs
    assert cached == padded[3] == len(PROMPT) and taps.shape == padded[2].shape
    for exact, got in ((logits, padded[0]), (rows, padded[1]), (taps, padded[2])):
        torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
    assert padded[4] == tokens


def test_the_cli_chunks_prompts_under_mpirun(demo_engine, tmp_path):
    """ONNX Runtime engines under mpirun -np 2: chunks of 3 tokens emit what the whole prompt does; a negative
    size is refused on every rank."""
    args = ["-m", "runner", "--engine_dir", str(demo_engine(2)), "--backend", "ort", "--max_output_len", "12",
            "--input_text", "The quick brown fox jumps over the lazy dog"]  # fmt: skip
    ids = {}
    for chunk in ("0", "3"):
        out = tmp_path / f"{chunk}.json"
        done = mpirun(2, *args, "--chunked_prefill_size", chunk, "--output_json", str(out))
        assert done.returncode == 0, done.stderr[-2000:]
        result = json.loads(out.read_text())["results"][0]
        assert len(result["prompt_ids"]) > 3
        ids[chunk] = result["output_ids"]
    assert ids["3"] == ids["0"]
    refused = mpirun(2, *args, "--chunked_prefill_size", "-1")
    assert refused.returncode != 0 and "--chunked_prefill_size must be >= 0" in refused.stderr + refused.stdout
