import hashlib
import json

import torch

from builder.demo_checkpoints import main as demo_main
from models.config import DrafterConfig, TargetConfig


def test_target_config_has_the_kimi_field_set(demo_hf):
    config = json.loads((demo_hf / "kimi-k2-tiny" / "config.json").read_text())
    for key in (
        "q_lora_rank",
        "kv_lora_rank",
        "first_k_dense_replace",
        "n_routed_experts",
        "num_experts_per_tok",
        "n_shared_experts",
        "routed_scaling_factor",
        "rope_scaling",
    ):
        assert key in config
    assert config["topk_method"] == "noaux_tc" and config["scoring_func"] == "sigmoid"
    assert config["rope_scaling"]["type"] == "yarn"
    target = TargetConfig.from_hf(config)
    assert target.first_k_dense_replace >= 1 and target.num_hidden_layers - target.first_k_dense_replace >= 2
    assert target.num_attention_heads == 8 and target.qk_head_dim != target.v_head_dim
    drafter = DrafterConfig.from_hf(json.loads((demo_hf / "kimi-k2-tiny-dflash" / "config.json").read_text()))
    assert drafter.block_size == 8 and drafter.num_key_value_heads < drafter.num_attention_heads
    drafter.check_against(target)


def test_int4_checkpoint_stores_experts_packed(demo_hf):
    from safetensors import safe_open

    handle = safe_open(str(demo_hf / "kimi-k2-tiny-int4" / "model.safetensors"), "pt")
    names = set(handle.keys())
    base = "model.layers.1.mlp.experts.0.gate_proj"
    assert {base + ".weight_packed", base + ".weight_scale", base + ".weight_shape"} <= names
    assert base + ".weight" not in names
    assert handle.get_tensor(base + ".weight_packed").dtype == torch.int32
    assert "model.layers.1.mlp.shared_experts.gate_proj.weight" in names  # shared expert stays float
    assert "model.layers.0.self_attn.q_a_proj.weight" in names


def test_generation_is_deterministic(tmp_path):
    assert demo_main([str(tmp_path / "a")]) == 0
    assert demo_main([str(tmp_path / "b")]) == 0
    for name in (
        "kimi-k2-tiny/model.safetensors",
        "kimi-k2-tiny/tokenizer.json",
        "kimi-k2-tiny-dflash/model.safetensors",
    ):
        digests = {hashlib.sha256((tmp_path / run / name).read_bytes()).hexdigest() for run in "ab"}
        assert len(digests) == 1, name


def test_refuses_to_overwrite_without_force(tmp_path, capsys):
    assert demo_main([str(tmp_path)]) == 0
    (tmp_path / "kimi-k2-tiny" / "config.json").write_text("{}")
    assert demo_main([str(tmp_path)]) == 2
    assert "not empty; pass --force" in capsys.readouterr().err
    assert (tmp_path / "kimi-k2-tiny" / "config.json").read_text() == "{}"


def test_transformers_loads_and_generates(demo_hf):
    import transformers  # a test dependency: missing, these tests fail (not skip)

    model = transformers.DeepseekV3ForCausalLM.from_pretrained(demo_hf / "kimi-k2-tiny", dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(demo_hf / "kimi-k2-tiny")
    ids = tokenizer("Hello world! Speculative decoding", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8)
    # every checkpoint tensor reached the model (the per-expert layout was converted, nothing newly initialised)
    from safetensors.torch import load_file

    stored = load_file(str(demo_hf / "kimi-k2-tiny" / "model.safetensors"))
    fused = model.state_dict()["model.layers.2.mlp.experts.gate_up_proj"]
    assert torch.equal(fused[5, :32], stored["model.layers.2.mlp.experts.5.gate_proj.weight"])
    assert torch.equal(fused[5, 32:], stored["model.layers.2.mlp.experts.5.up_proj.weight"])


def test_tokenizer_has_kimi_special_tokens(demo_hf):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(demo_hf / "kimi-k2-tiny" / "tokenizer.json"))
    assert tokenizer.get_vocab_size() == 512
    assert tokenizer.token_to_id("[PAD]") == 511 and tokenizer.token_to_id("[UNK]") == 510
    assert tokenizer.token_to_id("<|im_end|>") == 482
    text = "<|im_user|>user<|im_middle|>Hello world<|im_end|>"
    assert tokenizer.decode(tokenizer.encode(text).ids, skip_special_tokens=False) == text
