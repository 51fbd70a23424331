"""Why an isolated forward is faster than the same forward in a decode loop: one Kimi TP-8 rank's T=1 (and T=33)
target forward, captured in a CUDA graph, timed per replay (CUDA events) when replays run back to back, with the GPU
idle for a while between them (`torch.cuda._sleep`), and after an L2 flush (what `triton.testing.do_bench` does).
The SM / memory clocks and power are sampled by nvidia-smi during each run.

    PYTHONPATH=. python3 benchmarks/replay_spacing.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from benchmarks.gpu_runtime import benchmark_ops, scaled_models, tree_mask
from models.random_weights import random_rank_models
from runner.cuda_graphs import capture_graph


def sampled(fn) -> tuple[object, dict]:
    """fn() while nvidia-smi samples clocks and power every 20 ms; the medians."""
    query = "clocks.sm,clocks.mem,power.draw"
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits", "-lms", "20"],
                           stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(0.2)
    try:
        result = fn()
    finally:
        smi.terminate()
    rows = [line.split(",") for line in smi.communicate()[0].splitlines() if line.count(",") == 2]
    values = [[float(v) for v in row] for row in rows[10:]] or [[float("nan")] * 3]
    return result, {name: statistics.median(v[i] for v in values) for i, name in enumerate(query.split(","))}


def per_replay_ms(replay, count: int, between=None) -> float:
    times = []
    for _ in range(count):
        if between is not None:
            between()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def main() -> int:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    device, dtype = torch.device("cuda"), torch.bfloat16
    target_cfg, drafter_cfg = scaled_models("kimi-rank", False)
    target, _ = random_rank_models(target_cfg, drafter_cfg, benchmark_ops(False), device, dtype, seed=3)
    length, capacity = 256, 1024
    cache = (torch.randn(target_cfg.num_hidden_layers, capacity, target_cfg.latent_dim, device=device) * 0.5).to(dtype)
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device=device)
    results = {"date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "runs": {}}
    for tokens in (1, 33):
        ids = torch.randint(0, 1000, (tokens,), device=device)
        mask = tree_mask(tokens, device)
        args = (ids, length + mask.sum(-1) - 1, mask, cache, torch.tensor([length], device=device),
                torch.arange(tokens, device=device))  # fmt: skip
        with torch.no_grad():
            graph, _ = capture_graph(lambda a=args: target(*a), device, warmups=2)
        ways = {
            "back to back": None,
            "after an L2 flush": flush.zero_,
            "after 50 us idle": lambda: torch.cuda._sleep(50_000),
            "after 500 us idle": lambda: torch.cuda._sleep(500_000),
        }
        for name, between in ways.items():
            per_replay_ms(graph.replay, 5, between)  # warm
            ms, clocks = sampled(lambda b=between, g=graph: per_replay_ms(g.replay, 60, b))
            results["runs"][f"T={tokens} {name}"] = {"ms": ms, **clocks}
            print(f"T={tokens} {name:18s}: {ms * 1e3:8.1f} us a replay (median of 60), clocks {clocks}", flush=True)
    (out / "replay_spacing.json").write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
