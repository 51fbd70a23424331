"""Weight GEMMs at few rows on one GPU: cuBLAS (`F.linear`) against a Triton form (`linear_rows` below: a program a
block of weight rows and K split, float32 partials summed in split order) over its launch shapes, at the weight
shapes of one Kimi K2.x TP-8 rank (bf16), T = 1, 8 and 16 rows.

    PYTHONPATH=. python3 benchmarks/linear_rows_probe.py OUT_DIR

Every shape is checked against F.linear first (relative error of the largest difference). Times: CUDA-graph replays,
L2 flushed between them (do_bench, median); the floor reads the weight once at the copy rate measured in the same
run. Writes OUT_DIR/linear_rows_probe.json.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from benchmarks.common import environment, graph_time_us, measure_ceilings


@triton.jit
def _linear_rows(x_ptr, w_ptr, out_ptr, part_ptr, rows, n, k, x_stride, out_stride, split_k, BLOCK_T: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """Program (block of BLOCK_N weight rows, K split): the rows' dot products with every x row, float32 sums on
    tensor cores; one split writes y in x's dtype, several write float32 partials [split, T, N] for `_sum_splits`."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    offs_t = tl.arange(0, BLOCK_T)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok, n_ok = offs_t < rows, offs_n < n
    acc = tl.zeros([BLOCK_T, BLOCK_N], dtype=tl.float32)
    start = pid_k * split_k
    for k0 in tl.range(start, start + split_k, BLOCK_K, num_stages=STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < k
        w = tl.load(w_ptr + offs_n[:, None] * k + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptr + offs_t[:, None] * x_stride + offs_k[None, :], mask=t_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    ok = t_ok[:, None] & n_ok[None, :]
    if SPLIT:
        tl.store(part_ptr + (pid_k * rows + offs_t[:, None]) * n + offs_n[None, :], acc, mask=ok)
    else:
        tl.store(out_ptr + offs_t[:, None] * out_stride + offs_n[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sum_splits(part_ptr, out_ptr, splits, rows, n, out_stride, BLOCK: tl.constexpr):
    """y[t, cols] = the splits' partial sums added in split order, rounded once to y's dtype."""
    t, pid = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(part_ptr + (s * rows + t) * n + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * out_stride + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


LINEAR_ROWS_MAX = 16


def linear_rows(x: torch.Tensor, weight: torch.Tensor, block_n: int = 16, block_k: int = 256, splits: int | None = None,
                stages: int = 4, warps: int = 4) -> torch.Tensor:  # fmt: skip
    """x [T <= LINEAR_ROWS_MAX, K] @ weight [N, K]^T -> [T, N] in x's dtype (bf16 / fp16; float32 sums). K is split
    so that about two programs an SM stream the weights (`splits`: a fixed split)."""
    rows, k = x.shape
    n = weight.shape[0]
    if rows > LINEAR_ROWS_MAX or weight.shape[1] != k or weight.stride(-1) != 1 or weight.stride(0) != k:
        raise ValueError(f"linear_rows takes x [<= {LINEAR_ROWS_MAX}, K] and a contiguous weight [N, K], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)} strides {weight.stride()}")  # fmt: skip
    x = x if x.stride(-1) == 1 else x.contiguous()
    blocks = triton.cdiv(n, block_n)
    chunks = triton.cdiv(k, block_k)
    if splits is None:
        sms = torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 8
        splits = max(1, min(chunks, 2 * sms // blocks))
    split_k = triton.cdiv(chunks, splits) * block_k
    splits = triton.cdiv(k, split_k)
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    part = torch.empty(splits, rows, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    _linear_rows[(blocks, splits)](x, weight, out, part, rows, n, k, x.stride(0), out.stride(0), split_k,
                                   BLOCK_T=16, BLOCK_N=block_n, BLOCK_K=block_k, SPLIT=splits > 1, STAGES=stages,
                                   num_warps=warps)  # fmt: skip
    if splits > 1:
        _sum_splits[(rows, triton.cdiv(n, 1024))](part, out, splits, rows, n, out.stride(0), BLOCK=1024, num_warps=4)
    return out


# (name, N, K) of one rank's weights: MLA's fused q_a + kv_a, q_b, o_proj; the shared expert's gate + up and down;
# the dense first layer's gate + up and down; the vocab-parallel head's shard
SHAPES = [("q_a+kv_a", 2112, 7168), ("q_b", 1536, 1536), ("o_proj", 7168, 1024), ("shared gate+up", 512, 7168),
          ("shared down", 7168, 256), ("dense gate+up", 4608, 7168), ("dense down", 7168, 2304),
          ("head shard", 20480, 7168)]  # fmt: skip
LAUNCHES = list(itertools.product((16, 32, 64), (128, 256), (3, 5)))  # block_n, block_k, stages


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device("cuda")
    ceilings = measure_ceilings(False)
    info = {**environment(False), "command": " ".join(sys.argv), **ceilings, "rows": []}
    gen = torch.Generator(device=device).manual_seed(0)
    for (name, n, k), rows in itertools.product(SHAPES, (1, 8, 16)):
        weight = (torch.randn(n, k, generator=gen, device=device) * k**-0.5).to(torch.bfloat16)
        x = torch.randn(rows, k, generator=gen, device=device).to(torch.bfloat16)
        want = F.linear(x, weight)
        cublas = graph_time_us(lambda w=weight, a=x: F.linear(a, w), device, False)
        row = {"name": name, "n": n, "k": k, "rows": rows, "floor_us": n * k * 2 / ceilings["copy_Bps"] * 1e6,
               "cublas_us": cublas, "launches": []}  # fmt: skip
        for block_n, block_k, stages in LAUNCHES:
            got = linear_rows(x, weight, block_n=block_n, block_k=block_k, stages=stages)
            error = float((got.float() - want.float()).abs().max() / want.float().abs().max())
            launch = dict(block_n=block_n, block_k=block_k, stages=stages)
            us = graph_time_us(lambda w=weight, a=x, b=launch: linear_rows(a, w, **b), device, False)
            row["launches"].append({"block_n": block_n, "block_k": block_k, "stages": stages, "us": us,
                                    "error": error})  # fmt: skip
        best = min(row["launches"], key=lambda r: r["us"])
        default = next(r for r in row["launches"] if (r["block_n"], r["block_k"], r["stages"]) == (16, 256, 3))
        row["best"], row["default"] = best, default
        info["rows"].append(row)
        worst = max(r["error"] for r in row["launches"])
        print(f"{name:15s} {n:6d} x {k:5d} T={rows:2d}  floor {row['floor_us']:6.1f}  cuBLAS {cublas:6.1f}  best "
              f"{best['us']:6.1f} ({best['block_n']}, {best['block_k']}, {best['stages']})  default "
              f"{default['us']:6.1f}  worst error {worst:.1e}", flush=True)  # fmt: skip
        (args.out_dir / "linear_rows_probe.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
