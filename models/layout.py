"""Tensor names, shapes and the TP-N split of every weight (DESIGN.md, "Tensor parallel layout").

Two views of the same weights:
- `hf_*_specs`: the Hugging Face checkpoint (Kimi K2.x / DeepSeek-V3 names, one tensor per routed expert);
- `rank_*_shapes`: one rank's converted checkpoint (`rank{N}.safetensors`), routed experts stacked per layer as
  `...mlp.experts.{gate,up,down}_proj.weight` of shape [n_routed_experts, out, in], or, kept INT4, as
  `...weight_packed` [n_routed_experts, out, in / 8] int32 and `...weight_scale` [n_routed_experts, out, in / group].

A spec's `split_dim` is the dimension cut into tp_size equal contiguous pieces (None: replicated on every rank).
Column-parallel (split_dim 0): q_b_proj / kv_b_proj by head, gate/up by intermediate row, embedding and lm_head by
vocab row, drafter q/k/v by head (K/V heads replicated when there are fewer than ranks). Row-parallel (split_dim 1):
o_proj and down projections, followed by an all-reduce. Everything else (q_a / kv_a projections, norms, router,
drafter fc) is replicated.
"""

from __future__ import annotations

from dataclasses import dataclass

from models.config import DrafterConfig, TargetConfig

EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class TensorSpec:
    """heads: the heads along split_dim, for a split that replicates them when tp_size exceeds them (the drafter's
    K/V heads: rank r holds head r // (tp_size // heads), as TensorRT-LLM and vLLM lay out GQA)."""

    shape: tuple[int, ...]
    split_dim: int | None = None
    heads: int | None = None

    def pieces(self, tp_size: int) -> int:
        """Distinct pieces split_dim is cut into: tp_size, or the heads when there are fewer."""
        return min(tp_size, self.heads) if self.heads else tp_size

    def shard_shape(self, tp_size: int) -> tuple[int, ...]:
        if self.split_dim is None:
            return self.shape
        shape = list(self.shape)
        shape[self.split_dim] //= self.pieces(tp_size)
        return tuple(shape)

    def rank_piece(self, rank: int, tp_size: int) -> int:
        """Which of the `pieces` rank `rank` holds."""
        return rank // (tp_size // self.pieces(tp_size))


def _mlp(prefix: str, hidden: int, width: int) -> dict[str, TensorSpec]:
    return {
        f"{prefix}.gate_proj.weight": TensorSpec((width, hidden), 0),
        f"{prefix}.up_proj.weight": TensorSpec((width, hidden), 0),
        f"{prefix}.down_proj.weight": TensorSpec((hidden, width), 1),
    }


def hf_target_specs(cfg: TargetConfig, include_experts: bool = True) -> dict[str, TensorSpec]:
    """Every tensor of a Kimi K2.x text checkpoint (dequantized view), with its TP split."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    specs = {
        "model.embed_tokens.weight": TensorSpec((cfg.vocab_size, h), 0),
        "model.norm.weight": TensorSpec((h,)),
        "lm_head.weight": TensorSpec((cfg.vocab_size, h), 0),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        specs.update(
            {
                f"{p}.input_layernorm.weight": TensorSpec((h,)),
                f"{p}.post_attention_layernorm.weight": TensorSpec((h,)),
                f"{p}.self_attn.q_a_proj.weight": TensorSpec((cfg.q_lora_rank, h)),
                f"{p}.self_attn.q_a_layernorm.weight": TensorSpec((cfg.q_lora_rank,)),
                f"{p}.self_attn.q_b_proj.weight": TensorSpec((heads * cfg.qk_head_dim, cfg.q_lora_rank), 0),
                f"{p}.self_attn.kv_a_proj_with_mqa.weight": TensorSpec((cfg.latent_dim, h)),
                f"{p}.self_attn.kv_a_layernorm.weight": TensorSpec((cfg.kv_lora_rank,)),
                f"{p}.self_attn.kv_b_proj.weight": TensorSpec(
                    (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), 0
                ),
                f"{p}.self_attn.o_proj.weight": TensorSpec((h, heads * cfg.v_head_dim), 1),
            }
        )
        if not cfg.is_moe_layer(i):
            specs.update(_mlp(f"{p}.mlp", h, cfg.intermediate_size))
            continue
        specs[f"{p}.mlp.gate.weight"] = TensorSpec((cfg.n_routed_experts, h))
        specs[f"{p}.mlp.gate.e_score_correction_bias"] = TensorSpec((cfg.n_routed_experts,))
        specs.update(_mlp(f"{p}.mlp.shared_experts", h, cfg.shared_intermediate_size))
        if include_experts:
            for e in range(cfg.n_routed_experts):
                specs.update(_mlp(f"{p}.mlp.experts.{e}", h, cfg.moe_intermediate_size))
    return specs


def hf_expert_name(layer: int, expert: int, projection: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{expert}.{projection}.weight"


def stacked_expert_name(layer: int, projection: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{projection}.weight"


def expert_spec(cfg: TargetConfig, projection: str) -> TensorSpec:
    return _mlp("x", cfg.hidden_size, cfg.moe_intermediate_size)[f"x.{projection}.weight"]


def hf_drafter_specs(cfg: DrafterConfig) -> dict[str, TensorSpec]:
    """The drafter's own tensors (it borrows the target's embedding and lm_head)."""
    h, hd, kv = cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads
    specs = {
        "fc.weight": TensorSpec((h, cfg.num_taps * h)),
        "hidden_norm.weight": TensorSpec((h,)),
        "norm.weight": TensorSpec((h,)),
    }
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}"
        specs.update(
            {
                f"{p}.input_layernorm.weight": TensorSpec((h,)),
                f"{p}.post_attention_layernorm.weight": TensorSpec((h,)),
                f"{p}.self_attn.q_proj.weight": TensorSpec((cfg.num_attention_heads * hd, h), 0),
                f"{p}.self_attn.k_proj.weight": TensorSpec((kv * hd, h), 0, kv),
                f"{p}.self_attn.v_proj.weight": TensorSpec((kv * hd, h), 0, kv),
                f"{p}.self_attn.o_proj.weight": TensorSpec((h, cfg.num_attention_heads * hd), 1),
                f"{p}.self_attn.q_norm.weight": TensorSpec((hd,)),
                f"{p}.self_attn.k_norm.weight": TensorSpec((hd,)),
            }
        )
        specs.update(_mlp(f"{p}.mlp", h, cfg.intermediate_size))
    return specs


def packed_expert_names(layer: int, projection: str) -> tuple[str, str]:
    """A converted checkpoint's INT4 routed experts: (`...experts.{proj}.weight_packed`, `...weight_scale`)."""
    base = stacked_expert_name(layer, projection).removesuffix(".weight")
    return f"{base}.weight_packed", f"{base}.weight_scale"


