"""The Kimi K2.x target, one tensor-parallel rank.

    forward(input_ids [T], positions [T], tree_mask [T, T] bool, latent_cache [L, S, D], cache_length [1],
            logit_indices [N])
      -> logits [N, vocab] fp32 (all ranks' vocab slices gathered),
         new_latent_kv [L, T, D] (the input tokens' latent rows: an output, never written into the cache),
         taps [T, len(tap_layers) * hidden] (outputs of the drafter's target layers, in tap order)

One sequence, or several requests' trees in one forward (batched steps): `latent_cache` each request's [L, S, D]
cache stacked [B, L, S, D] (the batch's slots), cache_length [B], tree_mask [B, T, T], request b's rows at
[b * T, (b + 1) * T) (`models/mla.py`, `per_request`); the engines' profiles are one sequence. Every operator form
(attention, MoE, norms, collectives) is fixed at construction by `ops` (`models/ops.py`), chosen by the rank factory.
"""

from __future__ import annotations

import torch
from torch import nn

from models.config import TargetConfig
from models.layers import VocabParallelEmbedding, VocabParallelHead
from models.moe import PackedMoE
from models.ops import ModelOps
from models.rope import Rotary


class DecoderLayer(nn.Module):
    def __init__(self, config: TargetConfig, layer_idx: int, ops: ModelOps):
        super().__init__()
        tp = config.mapping.tp_size
        self.input_layernorm = ops.norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ops.mla(config, layer_idx, ops)
        self.post_attention_layernorm = ops.norm(config.hidden_size, config.rms_norm_eps)
        if config.is_moe_layer(layer_idx):
            # a checkpoint whose routed experts stayed INT4 runs them packed, through ops.int4_moe
            self.mlp = (PackedMoE if config.quantization else ops.moe)(config, layer_idx, ops)
        else:
            self.mlp = ops.gated_mlp(config.hidden_size, config.intermediate_size // tp, ops.fused_projections)
        self.collectives = ops.collectives

    def forward(self, x, cos, sin, tree_mask, cache, cache_length):
        _, x, mlp_out, new_kv = self.deferred(x, None, cos, sin, tree_mask, cache, cache_length)
        return x + mlp_out, new_kv

    def deferred(self, x, pending, cos, sin, tree_mask, cache, cache_length):
        """The layer with each residual add done by the RMSNorm after it (one kernel on GPUs, `add_norm`): x +
        pending (the previous layer's MLP output, None before the first layer) by the input norm, the attention's
        output by the post-attention norm; this layer's MLP output is left pending for the next norm. Returns (x +
        pending: the previous layer's output, the stream before this layer's MLP output, that output, new_kv)."""
        if pending is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_norm(x, pending)
        attn, new_kv = self.self_attn(normed, cos, sin, tree_mask, cache, cache_length)
        mid, normed = self.post_attention_layernorm.add_norm(x, self.collectives.all_reduce(attn))
        return x, mid, self.collectives.all_reduce(self.mlp(normed)), new_kv


class KimiTarget(nn.Module):
    def __init__(self, config: TargetConfig, tap_layers: tuple[int, ...], ops: ModelOps):
        super().__init__()
        self.config, self.tap_layers = config, tuple(tap_layers)
        self.model = nn.Module()
        self.model.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, config.mapping, ops.collectives
        )
        self.model.layers = nn.ModuleList(DecoderLayer(config, i, ops) for i in range(config.num_hidden_layers))
        self.model.norm = ops.norm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = VocabParallelHead(config.vocab_size, config.hidden_size, config.mapping, ops.collectives)
        self.rotary = Rotary(config.rope, config.qk_rope_head_dim)

    def forward(self, input_ids, positions, tree_mask, latent_cache, cache_length, logit_indices):
        x, pending = self.model.embed_tokens(input_ids), None
        cos, sin = self.rotary(positions, x.dtype)
        outputs, new_kv = [], []  # each layer's output, made by the next norm's residual add
        for i, layer in enumerate(self.model.layers):
            cache = latent_cache[i] if latent_cache.dim() == 3 else latent_cache[:, i]  # [B, layers, S, D]: batched
            previous, x, pending, kv = layer.deferred(x, pending, cos, sin, tree_mask, cache, cache_length)
            if i:
                outputs.append(previous)
            new_kv.append(kv)
        last, normed = self.model.norm.add_norm(x, pending)
        outputs.append(last)
        logits = self.lm_head(normed[logit_indices])
        taps = torch.cat([outputs[i] for i in self.tap_layers], dim=-1)
        return logits, torch.stack(new_kv), taps
