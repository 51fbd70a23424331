"""Training forms of the project's own target and drafter modules (one rank, TP 1), and their HF checkpoints.

The modules are `models.kimi.KimiTarget` and `models.dflash.DFlashDrafter`, built with the reference operator forms;
training runs their weights through batched forwards written here (the inference forwards take one sequence and a
KV cache), so what is trained is exactly what `build-engine` converts and the runner executes:

- `target_forward`: causal attention over whole sequences in MLA's expanded form (`ExpandedMLA`'s math), the
  MoE with every expert applied densely and weighted by the router's sparse top-k weights (the same function as
  token-choice, differentiable, no gathers), the per-expert token counts for the loss-free balancing update.
- `drafter_forward`: DFlash's block objective, many blocks per sequence: a block at anchor a holds the token at a
  and mask tokens at a+1 .. a+7, attends to the context features of every position < a and, non-causally, to its
  own block (as `DFlashDrafter.forward` does from the cache), and predicts the tokens at a+1 .. a+7.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models.config import DrafterConfig, TargetConfig
from models.dflash import DFlashDrafter
from models.kimi import KimiTarget
from models.layout import EXPERT_PROJECTIONS, hf_drafter_specs, hf_expert_name, hf_target_specs, stacked_expert_name
from models.moe import MoE
from models.parallel import SingleRank
from models.rope import deinterleave_permutation
from runner.factory import cpu_ops


def build_models(target_hf: dict, drafter_hf: dict, device) -> tuple[KimiTarget, DFlashDrafter]:
    """The TP-1 target and drafter in float32 on `device`, initialised for training; the drafter's embedding and
    head are the target's (frozen while the drafter trains)."""
    target_cfg, drafter_cfg = TargetConfig.from_hf(target_hf), DrafterConfig.from_hf(drafter_hf)
    ops = cpu_ops(SingleRank())
    gen = torch.Generator().manual_seed(0)
    target = KimiTarget(target_cfg, drafter_cfg.target_layer_ids, ops)
    drafter = DFlashDrafter(drafter_cfg, target_cfg, ops)
    for model, layers in ((target, target_cfg.num_hidden_layers), (drafter, drafter_cfg.num_hidden_layers)):
        for name, param in model.named_parameters():
            param.data.copy_(_init(name, param.shape, layers, gen))
    drafter.embed_tokens.weight = target.model.embed_tokens.weight
    drafter.lm_head.weight = target.lm_head.weight
    return target.to(device), drafter.to(device)


def _init(name: str, shape: torch.Size, layers: int, gen: torch.Generator) -> torch.Tensor:
    if len(shape) == 1:
        return torch.ones(shape)  # RMSNorm weights
    if name.endswith("embed_tokens.weight"):
        return torch.randn(shape, generator=gen)
    std = shape[-1] ** -0.5
    if name.endswith(("o_proj.weight", "down_proj.weight")):
        std /= (2 * layers) ** 0.5  # residual branches (GPT-2's scaling)
    return torch.randn(shape, generator=gen) * std


def target_forward(target: KimiTarget, ids: torch.Tensor):
    """ids [B, L] -> logits [B, L, vocab] fp32, taps [B, L, taps * hidden], per-MoE-layer expert counts [E]."""
    batch, length = ids.shape
    x = target.model.embed_tokens(ids.reshape(-1))
    positions = torch.arange(length, device=ids.device).repeat(batch)
    cos, sin = target.rotary(positions, x.dtype)
    outputs, counts = [], []
    for layer in target.model.layers:
        x = x + _attention(layer.self_attn, layer.input_layernorm(x), cos, sin, batch)
        h = layer.post_attention_layernorm(x)
        if isinstance(layer.mlp, MoE):
            out, count = _moe(layer.mlp, h)
            counts.append(count)
        else:
            out = layer.mlp(h)
        x = x + out
        outputs.append(x)
    logits = target.lm_head(target.model.norm(x)).view(batch, length, -1)
    taps = torch.cat([outputs[i] for i in target.tap_layers], dim=-1).view(batch, length, -1)
    return logits, taps, counts


