"""The device sampler's cost on the GPU, one draw of R rows over a V-token vocabulary, in a CUDA graph: the
Gumbel-max draw as one Triton kernel against the same draw as tensor ops, the whole `sample_tokens` without a
filter, with top-p alone (sort-free on GPUs) and with top-p through the sort, and greedy argmax for reference; plus
how many rows' tokens the two draws, and the two top-p forms, agree on.

    PYTHONPATH=. python3 benchmarks/sampling_speed.py OUT_DIR      (one GPU)
    PYTHONPATH=. python3 benchmarks/sampling_speed.py OUT_DIR --smoke      (the CPU, tensor ops only: checks the script)

V = 20480 is one TP-8 rank's vocabulary shard of Kimi K2.x (163840 / 8), V = 163840 the whole vocabulary (what every
rank samples from after the head's all-gather); R = 1 (a decode), 9 and 33 (verifies of budget 8 and 32).
Writes OUT_DIR/sampling_speed.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import environment, graph_time_us
from runner.device.sampling import gumbel_argmax, gumbel_argmax_tensor_ops, sample_tokens, sampling_tensors
from runner.sampling import SamplingParams


def shape_row(r: int, v: int, device: torch.device, smoke: bool, plain: dict, nucleus: dict) -> dict:
    logits = torch.randn(r, v, generator=torch.Generator().manual_seed(r + v)).mul(3).to(device, torch.bfloat16)
    scores, seed = logits.float(), plain["seed"]
    counter = torch.ones(1, dtype=torch.long, device=device)
    kernel, ops = gumbel_argmax(scores, seed, counter), gumbel_argmax_tensor_ops(scores, seed, counter)
    top_p, top_p_sort = (sample_tokens(logits, **nucleus, counter=counter, filter=f) for f in ("top_p", "sort"))
    times = {
        "draw_kernel_us": lambda: gumbel_argmax(scores, seed, counter),
        "draw_tensor_ops_us": lambda: gumbel_argmax_tensor_ops(scores, seed, counter),
        "sample_temperature_us": lambda: sample_tokens(logits, **plain, counter=counter, filter="none"),
        "sample_top_p_us": lambda: sample_tokens(logits, **nucleus, counter=counter, filter="top_p"),
        "sample_top_p_sort_us": lambda: sample_tokens(logits, **nucleus, counter=counter, filter="sort"),
        "greedy_argmax_us": lambda: logits.argmax(dim=-1),
    }
    return {"rows": r, "vocab": v, "same_tokens": int((kernel == ops).sum()),
            "same_tokens_top_p": int((top_p == top_p_sort).sum()),
            **{name: graph_time_us(fn, device, smoke) for name, fn in times.items()}}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cpu" if args.smoke else "cuda")
    started, rows = time.time(), []
    shapes = [(1, 512), (33, 512)] if args.smoke else [(r, v) for v in (20480, 163840) for r in (1, 9, 33)]
    plain, nucleus = (sampling_tensors(SamplingParams(1.0, top_p=p, seed=5), device) for p in (1.0, 0.95))
    for r, v in shapes:
        rows.append(shape_row(r, v, device, args.smoke, plain, nucleus))
        print(json.dumps(rows[-1]), flush=True)
    result = {**environment(args.smoke), "command": " ".join(sys.argv), "seconds": time.time() - started, "rows": rows}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "sampling_speed.json").write_text(json.dumps(result, indent=1) + "\n")
    print("\n| R | V | draw: kernel (µs) | draw: tensor ops (µs) | sample, temperature (µs) | sample, top-p 0.95 (µs) "
          "| top-p 0.95 by sort (µs) | greedy argmax (µs) | same tokens (draw; top-p) |\n"
          "|---:|---:|---:|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    for r in rows:
        print(
            f"| {r['rows']} | {r['vocab']} | {r['draw_kernel_us']:.1f} | {r['draw_tensor_ops_us']:.1f} | "
            f"{r['sample_temperature_us']:.1f} | {r['sample_top_p_us']:.1f} | {r['sample_top_p_sort_us']:.1f} | "
            f"{r['greedy_argmax_us']:.1f} | {r['same_tokens']}/{r['rows']}; {r['same_tokens_top_p']}/{r['rows']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
