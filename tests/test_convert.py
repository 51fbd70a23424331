import json
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from builder.cli import main as cli_main
from builder.convert import convert
from builder.hf_checkpoint import TargetCheckpoint
from models.checkpoint import load_rank_weights
from models.layout import hf_drafter_specs, hf_expert_name, hf_target_specs, stacked_expert_name
from tests.conftest import copy_checkpoint


@pytest.mark.parametrize("tp_size", [1, 2, 4, 8])
def test_shards_concatenate_back(demo_hf, demo_ckpt, tp_size):
    ckpt = demo_ckpt(tp_size)
    ranks = [load_rank_weights(ckpt, r) for r in range(tp_size)]
    config = ranks[0][0]
    original = load_file(str(demo_hf / "kimi-k2-tiny" / "model.safetensors"))
    for name, spec in hf_target_specs(config.target, include_experts=False).items():
        pieces = [r[1][name] for r in ranks]
        whole = pieces[0] if spec.split_dim is None else torch.cat(pieces, dim=spec.split_dim)
        assert torch.equal(whole, original[name]), name
        if spec.split_dim is None:
            assert all(torch.equal(p, pieces[0]) for p in pieces), name
    for layer in range(1, config.target.num_hidden_layers):
        for proj, dim in (("gate_proj", 1), ("up_proj", 1), ("down_proj", 2)):
            whole = torch.cat([r[1][stacked_expert_name(layer, proj)] for r in ranks], dim=dim)
            for e in range(config.target.n_routed_experts):
                assert torch.equal(whole[e], original[hf_expert_name(layer, e, proj)])
    drafter = load_file(str(demo_hf / "kimi-k2-tiny-dflash" / "model.safetensors"))
    for name, spec in hf_drafter_specs(config.drafter).items():
        pieces = [r[2][name] for r in ranks]
        whole = pieces[0] if spec.split_dim is None else torch.cat(pieces, dim=spec.split_dim)
        assert torch.equal(whole, drafter[name]), name


def test_int4_experts_are_dequantized_exactly(demo_hf, tmp_path):
    convert(demo_hf / "kimi-k2-tiny-int4", demo_hf / "kimi-k2-tiny-dflash", tmp_path / "c", 2, dequantize_experts=True)
    quantized = TargetCheckpoint(demo_hf / "kimi-k2-tiny-int4")
    float_reference = load_file(str(demo_hf / "kimi-k2-tiny" / "model.safetensors"))
    _, rank0, _ = load_rank_weights(tmp_path / "c", 0)
    _, rank1, _ = load_rank_weights(tmp_path / "c", 1)
    stacked = torch.cat([rank0[stacked_expert_name(1, "up_proj")], rank1[stacked_expert_name(1, "up_proj")]], 1)
    name = hf_expert_name(1, 7, "up_proj")
    assert torch.equal(stacked[7], quantized.get(name))
    # within INT4 rounding of the float weights it was quantized from
    error = (stacked[7] - float_reference[name]).abs().max()
    assert 0 < error < float_reference[name].abs().max() / 7


def test_multimodal_wrapper_layout(demo_hf, demo_ckpt, tmp_path, caplog):
    plain = demo_hf / "kimi-k2-tiny"
    wrapped = tmp_path / "k25"
    wrapped.mkdir()
    text = json.loads((plain / "config.json").read_text())
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {"hidden_size": 16},
    }
    (wrapped / "config.json").write_text(json.dumps(config))
    tensors = {f"language_model.{k}": v for k, v in load_file(str(plain / "model.safetensors")).items()}
    tensors["vision_tower.patch_embed.weight"] = torch.zeros(4, 4)
    tensors["mm_projector.proj.weight"] = torch.zeros(4, 4)
    save_file(tensors, str(wrapped / "model.safetensors"))
    with caplog.at_level("INFO", logger="ddtree.builder"):
        convert(wrapped, demo_hf / "kimi-k2-tiny-dflash", tmp_path / "out", tp_size=2)
    assert "ignoring 2 non-language-model tensors" in caplog.text
    for rank in range(2):
        a, b = (
            load_file(str(tmp_path / "out/target" / f"rank{rank}.safetensors")),
            load_file(str(demo_ckpt(2) / "target" / f"rank{rank}.safetensors")),
        )
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _convert_error(target, drafter, out, tp_size=8):
    with pytest.raises((ValueError, FileExistsError, FileNotFoundError)) as info:
        convert(target, drafter, out, tp_size)
    return str(info.value)


