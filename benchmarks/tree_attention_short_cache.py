"""TreeAttention tile choices at a short cache (what the end-to-end benchmark's engines see: 320 cached rows of a
1024-row capacity), T = 1 and 33 tokens x 8 heads, bf16: median CUDA-graph replay time per (block_m, min_blocks).

    PYTHONPATH=. python3 benchmarks/tree_attention_short_cache.py > OUT/sweep.log     (on a GPU)
"""

import torch
import triton.testing as tt

from plugins.tree_attention.kernel import tree_attention_cuda


def time_us(args, **config) -> float:
    return tt.do_bench_cudagraph(lambda: tree_attention_cuda(*args, 0.1, 512, **config)) * 1e3


def main() -> None:
    device, bf16 = "cuda", torch.bfloat16
    for tokens in (1, 33):
        q = torch.randn(tokens, 8, 576, device=device, dtype=bf16)
        cache = torch.randn(1024, 576, device=device, dtype=bf16)
        new_kv = torch.randn(tokens, 576, device=device, dtype=bf16)
        mask = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        args = (q, cache, torch.tensor([320], device=device), new_kv, mask)
        print(tokens, "default", round(time_us(args), 1))
        for block_m in (16, 32, 64):
            for min_blocks in (1, 2, 4, 8, 16):
                config = dict(block_m=block_m, block_n=64 if block_m < 64 else 32, num_warps=4 if block_m < 64 else 8,
                              num_stages=2, min_blocks=min_blocks)  # fmt: skip
                print(tokens, block_m, min_blocks, round(time_us(args, **config), 1))


if __name__ == "__main__":
    main()
