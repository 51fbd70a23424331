"""The rows layout's tensor-core form against its CUDA-core form when a block's tokens share experts, at Kimi K2.x
per-rank TP-8 dimensions on one GPU: the K split the chosen experts need (the default: `_busy_splits`, on the
device) against fixed splits of 1, 2, 4 and 8 (`Tuning.rows_split`), T = 9 .. 64, random, skewed and pooled routing
(`benchmarks/int4_moe_gpu.py`).

    python benchmarks/int4_busy_probe.py OUT_DIR

Each form's relative error against the float32 torch reference is recorded beside its time (median of CUDA-graph
replays); the INT4 byte floor of the distinct experts at the copy rate measured in the same run.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, graph_time_us  # noqa: E402
from benchmarks.int4_moe_gpu import GROUP, routing, rows_probe_setup  # noqa: E402
from plugins.int4_moe.kernel import DEFAULT_TUNING, int4_moe_cuda  # noqa: E402
from plugins.int4_moe.reference import int4_moe  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--tokens", default="9,17,33,64")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.bfloat16
    config, tensors, rows, expert_bytes, ceilings = rows_probe_setup(device, dtype)
    experts, hidden, k = config.n_routed_experts, config.hidden_size, config.num_experts_per_tok
    forms = {f"tensor_cores_split_{b or 'needed'}": dataclasses.replace(DEFAULT_TUNING, gemv_tokens=0, rows_split=b)
             for b in (None, 1, 2, 4, 8)}  # fmt: skip
    forms["cuda_cores"] = dataclasses.replace(DEFAULT_TUNING, gemv_tokens=10**9)
    table = []
    for kind in ("random", "skewed", "pooled"):
        for tokens in (int(t) for t in args.tokens.split(",")):
            g = torch.Generator().manual_seed(1000 + tokens)
            ids, weights = routing(kind, tokens, experts, k, g)
            x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
            ids, weights = ids.to(device), weights.to(device)
            want = int4_moe(x.float(), ids, weights, *[t if t.dtype == torch.int32 else t.float() for t in tensors],
                            GROUP)  # fmt: skip
            distinct = int(ids.unique().numel())
            row = {"routing": kind, "tokens": tokens, "distinct": distinct,
                   "floor_us": distinct * expert_bytes / ceilings["copy_Bps"] * 1e6}  # fmt: skip
            for name, tuning in forms.items():
                run = functools.partial(int4_moe_cuda, x, ids, weights, *rows, GROUP, tuning=tuning, layout="rows")
                got = run().float()
                row[f"{name}_err"] = float((got - want).norm() / want.norm())
                row[f"{name}_us"] = graph_time_us(run, device, False)
            table.append(row)
            print(json.dumps(row), flush=True)
    result = {"environment": environment(False), "ceilings": ceilings, "table": table}
    (args.out_dir / "int4_busy_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
