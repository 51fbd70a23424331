"""Lossless on the GPU: greedy speculative output == greedy autoregressive output, token for token, in float32.

    PYTHONPATH=. python3 benchmarks/gpu_lossless.py OUT_DIR [--smoke]

The "moe" preset in float32, ranks from the rank factory (the GPU forms: the TreeAttention and drafter kernels in
exact fp32, the gathered MoE, which the factory picks outside bf16; a CUDA graph per profile): autoregressive vs
DFlash chain vs DDTree budgets 8 and 32 (random drafter), 128 tokens from 3 prompts, on the host loop and on the
device loop (one graph a step, queued ahead). In bf16 the two orders of computation round differently and MoE
routing turns that into different experts, so greedy paths part after a few tokens; float32 shows the pipeline
itself is exact.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from benchmarks.common import Setup, environment, preset_ranks
from engines.spec import SpecConfig
from runner.factory import PresetWeights

SPECS = (("dflash chain", SpecConfig(8, 7, 1)), ("ddtree 8", SpecConfig(8, 8)), ("ddtree 32", SpecConfig(8, 32)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU: checks the script")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    setup = Setup(args.smoke, torch.device("cpu" if args.smoke else "cuda"), torch.float32, 1)
    weights = PresetWeights("moe", torch.float32, seed=3, smoke=args.smoke)
    vocab = weights.preset.target.vocab_size
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, vocab - 2, (n,), generator=gen).tolist() for n in (64, 17, 100)]
    tokens = 48 if args.smoke else 128
    rows = []
    with torch.no_grad():
        reference = preset_ranks(weights, setup, SpecConfig(8, 32), device_loop=False, autoregressive=True)
        expected = [reference.generate(p, tokens).tokens for p in prompts]
        reference.ranks.close()
        runs = [
            (f"{name}{suffix}", spec, loop, False)
            for name, spec in SPECS
            for suffix, loop in (("", False), (" (device loop)", True))
        ] + [("autoregressive (device loop)", SPECS[-1][1], True, True)]
        for name, spec, device_loop, autoregressive in runs:
            generator = preset_ranks(weights, setup, spec, device_loop, autoregressive)
            equal = [generator.generate(p, tokens).tokens == e for p, e in zip(prompts, expected)]
            rows.append({"mode": name, "printed_mode": generator.mode(), "equal_to_autoregressive": equal})
            print(f"{name} ({generator.mode()}): greedy == autoregressive for {tokens} tokens: {equal}", flush=True)
            generator.ranks.close()  # frees the device loop's graphs and pinned slots before the next ranks
    ok = all(all(r["equal_to_autoregressive"]) for r in rows)
    result = {**environment(args.smoke), "dtype": "float32", "tokens": tokens, "rows": rows, "pass": ok}
    (args.out_dir / "gpu_lossless.json").write_text(json.dumps(result, indent=1))
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
