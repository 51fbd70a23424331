"""Tiny Kimi-architecture checkpoints with the real layout, from a fixed seed.

    python -m builder.demo_checkpoints OUT [--int4] [--force]
    python -m builder.demo_checkpoints OUT --preset moe [--dtype bfloat16] [--device cuda]

writes OUT/kimi-k2-tiny (target, HF format, tokenizer included; with --int4 the routed experts are stored as
compressed-tensors pack-quantized INT4, group 32, exactly as Kimi K2.x ships them) and OUT/kimi-k2-tiny-dflash
(DFlash drafter, only its own tensors). Dimensions are small but every structural feature is present: a dense
first layer and MoE layers with a shared expert, noaux_tc sigmoid routing with a correction bias, MLA with
unequal qk (24) and v (16) head dims, yarn rope, 8 heads (one per rank at TP-8), GQA in the drafter.
The weights are random: the text they produce is noise, and a random drafter is rarely accepted.

`--preset moe|dense` writes OUT/kimi-<preset> and OUT/kimi-<preset>-dflash instead: the same layout at the
dimensions of a model preset (`models/presets.py`; "moe": hidden 2048, 8 layers, 64 experts, about 2.3 B
parameters), with the tiny tokenizer, for running and measuring the engine at a realistic size.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from builder import int4
from builder.tokenizer import SPECIAL_TOKENS, write_tiktoken_tokenizer, write_tokenizer
from engines.output_dir import check_output_dir, staged_output_dir
from models.config import DrafterConfig, TargetConfig
from models.layout import hf_drafter_specs, hf_target_specs
from models.random_weights import random_state

SEED = 20261130
VOCAB_SIZE = 512
SPECIAL_BASE = VOCAB_SIZE - len(SPECIAL_TOKENS)  # Kimi reserves the top 256 ids; here the top 32
YARN = {
    "type": "yarn",
    "factor": 8.0,
    "original_max_position_embeddings": 256,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


def special_id(token: str) -> int:
    return SPECIAL_BASE + SPECIAL_TOKENS.index(token)


# Kimi K2.x uses groups of 32 inputs; the tiny model's experts are 32 wide, so groups of 8 let TP-2 and TP-4 cut
# down_proj (16 and 8 columns a rank) on group boundaries with the experts kept INT4.
INT4_GROUP_SIZE = 8


def target_hf_config(int4_experts: bool) -> dict:
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        # Upstream K2.x says "kimi_k2" (remote code); transformers' built-in class and its weight-name
        # conversion key on "deepseek_v3", which is what the K2.5 text_config shows when transformers renders it.
        "model_type": "deepseek_v3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "moe_intermediate_size": 32,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "q_lora_rank": 32,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 16,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "routed_scaling_factor": 2.827,
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "norm_topk_prob": True,
        "n_group": 1,
        "topk_group": 1,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": dict(YARN),
        "max_position_embeddings": 2048,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "num_nextn_predict_layers": 0,
        "bos_token_id": special_id("[BOS]"),
        "eos_token_id": special_id("[EOS]"),
        "pad_token_id": special_id("[PAD]"),
        "initializer_range": 0.02,
        "use_cache": True,
        "torch_dtype": "float32",
    }
    if int4_experts:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {
                "group_0": {
                    "targets": ["Linear"],
                    "weights": {
                        "num_bits": 4,
                        "type": "int",
                        "symmetric": True,
                        "strategy": "group",
                        "group_size": INT4_GROUP_SIZE,
                        "dynamic": False,
                        "observer": "minmax",
                        "actorder": None,
                    },
                    "input_activations": None,
                    "output_activations": None,
                }
            },
            "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|down)_proj.*"],
            "kv_cache_scheme": None,
        }
    return config


def drafter_hf_config() -> dict:
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "head_dim": 16,
        "vocab_size": VOCAB_SIZE,
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "rope_scaling": dict(YARN),
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": 8,
        "num_target_layers": 4,
        "dflash_config": {"mask_token_id": special_id("[UNK]"), "target_layer_ids": [1, 2]},
        "torch_dtype": "float32",
    }


def random_tensors(specs: dict, seed: int) -> dict[str, torch.Tensor]:
    return random_state({name: spec.shape for name, spec in specs.items()}, seed)


def quantize_experts(tensors: dict[str, torch.Tensor], group_size: int) -> dict[str, torch.Tensor]:
    """Replaces every routed-expert weight by its compressed-tensors INT4 triplet."""
    out = {}
    for name, weight in tensors.items():
        if ".mlp.experts." not in name:
            out[name] = weight
            continue
        values, scale = int4.quantize(weight, group_size)
        base = name.removesuffix(".weight")
        out[base + ".weight_packed"] = int4.pack(values)
        out[base + ".weight_scale"] = scale.to(torch.bfloat16)
        out[base + ".weight_shape"] = torch.tensor(weight.shape, dtype=torch.int64)
    return out


def write_target(path: Path, int4_experts: bool, force: bool, tiktoken: bool = False) -> Path:
    """tiktoken: the tokenizer in Kimi K2.x's release layout (tiktoken.model + tokenizer_config.json), not
    tokenizer.json; the same weights either way."""
    config = target_hf_config(int4_experts)
    tensors = random_tensors(hf_target_specs(TargetConfig.from_hf(config)), SEED)
    if int4_experts:
        tensors = quantize_experts(tensors, group_size=INT4_GROUP_SIZE)
    generation = {
        "bos_token_id": config["bos_token_id"],
        "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"],
        "do_sample": False,
    }
    if tiktoken:  # as a chat release ships it: turns end at <|im_end|>, sampled by default
        eos = [special_id("<|im_end|>"), config["eos_token_id"]]
        generation = {**generation, "eos_token_id": eos, "do_sample": True, "temperature": 0.6, "top_p": 0.95}
    with staged_output_dir(path, force) as out:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (write_tiktoken_tokenizer if tiktoken else write_tokenizer)(out, SPECIAL_BASE, VOCAB_SIZE)
    return path


def write_drafter(path: Path, force: bool) -> Path:
    config = drafter_hf_config()
    tensors = random_tensors(hf_drafter_specs(DrafterConfig.from_hf(config)), SEED + 1)
    config_text = json.dumps(config, indent=2) + "\n"
    if not force and _same_drafter(path, config_text, tensors):
        logging.info("drafter %s already holds these weights; kept", path)
        return path
    with staged_output_dir(path, force) as out:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(config_text)
    return path


def _same_drafter(path: Path, config_text: str, tensors: dict[str, torch.Tensor]) -> bool:
    """The drafter is shared by the plain and the INT4 target: an identical one on disk is reused, not replaced."""
    from safetensors.torch import load_file

    try:
        if (path / "config.json").read_text() != config_text:
            return False
        stored = load_file(str(path / "model.safetensors"))
    except (OSError, ValueError):
        return False
    return stored.keys() == tensors.keys() and all(torch.equal(stored[k], v) for k, v in tensors.items())


def preset_hf_configs(name: str, dtype: str, smoke: bool = False) -> tuple[dict, dict]:
    """HF config.json dicts of a model preset's target and drafter (the tiny tokenizer's special ids)."""
    from models.presets import PRESETS, preset

    if name not in ("moe", "dense"):
        raise ValueError(f"--preset must be a whole model of {PRESETS}: moe or dense, got {name!r}")
    target, drafter = preset(name, smoke).target, preset(name, smoke).drafter
    fields = ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
              "num_attention_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
              "v_head_dim", "n_routed_experts", "num_experts_per_tok", "n_shared_experts", "first_k_dense_replace",
              "routed_scaling_factor", "max_position_embeddings")  # fmt: skip
    rope = target.rope.to_hf()
    hf_target = {**target_hf_config(False), **{f: getattr(target, f) for f in fields}, **rope, "torch_dtype": dtype}
    hf_target["num_key_value_heads"] = target.num_attention_heads
    hf_drafter = {
        **drafter_hf_config(),
        **{
            f: getattr(drafter, f)
            for f in (
                "hidden_size",
                "intermediate_size",
                "num_hidden_layers",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "vocab_size",
                "block_size",
                "max_position_embeddings",
            )
        },  # fmt: skip
        **drafter.rope.to_hf(),
        "num_target_layers": target.num_hidden_layers,
        "dflash_config": {"mask_token_id": special_id("[UNK]"), "target_layer_ids": list(drafter.target_layer_ids)},
        "torch_dtype": dtype,
    }
    hf_drafter["max_position_embeddings"] = target.max_position_embeddings
    return hf_target, hf_drafter


def write_preset(output_dir: Path, name: str, dtype: str, force: bool, device: str = "cpu",
                 smoke: bool = False) -> tuple[Path, Path]:  # fmt: skip
    """A preset's target and drafter as HF checkpoints with random weights (drawn on `device`, stored in `dtype`;
    the routing bias in float32 as Kimi K2.x ships it). smoke: the preset's few-MB form (scripts' CPU checks)."""
    hf_target, hf_drafter = preset_hf_configs(name, dtype, smoke)
    paths = output_dir / f"kimi-{name}", output_dir / f"kimi-{name}-dflash"
    for path in paths:
        check_output_dir(path, force)
    for path, config, specs, seed in (
        (paths[0], hf_target, hf_target_specs(TargetConfig.from_hf(hf_target)), SEED),
        (paths[1], hf_drafter, hf_drafter_specs(DrafterConfig.from_hf(hf_drafter)), SEED + 1),
    ):
        shapes = {n: spec.shape for n, spec in specs.items()}
        tensors = random_state(shapes, seed, device=device, dtype=getattr(torch, dtype))
        tensors = {n: (t.float() if n.endswith("e_score_correction_bias") else t).cpu() for n, t in tensors.items()}
        with staged_output_dir(path, force) as out:
            save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
            (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
            if path == paths[0]:
                write_tokenizer(out, SPECIAL_BASE, VOCAB_SIZE)
    return paths


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("output_dir", type=Path)
    parser.add_argument("--int4", action="store_true", help="store routed experts as INT4 pack-quantized")
    parser.add_argument("--tiktoken", action="store_true", help="the tokenizer in Kimi K2.x's release layout")
    parser.add_argument("--preset", default=None, help="write a model preset's dimensions instead (moe or dense)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="--preset weights")
    parser.add_argument("--device", default="cpu", help="--preset: where to draw the random weights (cpu, cuda)")
    parser.add_argument("--force", action="store_true", help="replace existing checkpoint folders")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.preset is not None and args.int4:
        parser.error("--int4 writes the tiny checkpoint; it does not combine with --preset")
    name = "kimi-k2-tiny" + ("-int4" if args.int4 else "") + ("-tiktoken" if args.tiktoken else "")
    try:
        if args.preset is not None:
            target, drafter = write_preset(args.output_dir, args.preset, args.dtype, args.force, args.device)
        else:
            target = write_target(args.output_dir / name, args.int4, args.force, args.tiktoken)
            drafter = write_drafter(args.output_dir / "kimi-k2-tiny-dflash", args.force)
    except (FileExistsError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"target:  {target}\ndrafter: {drafter}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
