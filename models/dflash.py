"""The DFlash drafter, one tensor-parallel rank (z-lab `DFlashDraftModel` semantics).

    forward(context_hidden [C, taps * hidden], context_positions [C], context_length [1],
            block_ids [B], block_positions [B], draft_cache [layers, 2, S, kv_heads, head_dim], draft_cache_length [1])
      -> draft_logits [B - 1, vocab] fp32 (gathered): block rows 1..B-1 predict the tokens at start + 1 .. start + B - 1
         new_context_kv [layers, 2, C, kv_heads, head_dim]: K/V of the context rows, for the runner to commit

Context features are `hidden_norm(fc(taps))` of tokens the target has committed; rows >= context_length are
padding. Every layer projects them with its own k/v (k_norm, rope at their absolute positions) and attends,
non-causally, from the block to [cached context | new context | block]. The draft cache keeps context K/V only.
The drafter borrows the target's vocab-parallel embedding and lm_head.

Several requests in one forward (batched steps, `runner/device/batch.py`): draft_cache each request's cache
stacked [n, layers, 2, S, kv_heads, head_dim] (the batch's slots), context_length and draft_cache_length [n],
request r's rows the r-th equal share of the context rows and of the block rows; draft_logits then
[n * (B - 1), vocab], request by request.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models.config import DrafterConfig, TargetConfig
from models.layers import VocabParallelEmbedding, VocabParallelHead, fuse_linears, linear
from models.rope import Rotary


class DraftAttention(nn.Module):
    """The torch form (CPUs, ONNX export): the block's queries over the concatenation [whole draft cache | new rows]
    under a key bias that hides the cache rows past the length. `KernelDraftAttention` is the GPU form.

    fused (GPUs): q, k and v run as one GEMM over one stacked weight (SGLang's qkv_proj), stacked by
    `prepare_weights`; the CPU and the ONNX export keep one linear per weight."""

    def __init__(self, config: DrafterConfig, ops):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = config.heads_per_rank, config.kv_heads_per_rank, config.head_dim
        self.scale = config.head_dim**-0.5
        self.q_proj = linear(config.hidden_size, self.heads * self.head_dim)
        self.k_proj = linear(config.hidden_size, self.kv_heads * self.head_dim)
        self.v_proj = linear(config.hidden_size, self.kv_heads * self.head_dim)
        self.o_proj = linear(self.heads * self.head_dim, config.hidden_size)
        self.q_norm = ops.norm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ops.norm(self.head_dim, config.rms_norm_eps)
        self.apply_rotary, self.fused = ops.rotary, ops.fused_projections
        self.register_buffer("qkv", None, persistent=False)
        self.project = self._project_fused if self.fused else self._project
        self.project_kv = self._project_kv_fused if self.fused else self._project_kv

    def prepare_weights(self) -> None:
        if self.fused:
            self.qkv = fuse_linears(self.q_proj, self.k_proj, self.v_proj)

    def _project(self, h, rows):
        """q of the block rows h [B, hidden]; k, v of the context-then-block rows [C + B, hidden]."""
        return self.q_proj(h), self.k_proj(rows), self.v_proj(rows)

    def _project_fused(self, h, rows):
        """One GEMM over the C + B rows; the context rows' q are dropped."""
        dim = self.head_dim
        q, k, v = F.linear(rows, self.qkv).split([self.heads * dim, self.kv_heads * dim, self.kv_heads * dim], -1)
        return q[rows.shape[0] - h.shape[0] :], k, v

    def _project_kv(self, x):
        return self.k_proj(x), self.v_proj(x)

    def _project_kv_fused(self, x):
        width = self.kv_heads * self.head_dim
        return F.linear(x, self.qkv[-2 * width :]).split(width, dim=-1)

    def keys_values(self, x, cos, sin):
        """x [R, hidden] -> k (k_norm, rope), v [R, kv_heads, head_dim]."""
        rows = x.shape[0]
        k, v = self.project_kv(x)
        k = self.apply_rotary(self.k_norm(k.view(rows, self.kv_heads, self.head_dim)), cos, sin)
        return k, v.view(rows, self.kv_heads, self.head_dim)

    def forward(self, h, ctx, block_rope, rows_rope, cache, key_bias, lengths):
        """h [B, hidden] block rows, ctx [C, hidden] context features, block_rope / rows_rope the (cos, sin) of the
        block rows / of the C + B context-then-block rows, cache [2, S, kv_heads, head_dim], lengths (valid cached
        rows [1], valid context rows [1]) and key_bias (`key_bias`; None for the kernel form). Several requests
        (batched steps): cache each one's [2, S, ...] stacked [n, 2, S, ...], lengths [n] each, key_bias a list,
        request r's rows the r-th equal share of the context rows and of the block rows (`attend_requests`)."""
        blocks, context, dim = h.shape[0], ctx.shape[0], self.head_dim
        q, k, v = self.project(h, torch.cat((ctx, h)))
        q = self.apply_rotary(self.q_norm(q.view(blocks, self.heads, dim)), *block_rope)
        k_new = self.apply_rotary(self.k_norm(k.view(context + blocks, self.kv_heads, dim)), *rows_rope)
        v_new = v.view(context + blocks, self.kv_heads, dim)  # [C + B, kv_heads, head_dim]
        if cache.dim() == 4:
            attended = self.attend_rows(q, cache, k_new, v_new, key_bias, lengths)
        else:
            attended = self.attend_requests(q, cache, k_new, v_new, key_bias, lengths, context)
        return self.o_proj(attended), torch.stack((k_new[:context], v_new[:context]))

    def attend_requests(self, q, caches, k_new, v_new, key_biases, lengths, context):
        """`attend_rows` per request: request r's block queries over its own cache, context rows and block rows."""
        count = len(caches)
        share, blocks = context // count, q.shape[0] // count
        out = []
        for r, cache in enumerate(caches):
            own = (slice(r * share, (r + 1) * share), slice(context + r * blocks, context + (r + 1) * blocks))
            keys, values = (torch.cat([t[rows] for rows in own]) for t in (k_new, v_new))
            own_lengths = (lengths[0][r : r + 1], lengths[1][r : r + 1])
            queries = q[r * blocks : (r + 1) * blocks]
            out.append(self.attend_rows(queries, cache, keys, values, key_biases[r], own_lengths))
        return torch.cat(out)

    @staticmethod
    def key_bias(capacity, context, blocks, cache_length, context_length, dtype):
        """[capacity + context + blocks]: 0 for the keys every layer attends to (valid cached rows, valid context
        rows, the block), -inf elsewhere; built once a forward."""
        device = cache_length.device
        visible = torch.cat(
            (
                torch.arange(capacity, device=device) < cache_length[0],
                torch.arange(context, device=device) < context_length[0],
                torch.ones(blocks, dtype=torch.bool, device=device),
            )
        )
        return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill(~visible, float("-inf"))

    def attend_rows(self, q, cache, k_new, v_new, key_bias, lengths):
        """q [B, heads, head_dim] over [cached rows | new rows] -> [B, heads * head_dim]: the concatenation under
        key_bias (`attend`)."""
        keys = torch.cat((cache[0], k_new), dim=0)  # [S + C + B, kv_heads, head_dim]
        values = torch.cat((cache[1], v_new), dim=0)
        return self.attend(q, keys, values, key_bias)

    def attend(self, q, keys, values, key_bias):
        """q [B, heads, head_dim] over keys / values [S', kv_heads, head_dim], key_bias [S'] -> [B, heads * head_dim]
        (the einsum chain)."""
        blocks, groups, kv, dim = q.shape[0], self.heads // self.kv_heads, self.kv_heads, self.head_dim
        q = q.view(blocks, kv, groups, dim)
        scores = torch.einsum("bkgd,skd->kgbs", q, keys) * self.scale + key_bias
        probs = torch.softmax(scores.to(torch.float32), dim=-1).to(q.dtype)
        return torch.einsum("kgbs,skd->bkgd", probs, values).reshape(blocks, -1)

    def fold_heads(self, q):
        """q [B, heads, head_dim] -> [kv_heads, groups * B, head_dim]: the query heads of each K/V head as rows."""
        blocks, groups = q.shape[0], self.heads // self.kv_heads
        q = q.view(blocks, self.kv_heads, groups, self.head_dim).permute(1, 2, 0, 3)
        return q.reshape(self.kv_heads, groups * blocks, self.head_dim)

    def unfold_heads(self, out, blocks: int):
        """`fold_heads`'s layout [kv_heads, groups * B, head_dim] -> [B, heads * head_dim]."""
        groups = self.heads // self.kv_heads
        out = out.reshape(self.kv_heads, groups, blocks, self.head_dim)
        return out.permute(2, 0, 1, 3).reshape(blocks, -1)


class KernelDraftAttention(DraftAttention):
    """The GPU form: the Triton kernel (`models/draft_attention_kernel.py`) reads only the valid cached rows and the
    new rows, without the concatenation or a key bias (measured against the torch forms in
    `benchmarks/profile_forward.py --draft-attention`)."""

    kernel_config: dict = {}  # the kernel's tiles (default: its own; tests under the interpreter take small ones)

    @staticmethod
    def key_bias(capacity, context, blocks, cache_length, context_length, dtype):
        return None

    def attend_rows(self, q, cache, k_new, v_new, key_bias, lengths):
        from models.draft_attention_kernel import draft_attention_cuda

        context = k_new.shape[0] - q.shape[0]
        out = draft_attention_cuda(self.fold_heads(q), cache, lengths[0], k_new, v_new, context, lengths[1],
                                   self.scale, **self.kernel_config)  # fmt: skip
        return self.unfold_heads(out, q.shape[0])

    def attend_requests(self, q, caches, k_new, v_new, key_biases, lengths, context):
        """Every request in one launch: each request's block rows folded, the kernel's batched form."""
        from models.draft_attention_kernel import draft_attention_cuda

        count, kv, groups, dim = caches.shape[0], self.kv_heads, self.heads // self.kv_heads, self.head_dim
        blocks = q.shape[0] // count
        folded = q.view(count, blocks, kv, groups, dim).permute(0, 2, 3, 1, 4).reshape(count, kv, groups * blocks, dim)
        out = draft_attention_cuda(folded, caches, lengths[0], k_new, v_new, context, lengths[1], self.scale,
                                   **self.kernel_config)  # fmt: skip
        return out.view(count, kv, groups, blocks, dim).permute(0, 3, 1, 2, 4).reshape(count * blocks, -1)


class DraftLayer(nn.Module):
    def __init__(self, config: DrafterConfig, ops):
        super().__init__()
        self.input_layernorm = ops.norm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = ops.draft_attention(config, ops)
        self.post_attention_layernorm = ops.norm(config.hidden_size, config.rms_norm_eps)
        width = config.intermediate_size // config.mapping.tp_size
        self.mlp = ops.gated_mlp(config.hidden_size, width, ops.fused_projections)
        self.collectives = ops.collectives

    def forward(self, x, ctx, block_rope, rows_rope, cache, key_bias, lengths):
        attn, new_kv = self.self_attn(self.input_layernorm(x), ctx, block_rope, rows_rope, cache, key_bias, lengths)
        x = x + self.collectives.all_reduce(attn)
        x = x + self.collectives.all_reduce(self.mlp(self.post_attention_layernorm(x)))
        return x, new_kv


class DFlashDrafter(nn.Module):
    def __init__(self, config: DrafterConfig, target: TargetConfig, ops):
        """ops: `models.ops.ModelOps` (collectives, norm, rotary, attention form, fused projections)."""
        super().__init__()
        hidden, collectives = config.hidden_size, ops.collectives
        self.embed_tokens = VocabParallelEmbedding(target.vocab_size, hidden, config.mapping, collectives)
        self.lm_head = VocabParallelHead(target.vocab_size, hidden, config.mapping, collectives)
        self.fc = linear(config.num_taps * hidden, hidden)
        self.hidden_norm = ops.norm(hidden, config.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(config, ops) for _ in range(config.num_hidden_layers))
        self.norm = ops.norm(hidden, config.rms_norm_eps)
        self.rotary = Rotary(config.rope, config.head_dim)
        self.key_bias = ops.draft_attention.key_bias  # the attention form's key bias (None for the kernel)

    def context_kv(self, context_hidden, context_positions):
        """K/V of context rows alone, every layer [layers, 2, C, kv_heads, head_dim]: the rows `forward` returns as
        `new_context_kv` (a layer's context K/V depend on the context features only, not on the block); the device
        loop commits a prompt's context with it (SGLang's `_append_target_hidden_to_draft_kv`: fc, hidden_norm, k/v,
        k_norm, rope)."""
        ctx = self.hidden_norm(self.fc(context_hidden))
        rope = self.rotary(context_positions, ctx.dtype)
        return torch.stack([torch.stack(layer.self_attn.keys_values(ctx, *rope)) for layer in self.layers])

    def forward(
        self,
        context_hidden,
        context_positions,
        context_length,
        block_ids,
        block_positions,
        draft_cache,
        draft_cache_length,
    ):
        ctx = self.hidden_norm(self.fc(context_hidden))
        x = self.embed_tokens(block_ids)
        blocks = x.shape[0]
        rows_rope = self.rotary(torch.cat((context_positions, block_positions)), x.dtype)  # context, then block rows
        block_rope = tuple(table[-blocks:] for table in rows_rope)
        if draft_cache.dim() == 5:
            lengths = (draft_cache_length.reshape(1), context_length.reshape(1))
            key_bias = self.key_bias(draft_cache.shape[2], ctx.shape[0], blocks, *lengths, x.dtype)
            caches = lambda i: draft_cache[i]  # noqa: E731
        else:  # several requests (batched steps): a cache, lengths and key bias each; equal shares of the rows
            count = len(draft_cache)
            lengths = (draft_cache_length.reshape(count), context_length.reshape(count))
            key_bias = [self.key_bias(c.shape[2], ctx.shape[0] // count, blocks // count, lengths[0][r : r + 1],
                                      lengths[1][r : r + 1], x.dtype) for r, c in enumerate(draft_cache)]  # fmt: skip
            caches = lambda i: draft_cache[:, i]  # noqa: E731
        new_kv = []
        for i, layer in enumerate(self.layers):
            x, kv = layer(x, ctx, block_rope, rows_rope, caches(i), key_bias, lengths)
            new_kv.append(kv)
        x = self.norm(x)
        if draft_cache.dim() == 5:
            return self.lm_head(x[1:]), torch.stack(new_kv)
        count = len(draft_cache)  # each request's block rows but its first
        return self.lm_head(x.view(count, blocks // count, -1)[:, 1:].reshape(-1, x.shape[-1])), torch.stack(new_kv)
