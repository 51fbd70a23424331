"""What load shape reads a decode's INT4 expert words at the copy rate: a Triton kernel that only loads the gate and up
words of the 8 experts one token chose (Kimi K2.x per-rank TP-8: 384 experts, 2 x 256 rows of 896 int32 words each,
14.7 MB for the 8) and folds them into one word a program, swept over rows a program, words a step, K splits,
software-pipeline stages and warps; its rate against the device-to-device copy rate of the same run.

    PYTHONPATH=. python3 benchmarks/int4_load_probe.py OUT_DIR [--smoke]

The W4A16 kernel's one-token form reads these words at about 1 TB/s (BENCHMARKS.md, section 8: a load-only kernel of
one word a thread a step moved them at 1.0-1.1 TB/s), where the floor asks for the copy rate: this says which shape
of loads gets there, before any arithmetic is added. Each shape's fold (xor of its words) is checked against numpy.
--smoke: small dimensions under the Triton interpreter on the CPU (TRITON_INTERPRET=1), checks only.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path

import numpy as np
import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import environment, graph_time_us, measure_ceilings  # noqa: E402

KIMI = {"experts": 384, "rows": 512, "words": 896, "chosen": 8}  # gate and up stacked: 2 x 256 rows, hidden 7168 / 8
SMOKE = {"experts": 12, "rows": 32, "words": 96, "chosen": 3}
SHAPES = {  # rows a program, words a step, K splits, stages, warps (132 shapes run, a compile each)
    "rows": (8, 16, 32),
    "words": (64, 128, 256),
    "splits": (1, 2, 4, 8),
    "stages": (1, 3),
    "warps": (4, 8),
}
SMOKE_SHAPES = {"rows": (8, 16), "words": (16, 32), "splits": (1, 3), "stages": (1,), "warps": (1,)}


@triton.jit
def _fold_words(words_ptr, ids_ptr, out_ptr, expert_stride, row_stride, WORDS: tl.constexpr, BLOCK_R: tl.constexpr,
                BLOCK_W: tl.constexpr, W_PER_SPLIT: tl.constexpr, STAGES: tl.constexpr):  # fmt: skip
    """Program (pair, rows, split): the xor of its expert's words in rows [tile * BLOCK_R, +BLOCK_R) and words
    [split * W_PER_SPLIT, +W_PER_SPLIT), BLOCK_W words a row a step."""
    pair, tile, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    expert = tl.load(ids_ptr + pair).to(tl.int64)
    rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
    base = words_ptr + expert * expert_stride + rows[:, None] * row_stride
    acc = tl.zeros((BLOCK_R, BLOCK_W), dtype=tl.int32)
    start = split * W_PER_SPLIT
    for w0 in tl.range(start, start + W_PER_SPLIT, BLOCK_W, num_stages=STAGES):
        offs = w0 + tl.arange(0, BLOCK_W)
        ok = (offs < WORDS) & (offs < start + W_PER_SPLIT)
        acc ^= tl.load(base + offs[None, :], mask=ok[None, :], other=0)
    program = (pair * tl.num_programs(1) + tile) * tl.num_programs(2) + split
    tl.store(out_ptr + program, tl.xor_sum(tl.xor_sum(acc, 1), 0))


def fold(words: torch.Tensor, ids: torch.Tensor, out: torch.Tensor, rows: int, block_w: int, splits: int,
         stages: int, warps: int) -> None:  # fmt: skip
    experts, total_rows, total_words = words.shape
    per_split = triton.cdiv(triton.cdiv(total_words, splits), block_w) * block_w
    grid = (ids.numel(), total_rows // rows, splits)
    _fold_words[grid](words, ids, out, words.stride(0), words.stride(1), WORDS=total_words, BLOCK_R=rows,
                      BLOCK_W=block_w, W_PER_SPLIT=per_split, STAGES=stages, num_warps=warps)  # fmt: skip


def expected_folds(words: np.ndarray, ids: np.ndarray, rows: int, block_w: int, splits: int) -> np.ndarray:
    per_split = triton.cdiv(triton.cdiv(words.shape[2], splits), block_w) * block_w
    out = []
    for expert in ids:
        for tile in range(words.shape[1] // rows):
            for split in range(splits):
                part = words[expert, tile * rows : (tile + 1) * rows, split * per_split : (split + 1) * per_split]
                out.append(np.bitwise_xor.reduce(part.reshape(-1)) if part.size else 0)
    return np.array(out, dtype=np.int32)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="small dimensions under the interpreter: checks only")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    dims, shapes = (SMOKE, SMOKE_SHAPES) if args.smoke else (KIMI, SHAPES)
    device = torch.device("cpu" if args.smoke else "cuda")
    gen = torch.Generator().manual_seed(0)
    words = torch.randint(-(2**31), 2**31 - 1, (dims["experts"], dims["rows"], dims["words"]), generator=gen,
                          dtype=torch.int32)  # fmt: skip
    ids = torch.randperm(dims["experts"], generator=gen)[: dims["chosen"]].to(torch.int32)
    host_words, host_ids = words.numpy(), ids.numpy()
    words, ids = words.to(device), ids.to(device)
    moved = dims["chosen"] * dims["rows"] * dims["words"] * 4
    ceilings = measure_ceilings(args.smoke)
    info = {**environment(args.smoke), "command": " ".join(sys.argv), "dims": dims, "bytes": moved,
            "copy_GBps": ceilings["copy_Bps"] / 1e9, "rows": []}  # fmt: skip
    floor_us = moved / ceilings["copy_Bps"] * 1e6
    for rows, block_w, splits, stages, warps in itertools.product(*shapes.values()):
        if rows > dims["rows"] or block_w * splits > 2 * dims["words"]:
            continue
        out = torch.empty(dims["chosen"] * (dims["rows"] // rows) * splits, dtype=torch.int32, device=device)
        row = {"rows": rows, "words": block_w, "splits": splits, "stages": stages, "warps": warps}
        run = functools.partial(fold, words, ids, out, rows, block_w, splits, stages, warps)
        try:
            run()
            row["correct"] = bool(np.array_equal(out.cpu().numpy(), expected_folds(host_words, host_ids, rows,
                                                                                  block_w, splits)))  # fmt: skip
            if not args.smoke:
                us = graph_time_us(run, device, False)
                row.update(us=us, GBps=moved / us / 1e3, x_floor=us / floor_us)
        except Exception as error:  # a shape that does not compile is reported, not fatal
            row["error"] = str(error)[:200]
        info["rows"].append(row)
        print(json.dumps(row), flush=True)
    timed = [r for r in info["rows"] if "us" in r and r["correct"]]
    for r in sorted(timed, key=lambda r: r["us"])[:10]:
        print(
            f"best: {r['us']:.1f} us, {r['GBps']:.0f} GB/s ({r['x_floor']:.2f}x the copy rate's {floor_us:.1f} us): "
            f"rows {r['rows']}, words {r['words']}, splits {r['splits']}, stages {r['stages']}, warps {r['warps']}"
        )
    print(f"{len(info['rows'])} shapes, correct: {all(r.get('correct') for r in info['rows'])}")
    (args.out_dir / "int4_load_probe.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0 if all(r.get("correct") for r in info["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
