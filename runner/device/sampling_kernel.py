"""The device sampler's draw (`runner/device/sampling.py`: argmax of the scores plus Gumbel noise hashed from
(seed, counter, row, token id)) as one Triton kernel, for CUDA tensors.

As tensor ops the draw is ~75 kernels (the 32-bit hash emulated in int64 halves, four rounds of it, then the noise,
the sum and the argmax over [rows, vocabulary]); inside a step graph each costs a few microseconds even at a
20k-token vocabulary shard, and at a full 164k-token vocabulary each one moves [rows, 164k] int64 through memory.
Here program (row, column block) hashes its block in registers with native 32-bit unsigned arithmetic (the same
bits as the int64 emulation), adds the noise to the scores and keeps the block's best (value, column); a torch
argmax over the blocks' bests picks the row's token (ties go to the lower column, as torch's argmax does).
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
def _gumbel_max_kernel(scores_ptr, stride, seed_ptr, counter_ptr, best_ptr, column_ptr, columns, blocks,
                       BLOCK: tl.constexpr):  # fmt: skip
    row, block = tl.program_id(0), tl.program_id(1)
    one = tl.arange(0, 1)
    seed = tl.load(seed_ptr + one).to(tl.uint32)  # [1]: the request's 32-bit seed, the step's draw counter
    counter = tl.load(counter_ptr + one).to(tl.uint32)
    key = _mix32(_mix32(_mix32(seed) ^ counter) ^ row.to(tl.uint32))
    cols = block * BLOCK + tl.arange(0, BLOCK)
    ok = cols < columns
    scores = tl.load(scores_ptr + row * stride + cols, mask=ok, other=float("-inf")).to(tl.float32)
    bits = _mix32(key ^ cols.to(tl.uint32))
    uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # `sampling.bits_to_uniform`
    noisy = tl.where(ok, scores - tl.log(-tl.log(uniform)), float("-inf"))
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
