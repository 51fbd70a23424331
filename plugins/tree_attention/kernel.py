"""GPU TreeAttention (Triton): absorbed-MLA attention of T tree tokens x H heads over the committed latent cache and
the tree's own new rows, split over the cache length so the GPU is full even at T = 33, H = 8.

All T*H query rows share one key/value stream (MQA): keys are the 576-wide latent rows [c_kv | k_pe], values their
first 512 columns, so each key block is loaded once and used for both products. Program (row tile, split) runs an
online softmax over its slice of the cache; one more split per tile visits the T new rows under the tree mask. The
slices are cut from the *device* cache length (the launch needs no host sync and is safe under CUDA-graph capture;
the grid is sized from the capacity): a short cache fills only the first splits, the others exit at once, and the
second kernel merges only the (max, sum, output) triples of the splits that ran. fp32 accumulation throughout; a
row that sees no key outputs zeros.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@triton.jit
def _softmax_step(m_i, l_i, scores, HIDDEN: tl.constexpr):
    """The online softmax's update for one key block's scaled scores [BLOCK_M, BLOCK_N]: the new running max, the
    factor of the terms so far, the block's weights and the new running sum. HIDDEN: scores may be -inf (a row that
    sees no key yet keeps a -inf max, and no NaN comes of it)."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    if HIDDEN:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[:, None])
    return m_new, alpha, p, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _columns(rows_ptr, offs, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """Columns [0, D) of a block of rows (`rows_ptr` [BLOCK_N, 1]), padded with zeros to BLOCK_D; no mask where
    D == BLOCK_D."""
    if D == BLOCK_D:
        values = tl.load(rows_ptr + offs[None, :])
    else:
        values = tl.load(rows_ptr + offs[None, :], mask=offs[None, :] < D, other=0.0)
    return values


@triton.jit
def _attend_block(
    acc,
    m_i,
    l_i,
    q_lat,
    q_rope,
    k_ptr,
    k_stride,
    rows_k,
    key_ok,
    visible,
    offs_dl,
    offs_dr,
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    qk_scale,
    PRECISION: tl.constexpr,
    v_ptr,
    v_stride,
    SEPARATE_V: tl.constexpr,
):
    """One key block into the online softmax. Keys are rows [lat | rope] at k_ptr; values are the keys' first D_LAT
    columns (MLA's latent rows), or with SEPARATE_V rows of D_LAT at v_ptr (the drafter's GQA cache)."""
    k_lat = tl.load(
        k_ptr + rows_k[:, None] * k_stride + offs_dl[None, :],
        mask=key_ok[:, None] & (offs_dl[None, :] < D_LAT),
        other=0.0,
    )
    scores = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if D_ROPE > 0:
        k_rope = tl.load(
            k_ptr + rows_k[:, None] * k_stride + D_LAT + offs_dr[None, :],
            mask=key_ok[:, None] & (offs_dr[None, :] < D_ROPE),
            other=0.0,
        )
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
    scores = tl.where(visible, scores * qk_scale, float("-inf"))
    m_new, alpha, p, l_i = _softmax_step(m_i, l_i, scores, True)
    if SEPARATE_V:
        values = tl.load(
            v_ptr + rows_k[:, None] * v_stride + offs_dl[None, :],
            mask=key_ok[:, None] & (offs_dl[None, :] < D_LAT),
            other=0.0,
        )
    else:
        values = k_lat
    acc = acc * alpha[:, None] + tl.dot(p.to(values.dtype), values, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _attend_whole_block(
    acc,
    m_i,
    l_i,
    q_lat,
    q_rope,
    k_ptr,
    k_stride,
    lat_desc,
    rope_desc,
    b,
    block,
    offs_n,
    offs_dl,
    offs_dr,
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_DL: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    qk_scale,
    PRECISION: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """A key block whose BLOCK_N rows all lie below the split's end (every one visible to every query): no key mask,
    no -inf handling (every score is finite). Its rows come by the tensor-memory accelerator (`lat_desc`, `rope_desc`:
    [requests, rows, columns] descriptors of the cache's latent and rope columns) or by pointer loads."""
    rows_k = k_ptr + (block + offs_n)[:, None] * k_stride
    if USE_TMA:
        k_lat = lat_desc.load([b, block, 0]).reshape(BLOCK_N, BLOCK_DL)
    else:
        k_lat = _columns(rows_k, offs_dl, D_LAT, BLOCK_DL)
    scores = tl.dot(q_lat, tl.trans(k_lat), input_precision=PRECISION)  # [BLOCK_M, BLOCK_N] fp32
    if D_ROPE > 0:
        if USE_TMA:
            k_rope = rope_desc.load([b, block, 0]).reshape(BLOCK_N, BLOCK_DR)
        else:
            k_rope = _columns(rows_k + D_LAT, offs_dr, D_ROPE, BLOCK_DR)
        scores += tl.dot(q_rope, tl.trans(k_rope), input_precision=PRECISION)
    # every score finite: alpha is 0 at the first block (m_i = -inf)
    m_new, alpha, p, l_i = _softmax_step(m_i, l_i, scores * qk_scale, False)
    acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _split_chunk(length, num_splits, BLOCK_N: tl.constexpr, MIN_BLOCKS: tl.constexpr):
    """Cache rows per split: the device length cut into num_splits slices of whole key blocks, at least MIN_BLOCKS
    blocks each, so a short cache uses only its first few splits (the rest do nothing and are never read)."""
    return tl.maximum(tl.cdiv(tl.cdiv(length, BLOCK_N), num_splits), MIN_BLOCKS) * BLOCK_N


@triton.jit
def _tree_attention_split(
    q_ptr,
    cache_ptr,
    length_ptr,
    new_ptr,
    mask_ptr,
    part_out,
    part_m,
    part_l,
    lat_desc,
    rope_desc,
    T,
    H,
    qk_scale,
    cache_stride,
    cache_batch_stride,
    new_stride,
    num_splits,
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_DL: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    PRECISION: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # program (tile, split, request): splits 0 .. num_splits - 1 take slices of the committed cache, split
    # num_splits the tree's own T rows under the tree mask, so no program does both and the tree never waits behind
    # a cache slice. Request b (several requests' trees in one launch) has its own cache, length, rows and mask.
    tile, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    requests = tl.num_programs(2)
    q_ptr += b * (T * H * (D_LAT + D_ROPE))
    cache_ptr += b.to(tl.int64) * cache_batch_stride
    new_ptr += b * T * new_stride
    mask_ptr += b * T * T
    length = tl.sum(tl.load(length_ptr + b + tl.arange(0, 1)), axis=0).to(tl.int32)  # a 0-d scalar
    chunk = _split_chunk(length, num_splits, BLOCK_N, MIN_BLOCKS)
    is_tree = split == num_splits
    start = split * chunk
    active = is_tree | (start < length)  # splits past the length do nothing (their loop below is empty)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (token, head) query rows
    row_ok = rows < T * H
    token = rows // H
    offs_dl, offs_dr = tl.arange(0, BLOCK_DL), tl.arange(0, BLOCK_DR)
    q_row = q_ptr + rows[:, None] * (D_LAT + D_ROPE)
    q_lat = tl.load(q_row + offs_dl[None, :], mask=row_ok[:, None] & (offs_dl[None, :] < D_LAT) & active, other=0.0)
    q_rope = tl.load(
        q_row + D_LAT + offs_dr[None, :], mask=row_ok[:, None] & (offs_dr[None, :] < D_ROPE) & active, other=0.0
    )
    acc = tl.zeros((BLOCK_M, BLOCK_DL), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    # committed cache rows [start, stop), visible to every query (the tree's split has none)
    stop = tl.where(is_tree, start, tl.minimum(start + chunk, length))
    if WHOLE_BLOCKS:  # the split's whole key blocks without masks, then its last, partial block (if any) below
        whole = start + tl.maximum(stop - start, 0) // BLOCK_N * BLOCK_N
        for block in range(start, whole, BLOCK_N):
            acc, m_i, l_i = _attend_whole_block(
                acc,
                m_i,
                l_i,
                q_lat,
                q_rope,
                cache_ptr,
                cache_stride,
                lat_desc,
                rope_desc,
                b,
                block,
                offs_n,
                offs_dl,
                offs_dr,
                D_LAT,
                D_ROPE,
                BLOCK_N,
                BLOCK_DL,
                BLOCK_DR,
                qk_scale,
                PRECISION,
                USE_TMA,
            )
    else:
        whole = start
    for block in range(whole, stop, BLOCK_N):
        keys = block + offs_n
        key_ok = keys < stop
        acc, m_i, l_i = _attend_block(
            acc,
            m_i,
            l_i,
            q_lat,
            q_rope,
            cache_ptr,
            cache_stride,
            keys,
            key_ok,
            row_ok[:, None] & key_ok[None, :],
            offs_dl,
            offs_dr,
            D_LAT,
            D_ROPE,
            qk_scale,
            PRECISION,
            cache_ptr,
            cache_stride,
            False,
        )
    if is_tree:  # the tree's own rows, under the tree mask
        # parents come before their children (causal for a prefill), so row i sees no new row past i: the key
        # blocks past the tile's last token are never visited (a causal prefill's upper triangle, half of its T x T
        # work). A loop bound, not a branch on the mask's contents: a branch measured 24-32 % slower at T = 33.
        last = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // H + 1, T)
        for block in range(0, last, BLOCK_N):
            keys = block + offs_n
            key_ok = keys < T
            allowed = tl.load(
                mask_ptr + token[:, None] * T + keys[None, :], mask=row_ok[:, None] & key_ok[None, :], other=0
            ).to(tl.int1)
            acc, m_i, l_i = _attend_block(
                acc,
                m_i,
                l_i,
                q_lat,
                q_rope,
                new_ptr,
                new_stride,
                keys,
                key_ok,
                allowed,
                offs_dl,
                offs_dr,
                D_LAT,
                D_ROPE,
                qk_scale,
                PRECISION,
                new_ptr,
                new_stride,
                False,
            )
    base = (split * requests + b) * T * H + rows
    written = row_ok & active
    tl.store(part_m + base, m_i, mask=written)
    tl.store(part_l + base, l_i, mask=written)
    tl.store(
        part_out + base[:, None] * D_LAT + offs_dl[None, :], acc, mask=written[:, None] & (offs_dl[None, :] < D_LAT)
    )


@triton.jit
def _keys_major_step(acc, m_i, l_i, q_lat, q_rope, k_lat, k_rope, visible, qk_scale, D_ROPE: tl.constexpr,
                     PRECISION: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    """One key block into the online softmax with the keys as the products' M side (`keys_major`): scores
    [BLOCK_N, BLOCK_M] = keys x queries, acc [BLOCK_DL, BLOCK_M] += values^T x weights, so a 64-key block makes the
    M = 64 that Hopper's wgmma needs even with few query rows. k_lat [BLOCK_N, BLOCK_DL], k_rope [BLOCK_N, BLOCK_DR]:
    the block's keys (values: k_lat); q_lat [BLOCK_DL, BLOCK_M], q_rope [BLOCK_DR, BLOCK_M]: the queries transposed;
    visible [BLOCK_N, BLOCK_M]; m_i, l_i per query. MASKED False: every key valid and visible (no -inf handling)."""
    scores = tl.dot(k_lat, q_lat, input_precision=PRECISION)  # [BLOCK_N, BLOCK_M] fp32
    if D_ROPE > 0:
        scores += tl.dot(k_rope, q_rope, input_precision=PRECISION)
    if MASKED:
        scores = tl.where(visible, scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        scores = scores * qk_scale
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        m_ref = m_new
    alpha = tl.exp2(m_i - m_ref)
    p = tl.exp2(scores - m_ref[None, :])
    l_i = l_i * alpha + tl.sum(p, axis=0)
    acc = acc * alpha[None, :] + tl.dot(tl.trans(k_lat), p.to(k_lat.dtype), input_precision=PRECISION)
    return acc, m_new, l_i


@triton.jit
def _masked_keys(k_ptr, k_stride, keys, key_ok, offs_dl, offs_dr, D_LAT: tl.constexpr, D_ROPE: tl.constexpr):
    """A key block's latent and rope columns by masked loads: rows `keys` where `key_ok`, else zeros."""
    rows = k_ptr + keys[:, None] * k_stride
    k_lat = tl.load(rows + offs_dl[None, :], mask=key_ok[:, None] & (offs_dl[None, :] < D_LAT), other=0.0)
    k_rope = tl.load(rows + D_LAT + offs_dr[None, :], mask=key_ok[:, None] & (offs_dr[None, :] < D_ROPE), other=0.0)
    return k_lat, k_rope


@triton.jit
def _tree_attention_split_keys_major(
    q_ptr,
    cache_ptr,
    length_ptr,
    new_ptr,
    mask_ptr,
    part_out,
    part_m,
    part_l,
    lat_desc,
    rope_desc,
    T,
    H,
    qk_scale,
    cache_stride,
    cache_batch_stride,
    new_stride,
    num_splits,
    D_LAT: tl.constexpr,
    D_ROPE: tl.constexpr,
    BLOCK_DL: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    PRECISION: tl.constexpr,
    WHOLE_BLOCKS: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    # `_tree_attention_split`'s programs, splits and partial results, with every product keys-major
    # (`_keys_major_step`): the queries, the accumulator and the tree mask are held transposed. A split's whole key
    # blocks (WHOLE_BLOCKS) load without masks, by pointers or by the tensor-memory accelerator (USE_TMA: no address
    # registers; `lat_desc`, `rope_desc` as in the other form)
    tile, split, b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    requests = tl.num_programs(2)
    q_ptr += b * (T * H * (D_LAT + D_ROPE))
    cache_ptr += b.to(tl.int64) * cache_batch_stride
    new_ptr += b * T * new_stride
    mask_ptr += b * T * T
    length = tl.sum(tl.load(length_ptr + b + tl.arange(0, 1)), axis=0).to(tl.int32)
    chunk = _split_chunk(length, num_splits, BLOCK_N, MIN_BLOCKS)
    is_tree = split == num_splits
    start = split * chunk
    active = is_tree | (start < length)
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # flattened (token, head) query rows
    row_ok = rows < T * H
    token = rows // H
    offs_dl, offs_dr = tl.arange(0, BLOCK_DL), tl.arange(0, BLOCK_DR)
    q_col = q_ptr + rows[None, :] * (D_LAT + D_ROPE)
    q_lat = tl.load(q_col + offs_dl[:, None], mask=row_ok[None, :] & (offs_dl[:, None] < D_LAT) & active, other=0.0)
    q_rope = tl.load(
        q_col + D_LAT + offs_dr[:, None], mask=row_ok[None, :] & (offs_dr[:, None] < D_ROPE) & active, other=0.0
    )
    acc = tl.zeros((BLOCK_DL, BLOCK_M), dtype=tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    offs_n = tl.arange(0, BLOCK_N)
    stop = tl.where(is_tree, start, tl.minimum(start + chunk, length))
    if WHOLE_BLOCKS:
        whole = start + tl.maximum(stop - start, 0) // BLOCK_N * BLOCK_N
        for block in range(start, whole, BLOCK_N):
            if USE_TMA:
                k_lat = lat_desc.load([b, block, 0]).reshape(BLOCK_N, BLOCK_DL)
                k_rope = rope_desc.load([b, block, 0]).reshape(BLOCK_N, BLOCK_DR)
            else:
                k_rows = cache_ptr + (block + offs_n)[:, None] * cache_stride
                k_lat = _columns(k_rows, offs_dl, D_LAT, BLOCK_DL)
                k_rope = _columns(k_rows + D_LAT, offs_dr, D_ROPE, BLOCK_DR)
            acc, m_i, l_i = _keys_major_step(acc, m_i, l_i, q_lat, q_rope, k_lat, k_rope, None, qk_scale, D_ROPE,
                                             PRECISION, False)  # fmt: skip
    else:
        whole = start
    for block in range(whole, stop, BLOCK_N):
        keys = block + offs_n
        key_ok = keys < stop
        k_lat, k_rope = _masked_keys(cache_ptr, cache_stride, keys, key_ok, offs_dl, offs_dr, D_LAT, D_ROPE)
        visible = key_ok[:, None] & row_ok[None, :]
        acc, m_i, l_i = _keys_major_step(acc, m_i, l_i, q_lat, q_rope, k_lat, k_rope, visible, qk_scale, D_ROPE,
                                         PRECISION, True)  # fmt: skip
    if is_tree:  # the tree's own rows under the tree mask, no block past the tile's last token (as in the other form)
        last = tl.minimum((tile * BLOCK_M + BLOCK_M - 1) // H + 1, T)
        for block in range(0, last, BLOCK_N):
            keys = block + offs_n
            key_ok = keys < T
            allowed = tl.load(
                mask_ptr + token[None, :] * T + keys[:, None], mask=key_ok[:, None] & row_ok[None, :], other=0
            ).to(tl.int1)
            k_lat, k_rope = _masked_keys(new_ptr, new_stride, keys, key_ok, offs_dl, offs_dr, D_LAT, D_ROPE)
            acc, m_i, l_i = _keys_major_step(acc, m_i, l_i, q_lat, q_rope, k_lat, k_rope, allowed, qk_scale, D_ROPE,
                                             PRECISION, True)  # fmt: skip
    base = (split * requests + b) * T * H + rows
    written = row_ok & active
    tl.store(part_m + base, m_i, mask=written)
    tl.store(part_l + base, l_i, mask=written)
    tl.store(
        part_out + base[None, :] * D_LAT + offs_dl[:, None], acc, mask=written[None, :] & (offs_dl[:, None] < D_LAT)
    )


@triton.jit
def _combine_splits(
    part_out,
    part_m,
    part_l,
    length_ptr,
    out_ptr,
    rows_total,
    rows_per_request,
    num_splits,
    D_LAT: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCKS: tl.constexpr,
    BLOCK_S: tl.constexpr,
    SPLIT_GROUP: tl.constexpr,
):
    # program (row, column block): merges the splits the device length used (the same cut as the split kernel) and
    # the tree split; rows_total rows of every request, rows_per_request each, request by request
    row, col = tl.program_id(0), tl.program_id(1)
    length = tl.sum(tl.load(length_ptr + row // rows_per_request + tl.arange(0, 1)), axis=0).to(tl.int32)
    used = tl.cdiv(length, _split_chunk(length, num_splits, BLOCK_N, MIN_BLOCKS))
    splits = tl.arange(0, BLOCK_S)
    ok = (splits < used) | (splits == num_splits)
    m = tl.load(part_m + splits * rows_total + row, mask=ok, other=float("-inf"))
    l = tl.load(part_l + splits * rows_total + row, mask=ok, other=0.0)
    m_max = tl.max(m, axis=0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.where(ok, tl.exp2(m - m_safe), 0.0)
    total = tl.sum(weight * l, axis=0)
    offs = col * BLOCK_D + tl.arange(0, BLOCK_D)
    ok_d = offs < D_LAT
    tree = num_splits * rows_total + row
    acc = tl.load(part_out + tree * D_LAT + offs, mask=ok_d, other=0.0) * tl.exp2(tl.load(part_m + tree) - m_safe)
    group = tl.arange(0, SPLIT_GROUP)
    for first in range(0, used, SPLIT_GROUP):  # the used splits, SPLIT_GROUP loads in flight at a time
        at = first + group
        ok_s = at < used
        w = tl.where(ok_s, tl.exp2(tl.load(part_m + at * rows_total + row, mask=ok_s, other=0.0) - m_safe), 0.0)
        parts = tl.load(
            part_out + (at[:, None] * rows_total + row) * D_LAT + offs[None, :],
            mask=ok_s[:, None] & ok_d[None, :],
            other=0.0,
        )
        acc += tl.sum(parts * w[:, None], axis=0)
    out = acc / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + row * D_LAT + offs, out.to(out_ptr.dtype.element_ty), mask=ok_d)


SMALL_TILE_CAPACITY = 8192  # cache rows up to which 16-row query tiles are used at any T (measured crossover)
MEDIUM_TILE_ROWS = 264  # query rows (T x H) up to which 32-row tiles of 4 warps beat 64-row tiles of 8 (measured)
COMBINE_COLUMNS, COMBINE_SPLIT_ROWS = 128, 128  # under 128 query rows a combine program merges 128 columns, not all
# (more programs where there are few rows: T = 1 decode over a long cache; measured)
SPLIT_GROUP = 16  # splits whose partial outputs a combine program loads at a time
HOPPER_BLOCK_SHARED = 232448  # the most shared memory one block may take on sm_90 (227 KB)
SHARED_MEMORY_BUDGET = HOPPER_BLOCK_SHARED - 8192  # what a tile may stage: Triton adds a few KB of its own (measured)


def shared_bytes(config: dict, width: int, element_size: int) -> int:
    """What a tile configuration stages in shared memory: the query tile plus num_stages key blocks."""
    return (config["block_m"] + config["num_stages"] * config["block_n"]) * width * element_size


def default_config(rows: int, width: int = 576, element_size: int = 2, capacity: int = 0) -> dict:
    """Tile shapes measured on the H200 (benchmarks/tree_attention_gpu.py; the short-cache sweep in
    benchmarks/results/HISTORY.md; the tile sweep in benchmarks/results/tree_attention_tiles.json): 16-row query
    tiles when at most 16 rows exist (T = 1 decode) or the cache can never be long (capacity <= SMALL_TILE_CAPACITY:
    more programs, and a key block re-read by more tiles costs little); 32-row tiles of 4 warps up to
    MEDIUM_TILE_ROWS rows (a verify of 33 tokens at 8 heads: twice the programs of 64-row tiles, half the registers
    a program; 12 % faster at T = 33 and 35 % at T = 8 over a 32k cache); otherwise 64-row tiles (the wgmma M) with
    64-key blocks, which read a long cache fewer times. Wider or fp32 rows fall back to smaller tiles until the
    shared memory fits."""
    small = rows <= 16 or capacity <= SMALL_TILE_CAPACITY
    preferred = [{"block_m": 16, "block_n": 64, "num_warps": 4, "num_stages": 2}] if small else []
    if rows <= MEDIUM_TILE_ROWS:
        preferred.append({"block_m": 32, "block_n": 64, "num_warps": 4, "num_stages": 2})
    preferred += [{"block_m": 64, "block_n": 64, "num_warps": 8, "num_stages": 2},
                  {"block_m": 64, "block_n": 32, "num_warps": 8, "num_stages": 2},
                  {"block_m": 32, "block_n": 32, "num_warps": 4, "num_stages": 2},
                  {"block_m": 16, "block_n": 32, "num_warps": 4, "num_stages": 2},
                  {"block_m": 16, "block_n": 16, "num_warps": 4, "num_stages": 1}]  # fmt: skip
    for config in preferred:
        if shared_bytes(config, width, element_size) <= SHARED_MEMORY_BUDGET:
            return config
    return preferred[-1]


def default_min_blocks(rows: int, capacity: int) -> int:
    """Key blocks a split takes at least (measured: the short-cache sweep in benchmarks/results/HISTORY.md): 1 for a
    decode's few rows over a cache that is never long (most parallel), else 2 (fewer partial results to write and
    merge)."""
    return 1 if rows <= 16 and capacity <= SMALL_TILE_CAPACITY else 2


def num_splits_for(rows: int, capacity: int, block_m: int, block_n: int, sm_count: int, min_blocks: int) -> int:
    """Cache splits of the grid: enough (row tile, split) programs to fill the GPU ~2 deep at a full cache, each
    with at least `min_blocks` key blocks of the *capacity* (the length is only known on the device, which uses as
    many of them as it needs)."""
    tiles = triton.cdiv(rows, block_m)
    wanted = max(1, (2 * sm_count) // tiles)
    return max(1, min(wanted, triton.cdiv(max(capacity, 1), block_n * min_blocks), 256))


_SM_COUNT: dict[int, int] = {}


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":  # TRITON_INTERPRET=1 on a CPU (tests)
        return 4
    if device.index not in _SM_COUNT:
        _SM_COUNT[device.index] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SM_COUNT[device.index]


def padded_widths(latent_dim: int, rope: int) -> tuple[int, int]:
    """The kernels' column blocks of the latent and the rope columns (powers of two, at least 16)."""
    return max(16, triton.next_power_of_2(latent_dim)), max(16, triton.next_power_of_2(rope))


def launch_config(tokens: int, heads: int, latent_dim: int, rope: int, element_size: int, capacity: int,
                  config: dict | None = None) -> dict:  # fmt: skip
    """The split kernel's form for a launch of `tokens` tokens a request at `heads` heads over a cache of `capacity`
    rows: `default_config`'s tile, `default_min_blocks`, whole key blocks and tensor descriptors from the measured
    thresholds below (descriptors only where whole blocks are taken; the launch also needs `tma_fits`), keys-major
    off; `config` overrides any of them. (The number of splits depends on the GPU: `num_splits_for`.)"""
    config = dict(config or {})
    rows = tokens * heads
    padded = sum(padded_widths(latent_dim, rope))
    out = {**default_config(rows, padded, element_size, capacity), **config}
    out.setdefault("min_blocks", default_min_blocks(rows, capacity))
    verify_sized = tokens <= TMA_MAX_TOKENS
    out.setdefault("whole_blocks", rows >= WHOLE_BLOCK_ROWS and verify_sized)
    out["tma"] = bool(out.get("tma", rows >= TMA_ROWS and verify_sized) and out["whole_blocks"])
    out.setdefault("keys_major", False)
    return out


def tree_attention_cuda(
    q, cache, cache_length, new_kv, tree_mask, scale: float, latent_dim: int, out=None, stream=None, **config
):
    """q [T, H, D], cache [S, D], cache_length [1] (int, on the device), new_kv [T, D], tree_mask [T, T] bool
    -> [T, H, latent_dim], with D = latent_dim + rope dim; same contract as `reference.tree_attention`.

    Several requests in one launch (batched steps): cache [B, S, D] (each request's own rows; any stride between
    requests, rows contiguous), cache_length [B], tree_mask [B, T, T], and q [B * T, H, D], new_kv [B * T, D] with
    request b's rows at [b * T, (b + 1) * T). Each request is cut into the splits a launch of its own would use, so
    its result does not depend on the others in the batch.

    config (default: `default_config` and the measured thresholds below): block_m, block_n, num_warps, num_stages,
    min_blocks, splits, whole_blocks, tma, combine_columns, split_group."""
    batched = cache.dim() == 3
    requests = cache.shape[0] if batched else 1
    tokens, heads, width = q.shape
    tokens //= requests
    rope = width - latent_dim
    device = q.device
    rows = tokens * heads
    capacity = cache.shape[-2]
    config = launch_config(tokens, heads, latent_dim, rope, q.element_size(), capacity, config)
    block_m, block_n, min_blocks = config["block_m"], config["block_n"], config["min_blocks"]
    splits = config.get("splits") or num_splits_for(rows, capacity, block_m, block_n, _sm_count(device), min_blocks)
    if capacity == 0:  # nothing cached: any valid pointer will do, no cache row is read
        cache = new_kv.view(requests, tokens, width) if batched else new_kv
    batch_stride = cache.stride(0) if batched else 0
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        if out is None:
            out = torch.empty((tokens * requests, heads, latent_dim), dtype=q.dtype, device=device)
        part_out, part_m, part_l = parts = split_partials(splits, rows * requests, latent_dim, device)
        mask = tree_mask.contiguous().view(torch.uint8) if tree_mask.dtype == torch.bool else tree_mask.contiguous()
        block_dl, block_dr = padded_widths(latent_dim, rope)
        whole_blocks = config["whole_blocks"]
        use_tma = config["tma"] and capacity > 0 and tma_fits(cache, latent_dim, device)
        lat_desc, rope_desc = (
            cache_descriptors(cache, latent_dim, block_n, block_dl, block_dr) if use_tma else (None,) * 2
        )
        grid = (triton.cdiv(rows, block_m), splits + 1, requests)
        # the two forms take the same arguments
        split_kernel = _tree_attention_split_keys_major if config["keys_major"] else _tree_attention_split
        split_kernel[grid](
            q.contiguous(),
            cache,
            cache_length,
            new_kv.contiguous(),
            mask,
            part_out,
            part_m,
            part_l,
            lat_desc,
            rope_desc,
            tokens,
            heads,
            scale * LOG2E,
            cache.stride(-2),
            batch_stride,
            new_kv.stride(0),
            splits,
            D_LAT=latent_dim,
            D_ROPE=rope,
            BLOCK_DL=block_dl,
            BLOCK_DR=block_dr,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            MIN_BLOCKS=min_blocks,
            PRECISION=dot_precision(q.dtype),
            WHOLE_BLOCKS=whole_blocks,
            USE_TMA=bool(use_tma),
            num_warps=config["num_warps"],
            num_stages=config["num_stages"],
        )
        block_d = block_dl if rows >= COMBINE_SPLIT_ROWS else min(block_dl, COMBINE_COLUMNS)
        block_d = config.get("combine_columns", block_d)
        combine_splits(parts, cache_length, out, rows * requests, splits, latent_dim, block_d, block_n, min_blocks,
                       rows_per_request=rows, split_group=config.get("split_group", SPLIT_GROUP))  # fmt: skip
    return out


# query rows (T x H) from which a split's whole key blocks run without masks (config "whole_blocks") and load by the
# tensor-memory accelerator (config "tma"; Hopper and later). Measured (`benchmarks/tree_attention_gpu.py
# --variants-only`, one H100, BENCHMARKS.md section 4): 7.6 % faster at T = 33, H = 16 (528 rows, 64-row tiles), 7 %
# faster with 64-row tiles at 264 rows too, but 28 % slower with the 32-row tiles that 264 rows take (T = 33, H = 8)
# and mixed at 8 and 64 rows; masks alone changed nothing (-3 % .. +7 %). Only for verify-sized launches (at most
# TMA_MAX_TOKENS tokens a request): prefill chunks keep the masked loads, not timed with descriptors
WHOLE_BLOCK_ROWS = 528
TMA_ROWS = 528
TMA_MAX_TOKENS = 64


def tma_fits(cache: torch.Tensor, latent_dim: int, device: torch.device) -> bool:
    """Tensor descriptors need a Hopper GPU (or the interpreter), rows and requests 16-byte aligned, and the rope
    columns starting on a 16-byte boundary."""
    if device.type == "cuda" and torch.cuda.get_device_capability(device)[0] < 9:
        return False
    size = cache.element_size()
    strides = [cache.stride(i) * size for i in range(cache.dim() - 1)]
    return (
        cache.stride(-1) == 1
        and all(s % 16 == 0 for s in strides)
        and (latent_dim * size) % 16 == 0
        and (cache.data_ptr() % 16 == 0)
    )


def cache_descriptors(cache: torch.Tensor, latent_dim: int, block_n: int, block_dl: int, block_dr: int):
    """[requests, rows, columns] tensor descriptors of the cache's latent and rope columns (one request: a batch of
    one), blocks of [1, block_n, block_dl] and [1, block_n, block_dr]; rows past the capacity read as zeros."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    rows = cache if cache.dim() == 3 else cache.unsqueeze(0)
    requests, capacity, width = rows.shape
    strides = [rows.stride(0), rows.stride(1), 1]
    lat = TensorDescriptor(rows, [requests, capacity, latent_dim], strides, [1, block_n, block_dl])
    rope = TensorDescriptor(rows[..., latent_dim:], [requests, capacity, width - latent_dim], strides,
                            [1, block_n, block_dr])  # fmt: skip
    return lat, rope


tree_attention_cuda.batched = True  # takes several requests in one launch (`models/mla.py`, `per_request`)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 models stay exact (no TF32 in the products); bf16 / fp16 ignore it."""
    return "ieee" if dtype == torch.float32 else "tf32"


def split_partials(splits: int, rows: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (output [., rows, width], running max, running sum) per query row of each of the `splits` cache splits
    and of the one split for the new rows; a split kernel writes them, `combine_splits` merges them."""
    return (
        torch.empty((splits + 1, rows, width), dtype=torch.float32, device=device),
        torch.empty((splits + 1, rows), dtype=torch.float32, device=device),
        torch.empty((splits + 1, rows), dtype=torch.float32, device=device),
    )


def combine_splits(parts, cache_length, out, rows: int, splits: int, width: int, block_d: int, block_n: int,
                   min_blocks: int, rows_per_request: int | None = None,
                   split_group: int = SPLIT_GROUP) -> None:  # fmt: skip
    """Merges `split_partials` into out [rows, width] (contiguous rows): the splits the device length used (cut as
    the split kernel cut them: block_n, min_blocks) and the new rows' split; a program per row and block_d columns.
    rows_per_request: several requests' rows, request by request, each with its own cache_length entry (None: one
    request); split_group: splits whose partial outputs a program loads at a time."""
    _combine_splits[(rows, triton.cdiv(width, block_d))](
        *parts,
        cache_length,
        out,
        rows,
        rows_per_request or rows,
        splits,
        D_LAT=width,
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        MIN_BLOCKS=min_blocks,
        BLOCK_S=triton.next_power_of_2(splits + 1),
        SPLIT_GROUP=split_group,
        num_warps=4,
    )
