"""GPU `ddtree::Int4MoE` (Triton): a W4A16 grouped MoE whose chosen experts' packed weights are read once per forward.

Two weight layouts, the same packed bytes:

- "rows" (what the torch backend runs where the dimensions allow: 128 | hidden and width, 16 | group; Kimi K2.x's
  do): `Int4MoEKernel.prepare_experts` reorders each layer's words once at load (`repack_rows`: nibble j of word w
  holds input j * words + w, so a 16-word step of one nibble is 16 consecutive inputs of one group). The weight rows
  sit on the MMA's M side and the words are loaded straight into the dot's register operand, unpacked by a lop3 (two
  nibbles into two bfloat16 mantissas), scaled there (rounded once, as the reference's weights) and multiplied on
  tensor cores; no dequantized tile goes through shared memory. Launches: route; gate + up (program: slot, 64 rows,
  K split, as many splits as the experts chosen need: `_busy_splits`); act (the K splits' sums, silu(gate) * up in
  the model's dtype); down (slot, 256 rows).
  For one bfloat16 token on a GPU, `token_cuda` (CUDA C compiled by NVRTC: `Tuning.token_kernel`), and for 2 to
  `Tuning.block_tokens` its block form (`Tuning.block_kernel`: the route launch, then CUDA C), else (float32,
  the interpreter) for one token (`Tuning.gemv_tokens`: a decode, whose experts are distinct) a CUDA-core form on the
  same words:
  gate + up (pair, 16 rows, K split; the last split to finish adds the splits and writes the act), down (token, 16
  rows, all its experts at once); no routing sort. For more tokens the same form runs blocks of up to
  `Tuning.cuda_core_block` sorted pairs of one expert (`route_blocks`); inside a model, where a verify block's tokens
  share experts, the tensor-core form is faster (BENCHMARKS.md, section 8), so `gemv_tokens` stays 1.
- "compressed-tensors" (the checkpoint's order: nibble j of word w is input 8 w + j; the TensorRT plugin and other
  dimensions): the "tiles" kernels below, the dequantized tile on the MMA's N side through shared memory.

The tiles form's three launches, all safe under CUDA-graph capture (static grids sized from the shapes, offsets on
the device):

1. route (one program, up to ROUTE_MAX_PAIRS pairs): the T x top-k (token, expert) pairs sorted by expert (keys
   expert * P + pair, a bitonic sort), each expert's start and count (a histogram and its running sum), and the chosen
   experts packed into the first slots of a static list (the others -1). Larger batches (prefill) route with torch ops.
2. gate + up: program (slot, column tile, K split) streams its expert's packed gate and up rows once for all the
   slot's pairs: whole int32 words (8 inputs each, compressed-tensors' order) are loaded, unpacked in registers
   (value - 8 by the float32 bit trick, times the group's scale, rounded to the model's dtype) and multiplied on
   tensor cores (`tl.dot`, 16 rows; a float32 multiply-add over 2 rows measured 2.7-3.5x slower on one H200, and a
   streaming GEMV-like form 1.03-2.5x slower: BENCHMARKS.md, section 8). A K split writes float32 partial sums.
3. down: program (slot, column tile) adds the K splits' partial sums, applies silu(gate) * up (rounded to the model's
   dtype, as the reference does), multiplies by its packed down rows and by each pair's routing weight, into the
   pair's own row. The k rows of a token are then summed in a fixed order (deterministic; no atomics).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plugins.int4_moe import token_cuda

ROUTE_MAX_PAIRS = 1024  # one routing program sorts up to this many (token, expert) pairs
MAGIC = tl.constexpr(0x4B000000)  # the bits of 2^23 as float32: (nibble | MAGIC) read as float32 is 2^23 + nibble
MAGIC_BIAS = tl.constexpr(8388616.0)  # 2^23 + 8: subtracting it leaves (nibble - 8) with no int-to-float convert


@dataclass(frozen=True)
class Tuning:
    """Launch shapes (`benchmarks/int4_moe_gpu.py --sweep` times the choices): columns a gate/up program and a down
    program compute, input words a down step reads, programs per SM the K split aims for, warps a program, input
    words a gate/up step reads (at least a group's), software-pipeline stages of both kernels' K loops."""

    gate_n: int = 64
    down_n: int = 256
    down_kw: int = 8
    programs_per_sm: int = 8
    num_warps: int = 4
    gate_kw: int = 16
    stages: int = 3  # Triton's default for CUDA launches
    block_m: int = 16  # pairs a program multiplies at once ("rows" layout)
    use_asm: bool = True  # "rows" layout in bfloat16 on a GPU: the lop3 unpack (inline PTX) instead of the plain one
    # "rows" layout: the CUDA-core form (`_gate_up_cc_kernel`) up to this many tokens (one token: a block a pair; more:
    # blocks of one expert's pairs). It wins on random routing, but a verify block's tokens share experts, and inside
    # the whole rank the tensor-core form was faster at every verify measured, 9 to 33 tokens (BENCHMARKS.md, section 8)
    gemv_tokens: int = 1
    gemv_n: int = 16  # rows a CUDA-core gate/up program computes (of gate and of up each)
    gemv_down_n: int = 16  # rows a CUDA-core down program computes (for all of a token's experts)
    gemv_per_sm: int = 8  # CUDA-core gate/up programs per SM its K split aims for
    gemv_warps: int = 4
    cuda_core_block: int = 2  # pairs of one expert a CUDA-core block multiplies at once (blocks of 1 narrower)
    cuda_core_down_n: int = 128  # rows a CUDA-core down program computes for a block (one token: `gemv_down_n`)
    rows_split: int | None = None  # K splits of the rows tensor-core form; None: what the chosen experts need
    # one bfloat16 token in the rows layout: "cuda" (`token_cuda`: CUDA C compiled by NVRTC at first use, every load
    # of a row issued before its first multiply) or "triton" (the CUDA-core form above)
    token_kernel: str = "cuda"
    # 2 to `block_tokens` bfloat16 tokens in the rows layout (a draft block, a verify): "cuda" (`token_cuda`'s block
    # form: each chosen expert's words streamed through shared memory once and multiplied by up to 8 of its tokens a
    # pass on tensor cores) or "triton" (the tensor-core form above). Measured faster at 8 to 33 tokens (BENCHMARKS.md,
    # section 8); 64 is checked on a GPU, not timed; longer blocks (prefill chunks) keep the Triton form
    block_kernel: str = "cuda"
    block_tokens: int = 64


# the best of `--sweep`'s 72 shapes on one H200 at Kimi K2.x's per-rank TP-8 dimensions (BENCHMARKS.md, section 8)
DEFAULT_TUNING = Tuning()


@triton.jit
def _route_kernel(ids_ptr, order_ptr, token_ptr, start_ptr, count_ptr, slot_expert_ptr, active_ptr, pairs, experts,
                  slots, block_expert_ptr, block_first_ptr, block_count_ptr, block_off_ptr, num_blocks,
                  TOP_K: tl.constexpr, P: tl.constexpr, E: tl.constexpr, BLOCK_M: tl.constexpr):  # fmt: skip
    p = tl.arange(0, P)
    p_ok = p < pairs
    # padding pairs take the spare expert bin E - 1 (E > experts) and sort last
    ids = tl.load(ids_ptr + p, mask=p_ok, other=E - 1).to(tl.int32)
    keys = tl.sort(ids * P + p)
    order = keys % P
    tl.store(order_ptr + p, order.to(tl.int64), mask=p_ok)
    tl.store(token_ptr + p, (order // TOP_K).to(tl.int32), mask=p_ok)
    counts = tl.histogram(ids, E)  # [E]; the padding lands in bin E - 1
    e = tl.arange(0, E)
    e_ok = e < experts
    counts = tl.where(e_ok, counts, 0)
    tl.store(count_ptr + e, counts, mask=e_ok)
    tl.store(start_ptr + e, tl.cumsum(counts, 0) - counts, mask=e_ok)
    chosen = counts > 0
    slot = tl.cumsum(chosen.to(tl.int32), 0) - 1
    tl.store(active_ptr, tl.sum(chosen.to(tl.int32), 0))  # the experts chosen (slots that hold one)
    s = tl.arange(0, E)
    tl.store(slot_expert_ptr + s, tl.full((E,), -1, tl.int32), mask=s < slots)
    if BLOCK_M > 0:  # blocks of up to BLOCK_M sorted pairs of one expert, each expert's from its block offset on
        per_expert = (counts + BLOCK_M - 1) // BLOCK_M
        tl.store(block_off_ptr + e, tl.cumsum(per_expert, 0) - per_expert, mask=e_ok)
        tl.store(block_expert_ptr + p, tl.full((P,), -1, tl.int32), mask=p < num_blocks)
    tl.debug_barrier()  # the -1 fills, starts, counts and block offsets land before what reads or overwrites them
    tl.store(slot_expert_ptr + slot, e.to(tl.int32), mask=chosen & (slot < slots))
    if BLOCK_M > 0:
        expert = keys // P  # of sorted pair p
        begin = tl.load(start_ptr + expert, mask=p_ok, other=0)
        rank = p - begin  # p's place among its expert's pairs
        head = p_ok & (rank % BLOCK_M == 0)
        block = tl.load(block_off_ptr + expert, mask=p_ok, other=0) + rank // BLOCK_M
        left = tl.load(count_ptr + expert, mask=p_ok, other=0) - rank
        tl.store(block_expert_ptr + block, expert, mask=head)
        tl.store(block_first_ptr + block, p, mask=head)
        tl.store(block_count_ptr + block, tl.minimum(left, BLOCK_M), mask=head)


def route(expert_ids: torch.Tensor, num_experts: int):
    """(order, token of each sorted pair, start and count of each expert, slot -> expert or -1, the number of
    experts chosen as a 1-element tensor): device work only."""
    flat = expert_ids.reshape(-1)
    if flat.numel() > ROUTE_MAX_PAIRS:
        return _route_torch(expert_ids, num_experts)
    return _route(expert_ids, num_experts, 0)[:6]


def block_count(pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks `route_blocks` can fill at most: every expert's pairs in blocks of up to block_m."""
    return min(pairs, triton.cdiv(pairs + (block_m - 1) * min(num_experts, pairs), block_m))


def route_blocks(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    """`route`'s sort plus each expert's sorted pairs in blocks of up to `block_m` (up to ROUTE_MAX_PAIRS pairs):
    (order, token of each sorted pair, block -> expert or -1, its first sorted pair, its pairs); the blocks past the
    filled ones hold expert -1. Device work only, one launch."""
    order, token, _, _, _, _, blocks = _route(expert_ids, num_experts, block_m)
    return (order, token, *blocks)


def _route(expert_ids: torch.Tensor, num_experts: int, block_m: int):
    flat = expert_ids.reshape(-1)
    pairs = flat.numel()
    if pairs > ROUTE_MAX_PAIRS:
        raise ValueError(f"one routing program sorts at most {ROUTE_MAX_PAIRS} pairs: got {pairs}")
    slots = min(num_experts, pairs)
    device = flat.device
    order = torch.empty(pairs, dtype=torch.int64, device=device)
    token = torch.empty(pairs, dtype=torch.int32, device=device)
    start = torch.empty(num_experts, dtype=torch.int32, device=device)
    count = torch.empty(num_experts, dtype=torch.int32, device=device)
    slot_expert = torch.empty(slots, dtype=torch.int32, device=device)
    active = torch.empty(1, dtype=torch.int32, device=device)
    blocks = block_count(pairs, num_experts, block_m) if block_m else 1
    block_expert, block_first, block_pairs = (torch.empty(blocks, dtype=torch.int32, device=device) for _ in "efp")
    block_off = torch.empty(num_experts if block_m else 1, dtype=torch.int32, device=device)
    span = triton.next_power_of_2(num_experts + 1)
    _route_kernel[(1,)](flat.contiguous(), order, token, start, count, slot_expert, active, pairs, num_experts, slots,
                        block_expert, block_first, block_pairs, block_off, blocks, TOP_K=expert_ids.shape[-1],
                        P=max(16, triton.next_power_of_2(pairs)), E=span, BLOCK_M=block_m, num_warps=8)  # fmt: skip
    return order, token, start, count, slot_expert, active, (block_expert, block_first, block_pairs)


def _route_torch(expert_ids: torch.Tensor, num_experts: int):
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
    active = chosen.sum().to(torch.int32).reshape(1)
    return order, token, start, count, slot_expert[:slots].contiguous(), active


@triton.jit
def _silu_times(gate, up):
    """silu(gate) * up in float32 (every form's act)."""
    return gate / (1.0 + tl.exp(-gate)) * up


@triton.jit
def _word_tile(packed_ptr, scale_ptr, row_stride, scale_stride, rows, row_ok, word0, words, groups,
               BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, GROUP: tl.constexpr):  # fmt: skip
    """[BLOCK_N, BLOCK_KW * 8] float32 weights from BLOCK_KW consecutive int32 words of each row (one coalesced load
    a word; value j of word w is input 8 w + j), times the scale of each group of GROUP inputs."""
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    offs_w = word0 + tl.arange(0, BLOCK_KW)
    mask = row_ok[:, None] & (offs_w < words)[None, :]
    packed = tl.load(packed_ptr + rows[:, None] * row_stride + offs_w[None, :], mask=mask, other=0)
    nibble = (packed[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [N, KW, 8]
    values = (nibble | MAGIC).to(tl.float32, bitcast=True) - MAGIC_BIAS  # value - 8, exact, no int-to-float convert
    offs_g = word0 * 8 // GROUP + tl.arange(0, GROUPS)
    g_mask = row_ok[:, None] & (offs_g < groups)[None, :]
    scales = tl.load(scale_ptr + rows[:, None] * scale_stride + offs_g[None, :], mask=g_mask, other=0.0)
    grouped = tl.reshape(values, (BLOCK_N, GROUPS, GROUP)) * scales.to(tl.float32)[:, :, None]
    return tl.reshape(grouped, (BLOCK_N, BLOCK_K))


@triton.jit
def _gate_up_kernel(x_ptr, token_ptr, slot_expert_ptr, start_ptr, count_ptr, gate_p, gate_s, up_p, up_s, part_ptr,
                    hidden, width, num_pairs, p_stride_e, p_stride_r, s_stride_e, s_stride_r, GROUP: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KW: tl.constexpr, K_PER_SPLIT: tl.constexpr,
                    PRECISION: tl.constexpr):  # fmt: skip
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
                           BLOCK_N, BLOCK_KW, GROUP)  # fmt: skip
            u = _word_tile(up_p, up_s, p_stride_r, s_stride_r, cols, col_ok, k0 // 8, words, groups,
                           BLOCK_N, BLOCK_KW, GROUP)  # fmt: skip
            acc_gate += tl.dot(a, tl.trans(g.to(dtype)), input_precision=PRECISION)
            acc_up += tl.dot(a, tl.trans(u.to(dtype)), input_precision=PRECISION)
        out = part_ptr + (split * num_pairs + pairs)[:, None] * (2 * width) + cols[None, :]
        mask = pair_ok[:, None] & col_ok[None, :]
        tl.store(out, acc_gate, mask=mask)
        tl.store(out + width, acc_up, mask=mask)


@triton.jit
def _down_kernel(part_ptr, splits, order_ptr, pair_weight_ptr, slot_expert_ptr, start_ptr, count_ptr, down_p, down_s,
                 out_ptr, hidden, width, num_pairs, p_stride_e, p_stride_r, s_stride_e, s_stride_r,
                 ACT_DTYPE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_KW: tl.constexpr, PRECISION: tl.constexpr):  # fmt: skip
    slot, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(slot_expert_ptr + slot)
    if expert < 0:
        return
    BLOCK_K: tl.constexpr = BLOCK_KW * 8
    start = tl.load(start_ptr + expert)
    count = tl.load(count_ptr + expert)
    cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    words, groups = width // 8, width // GROUP
    down_p, down_s = down_p + expert * p_stride_e, down_s + expert * s_stride_e
    for m0 in range(0, count, BLOCK_M):
        pairs = start + m0 + tl.arange(0, BLOCK_M)
        pair_ok = pairs < start + count
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, width, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask = pair_ok[:, None] & (offs_k < width)[None, :]
            gate = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            up = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
            for s in range(0, splits):  # the K splits' partial sums, in a fixed order
                row = part_ptr + (s * num_pairs + pairs)[:, None] * (2 * width) + offs_k[None, :]
                gate += tl.load(row, mask=mask, other=0.0)
                up += tl.load(row + width, mask=mask, other=0.0)
            act = _silu_times(gate, up).to(ACT_DTYPE)  # in the model's dtype, as the reference rounds it
            d = _word_tile(down_p, down_s, p_stride_r, s_stride_r, cols, col_ok, k0 // 8, words, groups,
                           BLOCK_N, BLOCK_KW, GROUP)  # fmt: skip
            acc += tl.dot(act, tl.trans(d.to(ACT_DTYPE)), input_precision=PRECISION)
        source = tl.load(order_ptr + pairs, mask=pair_ok, other=0)  # the pair's row in [T * k] order
        scale = tl.load(pair_weight_ptr + source, mask=pair_ok, other=0.0)
        tl.store(out_ptr + source[:, None] * hidden + cols[None, :], acc * scale[:, None],
                 mask=pair_ok[:, None] & col_ok[None, :])  # fmt: skip


# The 8 values of an int32 word as bfloat16 in 11 instructions (the plain unpack takes about 3 a value): lop3 puts
# nibbles j and j + 4 into the mantissas of two bfloat16 128.0s (128 + n, exact), one fma a pair subtracts 136.
_UNPACK_BF16_ASM = tl.constexpr("""
{
.reg .b32 w1, w2, w3, t0, t1, t2, t3, one, bias;
mov.b32 one, 0x3F803F80;
mov.b32 bias, 0xC308C308;
shr.u32 w1, $8, 4;
shr.u32 w2, $8, 8;
shr.u32 w3, $8, 12;
lop3.b32 t0, $8, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 t1, w1, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 t2, w2, 0x000F000F, 0x43004300, 0xEA;
lop3.b32 t3, w3, 0x000F000F, 0x43004300, 0xEA;
fma.rn.bf16x2 t0, t0, one, bias;
fma.rn.bf16x2 t1, t1, one, bias;
fma.rn.bf16x2 t2, t2, one, bias;
fma.rn.bf16x2 t3, t3, one, bias;
mov.b32 {$0, $4}, t0;
mov.b32 {$1, $5}, t1;
mov.b32 {$2, $6}, t2;
mov.b32 {$3, $7}, t3;
}
""")


@triton.jit
def _nibble(packed, j: tl.constexpr, DTYPE: tl.constexpr):
    """Value j of each word minus 8, exact in DTYPE."""
    return ((((packed >> (4 * j)) & 0xF) | MAGIC).to(tl.float32, bitcast=True) - MAGIC_BIAS).to(DTYPE)


@triton.jit
def _unpack8(packed, DTYPE: tl.constexpr, USE_ASM: tl.constexpr):
    """The 8 values of each word of `packed` [N, KW] minus 8, as 8 tensors [N, KW] of DTYPE (exact: -8 .. 7). The
    only input is the words, so Triton loads them straight into the dot's register-operand layout."""
    if USE_ASM:
        bits = tl.inline_asm_elementwise(_UNPACK_BF16_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r", [packed],
                                         dtype=(tl.int16,) * 8, is_pure=True, pack=1)  # fmt: skip
        return (bits[0].to(tl.bfloat16, bitcast=True), bits[1].to(tl.bfloat16, bitcast=True),
                bits[2].to(tl.bfloat16, bitcast=True), bits[3].to(tl.bfloat16, bitcast=True),
                bits[4].to(tl.bfloat16, bitcast=True), bits[5].to(tl.bfloat16, bitcast=True),
                bits[6].to(tl.bfloat16, bitcast=True), bits[7].to(tl.bfloat16, bitcast=True))  # fmt: skip
    else:
        return (_nibble(packed, 0, DTYPE), _nibble(packed, 1, DTYPE), _nibble(packed, 2, DTYPE),
                _nibble(packed, 3, DTYPE), _nibble(packed, 4, DTYPE), _nibble(packed, 5, DTYPE),
                _nibble(packed, 6, DTYPE), _nibble(packed, 7, DTYPE))  # fmt: skip


@triton.jit
def _group_dot(acc, q, b, scale_ptr, scale_stride, rows, row_ok, k0, k_ok, GROUP: tl.constexpr,
               PRECISION: tl.constexpr):  # fmt: skip
    """acc + (q * scale) @ b: q [N, 16] the integer values of inputs k0 .. k0 + 15 (one group of each row), scaled
    in the dot's register layout and rounded to q's dtype once, as the reference's weights are; b [16, M]."""
    scale = tl.load(scale_ptr + rows * scale_stride + k0 // GROUP, mask=row_ok & k_ok, other=0.0)
    return tl.dot(q * scale.to(q.dtype)[:, None], b, acc, input_precision=PRECISION)


@triton.jit
def _gate_up_rows_kernel(x_ptr, token_ptr, slot_expert_ptr, start_ptr, count_ptr, active_ptr, per_slot, gate_p,
                         gate_s, up_p, up_s, part_ptr, hidden, width, num_pairs, p_stride_e, p_stride_r, s_stride_e,
                         s_stride_r, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_KW: tl.constexpr, PRECISION: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """gate and up on the "rows" layout (`repack_rows`: nibble j of word w holds input j * words + w): the weight
    rows on the MMA's M side, the unpacked words its register operand; each 16-word step is 8 dots of one group
    each, the group's scale multiplied into the operand before its dot. The K splits it uses are those the chosen
    experts need (`_busy_splits`), up to the grid's; the other programs exit at once."""
    slot, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits, kw_per_split = _busy_splits(active_ptr, per_slot, tl.num_programs(2), hidden // 8, BLOCK_KW)
    expert = tl.load(slot_expert_ptr + slot)
    if (expert < 0) | (split >= splits):
        return
    start = tl.load(start_ptr + expert)
    count = tl.load(count_ptr + expert)
    dtype = x_ptr.dtype.element_ty
    words = hidden // 8
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < width
    w_begin = split * kw_per_split
    gate_p, gate_s = gate_p + expert * p_stride_e, gate_s + expert * s_stride_e
    up_p, up_s = up_p + expert * p_stride_e, up_s + expert * s_stride_e
    for m0 in range(0, count, BLOCK_M):
        pairs = start + m0 + tl.arange(0, BLOCK_M)
        pair_ok = pairs < start + count
        tokens = tl.load(token_ptr + pairs, mask=pair_ok, other=0)
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for w0 in range(w_begin, w_begin + kw_per_split, BLOCK_KW):
            offs_w = w0 + tl.arange(0, BLOCK_KW)
            mask = row_ok[:, None] & (offs_w < words)[None, :]
            pg = tl.load(gate_p + rows[:, None] * p_stride_r + offs_w[None, :], mask=mask, other=0)
            pu = tl.load(up_p + rows[:, None] * p_stride_r + offs_w[None, :], mask=mask, other=0)
            g = _unpack8(pg, dtype, USE_ASM)
            u = _unpack8(pu, dtype, USE_ASM)
            xm = (offs_w < words)[:, None] & pair_ok[None, :]
            xb = x_ptr + tokens[None, :] * hidden + offs_w[:, None]  # [KW, M]: input j * words + w at row w
            for j in tl.static_range(8):
                xj = tl.load(xb + j * words, mask=xm, other=0.0)
                acc_g = _group_dot(acc_g, g[j], xj, gate_s, s_stride_r, rows, row_ok, j * words + w0, w0 < words,
                                   GROUP, PRECISION)  # fmt: skip
                acc_u = _group_dot(acc_u, u[j], xj, up_s, s_stride_r, rows, row_ok, j * words + w0, w0 < words,
                                   GROUP, PRECISION)  # fmt: skip
        out = part_ptr + (split * num_pairs + pairs)[None, :] * (2 * width) + rows[:, None]
        mask = row_ok[:, None] & pair_ok[None, :]
        tl.store(out, acc_g, mask=mask)
        tl.store(out + width, acc_u, mask=mask)


@triton.jit
def _busy_splits(active_ptr, per_slot, most, words, BLOCK_KW: tl.constexpr):
    """(K splits, words a split) for the rows tensor-core form: about `per_slot` programs (the GPU's share of each
    chosen expert's tiles) over the experts chosen, at most `most` (the grid's), whole BLOCK_KW-word steps. A verify
    block's tokens share experts, so far fewer than the grid's static slots hold one; read on the device, so the
    split follows the routing without a host sync."""
    active = tl.maximum(tl.load(active_ptr), 1)
    want = tl.minimum(tl.maximum((per_slot + active - 1) // active, 1), most)
    kw = ((words + want - 1) // want + BLOCK_KW - 1) // BLOCK_KW * BLOCK_KW
    return (words + kw - 1) // kw, kw


@triton.jit
def _act_kernel(part_ptr, active_ptr, per_slot, most, words, act_ptr, width, num_pairs, BLOCK: tl.constexpr,
                BLOCK_KW: tl.constexpr):  # fmt: skip
    """act[pair] = silu(gate) * up in act's dtype (as the reference rounds it), the K splits summed in a fixed order."""
    pair = tl.program_id(0)
    splits, _ = _busy_splits(active_ptr, per_slot, most, words, BLOCK_KW)
    offs = tl.arange(0, BLOCK)
    for c0 in range(0, width, BLOCK):
        cols = c0 + offs
        ok = cols < width
        row = part_ptr + pair * (2 * width) + cols
        gate = tl.load(row, mask=ok, other=0.0)
        up = tl.load(row + width, mask=ok, other=0.0)
        for s in range(1, splits):
            gate += tl.load(row + s * num_pairs * 2 * width, mask=ok, other=0.0)
            up += tl.load(row + s * num_pairs * 2 * width + width, mask=ok, other=0.0)
        tl.store(act_ptr + pair * width + cols, _silu_times(gate, up).to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _down_rows_kernel(act_ptr, order_ptr, pair_weight_ptr, slot_expert_ptr, start_ptr, count_ptr, down_p,
                      down_s, out_ptr, hidden, width, num_pairs, p_stride_e, p_stride_r, s_stride_e, s_stride_r,
                      ACT_DTYPE: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_KW: tl.constexpr, PRECISION: tl.constexpr, USE_ASM: tl.constexpr):  # fmt: skip
    """down on the "rows" layout, as `_gate_up_rows_kernel`, over act [pairs, width]."""
    slot, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(slot_expert_ptr + slot)
    if expert < 0:
        return
    start = tl.load(start_ptr + expert)
    count = tl.load(count_ptr + expert)
    words = width // 8
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < hidden
    down_p, down_s = down_p + expert * p_stride_e, down_s + expert * s_stride_e
    for m0 in range(0, count, BLOCK_M):
        pairs = start + m0 + tl.arange(0, BLOCK_M)
        pair_ok = pairs < start + count
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        for w0 in range(0, words, BLOCK_KW):
            offs_w = w0 + tl.arange(0, BLOCK_KW)
            mask = row_ok[:, None] & (offs_w < words)[None, :]
            packed = tl.load(down_p + rows[:, None] * p_stride_r + offs_w[None, :], mask=mask, other=0)
            d = _unpack8(packed, ACT_DTYPE, USE_ASM)
            am = (offs_w < words)[:, None] & pair_ok[None, :]
            ab = act_ptr + pairs[None, :] * width + offs_w[:, None]  # [KW, M]: input j * words + w at row w
            for j in tl.static_range(8):
                act = tl.load(ab + j * words, mask=am, other=0.0)
                acc = _group_dot(acc, d[j], act, down_s, s_stride_r, rows, row_ok, j * words + w0, w0 < words, GROUP,
                                 PRECISION)  # fmt: skip
        source = tl.load(order_ptr + pairs, mask=pair_ok, other=0)  # the pair's row in [T * k] order
        weight = tl.load(pair_weight_ptr + source, mask=pair_ok, other=0.0)
        tl.store(out_ptr + source[None, :] * hidden + rows[:, None], acc * weight[None, :],
                 mask=row_ok[:, None] & pair_ok[None, :])  # fmt: skip


# The CUDA-core forms make each weight (n - 8) * s exactly in float32 in two instructions: one lop3 puts the nibble,
# at bits p .. p + 3 of its word (p = 8, 12 or 16: nibbles 2, 3, 4 in place, 0 and 1 of the word << 8, 5, 6, 7 of
# the word >> 12), into the mantissa of 2^(23 - p): 2^(23 - p) + n, exact; then fma(raw, s, -(2^(23 - p) + 8) s).
# With s of 8 significant bits (bfloat16 scales, as Kimi ships them) raw * s and (2^(23 - p) + 8) * s are exact
# products (16 + 8 and 13 + 8 bits at most), so the fma's result is exact whether the multiply-add is fused or not
# (the Triton interpreter's is not); other scales take raw - (2^(23 - p) + 8) = n - 8 (exact), then times s.
_LOP3_AT = {p: tl.constexpr(f"lop3.b32 $0, $1, {0xF << p:#010x}, {(150 - p) << 23:#010x}, 0xEA;") for p in (8, 12, 16)}
_LOP3_AT_8, _LOP3_AT_12, _LOP3_AT_16 = _LOP3_AT[8], _LOP3_AT[12], _LOP3_AT[16]


@triton.jit
def _weights(lo, word, hi, j: tl.constexpr, s, USE_ASM: tl.constexpr, FMA_SCALE: tl.constexpr):
    """(n - 8) * s exactly in float32, n nibble j of each word; s float32, broadcastable (see `_LOP3_AT`). The nibble
    comes from the words (`word`), the words << 8 (`lo`) or >> 12 (`hi`), where it sits at bit P: first as
    2^(23 - P) + n."""
    P: tl.constexpr = 4 * j + 8 * (j < 2) - 12 * (j > 4)
    BIAS: tl.constexpr = (1 << (23 - P)) + 8
    if j < 2:
        src = lo
    elif j < 5:
        src = word
    else:
        src = hi
    if USE_ASM:
        if P == 8:
            raw = tl.inline_asm_elementwise(_LOP3_AT_8, "=r,r", [src], dtype=tl.int32, is_pure=True, pack=1)
        elif P == 12:
            raw = tl.inline_asm_elementwise(_LOP3_AT_12, "=r,r", [src], dtype=tl.int32, is_pure=True, pack=1)
        else:
            raw = tl.inline_asm_elementwise(_LOP3_AT_16, "=r,r", [src], dtype=tl.int32, is_pure=True, pack=1)
    else:
        raw = (src & (0xF << P)) | ((150 - P) << 23)
    raw = raw.to(tl.float32, bitcast=True)
    if FMA_SCALE:
        return tl.fma(raw, s, -(s * BIAS))
    else:
        return (raw - BIAS) * s


@triton.jit
def _spread(words):
    """The two shifted copies of `words` that `_weights` takes nibbles 0, 1 and 5, 6, 7 from."""
    return words << 8, words >> 12  # an arithmetic shift: its sign bits land above bit 19, which no mask keeps


@triton.jit
def _pair_x(x_ptr, token_ptr, q, ok, HIDDEN: tl.constexpr, GROUP: tl.constexpr, TOP_K: tl.constexpr,
            ROUTED: tl.constexpr):  # fmt: skip
    """[1, 1, GROUP] pointers to the first group of the input row of the pair at row q of act (if `ok`)."""
    if ROUTED:
        tok = tl.load(token_ptr + q, mask=ok, other=0)
    else:
        tok = q // TOP_K
    return x_ptr + tok * HIDDEN + tl.arange(0, GROUP)[None, None, :]


@triton.jit
def _row_sums(acc):
    """[N] sums of one pair's [1, N, GROUP] products."""
    return tl.sum(tl.sum(acc, 2), 0)


@triton.jit
def _split_sums(part_ptr, split, num_rows, q, rows, ok, gate, up, WIDTH: tl.constexpr):
    """A K split's partial sums of one pair (row q of part) for the last split to add."""
    out = part_ptr + (split * num_rows + q) * (2 * WIDTH) + rows
    tl.store(out, gate, mask=ok)
    tl.store(out + WIDTH, up, mask=ok)


@triton.jit
def _write_act(part_ptr, splits, num_rows, q, rows, ok, gate, up, act_ptr, WIDTH: tl.constexpr):
    """silu(gate) * up of one pair into its row q of act, in act's dtype; from `gate` and `up` or, with K splits,
    from the splits' partial sums added in split order (the same sums whichever split came last)."""
    if splits > 1:
        gate = tl.zeros(rows.shape, dtype=tl.float32)
        up = tl.zeros(rows.shape, dtype=tl.float32)
        for s in range(0, splits):
            row = part_ptr + (s * num_rows + q) * (2 * WIDTH) + rows
            gate += tl.load(row, mask=ok, other=0.0, cache_modifier=".cg")
            up += tl.load(row + WIDTH, mask=ok, other=0.0, cache_modifier=".cg")
    tl.store(act_ptr + q * WIDTH + rows, _silu_times(gate, up).to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _gate_up_cc(x_ptr, token_ptr, gate_p, gate_s, up_p, up_s, part_ptr, count_ptr, act_ptr, num_rows, p_stride_e,
                p_stride_r, s_stride_e, s_stride_r, expert, first, n, HIDDEN: tl.constexpr, WIDTH: tl.constexpr,
                TOP_K: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, KW_PER_SPLIT: tl.constexpr,
                M: tl.constexpr, ROUTED: tl.constexpr, USE_ASM: tl.constexpr, FMA_SCALE: tl.constexpr,
                STAGES: tl.constexpr = 3):  # fmt: skip
    """`_gate_up_cc_kernel`'s work for a block of n <= M pairs (M = 1, 2 or 4; rows first .. first + n - 1 of act).
    Each pair has its own [1, BLOCK_N, GROUP] sums, so every tensor keeps the words' coalesced layout."""
    block, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    splits = tl.num_programs(2)
    ok0, ok1, ok2, ok3 = n > 0, n > 1, n > 2, n > 3
    x0 = _pair_x(x_ptr, token_ptr, first, ok0, HIDDEN, GROUP, TOP_K, ROUTED)
    x1 = _pair_x(x_ptr, token_ptr, first + 1, ok1 & (M > 1), HIDDEN, GROUP, TOP_K, ROUTED)
    x2 = _pair_x(x_ptr, token_ptr, first + 2, ok2 & (M > 2), HIDDEN, GROUP, TOP_K, ROUTED)
    x3 = _pair_x(x_ptr, token_ptr, first + 3, ok3 & (M > 3), HIDDEN, GROUP, TOP_K, ROUTED)
    words: tl.constexpr = HIDDEN // 8
    spans: tl.constexpr = words // GROUP  # groups one nibble of a row spans
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = (rows < WIDTH)[None, :, None]  # [1, N, 1]
    offs = rows[None, :, None] * p_stride_r + tl.arange(0, GROUP)[None, None, :]  # [1, N, GROUP]
    scales = expert * s_stride_e + rows[None, :, None] * s_stride_r  # [1, N, 1]
    gate_p, gate_s = gate_p + expert * p_stride_e + offs, gate_s + scales
    up_p, up_s = up_p + expert * p_stride_e + offs, up_s + scales
    g0 = tl.zeros((1, BLOCK_N, GROUP), dtype=tl.float32)
    g1, g2, g3, u0, u1, u2, u3 = g0, g0, g0, g0, g0, g0, g0
    w_begin = split * KW_PER_SPLIT
    w_end = w_begin + KW_PER_SPLIT  # the last split may end past the words: masked
    for w0 in tl.range(w_begin, w_end, GROUP, num_stages=STAGES):
        w_ok = w0 < words
        pg = tl.load(gate_p + w0, mask=row_ok & w_ok, other=0)
        pu = tl.load(up_p + w0, mask=row_ok & w_ok, other=0)
        lo_g, hi_g = _spread(pg)
        lo_u, hi_u = _spread(pu)
        for j in tl.static_range(8):
            # inputs j * words + w0 ...: one group of each row
            group = j * spans + w0 // GROUP
            sg = tl.load(gate_s + group, mask=row_ok & w_ok, other=0.0).to(tl.float32)
            su = tl.load(up_s + group, mask=row_ok & w_ok, other=0.0).to(tl.float32)
            wg = _weights(lo_g, pg, hi_g, j, sg, USE_ASM, FMA_SCALE)
            wu = _weights(lo_u, pu, hi_u, j, su, USE_ASM, FMA_SCALE)
            at = j * words + w0
            xj = tl.load(x0 + at, mask=ok0 & w_ok, other=0.0).to(tl.float32)
            g0, u0 = tl.fma(wg, xj, g0), tl.fma(wu, xj, u0)
            if M > 1:
                xj = tl.load(x1 + at, mask=ok1 & w_ok, other=0.0).to(tl.float32)
                g1, u1 = tl.fma(wg, xj, g1), tl.fma(wu, xj, u1)
            if M > 2:
                xj = tl.load(x2 + at, mask=ok2 & w_ok, other=0.0).to(tl.float32)
                g2, u2 = tl.fma(wg, xj, g2), tl.fma(wu, xj, u2)
                xj = tl.load(x3 + at, mask=ok3 & w_ok, other=0.0).to(tl.float32)
                g3, u3 = tl.fma(wg, xj, g3), tl.fma(wu, xj, u3)
    row_ok = rows < WIDTH
    # each pair's [N] sums (the pairs past M are never read, so never computed)
    g0, g1, g2, g3 = _row_sums(g0), _row_sums(g1), _row_sums(g2), _row_sums(g3)
    u0, u1, u2, u3 = _row_sums(u0), _row_sums(u1), _row_sums(u2), _row_sums(u3)
    last = splits == 1  # this program writes the act
    if splits > 1:
        _split_sums(part_ptr, split, num_rows, first, rows, row_ok & ok0, g0, u0, WIDTH)
        if M > 1:
            _split_sums(part_ptr, split, num_rows, first + 1, rows, row_ok & ok1, g1, u1, WIDTH)
        if M > 2:
            _split_sums(part_ptr, split, num_rows, first + 2, rows, row_ok & ok2, g2, u2, WIDTH)
            _split_sums(part_ptr, split, num_rows, first + 3, rows, row_ok & ok3, g3, u3, WIDTH)
        counter = count_ptr + block * tl.num_programs(1) + tile
        last = tl.atomic_add(counter, 1, sem="acq_rel") == splits - 1  # every other split's sums are written
        if last:
            tl.store(counter, 0)
    if last:
        _write_act(part_ptr, splits, num_rows, first, rows, row_ok & ok0, g0, u0, act_ptr, WIDTH)
        if M > 1:
            _write_act(part_ptr, splits, num_rows, first + 1, rows, row_ok & ok1, g1, u1, act_ptr, WIDTH)
        if M > 2:
            _write_act(part_ptr, splits, num_rows, first + 2, rows, row_ok & ok2, g2, u2, act_ptr, WIDTH)
            _write_act(part_ptr, splits, num_rows, first + 3, rows, row_ok & ok3, g3, u3, act_ptr, WIDTH)


@triton.jit
def _gate_up_cc_kernel(x_ptr, ids_ptr, token_ptr, block_expert_ptr, block_first_ptr, block_count_ptr, gate_p, gate_s,
                       up_p, up_s, part_ptr, count_ptr, act_ptr, num_rows, p_stride_e, p_stride_r, s_stride_e,
                       s_stride_r, HIDDEN: tl.constexpr, WIDTH: tl.constexpr, TOP_K: tl.constexpr,
                       GROUP: tl.constexpr, BLOCK_N: tl.constexpr, KW_PER_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       ROUTED: tl.constexpr, USE_ASM: tl.constexpr, FMA_SCALE: tl.constexpr):  # fmt: skip
    """gate and up on the CUDA cores ("rows" layout), for batches with few pairs an expert: program (block, BLOCK_N
    rows, K split) streams its expert's rows a group (GROUP words of one nibble: GROUP inputs, one scale) at a time,
    the next groups' words loaded ahead (Triton's software pipeline), each weight made once (`_weights`) and
    multiplied in float32 for every pair of the block. A block is up to BLOCK_M sorted pairs of one expert
    (`route_blocks`), or, not ROUTED (one token: its experts are distinct), pair `block` alone; blocks of one or two
    pairs take narrower code. The last split of a (block, rows) to finish (a counter a tile, left at 0 again) adds
    the splits' partial sums in split order and writes silu(gate) * up in act's dtype, into the pairs' rows of act."""
    block = tl.program_id(0)
    if not ROUTED:
        expert = tl.load(ids_ptr + block)
        _gate_up_cc(x_ptr, token_ptr, gate_p, gate_s, up_p, up_s, part_ptr, count_ptr, act_ptr, num_rows, p_stride_e,
                    p_stride_r, s_stride_e, s_stride_r, expert, block, 1, HIDDEN, WIDTH, TOP_K, GROUP, BLOCK_N,
                    KW_PER_SPLIT, 1, False, USE_ASM, FMA_SCALE)  # fmt: skip
    else:
        expert = tl.load(block_expert_ptr + block)
        if expert >= 0:
            first = tl.load(block_first_ptr + block)
            n = tl.load(block_count_ptr + block)  # <= BLOCK_M
            if n == 1:
                _gate_up_cc(x_ptr, token_ptr, gate_p, gate_s, up_p, up_s, part_ptr, count_ptr, act_ptr, num_rows,
                            p_stride_e, p_stride_r, s_stride_e, s_stride_r, expert, first, n, HIDDEN, WIDTH, TOP_K,
                            GROUP, BLOCK_N, KW_PER_SPLIT, 1, True, USE_ASM, FMA_SCALE)  # fmt: skip
            elif n == 2:
                _gate_up_cc(x_ptr, token_ptr, gate_p, gate_s, up_p, up_s, part_ptr, count_ptr, act_ptr, num_rows,
                            p_stride_e, p_stride_r, s_stride_e, s_stride_r, expert, first, n, HIDDEN, WIDTH, TOP_K,
                            GROUP, BLOCK_N, KW_PER_SPLIT, 2, True, USE_ASM, FMA_SCALE)  # fmt: skip
            else:
                _gate_up_cc(x_ptr, token_ptr, gate_p, gate_s, up_p, up_s, part_ptr, count_ptr, act_ptr, num_rows,
                            p_stride_e, p_stride_r, s_stride_e, s_stride_r, expert, first, n, HIDDEN, WIDTH, TOP_K,
                            GROUP, BLOCK_N, KW_PER_SPLIT, BLOCK_M, True, USE_ASM, FMA_SCALE)  # fmt: skip


@triton.jit
def _routed_row(routed_ptr, order_ptr, pair_weight_ptr, q, ok, rows, sums, HIDDEN: tl.constexpr):
    """One pair's down rows, times its routing weight, into its routed row (the pair's place in [T * k] order)."""
    source = tl.load(order_ptr + q, mask=ok, other=0)
    weight = tl.load(pair_weight_ptr + source, mask=ok, other=0.0).to(tl.float32)
    tl.store(routed_ptr + source * HIDDEN + rows, _row_sums(sums) * weight, mask=ok & (rows < HIDDEN))


@triton.jit
def _down_cc(act_ptr, order_ptr, pair_weight_ptr, down_p, down_s, routed_ptr, p_stride_e, p_stride_r, s_stride_e,
             s_stride_r, tile, expert, first, n, HIDDEN: tl.constexpr, WIDTH: tl.constexpr, GROUP: tl.constexpr,
             BLOCK_N: tl.constexpr, M: tl.constexpr, USE_ASM: tl.constexpr, FMA_SCALE: tl.constexpr,
             SUB: tl.constexpr = 16, STAGES: tl.constexpr = 3):  # fmt: skip
    """`_down_cc_kernel`'s work for a block of n <= M sorted pairs (M = 1, 2 or 4): the program's BLOCK_N rows SUB
    at a time, the next steps' words loaded ahead (a software pipeline), each pair's sums of its own."""
    ok0, ok1, ok2, ok3 = n > 0, n > 1, n > 2, n > 3
    offs = tl.arange(0, GROUP)[None, None, :]
    a0 = act_ptr + first * WIDTH + offs  # [1, 1, GROUP]
    a1, a2, a3 = a0 + WIDTH, a0 + 2 * WIDTH, a0 + 3 * WIDTH
    words: tl.constexpr = WIDTH // 8
    spans: tl.constexpr = words // GROUP
    down_p, down_s = down_p + expert * p_stride_e, down_s + expert * s_stride_e
    for r0 in tl.range(tile * BLOCK_N, tile * BLOCK_N + BLOCK_N, SUB, num_stages=STAGES):
        rows = r0 + tl.arange(0, SUB)
        row_ok = (rows < HIDDEN)[None, :, None]  # [1, SUB, 1]
        d0 = tl.zeros((1, SUB, GROUP), dtype=tl.float32)
        d1, d2, d3 = d0, d0, d0
        for w0 in tl.static_range(0, words, GROUP):
            packed = tl.load(down_p + rows[None, :, None] * p_stride_r + w0 + offs, mask=row_ok, other=0)
            lo, hi = _spread(packed)
            for j in tl.static_range(8):
                s = tl.load(down_s + rows[None, :, None] * s_stride_r + j * spans + w0 // GROUP, mask=row_ok,
                            other=0.0).to(tl.float32)  # fmt: skip
                w = _weights(lo, packed, hi, j, s, USE_ASM, FMA_SCALE)
                at = j * words + w0
                d0 = tl.fma(w, tl.load(a0 + at, mask=ok0, other=0.0).to(tl.float32), d0)
                if M > 1:
                    d1 = tl.fma(w, tl.load(a1 + at, mask=ok1, other=0.0).to(tl.float32), d1)
                if M > 2:
                    d2 = tl.fma(w, tl.load(a2 + at, mask=ok2, other=0.0).to(tl.float32), d2)
                    d3 = tl.fma(w, tl.load(a3 + at, mask=ok3, other=0.0).to(tl.float32), d3)
        _routed_row(routed_ptr, order_ptr, pair_weight_ptr, first, ok0, rows, d0, HIDDEN)
        if M > 1:
            _routed_row(routed_ptr, order_ptr, pair_weight_ptr, first + 1, ok1, rows, d1, HIDDEN)
        if M > 2:
            _routed_row(routed_ptr, order_ptr, pair_weight_ptr, first + 2, ok2, rows, d2, HIDDEN)
            _routed_row(routed_ptr, order_ptr, pair_weight_ptr, first + 3, ok3, rows, d3, HIDDEN)


@triton.jit
def _down_cc_kernel(act_ptr, order_ptr, pair_weight_ptr, block_expert_ptr, block_first_ptr, block_count_ptr, down_p,
                    down_s, routed_ptr, p_stride_e, p_stride_r, s_stride_e, s_stride_r, HIDDEN: tl.constexpr,
                    WIDTH: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                    USE_ASM: tl.constexpr, FMA_SCALE: tl.constexpr):  # fmt: skip
    """down on the CUDA cores for `_gate_up_cc_kernel`'s blocks: program (block, BLOCK_N rows) streams its expert's
    rows once for the block's pairs and writes each pair's routed row (times its routing weight) in float32."""
    block, tile = tl.program_id(0), tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert >= 0:
        first = tl.load(block_first_ptr + block)
        n = tl.load(block_count_ptr + block)
        if n == 1:
            _down_cc(act_ptr, order_ptr, pair_weight_ptr, down_p, down_s, routed_ptr, p_stride_e, p_stride_r,
                     s_stride_e, s_stride_r, tile, expert, first, n, HIDDEN, WIDTH, GROUP, BLOCK_N, 1, USE_ASM,
                     FMA_SCALE)  # fmt: skip
        elif n == 2:
            _down_cc(act_ptr, order_ptr, pair_weight_ptr, down_p, down_s, routed_ptr, p_stride_e, p_stride_r,
                     s_stride_e, s_stride_r, tile, expert, first, n, HIDDEN, WIDTH, GROUP, BLOCK_N, 2, USE_ASM,
                     FMA_SCALE)  # fmt: skip
        else:
            _down_cc(act_ptr, order_ptr, pair_weight_ptr, down_p, down_s, routed_ptr, p_stride_e, p_stride_r,
                     s_stride_e, s_stride_r, tile, expert, first, n, HIDDEN, WIDTH, GROUP, BLOCK_N, BLOCK_M, USE_ASM,
                     FMA_SCALE)  # fmt: skip


@triton.jit
def _down_token_kernel(act_ptr, ids_ptr, pair_weight_ptr, down_p, down_s, out_ptr, p_stride_e, p_stride_r,
                       s_stride_e, s_stride_r, HIDDEN: tl.constexpr, WIDTH: tl.constexpr, TOP_K: tl.constexpr,
                       K_PAD: tl.constexpr, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, USE_ASM: tl.constexpr,
                       FMA_SCALE: tl.constexpr):  # fmt: skip
    """down for a token's TOP_K pairs at once on the CUDA cores (one token: its experts are distinct): program (token,
    BLOCK_N rows) loads the rows of all its experts together, weights each pair by its routing weight and sums the
    pairs in a fixed order, into the token's output row in the output's dtype (no routed rows, no separate sum)."""
    token, tile = tl.program_id(0), tl.program_id(1)
    k = tl.arange(0, K_PAD)
    k_ok = k < TOP_K
    pairs = token * TOP_K + k
    experts = tl.load(ids_ptr + pairs, mask=k_ok, other=0)
    words: tl.constexpr = WIDTH // 8
    spans: tl.constexpr = words // GROUP
    rows = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < HIDDEN
    offs = tl.arange(0, GROUP)
    ok = k_ok[:, None, None] & row_ok[None, :, None]
    wp = down_p + experts[:, None, None] * p_stride_e + rows[None, :, None] * p_stride_r + offs[None, None, :]
    sp = down_s + experts[:, None] * s_stride_e + rows[None, :] * s_stride_r  # [K, N]
    acc = tl.zeros((K_PAD, BLOCK_N, GROUP), dtype=tl.float32)
    for w0 in range(0, words, GROUP):
        packed = tl.load(wp + w0, mask=ok, other=0)  # [K, N, GROUP]
        lo, hi = _spread(packed)
        for j in tl.static_range(8):
            aj = tl.load(act_ptr + pairs[:, None] * WIDTH + j * words + w0 + offs[None, :], mask=k_ok[:, None],
                         other=0.0).to(tl.float32)  # [K, GROUP]  # fmt: skip
            s = tl.load(sp + j * spans + w0 // GROUP, mask=k_ok[:, None] & row_ok[None, :], other=0.0)
            acc = tl.fma(_weights(lo, packed, hi, j, s.to(tl.float32)[:, :, None], USE_ASM, FMA_SCALE),
                         aj[:, None, :], acc)  # fmt: skip
    weight = tl.load(pair_weight_ptr + pairs, mask=k_ok, other=0.0).to(tl.float32)
    per_pair = tl.sum(acc, 2) * weight[:, None]  # [K, N]
    tl.store(out_ptr + token * HIDDEN + rows, tl.sum(per_pair, 0).to(out_ptr.dtype.element_ty), mask=row_ok)


def gemv_fits(hidden: int, width: int, group_size: int) -> bool:
    """The CUDA-core form steps a whole group of one nibble at a time: a power-of-two group dividing both word
    counts (Kimi K2.x: 896 and 32 words, groups of 32)."""
    words_in, words_width = hidden // 8, width // 8
    return group_size & (group_size - 1) == 0 and words_in % group_size == 0 and words_width % group_size == 0


def rows_layout_fits(hidden: int, width: int, group_size: int) -> bool:
    """The "rows" form needs each 16-word step of a nibble to lie in one group: 16 | words and 16 | group."""
    return (hidden // 8) % 16 == 0 and (width // 8) % 16 == 0 and group_size % 16 == 0


def repack_rows(packed: torch.Tensor, chunk: int = 16, in_place: bool = False) -> torch.Tensor:
    """compressed-tensors words [..., out, in / 8] (nibble j of word w = input 8 w + j) -> the "rows" layout (nibble
    j of word w = input j * (in / 8) + w): the same bytes reordered, `chunk` leading slices at a time. in_place: into
    `packed` itself (a layer's experts at load: no second copy of them, ever)."""
    flat = packed.reshape(-1, *packed.shape[-2:])
    out = flat if in_place else torch.empty_like(flat)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    for i in range(0, flat.shape[0], chunk):
        values = (flat[i : i + chunk].unsqueeze(-1) >> shifts) & 0xF  # [c, out, W, 8]: input 8 w + j
        n, rows, w, _ = values.shape
        values = values.reshape(n, rows, 8, w).transpose(-1, -2)  # [c, out, W, 8]: input j * W + w at [w, j]
        out[i : i + chunk] = _pack_words(values, shifts)
    return packed if in_place else out.reshape(packed.shape)


def _pack_words(values: torch.Tensor, shifts: torch.Tensor) -> torch.Tensor:
    word = torch.zeros(values.shape[:-1], dtype=torch.int32, device=values.device)
    for j in range(8):
        word |= values[..., j] << shifts[j]
    return word


def _split_k(programs: int, hidden: int, block_k: int, device: torch.device, per_sm: int = 2,
             cap: int | None = 8) -> int:  # fmt: skip
    """K splits so that small batches still fill the GPU (about `per_sm` programs per SM), in whole BLOCK_K steps,
    at most `cap` (None: up to one step a split)."""
    if device.type != "cuda":
        return 1 if hidden <= block_k else 2
    steps = triton.cdiv(hidden, block_k)
    return max(1, min(steps, cap or steps, triton.cdiv(per_sm * _sm_count(device), max(programs, 1))))


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


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
    tuning: Tuning | None = None,
    layout: str = "compressed-tensors",
) -> torch.Tensor:
    """The contract of `reference.int4_moe`; runs on any device Triton runs on (the interpreter included).
    layout "rows": the packed words were reordered by `repack_rows` (the scales are unchanged). tuning None: the
    module's `DEFAULT_TUNING` at the time of the call."""
    tuning = DEFAULT_TUNING if tuning is None else tuning
    tokens, hidden = x.shape
    experts, width, _ = gate_packed.shape
    if group_size % 8 or hidden % group_size or width % group_size:
        raise ValueError(f"Int4MoE needs group_size % 8 == 0 dividing hidden={hidden} and width={width}")
    if layout not in LAYOUTS:
        raise ValueError(f"Int4MoE layout must be one of {sorted(LAYOUTS)}: got {layout!r}")
    if layout == "rows" and not rows_layout_fits(hidden, width, group_size):
        raise ValueError(f"the rows layout needs 128 | hidden, 128 | width, 16 | group_size: got {hidden}, {width}, "
                         f"{group_size}")  # fmt: skip
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        x = x.contiguous()
        token = layout == "rows" and tokens == 1 and tuning.token_kernel == "cuda"
        if token and _token_cuda_fits(x, gate_scale, down_scale, expert_ids, group_size, width):
            result = token_cuda.int4_moe_token(x, expert_ids, expert_weights, gate_packed, gate_scale, up_packed,
                                               up_scale, down_packed, down_scale, group_size)  # fmt: skip
            return result if out is None else out.copy_(result)
        block = layout == "rows" and 1 < tokens <= tuning.block_tokens and tuning.block_kernel == "cuda"
        if (block and expert_ids.numel() <= ROUTE_MAX_PAIRS and _cuda_c_fits(x, gate_scale, down_scale)
                and token_cuda.block_fits(hidden, width, group_size, expert_ids.shape[-1])):  # fmt: skip
            routing = route(expert_ids, experts)
            result = token_cuda.int4_moe_block(x, routing, expert_weights, gate_packed, gate_scale, up_packed,
                                               up_scale, down_packed, down_scale, group_size)  # fmt: skip
            return result if out is None else out.copy_(result)
        if (layout == "rows" and tokens <= tuning.gemv_tokens and expert_ids.numel() <= ROUTE_MAX_PAIRS
                and gemv_fits(hidden, width, group_size)):  # fmt: skip
            result = _rows_cuda_cores(x, expert_ids, expert_weights, gate_packed, gate_scale, up_packed, up_scale,
                                down_packed, down_scale, group_size, tuning)  # fmt: skip
            return result if out is None else out.copy_(result)
        order, token, start, count, slot_expert, active = route(expert_ids, experts)
        routed = torch.empty((expert_ids.numel(), hidden), dtype=torch.float32, device=x.device)
        weights = expert_weights.reshape(-1).to(torch.float32).contiguous()  # no copy when already so
        precision = "ieee" if x.dtype == torch.float32 else "tf32"  # fp32 models: no TF32 rounding
        LAYOUTS[layout](x, order, token, start, count, slot_expert, active, weights, gate_packed, gate_scale, up_packed,
                        up_scale, down_packed, down_scale, group_size, routed, precision, tuning)  # fmt: skip
        result = routed.view(tokens, -1, hidden).sum(dim=1)
        return result.to(x.dtype) if out is None else out.copy_(result)


def _cuda_c_fits(x, gate_scale, down_scale) -> bool:
    """Whether `token_cuda`'s kernels can run here: bfloat16 tokens and scales on an sm_80 or newer GPU (its source
    holds sm_80 instructions)."""
    return (x.is_cuda and x.dtype == gate_scale.dtype == down_scale.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device) >= (8, 0))  # fmt: skip


def _token_cuda_fits(x, gate_scale, down_scale, expert_ids, group_size: int, width: int) -> bool:
    """Whether `token_cuda` takes this call: one bfloat16 token (`_cuda_c_fits`), its dimensions."""
    return _cuda_c_fits(x, gate_scale, down_scale) and token_cuda.fits(x.shape[1], width, group_size,
                                                                        expert_ids.shape[-1])  # fmt: skip


def _k_split(programs: int, total: int, block: int, device: torch.device, per_sm: int,
             cap: int | None = 8) -> tuple[int, int]:  # fmt: skip
    """(K splits, K a split in whole `block` steps) over `total` (inputs or words) for `programs` programs."""
    split = _split_k(programs, total, block, device, per_sm, cap=cap)
    per_split = triton.cdiv(triton.cdiv(total, split), block) * block
    return triton.cdiv(total, per_split), per_split


def _tiles_kernels(x, order, token, start, count, slot_expert, active, weights, gate_packed, gate_scale, up_packed,
                   up_scale, down_packed, down_scale, group_size, routed, precision, tuning):  # fmt: skip
    """The compressed-tensors layout's gate + up and down launches, into `routed` [pairs, hidden]."""
    pairs, hidden = routed.shape
    width, slots = gate_packed.shape[1], slot_expert.numel()
    block_m, block_kw = 16, max(tuning.gate_kw, group_size // 8)
    block_k, block_n = 8 * block_kw, tuning.gate_n
    tiles = triton.cdiv(width, block_n)
    split, k_per_split = _k_split(slots * tiles, hidden, block_k, x.device, tuning.programs_per_sm)
    part = torch.empty((split, pairs, 2 * width), dtype=torch.float32, device=x.device)
    _gate_up_kernel[(slots, tiles, split)](
        x, token, slot_expert, start, count, gate_packed, gate_scale, up_packed, up_scale, part, hidden, width,
        pairs, gate_packed.stride(0), gate_packed.stride(1), gate_scale.stride(0), gate_scale.stride(1),
        GROUP=group_size, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_KW=block_kw, K_PER_SPLIT=k_per_split,
        PRECISION=precision, num_warps=tuning.num_warps, num_stages=tuning.stages,
    )  # fmt: skip
    down_kw = max(group_size // 8, 2, min(tuning.down_kw, triton.next_power_of_2(triton.cdiv(width, 8))))
    down_n = tuning.down_n
    _down_kernel[(slots, triton.cdiv(hidden, down_n))](
        part, split, order, weights, slot_expert, start, count, down_packed, down_scale, routed, hidden, width,
        pairs, down_packed.stride(0), down_packed.stride(1), down_scale.stride(0), down_scale.stride(1),
        ACT_DTYPE=_TL_DTYPES[x.dtype], GROUP=group_size, BLOCK_M=block_m, BLOCK_N=down_n, BLOCK_KW=down_kw,
        PRECISION=precision, num_warps=tuning.num_warps, num_stages=tuning.stages,
    )  # fmt: skip


def _rows_kernels(x, order, token, start, count, slot_expert, active, weights, gate_packed, gate_scale, up_packed,
                  up_scale, down_packed, down_scale, group_size, routed, precision, tuning):  # fmt: skip
    """The rows layout's gate + up, act and down launches, into `routed` [pairs, hidden]."""
    pairs, hidden = routed.shape
    width, slots = gate_packed.shape[1], slot_expert.numel()
    use_asm = tuning.use_asm and x.dtype == torch.bfloat16 and x.is_cuda
    block_kw = 16
    tiles, words = triton.cdiv(width, tuning.gate_n), hidden // 8
    # the grid holds the K splits the fewest chosen experts would need (a token's k experts are distinct); the
    # kernels use as many as the experts chosen need (`_busy_splits`, on the device). A prefill's pairs (routed by
    # torch ops) choose nearly every expert: its grid and partial sums stay sized for all the slots
    fewest = min(slots, pairs // x.shape[0]) if pairs <= ROUTE_MAX_PAIRS else slots
    most, _ = _k_split(fewest * tiles, words, block_kw, x.device, tuning.programs_per_sm)
    if tuning.rows_split or not x.is_cuda:  # a fixed split (the interpreter: every split the grid holds)
        most = tuning.rows_split or most
        per_slot = most * slots
    else:
        per_slot = triton.cdiv(tuning.programs_per_sm * _sm_count(x.device), tiles)
    part = torch.empty((most, pairs, 2 * width), dtype=torch.float32, device=x.device)
    _gate_up_rows_kernel[(slots, tiles, most)](
        x, token, slot_expert, start, count, active, per_slot, gate_packed, gate_scale, up_packed, up_scale, part,
        hidden, width, pairs, gate_packed.stride(0), gate_packed.stride(1), gate_scale.stride(0), gate_scale.stride(1),
        GROUP=group_size, BLOCK_M=tuning.block_m, BLOCK_N=tuning.gate_n, BLOCK_KW=block_kw, PRECISION=precision,
        USE_ASM=use_asm, num_warps=tuning.num_warps, num_stages=tuning.stages,
    )  # fmt: skip
    act = torch.empty((pairs, width), dtype=x.dtype, device=x.device)
    _act_kernel[(pairs,)](part, active, per_slot, most, words, act, width, pairs,
                          BLOCK=min(1024, triton.next_power_of_2(width)), BLOCK_KW=block_kw)  # fmt: skip
    _down_rows_kernel[(slots, triton.cdiv(hidden, tuning.down_n))](
        act, order, weights, slot_expert, start, count, down_packed, down_scale, routed, hidden, width, pairs,
        down_packed.stride(0), down_packed.stride(1), down_scale.stride(0), down_scale.stride(1),
        ACT_DTYPE=_TL_DTYPES[x.dtype], GROUP=group_size, BLOCK_M=tuning.block_m, BLOCK_N=tuning.down_n,
        BLOCK_KW=block_kw, PRECISION=precision, USE_ASM=use_asm, num_warps=tuning.num_warps, num_stages=tuning.stages,
    )  # fmt: skip


_SPLIT_COUNTERS: dict[torch.device, torch.Tensor] = {}  # zeros the gate/up kernel leaves at zero again


def _split_counters(size: int, device: torch.device) -> torch.Tensor:
    """A zeroed int32 counter per (pair, rows) tile for the CUDA-core form's last-split reduction: kept a device and
    reused (each call leaves them at zero); grown outside a CUDA-graph capture, or made for the graph inside one."""
    have = _SPLIT_COUNTERS.get(device)
    if have is not None and have.numel() >= size:
        return have
    fresh = torch.zeros(max(size, 4096), dtype=torch.int32, device=device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return fresh  # allocated for this graph alone: not handed to callers outside it
    _SPLIT_COUNTERS[device] = fresh
    return fresh


def _rows_cuda_cores(x, expert_ids, expert_weights, gate_packed, gate_scale, up_packed, up_scale, down_packed,
                     down_scale, group_size, tuning):  # fmt: skip
    """The rows layout's CUDA-core form (few pairs an expert): gate + up + act (block, rows, K split), then down.
    One token: a block a pair, no routing sort, down for all of the token's experts at once, into [1, hidden] in x's
    dtype. More: the pairs sorted into blocks of up to `Tuning.cuda_core_block` pairs of one expert (`route_blocks`),
    down a block into its pairs' routed rows, summed over each token's k in a fixed order."""
    tokens, hidden = x.shape
    top_k = expert_ids.shape[-1]
    pairs, experts, width = expert_ids.numel(), gate_packed.shape[0], gate_packed.shape[1]
    ids = expert_ids.reshape(-1).contiguous()  # read as they come (int64 from top-k): no cast launch
    weights = expert_weights.reshape(-1).contiguous()
    use_asm = tuning.use_asm and x.is_cuda
    fma_scale = gate_scale.dtype == torch.bfloat16 and down_scale.dtype == torch.bfloat16  # `_LOP3_AT`
    routed_blocks = tokens > 1
    if not 1 <= tuning.cuda_core_block <= 4:  # the kernels hold a block's pairs in up to four sums of their own
        raise ValueError(f"Tuning.cuda_core_block must be 1 to 4 pairs: got {tuning.cuda_core_block}")
    block_m = tuning.cuda_core_block if routed_blocks else 1
    if routed_blocks:
        order, token, block_expert, block_first, block_pairs = route_blocks(expert_ids, experts, block_m)
        blocks = block_expert.numel()
    else:
        order = token = block_expert = block_first = block_pairs = ids  # not read
        blocks = pairs
    tiles = triton.cdiv(width, tuning.gemv_n)
    # a step is one group of one nibble; no cap on the splits here: the last one to finish sums them. The blocks
    # a batch fills are fewer than the grid's (at most one an expert chosen): the split counts them so.
    busy = min(blocks, experts) if routed_blocks else blocks
    split, kw_per_split = _k_split(busy * tiles, hidden // 8, group_size, x.device, tuning.gemv_per_sm, cap=None)
    part = torch.empty((split, pairs, 2 * width), dtype=torch.float32, device=x.device)
    counters = _split_counters(blocks * tiles, x.device)
    act = torch.empty((pairs, width), dtype=x.dtype, device=x.device)
    _gate_up_cc_kernel[(blocks, tiles, split)](
        x, ids, token, block_expert, block_first, block_pairs, gate_packed, gate_scale, up_packed, up_scale, part,
        counters, act, pairs, gate_packed.stride(0), gate_packed.stride(1), gate_scale.stride(0), gate_scale.stride(1),
        HIDDEN=hidden, WIDTH=width, TOP_K=top_k, GROUP=group_size, BLOCK_N=tuning.gemv_n, KW_PER_SPLIT=kw_per_split,
        BLOCK_M=block_m, ROUTED=routed_blocks, USE_ASM=use_asm, FMA_SCALE=fma_scale, num_warps=tuning.gemv_warps,
    )  # fmt: skip
    strides = (down_packed.stride(0), down_packed.stride(1), down_scale.stride(0), down_scale.stride(1))
    if not routed_blocks:
        result = torch.empty_like(x)
        _down_token_kernel[(tokens, triton.cdiv(hidden, tuning.gemv_down_n))](
            act, ids, weights, down_packed, down_scale, result, *strides, HIDDEN=hidden, WIDTH=width, TOP_K=top_k,
            K_PAD=triton.next_power_of_2(top_k), GROUP=group_size, BLOCK_N=tuning.gemv_down_n, USE_ASM=use_asm,
            FMA_SCALE=fma_scale, num_warps=tuning.gemv_warps,
        )  # fmt: skip
        return result
    routed = torch.empty((pairs, hidden), dtype=torch.float32, device=x.device)
    _down_cc_kernel[(blocks, triton.cdiv(hidden, tuning.cuda_core_down_n))](
        act, order, weights, block_expert, block_first, block_pairs, down_packed, down_scale, routed, *strides,
        HIDDEN=hidden, WIDTH=width, GROUP=group_size, BLOCK_N=tuning.cuda_core_down_n, BLOCK_M=block_m, USE_ASM=use_asm,
        FMA_SCALE=fma_scale, num_warps=tuning.gemv_warps,
    )  # fmt: skip
    return routed.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)


# layout name -> the launches of its kernels
LAYOUTS = {"compressed-tensors": _tiles_kernels, "rows": _rows_kernels}


class Int4MoEKernel:
    """`ModelOps.int4_moe` on a GPU: `int4_moe_cuda`, plus `prepare_experts`, which a `PackedMoE` calls once after
    loading to put its experts in the layout this kernel runs fastest."""

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        return int4_moe_cuda(*args, **kwargs)

    def __eq__(self, other) -> bool:  # stateless: every instance is the same form (ranks built are keyed by forms)
        return type(other) is type(self)

    def __hash__(self) -> int:
        return hash(type(self))

    @staticmethod
    def prepare_experts(gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, group_size: int):
        """The packed words of gate, up, down [E, out, in / 8] -> (the same tensors, the layout they now hold):
        reordered in place into "rows" where `rows_layout_fits`, else left in the checkpoint's own order."""
        hidden, width = gate.shape[-1] * 8, gate.shape[-2]
        if not rows_layout_fits(hidden, width, group_size):
            return (gate, up, down), "compressed-tensors"
        return tuple(repack_rows(t, in_place=True) for t in (gate, up, down)), "rows"

    @staticmethod
    def prepared(experts, group_size: int) -> tuple[list[torch.Tensor], str]:
        """The op's six expert arguments (gate, up, down: packed words then scales each, the checkpoint's) as this
        kernel runs them, its words reordered on copies (`experts` unchanged), and the layout's name."""
        words, layout = Int4MoEKernel.prepare_experts(*(experts[i].clone() for i in (0, 2, 4)), group_size)
        return [words[0], experts[1], words[1], experts[3], words[2], experts[5]], layout