def _attention(attn, x, cos, sin, batch: int) -> torch.Tensor:
    """Causal MLA over whole sequences, expanded form: keys and values from the latent rows via kv_b_proj."""
    tokens, heads, dtype = x.shape[0], attn.heads, torch.bfloat16 if x.is_cuda else x.dtype
    q_nope, q_pe, latent = attn.project(x, cos, sin)
    c_kv, k_pe = latent[:, : attn.kv_lora], latent[:, attn.kv_lora :]
    w_kc, w_vc = attn.kv_b_weights()
    k_nope = torch.einsum("nc,hdc->nhd", c_kv, w_kc)
    values = torch.einsum("nc,hvc->nhv", c_kv, w_vc)
    q = torch.cat((q_nope.to(dtype), q_pe.to(dtype)), dim=-1)
    k = torch.cat((k_nope.to(dtype), k_pe.to(dtype)[:, None].expand(-1, heads, -1)), dim=-1)
    v = F.pad(values.to(dtype), (0, q.shape[-1] - attn.v_dim))  # the fused kernels want one head width

    def split(t):
        return t.view(batch, tokens // batch, heads, -1).transpose(1, 2)

    out = F.scaled_dot_product_attention(split(q), split(k), split(v), is_causal=True, scale=attn.scale)
    out = out[..., : attn.v_dim].transpose(1, 2).reshape(tokens, heads * attn.v_dim)
    return attn.o_proj(out)


def _moe(moe: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids, weights = moe.gate(x)  # [N, k]: the inference router (noaux_tc: the bias steers the choice only)
    experts = moe.experts["gate_proj"].weight.shape[0]
    dense = torch.zeros(x.shape[0], experts, device=x.device, dtype=weights.dtype).scatter(1, ids, weights)
    gate = torch.einsum("nh,ewh->new", x, moe.experts["gate_proj"].weight)
    up = torch.einsum("nh,ewh->new", x, moe.experts["up_proj"].weight)
    act = F.silu(gate) * up * dense.to(up.dtype)[..., None]
    routed = torch.einsum("new,ehw->nh", act, moe.experts["down_proj"].weight)
    ones = torch.ones(ids.numel(), device=x.device)
    count = torch.zeros(experts, device=x.device).scatter_add_(0, ids.reshape(-1), ones)
    return routed + moe.shared_experts(x), count


@torch.no_grad()
def balance_routers(target: KimiTarget, counts: list[torch.Tensor], rate: float) -> None:
    """DeepSeek-V3's auxiliary-loss-free balancing: each expert's correction bias moves by `rate` towards the mean
    load (down when over-loaded, up when under-loaded)."""
    routers = [layer.mlp.gate for layer in target.model.layers if isinstance(layer.mlp, MoE)]
    for router, count in zip(routers, counts):
        router.e_score_correction_bias += rate * torch.sign(count.mean() - count)


def drafter_forward(drafter: DFlashDrafter, cfg: DrafterConfig, taps, ids, anchors):
    """taps [B, L, taps * hidden] (the frozen target's), ids [B, L], anchors [B, K] in [1, L - block] ->
    logits [B, K, block - 1, vocab] fp32 for the tokens at anchor + 1 .. anchor + block - 1."""
    batch, length = ids.shape
    blocks, size = anchors.shape[1], cfg.block_size
    device = ids.device
    dtype = torch.bfloat16 if ids.is_cuda else torch.float32
    block_pos = anchors[..., None] + torch.arange(size, device=device)  # [B, K, block]
    block_ids = torch.full_like(block_pos, cfg.mask_token_id)
    block_ids[..., 0] = ids.gather(1, anchors)
    rows = blocks * size
    x = drafter.embed_tokens(block_ids.reshape(-1)).view(batch, rows, -1)
    ctx = drafter.hidden_norm(drafter.fc(taps))  # [B, L, hidden]
    ctx_rope = drafter.rotary(torch.arange(length, device=device).repeat(batch), dtype)
    block_rope = drafter.rotary(block_pos.reshape(-1), dtype)
    sees_context = torch.arange(length, device=device) < anchors.repeat_interleave(size, dim=1)[..., None]
    block_of = torch.arange(rows, device=device) // size
    sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)
    mask = torch.cat((sees_context, sees_block), dim=-1)[:, None]  # [B, 1, K * block, L + K * block]
    for layer in drafter.layers:
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q = attn.apply_rotary(attn.q_norm(attn.q_proj(h).view(batch * rows, attn.heads, -1)), *block_rope)
        k_ctx, v_ctx = attn.keys_values(ctx.reshape(batch * length, -1), *ctx_rope)
        k_blk, v_blk = attn.keys_values(h.reshape(batch * rows, -1), *block_rope)
        groups = attn.heads // attn.kv_heads

        def heads_first(t, n):
            return t.to(dtype).view(batch, n, t.shape[-2], -1).transpose(1, 2)

        keys = torch.cat((heads_first(k_ctx, length), heads_first(k_blk, rows)), dim=2)
        values = torch.cat((heads_first(v_ctx, length), heads_first(v_blk, rows)), dim=2)
        keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(heads_first(q, rows), keys, values, attn_mask=mask, scale=attn.scale)
        x = x + attn.o_proj(out.transpose(1, 2).reshape(batch, rows, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    hidden = drafter.norm(x).view(batch, blocks, size, -1)[:, :, 1:]
    return drafter.lm_head(hidden)


# --- HF checkpoints ----------------------------------------------------------------------------------------------


def target_hf_state(target: KimiTarget) -> dict[str, torch.Tensor]:
    """The module's weights under HF names: experts unstacked, rope rows re-interleaved (the inverse of what
    `MultiLatentAttention.prepare_weights` does at load), bf16 but for the router (fp32, as Kimi ships its bias)."""
    cfg = target.config
    state = {k: v.detach().float().cpu() for k, v in target.state_dict().items()}
    perm = deinterleave_permutation(cfg.qk_rope_head_dim)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn"
        q_b = state[f"{p}.q_b_proj.weight"].view(cfg.num_attention_heads, cfg.qk_head_dim, -1).clone()
        rope = q_b[:, cfg.qk_nope_head_dim :].clone()
        q_b[:, cfg.qk_nope_head_dim + perm] = rope
        state[f"{p}.q_b_proj.weight"] = q_b.view(-1, q_b.shape[-1])
        kv_a = state[f"{p}.kv_a_proj_with_mqa.weight"].clone()
        rope = kv_a[cfg.kv_lora_rank :].clone()
        kv_a[cfg.kv_lora_rank + perm] = rope
        state[f"{p}.kv_a_proj_with_mqa.weight"] = kv_a
        if not cfg.is_moe_layer(i):
            continue
        for proj in EXPERT_PROJECTIONS:
            stacked = state.pop(stacked_expert_name(i, proj))
            for e in range(cfg.n_routed_experts):
                state[hf_expert_name(i, e, proj)] = stacked[e].clone()
    expected = set(hf_target_specs(cfg))
    if set(state) != expected:
        raise RuntimeError(f"target state differs from the HF layout: {sorted(set(state) ^ expected)[:8]}")
    return {k: v if ".mlp.gate." in k else v.to(torch.bfloat16) for k, v in state.items()}


def load_target_hf(target: KimiTarget, model_dir: Path) -> None:
    """Loads an HF checkpoint written by `target_hf_state` back into the TP-1 module (float32)."""
    cfg = target.config
    hf = {k: v.float() for k, v in load_file(str(Path(model_dir) / "model.safetensors")).items()}
    perm = deinterleave_permutation(cfg.qk_rope_head_dim)
    state = {}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}.self_attn"
        q_b = hf[f"{p}.q_b_proj.weight"].view(cfg.num_attention_heads, cfg.qk_head_dim, -1).clone()
        q_b[:, cfg.qk_nope_head_dim :] = q_b[:, cfg.qk_nope_head_dim + perm].clone()
        hf[f"{p}.q_b_proj.weight"] = q_b.view(-1, q_b.shape[-1])
        kv_a = hf[f"{p}.kv_a_proj_with_mqa.weight"].clone()
        kv_a[cfg.kv_lora_rank :] = kv_a[cfg.kv_lora_rank + perm].clone()
        hf[f"{p}.kv_a_proj_with_mqa.weight"] = kv_a
        if cfg.is_moe_layer(i):
            for proj in EXPERT_PROJECTIONS:
                experts = [hf.pop(hf_expert_name(i, e, proj)) for e in range(cfg.n_routed_experts)]
                state[stacked_expert_name(i, proj)] = torch.stack(experts)
    state.update(hf)
    device = next(target.parameters()).device
    target.load_state_dict({k: v.to(device) for k, v in state.items()}, strict=True)


def drafter_hf_state(drafter: DFlashDrafter, cfg: DrafterConfig) -> dict[str, torch.Tensor]:
    state = {k: v.detach().cpu().to(torch.bfloat16) for k, v in drafter.state_dict().items()}
    state = {k: v for k, v in state.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    expected = set(hf_drafter_specs(cfg))
    if set(state) != expected:
        raise RuntimeError(f"drafter state differs from the HF layout: {sorted(set(state) ^ expected)[:8]}")
    return state


def save_checkpoint(out: Path, state: dict[str, torch.Tensor], config: dict, extra: dict[str, dict]) -> None:
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name, data in extra.items():
        (out / name).write_text(json.dumps(data, indent=1) + "\n")
