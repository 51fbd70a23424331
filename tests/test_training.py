"""The training forms compute what the inference modules (and transformers) compute, and the commands run."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from models.config import DrafterConfig
from models.mapping import Mapping
from training import train_drafter, train_target
from training.data import special_id
from training.model import (
    build_models,
    drafter_forward,
    drafter_hf_state,
    load_target_hf,
    save_checkpoint,
    target_forward,
    target_hf_state,
)
from training.pair import drafter_config, target_config


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """The pair's architecture with its initial weights, the target saved as an HF checkpoint and loaded back."""
    target, drafter = build_models(target_config(), drafter_config(), "cpu")
    path = tmp_path_factory.mktemp("pair") / "target"
    path.mkdir()
    save_checkpoint(path, target_hf_state(target), target_config(), {})
    load_target_hf(target, path)  # bf16-rounded weights, so transformers and the module hold the same values
    return target.eval(), drafter.eval(), path


def test_target_training_form_matches_transformers(pair):
    target, _, path = pair
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.randint(0, special_id("[BOS]"), (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, taps, counts = target_forward(target, ids)
        expected = hf(ids, output_hidden_states=True)
    assert rel(logits, expected.logits) < 1e-4
    hidden = target.config.hidden_size
    for slot, layer in enumerate(target.tap_layers):
        assert rel(taps[..., slot * hidden : (slot + 1) * hidden], expected.hidden_states[layer + 1]) < 1e-4
    top_k = target.config.num_experts_per_tok
    assert all(float(c.sum()) == ids.numel() * top_k for c in counts)  # every token's k choices counted


def test_drafter_training_form_matches_the_inference_forward(pair):
    """Each block of the batched training forward == `DFlashDrafter.forward` with the context rows before it."""
    target, drafter, _ = pair
    cfg = DrafterConfig.from_hf(drafter_config())
    gen = torch.Generator().manual_seed(1)
    for p in drafter.parameters():  # away from the initial (all-ones) norms, so every weight shows
        p.data.add_(0.05 * torch.randn(p.shape, generator=gen))
    ids = torch.randint(0, special_id("[BOS]"), (2, 40), generator=gen)
    anchors = torch.tensor([[1, 9, 30], [17, 32, 5]])
    with torch.no_grad():
        _, taps, _ = target_forward(target, ids)
        logits = drafter_forward(drafter, cfg, taps, ids, anchors)
        size = cfg.block_size
        cache = torch.zeros(cfg.num_hidden_layers, 2, 4, cfg.num_key_value_heads, cfg.head_dim)
        for b in range(2):
            for k, a in enumerate(anchors[b].tolist()):
                block = torch.tensor([int(ids[b, a])] + [cfg.mask_token_id] * (size - 1))
                expected, _ = drafter(taps[b, :a], torch.arange(a), torch.tensor([a]), block,
                                      torch.arange(a, a + size), cache, torch.tensor([0]))  # fmt: skip
                assert rel(logits[b, k], expected) < 1e-4, (b, a)


def test_drafter_state_has_the_hf_layout(pair):
    _, drafter, _ = pair
    state = drafter_hf_state(drafter, DrafterConfig.from_hf(drafter_config()))
    assert "fc.weight" in state and "embed_tokens.weight" not in state
    assert DrafterConfig.from_hf(drafter_config(), Mapping(8, 0, 8)).heads_per_rank == 2  # divides for TP-8


def test_training_commands_write_checkpoints_that_build(stdlib_data, tmp_path):
    """Three steps each on the CPU: the commands run end to end and write HF checkpoints `build-engine` accepts."""
    from builder.cli import main as build_main

    small = ["--steps", "3", "--batch", "2", "--seq_len", "64", "--device", "cpu"]
    target_dir, drafter_dir = tmp_path / "target", tmp_path / "drafter"
    assert train_target.main(["--data", str(stdlib_data), "--output_dir", str(target_dir), *small]) == 0
    args = ["--data", str(stdlib_data), "--target_dir", str(target_dir), "--output_dir", str(drafter_dir)]
    assert train_drafter.main([*args, *small, "--blocks", "4"]) == 0
    record = json.loads((drafter_dir / "training.json").read_text())
    assert record["steps"] == 3 and len(record["heldout"]["top1_agreement_by_position"]) == 7
    with pytest.raises(SystemExit):  # an existing output is not replaced without --force
        train_target.main(["--data", str(stdlib_data), "--output_dir", str(target_dir), *small])
    out = tmp_path / "engine"
    code = build_main(["--model_dir", str(target_dir), "--draft_model_dir", str(drafter_dir), "--tp_size", "2",
                       "--output_dir", str(out), "--dtype", "float32", "--no_onnx"])  # fmt: skip
    assert code == 0 and (out / "checkpoint").exists()


def test_missing_data_or_target_is_a_clear_error(stdlib_data, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train_target.main(["--data", str(tmp_path / "none"), "--output_dir", str(tmp_path / "t"), "--device", "cpu"])
    expected = "lacks train.npy, heldout.npy, manifest.json: prepare it with `python -m training.data"
    assert expected in capsys.readouterr().err
    with pytest.raises(SystemExit):
        train_drafter.main(["--data", str(stdlib_data), "--target_dir", str(tmp_path / "none"), "--output_dir",
                            str(tmp_path / "d"), "--device", "cpu"])  # fmt: skip
    assert "holds no config.json: train the target first" in capsys.readouterr().err
    assert not (tmp_path / "t").exists() and not (tmp_path / "d").exists()