def test_tp_must_divide_heads_expert_width_and_vocab(demo_hf, tmp_path):
    drafter = demo_hf / "kimi-k2-tiny-dflash"
    assert "tp_size=3 must divide num_attention_heads=8" in _convert_error(
        demo_hf / "kimi-k2-tiny", drafter, tmp_path / "o", 3
    )
    odd_width = copy_checkpoint(demo_hf / "kimi-k2-tiny", tmp_path / "w", {"moe_intermediate_size": 36})
    assert "moe_intermediate_size (each expert's width)=36" in _convert_error(odd_width, drafter, tmp_path / "o")
    odd_vocab = copy_checkpoint(demo_hf / "kimi-k2-tiny", tmp_path / "v", {"vocab_size": 516})
    assert "must divide vocab_size=516" in _convert_error(odd_vocab, drafter, tmp_path / "o")
    assert not (tmp_path / "o").exists()


def test_missing_unexpected_and_mis_shaped_tensors_are_listed(demo_hf, tmp_path):
    bad = copy_checkpoint(demo_hf / "kimi-k2-tiny", tmp_path / "bad")
    tensors = load_file(str(bad / "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    tensors["model.layers.9.extra.weight"] = torch.zeros(2)
    tensors["model.norm.weight"] = torch.ones(63)
    save_file(tensors, str(bad / "model.safetensors"))
    message = _convert_error(bad, demo_hf / "kimi-k2-tiny-dflash", tmp_path / "o", 2)
    assert "missing 1 tensors: model.layers.1.mlp.experts.3.up_proj.weight" in message
    assert "unexpected 1 tensors: model.layers.9.extra.weight" in message
    assert "model.norm.weight: expected (64,), got (63,)" in message


def test_unsupported_model_type_and_quantization(demo_hf, tmp_path):
    drafter = demo_hf / "kimi-k2-tiny-dflash"
    llama = copy_checkpoint(demo_hf / "kimi-k2-tiny", tmp_path / "l", {"model_type": "llama"})
    assert "unsupported target model_type 'llama'" in _convert_error(llama, drafter, tmp_path / "o")
    fp8 = copy_checkpoint(
        demo_hf / "kimi-k2-tiny",
        tmp_path / "f",
        {"quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}},
    )
    assert "compressed-tensors / pack-quantized" in _convert_error(fp8, drafter, tmp_path / "o")


def test_drafter_must_fit_the_target(demo_hf, tmp_path):
    target = demo_hf / "kimi-k2-tiny"
    config = json.loads((demo_hf / "kimi-k2-tiny-dflash" / "config.json").read_text())
    far = copy_checkpoint(
        demo_hf / "kimi-k2-tiny-dflash",
        tmp_path / "far",
        {"dflash_config": {**config["dflash_config"], "target_layer_ids": [1, 9]}},
    )
    message = _convert_error(target, far, tmp_path / "o")
    assert "target_layer_ids [1, 9] must lie in [0, 4)" in message and "out of range: [9]" in message
    narrow = copy_checkpoint(demo_hf / "kimi-k2-tiny-dflash", tmp_path / "narrow", {"hidden_size": 32})
    assert "drafter hidden_size=32 must equal the target's hidden_size=64" in _convert_error(
        target, narrow, tmp_path / "o"
    )


def test_output_dir_is_never_overwritten_without_force(demo_hf, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    args = [
        "convert",
        "--model_dir",
        str(demo_hf / "kimi-k2-tiny"),
        "--draft_model_dir",
        str(demo_hf / "kimi-k2-tiny-dflash"),
        "--output_dir",
        str(out),
        "--tp_size",
        "8",
    ]
    assert cli_main(args) == 2
    assert "is not empty; pass --force" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "user data"
    assert cli_main([*args, "--force"]) == 0
    assert len(list((out / "target").glob("rank*.safetensors"))) == 8
    assert len(list((out / "drafter").glob("rank*.safetensors"))) == 8
    into_input = [*args[:5], "--output_dir", str(demo_hf / "kimi-k2-tiny"), "--force"]
    assert cli_main(into_input) == 2
    assert "would replace the input" in capsys.readouterr().err


def test_rank_file_errors(demo_ckpt, tmp_path):
    import shutil

    ckpt = shutil.copytree(demo_ckpt(2), tmp_path / "c")
    (ckpt / "drafter" / "rank1.safetensors").unlink()
    with pytest.raises(
        FileNotFoundError,
        match=r"lacks drafter/rank1.safetensors \(or drafter/rank1.safetensors.index.json\) \(tp_size=2\)",
    ):
        load_rank_weights(ckpt, 1)
    with pytest.raises(ValueError, match=r"rank must be in \[0, tp_size=2\), got 5"):
        load_rank_weights(ckpt, 5)


def test_config_values_of_the_wrong_type_are_named(demo_hf, tmp_path):
    """`hidden_size: 64.0` gave a traceback from a shape computation (and a half-written output folder)."""
    target, drafter = demo_hf / "kimi-k2-tiny", demo_hf / "kimi-k2-tiny-dflash"
    cases = [
        ("hidden_size", 64.0, "must be an integer, got 64.0 (float)"),
        ("num_hidden_layers", True, "must be an integer, got True (bool)"),
        ("routed_scaling_factor", "2.8", "must be a finite number, got '2.8' (str)"),
    ]
    for name, value, message in cases:
        bad = copy_checkpoint(target, tmp_path / name, {name: value})
        with pytest.raises(ValueError, match=f"target config {name} {re.escape(message)}"):
            convert(bad, drafter, tmp_path / f"out-{name}", 1)
        assert not (tmp_path / f"out-{name}").exists()
    bad = copy_checkpoint(drafter, tmp_path / "d", {"num_attention_heads": 16.0})
    with pytest.raises(ValueError, match=r"drafter config num_attention_heads must be an integer, got 16.0 \(float\)"):
        convert(target, bad, tmp_path / "out-d", 1)


def test_weights_with_nan_or_inf_are_refused(demo_hf, tmp_path):
    bad = copy_checkpoint(demo_hf / "kimi-k2-tiny", tmp_path / "nan")
    tensors = load_file(str(bad / "model.safetensors"))
    tensors["model.layers.2.self_attn.o_proj.weight"][3, 5] = float("nan")
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model.layers.2.self_attn.o_proj.weight in .* holds NaN or Inf values"):
        convert(bad, demo_hf / "kimi-k2-tiny-dflash", tmp_path / "out", 1)
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["nan"]


def test_the_router_bias_stays_float32_whatever_the_dtype(demo_hf, tmp_path):
    source = TargetCheckpoint(demo_hf / "kimi-k2-tiny")
    convert(demo_hf / "kimi-k2-tiny", demo_hf / "kimi-k2-tiny-dflash", tmp_path / "bf16", 2, dtype="bfloat16")
    _, weights, _ = load_rank_weights(tmp_path / "bf16", 1)
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert weights[bias].dtype == torch.float32 and torch.equal(weights[bias], source.get(bias).float())
    assert weights["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


def test_convert_streams_into_shards_with_an_index(demo_hf, demo_ckpt, tmp_path, caplog):
    """A tiny shard limit writes each layer group to its own shard per rank; the loader reads them back through the
    index, tensor for tensor equal to the single-file conversion."""
    out = tmp_path / "sharded"
    with caplog.at_level("INFO", logger="ddtree.builder"):
        config = convert(demo_hf / "kimi-k2-tiny", demo_hf / "kimi-k2-tiny-dflash", out, 2, max_shard_size=1)
    layers = config.target.num_hidden_layers
    for rank in range(2):
        index = json.loads((out / "target" / f"rank{rank}.safetensors.index.json").read_text())
        files = sorted(set(index["weight_map"].values()))
        assert files == [f"rank{rank}-{i:05d}-of-{layers + 1:05d}.safetensors" for i in range(1, layers + 2)]
        assert index["weight_map"]["model.layers.1.mlp.experts.up_proj.weight"] == files[2]
        assert not (out / "target" / f"rank{rank}.safetensors").exists()
        assert (out / "drafter" / f"rank{rank}.safetensors").is_file()  # one group: one file, no index
        _, target, drafter = load_rank_weights(out, rank)
        _, ref_target, ref_drafter = load_rank_weights(demo_ckpt(2), rank)
        assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in target.values())
        for got, want in ((target, ref_target), (drafter, ref_drafter)):
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)
    assert not list(out.rglob(".rank*"))  # no part files left behind
    assert re.search(
        rf"rank 1: target [\d.]+ [KM]B in {layers + 1} file\(s\), drafter [\d.]+ [KM]B in 1 file", caplog.text
    )
    assert re.search(r"converted 2 ranks in [\d.]+ s: read [\d.]+ [KM]B \([\d.]+ GB/s\)", caplog.text)


def test_a_shard_missing_from_the_index_is_named(demo_hf, tmp_path):
    out = tmp_path / "sharded"
    config = convert(demo_hf / "kimi-k2-tiny", demo_hf / "kimi-k2-tiny-dflash", out, 1, max_shard_size=1)
    second = f"rank0-00002-of-{config.target.num_hidden_layers + 1:05d}.safetensors"
    (out / "target" / second).unlink()
    with pytest.raises(FileNotFoundError, match=rf"lacks target/{second}, listed in rank0.safetensors.index.json"):
        load_rank_weights(out, 0)


def test_max_shard_size_is_checked(demo_hf, tmp_path, capsys):
    args = ["convert", "--model_dir", str(demo_hf / "kimi-k2-tiny"), "--draft_model_dir", str(tmp_path)]
    with pytest.raises(SystemExit):
        cli_main([*args, "--output_dir", str(tmp_path / "o"), "--max_shard_size", "0GB"])
    assert "--max_shard_size: expected a positive byte count such as 4GiB, 500MB or 1000000, got '0GB'" in (
        capsys.readouterr().err
    )
