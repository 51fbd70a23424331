"""The device sampler's draw (`runner/device/sampling.py`: argmax of the scores plus Gumbel noise hashed from
(seed, counter, row, token id)) as one Triton kernel, for CUDA tensors.

As tensor ops the draw is ~75 kernels (the 32-bit hash emulated in int64 halves, four rounds of it, then the noise,
the sum and the argmax over [rows, vocabulary]); inside a step graph each costs a few microseconds even at a
20k-token vocabulary shard, and at a full 164k-token vocabulary each one moves [rows, 164k] int64 through memory.
Here program (row, column block) hashes its block in registers with native 32-bit unsigned arithmetic (the same
bits as the int64 emulation), adds the noise to the scores and keeps the block's best (value, column); a torch
argmax over the blocks' bests picks the row's token (ties go to the lower column, as torch's argmax does).

Top-p without top-k (`nucleus_argmax_kernel`) does not sort the vocabulary: the draw is argmax over the nucleus of
(score + the same noise), and the nucleus is every token whose strictly more probable tokens hold less than top_p of
the mass. The unrestricted draw j is found first; if the mass above j is under top_p it is the nucleus's draw too
(the nucleus is a subset holding j). Otherwise j and every token at most as probable as j lie outside the nucleus, so
the argmax is taken again over the strictly more probable tokens, until it lands inside: the result is exactly the
argmax over the nucleus, the token the sort-based filter then the draw give (tokens tied in score at the nucleus's
edge are all kept here, where a sort keeps some of them). The first round and the masses run on (row, column block)
programs; the rare further rounds in one program per row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # columns a program hashes


@triton.jit
def _mix32(x):
    """`sampling._mix32` ("lowbias32") on uint32 values: multiplications wrap modulo 2^32 natively."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def _row_key(seed_ptr, counter_ptr, row):
    """[1]: the hash of (the request's 32-bit seed, the step's draw counter, the row)."""
    one = tl.arange(0, 1)
    seed = tl.load(seed_ptr + one).to(tl.uint32)
    counter = tl.load(counter_ptr + one).to(tl.uint32)
    return _mix32(_mix32(_mix32(seed) ^ counter) ^ row.to(tl.uint32))  # [1]


@triton.jit
def _noisy(scores, key, cols):
    """scores - log(-log(u)), u the hash of (row key, column) as `sampling.bits_to_uniform` makes it."""
    bits = _mix32(key ^ cols.to(tl.uint32))
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
    return scores - tl.log(-tl.log(uniform))


