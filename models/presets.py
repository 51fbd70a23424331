"""Model dimensions known by name: Kimi K2.x (the whole model, and one TP-N rank's share) and the mid-size
Kimi-architecture models that run whole on one GPU. Benchmarks, tests and the rank factory build from these.

    kimi-k2    the whole Kimi K2.x text model (61 layers, MLA 64 heads, 384 experts of width 2048, top-8 + a shared
               expert, vocab 163840) and the Kimi-K2.5-DFlash drafter (6 layers, 64 / 8 heads of 128, block 8)
    kimi-rank  what one rank of kimi-k2 at TP-8 computes for a token, alone on one GPU (no collectives): 61 layers
               at the per-rank dims (8 heads, the vocab-parallel head of 163840 / 8 rows, the drafter's rank share),
               every MLP dense at the per-rank width 18432 / 8 = 2304, which at one token reads the bytes of the
               shared expert plus 8 routed experts of width 2048 / 8 (the rank's 384 experts in bf16 would take
               254 GB)
    kimi-rank-int4  one TP-8 rank of kimi-k2 as it really runs: the dense first layer and 60 MoE layers with the
               rank's slice of all 384 experts kept INT4 (W4A16, groups of 32: 71 GB), alone on one GPU
    moe        hidden 2048, 8 layers (1 dense), 16 heads, MLA 1536/512/64, 64 experts of width 768, top-8, vocab 32768
    dense      the same with every layer dense

`smoke=True` gives each the same structure at a few-MB size, so a benchmark script can be checked on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from models.config import DrafterConfig, QuantConfig, RopeConfig, TargetConfig
from models.mapping import Mapping

KIMI_ROPE = RopeConfig("yarn", 50000.0, 64.0, 4096, 32.0, 1.0, 1.0, 1.0)
PRESETS = ("kimi-k2", "kimi-rank", "kimi-rank-int4", "moe", "dense")


@dataclass(frozen=True)
class Preset:
    name: str
    target: TargetConfig
    drafter: DrafterConfig
    standalone_rank: bool = False  # one rank's share of a TP-N model run alone: its compute, no collectives


def kimi_k2(tp_size: int = 1) -> TargetConfig:
    """Kimi K2.x's text model (DeepSeek-V3 architecture), as `tp_size` ranks split it."""
    return TargetConfig(
        vocab_size=163840,
        hidden_size=7168,
        intermediate_size=18432,
        moe_intermediate_size=2048,
        num_hidden_layers=61,
        num_attention_heads=64,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_nope_head_dim=128,
        qk_rope_head_dim=64,
        v_head_dim=128,
        n_routed_experts=384,
        num_experts_per_tok=8,
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.827,
        rope=KIMI_ROPE,
        max_position_embeddings=262144,
        mapping=Mapping(tp_size, 0, tp_size),
    )


def kimi_k2_dflash(target: TargetConfig) -> DrafterConfig:
    """Kimi-K2.5-DFlash (6 layers, hidden 7168, 64 / 8 heads of 128, MLP 18432, block 8), split like `target`."""
    return DrafterConfig(
        hidden_size=7168,
        intermediate_size=18432,
        num_hidden_layers=6,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=target.vocab_size,
        block_size=8,
        mask_token_id=target.vocab_size - 2,  # [UNK] 163838
        target_layer_ids=(1, 12, 24, 35, 47, 58),
        rope=KIMI_ROPE,
        mapping=target.mapping,
    )


def preset(name: str, smoke: bool = False) -> Preset:
    if name not in PRESETS:
        raise ValueError(f"preset must be one of {PRESETS}, got {name!r}")
    if name in ("kimi-k2", "kimi-rank", "kimi-rank-int4"):
        rank = name != "kimi-k2"
        target = kimi_k2(8 if rank else 1)
        if smoke:
            target = replace(target, hidden_size=64, intermediate_size=256, num_hidden_layers=4, vocab_size=1024,
                             q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
                             num_attention_heads=16, n_routed_experts=16, moe_intermediate_size=64,
                             mapping=Mapping(2, 0, 2) if rank else target.mapping)  # fmt: skip
        if name == "kimi-rank":
            target = replace(target, first_k_dense_replace=target.num_hidden_layers)
        if name == "kimi-rank-int4":
            target = replace(target, quantization=QuantConfig(group_size=32))
        drafter = kimi_k2_dflash(target)
        if smoke:
            drafter = replace(drafter, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                              target_layer_ids=(1, 2))  # fmt: skip
        return Preset(name, target, drafter, standalone_rank=rank)
    if smoke:
        hidden, layers, heads, experts, width, vocab, q_lora, kv_lora, rope = 64, 4, 4, 8, 32, 512, 32, 32, 16
    else:
        hidden, layers, heads, experts, width, vocab, q_lora, kv_lora, rope = 2048, 8, 16, 64, 768, 32768, 1536, 512, 64
    target = TargetConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        moe_intermediate_size=width,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=2 * rope,
        qk_rope_head_dim=rope,
        v_head_dim=2 * rope,
        n_routed_experts=experts,
        num_experts_per_tok=min(8, experts),
        n_shared_experts=1,
        first_k_dense_replace=layers if name == "dense" else 1,
        routed_scaling_factor=2.827,
        rope=KIMI_ROPE,
        max_position_embeddings=262144,
    )
    drafter = DrafterConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=2 * rope,
        vocab_size=vocab,
        block_size=8,
        mask_token_id=vocab - 2,
        target_layer_ids=(1, layers // 2, layers - 2),
        rope=KIMI_ROPE,
    )
    return Preset(name, target, drafter)
