"""A drafter in the layout of the published Kimi-K2.5 DFlash drafter, scaled down: block 8, the mask id at [UNK]
(163838 in the release, the vocabulary's second-to-last id), six taps spread over a 61-layer target
([1, 12, 24, 35, 47, 58]), 8 query heads per K/V head (64 / 8 in the release; here 16 / 2, so TP-8 replicates the
K/V heads), and rope settings of its own. It converts, and runs losslessly, at TP-1 and at TP-8."""

import json

import pytest
from safetensors.torch import save_file

from builder.convert import convert
from builder.demo_checkpoints import SEED, drafter_hf_config, random_tensors, special_id, target_hf_config
from engines.spec import BuildConfig, SpecConfig
from models.config import DrafterConfig, TargetConfig
from models.layout import hf_drafter_specs, hf_target_specs
from runner.sampling import Sampler, SamplingParams
from runner.speculate import generate, generate_autoregressive
from tests.conftest import cpu_ranks

TAPS = [1, 12, 24, 35, 47, 58]


@pytest.fixture(scope="module")
def release_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("release")
    target = {**target_hf_config(False), "num_hidden_layers": 61, "n_routed_experts": 8, "num_experts_per_tok": 2}
    drafter = {
        **drafter_hf_config(),
        "num_hidden_layers": 6,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "block_size": 8,
        "num_target_layers": 61,
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512},
        "max_position_embeddings": 4096,
        "dflash_config": {"mask_token_id": special_id("[UNK]"), "target_layer_ids": TAPS},
    }
    for name, config, specs, seed in (
        ("target", target, hf_target_specs(TargetConfig.from_hf(target)), SEED),
        ("drafter", drafter, hf_drafter_specs(DrafterConfig.from_hf(drafter)), SEED + 1),
    ):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
        save_file(random_tensors(specs, seed), str(root / name / "model.safetensors"))
    return root


@pytest.mark.parametrize("tp_size", [1, 8])
def test_the_published_drafter_layout_converts_and_runs(release_pair, tmp_path, tp_size):
    config = convert(release_pair / "target", release_pair / "drafter", tmp_path / "ckpt", tp_size)
    drafter = config.drafter
    assert drafter.target_layer_ids == tuple(TAPS) and drafter.mask_token_id == 510 and drafter.block_size == 8
    assert drafter.rope != config.target.rope and drafter.kv_heads_per_rank == (2 if tp_size == 1 else 1)
    spec, build = SpecConfig(8, 16), BuildConfig(max_input_len=64, max_seq_len=256)
    ranks = cpu_ranks(tmp_path / "ckpt", spec, build)
    prompt = [5, 77, 300, 12, 480, 33, 250, 7, 9, 100]
    greedy = Sampler(SamplingParams())
    new_tokens = 12  # each step runs 61 target layers in every rank (8 at TP-8, threads of this process)
    expected = generate_autoregressive(ranks, prompt, new_tokens, greedy).tokens
    assert generate(ranks, prompt, new_tokens, spec, greedy).tokens == expected
    ranks.close()
    if tp_size == 8:  # the same tokens as TP-1 of the same checkpoints
        one = tmp_path / "tp1"
        convert(release_pair / "target", release_pair / "drafter", one, 1)
        reference = cpu_ranks(one, spec, build)
        assert generate_autoregressive(reference, prompt, new_tokens, greedy).tokens == expected
        reference.close()
