"""One CUDA-core-form call of the W4A16 MoE kernel at Kimi K2.x per-rank TP-8 dimensions, T tokens, random routing,
for Nsight Compute: `ncu --clock-control none -k regex:_cc_|_down_token python benchmarks/int4_gemv_ncu.py [T]`."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.int4_moe_gpu import GROUP, make_weights, rank_config, routing  # noqa: E402
from plugins.int4_moe.kernel import int4_moe_cuda, repack_rows  # noqa: E402

if __name__ == "__main__":
    tokens = int(sys.argv[1]) if len(sys.argv) > 1 else 1
    config = rank_config(False)
    tensors, _, _, _ = make_weights(config, "cuda", torch.bfloat16, torch.Generator().manual_seed(0))
    tensors = [repack_rows(t) if t.dtype == torch.int32 else t for t in tensors]
    ids, weights = routing("random", tokens, config.n_routed_experts, config.num_experts_per_tok, torch.Generator())
    x = torch.randn(tokens, config.hidden_size, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        int4_moe_cuda(x, ids.cuda(), weights.cuda(), *tensors, GROUP, layout="rows")
    torch.cuda.synchronize()
