"""Weight GEMMs at few rows on one GPU: cuBLAS (`F.linear`) against `models.triton_ops.linear_rows` over its launch
shapes, at the weight shapes of one Kimi K2.x TP-8 rank (bf16), T = 1, 8 and 16 rows.

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

from benchmarks.common import environment, graph_time_us, measure_ceilings
from models.triton_ops import linear_rows

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
