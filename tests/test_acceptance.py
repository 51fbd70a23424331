"""The trained pair's acceptance, pinned: a bug that feeds the drafter wrong context (rejected rows committed into its
cache, positions off by one, taps of the wrong layers) keeps greedy output lossless but drops acceptance; these
tests see it. Also losslessness with a drafter that is often right, so long accepted paths are exercised."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.acceptance import ROOT, convert_pair, load_prompts
from engines.spec import BuildConfig, SpecConfig
from runner.factory import CheckpointWeights, RankOptions, local_ranks
from runner.generator import Generator

PROMPTS, TOKENS = 8, 32
# mean acceptance length (tokens a step emits) on the first 8 held-out prompts, 32 greedy tokens each, float32 on the
# CPU, recorded when the pair was committed; the band allows for other CPUs' float rounding flipping a near tie.
# Committing the tree's first rows' taps instead of the accepted rows' (a drafter-context bug that stays lossless)
# was tried: DDTree 32 fell to 2.856, outside the band.
RECORDED = {"chain": 2.785, "ddtree32": 3.714}
BAND = 0.3


@pytest.fixture(scope="module")
def pair_ckpt(tmp_path_factory) -> Path:
    return convert_pair(tmp_path_factory.mktemp("pair") / "ckpt", "float32")


def _generate(ckpt: Path, spec: SpecConfig | None, prompts) -> tuple[list[list[int]], float]:
    autoregressive = spec is None
    ranks = local_ranks(CheckpointWeights(ckpt), RankOptions("torch", "cpu", False, autoregressive),
                        spec or SpecConfig(8, 32), BuildConfig(max_input_len=128, max_seq_len=256))  # fmt: skip
    generator = Generator(ranks, autoregressive)
    results = [generator.generate(p, TOKENS) for p in prompts]
    ranks.close()
    steps = [a for r in results for a in r.accept_lengths]
    return [r.tokens for r in results], (sum(steps) / len(steps) if steps else 1.0)


def test_trained_pair_acceptance_is_pinned_and_lossless(pair_ckpt):
    prompts = load_prompts(ROOT / "kimi-k2-py", PROMPTS)
    expected, _ = _generate(pair_ckpt, None, prompts)
    measured = {}
    for name, spec in (("chain", SpecConfig(8, 7, 1)), ("ddtree32", SpecConfig(8, 32))):
        tokens, measured[name] = _generate(pair_ckpt, spec, prompts)
        assert tokens == expected, f"{name}: greedy speculative output differs from autoregressive"
    for name, value in measured.items():
        assert abs(value - RECORDED[name]) <= BAND, f"{name}: mean acceptance {value:.3f}, recorded {RECORDED[name]}"
    assert measured["ddtree32"] >= 1.2 * measured["chain"], measured  # the tree beats the chain (1.33x recorded)


def test_committed_pair_is_within_the_size_limit():
    sizes = sum(p.stat().st_size for p in ROOT.glob("kimi-k2-py*/*"))
    assert sizes <= 25e6, f"the trained pair takes {sizes / 1e6:.1f} MB, over 25 MB"
    prompts = json.loads((ROOT / "heldout_prompts.json").read_text())
    manifest = json.loads((ROOT / "data_manifest.json").read_text())
    heldout = {entry[0] for entry in manifest["heldout"]["list"]}
    assert len(prompts) >= 100 and all(p["file"] in heldout for p in prompts)
