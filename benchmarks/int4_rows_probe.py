"""The W4A16 MoE kernel's "rows" form (weight rows on the MMA's M side, dequantized words the dot's register
operand, optional lop3 unpack) against the "tiles" form, at Kimi K2.x per-rank TP-8 dimensions on one GPU.

    python benchmarks/int4_rows_probe.py OUT_DIR [--budget-s 300]

Each launch shape is checked against the torch reference first (relative error < 1e-2), then timed at T = 1 and 33
(random routing, median of CUDA-graph replays); the best rows shape is then timed at T = 1 .. 2048 next to the tiles
form, random and skewed routing. Registers, spills and the instructions that show shared-memory staging are read
from the compiled kernels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, graph_time_us, measure_ceilings  # noqa: E402
from benchmarks.int4_moe_gpu import GROUP, make_weights, packed_expert_bytes, rank_config, routing  # noqa: E402
from plugins.int4_moe import kernel  # noqa: E402
from plugins.int4_moe.kernel import DEFAULT_TUNING, Tuning, int4_moe_cuda, repack_rows  # noqa: E402
from plugins.int4_moe.reference import int4_moe  # noqa: E402


def compiled_stats() -> dict:
    """Registers, spills and PTX instruction counts of every compiled rows/tiles kernel so far."""
    stats = {}
    names = ("_gate_up_rows_kernel", "_down_rows_kernel", "_gate_up_kernel", "_down_kernel", "_gate_up_cc_kernel",
             "_down_cc_kernel", "_down_token_kernel")  # fmt: skip
    for name in names:
        fn = getattr(kernel, name)
        try:
            caches = fn.device_caches
        except AttributeError:
            continue
        for _, entry in caches.items():
            for key, compiled in entry[0].items():
                ptx = compiled.asm.get("ptx", "")
                stats.setdefault(name, []).append({
                    "key": str(key)[-160:], "regs": compiled.n_regs, "spills": compiled.n_spills,
                    **{op: ptx.count(op) for op in ("wgmma.mma_async", "mma.sync", "st.shared", "ld.shared",
                                                     "ldmatrix", "lop3.b32", "cp.async")}})  # fmt: skip
    return stats


def profile(fn, path: Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop sweeping after this long")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    config = rank_config(False)
    tensors, _, _, width = make_weights(config, device, dtype, gen)
    experts, hidden, k = config.n_routed_experts, config.hidden_size, config.num_experts_per_tok
    ceilings = measure_ceilings(False)
    expert_bytes = packed_expert_bytes(hidden, width)

    def case(kind, tokens, seed):
        g = torch.Generator().manual_seed(seed)
        ids, weights = routing(kind, tokens, experts, k, g)
        x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
        want = int4_moe(x.float(), ids.to(device), weights.to(device),
                        *[t if t.dtype == torch.int32 else t.float() for t in tensors], GROUP)  # fmt: skip
        return x, ids.to(device), weights.to(device), want

    rows_tensors = [repack_rows(t) if t.dtype == torch.int32 else t for t in tensors]

    def run(c, tuning):
        if tuning is DEFAULT_TUNING:
            return int4_moe_cuda(c[0], c[1], c[2], *tensors, GROUP, tuning=tuning)
        return int4_moe_cuda(c[0], c[1], c[2], *rows_tensors, GROUP, tuning=tuning, layout="rows")

    def error(c, tuning):
        got = run(c, tuning).float()
        return float((got - c[3]).norm() / c[3].norm())

    cases = {t: case("random", t, 100 + t) for t in (1, 33)}
    log = open(args.out_dir / "int4_rows_probe.log", "w")

    def emit(row):
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        log.flush()

    rows_grid = [Tuning(gate_n=64, down_n=128, programs_per_sm=4, stages=3, use_asm=a) for a in (False, True)]
    rows_grid += [Tuning(gate_n=gn, down_n=dn, programs_per_sm=ps, num_warps=4, stages=st)
                  for st, gn, dn, ps in itertools.product((3, 2), (32, 64), (32, 64, 128, 256), (4, 8))]  # fmt: skip
    results = []
    t0 = time.time()
    for tuning in [DEFAULT_TUNING] + rows_grid:
        if time.time() - t0 > args.budget_s:
            emit({"stopped": "budget", "left": len(rows_grid)})
            break
        try:
            errs = {t: error(c, tuning) for t, c in cases.items()}
            times = {t: graph_time_us(lambda c=c, u=tuning: run(c, u), device, False) for t, c in cases.items()}
        except Exception as err:  # noqa: BLE001 - a shape that does not compile is reported, the sweep goes on
            emit({**vars(tuning), "failed": f"{type(err).__name__}: {str(err)[:300]}"})
            continue
        row = {**vars(tuning), "form": "tiles" if tuning is DEFAULT_TUNING else "rows", "err_T1": errs[1],
               "err_T33": errs[33], "T1_us": times[1], "T33_us": times[33],
               "geomean_us": math.sqrt(times[1] * times[33])}  # fmt: skip
        results.append(row)
        emit(row)
    good = [r for r in results if r["form"] == "rows" and max(r["err_T1"], r["err_T33"]) < 1e-2]
    table = []
    if good:
        best = min(good, key=lambda r: r["geomean_us"])
        best_tuning = Tuning(**{f: best[f] for f in vars(DEFAULT_TUNING)})
        for tokens in (1, 33):
            profile(lambda c=cases[tokens]: run(c, best_tuning), args.out_dir / f"rows_profile_T{tokens}.txt")
        emit({"best": vars(best_tuning)})
        for kind in ("random", "skewed"):
            for tokens in (1, 8, 16, 33, 128):
                c = case(kind, tokens, 1000 + tokens)
                distinct = int(c[1].unique().numel())
                floor_us = distinct * expert_bytes / ceilings["copy_Bps"] * 1e6
                row = {"routing": kind, "tokens": tokens, "distinct": distinct, "floor_us": floor_us}
                for name, tuning in (("tiles", DEFAULT_TUNING), ("rows", best_tuning)):
                    row[f"{name}_err"] = error(c, tuning)
                    row[f"{name}_us"] = graph_time_us(lambda c=c, t=tuning: run(c, t), device, False)
                row["rows_over_floor"] = row["rows_us"] / floor_us
                table.append(row)
                emit(row)
    result = {"environment": environment(False), "ceilings": ceilings, "sweep": results, "table": table,
              "compiled": compiled_stats()}  # fmt: skip
    (args.out_dir / "int4_rows_probe.json").write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