@triton.jit
def _gumbel_max_kernel(scores_ptr, stride, seed_ptr, counter_ptr, best_ptr, column_ptr, columns, blocks,
                       BLOCK: tl.constexpr):  # fmt: skip
    row, block = tl.program_id(0), tl.program_id(1)
    key = _row_key(seed_ptr, counter_ptr, row)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < columns
    scores = tl.load(scores_ptr + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
    noisy = tl.where(ok, _noisy(scores, key, cols), float("-inf"))
    best, at = tl.max(noisy, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(best_ptr + row * blocks + block, best)
    tl.store(column_ptr + row * blocks + block, (block * BLOCK + at).to(tl.int64))


def gumbel_argmax_kernel(scores: torch.Tensor, seed: torch.Tensor, counter: torch.Tensor) -> torch.Tensor:
    """[R, V] float scores -> [R] int64: argmax(scores - log(-log(u))) with u = `sampling.counter_uniform`."""
    rows, columns = scores.shape
    blocks = triton.cdiv(columns, BLOCK)
    best = torch.empty((rows, blocks), dtype=torch.float32, device=scores.device)
    column = torch.empty((rows, blocks), dtype=torch.int64, device=scores.device)
    _gumbel_max_kernel[(rows, blocks)](scores, scores.stride(0), seed, counter, best, column, columns, blocks,
                                       BLOCK=BLOCK, num_warps=8)  # fmt: skip
    return column.gather(1, best.argmax(dim=1, keepdim=True)).squeeze(1)


@triton.jit
def _block_mass(scores_ptr, stride, chosen_ptr, max_ptr, sum_ptr, above_ptr, columns, blocks, BLOCK: tl.constexpr):
    """Program (row, block): the block's max score, its sum of exp(score - that max), and the same sum over the
    scores strictly above the chosen token's, taken against the block's max too (the merge rescales them)."""
    row, block = tl.program_id(0), tl.program_id(1)
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < columns
    scores = tl.load(scores_ptr + row * stride + cols, mask=ok, other=float("-inf"))
    pivot = tl.load(scores_ptr + row * stride + tl.load(chosen_ptr + row))
    top = tl.max(scores, axis=0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.where(ok, tl.exp(scores - safe), 0.0)
    at = row * blocks + block
    tl.store(max_ptr + at, top)
    tl.store(sum_ptr + at, tl.sum(weight, axis=0))
    tl.store(above_ptr + at, tl.sum(tl.where(scores > pivot, weight, 0.0), axis=0))


@triton.jit
def _nucleus_rounds(scores_ptr, stride, seed_ptr, counter_ptr, top_p_ptr, chosen_ptr, max_ptr, sum_ptr, above_ptr,
                    out_ptr, columns, blocks, BLOCK: tl.constexpr, BLOCKS: tl.constexpr):  # fmt: skip
    """Program (row): merges the block masses; while the chosen token's mass above is top_p or more, the argmax of
    the noisy scores over the strictly more probable tokens is chosen instead (one pass), and its mass above
    measured (another)."""
    row = tl.program_id(0)
    b = tl.arange(0, BLOCKS)
    b_ok = b < blocks
    tops = tl.load(max_ptr + row * blocks + b, mask=b_ok, other=float("-inf"))
    top = tl.max(tops, axis=0)
    scale = tl.where(b_ok & (tops > float("-inf")), tl.exp(tops - top), 0.0)
    total = tl.sum(tl.load(sum_ptr + row * blocks + b, mask=b_ok, other=0.0) * scale, axis=0)
    above = tl.sum(tl.load(above_ptr + row * blocks + b, mask=b_ok, other=0.0) * scale, axis=0)
    limit = tl.sum(tl.load(top_p_ptr + tl.arange(0, 1)), axis=0) * total
    chosen = tl.load(chosen_ptr + row)
    key = _row_key(seed_ptr, counter_ptr, row)
    offs = tl.arange(0, BLOCK)
    # ends: the most probable token has nothing above it (limit > 0: a row of -inf scores has no mass to split and
    # keeps its first draw instead of looping)
    while (above >= limit) & (limit > 0):
        pivot = tl.load(scores_ptr + row * stride + chosen)
        best, best_col = float("-inf"), chosen
        for start in range(0, columns, BLOCK):
            cols = start + offs
            ok = cols < columns
            scores = tl.load(scores_ptr + row * stride + cols, mask=ok, other=float("-inf"))
            noisy = tl.where(ok & (scores > pivot), _noisy(scores, key, cols), float("-inf"))
            value, at = tl.max(noisy, axis=0, return_indices=True, return_indices_tie_break_left=True)
            better = value > best
            best_col = tl.where(better, start + at, best_col)
            best = tl.where(better, value, best)
        chosen = best_col
        pivot = tl.load(scores_ptr + row * stride + chosen)
        above = 0.0
        for start in range(0, columns, BLOCK):
            cols = start + offs
            scores = tl.load(scores_ptr + row * stride + cols, mask=cols < columns, other=float("-inf"))
            above += tl.sum(tl.where(scores > pivot, tl.exp(scores - top), 0.0), axis=0)
    tl.store(out_ptr + row, chosen.to(tl.int64))


def nucleus_argmax_kernel(scores: torch.Tensor, top_p: torch.Tensor, seed: torch.Tensor,
                          counter: torch.Tensor) -> torch.Tensor:  # fmt: skip
    """[R, V] float32 scores (logits / temperature) -> [R] int64: the Gumbel-max draw (`gumbel_argmax_kernel`'s
    noise) over each row's top-p nucleus; top_p a float tensor [1]."""
    rows, columns = scores.shape
    blocks = triton.cdiv(columns, BLOCK)
    chosen = gumbel_argmax_kernel(scores, seed, counter)
    block_max, block_sum, block_above = (torch.empty((rows, blocks), dtype=torch.float32, device=scores.device)
                                         for _ in range(3))  # fmt: skip
    _block_mass[(rows, blocks)](scores, scores.stride(0), chosen, block_max, block_sum, block_above, columns, blocks,
                                BLOCK=BLOCK, num_warps=8)  # fmt: skip
    out = torch.empty(rows, dtype=torch.int64, device=scores.device)
    _nucleus_rounds[(rows,)](scores, scores.stride(0), seed, counter, top_p, chosen, block_max, block_sum,
                             block_above, out, columns, blocks, BLOCK=BLOCK,
                             BLOCKS=max(2, triton.next_power_of_2(blocks)), num_warps=8)  # fmt: skip
    return out
