"""The trained pair's dimensions: a small Kimi K2.x-architecture target and its DFlash drafter.

Every structural feature of Kimi K2.x is kept: MLA (q and kv LoRA, unequal qk 48 / v 32 head dims, yarn rope with
interleaved rope rows), a dense first layer, noaux_tc sigmoid routing with a correction bias over 16 experts, top-4,
one shared expert. 8 heads, experts 64 wide and a 4096-id vocab divide for TP-8 (one head a rank). The drafter is
z-lab's DFlash: block 8, three taps of the target's layers (1, 3, 4: not the last, whose hidden state transformers
reports after the final norm), the [UNK] id as the mask token, GQA (16 heads over 8 KV heads), the target's
embedding and head borrowed. About 8 M target and 2.6 M drafter parameters, stored in bf16.
"""

from __future__ import annotations

from builder.demo_checkpoints import YARN, drafter_hf_config, target_hf_config
from training.data import VOCAB_SIZE, special_id

TARGET_NAME, DRAFTER_NAME = "kimi-k2-py", "kimi-k2-py-dflash"
MAX_POSITIONS = 2048


def target_config() -> dict:
    config = target_hf_config(int4_experts=False)
    config.update(
        vocab_size=VOCAB_SIZE,
        hidden_size=256,
        intermediate_size=768,
        moe_intermediate_size=64,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=8,
        q_lora_rank=96,
        kv_lora_rank=64,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        rope_scaling={**YARN, "original_max_position_embeddings": 512, "factor": 4.0},
        max_position_embeddings=MAX_POSITIONS,
        bos_token_id=special_id("[BOS]"),
        eos_token_id=special_id("[EOS]"),
        pad_token_id=special_id("[PAD]"),
        torch_dtype="bfloat16",
    )
    return config


def drafter_config() -> dict:
    config = drafter_hf_config()
    config.update(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=3,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=32,
        vocab_size=VOCAB_SIZE,
        rope_scaling={**YARN, "original_max_position_embeddings": 512, "factor": 4.0},
        max_position_embeddings=MAX_POSITIONS,
        block_size=8,
        num_target_layers=6,
        dflash_config={"mask_token_id": special_id("[UNK]"), "target_layer_ids": [1, 3, 4]},
        torch_dtype="bfloat16",
    )
    return config
