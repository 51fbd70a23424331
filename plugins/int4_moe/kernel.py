"""GPU `ddtree::Int4MoE` (Triton): a W4A16 grouped MoE whose chosen experts' packed weights are read once per forward.

The T x top-k (token, expert) pairs are sorted by expert on the device; the experts that were chosen get the first
slots of a static list (no host sync: the grid is sized from min(experts, pairs), unused slots exit at once), so
the launch is safe under CUDA-graph capture. Two kernels:

1. gate + up: program (slot, column tile, K split) streams its expert's packed gate and up rows once for all the
   slot's tokens (in chunks of BLOCK_M rows), unpacks the int4 values and scales them in registers (value - 8, times
   the group's scale: compressed-tensors' definition), and accumulates both products in float32. A K split writes
   partial sums that one small reduction adds in a fixed order; silu(gate) * up follows.
2. down: program (slot, column tile) multiplies the slot's activations by its packed down rows, times each pair's
   routing weight, into the pair's own row; the k rows of a token are summed in a fixed order (deterministic).
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
import triton
import triton.language as tl


@triton.jit
def _dequantized_tile(
    packed_ptr, scale_ptr, row_stride, scale_stride, rows, row_ok, offs_k, k_ok, GROUP: tl.constexpr, dtype
):
    """[len(rows), len(offs_k)] weights: int4 value (4 bits of word k // 8, minus 8) times the scale of group
    k // GROUP. Each word is loaded once per value it holds; the repeats come from L1."""
    mask = row_ok[:, None] & k_ok[None, :]
    words = tl.load(packed_ptr + rows[:, None] * row_stride + (offs_k // 8)[None, :], mask=mask, other=0)
    values = ((words >> ((offs_k % 8) * 4)[None, :]) & 0xF) - 8
    scales = tl.load(scale_ptr + rows[:, None] * scale_stride + (offs_k // GROUP)[None, :], mask=mask, other=0.0)
    return (values.to(tl.float32) * scales.to(tl.float32)).to(dtype)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    token_ptr,
    slot_expert_ptr,
    start_ptr,
    count_ptr,
    gate_p,
    gate_s,
    up_p,
    up_s,
    part_ptr,
    hidden,
    width,
    num_pairs,
    p_stride_e,
    p_stride_r,
    s_stride_e,
    s_stride_r,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = tl.load(slot_expert_ptr + slot)
    if expert < 0:
        return
    start = tl.load(start_ptr + expert)
    count = tl.load(count_ptr + expert)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    k_begin = split * K_PER_SPLIT
    dtype = x_ptr.dtype.element_ty
    for m0 in range(0, count, BLOCK_M):
        pairs = start + m0 + tl.arange(0, BLOCK_M)
        pair_ok = pairs < start + count
        tokens = tl.load(token_ptr + pairs, mask=pair_ok, other=0)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < hidden
            a = tl.load(x_ptr + tokens[:, None] * hidden + offs_k[None, :], mask=pair_ok[:, None] & k_ok[None, :])
            g = _dequantized_tile(
                gate_p + expert * p_stride_e,
                gate_s + expert * s_stride_e,
                p_stride_r,
                s_stride_r,
                cols,
                col_ok,
                offs_k,
                k_ok,
                GROUP,
                dtype,
            )
            u = _dequantized_tile(
                up_p + expert * p_stride_e,
                up_s + expert * s_stride_e,
                p_stride_r,
                s_stride_r,
                cols,
                col_ok,
                offs_k,
                k_ok,
                GROUP,
                dtype,
            )
            acc_gate += tl.dot(a, tl.trans(g), input_precision=PRECISION)
            acc_up += tl.dot(a, tl.trans(u), input_precision=PRECISION)
        out = part_ptr + (split * num_pairs + pairs)[:, None] * (2 * width) + cols[None, :]
        mask = pair_ok[:, None] & col_ok[None, :]
        tl.store(out, acc_gate, mask=mask)
        tl.store(out + width, acc_up, mask=mask)


@triton.jit
def _down_kernel(
    act_ptr,
    order_ptr,
    pair_weight_ptr,
    slot_expert_ptr,
    start_ptr,
    count_ptr,
    down_p,
    down_s,
    out_ptr,
    hidden,
    width,
    p_stride_e,
    p_stride_r,
    s_stride_e,
    s_stride_r,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    slot, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(slot_expert_ptr + slot)
    if expert < 0:
        return
    start = tl.load(start_ptr + expert)
    count = tl.load(count_ptr + expert)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    dtype = act_ptr.dtype.element_ty
    for m0 in range(0, count, BLOCK_M):
        pairs = start + m0 + tl.arange(0, BLOCK_M)
        pair_ok = pairs < start + count
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < width
            a = tl.load(act_ptr + pairs[:, None] * width + offs_k[None, :], mask=pair_ok[:, None] & k_ok[None, :])
            d = _dequantized_tile(
                down_p + expert * p_stride_e,
                down_s + expert * s_stride_e,
                p_stride_r,
                s_stride_r,
                cols,
                col_ok,
                offs_k,
                k_ok,
                GROUP,
                dtype,
            )
            acc += tl.dot(a, tl.trans(d), input_precision=PRECISION)
        source = tl.load(order_ptr + pairs, mask=pair_ok, other=0)  # the pair's row in [T * k] order
        scale = tl.load(pair_weight_ptr + source, mask=pair_ok, other=0.0)
        tl.store(
            out_ptr + source[:, None] * hidden + cols[None, :],
            acc * scale[:, None],
            mask=pair_ok[:, None] & col_ok[None, :],
        )


@triton.jit
def _word_tile(packed_ptr, scale_ptr, row_stride, scale_stride, rows, row_ok, word0, words, groups,
               BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GROUP: tl.constexpr, dtype):  # fmt: skip
    """[BLOCK_N, BLOCK_KW * 8] weights from BLOCK_KW consecutive int32 words of each row (one coalesced load a word;
    value j of word w is input 8 w + j, compressed-tensors' order), times the scale of each group of GROUP inputs."""
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    offs_w = word0 + tl.arange(0, BLOCK_KW)
    mask = row_ok[:, None] & (offs_w < words)[None, :]
    packed = tl.load(packed_ptr + rows[:, None] * row_stride + offs_w[None, :], mask=mask, other=0)
    values = ((packed[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF) - 8  # [N, KW, 8]
    offs_g = word0 * 8 // GROUP + tl.arange(0, GROUPS)
    g_mask = row_ok[:, None] & (offs_g < groups)[None, :]
    scales = tl.load(scale_ptr + rows[:, None] * scale_stride + offs_g[None, :], mask=g_mask, other=0.0)
    grouped = tl.reshape(values.to(tl.float32), (BLOCK_N, GROUPS, GROUP)) * scales.to(tl.float32)[:, :, None]
    return tl.reshape(grouped, (BLOCK_N, BLOCK_K)).to(dtype)


@triton.jit
def _gate_up_words_kernel(x_ptr, token_ptr, slot_expert_ptr, start_ptr, count_ptr, gate_p, gate_s, up_p, up_s,
                          part_ptr, hidden, width, num_pairs, p_stride_e, p_stride_r, s_stride_e, s_stride_r,
                          GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                          K_PER_SPLIT: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    """`_gate_up_kernel` with coalesced word loads (`_word_tile`): BLOCK_KW words = BLOCK_KW * 8 inputs a step."""
    slot, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = tl.load(slot_expert_ptr + slot)
    if expert < 0:
        return
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    start = tl.load(start_ptr + expert)
    count = tl.load(count_ptr + expert)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < width
    k_begin = split * K_PER_SPLIT
    dtype = x_ptr.dtype.element_ty
    words, groups = hidden // 8, hidden // GROUP
    gate_p, gate_s = gate_p + expert * p_stride_e, gate_s + expert * s_stride_e
    up_p, up_s = up_p + expert * p_stride_e, up_s + expert * s_stride_e
    for m0 in range(0, count, BLOCK_M):
        pairs = start + m0 + tl.arange(0, BLOCK_M)
        pair_ok = pairs < start + count
        tokens = tl.load(token_ptr + pairs, mask=pair_ok, other=0)
        acc_gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_begin, k_begin + K_PER_SPLIT, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(x_ptr + tokens[:, None] * hidden + offs_k[None, :],
                        mask=pair_ok[:, None] & (offs_k < hidden)[None, :], other=0.0)  # fmt: skip
            g = _word_tile(gate_p, gate_s, p_stride_r, s_stride_r, cols, col_ok, k0 // 8, words, groups,
                           BLOCK_N, BLOCK_KW, GROUP, dtype)  # fmt: skip
            u = _word_tile(up_p, up_s, p_stride_r, s_stride_r, cols, col_ok, k0 // 8, words, groups,
                           BLOCK_N, BLOCK_KW, GROUP, dtype)  # fmt: skip
            acc_gate += tl.dot(a, tl.trans(g), input_precision=PRECISION)
            acc_up += tl.dot(a, tl.trans(u), input_precision=PRECISION)
        out = part_ptr + (split * num_pairs + pairs)[:, None] * (2 * width) + cols[None, :]
        mask = pair_ok[:, None] & col_ok[None, :]
        tl.store(out, acc_gate, mask=mask)
        tl.store(out + width, acc_up, mask=mask)


@triton.jit
def _down_words_kernel(act_ptr, order_ptr, pair_weight_ptr, slot_expert_ptr, start_ptr, count_ptr, down_p, down_s,
                       out_ptr, hidden, width, p_stride_e, p_stride_r, s_stride_e, s_stride_r, GROUP: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr,
                       PRECISION: tl.constexpr):  # fmt: skip
    """`_down_kernel` with coalesced word loads."""
    slot, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(slot_expert_ptr + slot)
    if expert < 0:
        return
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    start = tl.load(start_ptr + expert)
    count = tl.load(count_ptr + expert)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    dtype = act_ptr.dtype.element_ty
    words, groups = width // 8, width // GROUP
    down_p, down_s = down_p + expert * p_stride_e, down_s + expert * s_stride_e
    for m0 in range(0, count, BLOCK_M):
        pairs = start + m0 + tl.arange(0, BLOCK_M)
        pair_ok = pairs < start + count
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(act_ptr + pairs[:, None] * width + offs_k[None, :],
                        mask=pair_ok[:, None] & (offs_k < width)[None, :], other=0.0)  # fmt: skip
            d = _word_tile(down_p, down_s, p_stride_r, s_stride_r, cols, col_ok, k0 // 8, words, groups,
                           BLOCK_N, BLOCK_KW, GROUP, dtype)  # fmt: skip
            acc += tl.dot(a, tl.trans(d), input_precision=PRECISION)
        source = tl.load(order_ptr + pairs, mask=pair_ok, other=0)
        scale = tl.load(pair_weight_ptr + source, mask=pair_ok, other=0.0)
        tl.store(out_ptr + source[:, None] * hidden + cols[None, :], acc * scale[:, None],
                 mask=pair_ok[:, None] & col_ok[None, :])  # fmt: skip


def route(expert_ids: torch.Tensor, num_experts: int):
    """(order, token of each sorted pair, start and count of each expert, slot -> expert or -1): device ops only."""
    flat = expert_ids.reshape(-1)
    pairs = flat.numel()
    order = flat.argsort(stable=True)
    token = (order // expert_ids.shape[1]).to(torch.int32)
    count = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    count.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    start = (count.cumsum(0) - count).to(torch.int32)
    chosen = count > 0
    slots = min(num_experts, pairs)
    # the chosen experts' slot numbers in expert order; the others write to one spare slot past the end
    slot = torch.where(chosen, chosen.cumsum(0) - 1, torch.full_like(flat[:1], slots).expand(num_experts))
    slot_expert = torch.full((slots + 1,), -1, dtype=torch.int32, device=flat.device)
    experts = torch.arange(num_experts, dtype=torch.int32, device=flat.device)
    slot_expert.scatter_(0, slot, torch.where(chosen, experts, -1))
    return order, token, start, count, slot_expert[:slots].contiguous()


def _split_k(programs: int, hidden: int, block_k: int, device: torch.device) -> int:
    """K splits so that small batches still fill the GPU (about two programs per SM), in whole BLOCK_K steps."""
    if device.type != "cuda":
        return 1 if hidden <= block_k else 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    steps = triton.cdiv(hidden, block_k)
    return max(1, min(steps, 8, triton.cdiv(2 * sms, max(programs, 1))))


def int4_moe_cuda(
    x: torch.Tensor,
    expert_ids: torch.Tensor,
    expert_weights: torch.Tensor,
    gate_packed: torch.Tensor,
    gate_scale: torch.Tensor,
    up_packed: torch.Tensor,
    up_scale: torch.Tensor,
    down_packed: torch.Tensor,
    down_scale: torch.Tensor,
    group_size: int,
    out: torch.Tensor | None = None,
    stream: torch.cuda.Stream | None = None,
    block_m: int = 16,
    word_tiles: bool = True,
    block_kw: int = 16,
) -> torch.Tensor:
    """The contract of `reference.int4_moe`; runs on any device Triton runs on (the interpreter included).
    word_tiles: the kernels that load whole int32 words (`_word_tile`, BLOCK_KW words a step); False: the first
    kernels, which load each word once per value it holds (kept to compare)."""
    tokens, hidden = x.shape
    experts, width, _ = gate_packed.shape
    if group_size % 8 or hidden % group_size or width % group_size:
        raise ValueError(f"Int4MoE needs group_size % 8 == 0 dividing hidden={hidden} and width={width}")
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        x = x.contiguous()
        order, token, start, count, slot_expert = route(expert_ids, experts)
        pairs = expert_ids.numel()
        slots = slot_expert.numel()
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 rounding
        if word_tiles:
            result = _launch_word_tiles(x, expert_weights, gate_packed, gate_scale, up_packed, up_scale, down_packed,
                                        down_scale, group_size, order, token, start, count, slot_expert, block_m,
                                        block_kw, precision)  # fmt: skip
            if out is None:
                return result
            return out.copy_(result)
        block_k = max(group_size, 64)
        block_n = 32 if tokens <= 64 else 64
        tiles = triton.cdiv(width, block_n)
        split = _split_k(slots * tiles, hidden, block_k, x.device)
        k_per_split = triton.cdiv(triton.cdiv(hidden, split), block_k) * block_k
        split = triton.cdiv(hidden, k_per_split)
        part = torch.empty((split, pairs, 2 * width), dtype=torch.float32, device=x.device)
        _gate_up_kernel[(slots, tiles, split)](
            x,
            token,
            slot_expert,
            start,
            count,
            gate_packed,
            gate_scale,
            up_packed,
            up_scale,
            part,
            hidden,
            width,
            pairs,
            gate_packed.stride(0),
            gate_packed.stride(1),
            gate_scale.stride(0),
            gate_scale.stride(1),
            GROUP=group_size,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            K_PER_SPLIT=k_per_split,
            PRECISION=precision,
        )
        summed = part.sum(dim=0) if split > 1 else part[0]
        act = (F.silu(summed[:, :width]) * summed[:, width:]).to(x.dtype)  # [pairs, width], sorted order
        routed = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
        down_n = 64
        _down_kernel[(slots, triton.cdiv(hidden, down_n))](
            act,
            order,
            expert_weights.reshape(-1).to(torch.float32).contiguous(),
            slot_expert,
            start,
            count,
            down_packed,
            down_scale,
            routed,
            hidden,
            width,
            down_packed.stride(0),
            down_packed.stride(1),
            down_scale.stride(0),
            down_scale.stride(1),
            GROUP=group_size,
            BLOCK_M=block_m,
            BLOCK_N=down_n,
            BLOCK_K=max(group_size, 32),
            PRECISION=precision,
        )
        result = routed.view(tokens, -1, hidden).sum(dim=1).to(x.dtype)
        if out is None:
            return result
        out.copy_(result)
        return out


def _launch_word_tiles(x, expert_weights, gate_packed, gate_scale, up_packed, up_scale, down_packed, down_scale,
                       group_size, order, token, start, count, slot_expert, block_m, block_kw, precision):  # fmt: skip
    tokens, hidden = x.shape
    width = gate_packed.shape[1]
    pairs, slots = order.numel(), slot_expert.numel()
    block_kw = max(block_kw, group_size // 8)
    block_k = 8 * block_kw
    block_n = 32 if tokens <= 64 else 64
    tiles = triton.cdiv(width, block_n)
    split = _split_k(slots * tiles, hidden, block_k, x.device)
    k_per_split = triton.cdiv(triton.cdiv(hidden, split), block_k) * block_k
    split = triton.cdiv(hidden, k_per_split)
    part = torch.empty((split, pairs, 2 * width), dtype=torch.float32, device=x.device)
    _gate_up_words_kernel[(slots, tiles, split)](
        x, token, slot_expert, start, count, gate_packed, gate_scale, up_packed, up_scale, part, hidden, width, pairs,
        gate_packed.stride(0), gate_packed.stride(1), gate_scale.stride(0), gate_scale.stride(1),
        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, K_PER_SPLIT=k_per_split,
        PRECISION=precision,
    )  # fmt: skip
    summed = part.sum(dim=0) if split > 1 else part[0]
    act = (F.silu(summed[:, :width]) * summed[:, width:]).to(x.dtype)  # [pairs, width], sorted order
    routed = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    down_kw = max(group_size // 8, min(32, triton.next_power_of_2(triton.cdiv(width, 8))))
    down_n = 64
    _down_words_kernel[(slots, triton.cdiv(hidden, down_n))](
        act, order, expert_weights.reshape(-1).to(torch.float32).contiguous(), slot_expert, start, count,
        down_packed, down_scale, routed, hidden, width, down_packed.stride(0), down_packed.stride(1),
        down_scale.stride(0), down_scale.stride(1), GROUP=group_size, BLOCK_M=block_m, BLOCK_N=down_n,
        BLOCK_KW=down_kw, PRECISION=precision,
    )  # fmt: skip
    return routed.view(tokens, -1, hidden).sum(dim=1).to(x.dtype)
