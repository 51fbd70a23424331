"""The W4A16 MoE kernel's CUDA-core form (`_gate_up_cc_kernel`, `_down_cc_kernel`, `_down_token_kernel`: each
block's expert rows streamed once, a group at a time, for the block's up to `Tuning.cuda_core_block` pairs) against
its tensor-core form on the same "rows" layout, at Kimi K2.x per-rank TP-8 dimensions on one GPU.

    python benchmarks/int4_gemv_probe.py OUT_DIR [--budget-s 150]

Every launch shape is checked against the float32 torch reference first (relative error < 1e-2), then timed
(random routing, median of CUDA-graph replays) at T = 1 and 33; the best shape is then timed at T = 1 .. 64 beside
the tensor-core form, for random, skewed (Zipf) and pooled routing (each token's experts drawn from one pool of
2 k experts: a verify block whose tokens share experts, as inside a model). The smallest T where the tensor-core
form wins is what `Tuning.gemv_tokens` should stay below. Registers and spills are read from the compiled kernels;
a torch.profiler table at T = 1 and 33 splits the time.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, graph_time_us  # noqa: E402
from benchmarks.int4_moe_gpu import GROUP, routing, rows_probe_setup  # noqa: E402
from benchmarks.int4_rows_probe import compiled_stats, profile  # noqa: E402
from plugins.int4_moe.kernel import DEFAULT_TUNING, Tuning, int4_moe_cuda  # noqa: E402
from plugins.int4_moe.reference import int4_moe  # noqa: E402

CUDA_CORES, TENSOR_CORES = 10**9, 0  # gemv_tokens that force one form or the other


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--budget-s", type=float, default=150.0, help="stop sweeping after this long")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.bfloat16
    config, tensors, rows_tensors, expert_bytes, ceilings = rows_probe_setup(device, dtype)
    experts, hidden, k = config.n_routed_experts, config.hidden_size, config.num_experts_per_tok
    log = open(args.out_dir / "int4_gemv_probe.log", "w")

    def emit(row):
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    def case(kind, tokens, seed):
        g = torch.Generator().manual_seed(seed)
        ids, weights = routing(kind, tokens, experts, k, g)
        x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
        want = int4_moe(x.float(), ids.to(device), weights.to(device),
                        *[t if t.dtype == torch.int32 else t.float() for t in tensors], GROUP)  # fmt: skip
        return x, ids.to(device), weights.to(device), want

    def run(c, tuning):
        return int4_moe_cuda(c[0], c[1], c[2], *rows_tensors, GROUP, tuning=tuning, layout="rows")

    def error(c, tuning):
        got = run(c, tuning).float()
        return float((got - c[3]).norm() / c[3].norm())

    cases = {t: case("random", t, 100 + t) for t in (1, 33)}
    base = dataclasses.replace(DEFAULT_TUNING, gemv_tokens=CUDA_CORES)
    grid = [dataclasses.replace(base, gemv_n=n, cuda_core_block=m, cuda_core_down_n=d)
            for n, m, d in itertools.product((16, 32), (1, 2, 4), (32, 64, 128))]  # fmt: skip
    grid.sort(key=lambda t: (t.gemv_n, t.cuda_core_block, t.cuda_core_down_n))
    results, t0 = [], time.time()
    for tuning in [base] + grid:
        if time.time() - t0 > args.budget_s:
            emit({"stopped": "budget", "left": len(grid) - len(results) + 1})
            break
        try:
            errs = {t: error(c, tuning) for t, c in cases.items()}
            times = {t: graph_time_us(lambda c=c, u=tuning: run(c, u), device, False) for t, c in cases.items()}
        except Exception as err:  # noqa: BLE001 - a shape that does not compile is reported, the sweep goes on
            emit({**vars(tuning), "failed": f"{type(err).__name__}: {str(err)[:300]}"})
            continue
        row = {**vars(tuning), "err_T1": errs[1], "err_T33": errs[33], "T1_us": times[1], "T33_us": times[33],
               "geomean_us": math.sqrt(times[1] * times[33])}  # fmt: skip
        results.append(row)
        emit(row)
    good = [r for r in results if max(r["err_T1"], r["err_T33"]) < 1e-2]
    table = []
    if good:
        best = min(good, key=lambda r: r["geomean_us"])
        best_tuning = Tuning(**{f: best[f] for f in vars(DEFAULT_TUNING)})
        emit({"best": vars(best_tuning)})
        mma = dataclasses.replace(best_tuning, gemv_tokens=TENSOR_CORES)
        for tokens in (1, 33):
            profile(lambda c=cases[tokens]: run(c, best_tuning), args.out_dir / f"gemv_profile_T{tokens}.txt")
        for kind in ("random", "skewed", "pooled"):
            for tokens in (1, 2, 4, 8, 9, 16, 17, 33, 64):
                c = case(kind, tokens, 1000 + tokens)
                distinct = int(c[1].unique().numel())
                floor_us = distinct * expert_bytes / ceilings["copy_Bps"] * 1e6
                row = {"routing": kind, "tokens": tokens, "pairs": tokens * k, "distinct": distinct,
                       "floor_us": floor_us}  # fmt: skip
                for name, tuning in (("cuda_cores", best_tuning), ("tensor_cores", mma)):
                    row[f"{name}_err"] = error(c, tuning)
                    row[f"{name}_us"] = graph_time_us(lambda c=c, t=tuning: run(c, t), device, False)
                    row[f"{name}_over_floor"] = row[f"{name}_us"] / floor_us
                table.append(row)
                emit(row)
    result = {"environment": environment(False), "ceilings": ceilings, "sweep": results, "table": table,
              "compiled": compiled_stats()}  # fmt: skip
    (args.out_dir / "int4_gemv_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
