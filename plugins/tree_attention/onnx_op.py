"""Export form: `ddtree::TreeAttention` in the ONNX graph (TorchScript exporter, `torch.onnx.export(dynamo=False)`).

Attributes: `scale` (float, the softmax scale), `latent_dim` (int, kv_lora_rank: the output width).
"""

from __future__ import annotations

import torch

from plugins.tree_attention.reference import tree_attention


class TreeAttentionOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, cache, cache_length, new_kv, tree_mask, scale: float, latent_dim: int):
        return tree_attention(q, cache, cache_length, new_kv, tree_mask, scale, latent_dim)

    @staticmethod
    def symbolic(g, q, cache, cache_length, new_kv, tree_mask, scale, latent_dim):
        out = g.op(
            "ddtree::TreeAttention", q, cache, cache_length, new_kv, tree_mask, scale_f=scale, latent_dim_i=latent_dim
        )
        sizes = q.type().varyingSizes()
        if sizes is not None:
            out.setType(q.type().with_sizes([sizes[0], sizes[1], latent_dim]))
        return out


def export_tree_attention(q, cache, cache_length, new_kv, tree_mask, scale: float, latent_dim: int):
    return TreeAttentionOp.apply(q, cache, cache_length, new_kv, tree_mask, scale, latent_dim)
