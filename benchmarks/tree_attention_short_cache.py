"""TreeAttention split policy across cache lengths, T = 1 and 33 tokens x 8 heads (one Kimi TP-8 rank), bf16: median
CUDA-graph replay time (split + combine kernels) per (block_m, min_blocks), the default configuration, and, given a
second kernel module, the same calls with that one (a before/after in one run). The engines' capacity is what the
grid is sized from; the length is what the cache holds (the end-to-end benchmark's engines: 64..320 rows of 1024).

    PYTHONPATH=. python3 benchmarks/tree_attention_short_cache.py OUT_DIR [--baseline=path/to/kernel.py]  (a GPU)

Prints one line per measurement and writes OUT_DIR/tree_attention_short_cache.json.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

import torch
import triton.testing as tt

from plugins.tree_attention import kernel
from plugins.tree_attention.reference import tree_attention

# (capacity, length)
CASES = [(1024, 64), (1024, 320), (1024, 1000), (8192, 4096), (16384, 16384), (32768, 32768), (131072, 320)]
CONFIGS = [dict(block_m=block_m, block_n=64, num_warps=4 if block_m < 64 else 8, num_stages=2) for block_m in (16, 64)]


def load_baseline(path: str):
    spec = importlib.util.spec_from_file_location("baseline_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def time_us(fn, args, **config) -> float:
    return tt.do_bench_cudagraph(lambda: fn(*args, 0.1, 512, **config)) * 1e3


def main() -> int:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    baseline_path = next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--baseline=")), None)
    baseline = load_baseline(baseline_path) if baseline_path else None
    device, bf16 = "cuda", torch.bfloat16
    rows, worst = [], 0.0
    for tokens in (1, 33):
        for capacity, length in CASES:
            gen = torch.Generator().manual_seed(tokens + length)
            q = torch.randn(tokens, 8, 576, generator=gen).to(device, bf16)
            cache = torch.randn(capacity, 576, generator=gen).to(device, bf16)
            new_kv = torch.randn(tokens, 576, generator=gen).to(device, bf16)
            mask = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
            args = (q, cache, torch.tensor([length], device=device), new_kv, mask)
            expected = tree_attention(q.double(), cache.double(), args[2], new_kv.double(), mask, 0.1, 512)
            got = kernel.tree_attention_cuda(*args, 0.1, 512)
            worst = max(worst, float((got.double() - expected).norm() / expected.norm()))
            row = {
                "T": tokens,
                "capacity": capacity,
                "length": length,
                "default_us": time_us(kernel.tree_attention_cuda, args),
            }
            if baseline is not None:
                row["baseline_us"] = time_us(baseline.tree_attention_cuda, args)
            for config in CONFIGS:
                for min_blocks in (1, 2, 4):
                    name = f"m{config['block_m']}_b{min_blocks}"
                    row[name] = time_us(kernel.tree_attention_cuda, args, **config, min_blocks=min_blocks)
            rows.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    result = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d"),
        "worst_rel_error_default": worst,
        "rows": rows,
    }
    (out_dir / "tree_attention_short_cache.json").write_text(json.dumps(result, indent=1))
    print("worst relative error of the default configuration vs the float64 reference:", worst)
    return 0 if worst < 1e-2 else 1


if __name__ == "__main__":
    sys.exit(main())
