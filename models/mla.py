"""Multi-head latent attention (MLA), one rank's heads, in two equivalent forms.

`ExpandedMLA` (prefill form): per-head keys and values are expanded from the latent rows with kv_b_proj and the
attention runs over [T, H, qk_head_dim] / [T, H, v_head_dim] (transformers' DeepseekV3Attention).
`AbsorbedMLA` (decode / verify form; `InPlaceAbsorbedMLA` is its GPU form): kv_b_proj is folded into the query and
the output: per head q_latent = q_nope @ W_kc [T, H, kv_lora], the query [q_latent | q_pe] of width latent_dim
attends MQA-style to the cached latent rows [c_kv | k_pe], and the latent output is projected back with W_vc. This
is the form the engines use (through the TreeAttention op) because it reads the 576-wide latent cache once for all
heads.

Both return (partial output of this rank's heads before the o_proj all-reduce, the new latent rows [T, latent_dim]).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn

from models.config import TargetConfig
from models.layers import fuse_linears, linear
from models.rope import deinterleave_permutation
from models.streams import beside, join


def per_request(attention):
    """The tree attention of several requests' trees in one forward (batched steps: `runner/device/batch.py`):
    `cache` each request's [S, D] layer cache, stacked [B, S, D] (one slot's caches a row of the batch's: any stride
    between requests), cache_length [B], tree_mask [B, T, T], request b's rows at [b * T, (b + 1) * T). An op that
    takes a batch (`batched`: the GPU kernel, one launch for every request) gets it whole; otherwise it runs once
    per request; everything else in the layer runs once for all rows. One request ([S, D], as every engine profile
    has it): the op itself."""
    whole = getattr(attention, "batched", False)

    def attend(query, cache, cache_length, new_kv, tree_mask, scale, latent_dim):
        if cache.dim() == 2 or whole:
            return attention(query, cache, cache_length, new_kv, tree_mask, scale, latent_dim)
        rows = query.shape[0] // cache.shape[0]
        return torch.cat([attention(query[b * rows : (b + 1) * rows], layer, cache_length[b : b + 1],
                                    new_kv[b * rows : (b + 1) * rows], tree_mask[b], scale, latent_dim)
                          for b, layer in enumerate(cache)])  # fmt: skip

    return attend


class MultiLatentAttention(nn.Module):
    def __init__(self, config: TargetConfig, layer_idx: int, ops):
        """ops: `models.ops.ModelOps` (the tree attention, norm and rotary forms)."""
        super().__init__()
        c = config
        self.heads, self.nope, self.rope = c.heads_per_rank, c.qk_nope_head_dim, c.qk_rope_head_dim
        self.kv_lora, self.v_dim, self.scale = c.kv_lora_rank, c.v_head_dim, c.softmax_scale
        self.rope_interleave = c.rope_interleave
        self.tree_attention, self.apply_rotary = per_request(ops.tree_attention), ops.rotary
        self.fused = ops.fused_projections
        self.overlap = ops.side_stream  # InPlaceAbsorbedMLA: the latent row's norm and rope beside the query's chain
        self.q_a_proj = linear(c.hidden_size, c.q_lora_rank)
        self.q_a_layernorm = ops.norm(c.q_lora_rank, 1e-6)
        self.q_b_proj = linear(c.q_lora_rank, self.heads * c.qk_head_dim)
        self.kv_a_proj_with_mqa = linear(c.hidden_size, c.latent_dim)
        self.kv_a_layernorm = ops.norm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = linear(c.kv_lora_rank, self.heads * (self.nope + self.v_dim))
        self.o_proj = linear(self.heads * self.v_dim, c.hidden_size)

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """Once after loading: de-interleave the rope rows so forward can use the half-split rotation."""
        if not self.rope_interleave:
            return
        perm = deinterleave_permutation(self.rope)
        q_b = self.q_b_proj.weight.view(self.heads, self.nope + self.rope, -1)
        q_b[:, self.nope :] = q_b[:, self.nope :][:, perm].clone()
        kv_a = self.kv_a_proj_with_mqa.weight
        kv_a[self.kv_lora :] = kv_a[self.kv_lora :][perm].clone()

    def project(self, x, cos, sin):
        """x: [T, hidden] -> q_nope [T, H, nope], q_pe [T, H, rope] (rotated), new_kv [T, kv_lora + rope]."""
        tokens = x.shape[0]
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(tokens, self.heads, self.nope + self.rope)
        q_nope, q_pe = q[..., : self.nope], self.apply_rotary(q[..., self.nope :], cos, sin)
        kv = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(kv[:, : self.kv_lora])
        k_pe = self.apply_rotary(kv[:, self.kv_lora :], cos, sin)
        return q_nope, q_pe, torch.cat((c_kv, k_pe), dim=-1)

    def kv_b_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_kc [H, nope, kv_lora] and W_vc [H, v, kv_lora], views of kv_b_proj."""
        kv_b = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.kv_lora)
        return kv_b[:, : self.nope], kv_b[:, self.nope :]


class AbsorbedMLA(MultiLatentAttention):
    def forward(self, x, cos, sin, tree_mask, cache, cache_length):
        q_nope, q_pe, new_kv = self.project(x, cos, sin)
        w_kc, w_vc = self.kv_b_weights()
        q_latent = torch.einsum("thn,hnc->thc", q_nope, w_kc)  # [T, H, kv_lora]
        query = torch.cat((q_latent, q_pe), dim=-1)  # [T, H, latent_dim]
        latent = self.tree_attention(query, cache, cache_length, new_kv, tree_mask, self.scale, self.kv_lora)
        out = torch.einsum("thc,hvc->thv", latent, w_vc)  # [T, H, v_head_dim]
        return self.o_proj(out.reshape(x.shape[0], -1)), new_kv


