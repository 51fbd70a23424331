"""Torch reference of TreeAttention: the oracle every other implementation is tested against.

    q          [T, H, D]   D = kv_lora_rank + qk_rope_head_dim (576 for Kimi): absorbed latent query | rope query
    cache      [S, D]      committed latent rows [c_kv | k_pe]; only rows < cache_length are valid
    cache_length [1] int   number of valid cache rows
    new_kv     [T, D]      the latent rows of the T input tokens (not yet in the cache)
    tree_mask  [T, T] bool tree_mask[i, j]: token i may see token j (ancestor-or-self; causal for prefill);
                          parents precede their children, so it is lower-triangular (the GPU kernel relies on it)
    -> out     [T, H, latent_dim]   softmax(q . k * scale) @ k[:, :latent_dim]; fp32 accumulation

Every token sees all valid cache rows plus the new rows its mask allows. A row that sees nothing outputs zeros.
"""

from __future__ import annotations

import torch


def tree_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    cache_length: torch.Tensor,
    new_kv: torch.Tensor,
    tree_mask: torch.Tensor,
    scale: float,
    latent_dim: int,
) -> torch.Tensor:
    length = int(cache_length.reshape(-1)[0])  # the oracle may read it on the host; kernels must not
    tokens = q.shape[0]
    keys = torch.cat((cache[:length], new_kv), dim=0).to(torch.float32)  # [length + T, D]
    visible = torch.cat((tree_mask.new_ones(tokens, length), tree_mask.to(torch.bool)), dim=1)  # [T, length + T]
    scores = torch.einsum("thd,kd->thk", q.to(torch.float32), keys) * scale
    scores = scores.masked_fill(~visible[:, None, :], float("-inf"))
    seen = visible.any(dim=-1)[:, None, None]
    probs = torch.where(seen, torch.softmax(torch.where(seen, scores, 0.0), dim=-1), 0.0)
    out = torch.einsum("thk,kc->thc", probs, keys[:, :latent_dim])
    return out.to(q.dtype)
