"""Chunked prefill: one long prompt's prefill with the whole prompt in one forward and in chunks (`RankOptions.
chunked_prefill_size`, the CLI's --chunked_prefill_size): peak memory above the built ranks, time, and the logits
against the whole prompt's.

    PYTHONPATH=. python3 benchmarks/chunked_prefill.py OUT_DIR [--device cpu|cuda] [--prompt 4096]
        [--chunks 0,512,2048] [--repeats 3]

The trained pair (`trained/`) at TP-1 through the rank factory (the CLI's forms for the device), float32 on the CPU
and bf16 on a GPU, ranks built for the prompt plus 64 tokens; a random prompt. Each chunk size runs in its own
process, so the peak is its own: on the CPU the peak resident set (VmHWM) minus the resident set once the ranks
are built and warm, on a GPU torch's peak allocated bytes minus the allocated bytes before the timed prefills.
Time: median of --repeats prefills (the cache reset between them). Writes OUT_DIR/chunked_prefill.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import environment


def status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measure(ckpt: Path, device: str, prompt_len: int, chunk: int, repeats: int) -> dict:
    """One chunk size, in this process."""
    import torch

    from engines.spec import BuildConfig, SpecConfig
    from runner.factory import CheckpointWeights, RankOptions, local_ranks

    build = BuildConfig(max_input_len=prompt_len, max_seq_len=prompt_len + 64)
    options = RankOptions("torch", device, False, chunked_prefill_size=chunk)
    ranks = local_ranks(CheckpointWeights(ckpt), options, SpecConfig(8, 32), build)
    prompt = torch.randint(0, 4000, (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    cuda = device == "cuda"
    with torch.no_grad():
        ranks.prefill(prompt[:64])  # warm-up: first calls, allocations of the small shapes
        ranks.reset()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            base = status_bytes("VmRSS")
        times, logits = [], None
        for _ in range(repeats):
            start = time.perf_counter()
            logits = ranks.prefill(prompt)
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            ranks.reset()
        peak = torch.cuda.max_memory_allocated() if cuda else status_bytes("VmHWM")
    ranks.close()
    return {"chunk": chunk, "prefill_ms": statistics.median(times) * 1e3, "times_ms": [t * 1e3 for t in times],
            "peak_above_ranks_bytes": peak - base, "logits": logits.float().cpu().flatten().tolist()}  # fmt: skip


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--prompt", type=int, default=4096, help="prompt tokens")
    parser.add_argument("--chunks", default="0,512,2048", help="chunk sizes (0: the whole prompt in one forward)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a worker process: one chunk size
    parser.add_argument("--ckpt", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one is not None:
        row = measure(args.ckpt, args.device, args.prompt, args.one, args.repeats)
        print("ROW " + json.dumps(row), flush=True)
        return 0
    import numpy as np

    from benchmarks.acceptance import convert_pair

    args.out_dir.mkdir(parents=True, exist_ok=True)
    dtype = "float32" if args.device == "cpu" else "bfloat16"
    info = {**environment(False), "command": " ".join(sys.argv), "prompt": args.prompt,
            "device": args.device, "dtype": dtype, "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = convert_pair(Path(tmp) / "ckpt", dtype)
        rows = []
        for chunk in (int(c) for c in args.chunks.split(",")):
            done = subprocess.run([sys.executable, __file__, str(args.out_dir), "--device", args.device, "--prompt",
                                   str(args.prompt), "--repeats", str(args.repeats), "--one", str(chunk), "--ckpt",
                                   str(ckpt)], capture_output=True, text=True)  # fmt: skip
            lines = [line for line in done.stdout.splitlines() if line.startswith("ROW ")]
            if done.returncode != 0 or not lines:
                raise RuntimeError(f"chunk {chunk} failed:\n{done.stderr[-3000:]}")
            rows.append(json.loads(lines[-1][4:]))
    whole = np.array(rows[0]["logits"])
    for row in rows:
        got = np.array(row.pop("logits"))
        row["max_abs_logit_difference"] = float(np.abs(got - whole).max())
        print(f"chunk {row['chunk']:6d}: prefill {row['prefill_ms']:9.1f} ms, peak above the ranks "
              f"{row['peak_above_ranks_bytes'] / 2**20:8.1f} MiB, max |logit - whole| "
              f"{row['max_abs_logit_difference']:.2e}", flush=True)  # fmt: skip
    info["rows"] = rows
    (args.out_dir / "chunked_prefill.json").write_text(json.dumps(info, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