def packed_expert_shapes(cfg: TargetConfig, projection: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """One rank's packed [E, out, in / 8] int32 and scale [E, out, in / group_size] shapes. The row-parallel down
    projection is cut along its input width, which must hold whole groups on every rank."""
    group = cfg.quantization.group_size
    out_features, in_features = expert_spec(cfg, projection).shard_shape(cfg.mapping.tp_size)
    if in_features % group or group % 8:
        width = (
            f"per-rank input width moe_intermediate_size / tp_size = {cfg.moe_intermediate_size} / "
            f"{cfg.mapping.tp_size} = {in_features}"
            if projection == "down_proj"
            else f"input width {in_features}"
        )
        raise ValueError(
            f"INT4 experts: {projection}'s {width} must be a multiple of the group size {group} (itself a multiple "
            "of 8) so that every rank holds whole groups; choose another tp_size or convert with --dequantize_experts"
        )
    experts = cfg.n_routed_experts
    return (experts, out_features, in_features // 8), (experts, out_features, in_features // group)


def rank_target_shapes(cfg: TargetConfig) -> dict[str, tuple[int, ...]]:
    """Names and shapes in one rank's converted target checkpoint (routed experts packed when cfg.quantization)."""
    tp = cfg.mapping.tp_size
    shapes = {name: spec.shard_shape(tp) for name, spec in hf_target_specs(cfg, include_experts=False).items()}
    for i in range(cfg.num_hidden_layers):
        if not cfg.is_moe_layer(i):
            continue
        for proj in EXPERT_PROJECTIONS:
            if cfg.quantization:
                names, packed_shapes = packed_expert_names(i, proj), packed_expert_shapes(cfg, proj)
                shapes.update(zip(names, packed_shapes))
            else:
                shapes[stacked_expert_name(i, proj)] = (cfg.n_routed_experts, *expert_spec(cfg, proj).shard_shape(tp))
    return shapes


def rank_drafter_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    tp = cfg.mapping.tp_size
    return {name: spec.shard_shape(tp) for name, spec in hf_drafter_specs(cfg).items()}


def check_tensor_set(found: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]], what: str) -> None:
    """Raises one error listing every missing, unexpected and mis-shaped tensor."""
    missing = sorted(set(expected) - set(found))
    unexpected = sorted(set(found) - set(expected))
    wrong = [
        f"{name}: expected {expected[name]}, got {found[name]}"
        for name in sorted(set(found) & set(expected))
        if tuple(found[name]) != tuple(expected[name])
    ]
    if missing or unexpected or wrong:
        parts = []
        if missing:
            parts.append(f"missing {len(missing)} tensors: {_clip(missing)}")
        if unexpected:
            parts.append(f"unexpected {len(unexpected)} tensors: {_clip(unexpected)}")
        if wrong:
            parts.append(f"{len(wrong)} shape mismatches: {_clip(wrong)}")
        raise ValueError(f"{what}: " + "; ".join(parts))


def _clip(items: list[str], limit: int = 12) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
