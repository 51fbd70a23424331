"""Lossless on the GPU: greedy speculative output == greedy autoregressive output, token for token, in float32.

    PYTHONPATH=. python3 benchmarks/gpu_lossless.py OUT_DIR [--preset moe] [--context-rows 0] [--smoke]

The "moe" preset in float32, ranks from the rank factory (the GPU forms: the TreeAttention and drafter kernels in
exact fp32, the gathered MoE, which the factory picks outside bf16; a CUDA graph per profile): autoregressive vs
DFlash chain vs DDTree budgets 8 and 32 (random drafter), 128 tokens from 3 prompts, on the host loop and on the
device loop (one graph a step, queued ahead). In bf16 the two orders of computation round differently and MoE
routing turns that into different experts, so greedy paths part after a few tokens; float32 shows the pipeline
itself is exact. --context-rows N starts every request after N cached rows of seeded random K/V (`runner/probes.py`,
as `kimi_rank_int4.py --synthetic-context` does): the long-context kernels' paths (split key blocks over tens of
thousands of rows) checked the same way, against the device loop's autoregressive run (the rows are a device-loop
probe); --preset picks the model (for example kimi-rank: 61 layers).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.common import BUILD, Setup, environment, preset_ranks
from engines.spec import BuildConfig, SpecConfig
from runner.factory import PresetWeights
from runner.probes import Probes

SPECS = (("dflash chain", SpecConfig(8, 7, 1)), ("ddtree 8", SpecConfig(8, 8)), ("ddtree 32", SpecConfig(8, 32)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--preset", default="moe", help="the model preset (models/presets.py)")
    parser.add_argument("--context-rows", type=int, default=0, help="random cached rows before every prompt")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    args = parser.parse_args(argv)
    if args.context_rows < 0:
        parser.error(f"--context-rows: expected 0 or more cached rows, got {args.context_rows}")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    setup = Setup(args.smoke, torch.device("cpu" if args.smoke else "cuda"), torch.float32, 1)
    weights = PresetWeights(args.preset, torch.float32, seed=3, smoke=args.smoke)
    vocab = weights.preset.target.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab - 2, (n,), generator=gen).tolist() for n in (64, 17, 100)]
    tokens = 48 if args.smoke else 128
    probes = Probes(context_rows=args.context_rows) if args.context_rows else None
    # the caches hold the synthetic rows, the longest prompt, its tokens and a step's spare rows
    limits = BuildConfig(128, args.context_rows + 128 + tokens + 64) if args.context_rows else BUILD
    ranks = {"probes": probes, "limits": limits}
    rows = []
    # the synthetic rows are a device-loop probe: with them the reference is the device loop's autoregressive run
    loops = (("", False), (" (device loop)", True)) if not args.context_rows else ((" (device loop)", True),)
    with torch.no_grad():
        reference = preset_ranks(weights, setup, SpecConfig(8, 32), bool(args.context_rows), True, **ranks)
        expected = [reference.generate(p, tokens).tokens for p in prompts]
        reference.ranks.close()
        runs = [(f"{name}{suffix}", spec, loop, False) for name, spec in SPECS for suffix, loop in loops]
        if not args.context_rows:
            runs.append(("autoregressive (device loop)", SPECS[-1][1], True, True))
        for name, spec, device_loop, autoregressive in runs:
            generator = preset_ranks(weights, setup, spec, device_loop, autoregressive, **ranks)
            equal = [generator.generate(p, tokens).tokens == e for p, e in zip(prompts, expected)]
            rows.append({"mode": name, "printed_mode": generator.mode(), "equal_to_autoregressive": equal})
            print(f"{name} ({generator.mode()}): greedy == autoregressive for {tokens} tokens: {equal}", flush=True)
            generator.ranks.close()  # frees the device loop's graphs and pinned slots before the next ranks
    ok = all(all(r["equal_to_autoregressive"]) for r in rows)
    result = {
        **environment(args.smoke),
        "dtype": "float32",
        "preset": args.preset,
        "context_rows": args.context_rows,
        "tokens": tokens,
        "rows": rows,
        "pass": ok,
    }
    (args.out_dir / "gpu_lossless.json").write_text(json.dumps(result, indent=1))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