class InPlaceAbsorbedMLA(AbsorbedMLA):
    @staticmethod
    def supports(config: TargetConfig) -> bool:
        """The fused rotary kernel needs a power-of-two rope width."""
        rope = config.qk_rope_head_dim
        return rope & (rope - 1) == 0

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """The rope rows de-interleaved, then (fused projections) q_a_proj and kv_a_proj_with_mqa stacked into one
        [q_lora + latent_dim, hidden] weight: one GEMM reads x for both (SGLang's fused_qkv_a_proj_with_mqa)."""
        super().prepare_weights()
        self.register_buffer("q_kv_a", None, persistent=False)
        if self.fused:
            self.q_kv_a = fuse_linears(self.q_a_proj, self.kv_a_proj_with_mqa)

    def forward(self, x, cos, sin, tree_mask, cache, cache_length):
        """`AbsorbedMLA.forward` for the GPU (Triton kernels): every result is written where the next op reads it: the
        normalized and rotated latent rows into one [T, latent_dim] buffer, q_nope @ W_kc and the rotated q_pe into
        the two column ranges of the query, the W_vc product straight into the [T, H, v] layout o_proj reads. At
        T > 1 that saves the three copies (two concatenations, one transpose) the plain expressions launch. Up to
        64 rows each absorbed product is one Triton launch for every head (`head_matmul`), else a batched GEMM."""
        from models.triton_ops import HEAD_MATMUL_MAX_ROWS, head_matmul, rms_norm, rotary

        tokens, lora = x.shape[0], self.kv_lora
        if getattr(self, "q_kv_a", None) is not None:  # q_a and kv_a in one GEMM, each read as its column range
            q_kv = F.linear(x, self.q_kv_a)
            q_a, kv = q_kv[:, : self.q_a_proj.weight.shape[0]], q_kv[:, self.q_a_proj.weight.shape[0] :]
        else:
            q_a, kv = self.q_a_proj(x), self.kv_a_proj_with_mqa(x)
        new_kv = torch.empty(tokens, lora + self.rope, dtype=x.dtype, device=x.device)
        overlap = self.overlap and x.is_cuda  # the latent row on the side stream (`models/streams.py`)
        with beside(x.device) if overlap else nullcontext():
            rms_norm(kv[:, :lora], self.kv_a_layernorm.weight, self.kv_a_layernorm.eps, out=new_kv[:, :lora])
            rotary(kv[:, lora:], cos, sin, out=new_kv[:, lora:])
        q = self.q_b_proj(self.q_a_layernorm(q_a)).view(tokens, self.heads, self.nope + self.rope)
        w_kc, w_vc = self.kv_b_weights()
        query = torch.empty(tokens, self.heads, lora + self.rope, dtype=x.dtype, device=x.device)
        few = tokens <= HEAD_MATMUL_MAX_ROWS  # decode and verify rows: every head's product in one launch
        if few:
            head_matmul(q[..., : self.nope], w_kc, query[..., :lora])
        else:
            torch.bmm(q[..., : self.nope].transpose(0, 1), w_kc, out=query[..., :lora].transpose(0, 1))
        rotary(q[..., self.nope :], cos, sin, out=query[..., lora:])
        if overlap:
            join(x.device)
        latent = self.tree_attention(query, cache, cache_length, new_kv, tree_mask, self.scale, lora)
        out = torch.empty(tokens, self.heads, self.v_dim, dtype=x.dtype, device=x.device)
        if few:
            head_matmul(latent, w_vc.transpose(1, 2), out)
        else:
            torch.bmm(latent.transpose(0, 1), w_vc.transpose(1, 2), out=out.transpose(0, 1))
        return self.o_proj(out.view(tokens, -1)), new_kv


class ExpandedMLA(MultiLatentAttention):
    def forward(self, x, cos, sin, tree_mask, cache, cache_length):
        q_nope, q_pe, new_kv = self.project(x, cos, sin)
        tokens, length = x.shape[0], int(cache_length.reshape(-1)[0])
        latent = torch.cat((cache[:length], new_kv), dim=0)  # [S' + T, latent_dim]
        c_kv, k_pe = latent[:, : self.kv_lora], latent[:, self.kv_lora :]
        w_kc, w_vc = self.kv_b_weights()
        k_nope = torch.einsum("sc,hnc->shn", c_kv, w_kc)  # [S'+T, H, nope]
        values = torch.einsum("sc,hvc->shv", c_kv, w_vc)  # [S'+T, H, v]
        scores = torch.einsum("thn,shn->hts", q_nope, k_nope) + torch.einsum("thr,sr->hts", q_pe, k_pe)
        visible = torch.cat((torch.ones(tokens, length, dtype=torch.bool, device=x.device), tree_mask), dim=1)
        scores = (scores * self.scale).masked_fill(~visible, float("-inf"))
        probs = torch.softmax(scores.to(torch.float32), dim=-1).to(x.dtype)
        out = torch.einsum("hts,shv->thv", probs, values)
        return self.o_proj(out.reshape(tokens, -1)), new_kv
