"""GPU attention of the DFlash drafter (Triton): the block's queries over [cached context | new context | block]
without building that concatenation, and reading only the cache rows that exist.

The torch form (`DraftAttention.attend`) concatenates the whole draft cache with the new rows and masks the rows past
the length, so a step costs the cache's *capacity* (max_seq_len), not the sequence: measured 0.93 ms a drafter
forward at capacity 1024 and 2.07 ms at 131072 for the same 248 cached rows (BENCHMARKS.md, section 3). Here the
TreeAttention kernel's machinery (`plugins/tree_attention/kernel.py`) runs it: per KV head, its query heads' rows
(the heads sharing a K/V head, times the block's rows) take slices of the cached rows cut from the *device* length
(no host sync; safe under CUDA-graph capture), one more program takes the new rows (valid context rows and the
block, visible to every query), and the combine kernel merges the slices that ran. K and V are separate rows here
(`SEPARATE_V`), where MLA's values are the keys' first columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plugins.tree_attention.kernel import (
    LOG2E,
    _attend_block,
    _sm_count,
    _split_chunk,
    combine_splits,
    default_min_blocks,
    dot_precision,
    num_splits_for,
    split_partials,
)


@triton.jit
def _draft_attention_split(
    q_ptr,
    k_cache,
    v_cache,
    length_ptr,
    k_new,
    v_new,
    count_ptr,
    part_out,
    part_m,
    part_l,
    rows_total,
    qk_scale,
    cache_stride,
    cache_batch_stride,
    new_k_stride,
    new_v_stride,
    num_splits,
    context_rows,
    new_rows,
    KV,
    ROWS: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    PRECISION: tl.constexpr,
):
    # program (row tile, split, request x KV head): splits 0 .. num_splits - 1 take slices of the cached rows, split
    # num_splits the new_rows new rows (context_rows context rows, of which the first `count` are valid, then the
    # block); the row counts are run-time values, so a prompt of a new length does not compile another kernel.
    # Request r (several requests' blocks in one launch) has its own cache and lengths, its context rows the r-th
    # share of the new rows' context part and its block the r-th share of their block part.
    tile, split, program = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    r, head = program // KV, program % KV
    requests = tl.num_programs(2) // KV
    q_ptr += r * (KV * ROWS * D)
    k_cache += r.to(tl.int64) * cache_batch_stride
    v_cache += r.to(tl.int64) * cache_batch_stride
    length = tl.sum(tl.load(length_ptr + r + tl.arange(0, 1)), axis=0).to(tl.int32)
    count = tl.sum(tl.load(count_ptr + r + tl.arange(0, 1)), axis=0).to(tl.int32)
    chunk = _split_chunk(length, num_splits, BLOCK_N, MIN_BLOCKS)
    is_new = split == num_splits
    start = split * chunk
    active = is_new | (start < length)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # this KV head's query rows (`fold_heads` order)
    row_ok = rows < ROWS
    offs_d = tl.arange(0, BLOCK_D)
    q = tl.load(
        q_ptr + (head * ROWS + rows)[:, None] * D + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d[None, :] < D) & active,
        other=0.0,
    )
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    stop = tl.where(is_new, start, tl.minimum(start + chunk, length))
    for block in range(start, stop, BLOCK_N):  # cached rows [start, stop), visible to every query
        keys = block + offs_n
        key_ok = keys < stop
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q,
            q,
            k_cache + head * D,
            cache_stride,
            keys,
            key_ok,
            row_ok[:, None] & key_ok[None, :],
            offs_d,
            offs_d,
            D,
            0,
            qk_scale,
            PRECISION,
            v_cache + head * D,
            cache_stride,
            True,
        )
    if is_new:  # the new rows: valid context rows and the whole block
        for block in range(0, new_rows, BLOCK_N):
            keys = block + offs_n
            key_ok = (keys < new_rows) & ((keys >= context_rows) | (keys < count))
            # the request's own rows: its context share, then its block share (after every request's context)
            own = tl.where(keys < context_rows, r * context_rows + keys,
                           requests * context_rows + r * (new_rows - context_rows) + keys - context_rows)  # fmt: skip
            acc, m_i, l_i = _attend_block(
                acc,
                m_i,
                l_i,
                q,
                q,
                k_new + head * D,
                new_k_stride,
                own,
                key_ok,
                row_ok[:, None] & key_ok[None, :],
                offs_d,
                offs_d,
                D,
                0,
                qk_scale,
                PRECISION,
                v_new + head * D,
                new_v_stride,
                True,
            )
    base = split * rows_total + program * ROWS + rows
    written = row_ok & active
    tl.store(part_m + base, m_i, mask=written)
    tl.store(part_l + base, l_i, mask=written)
    tl.store(part_out + base[:, None] * D + offs_d[None, :], acc, mask=written[:, None] & (offs_d[None, :] < D))


def draft_attention_cuda(q, cache, cache_length, k_new, v_new, context_rows: int, context_length, scale: float,
                         **config):  # fmt: skip
    """q [KV, G * B, D] (`DraftAttention.fold_heads`: the G query heads of each KV head times the B block rows), cache
    [2, S, KV, D] (rows < cache_length [1] valid; the length on the device), k_new / v_new [C + B, KV, D] (the
    `context_rows` C context rows, the first context_length [1] of them valid, then the block; rows may be strided)
    -> [KV, G * B, D] in q's dtype: softmax(q k^T * scale) v over the valid cached rows, the valid context rows and
    the block. `config`: block_m, block_n, min_blocks, num_warps, num_stages (tests).

    Several requests in one launch (batched steps): q [R, KV, G * B, D] (each request folded), cache [R, 2, S, KV, D]
    (any stride between requests), cache_length and context_length [R], k_new / v_new [R * C + R * B, KV, D] (every
    request's C context rows, then every request's B block rows) -> [R, KV, G * B, D]. Each request is cut into the
    splits a launch of its own would use."""
    batched = q.dim() == 4
    requests = q.shape[0] if batched else 1
    kv, rows, dim = q.shape[-3:]
    capacity, new = cache.shape[-3], k_new.shape[0] // requests
    context_rows //= requests
    if cache.shape[-2:] != (kv, dim) or k_new.shape[1:] != (kv, dim) or v_new.shape != k_new.shape:
        shapes = f"q {tuple(q.shape)}, cache {tuple(cache.shape)}, k_new {tuple(k_new.shape)}, v {tuple(v_new.shape)}"
        raise ValueError(f"draft attention: {shapes} disagree on KV heads / head dim")
    if not 0 <= context_rows <= new:
        raise ValueError(f"draft attention: context_rows must be in [0, {new}] (the new rows), got {context_rows}")
    strides = [(t.stride(-2) if kv > 1 else dim, t.stride(-1)) for t in (cache, k_new, v_new)]
    if strides != [(dim, 1)] * 3:
        raise ValueError(f"draft attention: each K/V row's heads must be contiguous, got strides {strides}")
    block_d = max(16, triton.next_power_of_2(dim))
    block_m = config.get("block_m", 64 if rows > 32 else max(16, triton.next_power_of_2(rows)))
    block_n = config.get("block_n", 64)
    min_blocks = config.get("min_blocks", default_min_blocks(rows, capacity))
    tiles = triton.cdiv(rows, block_m)
    splits = num_splits_for(rows * kv, capacity, block_m, block_n, _sm_count(q.device), min_blocks)
    total = kv * rows
    part_out, part_m, part_l = parts = split_partials(splits, requests * total, dim, q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    keys, values = (cache[:, 0], cache[:, 1]) if batched else (cache[0], cache[1])
    _draft_attention_split[(tiles, splits + 1, requests * kv)](
        q.contiguous(),
        keys,
        values,
        cache_length,
        k_new,
        v_new,
        context_length,
        part_out,
        part_m,
        part_l,
        requests * total,
        scale * LOG2E,
        cache.stride(-3),
        cache.stride(0) if batched else 0,
        k_new.stride(0),
        v_new.stride(0),
        splits,
        context_rows,
        new,
        kv,
        ROWS=rows,
        D=dim,
        BLOCK_D=block_d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        MIN_BLOCKS=min_blocks,
        PRECISION=dot_precision(q.dtype),
        num_warps=config.get("num_warps", 4),
        num_stages=config.get("num_stages", 2),
    )
    combine_splits(parts, cache_length, out, requests * total, splits, dim, block_d, block_n, min_blocks,
                   rows_per_request=total)  # fmt: skip
    return out
